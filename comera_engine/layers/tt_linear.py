"""``TTLinear``: a drop-in ``nn.Linear`` whose weight lives in gated TT form."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..tensor.contract import explain, tt_linear
from ..tensor.factorize import Factorization, resolve_factors
from ..tensor.tt import TTLinearCores

__all__ = ["TTLinear"]


class TTLinear(nn.Module):
    """``y = x·Wᵀ + b`` with ``W`` (out × in) stored as an order-2d tensor train.

    Args:
        in_features, out_features: as ``nn.Linear``.
        rank: TT rank (scalar, clamped per bond to the maximal TT rank) or the ``2d-1``
            internal ranks.
        in_factors, out_factors: explicit factorisations (products may exceed the
            features: inputs are zero-padded, extra outputs dropped); chosen by
            :func:`~comera_engine.tensor.factorize.factorize` when omitted.
        d: number of factors per side when factors are chosen automatically (default 3).
        tau: rank-gate threshold.
        path: force a contraction path (``halves``/``sweep``/``dense``); default: planner.

    Initialisation matches ``nn.Linear``: the reconstructed weight has variance
    ``1/(3·in_features)`` and the bias is ``U(±1/sqrt(in_features))``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        rank: int | Sequence[int] = 8,
        in_factors: Sequence[int] | None = None,
        out_factors: Sequence[int] | None = None,
        bias: bool = True,
        d: int | None = None,
        tau: float = 1e-2,
        path: str | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        for name, v in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: must be a positive integer, got {v!r}")
        self.in_features, self.out_features = in_features, out_features
        if d is None and in_factors is not None:
            d = len(in_factors)
        if d is None and out_factors is not None:
            d = len(out_factors)
        fin = resolve_factors(in_features, in_factors, d, "in_factors")
        fout = resolve_factors(out_features, out_factors, len(fin.factors), "out_factors")
        if out_factors is None:  # mirror the input side: [12,8,8 | 8,8,12] as in the paper
            fout = Factorization(out_features, tuple(sorted(fout.factors)))
        self.path = path
        self.tt = TTLinearCores(fin.factors, fout.factors, rank, tau=tau,
                                init_var=1.0 / (3 * in_features), dtype=dtype, device=device)
        if bias:
            bound = 1.0 / math.sqrt(in_features)
            self.bias = nn.Parameter(
                torch.empty(out_features, dtype=dtype, device=device).uniform_(-bound, bound))
        else:
            self.register_parameter("bias", None)

    @property
    def in_factors(self) -> tuple[int, ...]:
        return self.tt.in_factors

    @property
    def out_factors(self) -> tuple[int, ...]:
        return self.tt.out_factors

    def forward(self, x: Tensor) -> Tensor:
        N, M = self.tt.shape
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x: last dimension {x.shape[-1]} != in_features "
                             f"{self.in_features}")
        if N != self.in_features:
            x = F.pad(x, (0, N - self.in_features))
        bias = self.bias
        if bias is not None and M != self.out_features:
            bias = F.pad(bias, (0, M - self.out_features))
        tt = self.tt
        cores, gates, alive = tt.parts()
        y = tt_linear(x, cores, tt.d, self.path, bias=bias, gates=gates, tau=tt.tau,
                      alive=alive)
        if M != self.out_features:
            y = y[..., : self.out_features]
        return y

    def dense_weight(self) -> Tensor:
        """The reconstructed weight, ``nn.Linear`` layout ``(out_features, in_features)``."""
        return self.tt.to_matrix()[: self.in_features, : self.out_features].t()

    def effective_ranks(self) -> list[int]:
        return self.tt.effective_ranks()

    def num_params(self, effective: bool = True) -> int:
        """Core parameters (effective or allocated) plus the bias."""
        b = self.bias.numel() if self.bias is not None else 0
        return self.tt.num_params(effective) + b

    def dense_num_params(self) -> int:
        b = self.bias.numel() if self.bias is not None else 0
        return self.in_features * self.out_features + b

    def explain(self, batch: int, training: bool = True) -> dict:
        """The planner's view of this layer at ``batch`` rows (effective ranks)."""
        ranks = [1, *self.effective_ranks(), 1]
        p = self.tt.cores[0]
        return explain(batch, self.in_factors, self.out_factors, ranks, p.device, p.dtype,
                       training)

    @classmethod
    def from_linear(cls, linear: nn.Linear, rank: int | Sequence[int] | None = None,
                    tol: float | None = None, **kw) -> TTLinear:
        """TT-SVD of a trained ``nn.Linear`` (rank cap and/or relative tolerance)."""
        layer = cls(linear.in_features, linear.out_features, rank=rank or 1,
                    bias=linear.bias is not None, dtype=linear.weight.dtype,
                    device=linear.weight.device, **kw)
        src = TTLinearCores.from_matrix(linear.weight.detach().t(), layer.in_factors,
                                        layer.out_factors, max_rank=rank, tol=tol,
                                        tau=layer.tt.tau)
        layer.tt.load_cores_([c.detach() for c in src.cores])
        if linear.bias is not None:
            with torch.no_grad():
                layer.bias.copy_(linear.bias)
        return layer

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"factors={list(self.in_factors)}|{list(self.out_factors)}, "
                f"ranks={self.tt.ranks}, bias={self.bias is not None}")
