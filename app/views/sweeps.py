"""Sweeps: a grid of targets × seeds run as ordinary runs; per-cell status, mean ± std per
grid point and the score-vs-compression Pareto front, stop/resume of the whole sweep."""

from __future__ import annotations

import streamlit as st

from app.lib import fmt, plots, runs, ui
from comera_engine.launch.sweep import resume_sweep, stop_sweep, sweep_report
from comera_engine.metrics import SCOPE_LABELS, format_metric

REFRESH_S = 2.0

store = ui.store_page(
    "Sweeps",
    "Several targets × seeds at once: each cell is an ordinary run (open it live, export "
    "it, compare it); here you see them together and where the best trade-offs lie.",
    ":material/grid_view:",
)

sweeps = store.list_sweeps()
if not sweeps:
    with st.container(border=True):
        st.markdown(
            "#### :material/grid_view: No sweeps yet\nOn **New experiment**, open **Sweep "
            "several targets** under the Launch button, or from a terminal:\n\n"
            "```\ncomera sweep experiments/configs/digits_tt_mlp.toml "
            "--grid comera.target_compression=5,10,30,100 --seeds 3\n```")
        if st.button("Design a sweep", icon=":material/tune:", key="sw-new"):
            st.switch_page(ui.NEW_PAGE)
    st.stop()

#: A sweep is live while it is queued or running: the page then redraws itself (the
#: picker too) every REFRESH_S.
LIVE = ("queued", "running")
LIVE_AT_START = any(s["status"] in LIVE for s in sweeps)


def _stop(sid: str) -> None:
    try:
        stop_sweep(sid, store, wait=False)
        st.session_state["sw-note"] = "Stop requested: waiting cells will not start, running " \
            "ones write a checkpoint and stop."
    except Exception as e:  # noqa: BLE001 - shown on the page
        st.session_state["sw-note"] = f"Stop failed: {e}"


def _resume(sid: str) -> None:
    try:
        done = resume_sweep(sid, store)
        left = "".join(f" Cell {cell} is left as it is: the run {why}."
                       for cell, why in done.left.items())
        st.session_state["sw-note"] = f"{len(done.queued)} cell(s) queued again.{left}"
    except Exception as e:  # noqa: BLE001 - shown on the page
        st.session_state["sw-note"] = f"Resume failed: {e}"


def pick(sweeps: list[dict]) -> str:
    """The sweep picker (``?sweep=`` remembers the choice), each sweep named with its
    status as ``sweeps`` gives it: the store's, read again at every pass."""
    ids = [s["id"] for s in sweeps]
    by_id = {s["id"]: s for s in sweeps}
    wanted = st.query_params.get("sweep")

    def name(i: str) -> str:
        return f"{by_id[i]['name']} · {by_id[i]['status']} · {i}"

    # the closed picker follows its sweep's status too (it kept "running" once it ended)
    index = ui.relabel("sw-pick", ids, ids.index(wanted) if wanted in ids else 0, name)
    sid = st.selectbox("Sweep", ids, index=index, key="sw-pick", format_func=name)
    if st.query_params.get("sweep") != sid:
        st.query_params["sweep"] = sid
    return str(sid)


def _text(value: object, shown: object) -> object:
    """A table cell: ``shown`` (the figure as text), blank while ``value`` is pending."""
    return "" if value is None else shown


def view(sid: str) -> None:
    rep = sweep_report(store, sid)
    sweep = rep["sweep"]
    counts = sweep["counts"]
    done = sum(n for k, n in counts.items() if k not in ("queued", "running", "stopping"))
    c1, c2, c3, c4 = st.columns(4)
    c1.metric("Status", sweep["status"])
    c2.metric("Cells ended", f"{done} / {sweep['cells']}",
              help="Cells that finished, stopped or failed, of all the sweep's cells.")
    c3.metric("At once", sweep.get("max_parallel") or "-")
    c4.metric("Backend", sweep.get("backend") or "local")
    st.progress(done / max(1, sweep["cells"]),
                text=" · ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    b1, b2, _ = st.columns([1, 1, 1])  # each label whole at 1024 px, sidebar open
    live = sweep["status"] in LIVE
    b1.button("Stop sweep", key="sw-stop", disabled=not live, on_click=_stop, args=(sid,),
              icon=":material/stop_circle:", width="stretch")
    resumable = any(k in ("stopped", "crashed", "failed") for k in counts)
    b2.button("Resume sweep", key="sw-resume", disabled=live or not resumable,
              on_click=_resume, args=(sid,), icon=":material/play_circle:",
              width="stretch")
    note = st.session_state.pop("sw-note", None)
    if note:
        st.info(note, icon=":material/info:")

    metric = rep["metric"] or "score"
    scope = runs.sweep_scope(rep["cells"])  # a dense baseline's 1x names none
    st.plotly_chart(plots.sweep_pareto(rep, f"{fmt.metric_label(metric)} vs compression reached",
                                       scope), width="stretch", key="sw-pareto")
    st.plotly_chart(plots.sweep_parcoords(rep, "Every cell across the swept keys"),
                    width="stretch", key="sw-parcoords")
    st.subheader("Per grid point", anchor=False)
    # figures as text: accuracies in percent, a pending value blank, no spread for one
    # seed (comera_engine.metrics.format_metric), nor in the header when no point has one
    spread = any(g["score_std"] is not None for g in rep["groups"])
    # the cells' memory: their peak GPU memory on a GPU, else their process memory
    kinds = sorted({runs.SWEEP_MEMORY_KINDS[c["peak_mem_metric"]] for c in rep["cells"]
                    if c["peak_mem_mb"] is not None})
    memory = " / ".join(fmt.memory_label(k) for k in kinds) or fmt.memory_label("gpu_peak")
    score = f"{metric} (mean ± std over seeds)" if spread else metric
    ui.table(
        [{"grid point": g["label"], "target": g["target"],
          score: format_metric(metric, g["score"], g["score_std"]),
          "compression": "" if g["compression"] is None else fmt.ratio(g["compression"]) + (
              "" if g["compression_std"] is None else f" ± {g['compression_std']:.1f}"),
          "scope": scope, "model size": _text(g.get("bytes"), fmt.nbytes(g.get("bytes"))),
          "finished": f"{g['finished']}/{g['cells']}", "Pareto": g["pareto"],
          "step time": _text(g["step_time_s"], f"{g['step_time_s'] or 0:.4f} s"),
          memory: _text(g["peak_mem_mb"], fmt.mib(g["peak_mem_mb"]))}
         for g in rep["groups"]],
        column_config={
            "target": st.column_config.NumberColumn(format="%g×"),
            "step time": st.column_config.TextColumn(
                help="Each finished cell's median training step, averaged "
                "over the seeds; cells that ran side by side share the machine, and each "
                "step time carries that load."),
            memory: st.column_config.TextColumn(help=" ".join(
                fmt.memory_help(k) for k in kinds or ["gpu_peak"]) + " The mean over the "
                "grid point's finished cells."),
        })
    st.subheader("Cells", anchor=False)
    ui.table(
        [{"run": f"/live_run?run={c['run']}", "cell": c["label"], "status": c["status"],
          "step": _text(c["step"], f"{c['step'] or 0:,}"),
          metric: format_metric(metric, c["score"]),
          "compression": "" if c["compression"] is None else fmt.ratio(c["compression"]),
          "scope": SCOPE_LABELS[c["scope"]],
          "params": _text(c["params"], fmt.count(c["params"])),
          "model size": _text(c.get("bytes"), fmt.nbytes(c.get("bytes")))}
         for c in rep["cells"]],
        column_config={
            "run": st.column_config.LinkColumn("run", display_text=r"run=(.*)$",
                                               help="Open the cell's Live run page"),
        })


def _history(sid: str) -> list[dict]:
    cells = sweep_report(store, sid)["cells"]
    return runs.metric_history(store, [c["run"] for c in cells],
                               {c["run"]: c["label"] for c in cells})


def downloads(sid: str) -> None:
    """Every cell's metric history, read when a button is pressed."""
    d1, d2, _ = st.columns([1, 1, 1])
    d1.download_button("Metrics of every cell (CSV)", key="sw-dl-csv",
                       icon=":material/download:",
                       data=lambda: runs.history_csv(_history(sid)),
                       file_name=f"{sid}-metrics.csv", mime="text/csv", on_click="ignore")
    d2.download_button("Metrics of every cell (JSON)", key="sw-dl-json",
                       icon=":material/download:",
                       data=lambda: runs.history_json(_history(sid)),
                       file_name=f"{sid}-metrics.json", mime="application/json",
                       on_click="ignore")


def page() -> None:
    """One pass of the page: the picker, the chosen sweep and its downloads, every
    status read from the store again (each pass, every REFRESH_S while a sweep was live
    when the page was drawn); once that changes, the page is drawn anew (with or without
    its refresh)."""
    now = store.list_sweeps()
    if not now:  # deleted meanwhile: the page says there is none
        st.rerun()
    sid = pick(now)
    view(sid)
    downloads(sid)
    if LIVE_AT_START != any(s["status"] in LIVE for s in now):
        st.rerun()


st.fragment(page, run_every=REFRESH_S if LIVE_AT_START else None)()
if LIVE_AT_START:
    st.caption(f":material/autorenew: Refreshing every {REFRESH_S:g} s while a sweep runs.")
