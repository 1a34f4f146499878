"""The config's schema: the four dataclasses of a run config (``[model]``, ``[comera]``,
``[train]`` and the whole :class:`Config`) with their defaults, and the names and bounds
the reading and the validation check against (models, layer kinds, methods, the
schedules' names). Torch-free.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

#: Layer kinds that can be TT, per model (``model.tt_layers`` in a config).
TT_LAYER_KINDS: dict[str, tuple[str, ...]] = {
    "transformer_cls": ("embedding", "attention", "ffn", "head"),
    "transformer_mlm": ("embedding", "attention", "ffn", "head"),
    "dlrm": ("embedding", "bottom", "top"),
    "tt_mlp": ("hidden", "output"),
    "custom": (),  # a user model (model.factory): [model.tensorize] says which layers
}
#: The kinds that are TT when a config does not say.
DEFAULT_TT_LAYERS: dict[str, tuple[str, ...]] = {
    "transformer_cls": ("embedding", "attention", "ffn"),
    "transformer_mlm": ("embedding", "attention", "ffn"),
    "dlrm": ("embedding",),
    "tt_mlp": ("hidden",),
    "custom": (),
}
MODEL_NAMES = tuple(TT_LAYER_KINDS)
MAX_NAME = 120  # characters in a run name
#: Bounds on a config, checked before anything else is read or built: the file's size,
#: a --set value's length, how deeply tables and lists nest, and a list's length.
MAX_CONFIG_BYTES = 256 * 1024
MAX_OVERRIDE_CHARS = 4096
MAX_DEPTH = 6
MAX_LIST = 256
PRESETS = ("paper", "small", "tiny")
METHODS = ("comera", "fixed", "tt_svd", "prune")
QUANTIZE = ("int8",)
TT_IMPLS = ("comera", "tltorch")
#: Core layouts of a TT linear weight (model.linear_layout; layers.tt_linear.TTLinear):
#: "tt" (the paper's order-2d train, input factors then output factors) and "ttm" (a TT
#: matrix: one input and one output factor per core).
LINEAR_LAYOUTS = ("tt", "ttm")
OPTIMIZERS = ("adamw", "galore")
#: ``comera.schedule``: which method runs; what each sets is
#: :data:`comera_engine.rank.schedule.SCHEDULES`.
SCHEDULE_NAMES = ("paper", "comera", "paced")
#: The tasks a user model or user data trains on (``task = ...``; models/tasks.py).
USER_TASKS = ("classify", "regress")


@dataclass
class ModelConfig:
    """Which network to build. ``None`` fields take the preset's value."""

    name: str = "transformer_cls"  # transformer_cls | transformer_mlm | dlrm | tt_mlp | custom
    preset: str = "tiny"  # paper | small | tiny
    dense: bool = False  # build the dense baseline (every layer nn.Linear / nn.Embedding)
    tt_layers: list[str] | None = None  # layer kinds in TT form; None: the model's default
    rank: int | None = None  # max TT rank of the linear layers
    embedding_rank: int | None = None  # max TT rank of the embedding tables
    # transformer (both variants)
    d_model: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    d_ff: int | None = None
    dropout: float | None = None
    # tt_mlp
    hidden: list[int] | None = None
    # dlrm
    embedding_dim: int | None = None
    bottom_mlp: list[int] | None = None
    top_mlp: list[int] | None = None
    tt_min_rows: int | None = None  # tables with fewer rows stay dense
    # Which implementation the TT layer kinds get (docs/METHODS.md). None or "comera":
    # the engine's gated TT layers; "tltorch": tensorly-torch's TT-matrix layers (no rank
    # gates: needs comera.method = "fixed"; the optional `peers` extra).
    tt_impl: str | None = None
    # Core layout of the engine's TT linears (docs/METHODS.md). None or "tt": the paper's
    # order-2d train (input factors, then output factors); "ttm": a TT matrix (one input
    # and one output factor per core, as tltorch's blocktt): higher matrix rank at the same
    # size, computed like a dense layer (W materialised each step).
    linear_layout: str | None = None
    # A dense run of the same model (its run folder, checkpoints folder, a checkpoint's
    # .json/.safetensors, or a state dict .safetensors/.pt): comera.method = "tt_svd"
    # initialises every TT layer by TT-SVD of its dense weight and copies the rest;
    # comera.method = "prune" prunes it; model.quantize quantizes it (or a pruned run).
    init_from: str | None = None
    # A user model (model.name = "custom", set by giving a factory): "package.module:function"
    # returning an nn.Module, called with kwargs (and the data facts it names as
    # parameters: in_features, num_classes, cardinalities, vocab_size, seq_len)
    factory: str | None = None
    kwargs: dict[str, Any] | None = None
    # which of its layers become TT: include / exclude (globs of module names), rank (an
    # integer, or "auto": from the target), layout ("tt" | "ttm"), min_features
    tensorize: dict[str, Any] | None = None
    # "int8": the model of model.init_from with torchao weight-only int8 weights,
    # evaluated (train.steps = 0; docs/METHODS.md; the optional `peers` extra)
    quantize: str | None = None


@dataclass
class CoMERAConfig:
    """Rank-adaptive multi-objective training (method page, section 2) and the optimiser."""

    enabled: bool = True  # false: plain task-loss training (ranks fixed)
    # How the TT model is trained (docs/METHODS.md): "comera" (rank gates, the two stages,
    # the target), "fixed" (gate-free TT at fixed ranks: with a target, the ranks that make
    # the model that size) or "tt_svd" ("fixed" initialised by TT-SVD of model.init_from)
    method: str = "comera"
    gamma: float = 0.01  # early stage: weight of the size surrogate
    gamma_warmup: int = 0  # steps over which gamma ramps up from 0
    tau: float = 1e-2  # gate threshold: |g| <= tau prunes a rank for good
    l2_cores: float = 0.0  # optional small l2 on TT cores (early stage)
    target_compression: float | None = None  # late stage target (>1): dense / target size
    target_scope: str = "tensorized"  # model | tensorized: what the ratio is measured on
    # late stage after this many steps, "plateau", "never", or "auto" (plateau if a target)
    switch: int | str = "auto"
    switch_epoch: int | None = None  # late stage after this many epochs (instead of steps)
    plateau_patience: int = 200  # steps without improvement that count as a plateau
    plateau_min_delta: float = 1e-3  # relative improvement that resets the patience
    rho_f: float = 0.1  # late stage augmentation on the task loss
    rho_s: float = 0.01  # late stage augmentation on the size surrogate
    # Which method runs (docs/METHODS.md, "Schedules"): "paper" (the spec's objective and
    # nothing else), "comera" (the objective with our additions, no pace: the objective
    # alone decides how many ranks go) or "paced" (the additions and the pace). Each
    # addition below is its own switch; unset (None), it takes the schedule's value.
    schedule: str = "paced"
    # the late stage divides the size surrogate by the cores' current size ("current")
    # or by their initial size, as the paper does ("initial")
    late_norm: str | None = None
    # once the size is at the target, the late stage's size terms are off (λ = 0, no ρ_S)
    size_off_at_target: bool | None = None
    # a loss plateau counts only once the smoothed loss is this much (relative) below its
    # start: a network still at chance is not switched to the late stage (0: off)
    plateau_min_drop: float | None = None
    # no bond loses its last entry (the paper lets a layer become the zero map)
    rank_floor: bool | None = None
    # initial ranks chosen from the target (docs/SIZE_AND_TARGET.md) unless model.rank
    # is fixed; off: the preset's ranks
    ranks_from_target: bool | None = None
    # each live rank entry's scale is moved from its two core slices into its gate every
    # balance_every steps (comera_engine/rank/balance.py): a gate can no longer shrink
    # while its slices grow back, so the size objective prunes by itself
    balance: bool | None = None
    balance_every: int = 10
    # a set lr_gates is raised to the schedule's gate rate where lower: (1 - tau) over a
    # tenth of the steps before the target is due (comera_engine/rank/optim.py, gate_lr;
    # Adam moves a gate by about its lr a step). Without lr_gates the gates learn at the
    # schedule's rate anyway.
    gate_speed: bool | None = None
    # with a target and a step budget, the late stage starts by switch_by of the steps at
    # the latest, whatever switch says (the pace needs it; the paper switches on the
    # plateau alone)
    deadline: bool | None = None
    # Reaching the target within the run (docs/SIZE_AND_TARGET.md). pace: the size follows
    # a planned path from the late stage's start to the target by reach_at of the steps;
    # ranks that lag the path are pruned by gate importance, and once the target size is
    # reached the ranks are fixed (the rest of the run fine-tunes). false: the objective
    # alone (the size may stop short of the target).
    pace: bool | None = None
    switch_by: float = 0.5  # the late stage starts by this fraction of the steps at the latest
    reach_at: float = 0.8  # the size is at the target by this fraction of the steps
    # initial ranks chosen from a target start at about this many times the target size
    # (only when model.rank is not fixed; docs/SIZE_AND_TARGET.md)
    headroom: float = 3.0
    # Learning rates and weight decay of the optimizer's groups (rank/optim.py,
    # param_groups). Unset (None): the optimizer's own (train.lr in `comera train`, the
    # lr a user's optimizer is given in their loop); the gates' rate then follows the
    # schedule (rank/optim.py, gate_lr).
    lr_cores: float | None = None
    # the TT embedding tables' cores in their own group (None: with the other cores). A
    # table's rows move only through shared cores and may want a larger step
    # (docs/RESULTS.md, the SNLI note under "Where the claims are missed").
    lr_embedding: float | None = None
    lr_gates: float | None = None
    lr_dense: float | None = None
    weight_decay: float | None = None


@dataclass
class TrainConfig:
    """The training loop."""

    steps: int = 1000
    batch_size: int = 32  # per process; the global batch is batch_size * world size
    eval_every: int = 100  # 0: only at the end
    eval_batches: int | None = None  # cap on eval batches (None: the whole eval split)
    ckpt_every: int = 500  # 0: only at stage changes and at the end
    keep_checkpoints: int = 2  # newest checkpoints kept on disk (plus the stage one)
    grad_clip: float = 1.0  # max gradient norm; 0 turns clipping off
    precision: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    cuda_graph: bool = True  # capture the whole step into a CUDA graph (GPU only)
    seed: int = 0
    # the optimizer's learning rate: every parameter group's unless [comera] sets the
    # group's own (lr_cores, lr_embedding, lr_dense; the gates follow the schedule)
    lr: float = 1e-3
    num_workers: int = 0  # background batch-building processes
    # adamw (CoMERA's groups) | galore: GaLore AdamW (galore-torch) on the dense model's
    # linear weight matrices, AdamW on every other parameter (docs/METHODS.md)
    optimizer: str = "adamw"
    galore_rank: int | None = None  # projection rank; None: a quarter of each matrix's smaller side
    galore_update_proj_gap: int = 200  # steps between recomputing the projections (SVD)
    galore_scale: float = 0.25  # GaLore's alpha: scale of the projected-back update


@dataclass
class Config:
    """A whole run."""

    name: str = "run"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: dict[str, Any] = field(default_factory=dict)
    comera: CoMERAConfig = field(default_factory=CoMERAConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    #: The task of a user model or user data: "classify", "regress" or
    #: {factory = "module:function", kwargs = {...}}; None: the dataset's own task.
    task: str | dict[str, Any] | None = None
    #: Folder that relative data paths are resolved from (not part of the file).
    base_dir: str | None = field(default=None, compare=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (the TOML tables), ``None`` values left out."""
        out: dict[str, Any] = {"name": self.name}
        if self.task is not None:
            out["task"] = self.task
        for section in ("model", "data", "comera", "train"):
            obj = getattr(self, section)
            values = dict(obj) if isinstance(obj, dict) else dataclasses.asdict(obj)
            out[section] = {k: v for k, v in values.items() if v is not None}
        return out


SECTIONS: dict[str, type] = {"model": ModelConfig, "comera": CoMERAConfig, "train": TrainConfig}

_TRANSFORMERS = ("transformer_cls", "transformer_mlm")
#: Model fields that only some models have.
MODEL_FIELDS: dict[str, tuple[str, ...]] = {
    "d_model": _TRANSFORMERS,
    "n_layers": _TRANSFORMERS,
    "n_heads": _TRANSFORMERS,
    "d_ff": _TRANSFORMERS,
    "hidden": ("tt_mlp",),
    "embedding_dim": ("dlrm",),
    "bottom_mlp": ("dlrm",),
    "top_mlp": ("dlrm",),
    "tt_min_rows": ("dlrm",),
    "embedding_rank": (*_TRANSFORMERS, "dlrm", "custom"),
}

#: ``[model.tensorize]`` keys of a user model and what each must be.
TENSORIZE_KEYS = {"include": "a list of module-name globs", "exclude": "a list of "
                  "module-name globs", "rank": 'a positive integer or "auto"',
                  "embedding_rank": "a positive integer", "layout": '"tt" or "ttm"',
                  "min_features": "a positive integer"}
