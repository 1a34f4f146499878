"""Model-level helpers: ``tensorize``, ``truncate``, ``size_report``.

``size_report`` is the one place model size is computed: the trainer's metrics, the
dashboard and export all call it.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from .attention import SplitAttention, packed_in_proj, set_layer, weight_readers
from .embedding_peers import peer_tables
from .peers import peer_layers
from .tied import tie_heads, tied_heads
from .tt_embedding import TTEmbedding, TTEmbeddingBag
from .tt_linear import TTLinear

__all__ = ["DENSE_ONLY", "TT_LAYERS", "candidate_layers", "conv1d_as_linear",
           "dense_only_layers", "factorized_layers", "freeze_gates", "groupable_linears",
           "is_conv1d", "size_report", "tensorize_layers", "truncate", "tt_layers"]

TT_LAYERS = (TTLinear, TTEmbedding)
#: the tables a TT table replaces: ``nn.Embedding`` by :class:`TTEmbedding`,
#: ``nn.EmbeddingBag`` by :class:`TTEmbeddingBag`
TABLES = (nn.Embedding, nn.EmbeddingBag)


def tt_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, layer)`` for every TT layer in ``model``."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, TT_LAYERS)]


def groupable_linears(model: nn.Module) -> list[TTLinear]:
    """The TT linears of ``model`` whose halves a forward can take from a grouped pass
    (:func:`comera_engine.tensor.grouped.grouped_halves`): layout ``tt``, path not forced
    to one that merges no halves (``sweep``, ``fused``), called as a layer (not an
    attention module's projection, whose weight torch reads)."""
    read = weight_readers(model)
    return [m for _, m in tt_layers(model) if isinstance(m, TTLinear) and m.layout == "tt"
            and m.path in (None, "halves", "dense") and id(m) not in read]


def factorized_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The engine's TT layers, then the peer (tltorch) TT layers of ``model``, each in
    model order (the order :func:`comera_engine.rank.size_spec` lists them in)."""
    return tt_layers(model) + peer_layers(model)


def freeze_gates(model: nn.Module) -> None:
    """Gate-free TT layers (the fixed-rank methods): every gate of ``model``'s TT layers
    at 1, not trained, never pruned (threshold 0)."""
    with torch.no_grad():
        for _, layer in tt_layers(model):
            layer.tt.gate.fill_(1.0)
            layer.tt.gate.requires_grad_(False)
            layer.tt.tau = 0.0


def matches(name: str, patterns: Iterable[str] | None) -> bool:
    """Whether the module name ``name`` matches one of the glob ``patterns`` (the full
    name: ``include`` / ``exclude``'s rule)."""
    return any(fnmatch.fnmatchcase(name, p) for p in (patterns or ()))


def is_conv1d(module: nn.Module | None) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2's linears: ``y = x·W + b``, ``W`` ``(in, out)``),
    known by its class name and shape, without importing transformers."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor)
            and weight.dim() == 2 and getattr(module, "nf", None) == weight.shape[1])


def conv1d_as_linear(module: nn.Module) -> nn.Linear:
    """An ``nn.Linear`` computing what the ``Conv1D`` ``module`` computes: its weight the
    transposed view of the ``Conv1D``'s (same storage, nothing copied), its bias the same
    parameter."""
    weight, bias = module.weight, module.bias
    linear = nn.Linear(weight.shape[0], weight.shape[1], bias=bias is not None,
                       device="meta", dtype=weight.dtype)
    linear.weight = nn.Parameter(weight.detach().t(), requires_grad=weight.requires_grad)
    if bias is not None:
        linear.bias = bias
    return linear


#: layers that hold much of a network's weights where they are and that no TT layer
#: replaces (TT layers replace linears and tables)
DENSE_ONLY = (nn.modules.conv._ConvNd, nn.RNNBase, nn.Bilinear)


def dense_only_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of the convolutions, recurrent and bilinear layers of
    ``model`` (:data:`DENSE_ONLY`): they stay dense whatever ``tensorize`` is asked."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, DENSE_ONLY)]


def _kept_as_is(module: nn.Module) -> str | None:
    """Why ``module`` must stay as it is, or ``None``: a weight the user froze (a TT layer
    would train it, from fresh values unless made from the weight), a parametrized weight
    (``weight_norm`` / ``spectral_norm`` through ``torch.nn.utils.parametrize``) or hooks
    on its forward (their older hook forms, or the user's own), which a TT layer would
    drop."""
    from torch.nn.utils import parametrize

    weight = getattr(module, "weight", None)
    if parametrize.is_parametrized(module):
        return ("its weight is parametrized (weight_norm, spectral_norm: torch.nn.utils."
                "parametrize), which a TT layer would drop: it stays dense")
    if module._forward_pre_hooks or module._forward_hooks:
        return ("has hooks on its forward (an older weight_norm / spectral_norm, or your "
                "own), which a TT layer would drop: it stays dense")
    if isinstance(weight, torch.Tensor) and not weight.requires_grad:
        return ("is frozen (its weight has requires_grad=False): a TT layer would train "
                "it; it stays dense (unfreeze it to compress it)")
    return None


def candidate_layers(model: nn.Module) -> list[tuple[str, nn.Module | str]]:
    """``(qualified name, module)`` of every layer of ``model`` that can be made TT, in
    model order: each ``nn.Linear``, ``nn.Embedding`` and ``nn.EmbeddingBag``; each
    Hugging Face ``Conv1D`` (GPT-2's) as the ``nn.Linear`` it computes
    (:func:`conv1d_as_linear`); and the
    packed input projection of each ``nn.MultiheadAttention`` as ``<attention>.in_proj``
    (an ``nn.Linear`` sharing its parameters,
    :func:`~comera_engine.layers.attention.packed_in_proj`, until the attention is split;
    in its place why it cannot be, a string: a layer frozen, parametrized or with hooks on
    its forward is kept as it is, :func:`_kept_as_is`)."""
    out: list[tuple[str, nn.Module | str]] = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.MultiheadAttention) and not isinstance(mod, SplitAttention):
            out.append((f"{name}.in_proj", packed_in_proj(mod)) if name else (
                "in_proj", "the model is an attention module itself: tensorize a model "
                           "that holds it"))
        elif isinstance(mod, TABLES + (nn.Linear,)) and not isinstance(mod, TT_LAYERS):
            base = next(b for b in (nn.Linear, *TABLES) if isinstance(mod, b))
            out.append((name, mod) if type(mod).forward is base.forward else (
                name, f"a {type(mod).__name__} computes more than a plain nn."
                      f"{base.__name__} (its own forward), which a TT layer would drop: it "
                      "stays dense"))
            if base is not nn.Linear and (mod.max_norm is not None or mod.scale_grad_by_freq):
                out[-1] = (name, "renormalises the rows it reads (max_norm) or scales their "
                                 "gradients by the ids' counts (scale_grad_by_freq), which a "
                                 "TT table cannot: it stays dense")
        elif is_conv1d(mod):
            out.append((name, conv1d_as_linear(mod)))
        else:
            continue
        if not isinstance(out[-1][1], str):  # hooks, parametrizations, frozen: kept as is
            kept = _kept_as_is(mod) or (_kept_as_is(out[-1][1]) if out[-1][1] is not mod
                                        else None)
            if kept:
                out[-1] = (out[-1][0], kept)
    return out


def tensorize_layers(
    model: nn.Module,
    rank: int | Sequence[int] = 8,
    include: Iterable[str] | None = None,
    exclude: Iterable[str] | None = None,
    from_pretrained: bool = False,
    min_features: int = 8,
    d: int | None = None,
    tau: float = 1e-2,
    layout: str = "tt",
    embedding_rank: int | Sequence[int] | None = None,
    dry_run: bool = False,
) -> list[dict]:
    """Replace ``nn.Linear`` / ``nn.Embedding`` modules by TT layers at the ranks given,
    in place, and report each candidate layer (:func:`candidate_layers`). (The public
    ``comera_engine.tensorize`` takes a :class:`~comera_engine.config.CoMERAConfig`,
    chooses the ranks from its target and returns the model:
    :func:`comera_engine.rank.tensorize`.)

    A linear head whose weight is an embedding's (a language model's tied output layer,
    :func:`~comera_engine.layers.tied.tied_heads`) follows that table whatever
    ``include`` / ``exclude`` say of it: once the table is TT it becomes a
    :class:`~comera_engine.layers.tied.TiedDecoder` over it (its row: ``tied_to``).

    An ``nn.MultiheadAttention``'s packed query-key-value projection is the candidate
    ``<attention>.in_proj``: made TT, the attention becomes a
    :class:`~comera_engine.layers.attention.SplitAttention` holding it (its
    ``out_proj`` is an ordinary candidate).

    Args:
        rank: TT rank for every replaced layer.
        include: glob patterns of qualified module names to replace (default: all).
        exclude: glob patterns to keep dense (applied after ``include``).
        from_pretrained: ``True`` initialises cores by TT-SVD of the existing weights
            (rank cap ``rank``); ``False`` gives a fresh random init (training from scratch).
        min_features: layers with a side smaller than this stay dense (e.g. a 3-way head).
        d: factors per side (default: 3 for linears, 3/4 for embeddings).
        layout: core layout of the ``TTLinear`` layers (``"tt"``, the paper's, or
            ``"ttm"``; see :class:`TTLinear`).
        embedding_rank: TT rank of the replaced embeddings (default: ``rank``).
        dry_run: replace nothing; build each TT layer on the meta device (no memory) and
            return it in its row under ``module`` (for planning from shapes).

    Returns one report row per candidate layer: ``name``, ``kind``, ``shape``,
    ``factors``, ``ranks``, ``params_before``, ``params_after``, ``replaced`` (and
    ``reason`` when skipped).
    """
    report = []
    emb_rank = rank if embedding_rank is None else embedding_rank
    candidates = candidate_layers(model)
    modules = dict(model.named_modules())
    ties = tied_heads(model)  # {head or embedding: the table whose weight it holds}
    tables: set[str] = set()  # the embeddings made TT (to be, in a dry run)
    for name, mod in candidates:
        if name in ties:  # a head tied to a table follows the table (below)
            continue
        if include is not None and not matches(name, include):
            continue
        row: dict = {"name": name}
        if isinstance(mod, str):  # cannot be made TT, and why
            row.update(kind="embedding" if isinstance(modules.get(name), TABLES)
                       else "linear", replaced=False, reason=mod)
            report.append(row)
            continue
        if isinstance(mod, nn.Linear):
            row.update(kind="linear", shape=[mod.in_features, mod.out_features],
                       params_before=sum(p.numel() for p in mod.parameters()))
            small = min(mod.in_features, mod.out_features) < min_features
        else:
            row.update(kind="embedding", shape=[mod.num_embeddings, mod.embedding_dim],
                       params_before=mod.weight.numel())
            small = min(mod.num_embeddings, mod.embedding_dim) < min_features
        if matches(name, exclude) or small:
            row.update(replaced=False, params_after=row["params_before"],
                       reason="excluded" if matches(name, exclude) else
                       f"smaller than min_features={min_features}")
            report.append(row)
            continue
        w = mod.weight
        device = torch.device("meta") if dry_run else w.device
        if isinstance(mod, nn.Linear):
            if from_pretrained and not dry_run:
                new = TTLinear.from_linear(mod, rank=rank, d=d, tau=tau, layout=layout)
            else:
                new = TTLinear(mod.in_features, mod.out_features, rank=rank,
                               bias=mod.bias is not None, d=d, tau=tau, dtype=w.dtype,
                               device=device, layout=layout)
            row["factors"] = [list(new.in_factors), list(new.out_factors)]
        else:
            table = TTEmbeddingBag if isinstance(mod, nn.EmbeddingBag) else TTEmbedding
            if from_pretrained and not dry_run:
                new = table.from_embedding(mod, rank=emb_rank, d=d, tau=tau)
            else:
                new = table(mod.num_embeddings, mod.embedding_dim, rank=emb_rank,
                            padding_idx=mod.padding_idx, d=d, tau=tau, dtype=w.dtype,
                            device=device, **table.options_of(mod))
            row["factors"] = [list(new.vocab_factors), list(new.dim_factors)]
        if dry_run:
            row["module"] = new
        else:
            if not from_pretrained:
                _start_like(new, mod)
            set_layer(model, name, new)
        row.update(replaced=not dry_run, ranks=new.tt.ranks, params_after=new.num_params(False))
        report.append(row)
        tables.add(name)
    for name in ties:  # tied to a table: the head decodes through it once it is TT,
        mod = modules[name]  # another embedding holding it becomes it
        if include is not None and not matches(name, include) and ties[name] not in tables:
            continue
        bias = mod.bias.numel() if getattr(mod, "bias", None) is not None else 0
        row = {"name": name, "params_before": bias, "params_after": bias,  # weight: table's
               "tied_to": ties[name], "replaced": not dry_run and ties[name] in tables}
        if isinstance(mod, nn.Embedding):
            row.update(kind="embedding", shape=[mod.num_embeddings, mod.embedding_dim])
        else:
            row.update(kind="linear", shape=[mod.in_features, mod.out_features])
        if ties[name] not in tables:
            row["reason"] = f"tied to {ties[name]}, which stays dense"
        report.append(row)
    if not dry_run:
        tie_heads(model, {h: t for h, t in ties.items() if t in tables})
    return report


@torch.no_grad()
def _start_like(new: nn.Module, old: nn.Module) -> None:
    """A fresh TT layer starts as the dense layer it replaces was initialised: its
    reconstructed weight's entries at the dense weight's mean square (a Hugging Face
    model's ``initializer_range``, a network's own init; torch's default init gives the
    TT layer's own scale), and the dense bias as it is. A weight of zeros (a residual
    branch started at zero) or without values (``meta``) leaves the TT layer's default:
    cores of zeros would never train."""
    w = old.weight
    if w.is_meta or w.numel() == 0:
        return
    var = float(torch.linalg.vector_norm(w.detach()).double() ** 2 / w.numel())
    if var > 0 and math.isfinite(var):
        new.tt.rescale_init_(var)
    bias = getattr(old, "bias", None)
    if isinstance(bias, torch.Tensor) and getattr(new, "bias", None) is not None:
        new.bias.copy_(bias)


def truncate(model: nn.Module) -> dict[str, list[tuple[int, int, int]]]:
    """Physically slice every TT layer to its effective ranks, in place; outputs unchanged.

    Returns ``{layer: [(bond, old, new), …]}`` for layers that shrank. Optimizer state is
    not touched here; use ``comera_engine.rank.truncate_model_and_optimizer`` mid-training.
    """
    out = {}
    for name, layer in tt_layers(model):
        ch = layer.tt.truncate_()
        if ch:
            out[name] = [(c.bond, c.old, c.new) for c in ch]
    return out


def _bytes(p: torch.Tensor, n: int) -> int:
    return n * p.element_size()


def size_report(model: nn.Module) -> dict:
    """Per-layer and whole-model sizes against the dense model.

    For each TT layer: ``dense_params`` (the equivalent dense layer, bias included),
    ``allocated_params`` (cores as stored + bias), ``effective_params`` (cores at the
    effective ranks, i.e. after physical truncation, + bias), bytes of each, ranks, and
    its compression ratio ``dense/effective``. Parameters outside TT layers (and not
    gates) count the same in all three totals. Gate vectors are reported apart
    (``gate_params``): they are training controls absorbed into the cores on export.

    Totals: ``model`` (every parameter) and ``tensorized`` (the TT layers only), each
    with ``dense_params``, ``allocated_params``, ``effective_params``, the ``*_bytes``
    and ``compression`` (dense / effective) and ``compression_allocated``.

    Peer TT layers (tltorch, :mod:`.peers`: fixed ranks, no gates) count as tensorized
    layers the same way (allocated = effective).
    """
    layers = []
    tt_param_ids: set[int] = set()
    tot = {"dense": 0, "alloc": 0, "eff": 0, "dense_b": 0, "alloc_b": 0, "eff_b": 0}
    gate_params = 0
    for name, layer in tt_layers(model):
        core0 = layer.tt.cores[0]
        for p in layer.parameters():
            tt_param_ids.add(id(p))
        gate_params += layer.tt.gate_params
        dense = layer.dense_num_params()
        alloc, eff = layer.num_params(False), layer.num_params(True)
        row = {
            "name": name,
            "kind": "linear" if isinstance(layer, TTLinear) else "embedding",
            "shape": ([layer.in_features, layer.out_features] if isinstance(layer, TTLinear)
                      else [layer.num_embeddings, layer.embedding_dim]),
            "factors": ([list(layer.in_factors), list(layer.out_factors)]
                        if isinstance(layer, TTLinear)
                        else [list(layer.vocab_factors), list(layer.dim_factors)]),
            "allocated_ranks": layer.tt.ranks[1:-1],
            "effective_ranks": layer.effective_ranks(),
            "dense_params": dense,
            "allocated_params": alloc,
            "effective_params": eff,
            "dense_bytes": _bytes(core0, dense),
            "allocated_bytes": _bytes(core0, alloc),
            "effective_bytes": _bytes(core0, eff),
            "compression": dense / eff if eff else float("inf"),
        }
        layers.append(row)
        tot["dense"] += dense
        tot["alloc"] += alloc
        tot["eff"] += eff
        tot["dense_b"] += row["dense_bytes"]
        tot["alloc_b"] += row["allocated_bytes"]
        tot["eff_b"] += row["effective_bytes"]
    for name, layer in peer_layers(model):
        core0 = layer.factors()[0]
        tt_param_ids.update(id(p) for p in layer.parameters())
        dense, eff = layer.dense_num_params(), layer.num_params()
        linear = hasattr(layer, "in_features")
        layers.append({
            "name": name,
            "kind": "linear" if linear else "embedding",
            "shape": ([layer.in_features, layer.out_features] if linear
                      else [layer.num_embeddings, layer.embedding_dim]),
            "factors": ([list(layer.in_factors), list(layer.out_factors)] if linear
                        else [list(layer.vocab_factors), list(layer.dim_factors)]),
            "allocated_ranks": layer.effective_ranks(),
            "effective_ranks": layer.effective_ranks(),
            "dense_params": dense, "allocated_params": eff, "effective_params": eff,
            "dense_bytes": _bytes(core0, dense), "allocated_bytes": _bytes(core0, eff),
            "effective_bytes": _bytes(core0, eff),
            "compression": dense / eff if eff else float("inf"),
        })
        for key, n in (("dense", dense), ("alloc", eff), ("eff", eff)):
            tot[key] += n
            tot[f"{key}_b"] += _bytes(core0, n)
    other = other_b = 0
    for p in model.parameters():
        if id(p) not in tt_param_ids:
            other += p.numel()
            other_b += _bytes(p, p.numel())

    def block(dn: int, al: int, ef: int, db: int, ab: int, eb: int) -> dict:
        return {
            "dense_params": dn, "allocated_params": al, "effective_params": ef,
            "dense_bytes": db, "allocated_bytes": ab, "effective_bytes": eb,
            "compression": dn / ef if ef else float("inf"),
            "compression_allocated": dn / al if al else float("inf"),
        }

    return {
        "layers": layers,
        "tensorized": block(tot["dense"], tot["alloc"], tot["eff"], tot["dense_b"],
                            tot["alloc_b"], tot["eff_b"]),
        "model": block(tot["dense"] + other, tot["alloc"] + other, tot["eff"] + other,
                       tot["dense_b"] + other_b, tot["alloc_b"] + other_b,
                       tot["eff_b"] + other_b),
        "other_params": other,
        "gate_params": gate_params,
    }


def stored_nbytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds as stored: a tensor subclass (e.g. torchao's int8 weights)
    counts its inner tensors (int8 data, scales, zero points)."""
    if type(t) not in (torch.Tensor, nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(stored_nbytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def dense_size_metrics(model: nn.Module) -> dict[str, float]:
    """``params/*``, ``bytes/*`` (as stored) and ``compression/*`` of a model without TT
    layers. A pruned or quantized peer (``comera_engine.train.shrink``) carries its dense
    model's sizes as ``model.comera_reference``; against them it gets
    ``compression/model`` (dense bytes / its bytes: what int8 saves counts) and, in the
    ``tensorized`` scope, the ratio at which CoMERA's model holds as many bytes:
    the scope's dense parameters over what it holds beyond the rest of the dense model
    (pruned models only: a quantized one is judged in bytes, whole model).

    A model whose embedding tables are compressed peers (hash, QR, mixed-dimension, int8:
    :func:`~comera_engine.layers.embedding_peers.peer_tables`) is measured against the
    same model with dense fp32 tables, in bytes as stored (:func:`_peer_size_metrics`)."""
    params = list(model.parameters())
    n = float(sum(p.numel() for p in params))
    nbytes = float(sum(stored_nbytes(p) for p in params))
    ref = getattr(model, "comera_reference", None)
    tables = peer_tables(model)
    if tables and not ref:
        return _peer_size_metrics(n, nbytes, [m for _, m in tables])
    if not ref:
        return {"params/effective": n, "params/allocated": n, "params/dense": n,
                "bytes/effective": nbytes, "bytes/dense": nbytes, "compression/model": 1.0}
    dense_b = float(ref["bytes"])
    out = {"params/effective": n, "params/allocated": n, "params/dense": float(ref["params"]),
           "bytes/effective": nbytes, "bytes/dense": dense_b,
           "compression/model": dense_b / max(nbytes, 1.0)}
    if ref.get("target") is not None:  # pruned: its size in the target's scope
        scope = float(ref["tensorized_params"])
        beyond = n - (float(ref["params"]) - scope)
        out["compression/tensorized"] = scope / beyond if beyond > 0 else float("inf")
        out["params/tensorized_effective"] = beyond
    return out


def _peer_size_metrics(n: float, nbytes: float, tables: list) -> dict[str, float]:
    """Sizes of a model of ``n`` parameters (``nbytes`` as stored) whose ``tables`` are
    compressed embedding peers, against the same model with each a dense fp32 ``N × D``
    table: ``compression/tensorized`` = the tables' dense bytes / the bytes their
    parameters hold (the scope a TT model's tables are measured in), ``compression/model``
    the same for the whole model. In bytes: an int8 table holds a quarter of the bytes of
    as many floats."""
    own = {id(p): p for t in tables for p in t.parameters()}.values()
    own_p = float(sum(p.numel() for p in own))
    own_b = float(sum(stored_nbytes(p) for p in own))
    dense_b = float(sum(t.dense_bytes() for t in tables))
    whole_dense_b = nbytes - own_b + dense_b
    return {"params/effective": n, "params/allocated": n,
            "params/dense": n - own_p + dense_b / 4.0,
            "bytes/effective": nbytes, "bytes/dense": whole_dense_b,
            "compression/model": whole_dense_b / max(nbytes, 1.0),
            "compression/tensorized": dense_b / max(own_b, 1.0)}
