"""Sweeps on many machines: a sweep's cells as Ray tasks.

The driver (:func:`run_ray_sweep`, or detached: ``python -m
comera_engine.launch.ray_backend --store DB --sweep-id ID``, started by
:func:`spawn_ray_driver`) connects to a Ray cluster (``address``: ``"auto"``, ``ray://...``
or ``host:port``; ``None``/``"local"`` starts a Ray instance on this machine) and sends
each queued cell of a ``backend = 'ray'`` sweep to it as one task, at most the sweep's
``max_parallel`` (else as many as the cluster has CPUs for) at once; the rest wait as
``queued``. A submitted cell is ``running`` with the driver's pid and host, so if the
driver dies, :func:`comera_engine.launch.liveness.reap` marks it ``crashed``.

A task (:func:`~comera_engine.launch.ray_task.run_cell`, in
:mod:`comera_engine.launch.ray_task`, on whichever machine Ray picks) writes the cell's
``config.toml`` into a temporary folder there, trains it as a subprocess (``python -m
comera_engine.cli train config.toml --run-dir DIR --no-store --no-progress``, so a stop
or a kill is the trainer's own), and returns its exit code, the last
:data:`LOG_LIMIT` bytes of its log and a gzipped tar of the run folder: the top-level
files (``config.toml``, ``metrics.jsonl``, ``data_spec.json``, ``dataset.json``,
``tokenizer.json``, ...) and the **newest checkpoint only**. That archive is how a result
comes back from another machine: about the size of one checkpoint (model and optimizer
state) plus ``metrics.jsonl`` (some 20 KB per 20 steps of a small model); the digits
model's comes to some 150 KB, a model with 100 M parameters to about 1.2 GB, all of it
held in Ray's object store until the driver has it.

While a task trains, it sends its trainer's new ``metrics.jsonl`` records (metrics,
rank snapshots, events, phases) every :data:`~comera_engine.launch.ray_task.STREAM_EVERY_S` s to a
:class:`CellStream` actor, which the driver drains each round into the store (one
transaction a cell, as the local sink writes): the dashboard follows a Ray cell as it
trains, and a cell whose task is killed keeps what it sent.

When a task ends the driver unpacks the archive into the cell's own run folder
(``store.run_dir(id)``), appends the log to its ``train.log``, imports ``metrics.jsonl``
(metrics and rank snapshots again, replacing the streamed rows from its first step on;
the events not streamed; artifacts with their paths moved to the run folder) into the
store and records the final status: ``finished`` / ``stopped`` as the trainer
reported them, ``diverged`` (exit 3), else ``failed`` with the error (the traceback or the
last log lines). A task that raised or whose worker died fails its cell alone.

The driver is a :class:`~comera_engine.launch.scheduler.Scheduler` (the queue and its
limit, heartbeats, stop deadlines, recording the end: the same as a local run's) with
the :class:`RayExecutor` (submit, wait, cancel).

Stopping: ``comera stop CELL`` only marks a Ray cell ``stopping`` (see
:func:`comera_engine.launch.stop`); the driver then cancels its task gracefully
(``ray.cancel``: the task sends SIGTERM to the trainer, which writes a checkpoint and
reports ``stopped``, and its results come back as usual) and, if nothing came back by the
stop deadline, with ``force=True`` (the worker is killed; the cell is recorded
``stopped`` with nothing copied back). Queued cells that are stopped never run. Ctrl-C or
SIGTERM to the driver stops every cell in flight the same way (a second Ctrl-C forces)
and records the queued ones ``stopped``.

Ray is optional (``pip install 'comera-studio[cluster]'``) and imported only here, inside
functions: the engine imports and runs without it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from comera_engine.errors import ConfigError
from comera_engine.launch.env import child_env, recorded_env
from comera_engine.launch.liveness import process_start_time, reap, this_host
from comera_engine.launch.ray_task import (  # what runs on the workers
    LOG_LIMIT,
    CellStream,
    pack_run_folder,
    run_cell,
    unpack_run_folder,
)
from comera_engine.launch.runs import CONFIG_FILENAME, DEFAULT_STOP_TIMEOUT, open_store
from comera_engine.launch.scheduler import Outcome, Scheduler, Slot
from comera_engine.store import RunStore, StoreError
from comera_engine.store.layout import log_error
from comera_engine.store.metrics import ArtifactRow, EventRow, MetricRow, RankRow
from comera_engine.store.runs import check_phase

__all__ = [
    "LOG_LIMIT",
    "RAY_MISSING",
    "CellStream",
    "RayExecutor",
    "cell_outcome",
    "connect",
    "driver_log_path",
    "engine_runtime_env",
    "import_metrics",
    "import_ray",
    "main",
    "pack_run_folder",
    "run_cell",
    "run_ray_sweep",
    "spawn_ray_driver",
    "unpack_run_folder",
]

#: The one line a Ray sweep gives when Ray is not installed.
RAY_MISSING = "Ray is not installed; pip install 'comera-studio[cluster]'"
#: Seconds after a cell's stop deadline before its task is cancelled with ``force=True``.
FORCE_AFTER_S = 5.0
_ENGINE_DIR = Path(__file__).resolve().parents[1]


def _say(text: str) -> None:
    print(f"comera ray: {text}", file=sys.stderr, flush=True)


def _stamp(path: Path, text: str) -> None:
    """Append a ``[comera time] text`` line to a cell's ``train.log``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"[comera {time.strftime('%Y-%m-%d %H:%M:%S')}] {text}\n")


# ---------------------------------------------------------------------- Ray itself


def import_ray() -> Any:
    """The ``ray`` module, or :class:`ConfigError` (``backend``) when it is missing."""
    try:
        import ray
    except ImportError:
        raise ConfigError("backend", RAY_MISSING) from None
    return ray


def engine_runtime_env() -> dict[str, Any]:
    """Ray's job ``runtime_env`` that ships this engine (``comera_engine/``, under 1 MB)
    to every worker, so the cells run the driver's code whatever is installed there
    (their Python still needs torch and the engine's other dependencies)."""
    return {"py_modules": [str(_ENGINE_DIR)], "excludes": ["__pycache__", "*.pyc"]}


def connect(address: str | None = None, num_cpus: int | None = None) -> bool:
    """Connect this process to Ray; returns whether it did (``False``: already connected,
    which is kept as it is; the caller shuts down only what it connected).

    ``address`` ``None`` or ``"local"``: start a Ray instance on this machine with
    ``num_cpus`` CPUs (default: all) and no dashboard; otherwise join that cluster
    (``"auto"``, ``host:port``, ``ray://host:10001``)."""
    ray = import_ray()
    if ray.is_initialized():
        return False
    import logging

    common = {"runtime_env": engine_runtime_env(), "log_to_driver": False,
              "logging_level": logging.WARNING}
    if address in (None, "", "local"):
        cpus = int(num_cpus or os.cpu_count() or 1)
        ray.init(num_cpus=cpus, include_dashboard=False, **common)
        _say(f"started a local Ray instance ({cpus} CPUs, no dashboard); for several "
             "machines run `ray start --head` and pass --address auto")
    else:
        ray.init(address=address, **common)
        _say(f"connected to the Ray cluster at {address}")
    return True


# ---------------------------------------------------------------------- back in the store


def _rows(records: Iterable[Mapping[str, Any]], worker_dir: str, run_dir: Path
          ) -> tuple[list[MetricRow], list[RankRow], list[EventRow], list[ArtifactRow],
                     dict[str, Any] | None]:
    """The store rows of ``metrics.jsonl``'s records, and its last status record."""
    metrics: list[MetricRow] = []
    ranks: list[RankRow] = []
    events: list[EventRow] = []
    artifacts: list[ArtifactRow] = []
    status = None
    for r in records:
        t = float(r.get("t") or time.time())
        kind = r.get("type")
        if kind == "metrics":
            for name, value in dict(r.get("values") or {}).items():
                try:
                    metrics.append((int(r["step"]), str(name), float(value), t))
                except (TypeError, ValueError):
                    continue  # not a number: the trainer logs none, skip rather than fail
        elif kind == "ranks":
            for layer, rs in dict(r.get("ranks") or {}).items():
                ranks.append((int(r["step"]), str(layer), json.dumps([int(x) for x in rs]), t))
        elif kind == "event":
            step = r.get("step")
            events.append((t, None if step is None else int(step), str(r.get("kind")),
                           str(r.get("text"))))
        elif kind == "artifact":
            artifacts.append(_artifact(str(r.get("kind")), str(r.get("path")), worker_dir,
                                       run_dir, t))
        elif kind == "status":
            status = dict(r)
    return metrics, ranks, events, artifacts, status


def _artifact(kind: str, path: str, worker_dir: str, run_dir: Path, t: float) -> ArtifactRow:
    """An artifact row with a worker path moved into ``run_dir`` (its size when the file
    came back, else ``None``: older checkpoints stay on the worker)."""
    if worker_dir and (path == worker_dir or path.startswith(worker_dir.rstrip("/") + "/")):
        path = str(run_dir / os.path.relpath(path, worker_dir))
    try:
        size: int | None = os.path.getsize(path)
    except OSError:
        size = None
    return (kind, path, size, t)


def import_metrics(store: RunStore, run_id: str, jsonl: str | os.PathLike[str],
                   worker_dir: str = "", events_done: int = 0) -> dict[str, Any] | None:
    """Write a cell's ``metrics.jsonl`` into the store in one transaction (replacing rows
    from its first step on) and return its last status record (``None`` when it has
    none). Artifact paths under ``worker_dir`` (the folder it trained in) are moved to
    the cell's run folder. ``events_done``: its first events, already in the store
    (streamed while it ran), are not written again."""
    from comera_engine.metrics import read_jsonl

    path = Path(jsonl)
    if not path.is_file():
        return None
    metrics, ranks, events, artifacts, status = _rows(read_jsonl(path), worker_dir,
                                                      store.run_dir(run_id))
    events = events[events_done:]
    steps = [m[0] for m in metrics] + [r[0] for r in ranks]
    store.write_batch(run_id, metrics=metrics, ranks=ranks, events=events,
                      artifacts=artifacts, rewind_from=min(steps) if steps else None)
    return status


def _signame(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _log_error(log: str) -> str:
    """A failed trainer's error as one line (:func:`~comera_engine.store.layout.log_error`;
    the traceback stays in the log)."""
    return log_error(log)


def cell_outcome(
    exit_code: int | None,
    final: Mapping[str, Any] | None,
    log: str = "",
    stop_requested: bool = False,
    failure: str | None = None,
) -> tuple[str, str | None]:
    """``(status, error)`` of a cell whose task ended.

    ``exit_code``/``final``/``log``: the trainer's exit code, last status record and log
    (``None`` when the task itself failed with ``failure``, e.g. its worker died or it
    was cancelled by force); ``stop_requested``: a stop was asked for."""
    reported = (final or {}).get("status")
    if exit_code is None:
        if stop_requested:
            return "stopped", None
        return "failed", f"the Ray task failed: {failure or 'no result'}"
    if exit_code == 3:
        return "diverged", (final or {}).get("error")
    if exit_code == 0 and reported in ("finished", "stopped"):
        return str(reported), None
    if stop_requested and (exit_code == 0 or exit_code < 0):
        return "stopped", None
    if exit_code < 0:
        how = _signame(exit_code)
        return "failed", f"the trainer was killed by {how}; last log lines: {_log_error(log)}"
    if exit_code == 0:
        return "failed", "the trainer exited (code 0) without a final status"
    error = (final or {}).get("error") if reported == "failed" else None
    return "failed", error or _log_error(log) or f"the trainer exited with code {exit_code}"


# ---------------------------------------------------------------------- the executor


def _waiting(run: Mapping[str, Any]) -> bool:
    """A cell that waits for the driver: queued and not yet submitted."""
    return run["status"] == "queued" and run["dispatched_at"] is None


class RayExecutor:
    """The Ray executor of :class:`~comera_engine.launch.scheduler.Scheduler`: each cell
    a Ray task (:func:`run_cell`); ``submit``, ``wait`` (``ray.wait``), ``cancel``
    (``ray.cancel``, ``force`` after the stop deadline plus :data:`FORCE_AFTER_S`), and
    on the end, the cell's folder brought back. While the cells run, :meth:`drain`
    writes what they streamed (:class:`CellStream`) into the store."""

    force_after = FORCE_AFTER_S
    start_error = "ray: cannot read the cell's config"

    def __init__(self, store: RunStore, sweep_id: str, cpus_per_cell: float = 1.0,
                 stop_timeout: float = DEFAULT_STOP_TIMEOUT) -> None:
        self.ray = import_ray()
        self.store, self.sweep_id = store, sweep_id
        self.cpus = float(cpus_per_cell)
        self.stop_timeout = float(stop_timeout)
        self.pid = os.getpid()
        self.owner = {"pid": self.pid, "pid_started": process_start_time(self.pid),
                      "host": this_host()}
        self._task = self.ray.remote(max_retries=0)(run_cell)
        self.stream = self.ray.remote(num_cpus=0)(CellStream).remote()
        self._gpus: dict[str, float] = {}
        self._events: dict[str, int] = {}  # events of a cell already in the store
        self._fresh: set[str] = set()  # cells whose first streamed batch rewinds
        self._pending: dict[str, list[dict[str, Any]]] = {}

    # ---- the queue

    def limit(self) -> int:
        """Cells in flight at once: the sweep's ``max_parallel``, at most what the
        cluster has CPUs for (at least one)."""
        cpus = float(self.ray.cluster_resources().get("CPU", 1.0))
        limit = max(1, int(cpus // max(self.cpus, 1e-9)))
        sweep = self.store.get_sweep(self.sweep_id) or {}
        parallel = sweep.get("max_parallel")
        return min(limit, int(parallel)) if parallel and int(parallel) > 0 else limit

    def claim(self) -> dict[str, Any] | None:
        """The sweep's next queued cell, within :meth:`limit`, owned by this driver."""
        rid = self.store.claim_queued(self.limit(), sweep_id=self.sweep_id, owner=self.owner)
        return None if rid is None else self.store.get_run(rid)

    def waiting(self) -> bool:
        return any(_waiting(r) for r in self.store.sweep_runs(self.sweep_id))

    def cancel_waiting(self, reason: str) -> None:
        for run in self.store.sweep_runs(self.sweep_id):
            if _waiting(run):
                self.store.lifecycle(run["id"]).cancel(
                    event=("stop", f"stopped while queued: {reason}"))

    # ---- the executor

    def _gpus_of(self, run: Mapping[str, Any]) -> float:
        """One GPU for a cell whose config asks for CUDA (or ``auto`` on a cluster that
        has GPUs), else none."""
        device = str(((run.get("config") or {}).get("train") or {}).get("device", "auto"))
        if device.startswith("cuda"):
            return 1.0
        has_gpu = float(self.ray.cluster_resources().get("GPU", 0.0)) >= 1.0
        return 1.0 if device == "auto" and has_gpu else 0.0

    def submit(self, run: Mapping[str, Any], attempt: int) -> tuple[Any, dict[str, Any]]:
        rid = str(run["id"])
        run_dir = self.store.run_dir(rid)
        text = (run_dir / CONFIG_FILENAME).read_text(encoding="utf-8")
        gpus = self._gpus[rid] = self._gpus_of(run)
        ref = self._task.options(num_cpus=self.cpus, num_gpus=gpus,
                                 name=f"comera-cell-{rid}").remote(
            text, recorded_env(run_dir), run.get("cwd"), rid, self.stop_timeout,
            max(1, int(self.cpus)), self.stream)
        self._events[rid] = 0
        self._fresh.add(rid)
        return ref, {}

    def started(self, slot: Slot) -> str:
        where = (f"Ray task ({self.cpus:g} CPU, {self._gpus.get(slot.run_id, 0.0):g} GPU), "
                 f"driver pid {self.pid}")
        _stamp(self.store.log_path(slot.run_id), f"attempt {slot.attempt}: {where}")
        _say(f"cell {slot.run_id} submitted ({len(self._events)} in flight)")
        return f"attempt {slot.attempt}: {where}"

    def wait(self, slots: list[Slot], timeout: float) -> list[Slot]:
        self.drain()
        refs = [s.handle for s in slots]
        ready, _ = self.ray.wait(refs, num_returns=1, timeout=timeout)
        if ready:
            ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0)
        return [s for s in slots if any(s.handle == r for r in ready)]

    def cancel(self, slot: Slot, force: bool) -> None:
        text = ("stop timed out: cancelling the Ray task by force (nothing comes back)"
                if force else "stop requested: cancelling the Ray task")
        _stamp(self.store.log_path(slot.run_id), text)
        self.ray.cancel(slot.handle, force=force)

    def drain(self) -> None:
        """Write what the cells streamed into the store: one transaction a cell (a
        store error keeps them for the next round)."""
        try:
            batches = self.ray.get(self.stream.drain.remote())
        except Exception as e:  # the stream is gone: the records come back with the folder
            _say(f"no live records: {type(e).__name__}: {e}")
            batches = {}
        for rid, records in batches.items():
            self._pending.setdefault(rid, []).extend(records)
        for rid, records in list(self._pending.items()):
            if rid not in self._events:  # not ours (any more): its end was recorded
                del self._pending[rid]
                continue
            try:
                self._write_live(rid, records)
            except StoreError as e:
                _say(f"store error, trying again: {e}")
                return
            except (KeyError, TypeError, ValueError) as e:  # they come back with the folder
                _say(f"cell {rid}: live records skipped: {type(e).__name__}: {e}")
            del self._pending[rid]

    def _write_live(self, rid: str, records: list[dict[str, Any]]) -> None:
            metrics, ranks, events, _, _ = _rows(records, "", self.store.run_dir(rid))
            phase = next((r for r in reversed(records) if r.get("type") == "phase"), None)
            steps = [m[0] for m in metrics] + [r[0] for r in ranks]
            rewind = min(steps) if steps and rid in self._fresh else None
            self.store.write_batch(
                rid, metrics=metrics, ranks=ranks, events=events, rewind_from=rewind,
                phase=None if phase is None else check_phase(phase.get("phase"),
                                                             phase.get("progress")))
            if rewind is not None:
                self._fresh.discard(rid)
            self._events[rid] += len(events)

    def outcome(self, slot: Slot, run: Mapping[str, Any]) -> Outcome:
        rid = slot.run_id
        self.drain()  # the task has sent everything before it returned
        try:
            result, failure = self.ray.get(slot.handle), None
        except Exception as e:  # the task raised, its worker or node died, a forced cancel
            result = None
            # TaskCancelledError, or WorkerCrashedError in some versions
            failure = "cancelled by force" if slot.forced else f"{type(e).__name__}: {e}"
        self.store.run_dir(rid).mkdir(parents=True, exist_ok=True)
        final, log, code = None, "", None
        if result is not None:
            try:
                final = self._bring_back(rid, result)
                code, log = int(result["exit_code"]), str(result.get("log") or "")
            except (OSError, ValueError, KeyError, TypeError, tarfile.TarError) as e:
                failure = f"its results could not be brought back: {type(e).__name__}: {e}"
        stop_requested = slot.stop_deadline is not None or run["status"] == "stopping"
        status, error = cell_outcome(code, final, log, stop_requested, failure)
        slot.exit_code = code
        host = f" on {result['host']}" if result else ""
        note = f"{status}{host}" + (f": {failure}" if failure else "")
        return Outcome(status, error, code, ("stop" if status == "stopped" else "end", note))

    def _bring_back(self, rid: str, result: Mapping[str, Any]) -> dict[str, Any] | None:
        """Append the task's log to the cell's ``train.log``, unpack its folder into the
        cell's run folder and import what was not streamed; returns the trainer's last
        status record."""
        st = self.store
        with open(st.log_path(rid), "a", encoding="utf-8") as f:
            f.write(str(result.get("log") or ""))
        unpack_run_folder(result["archive"], st.run_dir(rid))
        return import_metrics(st, rid, st.run_dir(rid) / "metrics.jsonl", str(result["folder"]),
                              events_done=self._events.get(rid, 0))

    def ended(self, slot: Slot, note: str) -> None:
        self._events.pop(slot.run_id, None)
        self._fresh.discard(slot.run_id)
        code = slot.exit_code
        how = "no result" if code is None else f"code {code}"
        _stamp(self.store.log_path(slot.run_id), f"Ray task ended ({how}); {note}")
        _say(f"cell {slot.run_id} {note.removeprefix('status ')}")

    def say(self, text: str) -> None:
        _say(text)

    def close(self) -> None:
        try:
            self.ray.kill(self.stream)
        except Exception:
            pass


def run_ray_sweep(
    store: RunStore | str | os.PathLike[str] | None,
    sweep_id: str,
    address: str | None = None,
    poll: float = 0.5,
    *,
    cpus_per_cell: float = 1.0,
    stop_timeout: float = DEFAULT_STOP_TIMEOUT,
) -> dict[str, int]:
    """Run a Ray sweep's queued cells as Ray tasks until none is left; returns the
    sweep's cells per status (e.g. ``{"finished": 3, "failed": 1}``).

    ``address``: the cluster (default: the sweep's recorded address; ``None``/``"local"``
    starts a Ray instance here). A process already connected to Ray keeps its connection
    (and it is not shut down). ``poll``: seconds between looks at the store;
    ``cpus_per_cell``: CPUs each task asks Ray for; ``stop_timeout``: seconds a stopped
    cell's trainer has to checkpoint before its task is cancelled by force.
    Raises :class:`ConfigError` (``backend``) without Ray, or for a sweep that is not a
    Ray sweep."""
    import_ray()
    st = open_store(store)
    sweep = st.get_sweep(sweep_id)
    if sweep is None:
        raise ConfigError("sweep", f"no sweep {sweep_id!r} in {st.path}")
    if sweep.get("backend") != "ray":
        raise ConfigError("backend", f"sweep {sweep_id} runs on the {sweep.get('backend')!r} "
                          "backend, not 'ray'")
    reap(st)  # cells of an earlier driver that died are crashed, not ours to run
    owned = connect(address if address is not None else sweep.get("address"))
    try:
        ex = RayExecutor(st, sweep_id, cpus_per_cell, stop_timeout)
        try:
            Scheduler(st, ex, ex.claim, waiting=ex.waiting, cancel_waiting=ex.cancel_waiting,
                      poll=poll, stop_timeout=stop_timeout).run()
        finally:
            ex.close()
        return dict((st.get_sweep(sweep_id) or {}).get("counts", {}))
    finally:
        if owned:
            import_ray().shutdown()


# ---------------------------------------------------------------------- detached driver


def driver_log_path(store: RunStore, sweep_id: str) -> Path:
    """Where a detached driver's output goes: ``<store dir>/<sweep_id>.log``."""
    return store.root / f"{sweep_id}.log"


def spawn_ray_driver(store: RunStore | str | os.PathLike[str] | None, sweep_id: str,
                     address: str | None = None) -> int:
    """Start a detached driver for the sweep (its own session, output appended to
    :func:`driver_log_path`), so the sweep outlives the dashboard that started it.
    Returns its pid."""
    st = open_store(store)
    cmd = [sys.executable, "-m", "comera_engine.launch.ray_backend", "--store", str(st.path),
           "--sweep-id", sweep_id]
    if address:
        cmd += ["--address", address]
    with open(driver_log_path(st, sweep_id), "ab") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, env=child_env(),
                                start_new_session=True, close_fds=True)
    # reap the child when it exits so a long-lived starter (the dashboard) keeps no zombie
    threading.Thread(target=proc.wait, name=f"reap-{sweep_id}", daemon=True).start()
    return proc.pid


def main(argv: list[str] | None = None) -> int:
    """``python -m comera_engine.launch.ray_backend --store DB --sweep-id ID
    [--address ADDR]``: run the sweep's cells on Ray. Exit 0 when every cell ran, 2 for
    a bad request (one line), 1 otherwise."""
    p = argparse.ArgumentParser(prog="python -m comera_engine.launch.ray_backend")
    p.add_argument("--store", required=True, help="run store (.db file or its folder)")
    p.add_argument("--sweep-id", required=True)
    p.add_argument("--address", default=None, help="Ray cluster (default: the sweep's)")
    p.add_argument("--poll", type=float, default=0.5)
    args = p.parse_args(argv)
    try:
        st = RunStore(args.store, create=False)
        _say(f"driver pid {os.getpid()} for sweep {args.sweep_id} ({st.path})")
        counts = run_ray_sweep(st, args.sweep_id, args.address, args.poll)
    except (ConfigError, StoreError) as e:
        _say(f"error: {e}")
        return 2
    _say("done: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    return 0


if __name__ == "__main__":
    # run the module's own copy, not __main__'s: Ray sends run_cell to the workers by
    # reference (comera_engine.launch.ray_backend.run_cell), never __main__'s by value
    from comera_engine.launch.ray_backend import main as _main

    sys.exit(_main())
