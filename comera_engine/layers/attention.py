"""``nn.MultiheadAttention`` with its packed input projection as a layer of its own, so
that :func:`~comera_engine.layers.tensorize_layers` can make it TT.

``nn.MultiheadAttention`` holds the query, key and value projections as one parameter,
``in_proj_weight`` ``(3E, E)``, which its forward (and the inference fast paths of
``nn.TransformerEncoderLayer`` / ``nn.TransformerEncoder``) read as a tensor, as they
read ``out_proj.weight``. :class:`SplitAttention` is the same module with that parameter
and ``in_proj_bias`` held by a child ``nn.Linear(E, 3E)``, ``in_proj``, and read back
through properties: the same function of the same parameters; in the state dict
``in_proj_weight`` / ``in_proj_bias`` become ``in_proj.weight`` / ``in_proj.bias``.

Once ``in_proj`` (or ``out_proj``) is a :class:`~comera_engine.layers.TTLinear`, what
torch reads is its ``weight``: ``W`` rebuilt from the gated cores, differentiable in
both, each time it is read. Attention then runs on torch's own code and kernels (masks,
dropout, ``need_weights``, the fast paths), at a dense GEMM's cost per token; the
parameters, the gradients' reach and the size are the TT layer's.

Only attention whose key and value have the query's width (``kdim == vdim ==
embed_dim``, torch's default) packs its projections; with other widths they are three
parameters of three shapes, and :func:`packed_in_proj` says so.
"""

from __future__ import annotations

from torch import Tensor, nn

from .tree import set_module

__all__ = ["SplitAttention", "packed_in_proj", "set_layer", "weight_readers"]

#: what :class:`SplitAttention` copies from the attention it splits (besides parameters)
_SETTINGS = ("embed_dim", "kdim", "vdim", "_qkv_same_embed_dim", "num_heads", "dropout",
             "batch_first", "head_dim", "add_zero_attn")


def packed_in_proj(attention: nn.MultiheadAttention) -> nn.Linear | str:
    """An ``nn.Linear(E, 3E)`` whose weight and bias *are* ``attention``'s
    ``in_proj_weight`` and ``in_proj_bias`` (the same parameters, nothing copied), or why
    there is none (a string): separate projections of other widths."""
    if not attention._qkv_same_embed_dim or attention.in_proj_weight is None:
        return ("its key and value widths differ from the query's (kdim / vdim): three "
                "projections, not one packed matrix; they stay dense")
    weight, bias = attention.in_proj_weight, attention.in_proj_bias
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None,
                       device="meta", dtype=weight.dtype)
    linear.weight = weight
    if bias is not None:
        linear.bias = bias
    return linear


class SplitAttention(nn.MultiheadAttention):
    """``nn.MultiheadAttention`` whose packed input projection is the child ``in_proj``
    (:func:`packed_in_proj`); ``in_proj_weight`` and ``in_proj_bias`` read it (its
    ``weight`` and ``bias``). Build one with :meth:`of`; the forward is torch's."""

    in_proj: nn.Module

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise TypeError("SplitAttention.of(attention): it splits an existing "
                        "nn.MultiheadAttention")

    @classmethod
    def of(cls, attention: nn.MultiheadAttention) -> SplitAttention:
        """``attention`` with its packed projection split out, sharing its parameters
        (``out_proj``, ``bias_k`` / ``bias_v`` and the packed matrix itself).

        Raises:
            ValueError: ``attention`` has no packed projection (:func:`packed_in_proj`).
        """
        in_proj = packed_in_proj(attention)
        if isinstance(in_proj, str):
            raise ValueError(f"attention: {in_proj}")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        for key in _SETTINGS:
            setattr(new, key, getattr(attention, key))
        for key in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
            new.register_parameter(key, None)
        new.register_parameter("bias_k", attention.bias_k)
        new.register_parameter("bias_v", attention.bias_v)
        new.in_proj = in_proj
        new.out_proj = attention.out_proj
        new.train(attention.training)
        return new

    @property
    def in_proj_weight(self) -> Tensor:  # type: ignore[override]
        """``(3E, E)``: the query, key and value projections (``in_proj``'s weight)."""
        return self.in_proj.weight

    @property
    def in_proj_bias(self) -> Tensor | None:  # type: ignore[override]
        return self.in_proj.bias


def weight_readers(model: nn.Module) -> dict[int, nn.Module]:
    """``{id(linear): attention}`` for every linear inside an attention module of
    ``model`` (its ``in_proj``, its ``out_proj``): torch's attention reads their
    ``weight``, never calls their forward."""
    return {id(child): m for m in model.modules() if isinstance(m, nn.MultiheadAttention)
            for child in (getattr(m, "in_proj", None), m.out_proj) if child is not None}


def set_layer(model: nn.Module, name: str, layer: nn.Module) -> None:
    """Put ``layer`` at ``name`` in ``model`` (:func:`~comera_engine.layers.tree.set_module`);
    at ``<attention>.in_proj`` of an attention not yet split, split it first
    (:meth:`SplitAttention.of`)."""
    owner = name.rpartition(".")[0]
    parent = model.get_submodule(owner)
    if (name.endswith(".in_proj") and isinstance(parent, nn.MultiheadAttention)
            and not isinstance(parent, SplitAttention)):
        set_module(model, owner, SplitAttention.of(parent))
    set_module(model, name, layer)
