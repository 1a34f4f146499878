"""``TTLinear``: a drop-in ``nn.Linear`` whose weight lives in gated TT form."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import LINEAR_LAYOUTS  # "tt" (the paper's order-2d train) | "ttm" (TT matrix)
from ..tensor.contract import explain, tt_linear
from ..tensor.costs import OPS
from ..tensor.factorize import Factorization, resolve_factors
from ..tensor.planner import compute_dtype, explain_ttm, in_graph, plan_case, ttm_linear
from ..tensor.tt import TTLinearCores, TTMCores

__all__ = ["LINEAR_LAYOUTS", "TTLinear", "linear_factors"]


def linear_factors(in_features: int, out_features: int, in_factors: Sequence[int] | None,
                   out_factors: Sequence[int] | None, d: int | None
                   ) -> tuple[Factorization, Factorization]:
    """The input and output factorisations of a TT linear: ``d`` factors a side, else as
    many as the factors given; an output side not given mirrors the input's
    (``[12,8,8 | 8,8,12]`` as in the paper)."""
    if d is None and in_factors is not None:
        d = len(in_factors)
    if d is None and out_factors is not None:
        d = len(out_factors)
    fin = resolve_factors(in_features, in_factors, d, "in_factors")
    fout = resolve_factors(out_features, out_factors, len(fin.factors), "out_factors")
    if out_factors is None:
        fout = Factorization(out_features, tuple(sorted(fout.factors)))
    return fin, fout



class TTLinear(nn.Module):
    """``y = x·Wᵀ + b`` with ``W`` (out × in) stored as a gated tensor train.

    Two layouts of the cores (``layout``):

    * ``"tt"`` (default, the CoMERA paper's): an order-2d train, the ``d`` input factors
      then the ``d`` output factors, cores ``(r_{k-1}, s_k, r_k)``. The matrix rank of
      ``W`` is at most the middle rank ``r_d``; the planner's halves / sweep paths
      contract ``x`` with the cores and save MACs against a dense layer.
    * ``"ttm"``: a TT matrix (tensorly-torch's ``blocktt``), ``d`` cores
      ``(r_{k-1}, n_k, m_k, r_k)`` each pairing one input and one output factor
      (:class:`~comera_engine.tensor.tt.TTMCores`, the same gates, pruning and
      truncation). Its paths: ``dense`` materialises ``W`` from the gated cores (about
      ``N·M·r_{d-1}`` MACs per step, batch independent: small against the batch's
      ``B·N·M``) and runs one GEMM, computing like ``nn.Linear``; ``sweep`` contracts
      ``x`` with one core at a time (:mod:`comera_engine.ops.ttm_linear`: fewer MACs
      only at small batches or ranks). It saves parameters more than MACs, and its
      matrix rank is not capped by one bond.

    Args:
        in_features, out_features: as ``nn.Linear``.
        rank: TT rank (scalar, clamped per bond to the maximal TT rank) or the ``2d-1``
            internal ranks.
        in_factors, out_factors: explicit factorisations (products may exceed the
            features: inputs are zero-padded, extra outputs dropped); chosen by
            :func:`~comera_engine.tensor.factorize.factorize` when omitted.
        d: number of factors per side when factors are chosen automatically (default 3).
        tau: rank-gate threshold.
        path: force a contraction path (``"tt"``: ``halves``/``sweep``/``dense``/
            ``fused``; ``"ttm"``: ``dense``/``sweep``); default: the planner's choice
            (:func:`comera_engine.tensor.planner.choose`).
        layout: ``"tt"`` or ``"ttm"`` (above); ``"ttm"`` needs as many input as output
            factors (``d`` each).

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
        layout: str = "tt",
    ) -> None:
        super().__init__()
        if layout not in LINEAR_LAYOUTS:
            raise ValueError(f"layout: must be one of {', '.join(LINEAR_LAYOUTS)}, "
                             f"got {layout!r}")
        paths = OPS["ttm_linear" if layout == "ttm" else "tt_linear"]
        if path is not None and path not in paths:
            raise ValueError(f"path: a {layout} layer's paths are {', '.join(paths)}; "
                             f"got {path!r}")
        for name, v in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: must be a positive integer, got {v!r}")
        self.in_features, self.out_features = in_features, out_features
        fin, fout = linear_factors(in_features, out_features, in_factors, out_factors, d)
        self.path = path
        self.layout = layout
        cls = TTMCores if layout == "ttm" else TTLinearCores
        self.tt: TTLinearCores | TTMCores = cls(
            fin.factors, fout.factors, rank, tau=tau, init_var=1.0 / (3 * in_features),
            dtype=dtype, device=device)
        if bias:
            bound = 1.0 / math.sqrt(in_features)
            self.bias = nn.Parameter(
                torch.empty(out_features, dtype=dtype, device=device).uniform_(-bound, bound))
        else:
            self.register_parameter("bias", None)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise afresh, as a new layer is (cores, gates 1, the bias as
        ``nn.Linear``'s): for a model built on the ``meta`` device, after ``to_empty``."""
        self.tt.reset_parameters()
        if self.bias is not None and not self.bias.is_meta:
            bound = 1.0 / math.sqrt(self.in_features)
            self.bias.uniform_(-bound, bound)

    @property
    def in_factors(self) -> tuple[int, ...]:
        tt = self.tt
        return tt.row_factors if isinstance(tt, TTMCores) else tt.in_factors

    @property
    def out_factors(self) -> tuple[int, ...]:
        tt = self.tt
        return tt.col_factors if isinstance(tt, TTMCores) else tt.out_factors

    def forward(self, x: Tensor) -> Tensor:
        N, M = self.tt.shape
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x: last dimension {x.shape[-1]} != in_features "
                             f"{self.in_features}")
        if self.layout == "ttm":
            cores, gates, alive = self.tt.parts()
            return ttm_linear(x, cores, self._ttm_path(x), self.bias, gates, alive,
                              self.tt.tau, self.out_features)
        if N != self.in_features:
            x = F.pad(x, (0, N - self.in_features))
        bias = self.bias
        if bias is not None and M != self.out_features:
            bias = F.pad(bias, (0, M - self.out_features))
        tt = self.tt
        cores, gate, alive = tt.flat_parts()  # one gate vector: its gradient in one piece
        y = tt_linear(x, cores, tt.d, self.path, bias=bias, gates=gate, tau=tt.tau,
                      alive=alive)
        if M != self.out_features:
            y = y[..., : self.out_features]
        return y

    def _ttm_path(self, x: Tensor) -> str:
        """The ``"ttm"`` layout's path for ``x``: as forced, else the planner's."""
        if self.path is not None:
            return self.path
        tt = self.tt
        training = torch.is_grad_enabled() and (
            x.requires_grad or any(c.requires_grad for c in tt.cores))
        rows = x.numel() // max(1, x.shape[-1])
        return plan_case("ttm_linear", self.in_factors, self.out_factors, tt.ranks, rows,
                         x.device, compute_dtype(x), in_graph(x), training, x.requires_grad)

    def dense_weight(self) -> Tensor:
        """The reconstructed weight, ``nn.Linear`` layout ``(out_features, in_features)``."""
        return self.tt.to_matrix()[: self.in_features, : self.out_features].t()

    @property
    def weight(self) -> Tensor:
        """:meth:`dense_weight`, rebuilt from the gated cores at each read (differentiable
        in them), for code that reads an ``nn.Linear``'s weight instead of calling it:
        ``nn.MultiheadAttention`` reads its ``out_proj.weight``, torch's transformer
        fast paths their linears'. Read-only: the parameters are the cores."""
        return self.dense_weight()

    def effective_ranks(self) -> list[int]:
        return self.tt.effective_ranks()

    def num_params(self, effective: bool = True) -> int:
        """Core parameters (effective or allocated) plus the bias."""
        b = self.bias.numel() if self.bias is not None else 0
        return self.tt.num_params(effective) + b

    def dense_num_params(self) -> int:
        b = self.bias.numel() if self.bias is not None else 0
        return self.in_features * self.out_features + b

    def explain(self, batch: int, training: bool = True, graph: bool = False,
                dtype: torch.dtype | None = None) -> dict:
        """The planner's view of this layer at ``batch`` rows (effective ranks), in
        ``dtype`` (default: the cores') and inside a CUDA graph or not: the path it picks,
        where the times came from, each path's cost (:func:`~comera_engine.tensor.explain`,
        :func:`~comera_engine.tensor.explain_ttm` for the ``"ttm"`` layout)."""
        ranks = [1, *self.effective_ranks(), 1]
        p = self.tt.cores[0]
        fn = explain_ttm if self.layout == "ttm" else explain
        return fn(batch, self.in_factors, self.out_factors, ranks, p.device, dtype or p.dtype,
                  training, graph)

    @classmethod
    def from_linear(cls, linear: nn.Linear, rank: int | Sequence[int] | None = None,
                    tol: float | None = None, **kw) -> TTLinear:
        """TT-SVD of a trained ``nn.Linear`` (rank cap and/or relative tolerance), in
        the layout ``layout`` (a keyword, default ``"tt"``)."""
        layer = cls(linear.in_features, linear.out_features, rank=rank or 1,
                    bias=linear.bias is not None, dtype=linear.weight.dtype,
                    device=linear.weight.device, **kw)
        layer.tt.load_cores_(layer.svd_cores(linear.weight.detach().t(), rank, tol))
        if linear.bias is not None:
            with torch.no_grad():
                layer.bias.copy_(linear.bias)
        return layer

    def svd_cores(self, W: Tensor, max_rank: int | Sequence[int] | None = None,
                  tol: float | None = None) -> list:
        """TT-SVD cores of a weight ``W`` ``(in_features, out_features)`` (as the cores
        hold it: inputs × outputs) in this layer's layout and factors, zero-padded to the
        factor products (a rank cap and/or relative tolerance)."""
        if self.layout == "ttm":
            N, M = self.tt.shape
            if tuple(W.shape) != (self.in_features, self.out_features):
                raise ValueError(f"W: shape {tuple(W.shape)}, expected "
                                 f"{(self.in_features, self.out_features)}")
            W = F.pad(W, (0, M - W.shape[1], 0, N - W.shape[0]))
            return TTMCores._svd_cores(W, self.in_factors, self.out_factors, max_rank, tol)
        return TTLinearCores._svd_cores(W, self.in_factors, self.out_factors, max_rank, tol)

    def extra_repr(self) -> str:
        lay = ", layout=ttm" if self.layout == "ttm" else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"factors={list(self.in_factors)}|{list(self.out_factors)}, "
                f"ranks={self.tt.ranks}, bias={self.bias is not None}{lay}")
