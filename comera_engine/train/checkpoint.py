"""Checkpoints: ``checkpoints/step_000123.safetensors`` plus a ``step_000123.json`` sidecar.

The safetensors file holds every tensor (model state under ``model/``, AdamW state under
``optim/<param index>/<key>``); the JSON sidecar holds everything else (step, stage,
objective state, RNG states as lists, data position, config, per-layer shapes and ranks,
optimizer hyper-parameters). Both are written to a temporary file, ``fsync``-ed, moved
into place with ``os.replace`` and the folder ``fsync``-ed, tensors first: a sidecar
exists only next to a complete tensor file, even after a power cut. The newest
:data:`DEFAULT_KEEP` checkpoints are kept (``train.keep_checkpoints``), plus the newest
one written at a stage change. A resume takes the newest checkpoint that reads back
whole (:func:`~comera_engine.store.layout.resume_point` checks the sidecar, the
safetensors header against the file size and the model tensors the sidecar lists) and
logs one line for any newer damaged one it skips. Loading uses safetensors only (no
pickle).

TT layers can be physically truncated during training, so a fresh model may have bigger
cores than the checkpoint. :func:`resize_to_shapes` gives every parameter and buffer the
checkpoint's shape before ``load_state_dict``; the TT layers read their ranks from their
core shapes, so they come back at the truncated ranks.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from comera_engine.config import TrainConfig
from comera_engine.metrics import deleted_text

# reading one back into a model: below the trainer and the export, which both do it
from comera_engine.models.checkpoint import load_checkpoint, model_state, resize_to_shapes

# complete checkpoints as (step, sidecar path), oldest first, and the one to resume from;
# torch-free, so the launcher and the supervisor use them too
from comera_engine.store.layout import (
    disk_full_text,
    file_sha256,
    is_disk_full,
    list_checkpoints,
    release_reserve,
    resume_point,
)

__all__ = [
    "DEFAULT_KEEP",
    "checkpoint_paths",
    "failure_text",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "model_state",
    "optimizer_state",
    "resize_to_shapes",
    "resume_point",
    "save_checkpoint",
]

#: Newest checkpoints kept when no ``keep`` is given (the stage checkpoint is kept too):
#: the config's default, ``train.keep_checkpoints``.
DEFAULT_KEEP = TrainConfig.keep_checkpoints


def checkpoint_paths(ckpt_dir: str | Path, step: int) -> tuple[Path, Path]:
    """``(tensors, sidecar)`` paths of the checkpoint after ``step`` steps."""
    base = Path(ckpt_dir) / f"step_{step:06d}"
    return base.with_suffix(".safetensors"), base.with_suffix(".json")


def save_checkpoint(
    ckpt_dir: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    meta: dict[str, Any],
    keep: int = DEFAULT_KEEP,
) -> Path:
    """Write a checkpoint durably (temporary file, ``fsync``, rename, ``fsync`` of the
    folder) and prune all but the ``keep`` newest and the newest stage checkpoint;
    returns the safetensors path."""
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    tensor_path, meta_path = checkpoint_paths(ckpt_dir, step)

    state = model.state_dict()
    tensors: dict[str, torch.Tensor] = {f"model/{k}": v for k, v in state.items()}
    opt = optimizer.state_dict()
    opt_scalars: dict[str, dict[str, Any]] = {}
    for pid, pstate in opt["state"].items():
        for key, value in pstate.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim/{pid}/{key}"] = value
            else:
                opt_scalars.setdefault(str(pid), {})[key] = value
    tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()}

    sidecar = dict(meta)
    sidecar["step"] = int(step)
    sidecar["shapes"] = {k: list(v.shape) for k, v in state.items()}
    sidecar["optimizer"] = {
        "param_groups": [_jsonable(g) for g in opt["param_groups"]],
        "scalars": _jsonable(opt_scalars),
    }

    tmp = tensor_path.with_suffix(".safetensors.tmp")
    tmp_meta = meta_path.with_suffix(".json.tmp")
    try:
        save_file(tensors, str(tmp), metadata={"format": "comera-checkpoint", "step": str(step)})
        sidecar["sha256"] = file_sha256(tmp)  # verified on resume (resume_point)
        _durable_replace(tmp, tensor_path)
        tmp_meta.write_text(json.dumps(sidecar), encoding="utf-8")
        _durable_replace(tmp_meta, meta_path)
    except BaseException:  # a full disk: no half-written file is left behind
        tmp.unlink(missing_ok=True)
        tmp_meta.unlink(missing_ok=True)
        if not meta_path.exists():  # tensors without their sidecar are no checkpoint
            tensor_path.unlink(missing_ok=True)
        raise
    _prune(ckpt_dir, keep, protect=step)
    return tensor_path


def failure_text(exc: BaseException, run_dir: str | Path) -> str:
    """The error a failed run records: ``disk full: free N MB in FOLDER ...`` for a full
    disk (one line, with the fix; the run folder's disk reserve is released first, so
    that this status and the last records can still be written); when the run folder
    itself is gone, that it was deleted while the run trained, whatever the write that
    met it first raised (the metrics log a ``FileNotFoundError``, a checkpoint's
    safetensors file a ``SafetensorError``); else ``Type: message``."""
    if is_disk_full(exc):
        release_reserve(run_dir)
        return disk_full_text(run_dir, exc=exc)
    if not Path(run_dir).exists():
        return f"{type(exc).__name__}: {deleted_text(run_dir)}"
    if isinstance(exc, OSError) and exc.errno == errno.EROFS:
        return (f"run: {run_dir} is read-only; make it writable (chmod u+w {run_dir}, or "
                "remount it), then resume the run")
    return f"{type(exc).__name__}: {exc}"


def _fsync(path: Path, flags: int = os.O_RDONLY) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _durable_replace(tmp: Path, target: Path) -> None:
    """``fsync`` ``tmp``, rename it to ``target`` and ``fsync`` the folder, so that after
    a crash ``target`` is either absent, the old file or the whole new one."""
    _fsync(tmp)
    os.replace(tmp, target)
    _fsync(target.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))


def latest_checkpoint(ckpt_dir: str | Path) -> Path | None:
    """Sidecar path of the newest complete checkpoint (not checked for damage: a resume
    uses :func:`resume_point`), or ``None``."""
    found = list_checkpoints(ckpt_dir)
    return found[-1][1] if found else None








def optimizer_state(
    optimizer: torch.optim.Optimizer, meta: dict[str, Any], tensors: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """Rebuild ``optimizer.state_dict()`` form from a checkpoint (for ``load_state_dict``)."""
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        if key.startswith("optim/"):
            _, pid, name = key.split("/", 2)
            state.setdefault(int(pid), {})[name] = value
    for pid, scalars in meta["optimizer"]["scalars"].items():
        state.setdefault(int(pid), {}).update(scalars)
    groups = meta["optimizer"]["param_groups"]
    current = optimizer.state_dict()["param_groups"]
    if len(groups) != len(current) or any(
        len(a["params"]) != len(b["params"]) for a, b in zip(groups, current)
    ):
        raise ValueError("checkpoint: optimizer parameter groups do not match the model")
    # keep the saved hyper-parameters, but with this optimizer's option types (betas tuple)
    # and its implementation switches: a run saved with CUDA graphs (capturable=True) may
    # resume on a CPU, and a CPU checkpoint may resume into a captured GPU step
    merged = []
    for saved, now in zip(groups, current):
        group = dict(now)
        group.update({k: v for k, v in saved.items()
                      if k in now and k != "params" and k not in _IMPL_OPTIONS})
        if "betas" in group:
            group["betas"] = tuple(group["betas"])
        group["params"] = saved["params"]
        merged.append(group)
    return {"state": state, "param_groups": merged}


_IMPL_OPTIONS = frozenset({"capturable", "foreach", "fused", "differentiable"})


def _is_stage(meta_path: Path) -> bool:
    """Whether a sidecar says it was written at a stage change."""
    try:
        return json.loads(meta_path.read_text(encoding="utf-8")).get("reason") == "stage"
    except (OSError, ValueError, AttributeError):
        return False


def _prune(ckpt_dir: Path, keep: int, protect: int) -> None:
    """Delete all checkpoints but the ``keep`` newest, ``protect`` and the newest stage
    checkpoint (tensor file first, so no sidecar is left without its tensors)."""
    found = list_checkpoints(ckpt_dir)
    old = found[:-keep] if keep > 0 else []
    stage = next((step for step, path in reversed(found) if _is_stage(path)), None)
    for step, meta_path in old:
        if step in (protect, stage):
            continue
        meta_path.with_suffix(".safetensors").unlink(missing_ok=True)
        meta_path.unlink(missing_ok=True)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)
