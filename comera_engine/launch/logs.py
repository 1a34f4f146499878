"""A run's log (``<run_dir>/train.log``): the trainer's and its supervisor's output.
Torch-free.
"""

from __future__ import annotations

import os

from comera_engine.launch.runs import open_store
from comera_engine.store import RunStore, read_log_tail


def logs(
    run_id: str,
    tail: int | None = None,
    store: RunStore | str | os.PathLike[str] | None = None,
) -> str:
    """The run's log (``<run_dir>/train.log``), or its last ``tail`` lines."""
    st = open_store(store)
    rid = st.resolve(run_id)
    path = st.log_path(rid)
    if tail is not None:
        return read_log_tail(path, lines=int(tail), max_bytes=max(65536, 400 * int(tail)))
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return ""
