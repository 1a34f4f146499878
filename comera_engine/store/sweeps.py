"""Sweep rows: a sweep is a base config, a grid of overrides and a number of seeds; its
cells are ordinary runs (``runs.sweep_id``, ``runs.cell``), queued and started like any
other, at most ``max_parallel`` of them at once.

A sweep's status is not stored but read from its cells (:func:`sweep_status`), so it can
never disagree with them: ``queued`` (no cell has started), ``running`` (a cell is active
or waiting), ``stopped`` (nothing left to run, some cells stopped), ``failed`` (nothing left
to run, some cells failed, crashed or diverged) or ``finished`` (every cell finished).
"""

from __future__ import annotations

import json
import secrets
import sqlite3
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from comera_engine.store.connection import Database
from comera_engine.store.errors import RunNotFoundError, StoreError
from comera_engine.store.runs import _run_dict

#: Where a sweep's cells run: this machine's launcher, or Ray tasks.
SWEEP_BACKENDS = ("local", "ray")


def new_sweep_id() -> str:
    """Sortable, unique-enough sweep id: ``sweep-YYYYmmdd-HHMMSS-xxxx``."""
    return "sweep-" + time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


def sweep_status(statuses: Iterable[str]) -> str:
    """The status of a sweep whose cells have ``statuses`` (see the module docstring)."""
    sts = list(statuses)
    if not sts:
        return "finished"
    if any(s in ("running", "stopping") for s in sts):
        return "running"
    if any(s == "queued" for s in sts):
        return "running" if any(s != "queued" for s in sts) else "queued"
    if all(s == "finished" for s in sts):
        return "finished"
    if any(s in ("failed", "crashed", "diverged") for s in sts):
        return "failed"
    return "stopped"


def _sweep_dict(row: sqlite3.Row) -> dict[str, Any]:
    d = dict(row)
    for key in ("config", "grid"):
        try:
            d[key] = json.loads(d[key])
        except (TypeError, ValueError):
            pass
    return d


class SweepRows(Database):
    """The ``sweeps`` table (a part of :class:`~comera_engine.store.RunStore`)."""

    def create_sweep(
        self,
        name: str,
        config: Mapping[str, Any],
        grid: Mapping[str, Sequence[Any]],
        seeds: int,
        *,
        max_parallel: int | None = None,
        backend: str = "local",
        address: str | None = None,
        sweep_id: str | None = None,
    ) -> str:
        """Insert a sweep (no cells yet) and return its id."""
        if backend not in SWEEP_BACKENDS:
            raise ValueError(f"backend: must be one of {', '.join(SWEEP_BACKENDS)}")
        sid = sweep_id or new_sweep_id()
        now = time.time()
        config_json = json.dumps(dict(config), default=str)
        grid_json = json.dumps({k: list(v) for k, v in grid.items()}, default=str)

        def ins(c: sqlite3.Connection) -> None:
            if c.execute("SELECT 1 FROM sweeps WHERE id = ?", (sid,)).fetchone():
                raise StoreError(f"sweep_id: sweep {sid!r} already exists")
            c.execute(
                "INSERT INTO sweeps (id, name, config, grid, seeds, max_parallel, backend, "
                "address, created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (sid, name, config_json, grid_json, int(seeds),
                 None if max_parallel is None else int(max_parallel), backend, address,
                 now, now),
            )

        self.write(ins)
        return sid

    def delete_sweep(self, sweep_id: str) -> None:
        """Delete a sweep row (its cells are runs: delete those with ``delete_run``)."""
        self.write(lambda c: c.execute("DELETE FROM sweeps WHERE id = ?", (sweep_id,)))

    def set_sweep_parallel(self, sweep_id: str, max_parallel: int | None) -> None:
        """Change how many of the sweep's cells may run at once (``None``: no limit)."""
        now = time.time()
        self.write(lambda c: c.execute(
            "UPDATE sweeps SET max_parallel = ?, updated_at = ? WHERE id = ?",
            (None if max_parallel is None else int(max_parallel), now, sweep_id)))

    def get_sweep(self, sweep_id: str) -> dict[str, Any] | None:
        """The sweep as a dict (``config`` and ``grid`` parsed) with its derived
        ``status`` and ``counts`` (cells per status), or ``None``."""
        rows = self._rows("SELECT * FROM sweeps WHERE id = ?", (sweep_id,))
        if not rows:
            return None
        d = _sweep_dict(rows[0])
        counts = dict(self._rows(
            "SELECT status, COUNT(*) FROM runs WHERE sweep_id = ? GROUP BY status", (sweep_id,)))
        d["counts"] = {str(k): int(v) for k, v in counts.items()}
        d["cells"] = sum(d["counts"].values())
        d["status"] = sweep_status(s for s, n in d["counts"].items() for _ in range(n))
        return d

    def list_sweeps(self, limit: int | None = None) -> list[dict[str, Any]]:
        """Sweeps, newest first, each as :meth:`get_sweep` returns it."""
        sql = "SELECT id FROM sweeps ORDER BY created_at DESC, id"
        params: list[Any] = []
        if limit is not None:
            sql += " LIMIT ?"
            params.append(int(limit))
        out = []
        for (sid,) in self._rows(sql, params):
            sweep = self.get_sweep(sid)
            if sweep is not None:
                out.append(sweep)
        return out

    def sweep_runs(self, sweep_id: str) -> list[dict[str, Any]]:
        """The sweep's cells (runs), in the order they were created."""
        return [_run_dict(r) for r in self._rows(
            "SELECT * FROM runs WHERE sweep_id = ? ORDER BY created_at, id", (sweep_id,))]

    def resolve_sweep(self, ref: str) -> str:
        """A sweep id from an id, a unique sweep name or a unique id prefix (with or
        without ``sweep-``)."""
        if self.get_sweep(ref) is not None:
            return ref
        named = self._rows("SELECT id FROM sweeps WHERE name = ? ORDER BY created_at DESC",
                           (ref,))
        if len(named) == 1:
            return str(named[0][0])
        if len(named) > 1:
            raise RunNotFoundError(
                f"sweep: {len(named)} sweeps are named {ref!r}; use the sweep id "
                f"(latest: {named[0][0]})")
        for prefix in (ref, "sweep-" + ref):
            like = prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
            ids = [r[0] for r in self._rows(
                "SELECT id FROM sweeps WHERE id LIKE ? ESCAPE '\\'", (like,))]
            if len(ids) == 1:
                return str(ids[0])
            if len(ids) > 1:
                raise RunNotFoundError(
                    f"sweep: {ref!r} matches {len(ids)} sweeps; give more of the id")
        raise RunNotFoundError(f"sweep: no sweep {ref!r} in {self.path}")

    def is_sweep(self, ref: str) -> bool:
        """Whether ``ref`` names a sweep (its id or a unique prefix starting ``sweep-``)."""
        if not ref.startswith("sweep-") and self.get_sweep(ref) is None:
            return False
        try:
            self.resolve_sweep(ref)
        except RunNotFoundError:
            return False
        return True
