"""One scheduler, two executors.

:class:`Scheduler` is what every run goes through between ``queued`` and its final
status, whatever runs its trainer: it takes runs from the queue (``claim``: the store's
:meth:`~comera_engine.store.RunStore.claim_queued`, which applies the concurrency
limit), hands each to its :class:`Executor`, records the start, beats for the runs in
flight, turns a ``stopping`` status into a graceful cancel and, past the stop deadline,
a forced one, and records how each run ended. Every status change goes through the
run's :class:`~comera_engine.store.lifecycle.RunLifecycle`.

Executors only start, watch and cancel:

* the **local executor** (:class:`comera_engine.launch.supervisor.LocalExecutor`): the
  trainer as a subprocess in its own process group, one per detached supervisor
  (``comera launch``, the dashboard, local sweeps; :func:`comera_engine.launch.runs.dispatch`
  fills the local queue by starting supervisors);
* the **Ray executor** (:class:`comera_engine.launch.ray_backend.RayExecutor`): a
  sweep's cells as Ray tasks, one detached driver per sweep.

:func:`start_queued` is the one entry that starts what is queued, for a run or a sweep
on either backend, through the executor's starter its caller hands in (the sweep's:
:data:`comera_engine.launch.sweep.STARTERS`); nothing here imports an executor.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from comera_engine.store import FINAL_STATUSES, RunStore, StoreError
from comera_engine.store.errors import is_damaged

__all__ = ["HEARTBEAT_EVERY_S", "Executor", "Outcome", "Scheduler", "Slot", "Starter",
           "start_queued"]

#: Seconds between the scheduler's heartbeats of the runs in flight.
HEARTBEAT_EVERY_S = 2.0
#: Times a run's end is tried again through store errors before it is left to the reaper.
_FINISH_TRIES = 3


@dataclass
class Slot:
    """A run in flight: the executor's handle and what was asked of it."""

    run_id: str
    attempt: int
    handle: Any = None
    #: the run's columns that must still hold when its end is recorded
    where: dict[str, Any] = field(default_factory=dict)
    stop_deadline: float | None = None  # set once a graceful stop was sent
    forced: bool = False
    exit_code: int | None = None  # the trainer's, once the executor knows it
    tries: int = 0


@dataclass
class Outcome:
    """How a run ended, as its executor judges it."""

    status: str
    error: str | None
    exit_code: int | None
    event: tuple[str, str]


class Executor(Protocol):
    """What runs a trainer: submit, wait, cancel (and judge the end)."""

    #: Seconds after a stop deadline before the cancel is forced.
    force_after: float
    #: What a run that could not be submitted (OSError) records as its error, before it.
    start_error: str

    def submit(self, run: Mapping[str, Any], attempt: int) -> tuple[Any, dict[str, Any]]:
        """Start the run's trainer; returns its handle and the run columns to record
        with the start (e.g. the trainer's ``pid``). OSError: it could not start."""
        ...

    def started(self, slot: Slot) -> str:
        """The ``start`` event's text."""
        ...

    def wait(self, slots: list[Slot], timeout: float) -> list[Slot]:
        """The slots whose trainer has ended, waiting up to ``timeout`` for the first."""
        ...

    def cancel(self, slot: Slot, force: bool) -> None:
        """Ask the trainer to stop (it checkpoints), or end it now (``force``)."""
        ...

    def outcome(self, slot: Slot, run: Mapping[str, Any]) -> Outcome:
        """Bring back what the ended trainer left and judge how it ended."""
        ...

    def ended(self, slot: Slot, note: str) -> None:
        """Say that a run's trainer ended and what was recorded (``note``)."""
        ...

    def say(self, text: str) -> None:
        """A line of the scheduler's own output."""
        ...


class Scheduler:
    """Runs queued runs through an :class:`Executor` to their end.

    ``claim()``: the next run to start (a row), or ``None`` (the queue and its limit);
    ``waiting()``: whether runs wait in the queue (the loop goes on while they do);
    ``cancel_waiting()``: stop the waiting runs when the scheduler is stopped;
    ``poll``: seconds between looks at the store; ``stop_timeout``: seconds a stop
    gives the trainer to checkpoint when the scheduler itself is stopped (SIGTERM,
    Ctrl-C) or a run's stop has no deadline; ``name``: what the scheduler runs and
    who it is, for its messages (``("the sweep", "the driver")``)."""

    def __init__(
        self,
        store: RunStore,
        executor: Executor,
        claim: Callable[[], Mapping[str, Any] | None],
        *,
        waiting: Callable[[], bool] = lambda: False,
        cancel_waiting: Callable[[str], None] = lambda reason: None,
        poll: float = 0.5,
        stop_timeout: float = 60.0,
        name: tuple[str, str] = ("the sweep", "the driver"),
    ) -> None:
        self.store, self.executor = store, executor
        self.claim, self.waiting, self.cancel_waiting = claim, waiting, cancel_waiting
        self.poll, self.stop_timeout = float(poll), float(stop_timeout)
        self.inflight: dict[str, Slot] = {}
        self.stop_reason: str | None = None
        self._last_beat = 0.0
        self.name = name

    # ---- the loop

    def run(self) -> None:
        """Until nothing is in flight or waiting, or the scheduler is stopped (SIGTERM
        in the main thread, Ctrl-C): then its runs are stopped and collected."""
        restore = self._trap_sigterm()
        try:
            try:
                while self.tick():
                    pass
            except KeyboardInterrupt:
                self.stop_reason = "interrupted (Ctrl-C)"
            if self.stop_reason is not None:
                self.shutdown(self.stop_reason)
        finally:
            restore()

    def tick(self) -> bool:
        """One round: carry out stops, start what fits, beat, then wait up to ``poll``
        for trainers to end and record them. Returns whether there is more to do."""
        for step in (self.enforce_stops, self.fill, self.beat):
            try:
                step()
            except StoreError as e:  # a locked or passing problem: go on, try again
                self.executor.say(f"store error, trying again: {e}")
        self.collect(self.poll)
        if self.stop_reason is not None:
            return False
        if self.inflight:
            return True
        try:
            return self.waiting()
        except StoreError:
            return True

    def _trap_sigterm(self) -> Callable[[], None]:
        if threading.current_thread() is not threading.main_thread():
            return lambda: None

        def on_term(signum: int, frame: Any) -> None:
            self.stop_reason = f"{self.name[1]} got SIGTERM"

        old = signal.signal(signal.SIGTERM, on_term)
        return lambda: signal.signal(signal.SIGTERM, old)

    # ---- starting

    def fill(self) -> None:
        """Start queued runs while the queue gives them."""
        while self.stop_reason is None and (run := self.claim()) is not None:
            self.submit(run)

    def submit(self, run: Mapping[str, Any]) -> Slot | None:
        """Hand a claimed run to the executor and record its start."""
        st, rid = self.store, str(run["id"])
        life = st.lifecycle(rid)
        attempt = int(run.get("attempt") or 0) + 1
        try:
            handle, fields = self.executor.submit(run, attempt)
        except OSError as e:
            life.end("failed", f"{self.executor.start_error}: {e}")
            return None
        # watched from now on, whatever the store says next
        slot = Slot(rid, attempt, handle, {"attempt": attempt,
                                           "pid": fields.get("pid", run.get("pid"))})
        self.inflight[rid] = slot
        st.update_run(rid, attempt=attempt, resume_pending=0, heartbeat_at=time.time(),
                      exit_code=None, **fields)
        life.start()  # not when a stop came first: then the loop stops it
        st.log_event(rid, "start", self.executor.started(slot))
        return slot

    # ---- while they run

    def beat(self) -> None:
        now = time.monotonic()
        if now - self._last_beat < HEARTBEAT_EVERY_S:
            return
        self._last_beat = now
        for rid in list(self.inflight):
            self.store.lifecycle(rid).heartbeat()

    def enforce_stops(self) -> None:
        """Cancel the trainers of runs marked ``stopping``; force those past their
        deadline (plus the executor's ``force_after``)."""
        now = time.time()
        for rid, slot in list(self.inflight.items()):
            run = self.store.get_run(rid)
            if run is None:  # the row was deleted: nothing to record
                self.executor.cancel(slot, force=True)
                del self.inflight[rid]
            elif run["status"] == "stopping" and slot.stop_deadline is None:
                slot.stop_deadline = float(run["stop_deadline"] or now + self.stop_timeout)
                self.executor.cancel(slot, force=False)
            elif slot.stop_deadline is not None and not slot.forced and \
                    now > slot.stop_deadline + self.executor.force_after:
                slot.forced = True
                self.executor.cancel(slot, force=True)

    def shutdown(self, reason: str) -> None:
        """Stop everything: waiting runs stopped, runs in flight asked to stop (by
        force after their deadline, or on a second Ctrl-C) and collected."""
        self.executor.say(f"stopping {self.name[0]}: {reason}")
        try:
            self.cancel_waiting(reason)
        except StoreError as e:
            self.executor.say(f"store error: {e}")
        deadline = time.time() + self.stop_timeout
        for rid in list(self.inflight):
            try:
                self.store.lifecycle(rid).request_stop(
                    deadline, event=("stop", f"stop requested: {reason}"))
            except StoreError as e:
                self.executor.say(f"store error: {e}")
        while self.inflight:
            try:
                try:
                    self.enforce_stops()
                except StoreError as e:
                    self.executor.say(f"store error, trying again: {e}")
                self.collect(self.poll)
            except KeyboardInterrupt:  # again: no more waiting
                for slot in self.inflight.values():
                    if not slot.forced:
                        slot.forced = True
                        self.executor.cancel(slot, force=True)

    # ---- ending

    def collect(self, timeout: float) -> None:
        """Record the runs whose trainer has ended, waiting up to ``timeout``."""
        if not self.inflight:
            time.sleep(timeout)
            return
        for slot in self.executor.wait(list(self.inflight.values()), timeout):
            try:
                self.finish(slot)
                self.inflight.pop(slot.run_id, None)
            except StoreError as e:  # tried again next round, a few times
                slot.tries += 1
                if is_damaged(e) or slot.tries >= _FINISH_TRIES:
                    self.inflight.pop(slot.run_id, None)
                    self.executor.ended(slot, f"the store could not record it ({e})")

    def finish(self, slot: Slot) -> None:
        """Record how a run ended, unless it has moved on (a newer attempt, another
        owner) or already has a final status (then only its exit code)."""
        st, rid = self.store, slot.run_id
        run = st.get_run(rid)
        if run is None:
            return
        out = self.executor.outcome(slot, run)
        run = st.get_run(rid) or run
        if any(run.get(k) != v for k, v in slot.where.items()):
            self.executor.ended(slot, "the run has moved on")
            return
        if run["status"] in FINAL_STATUSES:
            st.update_run(rid, exit_code=out.exit_code)  # same attempt and owner
            self.executor.ended(slot, f"status {run['status']}")
            return
        st.lifecycle(rid).end(out.status, out.error, where=slot.where,
                              exit_code=out.exit_code, event=out.event)
        self.executor.ended(slot, f"status {out.status}")


#: What starts the queued runs of one backend: ``start(store, sweep_id)``.
Starter = Callable[[RunStore, str | None], object]


def start_queued(store: RunStore, sweep_id: str | None,
                 starters: Mapping[str, Starter]) -> None:
    """Start what is queued through the starter of its backend: ``starters`` by backend
    name (:data:`~comera_engine.store.SWEEP_BACKENDS`), handed in by the caller, so the
    scheduler imports none of its executors. A sweep's cells start by the starter of the
    sweep's backend (Ray: its detached driver), anything else by ``starters["local"]``
    (the local queue)."""
    sweep = store.get_sweep(sweep_id) if sweep_id else None
    backend = sweep.get("backend") if sweep is not None else None
    starters[backend if backend in starters else "local"](store, sweep_id)
