"""Run-store access for the dashboard: the store, a double-launch guard, run summaries.

The store's location comes from the server's environment (``COMERA_HOME``, else
``./runs``), never from the browser.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from comera_engine.metrics import (
    SCOPE_LABELS,
    Compression,
    compression_metric,
    is_dense_baseline,
    run_compression,
    run_target,
    target_status,
)
from comera_engine.preview import method_label
from comera_engine.store import (
    ACTIVE_STATUSES,
    FINAL_STATUSES,
    RESUMABLE_STATUSES,
    RunStore,
    resolve_store_path,
)

__all__ = [
    "ACTIVE_STATUSES",
    "DENSE_HELP",
    "FINAL_STATUSES",
    "FROM_TARGET",
    "HISTORY_IDS",
    "RESUMABLE_STATUSES",
    "SWEEP_MEMORY_KINDS",
    "checkpoints",
    "compression",
    "config_diff",
    "config_fields",
    "config_token",
    "final_metrics",
    "dataset_of",
    "duration_s",
    "flatten",
    "history_csv",
    "history_json",
    "metric_history",
    "percent",
    "guarded_launch",
    "guarded_sweep",
    "is_live",
    "notices",
    "open_store",
    "phase_of",
    "phase_text",
    "ranks_from_target",
    "resolved_config",
    "peak_memory_mb",
    "resume_offer",
    "run_label",
    "stage_steps",
    "store_path",
    "summary_rows",
    "sweep_scope",
    "target_metric",
    "threads_now",
    "unique_name",
]

#: Store setting prefix that maps a launch token to the run it started.
TOKEN_PREFIX = "launch_token:"
#: Store setting prefix that maps a sweep form's token to the sweep it started.
SWEEP_TOKEN_PREFIX = "sweep_token:"
_LOCK_NAME = ".launch.lock"
_thread_lock = threading.Lock()


def store_path() -> Path:
    """The run store database the server uses (``$COMERA_HOME/comera.db``)."""
    return resolve_store_path(None)


def open_store() -> RunStore:
    """Open (creating if needed) the server's run store."""
    return RunStore(store_path())


# ------------------------------------------------------------------ launching, once


@contextlib.contextmanager
def launch_lock(store: RunStore) -> Iterator[None]:
    """Serialise launches across threads (browser sessions) and processes (servers)
    sharing one store: a thread lock plus an exclusive ``flock`` on
    ``<store dir>/.launch.lock``."""
    with _thread_lock:
        store.root.mkdir(parents=True, exist_ok=True)
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows: the thread lock only
            yield
            return
        with open(store.root / _LOCK_NAME, "a+") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def config_token(nonce: str, config: Mapping[str, Any], extra: Mapping[str, Any] | None = None
                 ) -> str:
    """Idempotency token of one form submission: the form's nonce plus a hash of what
    would be launched (so a double click or a resubmission maps to the same token)."""
    blob = json.dumps({"c": config, "x": dict(extra or {})}, sort_keys=True, default=str)
    return f"{nonce}:{hashlib.sha256(blob.encode()).hexdigest()[:16]}"


def launched_run(store: RunStore, token: str) -> str | None:
    """The run a token already started (and that still exists), else ``None``."""
    rid = store.get_setting(TOKEN_PREFIX + token)
    if rid and store.get_run(str(rid)) is not None:
        return str(rid)
    return None


def unique_name(name: str, taken: Iterable[str]) -> str:
    """``name`` when no name in ``taken`` is it, else the first free ``name #2``,
    ``name #3``, ... (cut to the longest run name the engine takes)."""
    from comera_engine.config import MAX_NAME

    taken = set(taken)
    if name not in taken:
        return name
    n = 2
    while (numbered := f"{name[:MAX_NAME - len(f' #{n}')]} #{n}") in taken:
        n += 1
    return numbered


def guarded_launch(
    store: RunStore,
    config: Mapping[str, Any],
    token: str,
    *,
    name: str | None = None,
    gpus: str | None = None,
    unique: bool = False,
) -> tuple[str, bool]:
    """Launch ``config`` once per ``token``: returns ``(run_id, started_now)``.

    The check-and-launch runs under :func:`launch_lock`, and the token is recorded in the
    store, so a double click, a resubmitted form or two browser sessions pressing the same
    button start one run; the second caller gets the first caller's run id. ``unique``:
    the run's name (the config's) is made one no run in the store has yet
    (:func:`unique_name`), under the same lock.
    """
    from comera_engine.launch import launch

    with launch_lock(store):
        existing = launched_run(store, token)
        if existing is not None:
            return existing, False
        if unique:
            config = {**config, "name": unique_name(
                str(config.get("name") or ""), (r["name"] for r in store.list_runs()))}
        rid = launch(dict(config), store=store, name=name, gpus=gpus)
        store.set_setting(TOKEN_PREFIX + token, rid)
        return rid, True


def launched_sweep(store: RunStore, token: str) -> str | None:
    """The sweep a token already started (and that still exists), else ``None``."""
    sid = store.get_setting(SWEEP_TOKEN_PREFIX + token)
    return str(sid) if sid and store.get_sweep(str(sid)) is not None else None


def guarded_sweep(
    store: RunStore,
    config: Mapping[str, Any],
    token: str,
    grid: Mapping[str, list[Any]],
    seeds: int,
    *,
    max_parallel: int | None = None,
    gpus: str | None = None,
) -> tuple[str, bool]:
    """Start a sweep of ``config`` once per ``token`` (see :func:`guarded_launch`):
    returns ``(sweep_id, started_now)``."""
    from comera_engine.launch.sweep import create_sweep
    from comera_engine.preview import check_runnable

    with launch_lock(store):
        existing = launched_sweep(store, token)
        if existing is not None:
            return existing, False
        sid = create_sweep(dict(config), grid, seeds, store=store, max_parallel=max_parallel,
                           gpus=gpus, check=check_runnable)  # every cell, as launch checks
        store.set_setting(SWEEP_TOKEN_PREFIX + token, sid)
        return sid, True


def parse_targets(text: str) -> list[float]:
    """``"5, 10, 30x"`` -> ``[5.0, 10.0, 30.0]``; raises ValueError naming the field."""
    out: list[float] = []
    for part in text.replace(";", ",").split(","):
        part = part.strip().rstrip("x×").strip()
        if not part:
            continue
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"targets: {part!r} is not a number; give e.g. 5, 10, 30, 100"
                             ) from None
        if not math.isfinite(value) or value <= 1.0:
            raise ValueError(f"targets: {part} must be a compression above 1×")
        if value not in out:
            out.append(value)
    if not out:
        raise ValueError("targets: give at least one target, e.g. 5, 10, 30, 100")
    return out


# ------------------------------------------------------------------ run facts


def is_live(run: Mapping[str, Any]) -> bool:
    """Queued, running or stopping: a run whose page should keep refreshing."""
    return run.get("status") in ("queued", *ACTIVE_STATUSES)


def phase_of(run: Mapping[str, Any]) -> tuple[str, float | None] | None:
    """``(phase, progress)`` of a live run that has reported one (progress 0..1, or
    ``None`` while unknown); ``None`` for a run that is over or has said nothing yet."""
    phase = run.get("phase")
    if not phase or not is_live(run):
        return None
    progress = run.get("phase_progress")
    return str(phase), (None if progress is None else min(1.0, max(0.0, float(progress))))


def phase_text(phase: str, progress: float | None = None) -> str:
    """``"Evaluating · 40 %"``, or ``"Preparing data…"`` while the progress is unknown."""
    name = phase[:1].upper() + phase[1:]
    return f"{name}…" if progress is None else f"{name} · {progress * 100:.0f} %"


def run_label(run: Mapping[str, Any]) -> str:
    return f"{run['name']} · {run['id']} · {run['status']}"


def total_steps(run: Mapping[str, Any]) -> int | None:
    try:
        return int(run["config"]["train"]["steps"])
    except (KeyError, TypeError, ValueError):
        return None


def target_of(run: Mapping[str, Any]) -> float | None:
    """The compression the run asks for (:func:`comera_engine.metrics.run_target`)."""
    return run_target(run.get("config"))


def is_dense(run: Mapping[str, Any]) -> bool:
    try:
        return bool(run["config"]["model"].get("dense", False))
    except (KeyError, TypeError, AttributeError):
        return False


def is_baseline(run: Mapping[str, Any]) -> bool:
    """The run trained the dense model as it is: the baseline the others are measured
    against (:func:`comera_engine.metrics.is_dense_baseline`)."""
    return is_dense_baseline(run.get("config"))


def distinct_labels(labels: Sequence[str]) -> list[str]:
    """``labels`` less the words all of them start with: ``["sweep digits comera · 10×",
    "sweep digits fixed · 10×"]`` → ``["comera · 10×", "fixed · 10×"]``. Unchanged for a
    single label, or where a label would be left with nothing."""
    if len(labels) < 2:
        return list(labels)
    words = [label.split(" ") for label in labels]
    common = 0
    while (all(len(w) > common + 1 for w in words)
           and len({w[common] for w in words}) == 1):
        common += 1
    return [" ".join(w[common:]) for w in words]


def target_metric(run: Mapping[str, Any]) -> str:
    """The compression metric the run's figure (and target) is measured on (the scope
    :func:`compression` states it in)."""
    return compression_metric(compression(run, {}).scope)


#: What a dense baseline's compression is, for the pages' help beside it.
DENSE_HELP = ("The dense baseline trains the dense model itself: no TT layers, so its "
              "figure is the whole model's, 1× by definition. The other runs are measured "
              "against it.")


def compression(run: Mapping[str, Any], latest: Mapping[str, Any]) -> Compression:
    """The run's one compression figure with its scope (``latest``: its latest metrics):
    what every page shows (:func:`comera_engine.metrics.run_compression`: a dense
    baseline's is the whole model's, 1×)."""
    return run_compression(run.get("config"), latest)


def final_metrics(store: RunStore, run_id: str) -> dict[str, float]:
    """Each metric's value at its latest step."""
    return {k: v for k, (_, v) in store.latest_metrics(run_id).items()}


#: Bytes per trained parameter in memory: fp32 weight and gradient, AdamW's two moments.
TRAIN_BYTES_PER_PARAM = 16


def peak_memory_mb(store: RunStore, run_id: str) -> tuple[float | None, str]:
    """The run's peak memory in MiB and its kind (``app.lib.fmt.MEMORY``): on a GPU,
    ``"gpu_peak"``, torch's peak allocated (weights, gradients, optimizer state, saved
    activations); on a CPU, ``"model_state"``, its model and optimizer state (the most
    parameters it allocated x 16 bytes), the memory the method changes (the process RSS
    is mostly the interpreter and libraries, the same for every run); ``(None, "")``
    when it logged neither."""
    def peak(name: str) -> float | None:
        s = store.series(run_id, name, max_points=500)
        vals = [v for v in s["value"] if isinstance(v, float) and math.isfinite(v)]
        return max(vals) if vals else None

    gpu = peak("mem/cuda_max_allocated_mb")
    if gpu is not None:
        return gpu, "gpu_peak"
    params = peak("params/allocated")
    if params is not None:
        return params * TRAIN_BYTES_PER_PARAM / 2**20, "model_state"
    return None, ""


def sweep_scope(cells: Sequence[Mapping[str, Any]]) -> str:
    """The scope a sweep's compressions are stated in (its table's column, its front's
    axis), from its ``cells`` (``sweep_report``'s): the TT cells' scope. A dense baseline
    (a cell's ``baseline``) is 1× in any scope, so its cells (stated in the whole
    model's) name none: the label says a mix only where the other cells' scopes differ;
    a sweep of dense baselines alone is the whole model's."""
    scopes = sorted({SCOPE_LABELS[c["scope"]] for c in cells if not c.get("baseline")})
    dense = any(c.get("baseline") for c in cells)
    return " / ".join(scopes) or (SCOPE_LABELS["model"] if dense else "–")


#: The kind (``app.lib.fmt.MEMORY``) of the memory metric a sweep cell's peak memory is
#: (``sweep_report``'s ``peak_mem_metric``).
SWEEP_MEMORY_KINDS = {"mem/cuda_max_allocated_mb": "gpu_peak", "mem/rss_mb": "rss"}


def stage_steps(store: RunStore, run_id: str) -> list[tuple[int, str]]:
    """``(step, text)`` of every stage switch (the trainer's ``stage`` events)."""
    out = []
    for e in store.events(run_id, kinds=["stage"]):
        if e.get("step") is not None:
            out.append((int(e["step"]), str(e["text"])))
    return out


def notices(store: RunStore, run: Mapping[str, Any]) -> list[tuple[str, str]]:
    """What the Live page states above the charts, as ``(level, text)`` with level
    ``success``/``warning``/``info``: where the run stands with its target (a verdict,
    the trainer's ``target`` event, only for a run that finished its steps: a miss is a
    warning; otherwise its progress toward the target, never an old verdict of an
    attempt that was stopped and resumed), the moment its ranks were fixed at the target
    (``pace``), the CPU threads it trains on while it is in flight (``threads``:
    :func:`threads_now`), the TT paths its step runs (``paths``: the planner's choice per op and
    where its times came from) and every slower path the trainer fell back to
    (``slow_path``: e.g. a CUDA graph capture that failed)."""
    out: list[tuple[str, str]] = []
    rid = run["id"]
    step = int(run.get("last_step") or 0)
    stalled = store.stalled_for(rid)  # by id: a steady read's key stays small
    if stalled is not None:
        out.append(("warning", f"Stalled: no step for {stalled:.0f} s (at step {step:,}); "
                    "the trainer may be frozen or starved. Stop resumes it to write its "
                    "checkpoint first."))
    evs = store.events(rid, kinds=["target", "pace", "slow_path", "threads", "paths"])
    finals = [e for e in evs if e["kind"] == "target" and (e.get("step") or 0) >= step]
    target = target_of(run)
    if run.get("status") == "finished" and finals:
        text = str(finals[-1]["text"])
        out.append(("warning" if "missed" in text else "success", text))
    elif target is not None and not is_dense(run):
        reached = compression(run, store.latest_metrics(rid)).value
        if reached is not None:
            out.append(("info", target_status(target, reached, str(run.get("status")), step,
                                              total_steps(run))))
    fixed = [e for e in evs if e["kind"] == "pace" and "ranks fixed" in str(e["text"])]
    if fixed and not (run.get("status") == "finished" and finals):
        out.append(("info", str(fixed[-1]["text"])))
    threads = [e for e in evs if e["kind"] == "threads"]
    now = threads_now(store, run, str(threads[-1]["text"])) if threads else None
    if now:
        out.append(("info", f"CPU threads: {now}"))
    paths = [e for e in evs if e["kind"] == "paths"]
    if paths:
        out.append(("info", f"TT paths: {paths[-1]['text']}"))
    seen = set()
    for e in evs:
        if e["kind"] == "slow_path" and e["text"] not in seen:
            seen.add(e["text"])
            out.append(("warning", f"Slower path at step {e.get('step')}: {e['text']}"))
    return out


#: The count of runs in flight in a ``threads`` event's text (the launcher's, the
#: trainer's: "1 thread(s): 2 cores shared by 3 run(s) in flight").
_IN_FLIGHT = re.compile(r"\b\d+ run\(s\) in flight")


def threads_now(store: RunStore, run: Mapping[str, Any], text: str) -> str | None:
    """What the run's last ``threads`` event (``text``) says as the page is drawn: only
    while the run is in flight (running, stopping, or dispatched and starting: the
    store's active runs), with the runs in flight on its host counted now (the event
    counted them when its threads were last set); ``None`` once it is over."""
    from comera_engine.launch.threads import runs_in_flight

    if run.get("id") not in {r["id"] for r in store.active_runs()}:
        return None
    count = f"{max(1, runs_in_flight(store, run.get('host') or None))} run(s) in flight"
    said, n = _IN_FLIGHT.subn(count, text)
    return said if n else f"{text} ({count} now)"


def checkpoints(store: RunStore, run_id: str) -> list[dict[str, Any]]:
    """Checkpoints of a run that still exist on disk, newest first:
    ``{"step", "path", "size", "label"}``."""
    seen: dict[str, dict[str, Any]] = {}
    for a in store.artifacts(run_id, kind="checkpoint"):
        if not a.get("exists"):
            continue
        p = Path(a["path"])
        step = None
        digits = "".join(ch for ch in p.stem if ch.isdigit())
        if digits:
            step = int(digits)
        seen[str(p)] = {"step": step, "path": str(p), "size": a.get("size")}
    try:
        from comera_engine.launch import checkpoint_steps

        run_dir = store.run_dir(run_id)
        for s in checkpoint_steps(run_dir):
            p = run_dir / "checkpoints" / f"step_{s:06d}.safetensors"
            if str(p) not in seen and p.exists():
                seen[str(p)] = {"step": s, "path": str(p), "size": p.stat().st_size}
    except Exception:  # noqa: BLE001 - listing is best effort
        pass
    rows = sorted(seen.values(), key=lambda r: (r["step"] is None, -(r["step"] or 0)))
    for r in rows:
        r["label"] = f"step {r['step']}" if r["step"] is not None else Path(r["path"]).name
    return rows


#: :func:`resume_offer`'s verdicts by run folder: ``(stamp, verdict)``
_OFFERS: dict[str, tuple[tuple, tuple[bool, str]]] = {}
_OFFERS_KEPT = 256


def _folder_stamp(folder: Path, config_name: str) -> tuple:
    """What a resume's verdict depends on in a run folder, cheaply: the config file's and
    every checkpoint file's size and modification time (a write changes one or the
    other)."""
    def stat(path: Path) -> tuple[str, int, int] | None:
        try:
            info = path.stat()
        except OSError:
            return None
        return path.name, info.st_size, info.st_mtime_ns

    try:
        ckpts = sorted(os.scandir(folder / "checkpoints"), key=lambda e: e.name)
    except OSError:
        ckpts = []
    return (stat(folder / config_name),
            tuple(stat(Path(e.path)) for e in ckpts if e.is_file()))


def resume_offer(store: RunStore, run: Mapping[str, Any]) -> tuple[bool, str]:
    """Whether a resume of ``run`` can work, and what the Resume button says of it (its
    help): the launcher's own rule (:func:`comera_engine.launch.runs.resume_from`).

    The rule reads every checkpoint back and checks its SHA-256, which a large model's
    checkpoints make slow; the verdict is kept until the run's status or a file in its
    folder changes (size or modification time), so a page pass over an unchanged run
    hashes nothing. The launcher's resume checks afresh either way."""
    from comera_engine.launch.runs import CONFIG_FILENAME, resume_from

    folder = store.run_dir(str(run["id"]))
    stamp = (run.get("status"), run.get("sweep_id"), _folder_stamp(folder, CONFIG_FILENAME))
    kept = _OFFERS.get(str(folder))
    if kept is not None and kept[0] == stamp:
        return kept[1]
    start, problem = resume_from(store, run)
    status = run.get("status")
    if problem is not None:
        verdict = (False, f"The run {problem}.")
    elif start is not None:
        verdict = (True, f"Continue the {status} run from its last checkpoint ({start.stem}).")
    else:
        verdict = (True, f"Continue the {status} run from its start (it {status} before its "
                         "first checkpoint).")
    if len(_OFFERS) >= _OFFERS_KEPT:
        _OFFERS.clear()
    _OFFERS[str(folder)] = (stamp, verdict)
    return verdict


def percent(fraction: Any) -> float | None:
    """An accuracy logged as a fraction, in percent (the unit every page states it in)."""
    return 100.0 * float(fraction) if isinstance(fraction, (int, float)) and not isinstance(
        fraction, bool) else None


def dataset_of(run: Mapping[str, Any]) -> str:
    """The data set a run trained on, as the tables name it: ``digits``, ``files:
    train.csv`` (a user's file by its name, never its folder)."""
    data = (run.get("config") or {}).get("data") or {}
    name = str(data.get("name") or "?")
    if name == "files" and data.get("train"):
        return f"files: {Path(str(data['train'])).name}"
    if name == "factory" and data.get("factory"):
        return f"factory: {data['factory']}"
    return name


def duration_s(run: Mapping[str, Any]) -> float | None:
    """Seconds from the run's start to its end (to now while it runs)."""
    import time

    start = run.get("started_at")
    if not isinstance(start, (int, float)):
        return None
    end = run.get("ended_at")
    return max(0.0, (end if isinstance(end, (int, float)) else time.time()) - start)


#: The columns of a :func:`metric_history` row that say whose and which step it is (the
#: others are its metrics).
HISTORY_IDS = ("run", "name", "cell", "step")


def metric_history(store: RunStore, run_ids: Sequence[str],
                   labels: Mapping[str, str] | None = None,
                   label: str = "cell") -> list[dict[str, Any]]:
    """Every metric the runs logged, one row per run and step: ``{"run", [label,] "step",
    <metric>: value, ...}`` (a metric not logged at a step is absent); ``labels``: each
    run's label, in the column ``label`` (``"cell"``: a sweep's cell; ``"name"``: the
    run's name)."""
    rows: list[dict[str, Any]] = []
    for rid in run_ids:
        by_step: dict[int, dict[str, Any]] = {}
        for r in store.metrics_since(rid):
            row = by_step.setdefault(int(r["step"]), {"run": rid, **(
                {label: labels[rid]} if labels and rid in labels else {}),
                "step": int(r["step"])})
            v = r["value"]
            row[r["name"]] = None if isinstance(v, float) and math.isnan(v) else v
        rows += [by_step[s] for s in sorted(by_step)]
    return rows


def history_csv(rows: Sequence[Mapping[str, Any]]) -> str:
    """:func:`metric_history` rows as CSV: the id columns (:data:`HISTORY_IDS`), then
    every metric (sorted); an empty cell where a metric was not logged at that step."""
    import csv
    import io

    ids = [k for k in HISTORY_IDS if any(k in r for r in rows)]
    names = sorted({k for r in rows for k in r} - set(ids))
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=ids + names, restval="", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def history_json(rows: Sequence[Mapping[str, Any]]) -> str:
    """:func:`metric_history` rows as JSON: ``{run: {<label>?, "metrics": {name:
    [[step, value], ...]}}}``."""
    out: dict[str, Any] = {}
    for r in rows:
        run = out.setdefault(r["run"], {**{k: r[k] for k in ("name", "cell") if k in r},
                                        "metrics": {}})
        for k, v in r.items():
            if k not in HISTORY_IDS:
                run["metrics"].setdefault(k, []).append([r["step"], v])
    return json.dumps(out, indent=1)


def summary_rows(store: RunStore, runs: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One table row per run: status, progress and final metrics."""
    rows = []
    for r in runs:
        m = final_metrics(store, r["id"])
        steps = total_steps(r)
        rows.append(
            {
                "run": r["id"],
                "name": r["name"],
                "status": r["status"],
                "step": r.get("last_step") or 0,
                "steps": steps,
                "dense": is_baseline(r),
                "method": method_label(r.get("config")),
                "data set": dataset_of(r),
                "duration": duration_s(r),
                "eval acc": percent(m.get("eval/acc")),
                "task loss": m.get("loss/task"),
                "compression": compression(r, m).value,
                "scope": compression(r, m).label,
                "target": target_of(r),
                "params": m.get("params/effective"),
                "created": r.get("created_at"),
            }
        )
    return rows


# ------------------------------------------------------------------ configs


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"model": {"rank": 8}} -> {"model.rank": 8}`` (lists kept as values)."""
    out: dict[str, Any] = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _data_defaults(name: Any, model: str) -> dict[str, Any]:
    """The registered defaults of the dataset ``name`` (``{}`` for one not registered),
    through the preview's dataset lists (``model``'s first). ``task`` is left out: a
    dataset that reads it takes the run's own ``task``, which the config states."""
    from comera_engine.config import MODEL_NAMES
    from comera_engine.preview import datasets_for

    for m in dict.fromkeys((model, *MODEL_NAMES)):
        for info in datasets_for(m):
            if info.name == name:
                return {k: v for k, v in info.defaults.items()
                        if v is not None and k != "task"}
    return {}


def resolved_config(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """``config`` as the engine reads it, every default filled in: ``[model]``,
    ``[comera]`` and ``[train]`` from their dataclasses (the engine's own
    :func:`comera_engine.config.config_from_dict`, which validates it), ``[data]`` from
    its dataset's registered defaults. Two configs that mean the same (one states
    ``split_fraction = 0.8``, the other leaves it to that default) resolve alike. A
    config the engine does not read (an old run's) is given as stored."""
    import copy

    from comera_engine.config import config_from_dict
    from comera_engine.errors import ConfigError

    raw = copy.deepcopy(dict(config or {}))
    try:
        cfg = config_from_dict(raw)
    except (ConfigError, TypeError, ValueError, AttributeError):
        return dict(config or {})
    out = cfg.to_dict()
    out["data"] = {**_data_defaults(cfg.data.get("name"), cfg.model.name), **out["data"]}
    return out


#: What an unset initial rank means in a run that chooses it from its target.
FROM_TARGET = "from the target"


def ranks_from_target(config: Mapping[str, Any] | None) -> bool:
    """The run chooses its initial ranks from its target where its config leaves them
    unset (docs/SIZE_AND_TARGET.md, rule 3): it asks a target
    (:func:`comera_engine.metrics.run_target`) of a TT model, and neither
    ``comera.ranks_from_target = false`` nor the ``"paper"`` schedule, which sets it off,
    keeps the preset's ranks (the fixed-rank methods always take the target's)."""
    if run_target(config) is None:
        return False
    model = (config or {}).get("model") or {}
    comera = (config or {}).get("comera") or {}
    if not isinstance(model, Mapping) or not isinstance(comera, Mapping) or model.get("dense"):
        return False
    if comera.get("method", "comera") != "comera":
        return True
    from comera_engine.preview import schedule_switch

    return bool(schedule_switch(comera, "ranks_from_target"))


def config_fields(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """``config`` as Compare lists its fields: resolved (:func:`resolved_config`), one
    key per field (:func:`flatten`), and an initial rank left unset by a run that
    chooses it from its target said so (:data:`FROM_TARGET`) instead of as missing."""
    from comera_engine.config import MODEL_FIELDS

    fields = flatten(resolved_config(config))
    if ranks_from_target(config):
        model = fields.get("model.name")
        for key in ("rank", "embedding_rank"):
            applies = key not in MODEL_FIELDS or model in MODEL_FIELDS[key]
            if applies and f"model.{key}" not in fields:
                fields[f"model.{key}"] = FROM_TARGET
    return fields


def config_diff(configs: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Rows ``{"field", <label>: value, ...}`` for the fields whose values differ between
    the given configs (a missing field counts as a difference)."""
    flat = {label: flatten(c) for label, c in configs.items()}
    keys = sorted({k for f in flat.values() for k in f})
    rows = []
    for k in keys:
        vals = [json.dumps(f.get(k), sort_keys=True, default=str) for f in flat.values()]
        if len(set(vals)) > 1:
            row: dict[str, Any] = {"field": k}
            for label, f in flat.items():
                v = f.get(k)
                row[label] = "—" if v is None else (v if isinstance(v, str) else json.dumps(v))
            rows.append(row)
    return rows


def env_store_hint() -> str:
    """Where the store is, for the sidebar."""
    home = os.environ.get("COMERA_HOME")
    return f"COMERA_HOME={home}" if home else "./runs (set COMERA_HOME to change)"
