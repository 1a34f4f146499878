"""Where the run store lives on disk and what a run folder holds.

The database is one file (``$COMERA_HOME/comera.db``, else ``./runs/comera.db``); the run
folder of run ``id`` is ``<store dir>/<id>/`` with the trainer's log ``train.log`` and its
checkpoints ``checkpoints/step_000123.json`` (sidecar, written last) beside
``step_000123.safetensors``. Reading those files needs neither SQLite nor torch.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import struct
from pathlib import Path
from typing import Any

from comera_engine.errors import ConfigError
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


#: Room kept beside a checkpoint for the run's logs, metrics and store rows.
DISK_MARGIN_BYTES = 16 << 20
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def free_bytes(folder: str | os.PathLike[str]) -> int | None:
    """Free bytes on the file system of ``folder`` (or of its nearest existing parent:
    a home not made yet), ``None`` when that cannot be told (a pseudo file system such
    as /proc, of size 0, is not a disk)."""
    path = Path(folder).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return None
    return usage.free if usage.total else None


def disk_full_text(folder: str | os.PathLike[str], need: int | None = None,
                   exc: BaseException | None = None, home: bool = False) -> str:
    """``disk full: free N MB in FOLDER`` (and what is needed), one line with the fix
    (``home``: the folder is ``COMERA_HOME``, which another folder can replace). When
    ``exc`` is a file size limit (``EFBIG``: ``ulimit -f``), it says that instead."""
    if exc is not None and _too_large(exc):
        return (f"file too large: a write in {folder} passed this process's file size "
                "limit (ulimit -f); raise it (ulimit -f unlimited), then resume the run")
    free = free_bytes(folder)
    shown = "?" if free is None else f"{free / 2**20:.1f}"
    wants = "" if need is None else f", about {need / 2**20:.0f} MB needed"
    fix = " (or set COMERA_HOME to a folder with room)" if home else ""
    return f"disk full: free {shown} MB in {folder}{wants}; free space there{fix}"


def _errors(exc: BaseException | None) -> list[BaseException]:
    """``exc`` and what it was raised from, in order."""
    out: list[BaseException] = []
    while exc is not None and len(out) < 20:
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def _too_large(exc: BaseException) -> bool:
    return any((isinstance(e, OSError) and e.errno == errno.EFBIG)
               or "File too large" in str(e) for e in _errors(exc))


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it was raised from) is a full disk, a quota or a file size
    limit, from the OS (``ENOSPC``/``EDQUOT``/``EFBIG``) or from SQLite (``database or
    disk is full``)."""
    return _too_large(exc) or any(
        (isinstance(e, OSError) and e.errno in _DISK_FULL)
        or "disk is full" in str(e) or "No space left" in str(e) for e in _errors(exc))


def check_free_space(folder: str | os.PathLike[str], need: int, field: str) -> None:
    """Refuse (ConfigError naming ``field``) when ``folder`` has less than ``need`` bytes
    plus :data:`DISK_MARGIN_BYTES` free."""
    free = free_bytes(folder)
    if free is not None and free < need + DISK_MARGIN_BYTES:
        raise ConfigError(field, disk_full_text(folder, need + DISK_MARGIN_BYTES,
                                                home=field == "COMERA_HOME"))


def checkpoint_bytes(ckpt_dir: str | os.PathLike[str]) -> int:
    """Bytes of the newest complete checkpoint in ``ckpt_dir`` (0 when none)."""
    found = list_checkpoints(ckpt_dir)
    if not found:
        return 0
    meta = found[-1][1]
    try:
        return meta.with_suffix(".safetensors").stat().st_size + meta.stat().st_size
    except OSError:
        return 0


#: A file of :data:`RESERVE_BYTES` a trainer keeps in its run folder while it lives and
#: deletes when the disk fills, so that its final status, its last records and the
#: clean-up can still be written.
RESERVE_NAME = ".disk-reserve"
RESERVE_BYTES = 1 << 20


def make_reserve(run_dir: str | os.PathLike[str], size: int = RESERVE_BYTES) -> bool:
    """Allocate the run folder's disk reserve; ``False`` (and no file) when there is no
    room for it."""
    path = Path(run_dir) / RESERVE_NAME
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
        finally:
            os.close(fd)
        return True
    except OSError:
        path.unlink(missing_ok=True)
        return False


def release_reserve(run_dir: str | os.PathLike[str]) -> None:
    """Delete the run folder's disk reserve (if any)."""
    try:
        (Path(run_dir) / RESERVE_NAME).unlink(missing_ok=True)
    except OSError:
        pass


def write_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` through ``<path>.tmp`` and a rename: ``path`` is the
    old file or the whole new one, and a failed write (a full disk) leaves no ``.tmp``."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def run_folder(root: Path, run_id: str) -> Path:
    """``root / run_id``; an id that is empty or would leave ``root`` raises StoreError."""
    if not run_id or "/" in run_id or "\\" in run_id or run_id in (".", ".."):
        raise StoreError(f"run_id: invalid run id {run_id!r}")
    return root / run_id


def run_folders(root: Path) -> list[Path]:
    """The run folders in ``root``: its folders that hold a ``config.toml`` (each run's
    complete record, with its ``metrics.jsonl``)."""
    try:
        return sorted(p for p in root.iterdir() if p.is_dir() and (p / "config.toml").is_file())
    except OSError:  # no such folder, or one that cannot be listed
        return []


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


def traceback_error(text: str) -> str | None:
    """The exception the last Python traceback in ``text`` ended with, as one line
    (``OverflowError: Python int too large to convert to C long``); ``None`` when
    ``text`` holds no traceback. The frames stay in the log."""
    tb = extract_traceback(text)
    if tb is None:
        return None
    lines = tb.splitlines()
    frames = [i for i, ln in enumerate(lines) if ln.startswith("  File ")]
    rest = lines[frames[-1] + 1:] if frames else lines[1:]
    while rest and (not rest[0].strip() or rest[0][0].isspace()):  # code, carets
        rest = rest[1:]
    return one_line_error("\n".join(rest)) or "a Python error (traceback in the log)"


def one_line_error(text: str) -> str:
    """An error as the one line a run records: its non-blank lines joined by `` | ``."""
    return " | ".join(ln.strip() for ln in str(text).splitlines() if ln.strip())


def log_error(text: str, log_name: str = "the log") -> str:
    """What a trainer's log ``text`` says went wrong, as one line: the exception its
    last traceback ended with (``... (traceback in LOG_NAME)``), else its last one-line
    error (``comera: error: ...``), else its last non-blank lines."""
    found = traceback_error(text)
    if found:
        return f"{found} (traceback in {log_name})"
    said = [ln.strip() for ln in text.splitlines() if ln.startswith("comera: error: ")]
    return said[-1] if said else log_tail_line(text)


def log_tail_line(text: str, lines: int = 3) -> str:
    """The last ``lines`` non-blank lines of a log's ``text`` as one line."""
    kept = [ln for ln in text.splitlines() if ln.strip()][-lines:]
    return one_line_error("\n".join(kept))


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


#: The largest safetensors header read back (a real checkpoint's is a few KB).
_MAX_HEADER_BYTES = 64 << 20


def _safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file, after checking that every tensor's bytes
    lie inside the file and that the file ends where the last tensor does.

    Layout: ``u64 little-endian N | N bytes of JSON | data``; each entry's
    ``data_offsets = [begin, end]`` counts from the start of the data. Raises
    ValueError naming what is wrong."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{size} bytes, shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, _MAX_HEADER_BYTES):
            raise ValueError(f"header length {n} does not fit in {size} bytes")
        header = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    data = size - 8 - n
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, stop = entry["data_offsets"]
        if not 0 <= begin <= stop <= data:
            raise ValueError(f"tensor {name} lies past the end of the file (truncated?)")
        end = max(end, stop)
    if end != data:
        raise ValueError(f"{data - end} bytes after the last tensor")
    return header


def file_sha256(path: str | os.PathLike[str]) -> str:
    """The SHA-256 of a file's bytes (hex), read in 1 MB pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def checkpoint_problem(meta_path: str | os.PathLike[str]) -> str | None:
    """What makes a checkpoint unusable, or ``None`` when it reads back whole.

    Checks, without loading any tensor: the sidecar parses and names its step; the
    ``.safetensors`` header parses and fits the file (:func:`_safetensors_header`); every
    model tensor the sidecar lists (``shapes``) is there as ``model/<name>`` with that
    shape."""
    meta_path = Path(meta_path)
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        if not isinstance(meta, dict) or "step" not in meta:
            return f"{meta_path.name}: not a checkpoint sidecar"
        header = _safetensors_header(meta_path.with_suffix(".safetensors"))
        want = meta.get("sha256")  # checkpoints written before the checksum have none
        if want is not None and file_sha256(meta_path.with_suffix(".safetensors")) != want:
            return (f"{meta_path.stem}.safetensors: checksum mismatch (its bytes changed "
                    "after it was written)")
        for name, shape in dict(meta.get("shapes", {})).items():
            entry = header.get(f"model/{name}")
            if entry is None:
                return f"{meta_path.stem}.safetensors: tensor model/{name} is missing"
            if list(entry["shape"]) != list(shape):
                return f"{meta_path.stem}.safetensors: tensor model/{name} has the wrong shape"
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        return f"{meta_path.stem}: {e}" if str(e) else f"{meta_path.stem}: unreadable"
    return None




def resume_point(ckpt_dir: str | os.PathLike[str]) -> tuple[Path | None, str | None]:
    """``(sidecar, note)``: the newest checkpoint that reads back whole, and one line to
    log when newer ones were damaged and skipped (else ``None``). ``(None, None)`` when
    there is no checkpoint at all; :class:`~comera_engine.errors.ConfigError` (one line)
    when there are checkpoints and every one is damaged."""
    found = list_checkpoints(ckpt_dir)
    if not found:
        return None, None
    skipped = []
    for _step, meta_path in reversed(found):
        problem = checkpoint_problem(meta_path)
        if problem is None:
            if not skipped:
                return meta_path, None
            return meta_path, (
                f"resume: skipped damaged {'; '.join(skipped)}; resuming from {meta_path.stem}"
            )
        skipped.append(problem)
    raise ConfigError(
        "--resume",
        f"no usable checkpoint in {ckpt_dir} ({'; '.join(skipped)}); "
        "restore one or start the run afresh",
    )
