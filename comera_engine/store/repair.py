"""``comera repair``: check the run store and rebuild a damaged one from the run folders.

Each run folder is a complete record of its run: ``config.toml`` (the resolved config)
and ``metrics.jsonl`` (every metric, rank snapshot, event, artifact and status the
trainer logged, in order). :func:`repair` runs ``PRAGMA quick_check`` on the store; a
store that fails it (or cannot be opened at all: a zeroed header, broken pages, a file
emptied beside run folders) is rebuilt from the folders ``<store dir>/<run id>/`` (the
run rows, metrics, rank snapshots, events and artifacts) into a new file beside it,
then moved aside as ``comera.db.damaged-<time>`` (with its ``-wal`` and ``-shm``),
never deleted, and the new file renamed into its place. A sound store gets the run
folders it has no row for, and the metric steps a folder holds that it lacks. A line of
``metrics.jsonl`` that does not parse is skipped; the intact lines after it are read.
A run whose trainer left no final status is rebuilt ``crashed`` (so it resumes); sweeps
and the owner columns are not kept. Runs trained in a folder outside the store's
(``comera train --run-dir``) are not found there.

Repair refuses while a trainer holds a run folder's lock (``comera stop RUN`` works
without a readable store), never moves a healthy store (it only adds to it), nor another
application's database.

The other way round, before a resume: :func:`rewind_jsonl` drops what the attempt being
resumed logged after its checkpoint, and :func:`mend_jsonl` rewrites a ``metrics.jsonl``
that lacks steps from the store (:func:`records_from_store`), or marks it partial.
Torch-free.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from comera_engine.store.errors import StoreError
from comera_engine.store.layout import resolve_store_path, run_folders, write_atomic
from comera_engine.store.run_store import RunStore
from comera_engine.store.runs import FINAL_STATUSES, STATUSES

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

__all__ = ["RepairReport", "backfill_store", "mend_jsonl", "rebuild_run", "records_from_store",
           "repair", "rewind_jsonl", "store_problem"]

#: What the store says about a database that belongs to something else: never moved.
_FOREIGN = ("not a CoMERA run store", "another application", "newer than this")


@dataclass
class RepairReport:
    """What :func:`repair` found and did."""

    path: Path
    problem: str | None  # None: the store was sound
    moved_to: Path | None = None
    runs: list[str] = field(default_factory=list)
    metric_rows: int = 0
    skipped: list[str] = field(default_factory=list)  # folders that could not be read


def store_problem(path: Path) -> str | None:
    """Why the store at ``path`` cannot be trusted (``None``: it opens and passes
    ``PRAGMA quick_check``). Raises StoreError for a database that is not a damaged
    run store but someone else's (never to be moved)."""
    try:
        st = RunStore(path, create=False)
    except StoreError as e:
        if any(w in str(e) for w in _FOREIGN):
            raise
        return str(e)
    try:
        found = st.check()
        st.list_runs()  # reads every run row
    except StoreError as e:
        return str(e)
    finally:
        st.close()
    return None if found == ["ok"] else "quick_check: " + "; ".join(found[:3])


def _live_folders(root: Path) -> list[str]:
    """Run folders whose ``.lock`` a live trainer holds (the OS drops it on its exit)."""
    live = []
    for folder in run_folders(root):
        try:
            fd = os.open(folder / ".lock", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            live.append(folder.name)
        finally:
            os.close(fd)
    return live


def _read_jsonl(path: Path) -> tuple[list[dict[str, Any]], list[int]]:
    """The records of a ``metrics.jsonl`` and the numbers (from 1) of its lines that do
    not read back (a torn last line from a crash, a damaged line): those are skipped, and
    every intact line after them is kept."""
    out: list[dict[str, Any]] = []
    damaged: list[int] = []
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    record = None
                if isinstance(record, dict):
                    out.append(record)
                else:
                    damaged.append(number)
    except FileNotFoundError:
        pass
    return out, damaged


def _records(path: Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` (lines that do not read back are skipped)."""
    return _read_jsonl(path)[0]


def _lines_text(numbers: list[int]) -> str:
    shown = ", ".join(str(n) for n in numbers[:5])
    return f"line {shown}" if len(numbers) == 1 else \
        f"{len(numbers)} lines ({shown}{', ...' if len(numbers) > 5 else ''})"


def rebuild_run(st: RunStore, folder: Path) -> int:
    """Insert the run kept in ``folder`` into ``st`` (id: the folder's name); returns
    its metric rows."""
    raw = tomllib.loads((folder / "config.toml").read_text(encoding="utf-8"))
    records, damaged = _read_jsonl(folder / "metrics.jsonl")
    metrics, ranks, events, artifacts = [], [], [], []
    status, error, started, ended = None, None, None, None
    for r in records:
        t, kind = float(r.get("t") or 0.0), r.get("type")
        if kind == "metrics":
            metrics += [(int(r["step"]), str(k), None if v is None else float(v), t)
                        for k, v in dict(r.get("values") or {}).items()]
        elif kind == "ranks":
            ranks += [(int(r["step"]), str(k), json.dumps(v), t)
                      for k, v in dict(r.get("ranks") or {}).items()]
        elif kind == "event":
            events.append((t, r.get("step"), str(r.get("kind")), str(r.get("text"))))
        elif kind == "artifact":
            artifacts.append((str(r.get("kind")), str(r.get("path")), None, t))
        elif kind == "status" and r.get("status") in STATUSES:
            status, error = r["status"], r.get("error")
            started = started or (t if status == "running" else None)
            ended = t if status in FINAL_STATUSES else None
    if status not in FINAL_STATUSES:  # its trainer is gone without a final word
        status = "crashed" if records else "stopped"
        error = ("rebuilt by comera repair: the trainer reported no final status; resume "
                 "continues from its newest checkpoint") if records else None
        ended = time.time()
    train = raw.get("train") if isinstance(raw.get("train"), dict) else {}
    rid = st.create_run(str(raw.get("name") or folder.name), raw, status, run_id=folder.name,
                        device=str(train.get("device", "auto")))
    st.write_batch(rid, metrics=metrics, ranks=ranks, events=events, artifacts=artifacts)
    created = min((float(r.get("t") or time.time()) for r in records),
                  default=folder.stat().st_mtime)
    st.update_run(rid, error=error, started_at=started, ended_at=ended,
                  last_step=max((m[0] for m in metrics), default=None))
    st.write(lambda c: c.execute("UPDATE runs SET created_at = ? WHERE id = ?", (created, rid)))
    skipped = (f"; skipped unreadable {_lines_text(damaged)} of metrics.jsonl"
               if damaged else "")
    st.log_event(rid, "repair", f"rebuilt from {folder} by comera repair "
                 f"({len(metrics)} metric rows, {len(events)} events{skipped})")
    return len(metrics)


def _unrecorded(st: RunStore, root: Path) -> list[Path]:
    """Run folders in ``root`` that no run of the store names (by id or folder)."""
    rows = st.read(lambda c: c.execute("SELECT id, folder FROM runs").fetchall())
    ids = {rid for rid, _ in rows}
    folders = {str(Path(f).resolve()) for _, f in rows if f}
    return [p for p in run_folders(root)
            if p.name not in ids and str(p.resolve()) not in folders]


def _refuse_live(root: Path, names: list[str] | None = None) -> None:
    live = [n for n in _live_folders(root) if names is None or n in names]
    if live:
        raise StoreError(f"repair: {len(live)} run(s) still train ({', '.join(live[:3])}); "
                         "stop them first (comera stop RUN works without the store)")


def _rebuild_into(st: RunStore, folders: list[Path], report: RepairReport) -> None:
    for folder in folders:
        try:
            report.metric_rows += rebuild_run(st, folder)
            report.runs.append(folder.name)
        except (OSError, ValueError, KeyError, TypeError) as e:
            report.skipped.append(f"{folder.name} ({type(e).__name__}: {e})")


def _backfill_runs(st: RunStore, root: Path) -> dict[str, int]:
    """The steps each recorded run's ``metrics.jsonl`` holds and the store lacks, added
    to the store (runs that train now are left alone); ``{run id: steps added}``."""
    live = set(_live_folders(root))
    found = {}
    for run in st.list_runs():
        folder = Path(st.run_dir(run["id"]))
        if folder.name in live or not (folder / "metrics.jsonl").is_file():
            continue
        try:
            n = backfill_store(folder / "metrics.jsonl", float("inf"), st, run["id"])
        except (OSError, ValueError, TypeError):
            continue
        if n:
            found[run["id"]] = n
    return found


def repair(store: str | os.PathLike[str] | None = None) -> RepairReport:
    """Check the store; when it is damaged, rebuild it from the run folders into a new
    file beside it, then move the damaged one aside and the new one into its place (a
    repair killed on the way leaves the damaged store where it was, and the next repair
    starts again). A sound store gets the run folders it has no row for. Raises
    StoreError (one line) while a run folder is locked by a live trainer, for another
    application's database, or for a store folder that does not exist."""
    path = resolve_store_path(store)
    root = path.parent
    if not root.is_dir():
        raise StoreError(f"--store: {root} is no folder; name the folder that holds "
                         "comera.db and the run folders")
    problem = store_problem(path) if path.exists() else "no store file"
    report = RepairReport(path, problem)
    if problem is None:
        with RunStore(path, create=False) as st:
            missing = _unrecorded(st, root)
            if missing:
                _refuse_live(root, [p.name for p in missing])
            found = _backfill_runs(st, root)
            _rebuild_into(st, missing, report)
        told = [f"{len(missing)} run folder(s) had no row in the store"] if missing else []
        if found:
            told.append(f"the store lacked {sum(found.values())} step(s) of "
                        f"{', '.join(found)} that metrics.jsonl holds")
        report.problem = "; ".join(told) + " (added)" if told else None
        return report
    _refuse_live(root)
    for old in root.glob(f"{path.name}.rebuild-*"):  # left by a repair that was killed
        if not _pid_alive(old.name.rsplit("-", 1)[-1]):
            old.unlink(missing_ok=True)
    fresh = path.with_name(f"{path.name}.rebuild-{os.getpid()}")
    try:
        st = RunStore(fresh)
        try:
            _rebuild_into(st, run_folders(root), report)
            st.read(lambda c: c.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall())
            st.read(lambda c: c.execute("PRAGMA journal_mode = DELETE").fetchall())
        finally:
            st.close()
        if path.exists():
            stamp = time.strftime("%Y%m%d-%H%M%S")
            report.moved_to = path.with_name(f"{path.name}.damaged-{stamp}")
            for suffix in ("", "-wal", "-shm"):
                src = path.with_name(path.name + suffix)
                if src.exists():
                    os.replace(src, report.moved_to.with_name(report.moved_to.name + suffix))
        os.replace(fresh, path)
    finally:
        for suffix in ("", "-wal", "-shm"):
            fresh.with_name(fresh.name + suffix).unlink(missing_ok=True)
    return report


def _pid_alive(text: str) -> bool:
    try:
        os.kill(int(text), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def records_from_store(st: RunStore, run_id: str, upto: int) -> list[dict[str, Any]]:
    """A run's ``metrics.jsonl`` records as the store holds them, steps ``<= upto``:
    metrics (one record per step), rank snapshots, events (with a step up to ``upto``,
    or none) and artifacts, ordered by time (the reverse of :func:`rebuild_run`)."""
    def q(c: Any) -> dict[str, list[tuple[Any, ...]]]:
        return {
            "metrics": c.execute("SELECT step, name, value, time FROM metrics WHERE run_id = ? "
                                 "AND step <= ? ORDER BY step, name", (run_id, upto)).fetchall(),
            "ranks": c.execute("SELECT step, layer, ranks, time FROM rank_snapshots WHERE "
                               "run_id = ? AND step <= ? ORDER BY id", (run_id, upto)).fetchall(),
            "events": c.execute("SELECT time, step, kind, text FROM events WHERE run_id = ? AND "
                                "(step IS NULL OR step <= ?) ORDER BY id",
                                (run_id, upto)).fetchall(),
            "artifacts": c.execute("SELECT kind, path, time FROM artifacts WHERE run_id = ? "
                                   "ORDER BY id", (run_id,)).fetchall(),
        }

    rows = st.read(q)
    out: list[dict[str, Any]] = []
    by_step: dict[int, dict[str, Any]] = {}
    for step, name, value, t in rows["metrics"]:
        rec = by_step.setdefault(step, {"t": t, "type": "metrics", "step": step, "values": {}})
        rec["values"][name] = float("nan") if value is None else value
    out += by_step.values()
    out += [{"t": t, "type": "ranks", "step": s, "ranks": {layer: json.loads(r)}}
            for s, layer, r, t in rows["ranks"]]
    out += [{"t": t, "type": "event", "kind": k, "text": x, "step": s}
            for t, s, k, x in rows["events"]]
    out += [{"t": t, "type": "artifact", "kind": k, "path": p} for k, p, t in rows["artifacts"]]
    return sorted(out, key=lambda r: (r["t"], r.get("step") or 0))


def mend_jsonl(path: Path, step: int, store: RunStore | None, run_id: str | None) -> None:
    """Before a resume from ``step``: a ``metrics.jsonl`` that lacks some of steps
    1..``step`` (deleted, cut by a full disk, a damaged line) gets them from the run
    store: rewritten from it when it holds all of them, else the steps it holds are
    added to the file's own records. Steps neither holds are named in an event that
    says the file is partial."""
    kept = _records(path)
    have = {r.get("step") for r in kept if r.get("type") == "metrics"}
    missing = sorted(set(range(1, step + 1)) - have)
    if not missing:
        return
    records: list[dict[str, Any]] = []
    if store is not None and run_id is not None:
        records = records_from_store(store, run_id, step)
    stored = {r["step"] for r in records if r["type"] == "metrics"}
    if stored >= set(range(1, step + 1)):
        note = f"metrics.jsonl lacked {len(missing)} of steps 1..{step}: rewritten from " \
               "the run store"
        records.append({"type": "event", "kind": "info", "text": note, "step": step})
        _write_records(path, records)
        print(f"comera: {note}", file=sys.stderr)
        return
    added = [r for r in records if r["type"] == "metrics" and r["step"] in set(missing)]
    lacking = [s for s in missing if s not in stored]
    source = "the run store lacks them too" if store is not None else "no run store holds them"
    note = (f"metrics.jsonl is partial: it lacks {len(lacking)} of steps 1..{step} "
            f"(first {lacking[0]}); {source}")
    if added:
        note += f" ({len(added)} other missing step(s) were restored from the run store)"
    merged = kept if not added else sorted(
        kept + added, key=lambda r: (float(r.get("t") or 0), r.get("step") or 0))
    merged.append({"type": "event", "kind": "partial", "text": note, "step": step})
    _write_records(path, merged)
    print(f"comera: {note}", file=sys.stderr)


def backfill_store(path: Path, step: float, store: RunStore, run_id: str,
                   owner: Any = None) -> int:
    """The mirror of :func:`mend_jsonl`: the metric rows and rank snapshots of steps
    1..``step`` that ``metrics.jsonl`` holds and the run store lacks (its writes failed
    while the run went on in its folder: a file size limit, a damaged store since
    rebuilt) are written to the store. Returns how many steps it added."""
    stored = set(store.read(lambda c: [r[0] for r in c.execute(
        "SELECT DISTINCT step FROM metrics WHERE run_id = ? AND step <= ?",
        (run_id, step)).fetchall()]))
    metrics: list[tuple[Any, ...]] = []
    ranks: list[tuple[Any, ...]] = []
    steps: set[int] = set()
    for r in _records(path):
        s = r.get("step")
        if not isinstance(s, int) or s > step or s in stored:
            continue
        t = float(r.get("t") or 0.0)
        if r.get("type") == "metrics":
            steps.add(s)
            metrics += [(s, str(k), None if v is None else float(v), t)
                        for k, v in dict(r.get("values") or {}).items()]
        elif r.get("type") == "ranks":
            ranks += [(s, str(k), json.dumps(v), t) for k, v in dict(r.get("ranks") or {}).items()]
    if metrics:
        store.write_batch(run_id, metrics=metrics, ranks=ranks, owner=owner)
    return len(steps)


def _write_records(path: Path, records: list[dict[str, Any]]) -> None:
    write_atomic(path, "".join(json.dumps({"t": r.get("t", 0), **r}) + "\n" for r in records))


def rewind_jsonl(path: Path, step: int) -> None:
    """Drop records of steps after ``step`` (left by an attempt that is being resumed;
    ``-1``: every record of a step, for a run that starts again from step 0). Every
    intact line of a step up to ``step`` is kept, also after a line that does not read
    back (which is dropped, and named on stderr)."""
    if not path.exists():
        return
    records, damaged = _read_jsonl(path)
    kept = [r for r in records if r.get("step") is None or _step_of(r) <= step]
    write_atomic(path, "".join(json.dumps(record) + "\n" for record in kept))
    if damaged:
        print(f"comera: metrics.jsonl: dropped unreadable {_lines_text(damaged)}; every "
              "other line was kept", file=sys.stderr)


def _step_of(record: dict[str, Any]) -> float:
    try:
        return float(record["step"])
    except (TypeError, ValueError):
        return float("inf")  # a step that is no number: not kept by a rewind
