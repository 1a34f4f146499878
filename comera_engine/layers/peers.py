"""Peer TT layers from tensorly-torch (``tltorch``): the TT-matrix ("BlockTT") linear and
embedding layers a CoMERA run is compared against (``model.tt_impl = "tltorch"``,
docs/METHODS.md).

:class:`TLTorchLinear` and :class:`TLTorchEmbedding` are drop-ins for ``nn.Linear`` /
``nn.Embedding`` (the same call signatures as :class:`TTLinear` / :class:`TTEmbedding`)
that hold a ``tltorch.FactorizedLinear`` / ``tltorch.FactorizedEmbedding`` with
``factorization="blocktt"``: ``d`` cores ``(r_{k-1}, a_k, b_k, r_k)``, one per pair of
row and column factors (Novikov et al.'s TT layer; tltorch contracts the input with the
cores, ``implementation="factorized"``). No rank gates: the ranks are fixed when the
layer is built (or set once by :meth:`set_ranks_`, before training).

What is the same as the engine's layers, so that the comparison is about the format and
its implementation only: the factors (chosen by
:func:`~comera_engine.tensor.factorize.resolve_factors`, padding allowed: inputs are
zero-padded, extra outputs and rows dropped), the initial distribution (cores i.i.d.
normal so that the reconstructed weight has the variance of ``TTLinear``'s, i.e.
``nn.Linear``'s, and the table that of ``nn.Embedding``), the bias (``nn.Linear``'s) and
the size accounting (``num_params`` / ``dense_num_params``, counted by
:func:`~comera_engine.layers.size_report` as tensorized layers).

``tltorch`` is an optional dependency (the ``peers`` extra): building a layer without it
raises a ``ConfigError`` naming ``model.tt_impl``. Importing tltorch switches tensorly's
global backend to PyTorch (tltorch computes with it); the engine's own TT-SVD pins
NumPy for its call (:func:`comera_engine.tensor.tt.tt_svd`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import ConfigError
from ..tensor.tt import max_tt_ranks, scaled_isometry
from .tt_embedding import embedding_factors
from .tt_linear import linear_factors

__all__ = ["PEER_LAYERS", "TLTorchEmbedding", "TLTorchLinear", "peer_layers", "require_tltorch"]


def require_tltorch() -> Any:
    """The ``tltorch`` module, or a ConfigError naming ``model.tt_impl`` and the fix."""
    try:
        import tltorch
    except ImportError as exc:
        raise ConfigError(
            "model.tt_impl",
            f'"tltorch" needs tensorly-torch, which is not installed ({exc}); install it '
            "with `pip install tensorly-torch` (or the `peers` extra: "
            "`pip install -e '.[peers]'`), or use the engine's layers (model.tt_impl = "
            '"comera")') from None
    return tltorch


def _resolve_ranks(rank: int | Sequence[int], mode_sizes: Sequence[int]) -> list[int]:
    """Internal ranks from a scalar (clamped to the full TT ranks) or a list."""
    caps = max_tt_ranks(mode_sizes)
    if isinstance(rank, int):
        if rank < 1:
            raise ValueError(f"rank: must be a positive integer, got {rank}")
        return [min(rank, c) for c in caps]
    ranks = [int(r) for r in rank]
    if len(ranks) != len(caps) or any(not 1 <= r <= c for r, c in zip(ranks, caps)):
        raise ValueError(f"rank: need {len(caps)} internal ranks within {caps}, got {ranks}")
    return ranks


class _BlockTTLayer(nn.Module):
    """What both peer layers share: the tltorch module in ``self.layer``, its cores,
    ranks, size and the rank/initialisation helpers."""

    layer: nn.Module

    def factors(self) -> list[nn.Parameter]:
        """The TT-matrix cores ``(r_{k-1}, a_k, b_k, r_k)``."""
        return list(self.layer.weight.factors)

    @property
    def mode_sizes(self) -> list[int]:
        """``a_k · b_k`` per core (what the size and the full ranks count)."""
        return [int(f.shape[1] * f.shape[2]) for f in self.factors()]

    def effective_ranks(self) -> list[int]:
        """The internal ranks (fixed: every rank is effective)."""
        return [int(f.shape[-1]) for f in self.factors()[:-1]]

    def _factor_params(self) -> int:
        return sum(f.numel() for f in self.factors())

    @torch.no_grad()
    def _init_cores(self, var: float) -> None:
        """Cores :func:`~comera_engine.tensor.tt.scaled_isometry` at the entry scale
        ``σ = (var / ∏ r_k)^(1/(2d))``: the entries of the reconstructed matrix then have
        variance ``var``, the engine's TT layers' init (every TT method starts alike)."""
        factors = self.factors()
        std = (var / max(1, math.prod(self.effective_ranks()))) ** (1.0 / (2 * len(factors)))
        for f in factors:
            f.copy_(scaled_isometry(f.shape, std, f.dtype, f.device))

    @torch.no_grad()
    def set_ranks_(self, ranks: Sequence[int]) -> None:
        """Slice every bond to the first ``ranks[k]`` entries (each at most its current
        rank), scaling the left core by ``sqrt(old/new)`` so that the reconstructed
        entries keep their variance: a layer at the planned ranks with the layer's own
        initial distribution."""
        factors = self.factors()
        ranks = [int(r) for r in ranks]
        old = self.effective_ranks()
        if len(ranks) != len(old) or any(not 1 <= r <= o for r, o in zip(ranks, old)):
            raise ValueError(f"ranks: need {len(old)} ranks within {old}, got {ranks}")
        for k, (r, o) in enumerate(zip(ranks, old)):
            if r == o:
                continue
            left, right = factors[k], factors[k + 1]
            left.data = (left.data[..., :r] * math.sqrt(o / r)).contiguous()
            right.data = right.data[:r].contiguous()
        full = [1, *ranks, 1]
        self.layer.weight.rank = full
        self.layer.rank = full


class TLTorchLinear(_BlockTTLayer):
    """``y = x·Wᵀ + b`` with ``W`` a tltorch TT-matrix (``FactorizedLinear``, BlockTT).

    Args: as :class:`~comera_engine.layers.TTLinear` (``rank``: a scalar, clamped per
    bond to the full TT rank, or the ``d-1`` internal ranks).
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
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        tltorch = require_tltorch()
        self.in_features, self.out_features = int(in_features), int(out_features)
        fin, fout = linear_factors(in_features, out_features, in_factors, out_factors, d)
        self.in_factors, self.out_factors = tuple(fin.factors), tuple(fout.factors)
        self.shape = (math.prod(self.in_factors), math.prod(self.out_factors))
        modes = [a * b for a, b in zip(self.out_factors, self.in_factors)]
        ranks = _resolve_ranks(rank, modes)
        self.layer = tltorch.FactorizedLinear(
            self.in_factors, self.out_factors, bias=False, factorization="blocktt",
            rank=[1, *ranks, 1], implementation="factorized", device=device, dtype=dtype)
        self._init_cores(1.0 / (3 * self.in_features))  # TTLinear's (nn.Linear's) variance
        if bias:
            bound = 1.0 / math.sqrt(self.in_features)
            self.bias = nn.Parameter(torch.empty(self.out_features, dtype=dtype, device=device)
                                     .uniform_(-bound, bound))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x: last dimension {x.shape[-1]} != in_features "
                             f"{self.in_features}")
        N, M = self.shape
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)
        if N != self.in_features:
            flat = F.pad(flat, (0, N - self.in_features))
        y = self.layer(flat)
        if M != self.out_features:
            y = y[:, : self.out_features]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def dense_weight(self) -> Tensor:
        """The reconstructed weight, ``nn.Linear`` layout ``(out_features, in_features)``."""
        return self.layer.weight.to_matrix()[: self.out_features, : self.in_features]

    def num_params(self, effective: bool = True) -> int:
        """Core parameters plus the bias (allocated = effective: no gates)."""
        return self._factor_params() + (self.bias.numel() if self.bias is not None else 0)

    def dense_num_params(self) -> int:
        return self.in_features * self.out_features + (
            self.bias.numel() if self.bias is not None else 0)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"factors={list(self.in_factors)}|{list(self.out_factors)}, "
                f"ranks={[1, *self.effective_ranks(), 1]}, bias={self.bias is not None}")


class TLTorchEmbedding(_BlockTTLayer):
    """``E[ids]`` with ``E`` a tltorch TT-matrix (``FactorizedEmbedding``, BlockTT).
    ``padding_idx`` as ``nn.Embedding`` (its row reads as zeros, so it gets no gradient).

    Args: as :class:`~comera_engine.layers.TTEmbedding`.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        rank: int | Sequence[int] = 8,
        padding_idx: int | None = None,
        vocab_factors: Sequence[int] | None = None,
        dim_factors: Sequence[int] | None = None,
        d: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        tltorch = require_tltorch()
        self.num_embeddings, self.embedding_dim = int(num_embeddings), int(embedding_dim)
        if padding_idx is not None:
            padding_idx %= num_embeddings
        self.padding_idx = padding_idx
        fv, fe = embedding_factors(num_embeddings, embedding_dim, vocab_factors, dim_factors, d)
        self.vocab_factors, self.dim_factors = tuple(fv.factors), tuple(fe.factors)
        modes = [a * b for a, b in zip(self.vocab_factors, self.dim_factors)]
        ranks = _resolve_ranks(rank, modes)
        self.layer = tltorch.FactorizedEmbedding(
            math.prod(self.vocab_factors), math.prod(self.dim_factors), auto_tensorize=False,
            tensorized_num_embeddings=self.vocab_factors,
            tensorized_embedding_dim=self.dim_factors, factorization="blocktt",
            rank=[1, *ranks, 1], device=device, dtype=dtype)
        self._init_cores(1.0)  # nn.Embedding's (and TTEmbedding's) variance

    def forward(self, ids: Tensor) -> Tensor:
        if ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"ids: expected an integer tensor, got {ids.dtype}")
        ids = ids.long()
        # tltorch unravels the ids with NumPy (np.unravel_index), so they go to the host:
        # on a GPU a device-to-host copy per lookup (and no whole-step CUDA graph), the
        # peer implementation's own cost
        out = self.layer(ids.cpu() if ids.device.type != "cpu" else ids)
        if out.shape[-1] != self.embedding_dim:
            out = out[..., : self.embedding_dim]
        if self.padding_idx is not None:
            out = out * (ids != self.padding_idx).unsqueeze(-1).to(out.dtype)
        return out

    def dense_weight(self) -> Tensor:
        """The reconstructed table ``(num_embeddings, embedding_dim)`` (padding row zero)."""
        E = self.layer.weight.to_matrix()[: self.num_embeddings, : self.embedding_dim]
        if self.padding_idx is not None:
            keep = torch.ones(self.num_embeddings, 1, dtype=E.dtype, device=E.device)
            keep[self.padding_idx] = 0
            E = E * keep
        return E

    def decode(self, h: Tensor) -> Tensor:
        """``h · Eᵀ`` (a tied decoder), through the reconstructed table."""
        return h @ self.dense_weight().to(h.dtype).t()

    def num_params(self, effective: bool = True) -> int:
        return self._factor_params()

    def dense_num_params(self) -> int:
        return self.num_embeddings * self.embedding_dim

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, "
                f"factors={list(self.vocab_factors)}x{list(self.dim_factors)}, "
                f"ranks={[1, *self.effective_ranks(), 1]}, padding_idx={self.padding_idx}")


PEER_LAYERS = (TLTorchLinear, TLTorchEmbedding)


def peer_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, layer)`` for every peer (tltorch) TT layer in ``model``."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, PEER_LAYERS)]
