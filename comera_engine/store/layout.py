"""Where the run store lives on disk and what a run folder holds.

The database is one file (``$COMERA_HOME/comera.db``, else ``./runs/comera.db``); the run
folder of run ``id`` is ``<store dir>/<id>/`` with the trainer's log ``train.log`` and its
checkpoints ``checkpoints/step_000123.json`` (sidecar, written last) beside
``step_000123.safetensors``. Reading those files needs neither SQLite nor torch.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from comera_engine.store.errors import StoreError

DB_FILENAME = "comera.db"
LOG_FILENAME = "train.log"
#: A checkpoint's sidecar; it is written after its tensor file, so it marks a whole one.
_CHECKPOINT_SIDECAR = re.compile(r"^step_(\d{6,})\.json$")


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


def run_folder(root: Path, run_id: str) -> Path:
    """``root / run_id``; an id that is empty or would leave ``root`` raises StoreError."""
    if not run_id or "/" in run_id or "\\" in run_id or run_id in (".", ".."):
        raise StoreError(f"run_id: invalid run id {run_id!r}")
    return root / run_id


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


def list_checkpoints(ckpt_dir: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Complete checkpoints in ``ckpt_dir`` as ``(step, sidecar path)``, oldest first: a
    ``step_NNNNNN.json`` sidecar with its ``.safetensors`` file beside it."""
    folder = Path(ckpt_dir)
    if not folder.is_dir():
        return []
    found = []
    for path in folder.iterdir():
        match = _CHECKPOINT_SIDECAR.match(path.name)
        if match and path.with_suffix(".safetensors").is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)
