"""SQLite run store (WAL), the batched :class:`StoreSink` and the dashboard's query API.

Modules: ``layout`` (where the file and the run folders are, reading a run's log and
checkpoints), ``schema`` (tables, migrations, recognising a store file), ``connection``
(WAL, busy retries, the per-file connection count), ``runs`` (run rows, the queue),
``lifecycle`` (a run's status changes: :data:`TRANSITIONS`, the one table of what may
change from where, and :class:`RunLifecycle`, the one way they are written),
``sweeps`` (sweeps of runs), ``metrics`` (what a run logs, batched writes, reads for
plots), ``run_store`` (:class:`RunStore`, made of those) and ``sink``
(:class:`StoreSink`). Whether a run's process is alive, and marking dead runs crashed,
is the launcher's (:mod:`comera_engine.launch.liveness`).

>>> store = RunStore()                       # $COMERA_HOME/comera.db or ./runs/comera.db
>>> rid = store.create_run("digits", {"model": {"kind": "tt_mlp"}})
>>> with StoreSink(store, rid) as sink:      # a comera_engine.metrics.MetricsSink
...     sink.set_status("running")
...     sink.log_metrics(0, {"loss/task": 2.3})
...     sink.set_status("finished")
>>> store.series(rid, "loss/task")["value"]
[2.3]
"""

from __future__ import annotations

from comera_engine.store.errors import RunNotFoundError, StoreError
from comera_engine.store.layout import (
    DB_FILENAME,
    LOG_FILENAME,
    default_store_path,
    extract_traceback,
    list_checkpoints,
    read_log_tail,
    resolve_store_path,
)
from comera_engine.store.lifecycle import TRANSITIONS, RunLifecycle
from comera_engine.store.run_store import RunStore
from comera_engine.store.runs import (
    ACTIVE_STATUSES,
    FINAL_STATUSES,
    HEARTBEAT_TIMEOUT_S,
    PHASES,
    RESUMABLE_STATUSES,
    STATUSES,
    new_run_id,
)
from comera_engine.store.schema import MIGRATIONS, SCHEMA_VERSION
from comera_engine.store.sink import StoreSink
from comera_engine.store.sweeps import SWEEP_BACKENDS, new_sweep_id, sweep_status

__all__ = [
    "ACTIVE_STATUSES",
    "DB_FILENAME",
    "FINAL_STATUSES",
    "HEARTBEAT_TIMEOUT_S",
    "LOG_FILENAME",
    "MIGRATIONS",
    "PHASES",
    "RESUMABLE_STATUSES",
    "SCHEMA_VERSION",
    "STATUSES",
    "SWEEP_BACKENDS",
    "TRANSITIONS",
    "RunLifecycle",
    "RunNotFoundError",
    "RunStore",
    "StoreError",
    "StoreSink",
    "default_store_path",
    "extract_traceback",
    "list_checkpoints",
    "new_run_id",
    "new_sweep_id",
    "read_log_tail",
    "resolve_store_path",
    "sweep_status",
]
