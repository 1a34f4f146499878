"""What a run logs: metric rows, rank snapshots, events and artifacts; the batched write
the trainer's sink makes, and the reads the dashboard plots from.

``metrics`` holds one value per ``(run, name, step)``, clustered by run, name and step
(``WITHOUT ROWID``), so one curve is one index range; ``metric_names`` lists each run's
names so queries never scan for them. SQLite stores NaN as NULL; reads give NaN back.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from comera_engine.store.connection import Database
from comera_engine.store.lifecycle import transition_in
from comera_engine.store.runs import check_owner_in, set_phase_in

MetricRow = tuple[int, str, float | None, float]
"""``(step, name, value, time)``."""
RankRow = tuple[int, str, str, float]
"""``(step, layer, ranks_json, time)``."""
EventRow = tuple[float, int | None, str, str]
"""``(time, step, kind, text)``."""
ArtifactRow = tuple[str, str, int | None, float]
"""``(kind, path, size, time)``."""


def _nan(v: Any) -> float:
    return float("nan") if v is None else float(v)


def metric_value(name: str, v: Any) -> float:
    """``float(v)``; a value that is not a number raises ValueError naming the metric
    (SQLite stores NaN as NULL; queries turn it back into NaN)."""
    try:
        return float(v)
    except (TypeError, ValueError):
        raise ValueError(f"metrics[{name!r}]: not a number: {v!r}") from None


def artifact_row(kind: str, path: str | os.PathLike[str]) -> ArtifactRow:
    """``(kind, absolute path, size in bytes (a folder: its files summed; None when
    unreadable), now)``."""
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


def _where_run(
    select: str, run_id: str, column: str, value: Any, order: str = ""
) -> tuple[str, list[Any]]:
    """``select WHERE run_id = ? [AND column = ?] [ORDER BY order]`` and its parameters;
    the ``column`` filter only when ``value`` is not None."""
    sql = f"{select} WHERE run_id = ?"
    params: list[Any] = [run_id]
    if value is not None:
        sql += f" AND {column} = ?"
        params.append(value)
    if order:
        sql += f" ORDER BY {order}"
    return sql, params


def _write_records(
    c: sqlite3.Connection,
    run_id: str,
    metrics: Sequence[MetricRow],
    ranks: Sequence[RankRow],
    events: Sequence[EventRow],
    artifacts: Sequence[ArtifactRow],
    rewind_from: int | None,
) -> None:
    """Insert one run's records inside the caller's transaction (see ``write_batch``)."""
    if rewind_from is not None:
        c.execute("DELETE FROM metrics WHERE run_id = ? AND step >= ?", (run_id, rewind_from))
        c.execute(
            "DELETE FROM rank_snapshots WHERE run_id = ? AND step >= ?", (run_id, rewind_from)
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


class MetricRows(Database):
    """Records of runs (a part of :class:`~comera_engine.store.RunStore`)."""

    # ---- writes ----------------------------------------------------------------------

    def write_batch(
        self,
        run_id: str,
        *,
        metrics: Sequence[MetricRow] = (),
        ranks: Sequence[RankRow] = (),
        events: Sequence[EventRow] = (),
        artifacts: Sequence[ArtifactRow] = (),
        rewind_from: int | None = None,
        heartbeat: bool = False,
        status: tuple[str, str, str | None] | None = None,
        owner: Mapping[str, Any] | None = None,
        phase: tuple[str | None, float | None] | None = None,
    ) -> bool:
        """Write buffered records of one run in one transaction.

        ``metrics``: ``(step, name, value, time)``; ``ranks``: ``(step, layer, ranks_json,
        time)``; ``events``: ``(time, step, kind, text)``; ``artifacts``: ``(kind, path,
        size, time)``. ``rewind_from``: first delete metrics and rank snapshots at steps
        ``>= rewind_from`` (rows of an earlier attempt that a resumed run logs again).
        ``status``: ``(action, status, error)`` carried out after the records (an action of
        :data:`~comera_engine.store.lifecycle.TRANSITIONS`). ``phase``:
        ``(phase, progress)`` the run is in now (see
        :meth:`~comera_engine.store.runs.RunRows.set_phase`). ``owner``: the
        writer's owner token (``pid``, ``pid_started``, ``host``); when given, nothing is
        written unless it still owns the run (:class:`~comera_engine.store.errors.NotOwnerError`).
        Returns whether the status changed (``True`` when no status was given).
        """

        def w(c: sqlite3.Connection) -> bool:
            if owner is not None:
                check_owner_in(c, run_id, owner)
            _write_records(c, run_id, metrics, ranks, events, artifacts, rewind_from)
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
            if phase is not None:
                set_phase_in(c, run_id, *phase)
            if status is not None:
                action, st, err = status
                return transition_in(c, run_id, action, st, err)
            return True

        return self.write(w)

    def log_metrics(self, run_id: str, step: int, metrics: Mapping[str, float]) -> None:
        """Unbuffered single write (use :class:`StoreSink` from a training loop)."""
        t = time.time()
        rows = [(int(step), str(k), metric_value(k, v), t) for k, v in metrics.items()]
        self.write_batch(run_id, metrics=rows)

    def log_ranks(self, run_id: str, step: int, ranks: Mapping[str, Sequence[int]]) -> None:
        t = time.time()
        rows = [(int(step), str(k), json.dumps([int(x) for x in v]), t) for k, v in ranks.items()]
        self.write_batch(run_id, ranks=rows)

    def log_event(self, run_id: str, kind: str, text: str, step: int | None = None) -> None:
        self.write_batch(run_id, events=[(time.time(), step, str(kind), str(text))])

    def log_artifact(self, run_id: str, kind: str, path: str | os.PathLike[str]) -> None:
        """Record a file written for a run (an export); a read-only store (a read-only
        home, opened for reading) keeps no record and says so on stderr."""
        if self.readonly:
            print(f"comera: {kind} not recorded: the store in {self.root} is read-only",
                  file=sys.stderr)
            return
        self.write_batch(run_id, artifacts=[artifact_row(kind, path)])

    # ---- metric reads ------------------------------------------------------------------

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
        """Metric rows of a run (of one metric when ``name`` is given)."""
        sql, params = _where_run("SELECT COUNT(*) FROM metrics", run_id, "name", name)
        return int(self._rows(sql, params)[0][0])

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

    def median_metric(self, run_id: str, name: str) -> float | None:
        """The median of a metric over every step the run logged it (NaN rows left out;
        ``None`` when it has none): e.g. a run's typical step time, which one step's value
        is not (a step that prunes, truncates or shares the machine takes several times
        longer)."""

        def q(c: sqlite3.Connection) -> float | None:
            where = "FROM metrics WHERE run_id = ? AND name = ? AND value IS NOT NULL"
            n = c.execute(f"SELECT COUNT(*) {where}", (run_id, name)).fetchone()[0]
            if not n:
                return None
            mid = c.execute(f"SELECT value {where} ORDER BY value LIMIT ? OFFSET ?",
                            (run_id, name, 2 - n % 2, (n - 1) // 2)).fetchall()
            return sum(float(r[0]) for r in mid) / len(mid)

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

    # ---- ranks, events, artifacts --------------------------------------------------------

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
        sql, params = _where_run(
            "SELECT step, layer, ranks, time FROM rank_snapshots",
            run_id,
            "layer",
            layer,
            "step, layer, id",
        )
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
        sql, params = _where_run(
            "SELECT id, kind, path, size, time FROM artifacts", run_id, "kind", kind, "id"
        )
        rows = [dict(r) for r in self._rows(sql, params)]
        for d in rows:
            d["exists"] = os.path.exists(d["path"])
        return rows

    def counts(self, run_id: str) -> dict[str, int]:
        """Row counts per table for one run."""

        def q(c: sqlite3.Connection) -> dict[str, int]:
            out = {}
            for t in ("metrics", "rank_snapshots", "events", "artifacts"):
                sql = f"SELECT COUNT(*) FROM {t} WHERE run_id = ?"
                out[t] = int(c.execute(sql, (run_id,)).fetchone()[0])
            return out

        return self.read(q)
