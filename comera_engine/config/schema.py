"""The config's schema: the four dataclasses of a run config (``[model]``, ``[comera]``,
``[train]`` and the whole :class:`Config`) with their defaults, and the names and bounds
the reading and the validation check against (models, layer kinds, methods, the
schedules' names). Torch-free.
"""

from __future__ import annotations

import dataclasses
import math
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
#: ``train.lr_schedule`` (comera_engine/train/lr_schedule.py)
LR_SCHEDULES = ("constant", "cosine", "linear")
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
    # the late stage's λ = 1 adds the size term to the task loss, which keeps its weight
    # (1 + ρ_f), instead of trading it down to ρ_f as the paper does: the gates go on
    # learning what each rank entry is worth to the task while the size presses them
    keep_task_loss: bool | None = None
    # a loss plateau counts only once the smoothed loss is this much (relative) below its
    # start: a network still at chance is not switched to the late stage (0: off)
    plateau_min_drop: float | None = None
    # no bond loses its last entry (the paper lets a layer become the zero map)
    rank_floor: bool | None = None
    # the size terms are weighed in the task loss's own units: scaled by f0 / ln 2, f0
    # where the loss starts (its first value, the untrained network's), when below ln 2 (the
    # paper's weights are set for a classifier's cross-entropy, which starts at ln K >=
    # ln 2; an MSE starting at 0.2 would weigh 3.5x less against the size, and a network
    # can be pruned into one that answers a constant)
    loss_scale: bool | None = None
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
    # the learning rates over the run (comera_engine/train/lr_schedule.py): constant |
    # cosine | linear decay to 0 at the last step, after warmup_steps rising linearly
    # from lr/warmup_steps; every group's but the gates' (theirs follows the rank schedule)
    lr_schedule: str = "constant"
    warmup_steps: int = 0
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


@dataclass(frozen=True)
class Bound:
    """The values a numeric setting may take: ``lo``..``hi`` (an end open where said),
    whole numbers only where ``integer``; ``what`` says it in words (``"a positive
    integer"``), ``also`` lists values outside the range that are allowed (``train.steps
    = 0`` with ``model.init_from``: the validation checks that). Every integer and float
    of a config has one (:data:`BOUNDS`, :data:`DATA_BOUNDS`), checked when a config is
    read, before anything is built: the CLI, the launcher and the New experiment form
    share them, so no typed number reaches the trainer as an overflow."""

    lo: float
    hi: float
    what: str
    integer: bool = False
    lo_open: bool = False
    hi_open: bool = False
    also: tuple[float, ...] = ()
    #: ``what`` states the whole range (a fraction in [0, 1)): said for any value outside
    says_range: bool = False

    def holds(self, value: float) -> bool:
        """Whether ``value`` (an int or a float; NaN and infinities never) is allowed."""
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if value in self.also:
            return True
        above = value > self.lo if self.lo_open else value >= self.lo
        below = value < self.hi if self.hi_open else value <= self.hi
        return above and below

    def text(self) -> str:
        """The range as a user reads it: ``1..1,000,000,000``, ``(0, 1]``."""
        if self.integer and not (self.lo_open or self.hi_open):
            return f"{int(self.lo):,}..{int(self.hi):,}"
        return (f"{'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}"
                f"{')' if self.hi_open else ']'}")

    def problem(self, value: Any) -> str | None:
        """``None`` when ``value`` is allowed; else what to say after the field's name."""
        if self.holds(value):
            return None
        if value > self.lo and not self.says_range and not (
                isinstance(value, float) and math.isinf(value)):
            return f"{show_number(value)} is too large (allowed: {self.text()})"
        return f"must be {self.what}, got {show_number(value)} (allowed: {self.text()})"


def show_number(value: Any) -> str:
    """A number as a message shows it: a huge integer by its size, not 10,000 digits."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**21:
        digits = len(str(abs(value))) if abs(value) < 10**4000 else None
        sign = "-" if value < 0 else ""
        return (f"{sign}{float(abs(value)):.3g}" if digits and digits < 300
                else f"a {'negative ' if value < 0 else ''}number of {digits or 'over 4,000'} "
                     "digits")
    return repr(value)


_STEPS = 10**9  # steps, cadences and step counts: a billion steps is far past any run
_SEED = 2**63 - 1  # torch.manual_seed and numpy take a 63-bit seed
_WIDTH = 10**7  # a layer's width
_RATE = 1e3  # learning rates, weights of loss terms


def _int(lo: int, hi: int, what: str = "", also: tuple[float, ...] = ()) -> Bound:
    what = what or ("a positive integer" if lo == 1 else f"an integer >= {lo}")
    return Bound(lo, hi, what, integer=True, also=also)


def _num(lo: float, hi: float, what: str = "", lo_open: bool = False,
         hi_open: bool = False) -> Bound:
    what = what or ("a positive number" if lo == 0 and lo_open else
                    "a finite number >= 0" if lo == 0 else f"a finite number >= {lo:g}")
    return Bound(lo, hi, what, lo_open=lo_open, hi_open=hi_open)


def _part(lo: float, hi: float, what: str, lo_open: bool = False,
          hi_open: bool = False) -> Bound:
    """A fraction, rate or probability: ``what`` says its whole range."""
    return Bound(lo, hi, what, lo_open=lo_open, hi_open=hi_open, says_range=True)


_FRACTION = _part(0.0, 1.0, "a fraction in [0, 1)", hi_open=True)

#: Every integer and float field of ``[model]``, ``[comera]`` and ``[train]`` (a list's
#: entries for a list of integers), by its full name.
BOUNDS: dict[str, Bound] = {
    "model.rank": _int(1, 100_000),
    "model.embedding_rank": _int(1, 100_000),
    "model.d_model": _int(1, 1_000_000),
    "model.n_layers": _int(1, 10_000),
    "model.n_heads": _int(1, 100_000),
    "model.d_ff": _int(1, _WIDTH),
    "model.dropout": _FRACTION,
    "model.hidden": _int(1, _WIDTH, "a list of positive widths"),
    "model.embedding_dim": _int(1, 1_000_000),
    "model.bottom_mlp": _int(1, _WIDTH, "a list of positive widths"),
    "model.top_mlp": _int(1, _WIDTH, "a list of positive widths"),
    "model.tt_min_rows": _int(0, 10**12),
    "comera.gamma": _num(0.0, _RATE),
    "comera.gamma_warmup": _int(0, _STEPS),
    "comera.tau": _FRACTION,
    "comera.l2_cores": _num(0.0, _RATE),
    "comera.target_compression": _num(1.0, 1e12, "a finite ratio > 1 (e.g. 50 for 50x "
                                      "smaller)", lo_open=True),
    "comera.switch": _int(0, _STEPS, "a step >= 0, 'auto', 'plateau' or 'never'"),
    "comera.switch_epoch": _int(0, 1_000_000, "a whole number of epochs >= 0"),
    "comera.plateau_patience": _int(1, _STEPS),
    "comera.plateau_min_delta": _num(0.0, _RATE),
    "comera.rho_f": _num(0.0, _RATE),
    "comera.rho_s": _num(0.0, _RATE),
    "comera.plateau_min_drop": _part(0.0, 1.0, "a fraction in [0, 1) (0: off)", hi_open=True),
    "comera.balance_every": _int(1, _STEPS, "a whole number of steps >= 1"),
    "comera.switch_by": _part(0.0, 1.0, "a fraction of the steps in (0, 1]", lo_open=True),
    "comera.reach_at": _part(0.0, 1.0, "a fraction of the steps in (0, 1]", lo_open=True),
    "comera.headroom": _num(1.0, 1e6, "a number >= 1 (the start size over the target "
                            "size)"),
    "comera.lr_cores": _num(0.0, _RATE, lo_open=True),
    "comera.lr_embedding": _num(0.0, _RATE, lo_open=True),
    "comera.lr_gates": _num(0.0, _RATE, lo_open=True),
    "comera.lr_dense": _num(0.0, _RATE, lo_open=True),
    "comera.weight_decay": _num(0.0, _RATE),
    "train.steps": _int(1, _STEPS, also=(0,)),  # 0: evaluate only, with model.init_from
    "train.batch_size": _int(1, 100_000_000),
    "train.eval_every": _int(0, _STEPS),
    "train.eval_batches": _int(1, _STEPS),
    "train.ckpt_every": _int(0, _STEPS),
    "train.keep_checkpoints": _int(1, 1_000_000),
    "train.grad_clip": _num(0.0, 1e9),
    "train.seed": _int(0, _SEED),
    "train.lr": _num(0.0, _RATE, lo_open=True),
    "train.warmup_steps": _int(0, _STEPS),
    "train.num_workers": _int(0, 1024),
    "train.galore_rank": _int(1, 1_000_000),
    "train.galore_update_proj_gap": _int(1, _STEPS),
    "train.galore_scale": _num(0.0, _RATE, lo_open=True),
}

#: ``[data]`` settings by key (whatever the dataset; a builder checks more, e.g. that a
#: key is its own). A number under any other key is held to :data:`ANY_NUMBER`.
DATA_BOUNDS: dict[str, Bound] = {
    "seed": _int(0, 2**62),  # the builders add offsets to it
    "split_fraction": _part(0.0, 1.0, "a fraction strictly between 0 and 1 (the share of "
                           "the examples used for training, e.g. 0.8)", lo_open=True,
                           hi_open=True),
    "seq_len": _int(1, 1_000_000),
    "vocab_size": _int(1, 100_000_000),
    "min_frequency": _int(0, 10**12),
    "max_examples": _int(1, 10**12),
    "max_eval_examples": _int(1, 10**12),
    "max_files": _int(1, 10**9),
    "max_bytes": _int(1, 2**50),
    "max_rows": _int(1, 10**12),
    "num_samples": _int(2, 10**10),
    "bucket_sizes": _int(1, 10**9, "a positive bucket count (or a list of them)"),
    "planted_features": _int(0, 10**6, "feature indices >= 0"),
    "rank": _int(1, 100_000),
    "mlm_probability": _part(0.0, 1.0, "a probability in (0, 1)", lo_open=True,
                            hi_open=True),
    "signal": _num(0.0, 100.0),
    "dense_signal": _num(0.0, 100.0),
    "base_rate": _part(0.0, 1.0, "a rate in (0, 1)", lo_open=True, hi_open=True),
    "missing_rate": _part(0.0, 0.99, "a rate in [0, 0.99]"),
}

#: Any other number in ``[data]`` (a user dataset's own settings are its factory's).
ANY_NUMBER = _num(-1e15, 1e15, "a finite number")

#: ``[model.tensorize]``'s numbers (a user model's).
TENSORIZE_BOUNDS: dict[str, Bound] = {
    "rank": _int(1, 100_000, 'a positive integer or "auto"'),
    "embedding_rank": _int(1, 100_000),
    "min_features": _int(1, 10**9),
}
