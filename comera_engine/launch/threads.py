"""A thread budget per run: the CPU cores of this machine split between the runs in flight.

Two runs that each start one BLAS/OpenMP thread per core on a shared machine fight for
the cores (10-30x slower on 2 cores). A run started by the launcher (``comera launch``,
the dashboard, a sweep) whose launch environment does not set ``OMP_NUM_THREADS`` itself
is marked ``COMERA_THREADS=auto``: when it is dispatched it gets ``cores // runs in
flight`` threads (at least 1), written into its ``launch_env.json`` as
``OMP_NUM_THREADS`` and logged as a ``threads`` event; while it trains, the trainer
follows the budget as other runs start and end (:mod:`comera_engine.train.threads`).
A run whose environment sets ``OMP_NUM_THREADS`` keeps it (the user's choice).

Runs in flight: this host's runs that are running, stopping or dispatched, a foreground
``comera train`` included. Torch-free.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from comera_engine.store import RunStore

__all__ = ["AUTO_KEY", "cpu_cores", "runs_in_flight", "thread_budget", "threads_note"]

#: Launch-environment key that marks a run whose thread count the launcher sets.
AUTO_KEY = "COMERA_THREADS"


def cpu_cores() -> int:
    """The cores this process may run on (its affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def thread_budget(cores: int, runs: int) -> int:
    """Threads for one of ``runs`` runs sharing ``cores`` cores: ``cores // runs``, >= 1."""
    return max(1, int(cores) // max(1, int(runs)))


def runs_in_flight(store: RunStore, host: str | None = None) -> int:
    """This host's runs that have (or are about to have) a trainer: running, stopping or
    dispatched (a dispatched run may not have recorded its host yet: counted)."""
    from comera_engine.launch.liveness import this_host

    host = host or this_host()
    return sum(1 for r in store.active_runs() if not r.get("host") or r["host"] == host)


def threads_note(env: Mapping[str, str] | None) -> str | None:
    """What a run's launch environment says about its threads, for its page and the
    launcher's message (``None``: nothing recorded)."""
    if not env:
        return None
    threads = env.get("OMP_NUM_THREADS")
    if env.get(AUTO_KEY) == "auto":
        shared = env.get("COMERA_THREADS_SHARED")
        return (f"{threads} thread(s) at start" + (f" ({shared})" if shared else "")
                + "; follows the runs in flight") if threads else "thread budget at dispatch"
    return f"{threads} thread(s) (OMP_NUM_THREADS set at launch)" if threads else None
