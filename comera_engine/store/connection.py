"""One SQLite connection per process to the store file: WAL mode, busy retries, short
``BEGIN IMMEDIATE`` write transactions, and a count of this process's open connections
per file.

WAL lets one writer work while any number of readers never block it. Every connection
sets a busy timeout, and :meth:`Database.write` / :meth:`Database.read` retry on
``SQLITE_BUSY`` with a growing back-off until ``busy_timeout`` seconds have passed.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from comera_engine.store import schema
from comera_engine.store.errors import StoreError, StoreLocked
from comera_engine.store.layout import resolve_store_path

T = TypeVar("T")
_D = TypeVar("_D", bound="Database")


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


class Database:
    """The store file behind one lazily opened connection.

    Safe to share between threads of one process (one connection behind a lock); after a
    fork the child opens its own. ``create=False`` raises :class:`StoreError` when the
    file does not exist instead of creating it. A foreign, corrupt or newer file raises
    :class:`StoreError` here, before anything is written.
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
        #: An existing store in a folder this process cannot write (a read-only home) is
        #: opened read-only: reads work, a write raises StoreError naming the folder.
        self.readonly = self.path.exists() and not (
            os.access(self.root, os.W_OK | os.X_OK) and os.access(self.path, os.W_OK))
        self._lock = threading.RLock()
        self._conn: sqlite3.Connection | None = None
        self._conn_pid = -1
        self._conn_key: tuple[int, int] | None = None  # the file the connection opened
        self._finalizer: weakref.finalize | None = None
        if not self.path.exists():
            if not create:
                raise StoreError(f"store: no run store at {self.path}")
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                if not os.access(self.path.parent, os.W_OK | os.X_OK):
                    raise PermissionError("not writable")
            except OSError as e:
                reason = e.strerror or str(e)
                raise StoreError(
                    f"store: cannot keep runs in {self.path.parent} ({reason}); set "
                    "COMERA_HOME (or --store) to a writable folder") from None
        with _LIVE_LOCK:
            if not _live_count(_file_key(self.path)):
                schema.check_header(self.path)
        self._connection()  # validate schema now, not at first query

    def _wrap(self, e: sqlite3.Error) -> StoreError:
        msg = str(e).lower()
        if "readonly" in msg or "read-only" in msg:
            return self.read_only_error()
        if "malformed" in msg or "not a database" in msg or "corrupt" in msg:
            return StoreError(
                f"store: {self.path} is corrupt or unreadable ({e}); it was left untouched — "
                "`comera repair` rebuilds it from the run folders (the damaged file is kept)"
            )
        if _is_busy(e):
            return StoreLocked(
                f"store: {self.path} stayed locked for {self.busy_timeout:g} s ({e})"
            )
        return StoreError(f"store: {self.path}: {e}")

    def _connection(self) -> sqlite3.Connection:
        """This process's connection, opened anew after a fork, and when the path names
        another file than the one it was opened on (``comera repair`` moved a damaged
        store aside and rebuilt it: a long-lived process such as the dashboard follows)."""
        with self._lock:
            if self._conn is not None and self._conn_pid == os.getpid():
                now = _file_key(self.path)
                if now is None or now == self._conn_key:
                    return self._conn
                self.close()
            self._conn = None  # after a fork, never reuse the parent's connection
            conn = self._connect()
            try:
                conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout * 1000)}")
                self._open_schema(conn)
                if not self.readonly:
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
            key = self._conn_key = _file_key(self.path)
            if key is not None:
                with _LIVE_LOCK:
                    _live_count(key, add=1)
                self._finalizer = weakref.finalize(conn, _release, key)
            return conn

    def _connect(self) -> sqlite3.Connection:
        """A new connection; read-only (``mode=ro``, else ``immutable=1`` where SQLite
        cannot make the WAL index beside a read-only file) for a read-only store."""
        kwargs: dict[str, Any] = {"timeout": self.busy_timeout, "isolation_level": None,
                                  "check_same_thread": False, "factory": _Connection}
        if not self.readonly:
            return sqlite3.connect(str(self.path), **kwargs)
        from urllib.parse import quote

        uri = "file:" + quote(str(self.path))
        try:
            conn = sqlite3.connect(uri + "?mode=ro", uri=True, **kwargs)
            conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
            return conn
        except sqlite3.OperationalError:
            return sqlite3.connect(uri + "?immutable=1", uri=True, **kwargs)

    def read_only_error(self) -> StoreError:
        """The one-line error of a write to a read-only store (names the folder and the
        fix)."""
        return StoreError(f"store: {self.root} is read-only; make it writable (chmod u+w "
                          f"{self.root}, or remount it) or set COMERA_HOME to a writable "
                          "folder")

    def _open_schema(self, conn: sqlite3.Connection) -> None:
        """Validate (read-only) an existing store, or create / migrate ours under a write
        lock."""
        if schema.read_version(conn, self.path) == schema.SCHEMA_VERSION:
            return
        if self.readonly:  # an older store cannot be migrated here
            raise self.read_only_error()
        _execute_when_free(conn, "BEGIN IMMEDIATE", self.busy_timeout)
        try:
            schema.upgrade(conn, self.path)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    def close(self) -> None:
        """Close this process's connection (it is reopened on next use)."""
        with self._lock:
            conn, self._conn = self._conn, None
            if conn is not None and self._conn_pid == os.getpid():
                conn.close()
                if self._finalizer is not None:
                    self._finalizer()  # the file's connection count, at most once

    def __enter__(self: _D) -> _D:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r})"

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
        """Run ``fn(conn)`` in one short write transaction (retried while busy); a
        read-only store raises StoreError naming its folder and the fix."""
        if self.readonly:
            raise self.read_only_error()
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
