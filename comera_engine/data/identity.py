"""What data a run was trained on: a JSON-serialisable ``identity`` dict saved with the run.

The dict answers "which files, which version, which split" so that two runs can be
compared (same ``fingerprint`` means same data, same split, same preprocessing settings).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

_CHUNK = 1 << 20


def file_sha256(path: str | Path) -> str:
    """Hex SHA-256 of a file's bytes (read in 1 MiB chunks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def content_sha256(*arrays: np.ndarray | torch.Tensor) -> str:
    """Hex SHA-256 over arrays' dtypes, shapes and bytes (for in-memory / generated data)."""
    digest = hashlib.sha256()
    for array in arrays:
        if isinstance(array, torch.Tensor):
            array = array.detach().cpu().contiguous().numpy()
        array = np.ascontiguousarray(array)
        digest.update(f"{array.dtype.str}{array.shape}".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def describe_files(
    paths: Sequence[str | Path], root: str | Path | None = None
) -> list[dict[str, Any]]:
    """One ``{"path", "sha256", "bytes"}`` entry per file (``path`` relative to ``root``)."""
    entries = []
    for path in paths:
        real = Path(path)
        shown = str(real.relative_to(root)) if root is not None else str(real)
        entries.append({"path": shown, "sha256": file_sha256(real), "bytes": real.stat().st_size})
    return entries


def _manifest(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Summary of many file entries: count, total bytes and one digest over all of them."""
    lines = sorted(f"{e['path']}\t{e['sha256']}\t{e['bytes']}" for e in entries)
    return {
        "count": len(entries),
        "total_bytes": int(sum(e["bytes"] for e in entries)),
        "sha256": hashlib.sha256("\n".join(lines).encode()).hexdigest(),
    }


def dataset_identity(
    name: str,
    source: str,
    num_examples: Mapping[str, int],
    seed: int | None,
    files: Sequence[str | Path] = (),
    root: str | Path | None = None,
    params: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
    notes: Mapping[str, Any] | None = None,
    max_listed_files: int = 32,
) -> dict[str, Any]:
    """Build the identity dict of a dataset.

    Args:
        name: registry name, e.g. ``"snli"``.
        source: where it came from: ``"files"``, ``"hub:nyu-mll/glue/mnli"``,
            ``"stdlib"``, ``"synthetic"``, ``"sklearn"``.
        num_examples: examples per split, e.g. ``{"train": 7873, "eval": 1969}``.
        seed: the seed that drove splitting / generation.
        files: data files read; each gets path, sha256 and size. With more than
            ``max_listed_files`` files only a ``files_manifest`` summary is kept.
        root: show file paths relative to this folder (and record it as ``root``).
        params: preprocessing settings that change the data (seq_len, vocab_size, ...).
        extra: other facts about the data (dropped-example counts, content hashes, ...).
        notes: facts about *this build* that do not change the data (whether the
            tokenizer was trained or loaded, where it was saved); not fingerprinted.

    Returns:
        A JSON-serialisable dict with keys ``name, source, seed, num_examples, files`` (or
        ``files_manifest``), ``params``, ``extra``, ``notes`` and ``fingerprint`` (SHA-256
        over all but ``notes`` and ``root``, with files by name and hash, so equal
        fingerprints mean equal data and settings wherever the files live).
    """
    entries = describe_files(files, root)
    identity: dict[str, Any] = {
        "name": name,
        "source": source,
        "seed": seed,
        "num_examples": {str(k): int(v) for k, v in num_examples.items()},
    }
    if root is not None:
        identity["root"] = str(root)
    if len(entries) > max_listed_files:
        identity["files_manifest"] = _manifest(entries)
    else:
        identity["files"] = entries
    identity["params"] = _jsonable(dict(params or {}))
    identity["extra"] = _jsonable(dict(extra or {}))
    identity["notes"] = _jsonable(dict(notes or {}))
    identity["fingerprint"] = _fingerprint(identity)
    return identity


def _fingerprint(identity: Mapping[str, Any]) -> str:
    """SHA-256 of the identity's content, ignoring absolute locations of the files."""
    content = {k: v for k, v in identity.items() if k not in ("fingerprint", "root", "notes")}
    if "files" in content:
        content["files"] = [
            {"name": Path(e["path"]).name, "sha256": e["sha256"], "bytes": e["bytes"]}
            for e in content["files"]
        ]
    text = json.dumps(content, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _jsonable(value: Any) -> Any:
    """Convert numpy scalars / tuples / paths into plain JSON types (recursively)."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    return value
