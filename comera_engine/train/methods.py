"""The peer methods a CoMERA run is compared against (docs/METHODS.md), on the trainer's
side: how a run's model is built and initialised, and the GaLore optimizer.

- ``comera.method = "fixed"``: the TT model at fixed ranks, gate-free (gates frozen at 1,
  never pruned, not optimised). With ``comera.target_compression`` the ranks are the ones
  that make the model that size (:func:`comera_engine.rank.plan_fixed_ranks`, applied
  here by :func:`apply_bond_ranks`); without one, ``model.rank`` (or the preset's).
- ``comera.method = "tt_svd"``: the same model, every TT layer initialised by TT-SVD of
  the matching layer of a trained dense model (``model.init_from``), every other
  parameter and buffer copied from it (:func:`init_from_dense`); then ``train.steps``
  steps of fine-tuning (0: evaluate only).
- ``model.tt_impl = "tltorch"``: the TT layers are tensorly-torch's (``layers.peers``);
  with ``comera.method = "fixed"`` the same rank plan applies.
- ``train.optimizer = "galore"``: :func:`galore_optimizer` for the dense model.

Checkpoints are read with safetensors or ``torch.load(weights_only=True)`` only.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from comera_engine.config import Config, ModelConfig
from comera_engine.errors import ConfigError
from comera_engine.layers import factorized_layers, freeze_gates
from comera_engine.train import checkpoint as ckpt

__all__ = ["GALORE_MIN_SIDE", "apply_bond_ranks", "build_run_model",
           "galore_optimizer", "init_from_dense", "load_init_state"]


# --------------------------------------------------------------------------- model


def build_run_model(cfg: Config, data: Any, plan: Any = None) -> nn.Module:
    """The run's model for its method: :func:`~comera_engine.models.build_model`, then for
    ``comera.method`` ``"fixed"`` / ``"tt_svd"`` the planned per-bond ranks
    (``plan.bond_ranks`` from :func:`~comera_engine.runplan.plan_initial_ranks`, if
    any) and frozen gates, and for ``"tt_svd"`` the TT-SVD initialisation from
    ``model.init_from``.

    Raises:
        ConfigError: ``model.init_from`` is missing, unreadable or not a dense run of
            this model.
    """
    from comera_engine.models import build_model

    model = build_model(cfg.model, data)
    if cfg.model.quantize is not None or cfg.comera.method == "prune":
        return _shrunk_model(cfg, data, model)
    if cfg.model.dense or cfg.comera.method == "comera":
        return model
    if plan is not None and plan.bond_ranks is not None:
        apply_bond_ranks(model, plan.bond_ranks)
    freeze_gates(model)
    if cfg.comera.method == "tt_svd":
        dense = build_model(dataclasses.replace(cfg.model, dense=True), data)
        state = load_init_state(cfg.model, cfg.base_dir)
        try:
            dense.load_state_dict(state)
        except RuntimeError as exc:
            raise ConfigError("model.init_from", "its weights do not fit the dense model "
                                                 f"of this config: {_first_line(exc)}") from None
        init_from_dense(model, dense)
    return model


def _shrunk_model(cfg: Config, data: Any, model: nn.Module) -> nn.Module:
    """The dense ``model`` with ``model.init_from``'s weights, pruned to the target
    (``comera.method = "prune"``) or int8-quantized (``model.quantize``): train/shrink.py."""
    from comera_engine.models import TaskModel
    from comera_engine.train import shrink
    from comera_engine.train.batches import eval_batches

    if not cfg.model.dense:  # CoMERA + int8: the TT run's cores, as its int8 export has them
        state = load_init_state(cfg.model, cfg.base_dir, tt=True)
        ckpt.resize_to_shapes(model, {k: list(v.shape) for k, v in state.items()})
        model.load_state_dict(state)
        model.comera_stored_bytes = shrink.int8_tt_(model)
        return model
    ref = shrink.dense_reference(cfg, data, model)
    state = load_init_state(cfg.model, cfg.base_dir)
    if cfg.model.quantize is not None:
        shrink.resize_to_state(model, state)  # a pruned run's shapes
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        raise ConfigError("model.init_from", "its weights do not fit the dense model "
                                             f"of this config: {_first_line(exc)}") from None
    if cfg.model.quantize is not None:
        shrink.quantize_int8(model)
    else:
        t = float(cfg.comera.target_compression or 1.0)
        target = ref["params"] - ref["tensorized_params"] * (1.0 - 1.0 / t)
        example = next(eval_batches(data.train, 8))
        ratio = shrink.prune_to_target(TaskModel(model, data.task), example, target,
                                       lambda m, b: m(b)["loss"])
        ref["prune_ratio"], ref["target"] = ratio, t
    model.comera_reference = ref
    return model


@torch.no_grad()
def apply_bond_ranks(model: nn.Module, bond_ranks: Sequence[Sequence[int]]) -> None:
    """Give the TT layers of ``model`` (in :func:`comera_engine.rank.size_spec` order)
    the internal ranks ``bond_ranks``, each at most the allocated one: every bond keeps its
    first entries and the left core is scaled by ``sqrt(old/new)``, so the layer keeps the
    variance of its own initialisation (random cores: the reconstructed entries' variance
    is proportional to the product of the ranks)."""
    layers = [m for _, m in factorized_layers(model)]
    if len(layers) != len(bond_ranks):
        raise ValueError(f"bond_ranks: {len(bond_ranks)} layers planned, the model has "
                         f"{len(layers)}")
    for layer, ranks in zip(layers, bond_ranks):
        if not hasattr(layer, "tt"):  # a peer layer slices itself
            layer.set_ranks_(ranks)
            continue
        tt = layer.tt
        old = list(tt.bond_ranks)
        if len(ranks) != len(old) or any(not 1 <= r <= o for r, o in zip(ranks, old)):
            raise ValueError(f"bond_ranks: need {len(old)} ranks within {old}, got "
                             f"{list(ranks)}")
        for k, (r, o) in enumerate(zip(ranks, old)):
            tt.cores[k].mul_(math.sqrt(o / r))
        tt.select_([torch.arange(r, device=tt.gate.device) for r in ranks])


@torch.no_grad()
def init_from_dense(model: nn.Module, dense: nn.Module) -> None:
    """Initialise the TT model ``model`` from the dense model ``dense`` of the same
    architecture: every TT layer by TT-SVD of the dense layer at the same name, at the TT
    layer's current ranks (its cores' shapes: a full-rank TT reproduces the weight
    exactly); every other parameter and buffer (biases, norms, dense layers, position
    tables) copied. Gates are set to 1 (all alive).

    Raises:
        ConfigError: the two models do not match (``model.init_from``).
    """
    from comera_engine.layers import TTEmbedding, TTLinear, tt_layers
    from comera_engine.layers.tensorize import TABLES
    from comera_engine.tensor.tt import TTMCores

    own = dict(factorized_layers(model))
    if len(own) != len(tt_layers(model)):
        raise ConfigError("model.init_from", 'TT-SVD initialises the engine\'s TT layers; '
                                             'use model.tt_impl = "comera" with it')
    dense_mods = dict(dense.named_modules())
    for name, layer in own.items():
        src = dense_mods.get(name)
        ranks = list(layer.tt.bond_ranks)
        if isinstance(layer, TTLinear) and isinstance(src, nn.Linear) and (
                src.in_features, src.out_features) == (layer.in_features, layer.out_features):
            W = src.weight.detach().t().double()  # (in, out), as the cores hold it
            cores = layer.svd_cores(W, ranks)  # in the layer's layout (tt or ttm)
            layer.tt.load_cores_(cores)
            if layer.bias is not None:
                layer.bias.copy_(src.bias)
        elif isinstance(layer, TTEmbedding) and isinstance(src, TABLES) and (
                src.num_embeddings, src.embedding_dim) == (layer.num_embeddings,
                                                           layer.embedding_dim):
            E = src.weight.detach().double()
            D = layer.tt.shape[1]
            if D != E.shape[1]:
                E = torch.nn.functional.pad(E, (0, D - E.shape[1]))
            cores = TTMCores._svd_cores(E, layer.vocab_factors, layer.dim_factors, ranks, None)
            layer.tt.load_cores_(cores)
        else:
            raise ConfigError("model.init_from", f"layer {name}: the dense model has "
                                                 f"{type(src).__name__} there, not the "
                                                 f"layer of this TT layer's shape")
    prefixes = tuple(f"{name}." for name in own)
    target = model.state_dict()
    source = dense.state_dict()
    rest = {k: v for k, v in target.items() if not k.startswith(prefixes)}
    missing = [k for k in rest if k not in source or source[k].shape != rest[k].shape]
    if missing:
        raise ConfigError("model.init_from", f"the dense model lacks {len(missing)} "
                                             f"tensors of this model (e.g. {missing[0]})")
    model.load_state_dict({k: source[k] for k in rest}, strict=False)


def load_init_state(cfg: ModelConfig, base_dir: str | None = None,
                    tt: bool = False) -> dict[str, Tensor]:
    """The model weights ``model.init_from`` names, checked to be a dense run of the
    model ``cfg`` describes (when a checkpoint sidecar says what it was).

    ``model.init_from`` may be a run folder (its newest complete checkpoint), its
    ``checkpoints/`` folder, a checkpoint's ``.json`` sidecar or ``.safetensors`` file, or
    a bare state dict (``.safetensors``, or ``.pt`` / ``.pth`` read with
    ``torch.load(weights_only=True)``). Relative paths are read from ``base_dir``.

    ``tt``: the run is a TT run of this model (its int8 form: ``model.quantize``).

    Raises:
        ConfigError: nothing readable there, or a run of another model (``model.init_from``).
    """

    raw = str(cfg.init_from)
    path = Path(raw).expanduser()
    if not path.is_absolute() and base_dir:
        path = Path(base_dir) / path
    if path.is_dir():
        folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        found = ckpt.latest_checkpoint(folder)
        if found is None:
            raise ConfigError("model.init_from", f"no checkpoint in {path}; name a dense "
                                                 "run's folder or a checkpoint file")
        path = found
    if not path.is_file():
        raise ConfigError("model.init_from", f"not found: {path}")
    meta: dict[str, Any] | None = None
    sidecar = path.suffix == ".json" or (path.suffix == ".safetensors"
                                         and path.with_suffix(".json").is_file())
    if sidecar:
        side = path.with_suffix(".json")
        try:
            meta, tensors = ckpt.load_checkpoint(side)
        except (OSError, ValueError) as exc:
            raise ConfigError("model.init_from", f"cannot read checkpoint {side.name}: "
                                                 f"{_first_line(exc)}") from None
        state = ckpt.model_state(tensors)
    elif path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(path), device="cpu")
        if any(k.startswith("model/") for k in state):
            state = ckpt.model_state(state)
    elif path.suffix in (".pt", ".pth"):
        loaded = torch.load(path, map_location="cpu", weights_only=True)
        state = loaded.get("model", loaded) if isinstance(loaded, dict) else None
        if not isinstance(state, dict):
            raise ConfigError("model.init_from", f"{path.name} holds no state dict")
    else:
        raise ConfigError("model.init_from", f"{path.name}: expected a run folder, a "
                                             ".json/.safetensors checkpoint or a .pt state dict")
    if meta is not None:
        _check_same_model(cfg, meta.get("config", {}).get("model", {}), path, tt)
    return state


#: ``[model]`` keys that may differ between the dense run and the TT run it initialises.
_FREE_KEYS = frozenset({"dense", "tt_layers", "rank", "embedding_rank", "tt_impl", "init_from",
                        "tt_min_rows", "linear_layout", "quantize"})


def _check_same_model(cfg: ModelConfig, saved: dict[str, Any], path: Path,
                      tt: bool = False) -> None:
    if tt and saved.get("dense", False):
        raise ConfigError("model.init_from", f"{path.name} is from a dense run; with "
                                             "model.dense = false model.quantize takes a TT run")
    if not tt and not saved.get("dense", False):
        raise ConfigError("model.init_from", f"{path.name} is from a TT run; TT-SVD starts "
                                             "from a dense run (model.dense = true)")
    mine = {k: v for k, v in dataclasses.asdict(cfg).items()
            if v is not None and k not in _FREE_KEYS}
    theirs = {k: v for k, v in saved.items() if k not in _FREE_KEYS}
    if mine != theirs:
        diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        raise ConfigError("model.init_from", f"{path.name} is a run of another model "
                                             f"(differs in model.{diff[0]}: "
                                             f"{theirs.get(diff[0])!r} there, "
                                             f"{mine.get(diff[0])!r} here)")


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


# --------------------------------------------------------------------------- GaLore

#: Weight matrices with a smaller side than this stay with plain AdamW (a projection of
#: rank >= the side saves nothing: e.g. a 3-class classifier).
GALORE_MIN_SIDE = 8


def galore_optimizer(model: nn.Module, cfg: Config) -> torch.optim.Optimizer:
    """GaLore AdamW (galore-torch) for a dense model: every ``nn.Linear`` weight whose
    smaller side exceeds its projection rank (and :data:`GALORE_MIN_SIDE`) gets a
    low-rank gradient projection (group ``galore``: rank ``train.galore_rank``, default a
    quarter of the smaller side; ``update_proj_gap``, ``scale``; GaLore's ``std``
    projection), every other parameter (embeddings, biases, norms, small heads) plain
    AdamW (group ``dense``). Learning rate ``comera.lr_dense`` (else ``train.lr``), weight
    decay ``comera.weight_decay`` (else AdamW's 0.01), ``eps = 1e-8`` as
    ``torch.optim.AdamW``.

    Raises:
        ConfigError: galore-torch is not installed (``train.optimizer``).
    """
    cls = _galore_class()
    c, t = cfg.comera, cfg.train
    by_rank: dict[int, list[nn.Parameter]] = {}
    projected: set[int] = set()
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.weight.requires_grad:
            side = min(module.weight.shape)
            rank = t.galore_rank if t.galore_rank is not None else max(1, side // 4)
            if side > max(rank, GALORE_MIN_SIDE - 1):
                by_rank.setdefault(rank, []).append(module.weight)
                projected.add(id(module.weight))
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in projected]
    groups: list[dict[str, Any]] = [
        {"name": "galore" if len(by_rank) == 1 else f"galore_r{rank}", "params": params,
         "rank": rank, "update_proj_gap": t.galore_update_proj_gap, "scale": t.galore_scale,
         "proj_type": "std"}
        for rank, params in sorted(by_rank.items())]
    if rest:
        groups.append({"name": "dense", "params": rest})
    lr = c.lr_dense if c.lr_dense is not None else t.lr
    decay = c.weight_decay if c.weight_decay is not None else 0.01  # torch's AdamW default
    return cls(groups, lr=lr, weight_decay=decay, eps=1e-8, no_deprecation_warning=True)


def _galore_class() -> type:
    """:class:`GaLoreAdamW` with a checkpoint-safe state (built on first use)."""
    global _GALORE
    if _GALORE is not None:
        return _GALORE
    try:
        from galore_torch import GaLoreAdamW
        from galore_torch.galore_projector import GaLoreProjector
    except ImportError as exc:
        raise ConfigError(
            "train.optimizer", f'"galore" needs galore-torch, which is not installed ({exc}); '
            "install it with `pip install galore-torch` (or the `peers` extra: "
            "`pip install -e '.[peers]'`), or use train.optimizer = \"adamw\"") from None

    class CheckpointableGaLoreAdamW(GaLoreAdamW):  # type: ignore[misc, valid-type]
        """GaLore AdamW whose ``state_dict`` holds tensors and numbers only: each
        parameter's projector (a Python object) is saved as its matrix
        ``projector_ortho`` and rebuilt from it on load, so checkpoints stay safetensors
        + JSON and a resumed run projects with the same matrices."""

        def state_dict(self) -> dict[str, Any]:
            out = super().state_dict()
            state = {}
            for pid, s in out["state"].items():
                s = dict(s)
                proj = s.pop("projector", None)
                if proj is not None and isinstance(proj.ortho_matrix, Tensor):
                    s["projector_ortho"] = proj.ortho_matrix
                state[pid] = s
            return {**out, "state": state}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            super().load_state_dict(state_dict)
            for group in self.param_groups:
                for p in group["params"]:
                    s = self.state.get(p)
                    if not s or "projector_ortho" not in s:
                        continue
                    proj = GaLoreProjector(group["rank"], update_proj_gap=group["update_proj_gap"],
                                           scale=group["scale"], proj_type=group["proj_type"])
                    proj.ortho_matrix = s.pop("projector_ortho")
                    s["projector"] = proj
                    s["step"] = int(s["step"])

    _GALORE = CheckpointableGaLoreAdamW
    return _GALORE


_GALORE: type | None = None
