"""Reading a checkpoint back into a model: the tensors and sidecar of
``checkpoints/step_XXXXXX`` (:func:`load_checkpoint`), the model's part of them
(:func:`model_state`), and a model given the checkpoint's shapes (:func:`resize_to_shapes`)
before ``load_state_dict``.

Below both the trainer (a resume, ``comera_engine.train.checkpoint`` writes them) and the
export (``comera export RUN``), which read checkpoints the same way. Safetensors only (no
pickle).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

__all__ = ["load_checkpoint", "model_state", "resize_to_shapes"]


def load_checkpoint(meta_path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(sidecar dict, tensors)`` of a checkpoint (tensors on the CPU)."""
    meta_path = Path(meta_path)
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    tensors = load_file(str(meta_path.with_suffix(".safetensors")), device="cpu")
    return meta, tensors


def model_state(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model part of a checkpoint's tensors."""
    return {k[len("model/") :]: v for k, v in tensors.items() if k.startswith("model/")}


def resize_to_shapes(model: nn.Module, shapes: dict[str, list[int]]) -> list[str]:
    """Give every parameter/buffer named in ``shapes`` that shape (values are garbage until
    ``load_state_dict``). Parameters keep their identity (only ``.data`` is replaced), as
    in the TT layers' own truncation. Returns the names that changed."""
    changed = []
    with torch.no_grad():
        for name, shape in shapes.items():
            module_name, _, leaf = name.rpartition(".")
            module = model.get_submodule(module_name) if module_name else model
            param = module._parameters.get(leaf)
            if param is not None:
                if list(param.shape) != list(shape):
                    param.data = param.data.new_empty(shape)
                    param.grad = None
                    changed.append(name)
                continue
            buf = module._buffers.get(leaf)
            if buf is not None and list(buf.shape) != list(shape):
                module._buffers[leaf] = buf.new_empty(shape)
                changed.append(name)
    return changed
