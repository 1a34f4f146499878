"""Sweeps: one config, a grid of overrides and several seeds, run as ordinary runs.

``create_sweep(CONFIG, {"comera.target_compression": [5, 10, 30, 100]}, seeds=3)`` checks
every cell's config first (nothing is written when one is invalid), then records the
sweep and queues one run per cell (grid point × seed). Cells are started by the same
launcher as any run (:func:`comera_engine.launch.dispatch`), at most the sweep's
``max_parallel`` at once; a cell that crashes is just that cell (the others go on). With
``backend="ray"`` the cells run as Ray tasks instead
(:mod:`comera_engine.launch.ray_backend`). :func:`stop_sweep` and :func:`resume_sweep`
act on every cell; :func:`sweep_report` reads the cells back as a table, mean ± std per
grid point, and the accuracy-vs-compression Pareto front.
"""

from __future__ import annotations

import itertools
import math
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from comera_engine.errors import ConfigError
from comera_engine.metrics import is_dense_baseline, run_compression
from comera_engine.store import FINAL_STATUSES, RESUMABLE_STATUSES, RunStore

__all__ = [
    "cell_label",
    "check_sweep",
    "create_sweep",
    "default_parallel",
    "expand_cells",
    "pareto_front",
    "parse_grid",
    "SweepResume",
    "resume_sweep",
    "score_metric",
    "stop_sweep",
    "sweep_report",
    "wait_sweeps",
]

#: The most cells one sweep may have (a typo like ``--seeds 300`` is refused).
MAX_CELLS = 1000


def _split_top(text: str) -> list[str]:
    """Split ``text`` on commas that are not inside brackets or quotes."""
    parts, depth, quote, cur = [], 0, "", []
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
            continue
        cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts]


def parse_grid(items: Sequence[str]) -> dict[str, list[Any]]:
    """``["comera.target_compression=5,10", "train.steps=300"]`` ->
    ``{"comera.target_compression": [5, 10], "train.steps": [300]}``.

    Each item is ``section.key=v1,v2,...`` (values read as TOML, like ``--set``; commas
    inside ``[...]`` belong to the value). A key given twice, an empty value or a key that
    is not ``section.key`` raises :class:`ConfigError` naming ``--grid``."""
    from comera_engine.config import parse_value

    grid: dict[str, list[Any]] = {}
    for item in items:
        key, sep, text = str(item).partition("=")
        key = key.strip()
        if not sep or len(key.split(".")) != 2 or not all(key.split(".")):
            raise ConfigError("--grid", f"expected section.key=v1,v2,..., got {item!r}")
        if key in grid:
            raise ConfigError("--grid", f"{key} is given twice; list all its values once")
        values = _split_top(text)
        if not text.strip() or any(v == "" for v in values):
            raise ConfigError("--grid", f"{key}: an empty value in {text!r}")
        grid[key] = [parse_value(v) for v in values]
        twice = [v for i, v in enumerate(values) if grid[key][i] in grid[key][:i]]
        if twice:  # two cells alike would be counted as two samples
            raise ConfigError("--grid", f"{key}: {twice[0]} is given twice in {text!r}; "
                              "list each value once (--seeds repeats a cell)")
    return grid


def expand_cells(grid: Mapping[str, Sequence[Any]], seeds: int, base_seed: int = 0
                 ) -> list[dict[str, Any]]:
    """Every grid point × seed as ``{"overrides": {key: value}, "seed": s}``, grid points
    in the order given, seeds ``base_seed .. base_seed + seeds - 1`` innermost."""
    keys = list(grid)
    cells = []
    for combo in itertools.product(*(list(grid[k]) for k in keys)):
        for s in range(int(seeds)):
            cells.append({"overrides": dict(zip(keys, combo)), "seed": int(base_seed) + s})
    return cells


def _toml(value: Any) -> str:
    from comera_engine.config import toml_value

    return toml_value(value)


def cell_overrides(cell: Mapping[str, Any]) -> list[str]:
    """A cell as ``--set`` items: its grid values, then ``train.seed``."""
    items = [f"{k}={_toml(v)}" for k, v in cell["overrides"].items()]
    return [*items, f"train.seed={int(cell['seed'])}"]


def cell_label(cell: Mapping[str, Any]) -> str:
    """Short human label of a cell, e.g. ``10× seed 1`` or ``lr_cores=0.001 seed 0``."""
    parts = []
    for key, value in (cell.get("overrides") or {}).items():
        if key == "comera.target_compression":
            parts.append(f"{value:g}×" if isinstance(value, (int, float)) else f"{value}×")
        else:
            parts.append(f"{key.split('.')[-1]}={value}")
    parts.append(f"seed {cell.get('seed', 0)}")
    return " ".join(parts)


def default_parallel(device: str = "auto") -> int:
    """How many cells fit this machine at once: one per visible GPU for a GPU run, else one
    per 4 CPU cores (each cell then gets that many threads), at least 1."""
    if device != "cpu":
        try:
            import torch

            if torch.cuda.is_available():
                return max(1, torch.cuda.device_count())
        except ImportError:  # pragma: no cover - torch is a dependency
            pass
    return max(1, (os.cpu_count() or 1) // 4)


def check_sweep(
    config: Mapping[str, Any] | str | os.PathLike[str],
    grid: Mapping[str, Sequence[Any]],
    seeds: Any = 1,
    overrides: Sequence[str] = (),
    *,
    name: str | None = None,
    max_parallel: Any = None,
    backend: str = "local",
    gpus: str | None = None,
    check: Any = None,
) -> tuple[Any, list[dict[str, Any]], list[Any]]:
    """Everything :func:`create_sweep` checks before it writes anything (the arguments
    as typed, every cell's config, ``check`` on each): returns ``(base config, cells,
    cell configs)``. The dashboard's sweep form calls it on every change, so a value is
    refused beside its field with the message a click would give.

    Raises:
        ConfigError: the first problem, naming the field (and the cell).
    """
    from comera_engine.config import MAX_NAME
    from comera_engine.launch.runs import _check_gpus, resolve_config
    from comera_engine.store import SWEEP_BACKENDS

    if backend not in SWEEP_BACKENDS:
        raise ConfigError("--backend", f"must be one of {', '.join(SWEEP_BACKENDS)}, "
                          f"got {backend!r}")
    if not isinstance(seeds, int) or isinstance(seeds, bool) or seeds < 1:
        raise ConfigError("--seeds", f"must be a whole number >= 1, got {seeds!r}")
    if max_parallel is not None and (not isinstance(max_parallel, int) or isinstance(
            max_parallel, bool) or max_parallel < 1):
        raise ConfigError("--max-parallel", f"must be a whole number >= 1, got {max_parallel!r}")
    if not grid:
        raise ConfigError("--grid", "give at least one section.key=v1,v2,... to sweep over")
    if backend == "ray":
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            raise ConfigError("--backend", "Ray is not installed; pip install "
                              "'comera-studio[cluster]' (or use --backend local)")
    if "train.seed" in grid and seeds > 1:
        raise ConfigError("--seeds", "train.seed is in the grid; leave --seeds at 1")
    base = resolve_config(config, overrides)
    if name is not None:
        from comera_engine.config import check_run_name

        name = check_run_name(name, "--name")
    cells = expand_cells(grid, seeds, base_seed=base.train.seed if "train.seed" not in grid
                         else 0)
    if "train.seed" in grid:
        for c in cells:
            c["seed"] = int(c["overrides"].pop("train.seed"))
    if len(cells) > MAX_CELLS:
        raise ConfigError("--grid", f"{len(cells)} cells; a sweep has at most {MAX_CELLS}")
    _check_gpus(gpus, 1)
    configs = []
    for cell in cells:  # every cell valid before anything is written
        label = cell_label(cell)
        try:
            cfg = resolve_config(config, [*overrides, *cell_overrides(cell)])
            if check is not None:
                check(cfg)
        except ConfigError as e:
            raise ConfigError(e.field, f"{e.problem} (cell {label})") from None
        cfg.name = f"{name or base.name} · {label}"[:MAX_NAME]
        configs.append(cfg)
    return base, cells, configs


def create_sweep(
    config: Mapping[str, Any] | str | os.PathLike[str],
    grid: Mapping[str, Sequence[Any]],
    seeds: int = 1,
    overrides: Sequence[str] = (),
    store: RunStore | str | os.PathLike[str] | None = None,
    *,
    name: str | None = None,
    max_parallel: int | None = None,
    backend: str = "local",
    address: str | None = None,
    gpus: str | None = None,
    check: Any = None,
) -> str:
    """Queue a sweep and start its first cells; returns the sweep id.

    ``grid``: ``{"section.key": [values]}`` (see :func:`parse_grid`); ``seeds``: runs per
    grid point (``train.seed`` = the config's seed + 0, 1, ...); ``overrides``: ``--set``
    items applied to every cell before the grid; ``max_parallel``: cells at once (default
    :func:`default_parallel`); ``gpus``: the GPUs cells share, one per cell in turn;
    ``check``: a callable run on every cell's config before anything is written (the CLI
    passes its device/data/memory check). Every cell is validated first
    (:func:`check_sweep`): a bad grid value raises :class:`ConfigError` naming the cell,
    and nothing is written."""
    from comera_engine.launch.runs import _check_gpus, open_store, queue_run

    base, cells, configs = check_sweep(config, grid, seeds, overrides, name=name,
                                       max_parallel=max_parallel, backend=backend,
                                       gpus=gpus, check=check)
    gpu_list = (_check_gpus(gpus, 1) or "").split(",") if gpus else []
    parallel = max_parallel or (len(gpu_list) if gpu_list else default_parallel(
        base.train.device))
    st = open_store(store)
    sid = st.create_sweep(name or base.name, base.to_dict(), grid, seeds,
                          max_parallel=parallel, backend=backend, address=address)
    made: list[str] = []
    try:
        for i, (cell, cfg) in enumerate(zip(cells, configs)):
            cell_gpus = gpu_list[i % len(gpu_list)] if gpu_list else None
            made.append(queue_run(st, cfg, gpus=cell_gpus, sweep_id=sid, cell=cell))
    except BaseException:
        for rid in made:
            st.delete_run(rid, remove_files=True)
        st.delete_sweep(sid)
        raise
    _start(st, sid, backend)
    return sid


def _start(st: RunStore, sweep_id: str, backend: str) -> None:
    """Start what can run now (:func:`comera_engine.launch.scheduler.start_queued`): the
    local launcher's queue, or the sweep's Ray driver."""
    from comera_engine.launch.scheduler import start_queued

    start_queued(st, sweep_id, STARTERS)


def _start_local(st: RunStore, sweep_id: str | None) -> None:
    """The local executor's start: supervisors for the queued runs that fit
    (:func:`comera_engine.launch.runs.dispatch`)."""
    from comera_engine.launch.runs import dispatch

    dispatch(st)


def _start_ray(st: RunStore, sweep_id: str | None) -> None:
    """The Ray executor's start: the sweep's detached driver
    (:func:`comera_engine.launch.ray_backend.spawn_ray_driver`)."""
    from comera_engine.launch.ray_backend import spawn_ray_driver

    spawn_ray_driver(st, str(sweep_id))


#: How each backend (``SWEEP_BACKENDS``) starts its queued runs, for
#: :func:`comera_engine.launch.scheduler.start_queued`.
STARTERS: dict[str, Callable[[RunStore, str | None], object]] = {
    "local": _start_local, "ray": _start_ray}


def stop_sweep(sweep_id: str, store: RunStore | str | os.PathLike[str] | None = None,
               timeout: float = 60.0, wait: bool = True) -> dict[str, int]:
    """Stop every cell of a sweep: waiting cells at once (so none starts while the others
    stop), then the running ones gracefully (checkpoint, then stop). Returns the cells
    per status afterwards."""
    from comera_engine.launch.runs import open_store, stop

    st = open_store(store)
    sid = st.resolve_sweep(sweep_id)
    cells = st.sweep_runs(sid)
    waiting = [r for r in cells if r["status"] == "queued" and r["dispatched_at"] is None]
    for r in waiting:
        stop(r["id"], store=st, wait=False)
    active = [r["id"] for r in st.sweep_runs(sid) if r["status"] not in FINAL_STATUSES]
    for rid in active:
        stop(rid, timeout=timeout, store=st, wait=False)
    if wait:
        deadline = time.time() + timeout + 20.0
        for rid in active:
            stop(rid, timeout=max(1.0, deadline - time.time() - 15.0), store=st, wait=True)
    sweep = st.get_sweep(sid) or {}
    return dict(sweep.get("counts", {}))


class SweepResume(NamedTuple):
    """What :func:`resume_sweep` did: the cells ``queued`` again, and those ``left`` as
    they were (id → why, in words that follow "the run")."""

    queued: list[str]
    left: dict[str, str]


def resume_sweep(sweep_id: str, store: RunStore | str | os.PathLike[str] | None = None
                 ) -> SweepResume:
    """Queue again every stopped, crashed or failed cell that can be resumed (each from its
    newest checkpoint; a stopped or crashed one without any from the start), by the
    launcher's one rule (:func:`comera_engine.launch.runs.resume_from`); finished cells
    stay, and a cell that cannot be (one that failed before its first checkpoint, a Ray
    sweep's cell) is left with the reason."""
    from comera_engine.launch.runs import ResumeRefused, open_store, resume

    st = open_store(store)
    sid = st.resolve_sweep(sweep_id)
    done = SweepResume([], {})
    for r in st.sweep_runs(sid):
        if r["status"] not in RESUMABLE_STATUSES:
            continue
        try:  # the rule is checked (its checkpoints read, hashed) once, by resume itself
            done.queued.append(resume(r["id"], store=st))
        except ResumeRefused as e:
            done.left[r["id"]] = e.problem
    return done


def wait_sweeps(store: RunStore, sweep_ids: Sequence[str], poll: float = 1.0, *,
                label: str = "", indent: str = "") -> None:
    """Until every cell of these sweeps has ended, running the launcher's housekeeping
    meanwhile (a cell whose process died is marked crashed, waiting cells start); prints
    ``{indent}HH:MM:SS {label}<cells per status>`` to stderr whenever the counts change."""
    import sys

    from comera_engine.launch.runs import housekeeping

    last = ""
    while True:
        housekeeping(store)
        sweeps = [store.get_sweep(s) or {} for s in sweep_ids]
        counts: dict[str, int] = {}
        for sweep in sweeps:
            for k, n in sweep.get("counts", {}).items():
                counts[k] = counts.get(k, 0) + n
        text = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
        if text != last:
            print(f"{indent}{time.strftime('%H:%M:%S')} {label}{text}", file=sys.stderr)
            last = text
        if all(sweep.get("status") not in ("queued", "running") for sweep in sweeps):
            return
        time.sleep(poll)


# ------------------------------------------------------------------------------ report


def score_metric(names: Sequence[str]) -> tuple[str | None, bool]:
    """The metric a sweep is scored on, from what its runs logged, and whether higher is
    better: ``eval/auc`` (click and binary tasks log it), else ``eval/acc``, else
    ``eval/loss`` (lower is better)."""
    for name, higher in (("eval/auc", True), ("eval/acc", True), ("eval/loss", False)):
        if name in names:
            return name, higher
    return None, True


def _mean_std(values: Sequence[float]) -> tuple[float | None, float | None]:
    vals = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    if not vals:
        return None, None
    # one value has no spread: None, never a std of 0 (one seed says nothing of it)
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else None)


def pareto_front(points: Sequence[Mapping[str, Any]], x: str, y: str,
                 higher_y: bool = True) -> list[int]:
    """Indices of the points no other point beats on both ``x`` (higher is better:
    compression) and ``y`` (``higher_y``: accuracy; else lower: loss), by ``x``."""
    ok = [i for i, p in enumerate(points)
          if isinstance(p.get(x), (int, float)) and isinstance(p.get(y), (int, float))]
    sign = 1.0 if higher_y else -1.0
    front = []
    for i in ok:
        xi, yi = points[i][x], sign * points[i][y]
        beaten = any(points[j][x] >= xi and sign * points[j][y] >= yi
                     and (points[j][x] > xi or sign * points[j][y] > yi) for j in ok if j != i)
        if not beaten:
            front.append(i)
    return sorted(front, key=lambda i: points[i][x])


def sweep_report(store: RunStore, sweep_id: str) -> dict[str, Any]:
    """A sweep read back from its cells:

    ``sweep`` (the row, with status and counts); ``metric`` / ``higher_is_better`` (what
    it is scored on, :func:`score_metric`); ``cells``: one row per run (id, label, grid
    values, seed, status, step, score, compression reached and asked and its scope,
    ``baseline``: the dense model as it is, 1x in any scope, parameters, the
    median step time over the run, peak memory and the metric it is: ``peak_mem_metric``,
    the peak allocated on a GPU, else the process RSS); ``groups``: one row per grid point
    (mean ± std of score and compression over its finished seeds, how many finished, the
    cells' statuses, whether it is on the Pareto front of score vs compression
    reached)."""
    sid = store.resolve_sweep(sweep_id)
    sweep = store.get_sweep(sid) or {}
    runs = store.sweep_runs(sid)
    latest = {r["id"]: {k: v for k, (_, v) in store.latest_metrics(r["id"]).items()}
              for r in runs}
    metric, higher = score_metric(sorted({n for m in latest.values() for n in m}))
    cells = []
    for r in runs:
        m = latest[r["id"]]
        cell = r.get("cell") if isinstance(r.get("cell"), dict) else {}
        # the target the grid gave the cell (what its groups are laid out by)
        target = ((r.get("config") or {}).get("comera") or {}).get("target_compression")
        peak_metric = next((k for k in ("mem/cuda_max_allocated_mb", "mem/rss_mb")
                            if k in m), None)
        comp = run_compression(r.get("config"), m)  # int8 of a dense run: whole model
        cells.append({
            "run": r["id"], "label": cell_label(cell) if cell else r["name"],
            "grid": dict(cell.get("overrides") or {}), "seed": cell.get("seed"),
            "status": r["status"], "step": r.get("last_step"),
            "score": m.get(metric) if metric else None,
            "compression": comp.value, "scope": comp.scope,
            "baseline": is_dense_baseline(r.get("config")),
            "target": target, "params": m.get("params/effective"),
            "bytes": m.get("bytes/effective"),
            "step_time_s": store.median_metric(r["id"], "perf/step_time_s"),
            "peak_mem_mb": m.get(peak_metric) if peak_metric else None,
            "peak_mem_metric": peak_metric,
        })
    groups: dict[str, dict[str, Any]] = {}
    for c in cells:
        key = repr(sorted(c["grid"].items()))
        g = groups.setdefault(key, {"grid": c["grid"], "label": cell_label(
            {"overrides": c["grid"], "seed": 0}).rsplit(" seed", 1)[0] or "all",
            "cells": [], "target": c["target"]})
        g["cells"].append(c)
    rows = []
    for g in groups.values():
        done = [c for c in g["cells"] if c["status"] == "finished"]
        score, score_sd = _mean_std([c["score"] for c in done])
        comp, comp_sd = _mean_std([c["compression"] for c in done])
        t_mean, _ = _mean_std([c["step_time_s"] for c in done])
        mem, _ = _mean_std([c["peak_mem_mb"] for c in done])
        nbytes, _ = _mean_std([c.get("bytes") for c in done])
        rows.append({
            "label": g["label"], "grid": g["grid"], "target": g["target"],
            "score": score, "score_std": score_sd, "compression": comp,
            "compression_std": comp_sd, "step_time_s": t_mean, "peak_mem_mb": mem,
            "bytes": nbytes,
            "finished": len(done), "cells": len(g["cells"]),
            "statuses": sorted({c["status"] for c in g["cells"]}),
        })
    for i in pareto_front(rows, "compression", "score", higher):
        rows[i]["pareto"] = True
    for r in rows:
        r.setdefault("pareto", False)
    return {"sweep": sweep, "metric": metric, "higher_is_better": higher, "cells": cells,
            "groups": rows}
