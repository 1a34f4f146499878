"""The run store's schema: its tables, the migrations, and how a file is recognised.

A store carries three marks: ``application_id`` ``0x434D5241`` ("CMRA") in the SQLite
header, a ``comera_meta`` row ``app = comera-run-store`` and the applied versions in
``schema_version``. A file without them is never written to. Migration ``v`` takes a
store at version ``v - 1`` to ``v`` and runs inside the caller's write transaction.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

from comera_engine.store.errors import StoreError
from comera_engine.store.layout import run_folders

SCHEMA_VERSION = 3
APPLICATION_ID = 0x434D5241  # "CMRA" in the SQLite header (offset 68)
MARKER = "comera-run-store"
SQLITE_MAGIC = b"SQLite format 3\x00"


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


def _migrate_to_2(c: sqlite3.Connection) -> None:
    """Foreground runs, run phases and sweeps.

    ``runs.folder``: the run folder when it is not ``<store dir>/<id>/`` (a foreground
    ``comera train --run-dir DIR``); ``runs.phase`` / ``phase_progress`` (0..1 or NULL):
    what the run is doing now (preparing data, training, ...); ``runs.sweep_id`` and
    ``runs.cell`` (JSON: the cell's overrides and seed) tie a run to its sweep. A sweep is
    its base config, its grid, the seeds and how many cells run at once."""
    _execute_script(
        c,
        """
        ALTER TABLE runs ADD COLUMN folder TEXT;
        ALTER TABLE runs ADD COLUMN phase TEXT;
        ALTER TABLE runs ADD COLUMN phase_progress REAL;
        ALTER TABLE runs ADD COLUMN sweep_id TEXT;
        ALTER TABLE runs ADD COLUMN cell TEXT;
        CREATE INDEX runs_sweep ON runs (sweep_id);
        CREATE TABLE sweeps (
            id TEXT PRIMARY KEY,
            name TEXT NOT NULL,
            config TEXT NOT NULL,
            grid TEXT NOT NULL,
            seeds INTEGER NOT NULL,
            max_parallel INTEGER,
            backend TEXT NOT NULL DEFAULT 'local',
            address TEXT,
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL
        );
        """,
    )


def _migrate_to_3(c: sqlite3.Connection) -> None:
    """What a user says of a run: ``runs.notes`` (free text), ``runs.tags`` (a JSON list
    of words) and ``runs.archived_at`` (set: hidden from the run lists until restored;
    nothing is deleted)."""
    _execute_script(
        c,
        """
        ALTER TABLE runs ADD COLUMN notes TEXT;
        ALTER TABLE runs ADD COLUMN tags TEXT;
        ALTER TABLE runs ADD COLUMN archived_at REAL;
        """,
    )


#: ``(version, migration)`` in order; migration ``v`` takes a store at ``v - 1`` to ``v``.
MIGRATIONS: list[tuple[int, Callable[[sqlite3.Connection], None]]] = [
    (1, _migrate_to_1),
    (2, _migrate_to_2),
    (3, _migrate_to_3),
]


def check_header(path: Path) -> None:
    """Refuse (StoreError) a file that is not a SQLite database or belongs to another
    application, from its first 100 bytes. A missing file passes, and so does an empty
    one, unless run folders lie beside it (then it was emptied: a damaged store).

    Reads the file with Python: call it only while this process has no SQLite connection
    to ``path`` (closing any descriptor of a file drops all of the process's locks on it;
    see :mod:`comera_engine.store.connection`)."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return
    if size == 0:
        if run_folders(path.parent):  # runs were recorded here: the file was emptied
            raise StoreError(
                f"store: {path} is empty (0 bytes) while {path.parent} holds run folders: "
                "it is corrupt; `comera repair` rebuilds it from the run folders (the "
                "damaged file is kept)")
        return
    with open(path, "rb") as f:
        head = f.read(100)
    if len(head) < 100 or not head.startswith(SQLITE_MAGIC):
        raise StoreError(
            f"store: {path} is not a SQLite database (a foreign or corrupt file); "
            "refusing to open or overwrite it — if it was this run store, `comera repair` "
            "moves it aside and rebuilds it from the run folders"
        )
    app_id = int.from_bytes(head[68:72], "big")
    if app_id not in (0, APPLICATION_ID):
        raise StoreError(
            f"store: {path} is a SQLite database of another application "
            f"(application_id {app_id:#x}), not a CoMERA run store; refusing to use it"
        )


def _tables(conn: sqlite3.Connection) -> set[str]:
    return {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}


def read_version(conn: sqlite3.Connection, path: Path) -> int:
    """Schema version of the store behind ``conn`` (0 for an empty database), read only.
    A database that is not a CoMERA store, or is newer than :data:`SCHEMA_VERSION`,
    raises StoreError naming ``path``."""
    tables = _tables(conn)
    if not tables:
        return 0
    if "comera_meta" not in tables:
        shown = ", ".join(sorted(tables)[:8])
        raise StoreError(
            f"store: {path} is a SQLite database but not a CoMERA run store "
            f"(tables: {shown}); refusing to use or overwrite it"
        )
    row = conn.execute("SELECT value FROM comera_meta WHERE key = 'app'").fetchone()
    if row is None or row[0] != MARKER:
        raise StoreError(f"store: {path} has no CoMERA run-store marker; refusing to use it")
    row = conn.execute("SELECT MAX(version) FROM schema_version").fetchone()
    version = int(row[0] or 0)
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"store: {path} has schema version {version}, newer than this "
            f"comera_engine supports ({SCHEMA_VERSION}); upgrade comera_engine"
        )
    return version


def upgrade(conn: sqlite3.Connection, path: Path) -> None:
    """Create or migrate the store to :data:`SCHEMA_VERSION`, inside the caller's write
    transaction (``BEGIN IMMEDIATE``: the version is read again under that lock, so of
    several processes opening a new store together exactly one creates it)."""
    version = read_version(conn, path)
    for v, migrate in MIGRATIONS:
        if v > version:
            migrate(conn)
            conn.execute(
                "INSERT INTO schema_version (version, applied_at) VALUES (?, ?)",
                (v, time.time()),
            )
    conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
