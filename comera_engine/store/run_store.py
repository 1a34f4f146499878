"""``RunStore``: the run store's one public class, made of its parts.

:class:`~comera_engine.store.connection.Database` opens the file (WAL, busy retries,
schema checks); :class:`~comera_engine.store.runs.RunRows` adds the runs and their
folders; :class:`~comera_engine.store.sweeps.SweepRows` the sweeps;
:class:`~comera_engine.store.metrics.MetricRows` what runs log. Store-wide
settings (``max_concurrent``, the dashboard's launch tokens) live here.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Mapping
from typing import Any

from comera_engine.store.lifecycle import RunLifecycle
from comera_engine.store.metrics import MetricRows
from comera_engine.store.runs import RunRows
from comera_engine.store.sweeps import SweepRows

#: A run with no completed step for ``max(STALL_FLOOR_S, STALL_STEPS x its median step
#: time)`` is stalled (``$COMERA_STALL_S`` sets the floor).
STALL_FLOOR_S = 60.0
STALL_STEPS = 20
#: Phases in which a run is expected to complete steps (or report evaluation progress).
_STEPPING_PHASES = (None, "training", "evaluating", "checkpointing")


def stall_floor() -> float:
    """The shortest quiet time that counts as stalled: ``$COMERA_STALL_S`` or 60 s."""
    try:
        return max(0.0, float(os.environ.get("COMERA_STALL_S", STALL_FLOOR_S)))
    except ValueError:
        return STALL_FLOOR_S


class RunStore(RunRows, SweepRows, MetricRows):
    """The SQLite run store: one file (default ``./runs/comera.db``, or
    ``$COMERA_HOME/comera.db``) in WAL mode; the run folder of run ``id`` is
    ``<store dir>/<id>/``.

    Safe to share between threads of one process (one connection behind a lock); every
    process opens its own ``RunStore``. ``create=False`` raises :class:`StoreError` when
    the file does not exist instead of creating it. A file that is not a SQLite database,
    or a SQLite database without this store's marker, raises :class:`StoreError` and is
    never written to.
    """

    def lifecycle(self, run_id: str, owner: Mapping[str, Any] | None = None) -> RunLifecycle:
        """The run's :class:`~comera_engine.store.lifecycle.RunLifecycle`: the one way its
        status changes (``owner``: the token the caller's writes carry)."""
        return RunLifecycle(self, run_id, owner)

    def get_setting(self, key: str, default: Any = None) -> Any:
        """A store-wide setting (JSON value), or ``default``."""
        rows = self._rows("SELECT value FROM settings WHERE key = ?", (key,))
        return json.loads(rows[0][0]) if rows else default

    def set_setting(self, key: str, value: Any) -> None:
        """Set a store-wide setting to a JSON-serialisable ``value``."""
        self.write(
            lambda c: c.execute(
                "INSERT INTO settings (key, value) VALUES (?, ?) "
                "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                (key, json.dumps(value)),
            )
        )

    def stalled_for(self, run: Mapping[str, Any] | str,
                    now: float | None = None) -> float | None:
        """Seconds since a live, stepping run (a row, or its id) last made progress (its
        last step's metric row, or a phase, progress or status change), when that
        exceeds ``max(floor, STALL_STEPS x its median step time)`` (:func:`stall_floor`);
        ``None`` while it makes progress, before its first step and for a run that is
        not running. The heartbeat is not progress: a frozen trainer under a live
        supervisor stalls."""
        if isinstance(run, str):
            run = self.get_run(run) or {}
        if run.get("status") not in ("running", "stopping") or run.get("last_step") is None:
            return None
        if run.get("phase") not in _STEPPING_PHASES:
            return None
        rows = self._rows(
            "SELECT time, value FROM metrics WHERE run_id = ? AND name = 'perf/step_time_s' "
            "ORDER BY step DESC LIMIT 101", (run["id"],))
        if not rows:
            return None
        times = [float(r[1]) for r in rows if r[1] is not None]
        median = statistics.median(times) if times else 0.0
        since = max(float(rows[0][0]), float(run.get("updated_at") or 0.0),
                    float(run.get("started_at") or 0.0))
        quiet = (time.time() if now is None else now) - since
        return quiet if quiet > max(stall_floor(), STALL_STEPS * median) else None
