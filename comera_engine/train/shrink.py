"""The peers a user would pick instead of TT compression (docs/METHODS.md): structured
pruning with torch-pruning and weight-only int8 quantization with torchao, both of a
trained dense run (``model.init_from``).

- ``comera.method = "prune"`` (with ``model.dense = true``): the dense run's model is
  pruned by torch-pruning's dependency graph (whole channels, hidden units, head
  dimensions and the residual width removed together with everything that reads them;
  L2-magnitude importance, the same ratio in every group; the output layer kept) to the
  size CoMERA's model has at ``comera.target_compression``: the model's parameters
  outside the target's scope as they are, the scope's divided by the target. The
  pruning ratio is found by bisection on copies. Then ``train.steps`` steps of
  fine-tuning (the reproduction gives it as many as CoMERA trains after reaching its
  target).
- ``model.quantize = "int8"`` (with ``train.steps = 0``): the model of ``model.init_from``
  (a dense run, or a pruned run, rebuilt at its checkpoint's shapes) with every
  ``nn.Linear`` weight int8 per output row (torchao ``Int8WeightOnlyConfig``) and every
  ``nn.Embedding`` table int8 per row (torchao ``IntxWeightOnlyConfig``), evaluated.

Sizes: such a model records its dense reference (``comera_reference``), so that
``params/*``, ``bytes/*`` (weights as stored: a torchao tensor counts its int8 data and
its scales) and ``compression/*`` compare it with the dense model, in the target's
scope too: ``compression/tensorized`` is the scope's dense size over what the model
holds beyond the rest of the dense model, the ratio at which CoMERA's model is as big.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from comera_engine.config import Config
from comera_engine.errors import ConfigError

__all__ = ["dense_reference", "int8_tt_", "prune_to_target", "quantize_int8", "quiet_import",
           "resize_to_state"]


def dense_reference(cfg: Config, data: Any, dense: nn.Module) -> dict[str, float]:
    """The dense model's sizes and the part of it CoMERA's TT layers would replace (the
    target's ``tensorized`` scope), from the TT model this config builds."""
    from comera_engine.layers import size_report, stored_nbytes
    from comera_engine.models import build_model

    tt = build_model(dataclasses.replace(cfg.model, dense=False, init_from=None,
                                         quantize=None), data)
    rep = size_report(tt)
    params = float(sum(p.numel() for p in dense.parameters()))
    return {"params": params, "bytes": float(sum(stored_nbytes(p) for p in dense.parameters())),
            "tensorized_params": float(rep["tensorized"]["dense_params"]),
            "scope": cfg.comera.target_scope}


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _require(module: str, key: str, extra: str) -> Any:
    try:
        with quiet_import():
            return __import__(module)
    except ImportError as exc:
        raise ConfigError(key, f"needs {extra}, which is not installed ({exc}); install it "
                               f"with `pip install {extra}` (or the `peers` extra: "
                               "`pip install -e '.[peers]'`)") from None


@contextmanager
def quiet_import() -> Iterator[None]:
    """torchao logs its optional CUDA kernels it cannot load on a CPU machine: hidden."""
    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _pruner(model: nn.Module, example: Any, ratio: float,
            forward: Callable[[nn.Module, Any], torch.Tensor]) -> Any:
    tp = _require("torch_pruning", "comera.method", "torch-pruning")
    from comera_engine.models.transformer import SelfAttention

    heads = {}
    for m in model.modules():
        if isinstance(m, SelfAttention):
            heads.update({m.q: m.n_heads, m.k: m.n_heads, m.v: m.n_heads})
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    # attention splits the residual width into heads: every width a multiple of theirs
    round_to = math.lcm(*heads.values()) if heads else None
    return tp.pruner.BasePruner(
        model, example, importance=tp.importance.MagnitudeImportance(p=2),
        pruning_ratio=ratio, ignored_layers=linears[-1:], num_heads=heads,
        forward_fn=forward, root_module_types=[nn.Linear, nn.Embedding], round_to=round_to)


def prune_to_target(model: nn.Module, example: Any, target_params: float,
                    forward: Callable[[nn.Module, Any], torch.Tensor]) -> float:
    """Prune ``model`` in place to at most ``target_params`` parameters (the smallest
    channel ratio that gets there, by bisection on copies); returns the ratio.

    Raises:
        ConfigError: even the largest ratio leaves the model above the target
            (``comera.target_compression``).
    """
    def size_at(ratio: float) -> int:
        trial = copy.deepcopy(model)
        _pruner(trial, example, ratio, forward).step()
        return _count(trial)

    if _count(model) <= target_params:
        return 0.0
    # torch-pruning leaves a group whole when the ratio would remove all its channels,
    # so the size is not monotone near 100 %: the bisection's upper end is the largest
    # of these ratios that reaches the target
    lo, hi, smallest = 0.0, None, None
    for cand in (0.98, 0.96, 0.94, 0.92, 0.9, 0.85, 0.8, 0.7):
        size = size_at(cand)
        smallest = size if smallest is None else min(smallest, size)
        if size <= target_params:
            hi = cand
            break
    if hi is None:
        raise ConfigError("comera.target_compression",
                          f"structured pruning cannot make this model that small: it keeps "
                          f"at least {smallest:,} parameters, the target asks for "
                          f"{int(target_params):,}; choose a smaller target")
    for _ in range(14):
        mid = (lo + hi) / 2
        if size_at(mid) <= target_params:
            hi = mid
        else:
            lo = mid
    _pruner(model, example, hi, forward).step()
    return hi


@torch.no_grad()
def quantize_int8(model: nn.Module) -> nn.Module:
    """torchao weight-only int8, in place: ``nn.Linear`` weights per output row,
    ``nn.Embedding`` tables per row; returns ``model``."""
    _require("torchao", "model.quantize", "torchao")
    with quiet_import():
        from torchao.quantization import (
            Int8WeightOnlyConfig,
            IntxWeightOnlyConfig,
            quantize_,
        )
        from torchao.quantization.granularity import PerAxis
    quantize_(model, IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0)),
              filter_fn=lambda m, _: isinstance(m, nn.Embedding))
    quantize_(model, Int8WeightOnlyConfig(),
              filter_fn=lambda m, _: isinstance(m, nn.Linear))
    for p in model.parameters():
        p.requires_grad_(False)
    model._register_state_dict_hook(_flat_state)
    return model


def _flat_state(module: nn.Module, state: dict[str, Any], prefix: str, local: Any) -> None:
    """A state dict of plain tensors (checkpoints are safetensors): each torchao weight
    as its inner tensors, ``<name>.qdata``, ``<name>.scale``, ``<name>.zero_point``."""
    for key in list(state):
        t = state[key]
        if type(t) not in (torch.Tensor, nn.Parameter) and hasattr(t, "__tensor_flatten__"):
            names, _ = t.__tensor_flatten__()
            del state[key]
            for n in names:
                state[f"{key}.{n}"] = getattr(t, n).detach()


@torch.no_grad()
def int8_tt_(model: nn.Module) -> int:
    """A TT model with its weights as its int8 export stores them (``comera export
    --dtype int8``), in place: each TT layer's effective cores (gates absorbed, dead
    ranks sliced out) rounded to int8 with one scale per core, every other parameter
    per row (matrices) or per tensor (vectors); returns the bytes that export's tensors
    take (int8 values and float32 scales)."""
    from comera_engine.layers import tt_layers
    from comera_engine.tensor.quant import int8_bytes, int8_round_trip

    total = 0
    layers = tt_layers(model)
    for _, layer in layers:
        cores, ranks = layer.tt.effective_cores()
        total += sum(int(c.numel()) for c in cores) + 4 * len(cores)
        if 0 in ranks:
            continue  # the zero map stays as it is
        layer.tt.resize_(ranks)
        layer.tt.load_cores_([int8_round_trip(c, per_row=False) for c in cores])
    inside = tuple(f"{name}.tt." for name, _ in layers)
    for name, p in model.named_parameters():
        if name.startswith(inside) or not p.is_floating_point():
            continue
        p.data = int8_round_trip(p.data, per_row=p.dim() >= 2).to(p.dtype)
        total += int8_bytes(p, per_row=p.dim() >= 2)
    return total


@torch.no_grad()
def resize_to_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Give ``model``'s linears, embeddings and layer norms the shapes of ``state`` (a
    pruned run's weights), so that ``load_state_dict`` fits.

    Raises:
        ConfigError: ``state`` has a shape this cannot give (``model.init_from``).
    """
    for name, module in model.named_modules():
        w = state.get(f"{name}.weight" if name else "weight")
        if w is None or tuple(w.shape) == tuple(module.weight.shape):
            continue
        if isinstance(module, nn.Linear):
            module.out_features, module.in_features = int(w.shape[0]), int(w.shape[1])
        elif isinstance(module, nn.Embedding):
            module.embedding_dim = int(w.shape[1])
        elif isinstance(module, nn.LayerNorm):
            module.normalized_shape = tuple(int(s) for s in w.shape)
        else:
            raise ConfigError("model.init_from", f"layer {name}: cannot take the shape "
                                                 f"{list(w.shape)} of the run it names")
        for key, p in list(module._parameters.items()):
            src = state.get(f"{name}.{key}" if name else key)
            if p is not None and src is not None:
                module._parameters[key] = nn.Parameter(torch.empty_like(src, dtype=p.dtype),
                                                       requires_grad=p.requires_grad)
