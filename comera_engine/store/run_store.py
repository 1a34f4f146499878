"""``RunStore``: the run store's one public class, made of its parts.

:class:`~comera_engine.store.connection.Database` opens the file (WAL, busy retries,
schema checks); :class:`~comera_engine.store.runs.RunRows` adds the runs and their
folders; :class:`~comera_engine.store.sweeps.SweepRows` the sweeps;
:class:`~comera_engine.store.metrics.MetricRows` what runs log. Store-wide
settings (``max_concurrent``, the dashboard's launch tokens) live here.
"""

from __future__ import annotations

import json
from typing import Any

from comera_engine.store.metrics import MetricRows
from comera_engine.store.runs import RunRows
from comera_engine.store.sweeps import SweepRows


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
