"""Gate balancing: the scale of every rank entry lives in its gate (``comera.balance``).

A rank gate and the two core slices it multiplies are a product: for bond ``k`` between
cores ``G_k`` and ``G_{k+1}`` and entry ``j``,

    G_k[..., j] · g_k[j] · G_{k+1}[j, ...]

is unchanged by ``G_k[..., j] *= a``, ``G_{k+1}[j, ...] *= b``, ``g_k[j] /= a·b``. The size
objective penalises ``|g|`` only, so training can shrink a gate while its slices grow
back: the surrogate falls and no entry ever reaches the threshold ``tau``
(docs/METHODS.md, "Schedules"). Balancing removes that way out: every ``every`` steps each
live slice is brought back to the norm its entries had at initialisation and its gate
takes the factor, so the gates carry the whole scale of every entry and the penalty acts
on what the entry contributes. The network's function is unchanged (up to
rounding); the AdamW moments of the rescaled tensors are left as they are (the factors
are close to 1 once the slices are balanced).

    balance_gates(layers)             # after optimizer.step(), before the gate refresh
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

__all__ = ["balance_gates"]


def _factor(norms: Tensor, live: Tensor, target: float) -> Tensor:
    """Per entry, the factor that brings its slice's norm to ``target`` (1 for dead or
    zero slices)."""
    on = live & (norms > 0)
    return torch.where(on, target / norms.clamp_min(torch.finfo(norms.dtype).tiny), 1.0)


@torch.no_grad()
def balance_gates(layers: Iterable[nn.Module]) -> None:
    """Move each live rank entry's scale from its two core slices into its gate, bond by
    bond, in every TT layer of ``layers`` (module doc): each slice is brought to the
    norm its entries had at initialisation (``tt.init_std`` per entry) and the gate takes
    the factors. Shapes: core ``G_k`` ``(r_{k-1}, *modes_k, r_k)``, gate ``g_k``
    ``(r_k,)``."""
    for m in layers:
        tt = m.tt
        std = float(getattr(tt, "init_std", 0.0))
        if std <= 0.0:
            continue
        cores, gates, alive = tt.parts()
        for k, g in enumerate(gates):
            left, right = cores[k], cores[k + 1]
            live = alive[k] & (g != 0)
            n_left = left.numel() // left.shape[-1]
            n_right = right.numel() // right.shape[0]
            a = _factor(left.reshape(-1, left.shape[-1]).norm(dim=0), live, std * n_left ** 0.5)
            b = _factor(right.reshape(right.shape[0], -1).norm(dim=1), live,
                        std * n_right ** 0.5)
            left.mul_(a)
            right.mul_(b.view(-1, *([1] * (right.dim() - 1))))
            g.div_(a * b)
        _even_out(gates, alive)


def _even_out(gates: list[Tensor], alive: list[Tensor]) -> None:
    """Give every bond of a layer the same mean live ``|g|`` (their geometric mean): the
    layer is multilinear in its gate vectors, so scaling bond ``k`` by ``c_k`` with
    ``∏ c_k = 1`` leaves it unchanged, and one threshold means the same on every bond."""
    means = []
    for g, a in zip(gates, alive):
        live = a & (g != 0)
        means.append(torch.where(live, g.abs(), 0.0).sum() / live.sum().clamp_min(1))
    if len(means) < 2:
        return
    m = torch.stack(means)
    if bool((m <= 0).any()):
        return
    scale = torch.exp(torch.log(m).mean()) / m
    for g, c in zip(gates, scale):
        g.mul_(c)
