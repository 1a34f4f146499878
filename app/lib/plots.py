"""Plotly figures for the dashboard (one look across pages)."""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from typing import Any

import plotly.graph_objects as go
import plotly.io as pio

from app.lib.fmt import metric_label
from comera_engine.metrics import PERCENT_METRICS, SCOPE_LABELS

COLORS = [
    "#4F46E5",  # indigo
    "#F97316",  # orange
    "#10B981",  # emerald
    "#E11D48",  # rose
    "#0EA5E9",  # sky
    "#A855F7",  # purple
    "#84CC16",  # lime
    "#64748B",  # slate
]
TARGET_COLOR = "#E11D48"
STAGE_COLOR = "#94A3B8"
#: Plotly's "Viridis", as the colour stops Plotly writes for the name
VIRIDIS = [list(stop) for stop in go.Heatmap(colorscale="Viridis").colorscale]

#: Every chart's template, set once as Plotly's default in the dashboard's process: named
#: in each figure's layout, Plotly validated the whole template again, about 15 ms a
#: figure (the Live page rebuilds eight every second). The figures' JSON is the same.
pio.templates.default = "plotly_white"


#: A horizontal legend at the bottom of the figure (below the x axis title): placed on
#: the container, it pushes the plot up by its own height.
LEGEND_BELOW = {"orientation": "h", "yref": "container", "yanchor": "bottom", "y": 0.0,
                "xanchor": "left", "x": 0.0, "font": {"size": 11}}
#: The same, centred under the plot (the charts whose legends are long)
LEGEND_CENTRED = {**LEGEND_BELOW, "x": 0.5, "xanchor": "center"}

#: Every chart's Plotly tool bar (shown on hover) down the figure's right edge, about
#: 25 px wide: across the top (Plotly's default) it is about 220 px wide, over the title
#: of a chart in two or three columns at 1024 px. A title left-aligned (:func:`look`) is
#: clear of it while the title fits beside it.
MODEBAR = {"orientation": "v"}

#: A figure as Plotly's JSON would have it, ``{"data": [trace, …], "layout": {…}}``: the
#: Live page draws these every second without building (and validating) a
#: ``go.Figure`` each time (about 20 ms a chart); the other pages wrap the same spec in a
#: ``go.Figure``. Valid Plotly, unchanged by Plotly's validation (tested).
Spec = dict[str, Any]


def look(title: str | None = None, height: int = 300, x_title: str | None = None,
         y_title: str | None = None) -> dict[str, Any]:
    """The layout every chart shares. The title sits alone at the top of the figure, from
    its left edge, and Plotly's tool bar (shown on hover) stands down the right edge
    (:data:`MODEBAR`): drawn across the top, it covered the title of a narrow chart. The
    legend sits at the bottom, under the x axis, in as many rows as it needs, each pushing
    the plot in as far as it needs (``automargin``, a legend placed on the container): a
    long legend never runs over the title or the axis."""
    layout: dict[str, Any] = {
        "height": height, "margin": {"l": 10, "r": 10, "t": 40 if title else 10, "b": 10},
        "colorway": list(COLORS), "legend": dict(LEGEND_BELOW), "hovermode": "x unified",
        "modebar": dict(MODEBAR), "font": {"size": 12}}
    if title:
        layout["title"] = {"text": title, "x": 0.0, "xanchor": "left", "font": {"size": 15},
                           "automargin": True, "yref": "container", "y": 1.0,
                           "yanchor": "top", "pad": {"t": 10, "b": 6}}
    if x_title:
        layout["xaxis"] = {"title": {"text": x_title}}
    if y_title:
        layout["yaxis"] = {"title": {"text": y_title}}
    return layout


def _axis(layout: dict[str, Any], name: str, **props: Any) -> None:
    """Set properties of the layout's axis ``name`` (``"xaxis"``, ``"yaxis"``)."""
    layout.setdefault(name, {}).update(props)


def base_layout(fig: go.Figure, title: str | None = None, height: int = 300,
                x_title: str | None = None, y_title: str | None = None) -> go.Figure:
    """:func:`look` applied to ``fig`` (the axis titles to all its x / y axes)."""
    fig.update_layout(look(title, height))
    if x_title:
        fig.update_xaxes(title_text=x_title)
    if y_title:
        fig.update_yaxes(title_text=y_title)
    return fig


def empty_spec(message: str, height: int = 300, title: str | None = None) -> Spec:
    """No axes, ``message`` in the middle."""
    layout = look(title, height)
    layout["annotations"] = [{"text": message, "showarrow": False,
                              "font": {"size": 13, "color": "#64748B"},
                              "xref": "paper", "yref": "paper", "x": 0.5, "y": 0.5}]
    layout["xaxis"] = {"visible": False}
    layout["yaxis"] = {"visible": False}
    return {"data": [], "layout": layout}


def empty_figure(message: str, height: int = 300, title: str | None = None) -> go.Figure:
    return go.Figure(empty_spec(message, height, title))


def plain(text: Any) -> str:
    """``text`` (a run's name, which its owner types) as Plotly shows it literally: its
    labels read ``<b>``, ``<br>`` and ``&…;`` as markup, so they are escaped."""
    return html.escape(str(text), quote=False)


def mark_x(fig: go.Figure, x: float, text: str, color: str) -> go.Figure:
    """A dotted vertical line at ``x`` labelled ``text`` at its foot, on a linear or a log
    x axis: Plotly draws a shape at ``x`` on either, but places an annotation on a log
    axis at ``log10`` of its ``x`` (``add_vline``'s label lands at 10× the line)."""
    log = fig.layout.xaxis.type == "log"
    fig.add_shape(type="line", x0=x, x1=x, xref="x", y0=0, y1=1, yref="y domain",
                  line={"color": color, "dash": "dot", "width": 1})
    fig.add_annotation(x=math.log10(x) if log else x, xref="x", y=0, yref="y domain",
                       text=text, showarrow=False, xanchor="left", yanchor="bottom",
                       font={"size": 10, "color": color})
    return fig


def stage_markers(stages: Sequence[tuple[int, str]]) -> tuple[list[dict], list[dict]]:
    """A dotted vertical line at each stage switch and its label: ``(shapes,
    annotations)``, as Plotly's ``add_vline(annotation_position="top left")`` makes them."""
    shapes, notes = [], []
    for step, _text in stages:
        shapes.append({"type": "line", "x0": step, "x1": step, "xref": "x", "y0": 0, "y1": 1,
                       "yref": "y domain",
                       "line": {"color": STAGE_COLOR, "dash": "dot", "width": 1.5}})
        notes.append({"text": "late stage", "showarrow": False, "x": step, "xanchor": "right",
                      "xref": "x", "y": 1, "yanchor": "top", "yref": "y domain",
                      "font": {"size": 10, "color": "#64748B"}})
    return shapes, notes


def ema(values: Sequence[float | None], alpha: float) -> list[float | None]:
    """Exponential moving average that skips missing values (bias-corrected start)."""
    out: list[float | None] = []
    acc = 0.0
    weight = 0.0
    for v in values:
        if v is None or not math.isfinite(v):
            out.append(None)
            continue
        acc = (1 - alpha) * acc + alpha * v
        weight = (1 - alpha) * weight + alpha
        out.append(acc / weight)
    return out


#: one legend row's height, and the width a chart of a page's column leaves it (pixels)
LEGEND_ROW_PX, LEGEND_WIDTH_PX = 22, 520


def legend_rows(names: Sequence[str], width: int = LEGEND_WIDTH_PX) -> int:
    """About how many rows a horizontal legend of ``names`` takes in ``width`` pixels
    (an entry: its symbol and about 7 px a character): a chart grows by them, so a long
    legend below it does not squash the plot (6 runs' names left 71 px of a 300 px
    chart)."""
    rows, used = 0, width
    for name in names:
        w = 45 + 7 * len(name)
        if used + w > width:
            rows, used = rows + 1, 0
        used += w
    return rows


def lines_spec(series: Sequence[tuple[str, Sequence[float], Sequence[float]]], title: str,
               y_title: str | None = None, x_title: str = "step", height: int = 300,
               stages: Sequence[tuple[int, str]] = (), hline: tuple[float, str] | None = None,
               log_y: bool = False, markers: bool = False, empty: str = "No data yet",
               smooth: float | None = None, dashes: Sequence[str | None] = (),
               percent: bool = False, from_zero: bool = False) -> Spec:
    """Several ``(label, x, y)`` curves on one plot, with optional stage markers and a
    horizontal reference line ``(y, label)``. ``smooth``: draw each curve faintly and an
    exponential moving average (weight ``smooth``) over it (of the logarithms, on a
    ``log_y`` axis: a geometric mean, which follows the typical value). ``dashes``: line dash per
    curve (e.g. ``[None, "dash"]``). ``percent``: fractions drawn on a % axis (as the
    tiles state them); ``from_zero``: the y axis starts at 0 (a flat memory curve stays
    flat instead of a few MiB filling the plot). Missing and non-finite values are gaps."""
    data: list[dict[str, Any]] = []
    for i, (label, x, y) in enumerate(series):
        if not len(x):
            continue
        label = plain(label)
        color = COLORS[i % len(COLORS)]
        ys = [v if v is not None and math.isfinite(v) else None for v in y]
        few = len(x) < 3
        if smooth and len(x) > 20:
            data.append({"type": "scatter", "x": list(x), "y": ys, "name": label,
                         "mode": "lines", "line": {"width": 1, "color": color},
                         "opacity": 0.25, "showlegend": False, "hoverinfo": "skip"})
            if log_y:  # averaged as the axis reads it: a spike to 1000x the typical
                # loss would hold an average of the values far above every typical step
                logs = ema([math.log(v) if v is not None and v > 0 else None for v in ys],
                           smooth)
                ys = [math.exp(v) if v is not None else None for v in logs]
            else:
                ys = ema(ys, smooth)
        line: dict[str, Any] = {"width": 2, "color": color}
        if i < len(dashes) and dashes[i] is not None:
            line["dash"] = dashes[i]
        data.append({"type": "scatter", "x": list(x), "y": ys, "name": label,
                     "mode": "lines+markers" if markers or few else "lines", "line": line})
    if not data:
        return empty_spec(empty, height, title)
    names = [d["name"] for d in data if d.get("showlegend", True)]
    extra = max(0, legend_rows(names) - 1) if len(names) > 1 else 0  # beyond the first
    layout = look(title, height + LEGEND_ROW_PX * extra, x_title, y_title)
    shapes, notes = [], []
    if hline is not None:  # as add_hline(annotation_position="bottom right") makes it
        shapes.append({"type": "line", "x0": 0, "x1": 1, "xref": "x domain", "y0": hline[0],
                       "y1": hline[0], "yref": "y",
                       "line": {"color": TARGET_COLOR, "dash": "dash", "width": 2}})
        notes.append({"text": hline[1], "showarrow": False, "x": 1, "xanchor": "right",
                      "xref": "x domain", "y": hline[0], "yanchor": "top", "yref": "y",
                      "font": {"color": TARGET_COLOR, "size": 11}})
    more_shapes, more_notes = stage_markers(stages)
    if shapes or more_shapes:
        layout["shapes"] = shapes + more_shapes
        layout["annotations"] = notes + more_notes
    if log_y:
        _axis(layout, "yaxis", **log_axis(values=[v for _, _, y in series for v in y]))
    xs = [v for _, x, _ in series for v in x if isinstance(v, (int, float))]
    if x_title == "step" and xs and max(xs) - min(xs) < 10:
        _axis(layout, "xaxis", dtick=1)  # no half steps on a short run
    if percent:
        _axis(layout, "yaxis", tickformat=percent_ticks([v for _, _, y in series for v in y]),
              hoverformat=".1%")
    if from_zero:
        _axis(layout, "yaxis", rangemode="tozero")
    return {"data": data, "layout": layout}


def lines(*args: Any, **kwargs: Any) -> go.Figure:
    """:func:`lines_spec` as a ``go.Figure`` (same arguments)."""
    return go.Figure(lines_spec(*args, **kwargs))


def is_fraction(metric: str) -> bool:
    """A metric logged as a fraction that the pages state in % (accuracies)."""
    return metric in PERCENT_METRICS


def percent_ticks(values: Sequence[Any]) -> str:
    """The tick format of a percent axis over these fractions: as many decimals as the
    span needs for neighbouring ticks to differ (a sweep within 94-95 % used to read
    "95% 95% 95% 94%"). Span ``s`` in points: 0 decimals from 5, 1 from 0.5, else 2."""
    vals = [v for v in values if is_finite(v)]
    span = 100.0 * (max(vals) - min(vals)) if vals else 100.0
    return ".0%" if span >= 5 else ".1%" if span >= 0.5 else ".2%"


def legend_below(fig: go.Figure) -> go.Figure:
    """The legend under the plot, centred (the scatter charts, whose legends are long)."""
    fig.update_layout(legend=LEGEND_CENTRED, margin={"b": 10})
    return fig


#: The ticks of a log axis per decade, by how many decades its values span (more than
#: the first figure: at each decade; more than the second: at 1, 2 and 5; less: finer).
LOG_TICKS = ((2.5, (1.0,)), (math.log10(3), (1.0, 2.0, 5.0)),
             (0.0, (1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0)))


def log_axis(suffix: str = "", values: Sequence[Any] = ()) -> dict[str, Any]:
    """A log axis labelled at 1, 2 and 5 of each decade (at each decade only where
    ``values`` span more than 2.5 decades, finer where they span less than a factor 3),
    every label a whole figure in k / M / G (``"20k"``, ``"0.005"``), instead of Plotly's
    own labels, which on a log axis read "9 10 2 3" (the minor digits of a decade)."""
    pos = [float(v) for v in values if is_finite(v) and v > 0]
    span = math.log10(max(pos) / min(pos)) if pos else 1.0
    steps = next(m for least, m in LOG_TICKS if span > least or least == 0.0)
    vals = [m * 10.0**e for e in range(-6, 13) for m in steps]
    return {"type": "log", "tickvals": vals,
            "ticktext": [f"{fmt_tick(v)}{suffix}" for v in vals]}


def log_ticks(fig: go.Figure, axis: str = "x", suffix: str = "") -> None:
    """:func:`log_axis` on ``fig``'s ``axis`` (``"x"`` or ``"y"``), over the values its
    traces draw on that axis."""
    values = [v for trace in fig.data for v in (getattr(trace, axis, None) or ())]
    (fig.update_xaxes if axis == "x" else fig.update_yaxes)(**log_axis(suffix, values))


def fmt_tick(v: float) -> str:
    """A tick's label: ``20k``, ``5M``, ``0.002``, ``1e-05``."""
    for div, suf in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if v >= div:
            return f"{v / div:.3g}{suf}"
    return f"{v:.3g}"


def rank_rows(
    history: Sequence[Mapping[str, Any]], until: int | None = None,
) -> tuple[list[str], list[int], list[list[float | None]]]:
    """Heatmap data from rank snapshots: rows ``layer · bond k``; columns span the steps
    from one snapshot to the next (ranks are piecewise constant), the last one up to
    ``until`` (the run's current step). Returns ``(rows, edges, z)`` with
    ``len(edges) == columns + 1``."""
    steps = sorted({int(h["step"]) for h in history})
    end = max(int(until), steps[-1] + 1) if until else steps[-1] + 1
    edges = [*steps, end]
    layers: dict[str, int] = {}
    for h in history:
        layers[h["layer"]] = max(layers.get(h["layer"], 0), len(h["ranks"]))
    col = {s: i for i, s in enumerate(steps)}
    grid: dict[tuple[str, int], list[float | None]] = {
        (name, b): [None] * len(steps) for name, nb in layers.items() for b in range(nb)
    }
    for h in history:
        for b, r in enumerate(h["ranks"]):
            grid[(h["layer"], b)][col[int(h["step"])]] = float(r)
    rows, z = [], []
    for (name, b), vals in grid.items():
        last = None
        filled = []
        for v in vals:
            last = v if v is not None else last
            filled.append(last)
        rows.append(f"{name} · bond {b + 1}")
        z.append(filled)
    return rows, edges, z


def rank_heatmap_spec(history: Sequence[Mapping[str, Any]],
                      title: str = "Effective ranks over steps",
                      stages: Sequence[tuple[int, str]] = (), until: int | None = None) -> Spec:
    """Layer × bond rows, steps across; ``until``: extend the last ranks to this step."""
    if not history:
        return empty_spec("No rank snapshots yet", 320, title)
    rows, edges, z = rank_rows(history, until)
    height = int(min(900, max(280, 60 + 16 * len(rows))))
    layout = look(title, height, "step")
    _axis(layout, "yaxis", autorange="reversed", tickfont={"size": 10})
    _axis(layout, "xaxis", range=[edges[0], edges[-1]])
    shapes, notes = stage_markers(stages)
    if shapes:
        layout.update(shapes=shapes, annotations=notes)
    layout["hovermode"] = "closest"
    return {"data": [{"type": "heatmap", "z": z, "x": edges, "y": rows,
                      "colorscale": VIRIDIS, "colorbar": {"title": {"text": "rank"}},
                      "hovertemplate": "%{y}<br>step %{x}: rank %{z}<extra></extra>",
                      "zmin": 0, "ygap": 1}],
            "layout": layout}


def rank_bars_spec(latest: Mapping[str, Sequence[int]],
                   title: str = "Current ranks per layer") -> Spec:
    """Grouped bars: one group per layer, one bar per bond."""
    if not latest:
        return empty_spec("No ranks yet", 300, title)
    layers = list(latest)
    nb = max(len(v) for v in latest.values())
    data = [{"type": "bar", "x": layers,
             "y": [latest[name][b] if b < len(latest[name]) else None for name in layers],
             "name": f"bond {b + 1}", "marker": {"color": COLORS[b % len(COLORS)]}}
            for b in range(nb)]
    layout = look(title, 320, None, "effective rank")
    layout.update(barmode="group", bargap=0.25, hovermode="closest",
                  legend=dict(LEGEND_CENTRED))
    _axis(layout, "xaxis", tickangle=-30 if len(layers) > 4 else 0, tickfont={"size": 10})
    return {"data": data, "layout": layout}


def label_positions(xs: Sequence[float], all_xs: Sequence[float], log: bool,
                    side: str = "top", ys: Sequence[float] | None = None,
                    near: float = 0.1) -> list[str]:
    """Where each point's label goes (``textposition``) so that it stays in the figure and
    clear of its neighbours' labels.

    Horizontally: centred over the point, but to its left in the right fifth of the x
    range ``all_xs`` spans (on a log axis: in log10) and to its right in the left fifth.
    Vertically: ``side`` for a point alone; points whose x lie within ``near`` of that
    range of each other (single linkage, so a chain of close points is one cluster) are
    staggered: in a cluster of ``k`` points ordered by ``ys`` from the highest (by input
    order when ``ys`` is None), the first label goes on top, the last at the bottom and
    the ones between beside their points, alternately right and left (``middle
    right``/``middle left``; only the inward side at an end of the range)."""
    def at(v: float) -> float:
        return math.log10(v) if log and v > 0 else v

    span = [at(v) for v in all_xs if not log or v > 0]
    lo, hi = (min(span), max(span)) if span else (0.0, 0.0)
    fracs = [(at(x) - lo) / (hi - lo) if hi > lo else 0.5 for x in xs]
    out = [f"{side} left" if f > 0.8 else f"{side} right" if f < 0.2 else f"{side} center"
           for f in fracs]
    for cluster in _clusters(fracs, near):
        if len(cluster) < 2:
            continue
        if ys is not None:
            cluster = sorted(cluster, key=lambda i: -ys[i])
        for k, i in enumerate(cluster):
            horizontal = out[i].split(" ", 1)[1]
            if k == 0:
                out[i] = f"top {horizontal}"
            elif k == len(cluster) - 1:
                out[i] = f"bottom {horizontal}"
            else:
                inward = "left" if fracs[i] > 0.8 else "right" if fracs[i] < 0.2 else None
                out[i] = f"middle {inward or ('right' if k % 2 else 'left')}"
    return out


def _clusters(fracs: Sequence[float], near: float) -> list[list[int]]:
    """Indices of ``fracs`` grouped so that neighbours (in sorted order) closer than
    ``near`` share a group, in input order within each group."""
    order = sorted(range(len(fracs)), key=lambda i: fracs[i])
    groups: list[list[int]] = []
    for j, i in enumerate(order):
        if j and fracs[i] - fracs[order[j - 1]] < near:
            groups[-1].append(i)
        else:
            groups.append([i])
    return [sorted(g) for g in groups]


#: Each data set's marker in a figure with several (its front's dash alike)
GROUP_SYMBOLS = ("circle", "square", "diamond", "triangle-up", "cross", "x")
GROUP_DASHES = ("dash", "dot", "dashdot", "longdash", "longdashdot")
#: The dense baselines' colour; the methods take the others, in turn (a reproduction
#: compares a dozen)
DENSE_COLOR = COLORS[1]
METHOD_COLORS = [c for c in COLORS if c != DENSE_COLOR] + [
    "#0F766E", "#B45309", "#DB2777", "#1E3A8A", "#CA8A04", "#7F1D1D"]
#: The most points a figure names beside them all; with more, only the fronts' points and
#: the dense baselines are named, the others on hover (a sweep's dozens of labels would
#: hide the points)
MAX_LABELS = 8
#: A point's method when the caller names none
TT_METHOD = "CoMERA (TT)"


def _pareto_group(fig: go.Figure, pts: Sequence[Mapping[str, Any]], x_key: str, y_key: str,
                  x_title: str, y_title: str, higher_x_better: bool, suffix: str,
                  index: int, methods: Sequence[str], all_xs: Sequence[float] = (),
                  log_x: bool = True, y_hover: str = ".3g", label_all: bool = True) -> None:
    """One group's points, front and dense baselines (``suffix`` names the group,
    ``index`` its marker and dash): a trace per method (``methods``: every method of the
    figure, in colour order); ``all_xs``, ``log_x``: every point's x and the axis type,
    to place the labels; ``y_hover``: the d3 format of y in the hover text. A point's
    ``text`` (else its ``label``) is written beside it if ``label_all``, or if it is on
    the front or a dense baseline; every point has its ``label`` on hover."""
    tt = [p for p in pts if not p.get("dense")]
    dense = [p for p in pts if p.get("dense")]
    # front: walk from the best x down, keep points that improve y (any method's)
    order = sorted(tt + dense, key=lambda p: p[x_key], reverse=higher_x_better)
    front, best = [], -math.inf
    for p in order:
        if p[y_key] > best:
            front.append(p)
            best = p[y_key]
    symbol = GROUP_SYMBOLS[index % len(GROUP_SYMBOLS)]
    if len(front) > 1:
        front = sorted(front, key=lambda p: p[x_key])
        fig.add_trace(go.Scatter(
            x=[p[x_key] for p in front], y=[p[y_key] for p in front], mode="lines",
            name="Pareto front" + suffix,
            line={"color": "#94A3B8" if suffix else "#CBD5E1", "width": 2,
                  "dash": GROUP_DASHES[index % len(GROUP_DASHES)]},
            hoverinfo="skip",
        ))
    hover = ("%{customdata}<br>" + x_title + ": %{x:.3g}<br>" + y_title + ": %{y:" + y_hover
             + "}<extra></extra>")
    # where the labels go, over all the group's named points at once (neighbours of
    # two methods are staggered too)
    on_front = {id(p) for p in front}
    named = [p for p in tt if label_all or id(p) in on_front]
    where = dict(zip(map(id, named), label_positions(
        [p[x_key] for p in named], all_xs, log_x, ys=[p[y_key] for p in named])))
    for method in methods:
        mine = [p for p in tt if (p.get("method") or TT_METHOD) == method]
        if not mine:
            continue
        colour = METHOD_COLORS[methods.index(method) % len(METHOD_COLORS)]
        fig.add_trace(go.Scatter(
            x=[p[x_key] for p in mine], y=[p[y_key] for p in mine],
            mode="markers+text", name=method + suffix,
            text=[p.get("text") or p["label"] if id(p) in where else "" for p in mine],
            customdata=[p["label"] for p in mine],
            textposition=[where.get(id(p), "top center") for p in mine],
            textfont={"size": 10}, cliponaxis=False,
            marker={"size": 12, "color": colour, "symbol": symbol,
                    "line": {"width": 1, "color": "white"}},
            hovertemplate=hover,
        ))
    if dense:
        fig.add_trace(go.Scatter(
            x=[p[x_key] for p in dense], y=[p[y_key] for p in dense],
            mode="markers+text", name="dense baseline" + suffix,
            text=[p.get("text") or p["label"] for p in dense],
            customdata=[p["label"] for p in dense],
            textposition=label_positions([p[x_key] for p in dense], all_xs, log_x, "bottom",
                                         ys=[p[y_key] for p in dense]),
            textfont={"size": 10}, cliponaxis=False,
            marker={"size": 18, "symbol": "star", "color": DENSE_COLOR,
                    "line": {"width": 1, "color": "white"}},
            hovertemplate=hover,
        ))
        for p in dense:
            fig.add_hline(y=p[y_key], line={"color": DENSE_COLOR, "dash": "dot", "width": 1})


def pareto(points: Sequence[Mapping[str, Any]], x_key: str, y_key: str, x_title: str,
           y_title: str, title: str, log_x: bool = True, higher_x_better: bool = True,
           x_include: Sequence[float] = (), y_percent: bool = False) -> go.Figure:
    """Scatter of runs with the Pareto front (best ``y`` for a given ``x``) and the dense
    baseline(s) drawn as stars. Points: ``{"label", "dense", x_key, y_key[, "group",
    "method", "text"]}``: each group (data set and task) gets its own front, never one
    across groups, and its own marker; each method (default :data:`TT_METHOD`) its own
    colour and legend entry, the same in every group. A point is named beside it by its
    ``text`` (default its ``label``) when the figure has at most :data:`MAX_LABELS`
    points, else only the fronts' points and the dense baselines are; every point by its
    ``label`` on hover. ``y_percent``: ``y`` is a fraction (an accuracy) shown in
    percent on the axis and in the hover text."""
    pts = [{**p, **{k: plain(p[k]) for k in ("label", "text") if p.get(k) is not None}}
           for p in points
           if isinstance(p.get(x_key), (int, float)) and isinstance(p.get(y_key), (int, float))
           and math.isfinite(p[x_key]) and math.isfinite(p[y_key])]
    if not pts:
        return empty_figure("No finished runs with these metrics yet", 360, title)
    fig = go.Figure()
    xs = [p[x_key] for p in pts if p[x_key] > 0] + [x for x in x_include if x > 0]
    if log_x and xs and max(xs) / min(xs) < 3:
        log_x = False  # a narrow spread reads better on a linear axis
    # one front per group (a data set and task): runs on different data never share one
    groups = sorted({str(p.get("group") or "") for p in pts})
    methods = sorted({p.get("method") or TT_METHOD for p in pts if not p.get("dense")})
    for gi, group in enumerate(groups):
        mine = [p for p in pts if str(p.get("group") or "") == group]
        _pareto_group(fig, mine, x_key, y_key, x_title, y_title, higher_x_better,
                      f" · {group}" if len(groups) > 1 else "", gi, methods,
                      [p[x_key] for p in pts] + list(x_include), log_x,
                      ".1%" if y_percent else ".3g", label_all=len(pts) <= MAX_LABELS)
    if not log_x and xs:
        lo, hi = min(xs), max(xs)
        pad = max((hi - lo) * 0.2, abs(hi) * 0.01, 1e-9)
        fig.update_xaxes(range=[lo - pad, hi + pad])
    if log_x:
        log_ticks(fig, "x")
        if xs:  # room for the labels at both ends
            lo, hi = math.log10(min(xs)), math.log10(max(xs))
            pad = max(0.15, 0.12 * (hi - lo))
            fig.update_xaxes(range=[lo - pad, hi + pad])
    ys = [p[y_key] for p in pts]
    if all(0.0 <= y <= 1.0 for y in ys):  # accuracies: keep the axis honest, not 0..1.5
        lo, hi = min(ys), max(ys)
        pad = max(0.02, (hi - lo) * 0.15)
        fig.update_yaxes(range=[max(0.0, lo - pad), min(1.0, hi + pad) + 0.01])
    if y_percent:
        fig.update_yaxes(tickformat=percent_ticks(ys))
    fig = base_layout(fig, title, 400, x_title.replace(", log", "") if not log_x else x_title,
                      y_title)
    legend_below(fig)
    fig.update_layout(hovermode="closest")
    return fig


def hbar(labels: Sequence[str], values: Sequence[float], title: str, x_title: str,
         colors: Sequence[str] | None = None, text: Sequence[str] | None = None,
         log_x: bool = False, height: int | None = None) -> go.Figure:
    fig = go.Figure(go.Bar(
        y=[plain(v) for v in labels], x=list(values), orientation="h",
        marker_color=list(colors) if colors else COLORS[0],
        text=list(text) if text else None, textposition="auto",
    ))
    if log_x:
        log_ticks(fig, "x")
    fig.update_yaxes(autorange="reversed")
    fig = base_layout(fig, title, height or max(200, 40 + 28 * len(labels)), x_title)
    fig.update_layout(hovermode="closest", showlegend=False)
    return fig


def size_bar(dense: float, start: float, floor: float, target: float | None,
             scope: str) -> go.Figure:
    """The target plan as one bar on a log axis of compression (``dense / size``): the
    reachable range from the start (the initial ranks) to the floor (rank 1 everywhere),
    with markers at start, target and floor. A target outside the range is drawn where
    it lies, in the target colour, so a refusal is visible too."""
    ratio = {"start": dense / start, "floor": dense / floor}
    if target is not None:
        ratio["target"] = target
    fig = go.Figure()
    fig.add_bar(y=["size"], x=[ratio["floor"] - ratio["start"]], base=[ratio["start"]],
                orientation="h", marker_color="#C7D2FE", width=0.35, hoverinfo="skip",
                showlegend=False)
    colors = {"start": COLORS[0], "target": TARGET_COLOR, "floor": COLORS[7]}
    for name, x in ratio.items():
        size = dense / x
        fig.add_scatter(x=[x], y=["size"], mode="markers+text", name=name,
                        marker={"size": 14, "color": colors[name], "symbol": "diamond"},
                        text=[f"{name} {x:.3g}×"], textposition="top center",
                        cliponaxis=False,
                        hovertemplate=f"{name}: {x:.3g}× ({size:,.0f} params)<extra></extra>")
    fig.update_xaxes(**log_axis(values=list(ratio.values())),
                     title_text=f"compression ({scope}), log scale")
    fig.update_yaxes(visible=False)
    base_layout(fig, None, 130)
    fig.update_layout(hovermode="closest", showlegend=False,
                      margin={"l": 10, "r": 10, "t": 25, "b": 10})
    return fig


def sweep_pareto(report: Mapping[str, Any], title: str = "Score vs compression reached",
                 scope: str = SCOPE_LABELS["tensorized"]) -> go.Figure:
    """A sweep's grid points as mean ± std (error bars over seeds) of its score against
    the compression reached (in ``scope``: ``app.lib.runs.sweep_scope``), every finished
    cell as a faint dot, the Pareto front as a dashed line (``report``:
    :func:`comera_engine.launch.sweep.sweep_report`)."""
    metric = report.get("metric") or "score"
    groups = [g for g in report.get("groups", [])
              if is_finite(g.get("score")) and is_finite(g.get("compression"))]
    if not groups:
        return empty_figure("No finished cells yet", 400, title)
    fig = go.Figure()
    cells = [c for c in report.get("cells", []) if c.get("status") == "finished"
             and is_finite(c.get("score")) and is_finite(c.get("compression"))]
    if cells:
        fig.add_trace(go.Scatter(
            x=[c["compression"] for c in cells], y=[c["score"] for c in cells], mode="markers",
            name="cells (each seed)", text=[c["label"] for c in cells],
            marker={"size": 7, "color": COLORS[0], "opacity": 0.35},
            hovertemplate="%{text}<br>%{x:.3g}×<br>" + metric + " %{y:.4f}<extra></extra>",
        ))
    front = sorted((g for g in groups if g.get("pareto")), key=lambda g: g["compression"])
    if len(front) > 1:
        fig.add_trace(go.Scatter(
            x=[g["compression"] for g in front], y=[g["score"] for g in front], mode="lines",
            name="Pareto front", line={"color": "#94A3B8", "width": 2, "dash": "dash"},
            hoverinfo="skip",
        ))
    # a spread only where seeds give one (one seed: a mean and no bar, never "± 0")
    spread = any(is_finite(g.get(k)) for g in groups for k in ("score_std", "compression_std"))
    fig.add_trace(go.Scatter(
        x=[g["compression"] for g in groups], y=[g["score"] for g in groups],
        mode="markers+text", name="grid point (mean ± std)" if spread else "grid point",
        text=[g["label"] for g in groups], textfont={"size": 10}, cliponaxis=False,
        textposition=label_positions([g["compression"] for g in groups],
                                     [g["compression"] for g in groups],
                                     log=min(g["compression"] for g in groups) > 0,
                                     ys=[g["score"] for g in groups]),
        error_y=_error_bars([g.get("score_std") for g in groups]),
        error_x=_error_bars([g.get("compression_std") for g in groups]),
        marker={"size": 13, "color": [COLORS[1] if g.get("pareto") else COLORS[0]
                                      for g in groups], "line": {"width": 1, "color": "white"}},
        hovertemplate="%{text}<br>%{x:.3g}×<br>" + metric + " %{y:.4f}<extra></extra>",
    ))
    xs = [g["compression"] for g in groups] + [c["compression"] for c in cells]
    if xs and min(xs) > 0 and max(xs) / min(xs) >= 3:
        log_ticks(fig, "x")
        lo, hi = math.log10(min(xs)), math.log10(max(xs))
        pad = max(0.15, 0.12 * (hi - lo))
        fig.update_xaxes(range=[lo - pad, hi + pad])
        x_title = "×, log"
    else:
        x_title = "×"
    x_title = f"compression reached ({scope}; {x_title})"
    fig = base_layout(fig, title, 420, x_title, metric_label(metric))
    if is_fraction(metric):  # accuracy: one unit (percent) everywhere
        fig.update_yaxes(tickformat=percent_ticks(
            [g["score"] for g in groups] + [c["score"] for c in cells]))
        fig.update_traces(hovertemplate="%{text}<br>%{x:.3g}×<br>" + metric
                          + " %{y:.1%}<extra></extra>")
    legend_below(fig)
    fig.update_layout(hovermode="closest")
    return fig


def is_finite(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _error_bars(stds: Sequence[Any]) -> dict[str, Any]:
    """Plotly error bars of these spreads; none drawn (not a bar of 0) where there is no
    spread (``None``: one seed)."""
    if not any(is_finite(v) for v in stds):
        return {"visible": False}
    return {"type": "data", "array": [v if is_finite(v) else float("nan") for v in stds],
            "thickness": 1.2, "width": 4}


def sweep_parcoords(rep: Mapping[str, Any], title: str) -> go.Figure:
    """Parallel coordinates of a sweep's cells: one axis per swept key (text values as
    their order), the seed, the compression reached and the score (an accuracy on a
    0..100 % axis); a line per finished cell (a running one's score is not its last),
    coloured by its score. A key or the seed with one value among the finished
    cells gets no axis (it would only add a flat line to every cell)."""
    metric = rep.get("metric") or "score"
    cells = [c for c in rep.get("cells") or []  # a running cell's score is not its last
             if c.get("status") == "finished" and is_finite(c.get("score"))]
    if not cells:
        return empty_figure("No finished cells yet", 360, title)
    keys = sorted({k for c in cells for k in (c.get("grid") or {})})
    dims = []
    for key in keys:
        values = [(c.get("grid") or {}).get(key) for c in cells]
        if all(is_finite(v) for v in values):
            dims.append({"label": key, "values": [float(v) for v in values],
                         "tickformat": ".3~g"})
        else:  # words: one tick per value
            words = sorted({str(v) for v in values})
            dims.append({"label": key, "values": [words.index(str(v)) for v in values],
                         "tickvals": list(range(len(words))), "ticktext": words})
    seeds = [c.get("seed") or 0 for c in cells]
    dims.append({"label": "seed", "values": seeds,  # whole seeds only on the axis
                 "tickvals": sorted(set(seeds)), "ticktext": [str(v) for v in sorted(set(seeds))]})
    dims = [d for d in dims if len({str(v) for v in d["values"]}) > 1]
    if all(is_finite(c.get("compression")) for c in cells):
        dims.append({"label": "compression (×)", "values": [c["compression"] for c in cells],
                     "tickformat": ".3~g"})
    scale = 100.0 if is_fraction(metric) else 1.0  # accuracy in percent
    label = f"{metric} (%)" if scale == 100.0 else metric
    scores = [c["score"] * scale for c in cells]
    score_dim: dict[str, Any] = {"label": label, "values": scores, "tickformat": ".3~g"}
    if scale == 100.0:  # Plotly pads a lone value's axis past 100 %: keep it in 0..100
        pad = max(1.0, (max(scores) - min(scores)) * 0.1)
        score_dim["range"] = [max(0.0, min(scores) - pad), min(100.0, max(scores) + pad)]
    dims.append(score_dim)
    fig = go.Figure(go.Parcoords(
        line={"color": scores, "colorscale": "Viridis", "showscale": True,
              "colorbar": {"title": {"text": label}}},
        dimensions=dims))
    fig = base_layout(fig, title, 380)
    fig.update_layout(margin={"l": 60, "r": 60, "t": 70, "b": 30})
    return fig
