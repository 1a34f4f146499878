"""Compare: overlaid curves, accuracy against compression and memory, final metrics,
config diff."""

from __future__ import annotations

import streamlit as st

from app.lib import fmt, plots, runs, ui
from comera_engine.preview import method_label

store = ui.store_page(
    "Compare",
    "Overlay runs, see which reach the best accuracy for their size, and what differs "
    "between their configs.",
    ":material/compare_arrows:",
)
all_runs = ui.runs_or_stop(
    store, "Compare needs runs: launch one (or several with different targets).", "compare")


def _repick() -> None:
    """Shown or hidden archived runs: an empty pick takes the default again (a pick the
    user made is kept)."""
    if not st.session_state.get("cmp-runs"):
        st.session_state.pop("cmp-runs", None)


# archived runs are offered only when asked for (as on the Overview)
offered = ui.unarchived(all_runs, "cmp-archived", on_change=_repick)

by_id = {r["id"]: r for r in offered}
done = [r["id"] for r in offered if r["status"] in ("finished", "stopped")]
default = (done or list(by_id))[:6]
sweeps = store.list_sweeps()


def _load_sweep() -> None:
    """Pick the cells of the chosen sweep (and nothing else)."""
    sid = st.session_state.get("cmp-sweep")
    if sid:
        st.session_state["cmp-runs"] = [r["id"] for r in store.sweep_runs(sid)
                                        if r["id"] in by_id]


if sweeps:
    sweep_names = {s["id"]: f"{s['name']} · {s['cells']} cells · {s['id']}" for s in sweeps}
    st.selectbox("Load a sweep", [None, *sweep_names], key="cmp-sweep",
                 format_func=lambda i: "—" if i is None else sweep_names[i],
                 on_change=_load_sweep,
                 help="Puts every cell of a sweep in the run list below (the Sweeps page "
                 "shows the same front as mean ± std per target).")
if "cmp-runs" not in st.session_state:
    st.session_state["cmp-runs"] = default
else:  # runs hidden since they were picked (archived) leave the pick
    st.session_state["cmp-runs"] = [i for i in st.session_state["cmp-runs"] if i in by_id]
picked = st.multiselect("Runs", list(by_id), key="cmp-runs",
                        format_func=lambda i: runs.run_label(by_id[i]),
                        help="Finished and stopped runs are picked by default.")
if not picked:
    st.info("Pick at least one run above." if offered else "Every run is archived: turn on "
            "**Show archived** to compare them.", icon=":material/checklist:")
    st.stop()
sel = [by_id[i] for i in picked]


def label(run: dict) -> str:
    """Short, unique legend label."""
    return f"{run['name']} ({run['id'][-4:]})"


# ------------------------------------------------------------------ curves

names = sorted({n for r in sel for n in store.metric_names(r["id"])})
if not names:
    st.info("The chosen runs have no metrics yet.")
    st.stop()


def _pick(default: str, key: str, title: str) -> str:
    options = names
    idx = options.index(default) if default in options else 0
    return st.selectbox(title, options, index=idx, key=key, format_func=fmt.metric_label)


st.subheader("Curves", anchor=False)
c1, c2 = st.columns(2)
with c1:
    m1 = _pick("loss/task", "cmp-m1", "Metric (left)")
    series = [(label(r), *(lambda s: (s["step"], s["value"]))(store.series(r["id"], m1, 1000)))
              for r in sel]
    st.plotly_chart(plots.lines(series, fmt.metric_label(m1), fmt.metric_label(m1),
                                log_y=m1.startswith("loss"), smooth=0.1,
                                percent=plots.is_fraction(m1)),
                    width="stretch", key="cmp-c1")
with c2:
    default2 = "eval/acc" if "eval/acc" in names else "acc/train"
    m2 = _pick(default2, "cmp-m2", "Metric (right)")
    series = [(label(r), *(lambda s: (s["step"], s["value"]))(store.series(r["id"], m2, 1000)))
              for r in sel]
    st.plotly_chart(plots.lines(series, fmt.metric_label(m2), fmt.metric_label(m2),
                                markers=m2.startswith("eval"), percent=plots.is_fraction(m2)),
                    width="stretch", key="cmp-c2")

# ------------------------------------------------------------------ Pareto

st.subheader("Accuracy for the size", anchor=False)
points = []
rows = []
scopes: set[str] = set()
mem_what: set[str] = set()
groups: set[str] = set()
#: each point named beside it by what tells it from the others (the hover has all of it)
texts = dict(zip((r["id"] for r in sel), runs.distinct_labels([label(r) for r in sel])))
for r in sel:
    m = runs.final_metrics(store, r["id"])
    peak, kind = runs.peak_memory_mb(store, r["id"])
    if kind:
        mem_what.add(kind)
    acc = m.get("eval/acc", m.get("acc/train"))
    comp = runs.compression(r, m)
    if not runs.is_baseline(r):  # the dense model is 1x in every scope (its own mark)
        scopes.add(comp.label)
    task = (r.get("config") or {}).get("task")  # a data set and its task: one front
    group = f"{runs.dataset_of(r)} ({task})" if isinstance(task, str) else runs.dataset_of(r)
    groups.add(group)
    method = method_label(r.get("config"))
    points.append({"label": label(r), "text": texts[r["id"]], "dense": runs.is_baseline(r),
                   "method": method, "acc": acc, "group": group, "comp": comp.value,
                   "mem": peak, "bytes": m.get("bytes/effective")})
    rows.append({
        "run": label(r),
        "status": r["status"],
        "method": method,
        "dense": runs.is_dense(r),
        "steps": r.get("last_step"),
        "eval acc": runs.percent(m.get("eval/acc")),
        "eval loss": m.get("eval/loss"),
        "task loss": m.get("loss/task"),
        "compression": comp.value,
        "scope": comp.label,
        "target": runs.target_of(r),
        "data set": group,
        "params": m.get("params/effective"),
        "model size": fmt.nbytes(m["bytes/effective"]) if "bytes/effective" in m else "",
        fmt.memory_label("gpu_peak"): fmt.mib(peak) if kind == "gpu_peak" else "",
        fmt.memory_label("model_state"): fmt.mib(peak) if kind == "model_state" else "",
        "samples/s": store.median_metric(r["id"], "perf/samples_per_s"),
    })
if not any(p["dense"] for p in points):
    st.caption(":material/info: No dense baseline among the chosen runs: launch the same preset "
               "with **Dense baseline** on (New experiment) to mark it here. The dense model "
               "is 1× by definition.")
if len(groups) > 1:
    st.caption(f":material/info: These runs trained on {len(groups)} data sets "
               f"({', '.join(sorted(groups))}): each has its own front, in its own colour; "
               "no front is drawn across them.")
c1, c2 = st.columns(2)
with c1:
    fig = plots.pareto(points, "comp", "acc",
                       f"compression vs dense ({' / '.join(sorted(scopes)) or 'whole model'}"
                       "; ×, log)",
                       "accuracy", "Accuracy vs compression", x_include=[1.0], y_percent=True)
    plots.mark_x(fig, 1.0, "dense 1×", plots.COLORS[1])
    st.plotly_chart(fig, width="stretch", key="cmp-pareto")
with c2:
    # bytes as stored: the currency in which TT, pruned and int8 models compare
    st.plotly_chart(
        plots.pareto(points, "bytes", "acc", "model weights as stored (bytes, log)",
                     "accuracy", "Accuracy vs model bytes", higher_x_better=False,
                     y_percent=True),
        width="stretch", key="cmp-pareto-bytes",
    )
mem_labels = " / ".join(fmt.memory_label(k) for k in sorted(mem_what)) or "memory"
st.plotly_chart(
    plots.pareto(points, "mem", "acc", f"{mem_labels} (MiB, log)", "accuracy",
                 f"Accuracy vs {mem_labels[0].lower()}{mem_labels[1:]}",
                 higher_x_better=False, y_percent=True),
    width="stretch", key="cmp-pareto-mem",
)
st.caption(" ".join(f"**{fmt.memory_label(k)}**: {fmt.memory_help(k)}" for k in sorted(mem_what))
           or "No run logged its memory yet.")

st.subheader("Final metrics", anchor=False)
ui.table(
    rows,
    column_config={
        "eval acc": st.column_config.NumberColumn(format="%.1f%%"),
        "eval loss": st.column_config.NumberColumn(format="%.4f"),
        "task loss": st.column_config.NumberColumn(format="%.4f"),
        "compression": st.column_config.NumberColumn(
            format="%.1f×", help="Dense / effective parameters in the run's scope (the "
            "one its target is asked in): the figure every page shows. A dense baseline "
            "has no TT layers: 1× of the whole model."),
        "target": st.column_config.NumberColumn(format="%.0f×"),
        "params": st.column_config.NumberColumn(format="compact"),
        **{fmt.memory_label(k): st.column_config.TextColumn(help=fmt.memory_help(k))
           for k in ("gpu_peak", "model_state")},
        "samples/s": st.column_config.NumberColumn(
            format="%.0f", help="Training throughput, the median over the run's steps (one "
            "step's own figure swings with pruning, checkpoints and the machine's load)."),
    },
)


def csv_name(chosen: list[dict]) -> str:
    """``compare-<tag>-<tag>-metrics.csv``: each run by its legend's tag (its id's last
    four characters, file-safe as ids are), the first six and then how many more."""
    tags = [r["id"][-4:] for r in chosen[:6]]
    more = [f"{len(chosen) - 6}more"] if len(chosen) > 6 else []
    return f"compare-{'-'.join(tags + more)}-metrics.csv"


st.download_button(
    "Metrics of these runs (CSV)", key="cmp-dl-csv", icon=":material/download:",
    data=lambda: runs.history_csv(runs.metric_history(
        store, picked, {r["id"]: r["name"] for r in sel}, label="name")),
    file_name=csv_name(sel), mime="text/csv", on_click="ignore",
    help="Every metric the chosen runs logged, one row per run and step (its id and "
    "name first), as the Live page's download gives one run's.")

st.subheader("Config diff", anchor=False)
if len(sel) < 2:
    st.caption("Pick two or more runs to see how their configs differ.")
else:
    # as the engine reads them: a default stated in one and left out of the other is no
    # difference
    diff = runs.config_diff({label(r): runs.config_fields(r.get("config")) for r in sel})
    if diff:
        ui.table(diff)
        st.caption("Each config with its defaults filled in; \"—\": not set (the preset's "
                   f"value, or none); \"{runs.FROM_TARGET}\": an initial rank the run "
                   "chooses from its target.")
    else:
        st.caption("The configs are identical (with their defaults filled in).")
