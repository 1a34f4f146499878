"""``StoreSink``: the trainer's batched metrics sink into the run store."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from comera_engine.store.errors import NotOwnerError, RunNotFoundError, is_damaged
from comera_engine.store.lifecycle import check_action
from comera_engine.store.metrics import artifact_row, metric_value
from comera_engine.store.run_store import RunStore
from comera_engine.store.runs import check_phase


class StoreSink:
    """A :class:`comera_engine.metrics.MetricsSink` that writes into a :class:`RunStore`.

    Records are buffered in memory; a background thread writes them every ``flush_every``
    seconds in one transaction together with the run's heartbeat, so a training step only
    pays for a list append and a crash loses at most the last ``flush_every`` seconds.
    ``set_status``, ``flush`` and ``close`` write synchronously. A failed write keeps the
    records and tries again on the next flush.

    ``set_phase`` writes a new phase through at once; progress within the same phase is
    kept (the newest only) and written with the next background flush, so a caller may
    report it per batch and the store sees it at most every ``flush_every`` seconds.

    The first step this sink logs rewinds the run: metrics and rank snapshots at that step
    or later (left by an earlier attempt of a resumed run) are deleted in the same
    transaction as the first insert, so a resumed run has exactly one row per
    ``(step, name)``.

    ``process``: the run columns that identify this process (``pid``, and ``host``,
    ``pid_started`` if known), recorded with ``running`` when the run has no pid yet, so
    the launcher can tell whether it is alive; by default this process's pid and host (the
    trainer passes :func:`comera_engine.launch.liveness.this_process`, which adds the
    start time).

    ``owner``: the owner token this process took (see
    :func:`comera_engine.launch.owner.claim_run`); every write then checks in its own
    transaction that the token still owns the run. A process that lost the run writes
    nothing more: its records are dropped, one line goes to stderr and ``owner_lost`` is
    set.
    """

    def __init__(
        self,
        store: RunStore | str | os.PathLike[str],
        run_id: str,
        flush_every: float = 0.5,
        *,
        heartbeat: bool = True,
        rewind: bool = True,
        process: Mapping[str, Any] | None = None,
        owner: Mapping[str, Any] | None = None,
        keep_going: bool = False,
    ) -> None:
        self._own_store = not isinstance(store, RunStore)
        self.store = store if isinstance(store, RunStore) else RunStore(store, create=False)
        if self.store.get_run(run_id) is None:
            raise RunNotFoundError(f"run_id: no run {run_id!r} in {self.store.path}")
        self.run_id = run_id
        self.flush_every = float(flush_every)
        self._heartbeat = heartbeat
        self._process = dict(process or owner or {"pid": os.getpid(), "host": socket.gethostname()})
        self._owner = dict(owner) if owner is not None else None
        #: Set when another process took the run over; nothing is written after that.
        self.owner_lost = False
        #: Set (with ``keep_going``) when the store file is damaged: nothing is written
        #: to it after that (the run folder keeps the record; ``comera repair``).
        self.store_lost = False
        self._keep_going = keep_going
        self._rewind_pending = rewind
        self._first_step: int | None = None
        self._lock = threading.Lock()  # guards the buffers
        self._flush_lock = threading.Lock()  # one flush at a time
        self._metrics: list[tuple[int, str, float | None, float]] = []
        self._ranks: list[tuple[int, str, str, float]] = []
        self._events: list[tuple[float, int | None, str, str]] = []
        self._artifacts: list[tuple[str, str, int | None, float]] = []
        self._phase: str | None = None  # the phase last reported
        self._phase_pending: tuple[str | None, float | None] | None = None  # not written yet
        self._closed = False
        self._warned = False
        #: ``flushes``, ``rows`` written, ``flush_cpu_s`` (CPU time of the flushing thread
        #: spent writing) and ``flush_wall_s``; for benchmarks and diagnostics.
        self.stats: dict[str, float] = {
            "flushes": 0,
            "rows": 0,
            "flush_cpu_s": 0.0,
            "flush_wall_s": 0.0,
        }
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._loop, name=f"StoreSink-{run_id}", daemon=True
        )
        self._thread.start()

    # ---- MetricsSink -------------------------------------------------------------------

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        t = time.time()
        step = int(step)
        try:
            rows = [(step, k, float(v), t) for k, v in metrics.items()]
        except (TypeError, ValueError):  # name the offending metric
            rows = [(step, str(k), metric_value(k, v), t) for k, v in metrics.items()]
        with self._lock:
            if self._first_step is None:
                self._first_step = step
            self._metrics.extend(rows)

    def log_ranks(self, step: int, ranks: Mapping[str, Sequence[int]]) -> None:
        t = time.time()
        step = int(step)
        rows = [(step, str(k), json.dumps([int(x) for x in v]), t) for k, v in ranks.items()]
        with self._lock:
            if self._first_step is None:
                self._first_step = step
            self._ranks.extend(rows)

    def log_event(self, kind: str, text: str, step: int | None = None) -> None:
        row = (time.time(), None if step is None else int(step), str(kind), str(text))
        with self._lock:
            self._events.append(row)

    def log_artifact(self, kind: str, path: str | os.PathLike[str]) -> None:
        """Record a file; a checkpoint is written through at once (with everything logged
        before it), so the store is never far behind the newest checkpoint on disk."""
        row = artifact_row(kind, path)
        with self._lock:
            self._artifacts.append(row)
        if kind == "checkpoint":
            try:
                self._flush()
            except Exception:  # the background thread retries; never fail the trainer
                pass

    def set_status(self, status: str, error: str | None = None) -> None:
        """Flush and set the status in one transaction.

        ``running`` only applies to a queued or running run (a pending stop request
        wins) and records ``process`` (this process's pid and host) when no pid is known.
        A final status applies unless another final status is already set (``crashed``
        may be corrected by the trainer itself).
        """
        # the trainer's own report, or its final status (see store.lifecycle.TRANSITIONS)
        action = "report" if status == "running" else "finish"
        check_action(action, status)  # a status the trainer never sets raises here
        self._sync(status=(action, status, error))
        if self.store_lost:
            return
        if status == "running" and self._owner is None:
            run = self.store.get_run(self.run_id)
            if run is not None and not run["pid"]:
                self.store.update_run(self.run_id, **self._process)

    def set_phase(self, phase: str, progress: float | None = None) -> None:
        """Record what the run is doing (one of :data:`~comera_engine.store.PHASES`) and
        how far along it is (0..1, ``None``: unknown). A phase change is written through
        at once, with everything logged before it (a failed write is retried by the
        background flush, never raised); progress within the same phase waits for the
        next background flush. A bad phase raises ValueError here, in the caller."""
        value = check_phase(phase, progress)
        with self._lock:
            changed = value[0] != self._phase
            self._phase = value[0]
            self._phase_pending = value
        if changed:
            try:
                self._flush()
            except Exception:  # the background thread retries; never fail the trainer
                pass

    def flush(self) -> None:
        self._sync()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join(timeout=max(5.0, 2 * self.flush_every))
        self._sync()
        if self._own_store:
            self.store.close()

    def _sync(self, **kwargs: Any) -> None:
        """A synchronous flush; with ``keep_going`` a failure is said once and the run
        goes on (records kept for the next try, or dropped once the store is damaged)."""
        try:
            self._flush(**kwargs)
        except Exception as e:
            if not self._keep_going:
                raise
            self._failed(e)

    def _failed(self, e: BaseException) -> None:
        """Say once that a write failed; a damaged store file is written no more."""
        text = str(e)
        if is_damaged(e):
            self.store_lost = True
            with self._lock:
                self._metrics, self._ranks, self._events, self._artifacts = [], [], [], []
                self._phase_pending = None
            print(f"comera store: {text}; this run goes on in its folder (metrics.jsonl, "
                  "checkpoints) and writes no more to the store; `comera repair` rebuilds "
                  "the store from the run folders", file=sys.stderr)
        elif not self._warned:
            self._warned = True
            print(f"comera store: write failed, will retry: {text}", file=sys.stderr)

    def __enter__(self) -> StoreSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals ---------------------------------------------------------------------

    def pending(self) -> int:
        """Number of buffered records not yet written."""
        with self._lock:
            return (len(self._metrics) + len(self._ranks) + len(self._events)
                    + len(self._artifacts) + int(self._phase_pending is not None))

    def _loop(self) -> None:
        while not self._stop.wait(self.flush_every):
            try:
                self._flush(heartbeat=self._heartbeat)
            except Exception as e:  # keep training; records stay buffered
                self._failed(e)

    def _flush(
        self,
        heartbeat: bool = False,
        status: tuple[str, str, str | None] | None = None,
    ) -> None:
        with self._flush_lock:
            with self._lock:
                metrics, self._metrics = self._metrics, []
                ranks, self._ranks = self._ranks, []
                events, self._events = self._events, []
                artifacts, self._artifacts = self._artifacts, []
                phase, self._phase_pending = self._phase_pending, None
                rewind = self._first_step if self._rewind_pending and (metrics or ranks) else None
            if self.owner_lost or self.store_lost or not (
                metrics or ranks or events or artifacts or heartbeat or status or phase
            ):
                return
            c0, w0 = time.thread_time(), time.perf_counter()
            try:
                self.store.write_batch(
                    self.run_id,
                    metrics=metrics,
                    ranks=ranks,
                    events=events,
                    artifacts=artifacts,
                    rewind_from=rewind,
                    heartbeat=heartbeat or status is not None,
                    status=status,
                    owner=self._owner,
                    phase=phase,
                )
            except NotOwnerError as e:  # another process owns the run: write nothing more
                self.owner_lost = True
                print(f"comera store: {e}; this process writes no more records", file=sys.stderr)
                return
            except BaseException:
                with self._lock:  # put them back in front, in order
                    self._metrics[:0] = metrics
                    self._ranks[:0] = ranks
                    self._events[:0] = events
                    self._artifacts[:0] = artifacts
                    if self._phase_pending is None:  # unless a newer one came meanwhile
                        self._phase_pending = phase
                raise
            if rewind is not None:
                self._rewind_pending = False
            st = self.stats
            st["flushes"] += 1
            st["rows"] += len(metrics) + len(ranks) + len(events) + len(artifacts)
            st["flush_cpu_s"] += time.thread_time() - c0
            st["flush_wall_s"] += time.perf_counter() - w0

