"""Signals to a run's trainer: a graceful stop (SIGCONT, then SIGTERM: it checkpoints),
a wake-up for a frozen one, and the kill (SIGKILL, then waiting until it is gone), to
its process group where it leads one. Torch-free.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping
from typing import Any

from comera_engine.launch.liveness import pid_alive


def signal_group(pid: int | None, sig: int) -> bool:
    """Send ``sig`` to the process group led by ``pid`` (the trainer and its children).
    Returns whether anything was signalled."""
    if not pid:
        return False
    try:
        os.killpg(int(pid), sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover
        return False


def wake(pid: int | None) -> None:
    """SIGCONT to ``pid``'s process group (or the process alone when it leads none): a
    frozen (SIGSTOP-ed) trainer must run again to write its last checkpoint."""
    if pid and not signal_group(pid, signal.SIGCONT):
        try:
            os.kill(int(pid), signal.SIGCONT)
        except OSError:
            pass


def send_stop_signal(pid: int | None, nproc: int = 1) -> bool:
    """SIGTERM to the trainer, after a SIGCONT (a stopped process would never act on
    it): the process itself (its data-loader workers are its own business), or with
    torchrun (``nproc > 1``) its worker processes, so that torchrun sees them end
    cleanly. Returns whether anything was signalled."""
    if not pid:
        return False
    wake(pid)
    if nproc > 1:
        try:
            import psutil

            workers = psutil.Process(int(pid)).children()
        except Exception:
            workers = []
        sent = False
        for w in workers:
            try:
                w.send_signal(signal.SIGCONT)
                w.send_signal(signal.SIGTERM)
                sent = True
            except Exception:
                pass
        if sent:
            return True
    try:
        os.kill(int(pid), signal.SIGTERM)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def kill_owner(run: Mapping[str, Any], timeout: float = 5.0) -> bool:
    """SIGKILL the run's trainer (its process group when it leads one, else the process
    itself) and return whether it is gone within ``timeout`` seconds."""
    pid = run["pid"]
    if pid and pid_alive(pid, run["pid_started"]) and not signal_group(pid, signal.SIGKILL):
        try:
            os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass
    t0 = time.monotonic()
    while pid_alive(pid, run["pid_started"]):
        if time.monotonic() - t0 > timeout:
            return False
        time.sleep(0.05)
    return True
