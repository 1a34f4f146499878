"""SQLite run store (WAL), the batched :class:`StoreSink` and the dashboard's query API.

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

from comera_engine.store.db import (
    ACTIVE_STATUSES,
    DB_FILENAME,
    FINAL_STATUSES,
    HEARTBEAT_TIMEOUT_S,
    LOG_FILENAME,
    MIGRATIONS,
    RESUMABLE_STATUSES,
    SCHEMA_VERSION,
    STATUSES,
    RunNotFoundError,
    RunStore,
    StoreError,
    default_store_path,
    extract_traceback,
    pid_alive,
    read_log_tail,
    resolve_store_path,
)
from comera_engine.store.sink import StoreSink

__all__ = [
    "ACTIVE_STATUSES",
    "DB_FILENAME",
    "FINAL_STATUSES",
    "HEARTBEAT_TIMEOUT_S",
    "LOG_FILENAME",
    "MIGRATIONS",
    "RESUMABLE_STATUSES",
    "SCHEMA_VERSION",
    "STATUSES",
    "RunNotFoundError",
    "RunStore",
    "StoreError",
    "StoreSink",
    "default_store_path",
    "extract_traceback",
    "pid_alive",
    "read_log_tail",
    "resolve_store_path",
]
