"""``TTEmbedding`` and ``TTEmbeddingBag``: drop-in ``nn.Embedding`` / ``nn.EmbeddingBag``
tables stored as a gated TT-matrix (TTM)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from ..tensor.costs import OPS
from ..tensor.factorize import Factorization, resolve_factors
from ..tensor.lookup import lookup_rows, split_point
from ..tensor.planner import compute_dtype, explain_decode, explain_lookup, in_graph, plan_case
from ..tensor.tt import TTMCores

__all__ = ["BAG_MODES", "TTEmbedding", "TTEmbeddingBag", "embedding_factors"]

#: the reductions of ``nn.EmbeddingBag`` (``mode``)
BAG_MODES = ("sum", "mean", "max")


def embedding_factors(num_embeddings: int, embedding_dim: int,
                      vocab_factors: Sequence[int] | None, dim_factors: Sequence[int] | None,
                      d: int | None) -> tuple[Factorization, Factorization]:
    """The row and column factorisations of a TTM table: ``d`` cores, else as many as
    the factors given, else 4 for vocabularies of at least 4096 rows and 3 below."""
    if d is None:
        d = len(vocab_factors) if vocab_factors is not None else (
            len(dim_factors) if dim_factors is not None else
            (4 if num_embeddings >= 4096 else 3))
    return (resolve_factors(num_embeddings, vocab_factors, d, "vocab_factors"),
            resolve_factors(embedding_dim, dim_factors, d, "dim_factors"))


class TTEmbedding(nn.Module):
    """``E[ids]`` with ``E`` (num_embeddings × embedding_dim) in TTM format.

    Lookup paths (``path``; default the planner's choice per step shape,
    :func:`~comera_engine.tensor.planner.choose`): ``gather`` (unique ids, two merged
    half-tables, one batched GEMM: :func:`~comera_engine.tensor.lookup.ttm_lookup`),
    ``dense`` (the table ``E`` made from the gated cores, then its rows: one gather;
    gradients scatter into ``E`` and back through the cores) and ``fused`` (the Triton
    lookup, where the kernels run). :meth:`decode` (the tied MLM decoder) has ``table``
    and ``tt``. ``padding_idx`` behaves as in ``nn.Embedding``: its row reads as zeros
    and receives no gradient. Initialisation matches ``nn.Embedding`` (entries of
    variance 1).

    Args:
        num_embeddings, embedding_dim: table shape.
        rank: TT rank (scalar, clamped) or the ``d-1`` internal ranks.
        padding_idx: as ``nn.Embedding``.
        vocab_factors, dim_factors: explicit factorisations (``∏ vocab_factors`` may exceed
            ``num_embeddings``; ``∏ dim_factors`` may exceed ``embedding_dim``).
        d: cores when factors are chosen automatically (default 4 for vocabularies of
            at least 4096 rows, else 3).
        path: force the lookup's path (``dense``, ``gather``, ``fused``); default: planner.
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
        tau: float = 1e-2,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        path: str | None = None,
    ) -> None:
        super().__init__()
        if path is not None and path not in OPS["ttm_lookup"]:
            raise ValueError(f"path: a TT embedding's paths are "
                             f"{', '.join(OPS['ttm_lookup'])}; got {path!r}")
        self.path = path
        for name, v in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: must be a positive integer, got {v!r}")
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"padding_idx: must be within num_embeddings, got {padding_idx}")
            padding_idx %= num_embeddings
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = padding_idx
        fv, fe = embedding_factors(num_embeddings, embedding_dim, vocab_factors, dim_factors, d)
        self.tt = TTMCores(fv.factors, fe.factors, rank, tau=tau, init_var=1.0, dtype=dtype,
                           device=device)

    def reset_parameters(self) -> None:
        """Initialise afresh, as a new table is (entries of variance 1, gates 1): for a
        model built on the ``meta`` device, after ``to_empty``."""
        self.tt.reset_parameters()

    @property
    def vocab_factors(self) -> tuple[int, ...]:
        return self.tt.row_factors

    @property
    def dim_factors(self) -> tuple[int, ...]:
        return self.tt.col_factors

    def forward(self, ids: Tensor) -> Tensor:
        if ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"ids: expected an integer tensor, got {ids.dtype}")
        ids = ids.long()
        path = self.path or self._plan("ttm_lookup", ids.numel(), ids)
        h = split_point(self.vocab_factors, self.dim_factors, self.tt.ranks)
        out = lookup_rows(ids, *self.tt.parts(), self.tt.tau, path, h)
        if out.shape[-1] != self.embedding_dim:
            out = out[..., : self.embedding_dim]
        if self.padding_idx is not None:
            keep = (ids != self.padding_idx).unsqueeze(-1).to(out.dtype)
            out = out * keep
        return out

    def _plan(self, op: str, tokens: int, t: Tensor) -> str:
        """The planner's path for ``op`` (``ttm_lookup``, ``ttm_decode``) on ``tokens``
        rows, ``t`` the input (its device, dtype, graph capture)."""
        tt = self.tt
        training = torch.is_grad_enabled() and any(c.requires_grad for c in tt.cores)
        return plan_case(op, self.vocab_factors, self.dim_factors, tt.ranks, tokens,
                         t.device, compute_dtype(t, tt.cores[0]), in_graph(t), training,
                         t.requires_grad)

    def decode(self, h: Tensor, path: str | None = None) -> Tensor:
        """``h · Eᵀ``: hidden states ``(..., embedding_dim)`` to scores over the rows
        ``(..., num_embeddings)`` (a tied decoder; the padding row scores 0). ``path``:
        ``tt`` (contracted through the two half tables without building ``E``,
        :func:`comera_engine.ops.ttm_decode.ttm_decode`) or ``table`` (``E`` built);
        default: the planner's choice."""
        from ..ops.ttm_decode import ttm_decode

        cores = self.tt.gated_cores()
        split = split_point(self.vocab_factors, self.dim_factors, self.tt.ranks)
        flat = h.reshape(-1, h.shape[-1])
        path = path or self._plan("ttm_decode", flat.shape[0], flat)
        out = ttm_decode(flat, cores, split, self.num_embeddings, self.padding_idx, path=path)
        return out.reshape(*h.shape[:-1], self.num_embeddings)

    def explain(self, tokens: int, training: bool = True, graph: bool = False,
                dtype: torch.dtype | None = None, decode: bool = False) -> dict:
        """The planner's view of this table's lookup of ``tokens`` ids (``decode``: of
        the tied decoder on ``tokens`` hidden states), at the effective ranks
        (:func:`~comera_engine.tensor.planner.explain_lookup`, ``explain_decode``)."""
        ranks = [1, *self.effective_ranks(), 1]
        p = self.tt.cores[0]
        fn = explain_decode if decode else explain_lookup
        return fn(tokens, self.vocab_factors, self.dim_factors, ranks, p.device,
                  dtype or p.dtype, training, graph)

    def dense_weight(self) -> Tensor:
        """The reconstructed table ``(num_embeddings, embedding_dim)`` (padding row zero)."""
        E = self.tt.to_matrix()[: self.num_embeddings, : self.embedding_dim]
        if self.padding_idx is not None:
            mask = torch.ones(self.num_embeddings, 1, dtype=E.dtype, device=E.device)
            mask[self.padding_idx] = 0
            E = E * mask
        return E

    def effective_ranks(self) -> list[int]:
        return self.tt.effective_ranks()

    def num_params(self, effective: bool = True) -> int:
        return self.tt.num_params(effective)

    def dense_num_params(self) -> int:
        return self.num_embeddings * self.embedding_dim

    @classmethod
    def from_embedding(cls, emb: nn.Embedding | nn.EmbeddingBag,
                       rank: int | Sequence[int] | None = None, tol: float | None = None,
                       **kw) -> TTEmbedding:
        """TT-SVD of a trained ``nn.Embedding`` table (an ``nn.EmbeddingBag``'s for
        :class:`TTEmbeddingBag`, its reduction kept)."""
        layer = cls(emb.num_embeddings, emb.embedding_dim, rank=rank or 1,
                    padding_idx=emb.padding_idx, dtype=emb.weight.dtype,
                    device=emb.weight.device, **cls.options_of(emb), **kw)
        W = emb.weight.detach()
        D = layer.tt.shape[1]
        if D != W.shape[1]:
            W = torch.nn.functional.pad(W, (0, D - W.shape[1]))
        src = TTMCores.from_matrix(W, layer.vocab_factors, layer.dim_factors, max_rank=rank,
                                   tol=tol, tau=layer.tt.tau)
        layer.tt.load_cores_([c.detach() for c in src.cores])
        return layer

    @staticmethod
    def options_of(emb: nn.Module) -> dict:
        """The constructor keywords, beyond the table's shape and padding row, that
        rebuild ``emb``'s behaviour (none for a plain table)."""
        return {}

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, "
                f"factors={list(self.vocab_factors)}x{list(self.dim_factors)}, "
                f"ranks={self.tt.ranks}, padding_idx={self.padding_idx}")


class TTEmbeddingBag(TTEmbedding):
    """A drop-in ``nn.EmbeddingBag``: sums, means or maxima over bags of rows of a TTM
    table, as ``F.embedding_bag`` computes them (``mode``, ``offsets`` or a 2-D input of
    equal bags, ``per_sample_weights`` with ``sum``, ``include_last_offset``; an entry
    equal to ``padding_idx`` is left out of its bag, an empty bag gives zeros).

    The rows of every entry are looked up from the cores as :class:`TTEmbedding` does
    (each distinct id once), then reduced per bag: ``F.embedding_bag`` over those rows.
    Shapes: ``input`` ``(N,)`` with ``offsets`` ``(B,)`` (``(B+1,)`` with
    ``include_last_offset``), or ``(B, L)``; the output ``(B, embedding_dim)``.

    Args:
        mode: ``"sum"``, ``"mean"`` (default, as ``nn.EmbeddingBag``) or ``"max"``.
        include_last_offset: as ``nn.EmbeddingBag``.
        The rest: as :class:`TTEmbedding`.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 rank: int | Sequence[int] = 8, padding_idx: int | None = None,
                 mode: str = "mean", include_last_offset: bool = False, **kw) -> None:
        if mode not in BAG_MODES:
            raise ValueError(f"mode: one of {', '.join(BAG_MODES)}, got {mode!r}")
        super().__init__(num_embeddings, embedding_dim, rank=rank, padding_idx=padding_idx,
                         **kw)
        self.mode = mode
        self.include_last_offset = bool(include_last_offset)

    def forward(self, input: Tensor, offsets: Tensor | None = None,  # noqa: A002 - torch's
                per_sample_weights: Tensor | None = None) -> Tensor:
        flat = input.reshape(-1)
        rows = super().forward(flat)  # (N, D), each entry's row
        index = torch.arange(flat.numel(), device=flat.device).reshape(input.shape)
        skip = None
        if self.padding_idx is not None:  # padding entries point at a row the bag skips
            skip = flat.numel()
            index = torch.where(input == self.padding_idx, skip, index)
            rows = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])
        return torch.nn.functional.embedding_bag(
            index, rows, offsets, mode=self.mode, per_sample_weights=per_sample_weights,
            include_last_offset=self.include_last_offset, padding_idx=skip)

    @staticmethod
    def options_of(emb: nn.Module) -> dict:
        return {"mode": emb.mode, "include_last_offset": emb.include_last_offset}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mode={self.mode!r}"
