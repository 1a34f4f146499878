"""Live run: metrics, ranks, memory and events of one run, refreshed every second.

The charts are in-place charts (:mod:`app.lib.livechart`): a refresh hands each one its
new figure, and none is taken down and drawn again."""

from __future__ import annotations

import math
import time
from typing import Any

import streamlit as st

from app.lib import fmt, plots, runs, ui
from app.lib.livechart import live_chart
from comera_engine.metrics import SCOPE_LABELS
from comera_engine.store import StoreError

REFRESH_S = 1.0
MAX_POINTS = 800
LOG_LINES = 30

store = ui.store_page(
    "Live run",
    "Loss, accuracy, compression against the target and the ranks the gates keep, "
    "refreshed every second while the run lives.",
    ":material/monitoring:",
)
ui.launch_note()
all_runs = ui.runs_or_stop(
    store, "Launch a run and it appears here, updating every second.", "live")

chosen = ui.pick_run(store, "Run", "live-run", all_runs)
assert chosen is not None
RID = chosen["id"]
LIVE_AT_START = runs.is_live(chosen)
#: What the page reads, through a session memo: a busy store redraws the last answers.
DB = ui.steady(store, "live")


def _series(db: ui.SteadyReads, rid: str, name: str) -> tuple[list[int], list[float]]:
    s = db.series(rid, name, max_points=MAX_POINTS)
    return s["step"], s["value"]


def _last(values: list[float]) -> float | None:
    for v in reversed(values):
        if v is not None and math.isfinite(v):
            return v
    return None


def _device_text(run: dict[str, Any], latest: dict[str, float]) -> str:
    if run.get("gpus"):
        return f"GPU {run['gpus']}"
    dev = str(run.get("device") or "auto")
    if dev == "auto":
        if "mem/rss_mb" in latest:
            return "CPU"
        if "mem/cuda_max_allocated_mb" in latest:
            return "GPU"
    return dev.upper() if dev == "cpu" else dev


def controls(run: dict[str, Any]) -> None:
    from comera_engine.launch import LaunchError, resume, stop

    status = run["status"]
    c1, c2, _ = st.columns([1, 1, 2])  # "Resume" whole at 1024 px, sidebar open
    can_stop = status in ("queued", "running")
    if c1.button("Stop", key="stop", icon=":material/stop:", disabled=not can_stop,
                 help="Graceful stop: the trainer writes a checkpoint and reports 'stopped'.",
                 width="stretch"):
        try:
            new = stop(run["id"], store=store, wait=False)
            st.toast(f"Stop requested ({new})", icon=":material/stop_circle:")
        except (LaunchError, ValueError) as e:
            st.error(str(e))
    can_resume, why = runs.resume_offer(store, run)
    if c2.button("Resume", key="resume", icon=":material/play_arrow:", disabled=not can_resume,
                 help=why, width="stretch"):
        try:
            resume(run["id"], store=store)
            st.toast(f"Resume requested. {why}", icon=":material/play_circle:")
            st.rerun()  # the page switches back to live refreshing
        except (LaunchError, ValueError) as e:
            st.error(str(e))
    if status in runs.RESUMABLE_STATUSES and not can_resume:
        st.caption(f":material/block: Not resumable. {why}")
    elif status in runs.RESUMABLE_STATUSES:  # where a resume starts: its checkpoint's step
        st.caption(f":material/restart_alt: Resume: {why[0].lower()}{why[1:]}")


def header(run: dict[str, Any], latest: dict[str, float]) -> None:
    total = runs.total_steps(run) or 0
    step = int(run.get("last_step") or 0)
    st.markdown(f"### {fmt.literal(run['name'])} &nbsp; {fmt.status_badge(run['status'])}")
    started = run.get("started_at")
    end = run.get("ended_at") or time.time()
    elapsed = (end - started) if started else None
    eta = None
    if runs.is_live(run) and started and step > 0 and total:
        # the trainer's own figure: the median step of the last 50 times the steps left
        # (older runs: the time since the start, which counts the start-up)
        eta = latest.get("perf/eta_s")
        if eta is None:
            eta = elapsed / step * (total - step) if elapsed else None
    stage = latest.get("stage")
    stage_txt = "" if stage is None else (" · late stage" if stage >= 0.5 else " · early stage")
    phase = runs.phase_of(run)
    st.caption(
        f"`{run['id']}` · {_device_text(run, latest)}"
        f" · started {fmt.clock(started)} · elapsed {fmt.duration(elapsed)}"
        + (f" · ETA {fmt.duration(eta)}" if eta is not None else "") + stage_txt
        + (f" · now {phase[0]}" if phase else "")
    )
    st.progress(min(1.0, step / total) if total else 0.0, text=f"step {step:,} of {total:,}")
    phase_note(phase)


def phase_note(phase: tuple[str, float | None] | None) -> None:
    """What a live run is doing besides stepping: a progress bar for a phase whose
    progress is known (evaluating), a note while it is not (preparing data, training a
    tokenizer, building). Training itself is the step bar above."""
    if phase is None or phase[0] == "done" or phase == ("training", None):
        return
    name, progress = phase
    if progress is None:
        st.info(runs.phase_text(name), icon=":material/hourglass_top:")
    else:
        st.progress(progress, text=runs.phase_text(name, progress))


def kpis(run: dict[str, Any], latest: dict[str, float], tput: tuple[str, float | None],
         mem: tuple[str, str, str | None]) -> None:
    """The run's tiles; ``mem``: its memory tile, ``(kind, value, delta)`` (the kind
    names it: ``app.lib.fmt.MEMORY``)."""
    total = runs.total_steps(run) or 0
    step = int(run.get("last_step") or 0)
    target = runs.target_of(run)
    comp = runs.compression(run, latest)
    acc_name = "eval/acc" if "eval/acc" in latest else "acc/train"
    c = ui.tile_columns(6)  # rows of 3: each value fits its tile at 1024 px
    c[0].metric("Step", f"{step:,}", delta=f"of {total:,}", delta_color="off",
                delta_arrow="off")
    c[1].metric("Task loss", fmt.num(latest.get("loss/task")),
                delta=f"total {fmt.num(latest.get('loss/total'))}", delta_color="off",
                delta_arrow="off")
    c[2].metric("Eval accuracy" if acc_name == "eval/acc" else "Train accuracy",
                fmt.pct(latest.get(acc_name)))
    baseline = runs.is_baseline(run)
    c[3].metric(f"Compression ({comp.label})", fmt.ratio(comp.value),
                delta=f"target {fmt.ratio(target)}" if target else
                "dense model" if baseline else "no target",
                delta_color="off", delta_arrow="off",
                help=runs.DENSE_HELP if baseline else
                f"Dense / effective parameters of the {comp.label}: the scope the "
                "run's target is measured on (comera.target_scope); every page shows "
                "this figure.")
    c[4].metric(tput[0], fmt.count(tput[1]),
                help="Training throughput on the trainer's own clock, over its last 50 "
                     "steps (the wait for each batch counted; evaluations and checkpoints "
                     "not).")
    c[5].metric(fmt.memory_label(mem[0]), mem[1], delta=mem[2], delta_color="off",
                delta_arrow="off", help=fmt.memory_help(mem[0]))


def charts(run: dict[str, Any], latest: dict[str, float]) -> None:
    rid = run["id"]
    stages = runs.stage_steps(DB, rid)
    c1, c2 = st.columns(2)
    with c1:
        s_task = _series(DB, rid, "loss/task")
        s_total = _series(DB, rid, "loss/total")
        live_chart(plots.lines_spec([("task loss", *s_task), ("total (objective)", *s_total)],
                               "Loss", "loss", stages=stages, smooth=0.1,
                               dashes=[None, "dash"]), key="ch-loss")
    with c2:
        s_tr = _series(DB, rid, "acc/train")
        s_ev = _series(DB, rid, "eval/acc")
        live_chart(
            plots.lines_spec([("train", *s_tr), ("eval", *s_ev)], "Accuracy", "accuracy",
                        stages=stages, smooth=0.1, percent=True), key="ch-acc",
        )
    c1, c2 = st.columns(2)
    with c1:
        target = runs.target_of(run)
        comp = runs.compression(run, latest)
        other = "model" if comp.scope == "tensorized" else "tensorized"
        series = [(comp.label, *_series(DB, rid, runs.target_metric(run)))]
        if f"compression/{other}" in latest:
            series.append((f"{SCOPE_LABELS[other]} (other scope)",
                           *_series(DB, rid, f"compression/{other}")))
        live_chart(
            plots.lines_spec(series, f"Compression vs dense ({comp.label})", "× smaller",
                        stages=stages, dashes=[None, "dot"],
                        hline=(target, f"target {target:g}× ({comp.label})")
                        if target else None), key="ch-comp",
        )
    with c2:
        name = "perf/tokens_per_s" if "perf/tokens_per_s" in latest else "perf/samples_per_s"
        live_chart(
            plots.lines_spec([(name.split("/")[1].replace("_per_s", "/s"),
                          *_series(DB, rid, name))], "Throughput",
                        "tokens/s" if "tokens" in name else "samples/s", stages=stages,
                        smooth=None), key="ch-tput",  # the trainer's smoothed figure
        )
    history = DB.rank_history(rid)
    c1, c2 = st.columns([3, 2])
    with c1:
        live_chart(plots.rank_heatmap_spec(history, stages=stages, until=run.get("last_step")),
                   key="ch-heat")
    with c2:
        live_chart(plots.rank_bars_spec(DB.latest_ranks(rid)), key="ch-bars")
    c1, c2 = st.columns(2)
    with c1:
        if on_gpu(latest):
            series = [(fmt.memory_label(kind), *_series(DB, rid, name)) for kind, name in (
                ("gpu_used", "mem/gpu_used_mb"), ("gpu_peak", "mem/cuda_max_allocated_mb"),
                ("gpu_reserved", "mem/cuda_max_reserved_mb"))]
            total = latest.get("mem/gpu_total_mb")
            fig = plots.lines_spec(series, "GPU memory", "MiB", stages=stages, from_zero=True,
                              hline=(total, f"device total {fmt.mib(total)}") if total else None)
        else:
            fig = plots.lines_spec(
                [(fmt.memory_label("rss"), *_series(DB, rid, "mem/rss_mb"))],
                f"{fmt.memory_label('rss')} (a CPU run)", "MiB", stages=stages, from_zero=True)
        live_chart(fig, key="ch-mem")
    with c2:
        if "sys/cpu_percent" in latest:  # what the trainer read of the machine
            steps, used = _series(DB, rid, "sys/ram_used_mb")
            _, total = _series(DB, rid, "sys/ram_total_mb")
            live_chart(plots.lines_spec(
                [("process CPU % (of one core)", *_series(DB, rid, "sys/cpu_percent")),
                 ("system RAM used %", steps, _percent(used, total))],
                "System (read by the trainer, once a second)", "%", stages=stages,
                from_zero=True), key="ch-sys")
    rates = sorted(k for k in latest if k.startswith("lr/"))
    if rates:  # each optimizer group's rate as the step ran (train.lr_schedule)
        c1, _ = st.columns(2)
        with c1:
            live_chart(plots.lines_spec(
                [(k.split("/", 1)[1], *_series(DB, rid, k)) for k in rates],
                "Learning rates (per optimizer group)", "rate", stages=stages, log_y=True),
                key="ch-lr")
    gpu_panel(rid, latest, stages)


def on_gpu(latest: dict[str, float]) -> bool:
    """Whether the run trains on a GPU, from what its trainer logged."""
    return any(k in latest for k in ("mem/gpu_used_mb", "mem/cuda_max_allocated_mb",
                                     "sys/gpu_util_percent"))


def _percent(part: list[float], whole: list[float]) -> list[float | None]:
    return [100.0 * p / w if p is not None and w else None for p, w in zip(part, whole)]


def gpu_panel(rid: str, latest: dict[str, float], stages: list[tuple[int, str]]) -> None:
    """The GPU's utilisation and used memory (percent of the device) as the trainer read
    them (``sys/gpu_util_percent`` from NVML once a second, ``mem/gpu_used_mb`` of
    ``mem/gpu_total_mb`` every step); one line instead of a chart on a CPU run."""
    if not on_gpu(latest):
        st.caption(":material/memory: GPU utilisation and memory: none to plot, this run "
                   "trains on the CPU.")
        return
    steps, used = _series(DB, rid, "mem/gpu_used_mb")
    _, total = _series(DB, rid, "mem/gpu_total_mb")
    series = [("GPU utilisation %", *_series(DB, rid, "sys/gpu_util_percent")),
              ("GPU memory used % (of the device)", steps, _percent(used, total))]
    live_chart(plots.lines_spec(series, "GPU utilisation and memory (read by the trainer)", "%",
                           stages=stages, from_zero=True), key="ch-gpu")
    if "sys/gpu_util_percent" not in latest:
        st.caption("GPU utilisation needs NVML in the trainer's environment "
                   "(`pip install nvidia-ml-py`); the memory is the CUDA runtime's.")


def events(run: dict[str, Any]) -> None:
    evs = DB.events(run["id"])
    rows = [
        {"time": fmt.clock(e["time"]),
         "step": "" if e.get("step") is None else str(e["step"]),
         "kind": str(e["kind"]).replace("_", " "), "text": e["text"]}
        for e in reversed(evs[-300:])
    ]
    c1, c2 = st.columns([3, 2])
    with c1:
        st.markdown("**Event log** (rank changes, stages, checkpoints, errors)")
        if rows:
            ui.table(rows, height=280,
                         column_config={
                             "time": st.column_config.TextColumn(width=70),
                             "step": st.column_config.TextColumn(width=50),
                             "kind": st.column_config.TextColumn(width=95),
                             "text": st.column_config.TextColumn(width="large"),
                         })
        else:
            st.caption("No events yet.")
    with c2:
        from comera_engine.launch import logs

        st.markdown(f"**Trainer log** (last {LOG_LINES} lines, newest at the bottom)")
        try:
            tail = logs(run["id"], tail=LOG_LINES, store=store)
        except Exception as e:  # noqa: BLE001
            tail = f"(log unavailable: {e})"
        # the whole tail, wrapped: nothing clipped, the newest line always in view
        st.code(tail.rstrip("\n") or "(empty)", language=None, wrap_lines=True)


def view() -> None:
    DB.busy = 0
    try:
        _view()
    except StoreError as e:  # busy before anything was read once: the next pass retries
        st.warning(f"The run store is busy ({e}); retrying…", icon=":material/sync_problem:")


def _view() -> None:
    """One pass of the page. Its parts sit in containers created in a fixed order, so a
    part that grows or shrinks (a phase bar, a banner) never shifts the charts below it:
    every chart keeps its place and updates in place, and none is taken down and drawn
    again between refreshes."""
    ui.reap(store)  # a trainer that vanished shows up as crashed while we watch
    run = DB.get_run(RID)
    if run is None:
        st.warning(f"Run {RID} is gone from the store.")
        return
    top, notes, tiles, body, log = (st.container() for _ in range(5))
    latest = runs.final_metrics(DB, RID)
    with top:
        header(run, latest)
        controls(run)
    with notes:
        if run["status"] in ("failed", "crashed", "diverged") and run.get("error"):
            err = str(run["error"])
            first = err.strip().splitlines()[-1] if err.strip() else err
            said = first.removeprefix(f"{run['status']}:").strip()  # once, not "crashed: crashed:"
            st.error(f"**{run['status']}**: {said}", icon=":material/error:")
            with st.expander("Full error"):
                st.code(err, language=None)
        elif run["status"] == "queued" and runs.phase_of(run) is None:
            st.info("Queued: the trainer is starting (building the dataset and the model)…",
                    icon=":material/hourglass_top:")
        for level, text in runs.notices(DB, run):
            icon = {"success": ":material/check_circle:", "warning": ":material/warning:",
                    "info": ":material/info:"}[level]
            getattr(st, level)(text, icon=icon)
    if "perf/tokens_per_s" in latest:
        tput = ("Tokens / s", latest.get("perf/tokens_per_s"))
    else:
        tput = ("Samples / s", latest.get("perf/samples_per_s"))
    if "mem/cuda_max_allocated_mb" in latest:  # the chart beside has the device's figure
        mem = ("gpu_peak", fmt.mib(latest.get("mem/cuda_max_allocated_mb")),
               f"device {fmt.mib(latest['mem/gpu_used_mb'])} used"
               if "mem/gpu_used_mb" in latest else None)
    else:
        mem = ("rss", fmt.mib(latest.get("mem/rss_mb")), None)
    with tiles:
        kpis(run, latest, tput, mem)
    with body:
        if runs.is_live(run) and not latest:  # nothing to plot yet: no empty charts
            st.caption(":material/hourglass_top: The charts appear with the first training "
                       "step.")
        else:
            charts(run, latest)
    with log:
        events(run)
    if LIVE_AT_START != runs.is_live(run):
        st.rerun()  # the run started or ended: rebuild with(out) the 1 s refresh


# Elements a refresh has not redrawn yet are "stale"; Streamlit fades them, which on a
# page redrawn every second reads as flicker. They are current to within a second: keep
# them opaque.
st.html("<style>[data-stale='true'] { opacity: 1 !important; transition: none !important; }"
        "</style>")
st.fragment(view, run_every=REFRESH_S if LIVE_AT_START else None)()
def _about(run: dict[str, Any]) -> None:
    """Name, notes and tags of the run, and archive / restore (nothing is deleted)."""
    from comera_engine.config import check_run_name
    from comera_engine.errors import ConfigError

    archived = bool(run.get("archived_at"))
    with st.expander("Name, notes and tags" + (" · archived" if archived else ""),
                     icon=":material/edit_note:"):
        name = st.text_input("Name", value=run["name"], key=f"about-name-{RID}")
        notes = st.text_area("Notes", value=run.get("notes") or "", key=f"about-notes-{RID}",
                             help="What you tried and what you saw: kept with the run.")
        tags = st.text_input("Tags", value=", ".join(run.get("tags") or []),
                             key=f"about-tags-{RID}", help="Words, separated by commas.")
        c1, c2, _ = st.columns([1, 1, 2])
        if c1.button("Save", key="about-save", icon=":material/save:"):
            try:
                name = check_run_name(name)
                taken = {r["name"] for r in store.list_runs() if r["id"] != RID}
                if name in taken:  # names pick a run (`comera export NAME`): one each
                    raise ConfigError("name", f"another run is called {name!r}; choose "
                                              f"another, e.g. {runs.unique_name(name, taken)!r}")
                store.update_run(RID, name=name)
                store.set_notes(RID, notes)
                store.set_tags(RID, tags.split(","))
            except (ConfigError, ValueError) as e:
                st.error(str(e), icon=":material/error:")
            else:
                st.toast("Saved", icon=":material/check:")
                st.rerun()
        if archived:
            if c2.button("Restore", key="about-restore", icon=":material/unarchive:",
                         help="Back in the run lists."):
                store.archive_run(RID, False)
                st.rerun()
        elif c2.button("Archive", key="about-archive", icon=":material/archive:",
                       disabled=runs.is_live(run),
                       help="Hidden from the Overview's list (shown with \"Show archived\") "
                            "until restored here; nothing is deleted."):
            store.archive_run(RID)
            st.rerun()


_about(store.get_run(RID) or chosen)
d1, d2, _ = st.columns([1, 1, 1])  # the metric history, read when the button is pressed
d1.download_button("Metrics (CSV)", key="dl-csv", icon=":material/download:",
                   data=lambda: runs.history_csv(runs.metric_history(store, [RID])),
                   file_name=f"{RID}-metrics.csv", mime="text/csv", on_click="ignore",
                   help="Every metric the run logged, one row per step.")
d2.download_button("Metrics (JSON)", key="dl-json", icon=":material/download:",
                   data=lambda: runs.history_json(runs.metric_history(store, [RID])),
                   file_name=f"{RID}-metrics.json", mime="application/json",
                   on_click="ignore", help="Every metric the run logged: [step, value] "
                   "pairs per metric.")
if LIVE_AT_START:
    st.caption(f":material/autorenew: Refreshing every {REFRESH_S:g} s while the run lives.")
