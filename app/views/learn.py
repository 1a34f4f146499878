"""Learn: tensor-train compression, hands on."""

from __future__ import annotations

import math

import numpy as np
import plotly.graph_objects as go
import streamlit as st

from app.lib import fmt, plots, ui
from app.lib.learn import (
    LAYOUTS,
    SOURCES,
    bounds_text,
    gate_importance,
    gates_after,
    in_words,
    make_matrix,
    path_macs,
    tt_approx,
    tt_layer_cores,
)

PAPER_IN, PAPER_OUT = [12, 8, 8], [8, 8, 12]

st.title(":material/school: Learn", anchor=False)
st.caption("How a tensor train stores a matrix with far fewer numbers, how CoMERA learns its "
           "ranks, and why the TT layer needs far fewer multiply-adds. Every number on this "
           "page is computed live.")


@st.cache_data(show_spinner=False, max_entries=8)
def _matrix(source: str) -> np.ndarray:
    return make_matrix(source)


@st.cache_data(show_spinner=False, max_entries=256)
def _approx(source: str, layout: str, rank: int):  # noqa: ANN202 - TTResult
    return tt_approx(_matrix(source), layout, rank)


@st.cache_data(show_spinner=False, max_entries=16)
def _curve(source: str, layout: str) -> list[tuple[int, int, float]]:
    out = []
    for r in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64):
        res = _approx(source, layout, r)
        out.append((r, res.params, res.rel_error))
    return out


tab1, tab2, tab3, tab4 = st.tabs([
    ":material/image: TT-SVD playground",
    ":material/view_column: 768×768 → cores",
    ":material/tune: Rank gates",
    ":material/speed: Two halves: fewer MACs",
])

# ------------------------------------------------------------------ 1. TT-SVD playground
with tab1:
    st.markdown(
        "A 256×256 matrix is reshaped into a higher-order tensor and split by **TT-SVD** "
        "(a sweep of truncated SVDs, computed with tensorly) into a chain of small *cores*. "
        "The **rank** caps how wide each link of the chain is: more rank, more parameters, "
        "smaller error."
    )
    c1, c2, c3 = st.columns([2, 2, 3])
    source = c1.selectbox("Decompose", list(SOURCES), format_func=SOURCES.get, key="l-src")
    layout = c2.selectbox("Reshape as", list(LAYOUTS), format_func=LAYOUTS.get, key="l-lay",
                          help="rows then columns: modes 4·4·4·4 | 4·4·4·4, the layout of a TT "
                               "linear layer. Interleaved: modes (row digit, column digit) "
                               "pairs 16·16·16·16, often better for images.")
    rank = c3.slider("TT rank", 1, 64, 8, key="l-rank")
    with st.spinner("Running TT-SVD…"):
        res = _approx(source, layout, rank)
        curve = _curve(source, layout)
    m = _matrix(source)
    k = ui.tile_columns(4, per_row=2)  # the rank list is long: rows of 2 tiles
    k[0].metric("Parameters", f"{res.params:,}", delta=f"dense {res.dense:,}",
                delta_color="off", delta_arrow="off")
    k[1].metric("Compression", fmt.ratio(res.compression))
    k[2].metric("Relative error", f"{100 * res.rel_error:.2f}%",
                help="‖A − A_TT‖ / ‖A‖ (Frobenius).")
    k[3].metric("Ranks", "-".join(map(str, res.ranks[1:-1])),
                help="Each bond is capped at the rank and at what the unfolding allows.")
    c1, c2, c3 = st.columns([1, 1, 1.3])
    is_img = source == "photo"
    scale = {"zmin": 0, "zmax": 1} if is_img else {"zmin": float(np.percentile(m, 1)),
                                                    "zmax": float(np.percentile(m, 99))}
    cmap = "gray" if is_img else "RdBu"
    for col, data, title in ((c1, m, "Original"), (c2, res.reconstruction,
                             f"TT at rank {rank} ({res.params:,} numbers)")):
        fig = go.Figure(go.Heatmap(z=data, colorscale=cmap, showscale=False, **scale,
                                   hoverinfo="skip"))
        fig.update_yaxes(autorange="reversed", visible=False, scaleanchor="x")
        fig.update_xaxes(visible=False)
        plots.base_layout(fig, title, 330)
        col.plotly_chart(fig, width="stretch", key=f"l-img-{title[:4]}")
    with c3:
        fig = go.Figure()
        fig.add_scatter(x=[p for _, p, _ in curve], y=[100 * e for _, _, e in curve],
                        mode="lines+markers", name="error", text=[f"rank {r}" for r, _, _ in curve],
                        line={"color": plots.COLORS[0], "width": 2},
                        hovertemplate="%{text}: %{x:,} params, %{y:.2f}%<extra></extra>")
        fig.add_scatter(x=[res.params], y=[100 * res.rel_error], mode="markers", name="you",
                        marker={"size": 14, "color": plots.COLORS[3]})
        plots.log_ticks(fig, "x")
        plots.mark_x(fig, res.dense, "dense", plots.COLORS[7])  # its label on a log axis
        plots.base_layout(fig, "Error against parameters", 330, "parameters (log)",
                          "relative error (%)")
        fig.update_layout(hovermode="closest")
        st.plotly_chart(fig, width="stretch", key="l-curve")
    if source == "random":
        st.info("A random matrix has no structure for the cores to capture: its error falls "
                "slowly. That is why CoMERA *trains* in TT form from scratch instead of "
                "compressing a trained dense layer: training finds weights that the chosen "
                "ranks can express.", icon=":material/lightbulb:")

# ------------------------------------------------------------------ 2. cores of a layer


def cores_figure(in_f: list[int], out_f: list[int], r: int) -> go.Figure:
    shapes = tt_layer_cores(in_f, out_f, r)
    d = len(in_f)
    fig = go.Figure()
    gap, w = 1.2, 1.6
    maxp = max(a * s * b for a, s, b in shapes)
    x = 0.0
    centers = []
    for k, (a, s, b) in enumerate(shapes):
        h = 0.6 + 1.6 * math.sqrt(a * s * b / maxp)
        color = plots.COLORS[0] if k < d else plots.COLORS[2]
        fig.add_shape(type="rect", x0=x, x1=x + w, y0=-h / 2, y1=h / 2, line={"color": color,
                      "width": 2}, fillcolor=color, opacity=0.18, layer="below")
        fig.add_annotation(x=x + w / 2, y=0, showarrow=False,
                           text=f"<b>G{k + 1}</b><br>{a}×{s}×{b}", font={"size": 12})
        fig.add_annotation(x=x + w / 2, y=-h / 2 - 0.25, showarrow=False,
                           text=f"{a * s * b:,}", font={"size": 11, "color": "#475569"})
        centers.append((x, x + w))
        x += w + gap
    for k in range(len(shapes) - 1):
        x0, x1 = centers[k][1], centers[k + 1][0]
        mid = k == d - 1
        fig.add_shape(type="line", x0=x0, x1=x1, y0=0, y1=0,
                      line={"color": plots.COLORS[3] if mid else "#334155",
                            "width": 4 if mid else 2})
        fig.add_annotation(x=(x0 + x1) / 2, y=0.18, showarrow=False,
                           text=f"r{k + 1}={shapes[k][2]}",
                           font={"size": 11, "color": plots.COLORS[3] if mid else "#334155"})
    left_end = centers[d - 1][1]
    right_start = centers[d][0]
    fig.add_annotation(x=left_end / 2, y=1.55, showarrow=False,
                       text=f"input modes {'·'.join(map(str, in_f))} = {math.prod(in_f)}  "
                            f"→ merge: L ({math.prod(in_f)}×{shapes[d - 1][2]})",
                       font={"color": plots.COLORS[0], "size": 12})
    fig.add_annotation(x=(right_start + x - gap) / 2, y=1.55, showarrow=False,
                       text=f"output modes {'·'.join(map(str, out_f))} = {math.prod(out_f)}  "
                            f"→ merge: R ({shapes[d - 1][2]}×{math.prod(out_f)})",
                       font={"color": plots.COLORS[2], "size": 12})
    fig.add_annotation(x=(left_end + right_start) / 2, y=-0.55, showarrow=False,
                       text="middle rank joins<br>the two halves",
                       font={"size": 10, "color": plots.COLORS[3]})
    fig.update_xaxes(visible=False, range=[-0.3, x - gap + 0.3])
    fig.update_yaxes(visible=False, range=[-1.9, 1.9])
    plots.base_layout(fig, None, 300)
    fig.update_layout(hovermode=False, showlegend=False)
    return fig


with tab2:
    intro = st.empty()  # drawn once the factors are read: it counts their cores
    c1, c2 = st.columns([1, 2])
    r2 = c1.slider("Rank", 1, 64, 30, key="l-core-rank")
    fac = c2.radio("Factors per side", ["12·8·8 | 8·8·12 (paper)", "24·32 | 32·24",
                                        "6·4·4·8 | 8·4·4·6"], horizontal=True, key="l-fac")
    in_f, out_f = {
        "12·8·8 | 8·8·12 (paper)": (PAPER_IN, PAPER_OUT),
        "24·32 | 32·24": ([24, 32], [32, 24]),
        "6·4·4·8 | 8·4·4·6": ([6, 4, 4, 8], [8, 4, 4, 6]),
    }[fac]
    shapes = tt_layer_cores(in_f, out_f, r2)
    intro.markdown(
        "A 768×768 weight (a BERT attention projection) has **589,824** numbers. Write "
        f"768 = {'·'.join(map(str, in_f))} for the inputs and {'·'.join(map(str, out_f))} "
        f"for the outputs, reshape $W$ into {fmt.a_or_an(len(shapes))} {len(shapes)}-way "
        "tensor and store it as one "
        "core per factor, $G_k \\in \\mathbb{R}^{r_{k-1} \\times s_k \\times r_k}$ "
        f"({in_words(len(shapes))} here). The paper uses 12·8·8 | 8·8·12 with rank 30."
    )
    tt_p = sum(a * s * b for a, s, b in shapes)
    st.caption(f"With {fac.split(' (')[0]}: {fmt.a_or_an(len(shapes))} {len(shapes)}-way "
               f"tensor, **{len(shapes)} cores**.")
    k = st.columns(3)
    k[0].metric("Dense parameters", f"{768 * 768:,}")
    k[1].metric("TT parameters", f"{tt_p:,}", help="Σ r_{k-1}·s_k·r_k over the cores.")
    k[2].metric("Compression", fmt.ratio(768 * 768 / tt_p))
    st.plotly_chart(cores_figure(in_f, out_f, r2), width="stretch", key="l-cores")
    st.caption("Box area grows with the core's parameter count (the number under it). Ranks "
               "at the ends are 1; inner ranks are capped by what the modes on either side "
               f"allow: {bounds_text(in_f, out_f, r2)}.")

# ------------------------------------------------------------------ 3. rank gates
with tab3:
    st.markdown(
        "Between two cores sits a trainable **gate** vector $g$ (one entry per rank "
        "direction, initialised to 1): $W = G_1 \\,\\mathrm{diag}(g_1)\\, G_2 \\,"
        "\\mathrm{diag}(g_2) \\cdots$. CoMERA adds the "
        "model's size to the loss through the l1 norm of the gates, which pushes *every* "
        "gate down at the same rate, while the task loss holds up the directions it needs. "
        "A gate at or below the threshold $\\tau$ is **pruned for good**: the effective "
        "rank is the number of gates above $\\tau$."
    )
    c1, c2, c3 = st.columns(3)
    r3 = c1.slider("Allocated rank of the bond", 4, 64, 30, key="l-g-rank")
    pressure = c2.slider("Size pressure so far (γ × steps)", 0.0, 1.0, 0.35, 0.01, key="l-g-p",
                         help="How far the size surrogate has pushed the gates down.")
    tau = c3.select_slider("Threshold τ", [0.001, 0.005, 0.01, 0.02, 0.05, 0.1], value=0.01,
                           key="l-g-tau")
    imp = gate_importance(r3)
    g = gates_after(imp, pressure)
    alive = g > tau
    floor = not alive.any()  # the default schedules keep a bond's strongest direction
    if floor:
        alive[int(g.argmax())] = True
    eff = int(alive.sum())
    fig = go.Figure()
    fig.add_bar(x=list(range(1, r3 + 1)), y=imp, name="importance (where the loss holds it)",
                marker_color="#E2E8F0")
    fig.add_bar(x=list(range(1, r3 + 1)), y=g, name="gate |g|",
                marker_color=[plots.COLORS[0] if a else plots.COLORS[3] for a in alive])
    dead = [i + 1 for i, a in enumerate(alive) if not a]
    if dead:  # a pruned gate is at or near 0: a bar too short to see, so a mark on τ
        fig.add_scatter(x=dead, y=[tau] * len(dead), mode="markers",
                        name="pruned (gate ≤ τ)",
                        marker={"symbol": "x", "size": 9, "color": plots.COLORS[3]})
    fig.add_hline(y=tau, line={"color": plots.COLORS[3], "dash": "dash"},
                  annotation_text=f"τ = {tau:g}", annotation_position="top right")
    fig.update_layout(barmode="overlay")
    plots.base_layout(fig, f"Gates of one bond: effective rank {eff} of {r3}", 320,
                      "rank direction", "gate magnitude")
    fig.update_layout(hovermode="closest")
    st.plotly_chart(fig, width="stretch", key="l-gates")
    # the 768x768 layer with every bond at the same effective fraction
    shapes_full = tt_layer_cores(PAPER_IN, PAPER_OUT, r3)
    shapes_eff = tt_layer_cores(PAPER_IN, PAPER_OUT, max(1, eff))
    p_full = sum(a * s * b for a, s, b in shapes_full)
    p_eff = 0 if eff == 0 else sum(a * s * b for a, s, b in shapes_eff)
    k = st.columns(3)
    k[0].metric("Effective rank", f"{eff} / {r3}")
    k[1].metric("Parameters (768×768, all bonds alike)", f"{p_eff:,}",
                delta=f"from {p_full:,}", delta_color="off", delta_arrow="off")
    k[2].metric("Compression vs dense", fmt.ratio(768 * 768 / p_eff))
    if floor:
        st.caption(":material/info: Every gate fell to τ: the bond keeps its strongest "
                   "direction (held just above τ), as the default schedules do "
                   "(`comera.rank_floor`); only the paper's schedule lets a bond die, "
                   "which makes the whole layer the zero map.")
    st.caption("Red crosses on the τ line mark pruned directions: they act as exact zeros "
               "and get no gradient, so at the "
               "next checkpoint the cores are physically sliced and memory really shrinks. "
               "In the late stage CoMERA keeps pushing only while the size is above the "
               "target, so the size lands on it.")

# ------------------------------------------------------------------ 4. contraction cost
with tab4:
    st.markdown(
        "To compute $Y = XW$ for a batch of $B$ rows, the TT layer never needs $W$. "
        "Merging the input cores gives $L$ ($N \\times r$), the output cores $R$ "
        "($r \\times M$), and $Y = (XL)R$ costs $B\\,r\\,(N+M)$ multiply-adds instead of "
        "$B\\,N\\,M$, plus merges that do not depend on the batch. A core-by-core "
        "*sweep* wins for tiny batches; rebuilding $W$ (*dense*) only near full rank. "
        "Fewer multiply-adds is not yet less time on a GPU: the TT layer runs as tens of "
        "small kernels, and a CoMERA training step of the paper's model is still slower "
        "than dense there (docs/BENCHMARKS.md, \"On a GPU\"). So the planner picks each "
        "layer's path from timings measured on the GPU where the device has a profile, "
        "and from a cost model (forward and backward) elsewhere, as below."
    )
    c1, c2, c3 = st.columns(3)
    shape = c1.radio("Layer", ["768×768 (attention)", "768×3072 (FFN in)"], horizontal=True,
                     key="l-c-shape")
    in_f, out_f = (PAPER_IN, PAPER_OUT) if shape.startswith("768×768") else (
        PAPER_IN, [12, 16, 16])
    batch = c2.select_slider("Batch rows B (tokens)", [1, 4, 16, 64, 256, 1024, 4096, 16384],
                             value=1024, key="l-c-batch")
    r4 = c3.slider("Rank", 1, 64, 30, key="l-c-rank")
    now = path_macs(batch, in_f, out_f, r4)
    pick = str(now["pick"])
    k = st.columns(4)
    k[0].metric("nn.Linear (fwd+bwd)", fmt.count(now["nn.Linear"]))
    k[1].metric("TT, two halves", fmt.count(now["halves"]))
    k[2].metric("TT, sweep", fmt.count(now["sweep"]))
    k[3].metric("Planner picks", pick,
                delta=f"{now['nn.Linear'] / now[pick]:.1f}× fewer MACs than dense",
                delta_color="off", delta_arrow="off")
    ranks = list(range(1, 65, 3))
    per_rank = [path_macs(batch, in_f, out_f, r) for r in ranks]
    batches = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
    per_batch = [path_macs(b, in_f, out_f, r4) for b in batches]
    names = {"halves": "TT two halves", "sweep": "TT sweep", "dense": "TT → dense W",
             "nn.Linear": "nn.Linear"}
    c1, c2 = st.columns(2)
    for col, xs, data, title, xt, here in (
        (c1, ranks, per_rank, f"MACs against rank (B = {batch})", "rank", r4),
        (c2, batches, per_batch, f"MACs against batch (rank {r4})", "batch rows B", batch),
    ):
        fig = go.Figure()
        for i, (key, nm) in enumerate(names.items()):
            fig.add_scatter(x=xs, y=[d[key] for d in data], name=nm, mode="lines",
                            line={"width": 2, "color": plots.COLORS[[0, 1, 7, 3][i]],
                                  "dash": "dot" if key == "nn.Linear" else None})
        picks = [d["pick"] for d in data]
        fig.add_scatter(x=xs, y=[d[p] for d, p in zip(data, picks)], mode="markers",
                        name="planner's pick", marker={"size": 7, "color": "#0F172A"},
                        text=picks, hovertemplate="%{text}: %{y:.3s}<extra></extra>")
        fig.add_vline(x=here, line={"color": "#94A3B8", "dash": "dash"})
        plots.log_ticks(fig, "y")
        if col is c2:
            plots.log_ticks(fig, "x")
        plots.base_layout(fig, title, 400, xt, "MACs, forward + backward (log)")
        plots.legend_below(fig)
        col.plotly_chart(fig, width="stretch", key=f"l-cost-{xt}")
    st.caption("The planner minimises time (measured, or modelled as here), not MACs: "
               "skinny GEMMs and kernel launches cost extra, which is why the sweep can win "
               "at tiny batches.")
