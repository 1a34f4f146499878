"""The trainer's side of the thread budget (:mod:`comera_engine.launch.threads`): a run
launched with ``COMERA_THREADS=auto`` keeps torch's intra-op threads at ``cores // runs
in flight`` while other runs start and end.

:class:`ThreadBudget` is a metrics sink: a daemon thread counts the runs in flight every
``every`` seconds (a store query, never on the training thread), and ``log_metrics``,
which the training loop calls on its own thread after each step, applies a new count
with ``torch.set_num_threads`` (OpenMP's thread count belongs to the thread that sets
it). A failed count keeps the current threads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from comera_engine.metrics import NullSink

__all__ = ["ThreadBudget"]


class ThreadBudget(NullSink):
    """Follow ``max(1, cores // count_runs())`` threads; ``on_change(threads, runs,
    step)`` is called (on the training thread) after each change."""

    def __init__(self, count_runs: Callable[[], int], cores: int, every: float = 3.0,
                 on_change: Callable[[int, int, int], None] | None = None) -> None:
        self._count_runs, self._cores, self._every = count_runs, max(1, int(cores)), every
        self._on_change = on_change
        self._want: tuple[int, int] | None = None  # (threads, runs) last counted
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="ThreadBudget", daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while True:
            try:
                runs = max(1, int(self._count_runs()))
                self._want = (max(1, self._cores // runs), runs)
            except Exception:  # noqa: BLE001 (a busy or damaged store: keep the threads)
                pass
            if self._stop.wait(self._every):
                return

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        want = self._want
        if want is not None and want[0] != torch.get_num_threads():
            torch.set_num_threads(want[0])
            if self._on_change is not None:
                self._on_change(*want, step)

    def close(self) -> None:
        self._stop.set()
