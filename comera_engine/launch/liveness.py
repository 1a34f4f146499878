"""Is a run's process alive, and marking the runs whose process died as ``crashed``.

A run records its trainer's ``pid``, that process's start time ``pid_started`` (so a
reused pid is not taken for it), its supervisor's pid and the ``host``. On this host the
pids decide; for another host, or a run without pids, the heartbeat does (older than
:data:`~comera_engine.store.HEARTBEAT_TIMEOUT_S` means gone). The store only records
what this module decides.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping
from typing import Any

from comera_engine.store import HEARTBEAT_TIMEOUT_S, RunStore, read_log_tail
from comera_engine.store.layout import log_tail_line

__all__ = [
    "dead_reason",
    "pid_alive",
    "process_start_time",
    "processes_alive",
    "reap",
    "this_host",
    "this_process",
]


def this_host() -> str:
    """This machine's host name, as runs record it."""
    return socket.gethostname()


def pid_alive(pid: int | None, started: float | None = None) -> bool:
    """Whether ``pid`` is a live (non-zombie) process on this host, and the same process
    that started at ``started`` (epoch seconds, within 1 s) when given."""
    if not pid:
        return False
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil is a dependency
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    try:
        p = psutil.Process(int(pid))
        if p.status() == psutil.STATUS_ZOMBIE:
            return False
        if started is not None and abs(p.create_time() - float(started)) > 1.0:
            return False  # the pid was reused by another process
        return True
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def process_start_time(pid: int) -> float | None:
    """Creation time (epoch seconds) of ``pid``, or ``None``."""
    try:
        import psutil

        return float(psutil.Process(int(pid)).create_time())
    except Exception:
        return None


def this_process() -> dict[str, Any]:
    """The run columns that identify this process: ``pid``, ``pid_started``, ``host``
    (what a trainer's :class:`~comera_engine.store.StoreSink` records when it starts
    without a supervisor)."""
    pid = os.getpid()
    return {"pid": pid, "pid_started": process_start_time(pid), "host": this_host()}


def processes_alive(run: Mapping[str, Any]) -> bool:
    """Whether the run's trainer or supervisor is alive on this host (``False`` for a run
    on another host: nothing here can tell)."""
    if run.get("host") and run["host"] != this_host():
        return False
    return pid_alive(run.get("pid"), run.get("pid_started")) or pid_alive(
        run.get("supervisor_pid")
    )


def dead_reason(
    run: Mapping[str, Any], host: str, now: float, stale_after: float = HEARTBEAT_TIMEOUT_S
) -> str | None:
    """Why an active run counts as gone, or ``None`` while it may be alive.

    On ``host`` with a trainer or supervisor pid: gone when neither process is alive.
    Otherwise (another host, no pids): gone when its last sign of life (heartbeat, else
    dispatch, else start) is missing or more than ``stale_after`` seconds before ``now``.
    """
    if run["host"] == host and (run["pid"] or run["supervisor_pid"]):
        if not pid_alive(run["pid"], run["pid_started"]) and not pid_alive(
            run["supervisor_pid"]
        ):
            return "its process is gone"
        return None
    ref = run["heartbeat_at"] or run["dispatched_at"] or run["started_at"]
    if ref is None or now - ref > stale_after:
        return f"no heartbeat for {stale_after:g} s"
    return None


def reap(store: RunStore, stale_after: float = HEARTBEAT_TIMEOUT_S) -> list[str]:
    """Mark runs whose process is gone without a final status as ``crashed``.

    Checks every running, stopping or dispatched run with :func:`dead_reason`; the tail
    of a dead run's log is stored as its error, and a ``crash`` event is logged. The
    change applies only while the run still has the attempt and pid that were judged (a
    run that moved on meanwhile is left alone). Returns the ids it marked.
    """
    host = this_host()
    now = time.time()
    marked: list[str] = []
    for run in store.active_runs():
        reason = dead_reason(run, host, now, stale_after)
        if reason is None:
            continue
        tail = read_log_tail(store.log_path(run["id"]))
        error = f"crashed: {reason} and it reported no final status"
        if tail:
            error += f"; last log lines: {log_tail_line(tail)}"
        if store.lifecycle(run["id"]).crash(
            error,
            where={"attempt": run["attempt"], "pid": run["pid"]},
            event=("crash", f"marked crashed: {reason}"),
        ):
            marked.append(run["id"])
    return marked
