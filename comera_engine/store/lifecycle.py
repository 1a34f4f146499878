"""A run's lifecycle: the one place its status changes, and the table of what may change.

``queued → running → (stopping →) finished | stopped | failed | diverged | crashed``;
``stopped``, ``crashed`` and ``failed`` runs can be queued again (a resume). Who moves a
run, and from where, is :data:`TRANSITIONS`: one row per action, naming the statuses the
action may leave and the statuses it may set. :class:`RunLifecycle` is the object of one
run that carries the actions out (``store.lifecycle(run_id)``), each as one conditional
update inside one transaction (with its event, when one is given), so a stale process
can never move a run that has gone on. Launcher, supervisor, Ray driver, reaper, the
``comera`` command and the trainer's :class:`~comera_engine.store.StoreSink` all change
a status through it; nothing else writes a run's status.

Whether a process is alive is not the store's business: :meth:`RunLifecycle.claim`
takes that judgement as a function (see :mod:`comera_engine.launch.owner`).
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from comera_engine.store.errors import RunNotFoundError
from comera_engine.store.runs import (
    FINAL_STATUSES,
    OWNER_COLUMNS,
    RESUMABLE_STATUSES,
    STATUSES,
    check_columns,
    check_owner_in,
    owner_token,
    set_phase_in,
    set_status_in,
)

if TYPE_CHECKING:
    from comera_engine.store.run_store import RunStore

__all__ = ["TRANSITIONS", "RunLifecycle", "TransitionError", "allowed", "check_action",
           "transition_in"]

_LIVE = frozenset({"queued", "running", "stopping"})

#: action -> (statuses it may leave, statuses it may set). The whole lifecycle.
TRANSITIONS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    # a supervisor or a Ray driver has started the run's trainer
    "start": (frozenset({"queued"}), frozenset({"running"})),
    # the trainer says it runs (a pending stop request wins: not from ``stopping``)
    "report": (frozenset({"queued", "running"}), frozenset({"running"})),
    # a foreground ``comera train --resume`` of a recorded run
    "reopen": (RESUMABLE_STATUSES, frozenset({"running"})),
    # ``comera stop``, the dashboard, a supervisor or driver told to stop
    "request_stop": (frozenset({"queued", "running"}), frozenset({"stopping"})),
    # a queued run that no process has taken stops at once (it never starts)
    "cancel": (frozenset({"queued"}), frozenset({"stopped"})),
    # the trainer's own final status (it may correct a ``crashed`` the reaper guessed)
    "finish": (_LIVE | {"crashed"}, FINAL_STATUSES),
    # the process watching the trainer (supervisor, Ray driver, launcher) records its end
    "end": (_LIVE, FINAL_STATUSES),
    # the reaper: the run's process is gone without a final status
    "crash": (_LIVE, frozenset({"crashed"})),
    # a resume: the run waits for a process again
    "requeue": (RESUMABLE_STATUSES, frozenset({"queued"})),
}


class TransitionError(ValueError):
    """An action asked to set a status it never sets (a programming error)."""


def allowed(action: str, current: str, status: str) -> bool:
    """Whether ``action`` moves a run from ``current`` to ``status`` (the table alone)."""
    sources, targets = TRANSITIONS[action]
    return current in sources and status in targets


def check_action(action: str, status: str) -> tuple[str, ...]:
    """The statuses ``action`` may leave, sorted; TransitionError when it never sets
    ``status``."""
    if action not in TRANSITIONS:
        raise TransitionError(f"action: must be one of {', '.join(TRANSITIONS)}, got {action!r}")
    if status not in STATUSES:
        raise TransitionError(f"status: must be one of {', '.join(STATUSES)}, got {status!r}")
    sources, targets = TRANSITIONS[action]
    if status not in targets:
        raise TransitionError(f"{action}: sets {', '.join(sorted(targets))}, not {status!r}")
    return tuple(sorted(sources))


def transition_in(
    c: sqlite3.Connection,
    run_id: str,
    action: str,
    status: str,
    error: str | None = None,
    *,
    where: Mapping[str, Any] | None = None,
    fields: Mapping[str, Any] | None = None,
    event: tuple[str, str] | None = None,
) -> bool:
    """Carry out ``action`` (to ``status``) inside the caller's transaction: only from the
    statuses :data:`TRANSITIONS` allows, only while the run's columns equal ``where``;
    ``fields`` are set with it and ``event`` (``(kind, text)``) logged with it. Returns
    whether the run changed."""
    sources = check_action(action, status)
    changed = set_status_in(c, run_id, status, error, sources, dict(fields or {}), where)
    if changed and event is not None:
        c.execute("INSERT INTO events (run_id, time, step, kind, text) VALUES (?, ?, ?, ?, ?)",
                  (run_id, time.time(), None, str(event[0]), str(event[1])))
    return changed


class RunLifecycle:
    """One run's lifecycle in a :class:`~comera_engine.store.RunStore`.

    Each method is one action of :data:`TRANSITIONS` (or a write that goes with the
    lifecycle: the owner claim, the heartbeat, the phase), written in one transaction.
    Status changes return whether they applied; ``event`` is ``(kind, text)``, logged
    in the same transaction when the change applies. ``owner``: the owner token the
    caller holds; when given, every write first checks that it still owns the run
    (:class:`~comera_engine.store.errors.NotOwnerError`)."""

    def __init__(self, store: RunStore, run_id: str,
                 owner: Mapping[str, Any] | None = None) -> None:
        self.store = store
        self.run_id = run_id
        self.owner = dict(owner) if owner is not None else None

    def __repr__(self) -> str:
        return f"RunLifecycle({self.run_id!r})"

    # ---- the one way a status changes ---------------------------------------------

    def transition(self, action: str, status: str, error: str | None = None, *,
                   where: Mapping[str, Any] | None = None,
                   event: tuple[str, str] | None = None, **fields: Any) -> bool:
        """Carry out ``action`` of :data:`TRANSITIONS`, setting ``status`` (and
        ``error``, and the run columns ``fields``); see :func:`transition_in`."""
        check_action(action, status)
        check_columns(fields)
        owner = self.owner

        def w(c: sqlite3.Connection) -> bool:
            if owner is not None:
                check_owner_in(c, self.run_id, owner)
            return transition_in(c, self.run_id, action, status, error, where=where,
                                 fields=fields, event=event)

        return self.store.write(w)

    # ---- the actions --------------------------------------------------------------

    def start(self, *, where: Mapping[str, Any] | None = None,
              event: tuple[str, str] | None = None, **fields: Any) -> bool:
        """``queued → running``: a supervisor or driver started the trainer (``fields``:
        its pid, attempt, ... recorded with it)."""
        return self.transition("start", "running", where=where, event=event, **fields)

    def reopen(self, event: tuple[str, str] | None = None, **fields: Any) -> bool:
        """``stopped | crashed | failed → running``: a foreground resume."""
        return self.transition("reopen", "running", event=event, ended_at=None, **fields)

    def request_stop(self, deadline: float, event: tuple[str, str] | None = None) -> bool:
        """``queued | running → stopping``, to be stopped by ``deadline`` (epoch s)."""
        return self.transition("request_stop", "stopping", event=event,
                               stop_deadline=float(deadline))

    def cancel(self, event: tuple[str, str] | None = None) -> bool:
        """``queued → stopped`` for a run no process has taken (``dispatched_at`` unset):
        it never starts."""
        return self.transition("cancel", "stopped", where={"dispatched_at": None},
                               event=event)

    def end(self, status: str, error: str | None = None, *,
            where: Mapping[str, Any] | None = None, event: tuple[str, str] | None = None,
            **fields: Any) -> bool:
        """``queued | running | stopping → final``: what the process watching the trainer
        (or the launcher, when none could start) records."""
        return self.transition("end", status, error, where=where, event=event, **fields)

    def crash(self, error: str, *, where: Mapping[str, Any] | None = None,
              event: tuple[str, str] | None = None) -> bool:
        """``queued | running | stopping → crashed``: its process is gone."""
        return self.transition("crash", "crashed", error, where=where, event=event)

    def requeue(self, event: tuple[str, str] | None = None, **fields: Any) -> bool:
        """``stopped | crashed | failed → queued``: a resume."""
        return self.transition("requeue", "queued", event=event, **fields)

    # ---- what goes with it ----------------------------------------------------------

    def claim(self, me: Mapping[str, Any], mine: Callable[[Mapping[str, Any]], bool],
              refuse: Callable[[Mapping[str, Any], str], None]) -> dict[str, Any]:
        """Take the run's owner columns for process ``me`` in one transaction; returns
        the owner token its writes carry. ``mine(held)``: whether the recorded owner is
        ``me`` already (kept); ``refuse(held, status)`` raises when a live other owner
        keeps the run (nothing changes), else the owner is replaced."""
        me = dict(me)

        def w(c: sqlite3.Connection) -> dict[str, Any]:
            cur = c.cursor()
            cur.row_factory = sqlite3.Row
            row = cur.execute("SELECT * FROM runs WHERE id = ?", (self.run_id,)).fetchone()
            if row is None:
                raise RunNotFoundError(f"run_id: no run {self.run_id!r} in {self.store.path}")
            held = owner_token(row)
            if mine(held):
                return held
            refuse(held, str(row["status"]))
            cols = ", ".join(f"{k} = ?" for k in OWNER_COLUMNS)
            c.execute(f"UPDATE runs SET {cols} WHERE id = ?",
                      (*(me[k] for k in OWNER_COLUMNS), self.run_id))
            return {k: me[k] for k in OWNER_COLUMNS}

        return self.store.write(w)

    def attach_supervisor(self, pid: int, host: str) -> None:
        """Record the supervisor just started for the run, unless it recorded itself."""
        self.store.write(lambda c: c.execute(
            "UPDATE runs SET supervisor_pid = ?, host = ? WHERE id = ? AND "
            "supervisor_pid IS NULL", (int(pid), host, self.run_id)))

    def heartbeat(self) -> None:
        """The process watching the run is alive."""
        self.store.heartbeat(self.run_id)

    def phase(self, phase: str | None, progress: float | None = None) -> None:
        """What the run is doing now, and how far along (see :data:`PHASES`)."""
        owner = self.owner

        def w(c: sqlite3.Connection) -> None:
            if owner is not None:
                check_owner_in(c, self.run_id, owner)
            set_phase_in(c, self.run_id, phase, progress)

        self.store.write(w)
