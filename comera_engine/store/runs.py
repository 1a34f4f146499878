"""Run rows: create, status transitions, the queue, and queries over runs.

Lifecycle: ``queued → running → (stopping →) finished | stopped | failed | diverged |
crashed``. Each status change is one conditional update (``only_from`` the statuses it may
leave, ``where`` columns such as the attempt still equal), so a stale process cannot move
a run that has gone on; which change is allowed from where is
:data:`comera_engine.store.lifecycle.TRANSITIONS`, and every status change of the project
goes through :class:`~comera_engine.store.lifecycle.RunLifecycle`
(:meth:`RunRows.set_status` is the unchecked primitive under it, for tests and repair).
The run folder of run ``id`` is ``<store dir>/<id>/``.
Whether a run's process is alive is the launcher's business
(:mod:`comera_engine.launch.liveness`); the store records what it decides.

Phase: beside its status a run records what its trainer is doing (``phase``, one of
:data:`PHASES`) and how far along (``phase_progress``, 0..1 or NULL): written by the
trainer's :class:`~comera_engine.store.StoreSink` (a change at once, progress with its
batched flush, both checked against the owner token); see :mod:`comera_engine.launch`.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sqlite3
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from comera_engine.store.connection import Database
from comera_engine.store.errors import NotOwnerError, RunNotFoundError, StoreError
from comera_engine.store.layout import LOG_FILENAME, one_line_error, run_folder

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
#: Statuses a run can be resumed from (a ``failed`` run too: its owner is gone, and the
#: resume starts from its newest checkpoint that reads back whole).
RESUMABLE_STATUSES = frozenset({"stopped", "crashed", "failed"})
#: The run columns that name the process owning a run (its one writer).
OWNER_COLUMNS = ("pid", "pid_started", "host")

#: A run on another host (or without a pid) is crashed when its heartbeat is older (the
#: sink beats every 0.5 s, the supervisor every 2 s: a dead run is marked within 10 s).
HEARTBEAT_TIMEOUT_S = 8.0

#: Runs that have, or are about to have, a process: running, stopping, or dispatched.
_ACTIVE_WHERE = (
    "status IN ('running', 'stopping') OR (status = 'queued' AND dispatched_at IS NOT NULL)"
)

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
        "folder",
        "phase",
        "phase_progress",
        "sweep_id",
        "cell",
        "notes",
        "tags",
        "archived_at",
    }
)
#: Bounds on what a user says of a run.
MAX_NOTES, MAX_TAGS, MAX_TAG = 20_000, 32, 40
#: What a run can be doing (``runs.phase``), in the order a run goes through them.
PHASES = ("preparing data", "training tokenizer", "building", "training", "evaluating",
          "checkpointing", "exporting", "done")


_ISSUED: dict[str, set[str]] = {}  # the current second -> the tails this process drew


def new_run_id() -> str:
    """Sortable id ``YYYYmmdd-HHMMSS-xxxx``, never repeated by one process (16 random bits
    collide within a second one time in ~300 for 20 ids); callers still check the store
    or the folder for another process's id."""
    second = time.strftime("%Y%m%d-%H%M%S")
    if second not in _ISSUED:  # a new second: the earlier ones cannot recur
        _ISSUED.clear()
    issued = _ISSUED.setdefault(second, set())
    while (tail := secrets.token_hex(2)) in issued:
        pass
    issued.add(tail)
    return f"{second}-{tail}"


def _check_status(status: str) -> None:
    if status not in STATUSES:
        raise ValueError(f"status: must be one of {', '.join(STATUSES)}, got {status!r}")


def check_columns(fields: Iterable[str]) -> None:
    """ValueError naming the first of ``fields`` that is not a run column."""
    bad = sorted(set(fields) - _RUN_COLUMNS)
    if bad:
        raise ValueError(f"{bad[0]}: not a run field")


def _escape_like(text: str) -> str:
    """``text`` with LIKE's wildcards escaped (for ``ESCAPE '\\'``)."""
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def owner_token(run: Mapping[str, Any]) -> dict[str, Any]:
    """The owner columns (:data:`OWNER_COLUMNS`) of a run row."""
    return {k: run[k] for k in OWNER_COLUMNS}


def same_owner(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two owner tokens name the same process: same pid and host, start times
    within 1 s (or either unknown)."""
    if a["pid"] != b["pid"] or a["host"] != b["host"]:
        return False
    ta, tb = a.get("pid_started"), b.get("pid_started")
    return ta is None or tb is None or abs(float(ta) - float(tb)) <= 1.0


def check_owner_in(c: sqlite3.Connection, run_id: str, owner: Mapping[str, Any]) -> None:
    """Raise :class:`NotOwnerError` unless ``owner`` still owns the run (inside the
    caller's transaction, so the check and the write it guards are one)."""
    row = c.execute(
        f"SELECT {', '.join(OWNER_COLUMNS)} FROM runs WHERE id = ?", (run_id,)
    ).fetchone()
    if row is None:
        raise RunNotFoundError(f"run: no run {run_id!r}")
    if not same_owner(dict(zip(OWNER_COLUMNS, row)), owner):
        raise NotOwnerError(
            f"run: {run_id} is now owned by pid {row[0]} on {row[2]}, not pid {owner['pid']}"
        )


def set_status_in(
    c: sqlite3.Connection,
    run_id: str,
    status: str,
    error: str | None,
    only_from: tuple[str, ...] | None,
    fields: Mapping[str, Any],
    where: Mapping[str, Any] | None = None,
) -> bool:
    """Set a run's status inside the caller's transaction; see :meth:`RunRows.set_status`.

    A final status sets ``ended_at`` and ``error``; ``queued`` (or any given error) sets
    ``error``; the first ``running`` sets ``started_at``. Returns whether it changed."""
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
    if error is not None:  # a run's error is one line (a traceback stays in its log)
        error = one_line_error(error)
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


def check_phase(phase: str | None, progress: float | None = None
                ) -> tuple[str | None, float | None]:
    """``(phase, progress)`` validated: ``phase`` one of :data:`PHASES` (or ``None``),
    ``progress`` clamped to 0..1 (or ``None`` when unknown). A bad phase raises
    ValueError."""
    if phase is not None and phase not in PHASES:
        raise ValueError(f"phase: must be one of {', '.join(PHASES)}, got {phase!r}")
    if progress is not None:
        progress = min(1.0, max(0.0, float(progress)))
    return phase, progress


def set_phase_in(c: sqlite3.Connection, run_id: str, phase: str | None,
                 progress: float | None = None) -> None:
    """Set a run's phase and its progress inside the caller's transaction (see
    :meth:`RunRows.set_phase`)."""
    phase, progress = check_phase(phase, progress)
    c.execute(
        "UPDATE runs SET phase = ?, phase_progress = ?, updated_at = ? WHERE id = ?",
        (phase, progress, time.time(), run_id),
    )


def _run_dict(row: sqlite3.Row) -> dict[str, Any]:
    d = dict(row)
    try:
        d["config"] = json.loads(d["config"])
    except (TypeError, ValueError):
        pass
    d["resume_pending"] = bool(d.get("resume_pending"))
    try:
        tags = json.loads(d.get("tags") or "[]")
    except (TypeError, ValueError):
        tags = []
    d["tags"] = [str(t) for t in tags] if isinstance(tags, list) else []
    if d.get("cell"):
        try:
            d["cell"] = json.loads(d["cell"])
        except (TypeError, ValueError):
            pass
    return d


class RunRows(Database):
    """The ``runs`` table and the run folders (a part of :class:`~comera_engine.store.RunStore`)."""

    # ---- paths -----------------------------------------------------------------------

    def run_dir(self, run_id: str) -> Path:
        """The run folder (not created here): ``<store dir>/<run_id>/``, or the folder a
        foreground run recorded (``comera train --run-dir DIR``)."""
        path = run_folder(self.root, run_id)  # validates the id
        rows = self._rows("SELECT folder FROM runs WHERE id = ?", (run_id,))
        if rows and rows[0][0]:
            return Path(rows[0][0])
        return path

    def log_path(self, run_id: str) -> Path:
        """The trainer's stdout/stderr log, ``<run_dir>/train.log``."""
        return self.run_dir(run_id) / LOG_FILENAME

    # ---- writes ----------------------------------------------------------------------

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
        folder: str | os.PathLike[str] | None = None,
        sweep_id: str | None = None,
        cell: Mapping[str, Any] | None = None,
    ) -> str:
        """Insert a run and return its id (``YYYYmmdd-HHMMSS-xxxx`` unless given).
        ``folder``: its run folder when not ``<store dir>/<id>/`` (stored absolute);
        ``sweep_id`` / ``cell``: the sweep it is a cell of, and that cell's settings."""
        _check_status(status)
        config_json = json.dumps(dict(config), default=str)
        folder_text = str(Path(folder).absolute()) if folder is not None else None
        cell_json = json.dumps(dict(cell), default=str) if cell is not None else None
        for _ in range(20):
            rid = run_id or new_run_id()
            self.run_dir(rid)  # validates the id
            now = time.time()

            def ins(c: sqlite3.Connection, rid: str = rid, now: float = now) -> bool:
                if c.execute("SELECT 1 FROM runs WHERE id = ?", (rid,)).fetchone():
                    return False
                c.execute(
                    "INSERT INTO runs (id, name, config, status, created_at, updated_at, "
                    "queued_at, started_at, device, gpus, nproc, cwd, folder, sweep_id, "
                    "cell) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
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
                        folder_text,
                        sweep_id,
                        cell_json,
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
        check_columns(fields)
        if "status" in fields and fields["status"] not in STATUSES:
            raise ValueError(f"status: must be one of {', '.join(STATUSES)}")
        for key in ("config", "cell"):
            if isinstance(fields.get(key), Mapping):
                fields[key] = json.dumps(dict(fields[key]), default=str)
        if fields.get("error") is not None:  # one line, as set_status_in keeps it
            fields["error"] = one_line_error(fields["error"])
        fields["updated_at"] = time.time()
        cols = ", ".join(f"{k} = ?" for k in fields)
        self.write(
            lambda c: c.execute(f"UPDATE runs SET {cols} WHERE id = ?", (*fields.values(), run_id))
        )

    def set_notes(self, run_id: str, notes: str) -> None:
        """A run's notes (free text, at most :data:`MAX_NOTES` characters)."""
        if not isinstance(notes, str) or len(notes) > MAX_NOTES:
            raise ValueError(f"notes: at most {MAX_NOTES:,} characters of text")
        self.update_run(run_id, notes=notes)

    def set_tags(self, run_id: str, tags: Iterable[str]) -> list[str]:
        """A run's tags: words without commas, each at most :data:`MAX_TAG` characters,
        at most :data:`MAX_TAGS`, kept once in the order given; returns them."""
        out: list[str] = []
        for tag in tags:
            tag = str(tag).strip()
            if not tag:
                continue
            if len(tag) > MAX_TAG or "," in tag or any(ord(ch) < 32 for ch in tag):
                raise ValueError(f"tags: {tag[:MAX_TAG]!r} must be at most {MAX_TAG} "
                                 "characters, without commas or control characters")
            if tag not in out:
                out.append(tag)
        if len(out) > MAX_TAGS:
            raise ValueError(f"tags: at most {MAX_TAGS}, got {len(out)}")
        self.update_run(run_id, tags=json.dumps(out))
        return out

    def archive_run(self, run_id: str, archived: bool = True) -> None:
        """Hide a run from the run lists (``archived=False``: restore it). Nothing is
        deleted: its record, metrics and folder stay."""
        self.update_run(run_id, archived_at=time.time() if archived else None)

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
        _check_status(status)
        check_columns(fields)
        allowed = tuple(only_from) if only_from is not None else None

        def upd(c: sqlite3.Connection) -> bool:
            return set_status_in(c, run_id, status, error, allowed, fields, where)

        return self.write(upd)

    def set_phase(self, run_id: str, phase: str | None, progress: float | None = None) -> None:
        """Record what the run is doing now (one of :data:`PHASES`, or ``None``) and how
        far along that phase is (0..1, or ``None`` when unknown). Unguarded: a trainer
        writes its phase through its :class:`~comera_engine.store.StoreSink`, which checks
        that it still owns the run."""
        phase, progress = check_phase(phase, progress)
        self.write(lambda c: set_phase_in(c, run_id, phase, progress))

    def heartbeat(self, run_id: str) -> None:
        now = time.time()
        self.write(
            lambda c: c.execute("UPDATE runs SET heartbeat_at = ? WHERE id = ?", (now, run_id))
        )

    def delete_run(self, run_id: str, remove_files: bool = False) -> None:
        """Delete a run and all its rows (and its folder when ``remove_files``)."""

        def rm(c: sqlite3.Connection) -> None:
            for t in ("metrics", "metric_names", "rank_snapshots", "events", "artifacts"):
                c.execute(f"DELETE FROM {t} WHERE run_id = ?", (run_id,))
            c.execute("DELETE FROM runs WHERE id = ?", (run_id,))

        folder = self.run_dir(run_id)
        self.write(rm)
        if remove_files:
            shutil.rmtree(folder, ignore_errors=True)

    def claim_queued(self, max_active: int | None = None, *, sweep_id: str | None = None,
                     owner: Mapping[str, Any] | None = None) -> str | None:
        """The queue: atomically pick the oldest queued, undispatched run while fewer
        than ``max_active`` runs are active (running, stopping or dispatched); mark it
        dispatched and return its id, else ``None``.

        Without ``sweep_id`` (the local launcher's queue): any run of the store, counted
        store-wide; a sweep's cell waits while its sweep has ``max_parallel`` cells
        active; cells of a sweep on another backend (Ray) are that backend's to start and
        never picked. With ``sweep_id`` (a sweep's own scheduler): only that sweep's
        cells, counted within the sweep, recorded as owned by ``owner`` (the scheduling
        process's ``pid``, ``pid_started``, ``host``) with a first heartbeat."""

        def claim(c: sqlite3.Connection) -> str | None:
            scope, params = ("", ()) if sweep_id is None else (" AND sweep_id = ?", (sweep_id,))
            if max_active:
                (n,) = c.execute(f"SELECT COUNT(*) FROM runs WHERE ({_ACTIVE_WHERE}){scope}",
                                 params).fetchone()
                if n >= max_active:
                    return None
            if sweep_id is not None:
                row = c.execute(
                    "SELECT id FROM runs WHERE status = 'queued' AND dispatched_at IS NULL "
                    "AND sweep_id = ? ORDER BY queued_at, created_at LIMIT 1", params
                ).fetchone()
            else:
                active = _ACTIVE_WHERE.replace("status", "a.status").replace(
                    "dispatched_at", "a.dispatched_at")
                row = c.execute(
                    "SELECT r.id FROM runs r LEFT JOIN sweeps s ON r.sweep_id = s.id "
                    "WHERE r.status = 'queued' AND r.dispatched_at IS NULL AND ("
                    "r.sweep_id IS NULL OR s.id IS NULL OR (s.backend = 'local' AND ("
                    "s.max_parallel IS NULL OR s.max_parallel < 1 OR (SELECT COUNT(*) FROM "
                    f"runs a WHERE a.sweep_id = s.id AND ({active})) < s.max_parallel))) "
                    "ORDER BY r.queued_at, r.created_at LIMIT 1"
                ).fetchone()
            if row is None:
                return None
            now = time.time()
            who = dict.fromkeys(OWNER_COLUMNS) if owner is None else \
                {k: owner.get(k) for k in OWNER_COLUMNS}
            beat = None if owner is None else now
            c.execute(
                "UPDATE runs SET dispatched_at = ?, updated_at = ?, pid = ?, "
                "pid_started = ?, host = COALESCE(?, host), supervisor_pid = NULL, "
                "heartbeat_at = ?, exit_code = NULL, stop_deadline = NULL WHERE id = ?",
                (now, now, who["pid"], who["pid_started"], who["host"], beat, row[0]),
            )
            return str(row[0])

        return self.write(claim)

    # ---- queries ---------------------------------------------------------------------

    def get_run(self, run_id: str) -> dict[str, Any] | None:
        """The run as a dict (``config`` parsed), or ``None``."""
        rows = self._rows("SELECT * FROM runs WHERE id = ?", (run_id,))
        return _run_dict(rows[0]) if rows else None

    def run_for_folder(self, folder: str | os.PathLike[str]) -> str | None:
        """The id of the run whose folder is ``folder``, or ``None``."""
        path = Path(folder).absolute()
        rows = self._rows("SELECT id FROM runs WHERE folder = ? ORDER BY created_at DESC",
                          (str(path),))
        if rows:
            return str(rows[0][0])
        if path.resolve().parent == self.root.resolve():
            rows = self._rows("SELECT id FROM runs WHERE id = ? AND folder IS NULL",
                              (path.name,))
            if rows:
                return str(rows[0][0])
        return None

    def active_runs(self) -> list[dict[str, Any]]:
        """Runs that have, or are about to have, a process: running, stopping, or queued
        and already dispatched to a supervisor (what the launcher checks for crashes)."""
        return [_run_dict(r) for r in self._rows(f"SELECT * FROM runs WHERE {_ACTIVE_WHERE}")]

    def resolve(self, ref: str) -> str:
        """A run id from an id, a unique id prefix or a unique run name."""
        if not ref.strip():  # an empty prefix would match every run
            raise RunNotFoundError("run: the run reference is empty; give a run id, the "
                                   "start of one, or a run name (comera runs lists them)")
        if self.get_run(ref) is not None:
            return ref
        like = _escape_like(ref) + "%"
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
            params.append(f"%{_escape_like(name_like)}%")
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
