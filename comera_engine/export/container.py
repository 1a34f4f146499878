"""The safetensors container, read defensively, and atomic writes.

``read_header`` parses and checks a safetensors header *before* any tensor is read: the
8-byte length, the JSON header (an object of tensor entries plus ``__metadata__``), each
entry's dtype, shape and byte range (in bounds, the right length, contiguous, covering
the data exactly). Files that are not safetensors at all (pickles, ``torch.save`` zip
archives, ONNX protobufs, random bytes) are recognised from their first bytes and
refused with a message that says what they look like. Nothing in a file is ever
executed: there is no pickle anywhere on this path.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from comera_engine.config import loads_json
from comera_engine.errors import ConfigError

#: Export formats (``comera export --format``).
FORMATS = ("compressed", "dense", "onnx")

__all__ = [
    "BadExportFile",
    "DTYPE_SIZES",
    "Header",
    "TensorEntry",
    "atomic_write",
    "read_header",
    "read_comera_metadata",
]

#: Largest JSON header accepted (the safetensors library uses the same bound).
MAX_HEADER_BYTES = 100 * 1024 * 1024
#: Tensor entries a header may list (a CoMERA export of the paper's model has under 1,000).
MAX_TENSORS = 65_536
#: Key of the CoMERA JSON document inside the safetensors ``__metadata__``.
METADATA_KEY = "comera"

DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip


class BadExportFile(ConfigError):
    """A file that cannot be loaded: not safetensors, corrupt, truncated, or whose
    metadata disagrees with its tensors. The message starts with the file's path."""

    def __init__(self, path: str | os.PathLike[str], problem: str) -> None:
        super().__init__(str(path), problem)


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Header:
    """A checked safetensors header."""

    path: Path
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]
    header_bytes: int  # 8 + JSON length
    data_bytes: int
    file_bytes: int


def _sniff(head: bytes) -> str | None:
    """What a non-safetensors file looks like, from its first (nine) bytes. A safetensors
    header of 640 bytes starts ``80 02 00 00 00 00 00 00 7b`` as a pickle starts
    ``80 02``: a length field whose high bytes are 0 followed by the JSON's ``{`` is read
    as safetensors (its header is then parsed as JSON, never unpickled)."""
    if head[:4] == b"PK\x03\x04":
        return ("a zip archive (torch.save checkpoints are zip files of pickles); "
                "only safetensors files are read and pickles are never loaded")
    if (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")
            and head[4:9] != b"\x00\x00\x00\x00{"):
        return "a Python pickle; refusing it (pickles can run code and are never loaded)"
    return None


def read_header(path: str | os.PathLike[str]) -> Header:
    """Parse and validate the header of a safetensors file (no tensor data is read).

    Raises:
        BadExportFile: missing file, not safetensors, truncated, or an inconsistent
            header. The message names the file and the problem.
    """
    path = Path(path)
    if not path.exists():
        raise BadExportFile(path, "file not found")
    if not path.is_file():
        raise BadExportFile(path, "not a file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(9)
        if len(head) < 8:
            raise BadExportFile(path, f"too short to be a safetensors file ({size} bytes)")
        what = _sniff(head)
        if what is not None:
            raise BadExportFile(path, f"not a safetensors file: it is {what}")
        (n,) = struct.unpack("<Q", head[:8])
        if n > MAX_HEADER_BYTES:
            hint = " (is this an ONNX file? load .onnx exports with onnxruntime)" if (
                path.suffix == ".onnx") else ""
            raise BadExportFile(
                path, f"not a safetensors file: declared header length {n} bytes exceeds "
                f"the {MAX_HEADER_BYTES}-byte limit{hint}")
        if 8 + n > size:
            raise BadExportFile(
                path, f"truncated or not a safetensors file: header declares {n} bytes but "
                f"the file has only {size - 8} after the length")
        f.seek(8)
        raw = f.read(n)
    if raw.count(b'"data_offsets"') > MAX_TENSORS:  # before parsing: a cheap byte count
        raise _too_many(path, raw.count(b'"data_offsets"'))
    try:
        text = raw.decode("utf-8")
        header = loads_json(text)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise BadExportFile(path, "not a safetensors file: header is not valid JSON") from None
    if not isinstance(header, dict):
        raise BadExportFile(path, f"safetensors header must be a JSON object, got "
                                  f"{type(header).__name__}")
    if sum(1 for k in header if k != "__metadata__") > MAX_TENSORS:
        raise _too_many(path, len(header))
    data_bytes = size - 8 - n
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise BadExportFile(path, "safetensors __metadata__ must map strings to strings")
    tensors: dict[str, TensorEntry] = {}
    for name, entry in header.items():
        tensors[name] = _entry(path, name, entry, data_bytes)
    spans = sorted((e.begin, e.end, k) for k, e in tensors.items())
    pos = 0
    for begin, end, name in spans:
        if begin != pos:
            raise BadExportFile(
                path, f"tensor {name!r}: data starts at byte {begin}, expected {pos} "
                "(overlapping or gapped tensors)")
        pos = end
    if pos != data_bytes:
        raise BadExportFile(
            path, f"tensor data is {pos} bytes but the file holds {data_bytes} after the "
            "header (truncated or padded file)")
    return Header(path, tensors, dict(meta), 8 + n, data_bytes, size)


def _too_many(path: Path, n: int) -> BadExportFile:
    return BadExportFile(path, f"the header lists about {n:,} tensors, more than the "
                               f"{MAX_TENSORS:,} any model file here has")


def _entry(path: Path, name: str, entry: Any, data_bytes: int) -> TensorEntry:
    if not isinstance(entry, dict):
        raise BadExportFile(path, f"tensor {name!r}: header entry is not an object")
    dtype, shape, offs = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_SIZES:
        raise BadExportFile(path, f"tensor {name!r}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape
    ):
        raise BadExportFile(path, f"tensor {name!r}: shape must be a list of integers >= 0, "
                                  f"got {shape!r}")
    if (not isinstance(offs, list) or len(offs) != 2 or not all(
            isinstance(o, int) and not isinstance(o, bool) for o in offs)):
        raise BadExportFile(path, f"tensor {name!r}: data_offsets must be [begin, end]")
    begin, end = offs
    if not 0 <= begin <= end <= data_bytes:
        raise BadExportFile(
            path, f"tensor {name!r}: bytes [{begin}, {end}) lie outside the {data_bytes} "
            "bytes of data (truncated file?)")
    want = math.prod(shape) * DTYPE_SIZES[dtype]
    if end - begin != want:
        raise BadExportFile(
            path, f"tensor {name!r}: {end - begin} bytes stored but shape {shape} of "
            f"{dtype} needs {want}")
    return TensorEntry(dtype, tuple(shape), begin, end)


def read_comera_metadata(header: Header) -> dict[str, Any]:
    """The CoMERA JSON document of an export or checkpoint (must be a JSON object)."""
    raw = header.metadata.get(METADATA_KEY)
    if raw is None:
        n = len(header.metadata)  # the file's own keys are not echoed
        raise BadExportFile(
            header.path, f"not a CoMERA export: no '{METADATA_KEY}' entry in the safetensors "
            f"metadata ({n} other entr{'y' if n == 1 else 'ies'})")
    try:
        doc = loads_json(raw)
    except (ValueError, RecursionError):
        raise BadExportFile(header.path, f"metadata '{METADATA_KEY}' is not valid JSON") from None
    if not isinstance(doc, dict):
        raise BadExportFile(
            header.path, f"metadata '{METADATA_KEY}' must be a JSON object, got "
            f"{type(doc).__name__}")
    return doc


@contextmanager
def atomic_write(target: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside ``target``; on success it replaces ``target``
    (``os.replace``), on any error it is removed, so no half-written file remains."""
    target = Path(target)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()


def _default_mode() -> int:
    """``0o666`` minus the umask (read without changing it, where the OS allows)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o644


def write_atomic(target: str | os.PathLike[str], writer: Callable[[Path], None]) -> Path:
    """``writer(tmp_path)`` then move into place atomically; returns ``target``. The file
    gets the usual permissions (safetensors itself creates files as 0600)."""
    with atomic_write(target) as tmp:
        writer(tmp)
        os.chmod(tmp, _default_mode())
    return Path(target)
