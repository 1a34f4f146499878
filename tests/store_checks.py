"""Shared by tests of a run store whose write lock a frozen process holds
(tests/test_faults.py, tests/test_app.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def frozen_lock_holder(db: Path) -> Iterator[subprocess.Popen]:
    """A process that takes the SQLite store ``db``'s write lock (``BEGIN IMMEDIATE``)
    and is then stopped with SIGSTOP, as a trainer frozen in the middle of a write; woken
    and killed on exit, which frees the lock."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sqlite3, sys, time\n"
         "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
         "c.execute('BEGIN IMMEDIATE'); print('held', flush=True); time.sleep(120)",
         str(db)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        os.kill(holder.pid, signal.SIGSTOP)
        yield holder
    finally:
        os.kill(holder.pid, signal.SIGCONT)
        holder.kill()
        holder.wait()
