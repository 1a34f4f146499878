"""A tried-and-rejected variant of the pace: prune a bond by TT rounding instead of
dropping its least important rank entries.

The pace (:mod:`comera_engine.rank.pace`) decides how many entries each bond loses and
which ones (lowest gate × core importance), then zeroes them. Here the same decision is
taken, and then every bond that shrank from ``r`` to ``c`` entries gets the best rank-``c``
approximation of its two gated cores' product instead (``A = G_k·diag(g_k)`` unfolded
``(p, r)``, ``B = G_{k+1}`` unfolded ``(r, q)``; QR of ``A`` and ``Bᵀ``, an SVD of the
``r × r`` middle, the top ``c`` directions written into the surviving entries' slices,
their gates at the bond's mean live gate). The optimizer state is left as it is.

On SNLI-small (200 steps, seeds 0-2) it ended level with dropping entries, not closer to
fixed ranks (``experiments/results/snli_small_short_budget.json``, variant ``R``).

    python experiments/prune_by_rounding.py train CONFIG [comera train's arguments]
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor, nn

import comera_engine.rank.controller as controller
from comera_engine.layers import tt_layers
from comera_engine.rank import pace

_drop = pace.prune_to


def _round_bond(A: Tensor, B: Tensor, c: int) -> tuple[Tensor, Tensor]:
    """``(A', B')`` with ``A'B'`` the best rank-``c`` approximation of ``A B``
    (``A``: ``(p, r)``, ``B``: ``(r, q)``; ``A'``: ``(p, c)``, ``B'``: ``(c, q)``, zero
    columns/rows past the product's rank)."""
    Qa, Ra = torch.linalg.qr(A)
    Qb, Rb = torch.linalg.qr(B.t())
    U, S, Vh = torch.linalg.svd(Ra @ Rb.t(), full_matrices=False)
    k = min(c, int(S.shape[0]))
    s = S[:k].sqrt()
    A2, B2 = A.new_zeros(A.shape[0], c), B.new_zeros(c, B.shape[1])
    A2[:, :k] = Qa @ (U[:, :k] * s)
    B2[:k] = (s[:, None] * Vh[:k]) @ Qb.t()
    return A2, B2


@torch.no_grad()
def prune_by_rounding(model: nn.Module, goal: float, low: float, extra: float
                      ) -> tuple[float, dict[str, list[tuple[int, int, int]]]]:
    """:func:`comera_engine.rank.pace.prune_to`, then each shrunk bond rounded."""
    layers = list(tt_layers(model))
    before = []
    for _, m in layers:
        cores, gates, _ = m.tt.parts()
        masks = m.tt.masks()
        before.append([(cores[k].clone(), cores[k + 1].clone(), gates[k] * masks[k],
                        masks[k].clone()) for k in range(len(gates))])
    size, changes = _drop(model, goal, low, extra)
    for li, (name, m) in enumerate(layers):
        cores, gates, _ = m.tt.parts()
        masks = m.tt.masks()
        for k, old, new in changes.get(name, []):
            keep = torch.nonzero(masks[k]).flatten()
            if new >= old or keep.numel() != new:
                continue
            L, R, gm, live = before[li][k]
            idx = torch.nonzero(live).flatten()
            A = (L * gm).reshape(-1, L.shape[-1])[:, idx].double()
            B = R.reshape(R.shape[0], -1)[idx].double()
            A2, B2 = _round_bond(A, B, new)
            level = float(gm[keep].abs().mean()) or 1.0
            cores[k].view(-1, cores[k].shape[-1])[:, keep] = (A2 / level).to(L.dtype)
            cores[k + 1].view(cores[k + 1].shape[0], -1)[keep] = B2.to(R.dtype)
            gates[k][keep] = level
    return size, changes


def main(argv: list[str] | None = None) -> int:
    controller.prune_to = prune_by_rounding
    from comera_engine.cli import main as cli

    return cli(argv if argv is not None else sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
