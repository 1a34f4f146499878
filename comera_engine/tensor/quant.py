"""Symmetric int8 rounding, the one rule both the int8 export
(:mod:`comera_engine.export.quant`) and the "CoMERA + int8" runs
(:mod:`comera_engine.train.shrink`) use: ``w ≈ q · s`` with ``q`` in ``[-127, 127]`` and
``s = max|w| / 127`` per tensor, or per row (dim 0)."""

from __future__ import annotations

import torch

__all__ = ["QMAX", "int8_bytes", "int8_round_trip", "int8_scale", "to_int8"]

QMAX = 127


def int8_scale(w: torch.Tensor, per_row: bool) -> torch.Tensor:
    """``max|w| / 127`` per row (shape ``(rows,)``) or for the whole tensor (shape
    ``()``); 1 where that is 0 (q = 0 whatever the scale)."""
    a = w.detach().abs().float()
    if a.numel() == 0:
        return torch.ones(a.shape[0]) if per_row else torch.ones(())
    peak = a.reshape(a.shape[0], -1).amax(1) if per_row else a.max()
    return torch.where(peak > 0, peak / QMAX, torch.ones_like(peak))


def _expand(scale: torch.Tensor, dim: int) -> torch.Tensor:
    return scale.reshape(-1, *([1] * (dim - 1))) if scale.dim() else scale


def to_int8(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``round(w / s)`` clamped to ``[-127, 127]``, as int8."""
    return torch.round(w.detach().float() / _expand(scale, w.dim())).clamp_(
        -QMAX, QMAX).to(torch.int8)


def int8_round_trip(w: torch.Tensor, per_row: bool) -> torch.Tensor:
    """``q · s``: ``w`` as int8 storage gives it back (float32)."""
    scale = int8_scale(w, per_row)
    return to_int8(w, scale).float() * _expand(scale, w.dim())


def int8_bytes(w: torch.Tensor, per_row: bool) -> int:
    """Bytes of ``w`` stored in int8 with its float32 scales."""
    return int(w.numel()) + 4 * (int(w.shape[0]) if per_row and w.dim() else 1)
