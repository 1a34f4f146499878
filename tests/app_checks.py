"""Shared by the dashboard's AppTest tests (tests/test_app*.py, with the ``home`` fixture
of conftest.py): where the app is, the no-exception check, blank missing cells."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from streamlit.testing.v1 import AppTest

ROOT = Path(__file__).resolve().parents[1]
HOME = str(ROOT / "app" / "Home.py")
TIMEOUT = 120


def no_exception(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]


#: What a table cell must never read for a value a run did not log (issue 46).
MISSING_TEXTS = {"None", "none", "nan", "NaN", "<NA>", "NaT", "null", "–"}


def blank_when_missing(at: AppTest) -> int:
    """Every table on the page shows a missing value as a blank cell: the grid is told to
    draw ``None``/NaN as ``""`` (``placeholder``; without it Streamlit's grid writes
    "None"), and no cell carries the missing value as text. Returns how many cells are
    missing (drawn blank), for the caller to check there were some."""
    missing = 0
    for table in at.dataframe:
        assert table.proto.HasField("placeholder") and table.proto.placeholder == "", \
            f"table {table.proto.id}: missing values would read 'None'"
        frame = table.value
        for column in frame.columns:
            for cell in frame[column]:
                if isinstance(cell, str):
                    assert cell.strip() not in MISSING_TEXTS, (column, cell)
                elif pd.api.types.is_scalar(cell) and pd.isna(cell):
                    missing += 1
    return missing


def tile_rows(at: AppTest) -> list[list[str]]:
    """The rows of metric tiles on the page, in order: per row of columns holding a tile,
    the label of each column's tile ("" for a column without one)."""
    from streamlit.testing.v1.element_tree import Block, Column, Metric

    rows: list[list[str]] = []

    def walk(node: Block) -> None:
        kids = list(node.children.values())
        if kids and all(isinstance(k, Column) for k in kids) and any(
                isinstance(e, Metric) for k in kids for e in k.children.values()):
            rows.append([next((e.label for e in k.children.values() if isinstance(e, Metric)),
                              "") for k in kids])
        for k in kids:
            if isinstance(k, Block):
                walk(k)

    walk(at.main)
    return rows


def page_figures(at: AppTest) -> dict[str, dict]:
    """Every chart on the page as a Plotly figure dict, by its key: the Plotly charts
    and the Live page's in-place charts (``app.lib.livechart``)."""
    import json

    from app.lib.livechart import figure_of

    out = {c.proto.id: json.loads(c.proto.spec) for c in at.get("plotly_chart")}
    out.update({e.proto.id: figure_of(e.proto.json_args) for e in at.get("component_instance")
                if e.proto.component_name.endswith("live_chart")})
    return out


def tick_value(text: str) -> float:
    """A log axis's tick label as the figure it states: ``"20k"`` -> 20000."""
    scale = {"k": 1e3, "M": 1e6, "G": 1e9}
    return float(text[:-1]) * scale[text[-1]] if text[-1:] in scale else float(text)


def log_axes(figures: dict[str, dict]) -> dict[str, dict]:
    """The log axes of these figures, by ``"<figure key> <axis>"``."""
    return {f"{key} {name}": axis for key, fig in figures.items()
            for name, axis in (fig.get("layout") or {}).items()
            if name.startswith(("xaxis", "yaxis")) and isinstance(axis, dict)
            and axis.get("type") == "log"}


def unlabelled_log_axes(figures: dict[str, dict]) -> list[str]:
    """The log axes that Plotly would label itself ("9 10 2 3": the minor digits of a
    decade): those without their own tick values, or with a label that is not the whole
    figure at its tick (``"20k"`` at 20000)."""
    bad = []
    for where, axis in log_axes(figures).items():
        vals, texts = axis.get("tickvals"), axis.get("ticktext")
        if not vals or not texts or len(vals) != len(texts) or any(
                abs(tick_value(t) - v) > 1e-6 * v for v, t in zip(vals, texts)):
            bad.append(where)
    return bad
