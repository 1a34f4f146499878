"""SQLite run store: runs, metrics, rank snapshots, events and artifacts.

One file (default ``./runs/comera.db``, or ``$COMERA_HOME/comera.db``) in WAL mode, so one
writer at a time and any number of readers that never block it. Every connection sets a
busy timeout, keeps write transactions short (``BEGIN IMMEDIATE`` … ``COMMIT``) and
retries on ``SQLITE_BUSY``. The run folder of run ``id`` is ``<store dir>/<id>/``.

A file that is not a SQLite database, or a SQLite database without this store's marker,
raises :class:`StoreError` and is never written to.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import sqlite3
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

SCHEMA_VERSION = 1
APPLICATION_ID = 0x434D5241  # "CMRA" in the SQLite header (offset 68)
MARKER = "comera-run-store"
DB_FILENAME = "comera.db"
LOG_FILENAME = "train.log"
SQLITE_MAGIC = b"SQLite format 3\x00"

#: Every status a run can have.
STATUSES = (
    "queued",
    "running",
    "stopping",
    "finished",
    "stopped",
    "failed",
    "diverged",
    "crashed",
)
#: Statuses after which no process works on the run.
FINAL_STATUSES = frozenset({"finished", "stopped", "failed", "diverged", "crashed"})
#: Statuses of a run that has (or should have) a live process.
ACTIVE_STATUSES = frozenset({"running", "stopping"})
#: Statuses a run can be resumed from.
RESUMABLE_STATUSES = frozenset({"stopped", "crashed"})

#: A run on another host (or without a pid) is crashed when its heartbeat is older (the
#: sink beats every 0.5 s, the supervisor every 2 s: a dead run is marked within 10 s).
HEARTBEAT_TIMEOUT_S = 8.0

T = TypeVar("T")


class StoreError(ValueError):
    """The run store cannot be used: foreign or corrupt file, newer schema, unknown run."""


class RunNotFoundError(StoreError):
    """No run matches the given id, id prefix or name."""


def default_store_path() -> Path:
    """``$COMERA_HOME/comera.db`` when ``COMERA_HOME`` is set, else ``./runs/comera.db``."""
    home = os.environ.get("COMERA_HOME")
    return (Path(home) if home else Path("runs")) / DB_FILENAME


def resolve_store_path(path: str | os.PathLike[str] | None = None) -> Path:
    """The database file for ``path``: a file (``runs/comera.db``), a folder
    (``<folder>/comera.db``; a path that does not exist and has no suffix counts as a
    folder) or ``None`` (:func:`default_store_path`)."""
    if path is None or str(path) == "":
        return default_store_path().absolute()
    text = os.fspath(path)
    p = Path(text).expanduser()
    if p.is_dir() or (not p.exists() and (not p.suffix or text.endswith(("/", os.sep)))):
        p = p / DB_FILENAME
    return p.absolute()


def new_run_id() -> str:
    """Sortable, unique-enough id: ``YYYYmmdd-HHMMSS-xxxx``."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


# --------------------------------------------------------------------------------------
# schema and migrations


def _execute_script(c: sqlite3.Connection, script: str) -> None:
    """Run ``;``-separated statements inside the caller's transaction (``executescript``
    would commit it)."""
    for stmt in script.split(";"):
        if stmt.strip():
            c.execute(stmt)


def _migrate_to_1(c: sqlite3.Connection) -> None:
    _execute_script(
        c,
        """
        CREATE TABLE comera_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        CREATE TABLE schema_version (version INTEGER NOT NULL, applied_at REAL NOT NULL);
        CREATE TABLE settings (key TEXT PRIMARY KEY, value TEXT);
        CREATE TABLE runs (
            id TEXT PRIMARY KEY,
            name TEXT NOT NULL,
            config TEXT NOT NULL,
            status TEXT NOT NULL,
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL,
            queued_at REAL,
            dispatched_at REAL,
            started_at REAL,
            ended_at REAL,
            heartbeat_at REAL,
            pid INTEGER,
            pid_started REAL,
            supervisor_pid INTEGER,
            host TEXT,
            cwd TEXT,
            device TEXT,
            gpus TEXT,
            nproc INTEGER NOT NULL DEFAULT 1,
            attempt INTEGER NOT NULL DEFAULT 0,
            resume_pending INTEGER NOT NULL DEFAULT 0,
            stop_deadline REAL,
            exit_code INTEGER,
            last_step INTEGER,
            error TEXT
        );
        CREATE INDEX runs_status ON runs (status);
        CREATE INDEX runs_created ON runs (created_at);
        CREATE TABLE metrics (
            run_id TEXT NOT NULL,
            name TEXT NOT NULL,
            step INTEGER NOT NULL,
            value REAL,
            time REAL NOT NULL,
            PRIMARY KEY (run_id, name, step)
        ) WITHOUT ROWID;
        CREATE TABLE metric_names (
            run_id TEXT NOT NULL,
            name TEXT NOT NULL,
            PRIMARY KEY (run_id, name)
        ) WITHOUT ROWID;
        CREATE TABLE rank_snapshots (
            id INTEGER PRIMARY KEY,
            run_id TEXT NOT NULL,
            step INTEGER NOT NULL,
            layer TEXT NOT NULL,
            ranks TEXT NOT NULL,
            time REAL NOT NULL
        );
        CREATE INDEX ranks_run_layer_step ON rank_snapshots (run_id, layer, step);
        CREATE INDEX ranks_run_step ON rank_snapshots (run_id, step);
        CREATE TABLE events (
            id INTEGER PRIMARY KEY,
            run_id TEXT NOT NULL,
            time REAL NOT NULL,
            step INTEGER,
            kind TEXT NOT NULL,
            text TEXT NOT NULL
        );
        CREATE INDEX events_run ON events (run_id, id);
        CREATE TABLE artifacts (
            id INTEGER PRIMARY KEY,
            run_id TEXT NOT NULL,
            kind TEXT NOT NULL,
            path TEXT NOT NULL,
            size INTEGER,
            time REAL NOT NULL
        );
        CREATE INDEX artifacts_run ON artifacts (run_id, id);
        """
    )
    c.execute("INSERT INTO comera_meta (key, value) VALUES ('app', ?)", (MARKER,))


#: ``(version, migration)`` in order; migration ``v`` takes a store at ``v - 1`` to ``v``.
MIGRATIONS: list[tuple[int, Callable[[sqlite3.Connection], None]]] = [
    (1, _migrate_to_1),
]

_RUN_COLUMNS = frozenset(
    {
        "name",
        "config",
        "status",
        "queued_at",
        "dispatched_at",
        "started_at",
        "ended_at",
        "heartbeat_at",
        "pid",
        "pid_started",
        "supervisor_pid",
        "host",
        "cwd",
        "device",
        "gpus",
        "nproc",
        "attempt",
        "resume_pending",
        "stop_deadline",
        "exit_code",
        "last_step",
        "error",
    }
)


def _is_busy(e: sqlite3.Error) -> bool:
    msg = str(e).lower()
    return "locked" in msg or "busy" in msg


def _execute_when_free(conn: sqlite3.Connection, sql: str, timeout: float) -> None:
    """Run ``sql``, retrying while the database is busy, for up to ``timeout`` seconds.

    For statements SQLite may refuse at once instead of calling the busy handler
    (``BEGIN IMMEDIATE`` while another connection writes; ``PRAGMA journal_mode = WAL``
    while another one creates the schema: seen as a first-open failure of one of four
    sessions opening a new store together)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            conn.execute(sql)
            return
        except sqlite3.OperationalError as e:
            if _is_busy(e) and time.monotonic() < deadline:
                time.sleep(0.05)
                continue
            raise


def _nan(v: Any) -> float:
    return float("nan") if v is None else float(v)


def pid_alive(pid: int | None, started: float | None = None) -> bool:
    """Whether ``pid`` is a live (non-zombie) process on this host, and the same process
    that started at ``started`` (epoch seconds) when given."""
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


def read_log_tail(path: str | os.PathLike[str], lines: int = 40, max_bytes: int = 65536) -> str:
    """The last ``lines`` lines of a log file (``""`` when it is missing)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return ""
    text = data.decode("utf-8", errors="replace")
    return "\n".join(text.splitlines()[-lines:])


def extract_traceback(text: str) -> str | None:
    """The last Python traceback in ``text`` (to its end), or ``None``."""
    i = text.rfind("Traceback (most recent call last)")
    return text[i:].strip() if i >= 0 else None


# --------------------------------------------------------------------------------------
# Closing *any* file descriptor of a file drops all POSIX (fcntl) locks this process holds
# on it, including SQLite's. So the database header is read with Python only while this
# process has no open connection to that file; connections are counted per file here.

#
# A connection's count is dropped by a weakref finalizer. sqlite3 connections sit in a
# reference cycle (their statement cache wraps the connection), so the finalizer runs in
# the garbage collector: in any thread, at any allocation, including one made while that
# thread holds _LIVE_LOCK. The finalizer therefore takes no lock: it queues the file's key
# (deque.append is atomic) and whoever takes _LIVE_LOCK next applies the queue (taking the
# lock there deadlocked a thread against itself: CI hung in test_store).

_LIVE_LOCK = threading.Lock()
_LIVE: dict[tuple[int, int], int] = {}
_RELEASED: deque[tuple[int, int]] = deque()


def _file_key(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


class _Connection(sqlite3.Connection):
    """A connection that can be weakly referenced (for the per-file count)."""


def _release(key: tuple[int, int]) -> None:
    """Finalizer of a counted connection: queue ``key``; never blocks (see above)."""
    _RELEASED.append(key)


def _bump(key: tuple[int, int], delta: int) -> int:
    """Add ``delta`` to the count of ``key`` (dropped at zero); returns the new count.
    The caller holds ``_LIVE_LOCK``."""
    n = _LIVE.get(key, 0) + delta
    if n > 0:
        _LIVE[key] = n
    else:
        _LIVE.pop(key, None)
    return n


def _live_count(key: tuple[int, int] | None, add: int = 0) -> int:
    """This process's open connections to the file ``key``, after applying the queued
    releases and adding ``add``. The caller holds ``_LIVE_LOCK``."""
    while True:
        try:
            _bump(_RELEASED.popleft(), -1)
        except IndexError:
            break
    return 0 if key is None else _bump(key, add)


class RunStore:
    """The SQLite run store.

    Safe to share between threads of one process (one connection behind a lock); every
    process opens its own ``RunStore``. ``create=False`` raises :class:`StoreError` when
    the file does not exist instead of creating it.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        create: bool = True,
        busy_timeout: float = 30.0,
    ) -> None:
        self.path = resolve_store_path(path)
        self.root = self.path.parent
        self.busy_timeout = float(busy_timeout)
        self._lock = threading.RLock()
        self._conn: sqlite3.Connection | None = None
        self._conn_pid = -1
        self._finalizer: weakref.finalize | None = None
        if not self.path.exists():
            if not create:
                raise StoreError(f"store: no run store at {self.path}")
            self.path.parent.mkdir(parents=True, exist_ok=True)
        with _LIVE_LOCK:
            if not _live_count(_file_key(self.path)):
                self._check_header()
        self._connection()  # validate schema now, not at first query

    # ---- connection handling -------------------------------------------------------

    def _check_header(self) -> None:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return
        if size == 0:
            return
        with open(self.path, "rb") as f:
            head = f.read(100)
        if len(head) < 100 or not head.startswith(SQLITE_MAGIC):
            raise StoreError(
                f"store: {self.path} is not a SQLite database (a foreign or corrupt file); "
                "refusing to open or overwrite it — move it away or choose another "
                "--store / COMERA_HOME"
            )
        app_id = int.from_bytes(head[68:72], "big")
        if app_id not in (0, APPLICATION_ID):
            raise StoreError(
                f"store: {self.path} is a SQLite database of another application "
                f"(application_id {app_id:#x}), not a CoMERA run store; refusing to use it"
            )

    def _corrupt(self, e: sqlite3.Error) -> StoreError:
        return StoreError(
            f"store: {self.path} is corrupt or unreadable ({e}); it was left untouched — "
            "restore a backup or choose another --store / COMERA_HOME"
        )

    def _wrap(self, e: sqlite3.Error) -> StoreError:
        msg = str(e).lower()
        if "malformed" in msg or "not a database" in msg or "corrupt" in msg:
            return self._corrupt(e)
        if _is_busy(e):
            return StoreError(
                f"store: {self.path} stayed locked for {self.busy_timeout:g} s ({e})"
            )
        return StoreError(f"store: {self.path}: {e}")

    def _connection(self) -> sqlite3.Connection:
        with self._lock:
            if self._conn is not None and self._conn_pid == os.getpid():
                return self._conn
            self._conn = None  # after a fork, never reuse the parent's connection
            conn = sqlite3.connect(
                str(self.path),
                timeout=self.busy_timeout,
                isolation_level=None,
                check_same_thread=False,
                factory=_Connection,
            )
            try:
                conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout * 1000)}")
                self._open_schema(conn)
                _execute_when_free(conn, "PRAGMA journal_mode = WAL", self.busy_timeout)
                conn.execute("PRAGMA synchronous = NORMAL")
            except sqlite3.Error as e:
                conn.close()
                raise self._wrap(e) from e
            except BaseException:
                conn.close()
                raise
            self._conn = conn
            self._conn_pid = os.getpid()
            key = _file_key(self.path)
            if key is not None:
                with _LIVE_LOCK:
                    _live_count(key, add=1)
                self._finalizer = weakref.finalize(conn, _release, key)
            return conn

    def _open_schema(self, conn: sqlite3.Connection) -> None:
        """Validate (read-only) an existing store, or create / migrate ours."""
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        version = self._validate(conn, tables)
        if version == SCHEMA_VERSION:
            return
        # new (empty) database or an older schema: migrate under a write lock
        _execute_when_free(conn, "BEGIN IMMEDIATE", self.busy_timeout)
        try:
            tables = {
                r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")
            }
            version = self._validate(conn, tables)
            for v, migrate in MIGRATIONS:
                if v > version:
                    migrate(conn)
                    conn.execute(
                        "INSERT INTO schema_version (version, applied_at) VALUES (?, ?)",
                        (v, time.time()),
                    )
            conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    def _validate(self, conn: sqlite3.Connection, tables: set[str]) -> int:
        """Schema version of an existing store (0 for an empty database)."""
        if not tables:
            return 0
        if "comera_meta" not in tables:
            shown = ", ".join(sorted(tables)[:8])
            raise StoreError(
                f"store: {self.path} is a SQLite database but not a CoMERA run store "
                f"(tables: {shown}); refusing to use or overwrite it"
            )
        row = conn.execute("SELECT value FROM comera_meta WHERE key = 'app'").fetchone()
        if row is None or row[0] != MARKER:
            raise StoreError(
                f"store: {self.path} has no CoMERA run-store marker; refusing to use it"
            )
        row = conn.execute("SELECT MAX(version) FROM schema_version").fetchone()
        version = int(row[0] or 0)
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"store: {self.path} has schema version {version}, newer than this "
                f"comera_engine supports ({SCHEMA_VERSION}); upgrade comera_engine"
            )
        return version

    def close(self) -> None:
        """Close this process's connection (it is reopened on next use)."""
        with self._lock:
            conn, self._conn = self._conn, None
            if conn is not None and self._conn_pid == os.getpid():
                conn.close()
                if self._finalizer is not None:
                    self._finalizer()  # the file's connection count, at most once

    def __enter__(self) -> RunStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RunStore({str(self.path)!r})"

    def _retrying(self, fn: Callable[[sqlite3.Connection], T], write: bool) -> T:
        deadline = time.monotonic() + self.busy_timeout
        delay = 0.005
        with self._lock:
            while True:
                conn = self._connection()
                try:
                    if not write:
                        return fn(conn)
                    conn.execute("BEGIN IMMEDIATE")
                    try:
                        result = fn(conn)
                        conn.execute("COMMIT")
                        return result
                    finally:
                        if conn.in_transaction:
                            conn.execute("ROLLBACK")
                except sqlite3.OperationalError as e:
                    if _is_busy(e) and time.monotonic() < deadline:
                        time.sleep(delay)
                        delay = min(delay * 2, 0.1)
                        continue
                    raise self._wrap(e) from e
                except sqlite3.Error as e:
                    raise self._wrap(e) from e

    def write(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``fn(conn)`` in one short write transaction (retried while busy)."""
        return self._retrying(fn, write=True)

    def read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``fn(conn)`` for reading (retried while busy)."""
        return self._retrying(fn, write=False)

    def _rows(self, sql: str, params: Sequence[Any] = ()) -> list[sqlite3.Row]:
        def q(c: sqlite3.Connection) -> list[sqlite3.Row]:
            cur = c.cursor()
            cur.row_factory = sqlite3.Row
            return cur.execute(sql, params).fetchall()

        return self.read(q)

    def check(self) -> list[str]:
        """``PRAGMA quick_check``: ``["ok"]`` for a sound file, else the problems found."""
        return [r[0] for r in self.read(lambda c: c.execute("PRAGMA quick_check").fetchall())]

    # ---- paths -----------------------------------------------------------------------

    def run_dir(self, run_id: str) -> Path:
        """The run folder ``<store dir>/<run_id>/`` (not created here)."""
        if not run_id or "/" in run_id or "\\" in run_id or run_id in (".", ".."):
            raise StoreError(f"run_id: invalid run id {run_id!r}")
        return self.root / run_id

    def log_path(self, run_id: str) -> Path:
        """The trainer's stdout/stderr log, ``<run_dir>/train.log``."""
        return self.run_dir(run_id) / LOG_FILENAME

    # ---- settings --------------------------------------------------------------------

    def get_setting(self, key: str, default: Any = None) -> Any:
        rows = self._rows("SELECT value FROM settings WHERE key = ?", (key,))
        return json.loads(rows[0][0]) if rows else default

    def set_setting(self, key: str, value: Any) -> None:
        self.write(
            lambda c: c.execute(
                "INSERT INTO settings (key, value) VALUES (?, ?) "
                "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                (key, json.dumps(value)),
            )
        )

    # ---- runs ------------------------------------------------------------------------

    def create_run(
        self,
        name: str,
        config: Mapping[str, Any],
        status: str = "queued",
        *,
        device: str | None = None,
        gpus: str | None = None,
        nproc: int = 1,
        cwd: str | None = None,
        run_id: str | None = None,
    ) -> str:
        """Insert a run and return its id (``YYYYmmdd-HHMMSS-xxxx`` unless given)."""
        if status not in STATUSES:
            raise ValueError(f"status: must be one of {', '.join(STATUSES)}, got {status!r}")
        config_json = json.dumps(dict(config), default=str)
        for _ in range(20):
            rid = run_id or new_run_id()
            self.run_dir(rid)  # validates the id
            now = time.time()

            def ins(c: sqlite3.Connection, rid: str = rid, now: float = now) -> bool:
                if c.execute("SELECT 1 FROM runs WHERE id = ?", (rid,)).fetchone():
                    return False
                c.execute(
                    "INSERT INTO runs (id, name, config, status, created_at, updated_at, "
                    "queued_at, started_at, device, gpus, nproc, cwd) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        rid,
                        name,
                        config_json,
                        status,
                        now,
                        now,
                        now if status == "queued" else None,
                        now if status == "running" else None,
                        device,
                        gpus,
                        int(nproc),
                        cwd,
                    ),
                )
                return True

            if self.write(ins):
                return rid
            if run_id is not None:
                raise StoreError(f"run_id: run {run_id!r} already exists")
        raise StoreError("run_id: could not allocate a unique run id")  # pragma: no cover

    def update_run(self, run_id: str, **fields: Any) -> None:
        """Set run columns (``config`` may be a dict). Unknown columns raise ValueError."""
        if not fields:
            return
        bad = sorted(set(fields) - _RUN_COLUMNS)
        if bad:
            raise ValueError(f"{bad[0]}: not a run field")
        if "status" in fields and fields["status"] not in STATUSES:
            raise ValueError(f"status: must be one of {', '.join(STATUSES)}")
        if isinstance(fields.get("config"), Mapping):
            fields["config"] = json.dumps(dict(fields["config"]), default=str)
        fields["updated_at"] = time.time()
        cols = ", ".join(f"{k} = ?" for k in fields)
        self.write(
            lambda c: c.execute(f"UPDATE runs SET {cols} WHERE id = ?", (*fields.values(), run_id))
        )

    def set_status(
        self,
        run_id: str,
        status: str,
        error: str | None = None,
        *,
        only_from: Iterable[str] | None = None,
        where: Mapping[str, Any] | None = None,
        **fields: Any,
    ) -> bool:
        """Set a run's status (and ``error``), optionally only when its current status is in
        ``only_from`` and its columns equal ``where`` (e.g. ``{"attempt": 2}``, so a stale
        process cannot change a newer attempt). Keeps ``started_at`` / ``ended_at`` right.
        Other keyword arguments set run columns too. Returns whether it changed."""
        if status not in STATUSES:
            raise ValueError(f"status: must be one of {', '.join(STATUSES)}, got {status!r}")
        bad = sorted(set(fields) - _RUN_COLUMNS)
        if bad:
            raise ValueError(f"{bad[0]}: not a run field")
        allowed = tuple(only_from) if only_from is not None else None

        def upd(c: sqlite3.Connection) -> bool:
            return _set_status_in(c, run_id, status, error, allowed, fields, where)

        return self.write(upd)

    def heartbeat(self, run_id: str) -> None:
        now = time.time()
        self.write(
            lambda c: c.execute("UPDATE runs SET heartbeat_at = ? WHERE id = ?", (now, run_id))
        )

    def get_run(self, run_id: str) -> dict[str, Any] | None:
        """The run as a dict (``config`` parsed), or ``None``."""
        rows = self._rows("SELECT * FROM runs WHERE id = ?", (run_id,))
        return _run_dict(rows[0]) if rows else None

    def resolve(self, ref: str) -> str:
        """A run id from an id, a unique id prefix or a unique run name."""
        if self.get_run(ref) is not None:
            return ref
        like = ref.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        ids = [r[0] for r in self._rows("SELECT id FROM runs WHERE id LIKE ? ESCAPE '\\'", (like,))]
        if len(ids) == 1:
            return ids[0]
        if len(ids) > 1:
            raise RunNotFoundError(f"run: {ref!r} matches {len(ids)} runs; give more of the id")
        named = self._rows("SELECT id FROM runs WHERE name = ? ORDER BY created_at DESC", (ref,))
        if len(named) == 1:
            return named[0][0]
        if len(named) > 1:
            raise RunNotFoundError(
                f"run: {len(named)} runs are named {ref!r}; use the run id "
                f"(latest: {named[0][0]})"
            )
        raise RunNotFoundError(f"run: no run {ref!r} in {self.path}")

    def list_runs(
        self,
        status: str | Iterable[str] | None = None,
        name_like: str | None = None,
        *,
        since: float | None = None,
        limit: int | None = None,
        newest_first: bool = True,
    ) -> list[dict[str, Any]]:
        """Runs, newest first, filtered by status(es), a name substring (case-insensitive)
        and creation time (epoch seconds)."""
        where: list[str] = []
        params: list[Any] = []
        if status is not None:
            sts = [status] if isinstance(status, str) else list(status)
            where.append(f"status IN ({', '.join('?' * len(sts))})")
            params.extend(sts)
        if name_like:
            where.append("name LIKE ? ESCAPE '\\'")
            esc = name_like.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
            params.append(f"%{esc}%")
        if since is not None:
            where.append("created_at >= ?")
            params.append(float(since))
        sql = "SELECT * FROM runs"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += f" ORDER BY created_at {'DESC' if newest_first else 'ASC'}, id"
        if limit is not None:
            sql += " LIMIT ?"
            params.append(int(limit))
        return [_run_dict(r) for r in self._rows(sql, params)]

    def delete_run(self, run_id: str, remove_files: bool = False) -> None:
        """Delete a run and all its rows (and its folder when ``remove_files``)."""

        def rm(c: sqlite3.Connection) -> None:
            for t in ("metrics", "metric_names", "rank_snapshots", "events", "artifacts"):
                c.execute(f"DELETE FROM {t} WHERE run_id = ?", (run_id,))
            c.execute("DELETE FROM runs WHERE id = ?", (run_id,))

        self.write(rm)
        if remove_files:
            import shutil

            shutil.rmtree(self.run_dir(run_id), ignore_errors=True)

    def claim_queued(self, max_active: int | None = None) -> str | None:
        """Atomically pick the oldest queued, undispatched run while fewer than
        ``max_active`` runs are active (running, stopping or dispatched); mark it
        dispatched and return its id, else ``None``."""

        def claim(c: sqlite3.Connection) -> str | None:
            if max_active:
                (n,) = c.execute(
                    "SELECT COUNT(*) FROM runs WHERE status IN ('running', 'stopping') "
                    "OR (status = 'queued' AND dispatched_at IS NOT NULL)"
                ).fetchone()
                if n >= max_active:
                    return None
            row = c.execute(
                "SELECT id FROM runs WHERE status = 'queued' AND dispatched_at IS NULL "
                "ORDER BY queued_at, created_at LIMIT 1"
            ).fetchone()
            if row is None:
                return None
            now = time.time()
            c.execute(
                "UPDATE runs SET dispatched_at = ?, updated_at = ?, pid = NULL, "
                "pid_started = NULL, supervisor_pid = NULL, heartbeat_at = NULL, "
                "exit_code = NULL, stop_deadline = NULL WHERE id = ?",
                (now, now, row[0]),
            )
            return str(row[0])

        return self.write(claim)

    def reap(self, stale_after: float = HEARTBEAT_TIMEOUT_S) -> list[str]:
        """Mark runs whose process is gone without a final status as ``crashed``.

        A running / stopping / dispatched run is gone when it ran on this host and neither
        its trainer pid nor its supervisor pid is alive, or, for another host or a run
        without pids, when its heartbeat is older than ``stale_after`` seconds. The tail of
        its log is stored as the error. Returns the ids it marked.
        """
        host = socket.gethostname()
        now = time.time()
        rows = self._rows(
            "SELECT * FROM runs WHERE status IN ('running', 'stopping') "
            "OR (status = 'queued' AND dispatched_at IS NOT NULL)"
        )
        marked: list[str] = []
        for r in rows:
            run = _run_dict(r)
            reason = None
            if run["host"] == host and (run["pid"] or run["supervisor_pid"]):
                if not pid_alive(run["pid"], run["pid_started"]) and not pid_alive(
                    run["supervisor_pid"]
                ):
                    reason = "its process is gone"
            else:
                ref = run["heartbeat_at"] or run["dispatched_at"] or run["started_at"]
                if ref is None or now - ref > stale_after:
                    reason = f"no heartbeat for {stale_after:g} s"
            if reason is None:
                continue
            tail = read_log_tail(self.log_path(run["id"]))
            error = f"crashed: {reason} and it reported no final status"
            if tail:
                error += f"; last log lines:\n{tail}"
            if self.set_status(
                run["id"],
                "crashed",
                error,
                only_from=("queued", "running", "stopping"),
                where={"attempt": run["attempt"], "pid": run["pid"]},
            ):
                self.log_event(run["id"], "crash", f"marked crashed: {reason}")
                marked.append(run["id"])
        return marked

    # ---- records ---------------------------------------------------------------------

    def write_batch(
        self,
        run_id: str,
        *,
        metrics: Sequence[tuple[int, str, float | None, float]] = (),
        ranks: Sequence[tuple[int, str, str, float]] = (),
        events: Sequence[tuple[float, int | None, str, str]] = (),
        artifacts: Sequence[tuple[str, str, int | None, float]] = (),
        rewind_from: int | None = None,
        heartbeat: bool = False,
        status: tuple[str, str | None, tuple[str, ...] | None] | None = None,
    ) -> bool:
        """Write buffered records of one run in one transaction.

        ``metrics``: ``(step, name, value, time)``; ``ranks``: ``(step, layer, ranks_json,
        time)``; ``events``: ``(time, step, kind, text)``; ``artifacts``: ``(kind, path,
        size, time)``. ``rewind_from``: first delete metrics and rank snapshots at steps
        ``>= rewind_from`` (rows of an earlier attempt that a resumed run logs again).
        ``status``: ``(status, error, only_from)`` set after the records. Returns whether the
        status changed (``True`` when no status was given).
        """

        def w(c: sqlite3.Connection) -> bool:
            if rewind_from is not None:
                c.execute(
                    "DELETE FROM metrics WHERE run_id = ? AND step >= ?", (run_id, rewind_from)
                )
                c.execute(
                    "DELETE FROM rank_snapshots WHERE run_id = ? AND step >= ?",
                    (run_id, rewind_from),
                )
            if metrics:
                # one value per (run, name, step): a value logged again replaces the old one
                c.executemany(
                    "INSERT OR REPLACE INTO metrics (run_id, step, name, value, time) "
                    "VALUES (?, ?, ?, ?, ?)",
                    [(run_id, *m) for m in metrics],
                )
                c.executemany(
                    "INSERT OR IGNORE INTO metric_names (run_id, name) VALUES (?, ?)",
                    [(run_id, n) for n in {m[1] for m in metrics}],
                )
            if rewind_from is not None:
                c.execute(
                    "DELETE FROM metric_names WHERE run_id = ? AND NOT EXISTS (SELECT 1 "
                    "FROM metrics m WHERE m.run_id = metric_names.run_id "
                    "AND m.name = metric_names.name)",
                    (run_id,),
                )
            if ranks:
                c.executemany(
                    "INSERT INTO rank_snapshots (run_id, step, layer, ranks, time) "
                    "VALUES (?, ?, ?, ?, ?)",
                    [(run_id, *r) for r in ranks],
                )
            if events:
                c.executemany(
                    "INSERT INTO events (run_id, time, step, kind, text) VALUES (?, ?, ?, ?, ?)",
                    [(run_id, *e) for e in events],
                )
            if artifacts:
                c.executemany(
                    "INSERT INTO artifacts (run_id, kind, path, size, time) VALUES (?, ?, ?, ?, ?)",
                    [(run_id, *a) for a in artifacts],
                )
            sets = []
            params: list[Any] = []
            if heartbeat:
                sets.append("heartbeat_at = ?")
                params.append(time.time())
            if metrics:
                sets.append("last_step = ?")
                params.append(max(m[0] for m in metrics))
            if sets:
                c.execute(f"UPDATE runs SET {', '.join(sets)} WHERE id = ?", (*params, run_id))
            if status is not None:
                st, err, only = status
                return _set_status_in(c, run_id, st, err, only, {})
            return True

        return self.write(w)

    def log_metrics(self, run_id: str, step: int, metrics: Mapping[str, float]) -> None:
        """Unbuffered single write (use :class:`StoreSink` from a training loop)."""
        t = time.time()
        rows = [(int(step), str(k), _metric_value(k, v), t) for k, v in metrics.items()]
        self.write_batch(run_id, metrics=rows)

    def log_ranks(self, run_id: str, step: int, ranks: Mapping[str, Sequence[int]]) -> None:
        t = time.time()
        rows = [(int(step), str(k), json.dumps([int(x) for x in v]), t) for k, v in ranks.items()]
        self.write_batch(run_id, ranks=rows)

    def log_event(self, run_id: str, kind: str, text: str, step: int | None = None) -> None:
        self.write_batch(run_id, events=[(time.time(), step, str(kind), str(text))])

    def log_artifact(self, run_id: str, kind: str, path: str | os.PathLike[str]) -> None:
        self.write_batch(run_id, artifacts=[_artifact_row(kind, path)])

    # ---- queries ---------------------------------------------------------------------

    def metrics_since(
        self,
        run_id: str,
        step: int = -1,
        names: Iterable[str] | None = None,
        limit: int | None = None,
    ) -> list[dict[str, Any]]:
        """Metric rows with ``step > step`` (incremental polling), ordered by step then
        name: ``{"step", "name", "value", "time"}`` (``value`` NaN for a NaN/None)."""
        ns = list(names) if names is not None else self.metric_names(run_id)
        if not ns:
            return []
        # one index range per name (the table is clustered by run, name, step)
        sql = (
            "SELECT step, name, value, time FROM metrics WHERE run_id = ? "
            f"AND name IN ({', '.join('?' * len(ns))}) AND step > ? ORDER BY step, name"
        )
        params: list[Any] = [run_id, *ns, int(step)]
        if limit is not None:
            sql += " LIMIT ?"
            params.append(int(limit))
        return [
            {"step": r[0], "name": r[1], "value": _nan(r[2]), "time": r[3]}
            for r in self.read(lambda c: c.execute(sql, params).fetchall())
        ]

    def count_metrics(self, run_id: str, name: str | None = None) -> int:
        if name is None:
            rows = self._rows("SELECT COUNT(*) FROM metrics WHERE run_id = ?", (run_id,))
        else:
            rows = self._rows(
                "SELECT COUNT(*) FROM metrics WHERE run_id = ? AND name = ?", (run_id, name)
            )
        return int(rows[0][0])

    def metric_names(self, run_id: str) -> list[str]:
        """Names of the metrics a run has logged, sorted."""
        return [
            r[0]
            for r in self._rows(
                "SELECT name FROM metric_names WHERE run_id = ? ORDER BY name", (run_id,)
            )
        ]

    def latest_metrics(self, run_id: str) -> dict[str, tuple[int, float]]:
        """``{name: (step, value)}`` at each metric's latest step."""

        def q(c: sqlite3.Connection) -> dict[str, tuple[int, float]]:
            out = {}
            names = c.execute(
                "SELECT name FROM metric_names WHERE run_id = ? ORDER BY name", (run_id,)
            ).fetchall()
            for (name,) in names:
                row = c.execute(
                    "SELECT step, value FROM metrics WHERE run_id = ? AND name = ? "
                    "ORDER BY step DESC LIMIT 1",
                    (run_id, name),
                ).fetchone()
                if row is not None:
                    out[name] = (int(row[0]), _nan(row[1]))
            return out

        return self.read(q)

    def series(self, run_id: str, name: str, max_points: int = 2000) -> dict[str, Any]:
        """One metric curve, at most ``max_points`` points.

        Long curves are split into ``(max_points - 2) // 2`` equal step ranges and keep each
        range's minimum and maximum (so spikes survive), plus the first and the last point.
        Returns ``{"step": [...], "value": [...], "total": n, "downsampled": bool}``.
        """
        if max_points < 4:
            raise ValueError(f"max_points: must be at least 4, got {max_points}")

        def q(c: sqlite3.Connection) -> dict[str, Any]:
            n, s0, s1 = c.execute(
                "SELECT COUNT(*), MIN(step), MAX(step) FROM metrics WHERE run_id = ? AND name = ?",
                (run_id, name),
            ).fetchone()
            if n <= max_points:
                rows = c.execute(
                    "SELECT step, value FROM metrics WHERE run_id = ? AND name = ? ORDER BY step",
                    (run_id, name),
                ).fetchall()
                return {
                    "step": [r[0] for r in rows],
                    "value": [_nan(r[1]) for r in rows],
                    "total": n,
                    "downsampled": False,
                }
            nb = (max_points - 2) // 2
            span = s1 - s0 + 1
            bucket = "((step - :s0) * :nb) / :span"
            p = {"run": run_id, "name": name, "s0": s0, "nb": nb, "span": span}
            pts: dict[int, float | None] = {}
            for agg in ("MIN", "MAX"):
                # SQLite returns the other columns from the row holding the MIN/MAX
                for step, value in c.execute(
                    f"SELECT step, {agg}(value) FROM metrics WHERE run_id = :run "
                    f"AND name = :name GROUP BY {bucket}",
                    p,
                ):
                    pts[step] = value
            for order in ("ASC", "DESC"):
                row = c.execute(
                    "SELECT step, value FROM metrics WHERE run_id = ? AND name = ? "
                    f"ORDER BY step {order} LIMIT 1",
                    (run_id, name),
                ).fetchone()
                pts[row[0]] = row[1]
            steps = sorted(pts)
            return {
                "step": steps,
                "value": [_nan(pts[s]) for s in steps],
                "total": n,
                "downsampled": True,
            }

        return self.read(q)

    def latest_ranks(self, run_id: str) -> dict[str, list[int]]:
        """``{layer: bond ranks}`` at each layer's latest snapshot."""
        rows = self._rows(
            "SELECT layer, MAX(step), ranks FROM rank_snapshots WHERE run_id = ? "
            "GROUP BY layer ORDER BY layer",
            (run_id,),
        )
        return {r[0]: json.loads(r[2]) for r in rows}

    def rank_history(self, run_id: str, layer: str | None = None) -> list[dict[str, Any]]:
        """Rank snapshots ``{"step", "layer", "ranks", "time"}`` ordered by step."""
        sql = "SELECT step, layer, ranks, time FROM rank_snapshots WHERE run_id = ?"
        params: list[Any] = [run_id]
        if layer is not None:
            sql += " AND layer = ?"
            params.append(layer)
        sql += " ORDER BY step, layer, id"
        return [
            {"step": r[0], "layer": r[1], "ranks": json.loads(r[2]), "time": r[3]}
            for r in self._rows(sql, params)
        ]

    def events(
        self, run_id: str, since_id: int = 0, kinds: Iterable[str] | None = None
    ) -> list[dict[str, Any]]:
        """Events with ``id > since_id``: ``{"id", "time", "step", "kind", "text"}``."""
        sql = "SELECT id, time, step, kind, text FROM events WHERE run_id = ? AND id > ?"
        params: list[Any] = [run_id, int(since_id)]
        if kinds is not None:
            ks = list(kinds)
            sql += f" AND kind IN ({', '.join('?' * len(ks))})"
            params.extend(ks)
        sql += " ORDER BY id"
        return [dict(r) for r in self._rows(sql, params)]

    def artifacts(self, run_id: str, kind: str | None = None) -> list[dict[str, Any]]:
        """Artifacts ``{"id", "kind", "path", "size", "time", "exists"}`` in logging order."""
        sql = "SELECT id, kind, path, size, time FROM artifacts WHERE run_id = ?"
        params: list[Any] = [run_id]
        if kind is not None:
            sql += " AND kind = ?"
            params.append(kind)
        sql += " ORDER BY id"
        out = []
        for r in self._rows(sql, params):
            d = dict(r)
            d["exists"] = os.path.exists(d["path"])
            out.append(d)
        return out

    def counts(self, run_id: str) -> dict[str, int]:
        """Row counts per table for one run."""

        def q(c: sqlite3.Connection) -> dict[str, int]:
            out = {}
            for t in ("metrics", "rank_snapshots", "events", "artifacts"):
                sql = f"SELECT COUNT(*) FROM {t} WHERE run_id = ?"
                out[t] = int(c.execute(sql, (run_id,)).fetchone()[0])
            return out

        return self.read(q)


# --------------------------------------------------------------------------------------


def _set_status_in(
    c: sqlite3.Connection,
    run_id: str,
    status: str,
    error: str | None,
    only_from: tuple[str, ...] | None,
    fields: Mapping[str, Any],
    where: Mapping[str, Any] | None = None,
) -> bool:
    cur = c.cursor()
    cur.row_factory = sqlite3.Row
    row = cur.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
    if row is None:
        raise RunNotFoundError(f"run: no run {run_id!r}")
    current, started = row["status"], row["started_at"]
    if only_from is not None and current not in only_from:
        return False
    if where and any(row[k] != v for k, v in where.items()):
        return False
    now = time.time()
    sets: dict[str, Any] = {"status": status, "updated_at": now}
    if status in FINAL_STATUSES:
        sets["ended_at"] = now
        sets["error"] = error
    elif status == "queued" or error is not None:
        sets["error"] = error
    if status == "running" and started is None:
        sets["started_at"] = now
    sets.update(fields)
    cols = ", ".join(f"{k} = ?" for k in sets)
    c.execute(f"UPDATE runs SET {cols} WHERE id = ?", (*sets.values(), run_id))
    return True


def _run_dict(row: sqlite3.Row) -> dict[str, Any]:
    d = dict(row)
    try:
        d["config"] = json.loads(d["config"])
    except (TypeError, ValueError):
        pass
    d["resume_pending"] = bool(d.get("resume_pending"))
    return d


def _metric_value(name: str, v: Any) -> float:
    """``float(v)`` (SQLite stores NaN as NULL; queries turn it back into NaN)."""
    try:
        return float(v)
    except (TypeError, ValueError):
        raise ValueError(f"metrics[{name!r}]: not a number: {v!r}") from None


def _artifact_row(kind: str, path: str | os.PathLike[str]) -> tuple[str, str, int | None, float]:
    p = os.path.abspath(os.fspath(path))
    try:
        size: int | None = os.path.getsize(p)
        if os.path.isdir(p):
            size = sum(
                os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(p) for f in fs
            )
    except OSError:
        size = None
    return (str(kind), p, size, time.time())


def this_host() -> str:
    return socket.gethostname()
