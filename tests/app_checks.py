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
