"""Run configuration, torch-free: four plain dataclasses, loaded from TOML, overridden
by ``--set``.

A config file has a top-level ``name`` and four tables::

    name = "digits-tt"

    [model]     # ModelConfig: which network, its size preset, which layers are TT
    [data]      # free-form table handed to comera_engine.data.build_dataset (it checks it)
    [comera]    # CoMERAConfig: rank adaptivity, the two stages, AdamW learning rates
    [train]     # TrainConfig: steps, batch size, eval/checkpoint cadence, device, precision

Everything is validated up front by :func:`load_config` / :func:`config_from_dict`:
unknown keys (with a "did you mean" suggestion), wrong types and out-of-range values
raise :class:`~comera_engine.errors.ConfigError` whose message names the field, e.g.
``train.batch_sise: unknown key (did you mean train.batch_size?)``.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from comera_engine.errors import ConfigError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the tomli backport has the same API
    import tomli as tomllib  # type: ignore[no-redef]

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


# --------------------------------------------------------------------------- loading


def load_config(
    path: str | Path, overrides: list[str] | None = None, base_dir: str | Path | None = None
) -> Config:
    """Read a TOML config, apply ``--set`` overrides, validate everything but the data.

    Relative data paths are resolved from ``base_dir`` (default: the current folder).
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError("config", f"file not found: {path}")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise ConfigError("config", f"{path.name} is {path.stat().st_size:,} bytes; a run "
                          f"config is at most {MAX_CONFIG_BYTES // 1024} KB")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("config", f"{path.name} is not valid TOML ({exc})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError("config", f"{path.name} is not UTF-8 text (byte {exc.start}); "
                                    "save it as UTF-8") from None
    except RecursionError:
        raise ConfigError("config", f"{path.name} nests values too deeply (at most "
                          f"{MAX_DEPTH} levels)") from None
    for item in overrides or []:
        apply_override(raw, item)
    cfg = config_from_dict(raw)
    cfg.base_dir = str(Path(base_dir).resolve()) if base_dir else str(Path.cwd())
    return cfg


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply one ``section.key=value`` override to the raw dict (value read as TOML)."""
    if len(item) > MAX_OVERRIDE_CHARS:
        raise ConfigError("--set", f"a value of {len(item):,} characters; at most "
                          f"{MAX_OVERRIDE_CHARS:,} (put long settings in the config file)")
    if "=" not in item:
        raise ConfigError("--set", f"expected section.key=value, got {item!r}")
    key, text = item.split("=", 1)
    key = key.strip()
    parts = key.split(".")
    if not all(parts) or len(parts) > 2:
        raise ConfigError("--set", f"expected section.key=value, got {item!r}")
    value = parse_value(text.strip())
    if len(parts) == 1:
        raw[parts[0]] = value
        return
    section = raw.setdefault(parts[0], {})
    if not isinstance(section, dict):
        raise ConfigError(parts[0], "is a value, not a table; cannot set a key inside it")
    section[parts[1]] = value


def parse_value(text: str) -> Any:
    """A TOML literal (``64``, ``1e-3``, ``true``, ``"x"``, ``[1, 2]``); bare words are strings."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
    except RecursionError:
        raise ConfigError("--set", f"the value nests too deeply (at most {MAX_DEPTH} "
                          "levels)") from None


def check_bounds(raw: Any, where: str = "", depth: int = 1) -> None:
    """Refuse a raw config (nested tables and lists) nested deeper than
    :data:`MAX_DEPTH` or with a list longer than :data:`MAX_LIST`, naming the field
    (the walk stops at that depth, so it never recurses far)."""
    if depth > MAX_DEPTH:
        raise ConfigError(where or "config", f"nested more than {MAX_DEPTH} levels deep")
    if isinstance(raw, dict):
        for key, value in raw.items():
            check_bounds(value, f"{where}.{key}" if where else str(key), depth + 1)
    elif isinstance(raw, list):
        if len(raw) > MAX_LIST:
            raise ConfigError(where or "config", f"a list of {len(raw):,} entries; at most "
                              f"{MAX_LIST}")
        for value in raw:
            check_bounds(value, where, depth + 1)


def config_from_dict(raw: dict[str, Any]) -> Config:
    """Build and validate a :class:`Config` from nested plain values (TOML tables)."""
    check_bounds(raw)
    allowed_top = {"name", "task", "model", "data", "comera", "train"}
    for key in raw:
        if key not in allowed_top:
            _unknown(key, sorted(allowed_top) + _all_field_names())
    name = check_run_name(raw.get("name", "run"))
    data = raw.get("data", {})
    if not isinstance(data, dict):
        raise ConfigError("data", "must be a table ([data])")
    if "factory" in data and "name" not in data:  # data.factory alone: user datasets
        data = {"name": "factory", **data}
    if "name" not in data:
        raise ConfigError("data.name", "missing; name a dataset (e.g. digits, snli, code_mlm, "
                                       "files)")
    sections = {}
    for section, cls in SECTIONS.items():
        values = raw.get(section, {})
        if not isinstance(values, dict):
            raise ConfigError(section, f"must be a table ([{section}])")
        if section == "model" and "factory" in values and "name" not in values:
            values = {"name": "custom", **values}  # model.factory alone: a user model
        sections[section] = _build_section(section, cls, values)
    cfg = Config(name=name.strip(), data=dict(data), task=check_task(raw.get("task")),
                 **sections)
    validate(cfg)
    m = cfg.model
    for key in ("rank", "embedding_rank"):  # a fixed [model.tensorize] rank is the model's
        value = (m.tensorize or {}).get(key)
        if isinstance(value, int) and getattr(m, key) is None:
            setattr(m, key, value)
    return cfg


#: The tasks a user model or user data trains on (``task = ...``; models/tasks.py).
USER_TASKS = ("classify", "regress")


def check_entry_point(value: Any, field: str) -> str:
    """A ``"package.module:function"`` string (dotted names on both sides), else a
    ConfigError naming ``field``; nothing is imported here."""
    if not isinstance(value, str) or value.count(":") != 1:
        raise ConfigError(field, f'must be "package.module:function", got {value!r}')
    module, function = value.split(":")
    if not all(p.isidentifier() for p in module.split(".")) or not all(
            p.isidentifier() for p in function.split(".")):
        raise ConfigError(field, f'must be "package.module:function" (Python names), got '
                                 f"{value!r}")
    return value


def check_task(task: Any) -> str | dict[str, Any] | None:
    """``task``: ``None``, one of :data:`USER_TASKS`, or a table with ``factory``
    (``"module:function"`` returning ``(loss_fn, metrics_fn)``) and optional ``kwargs``."""
    if task is None:
        return None
    if isinstance(task, str):
        _choice("task", task, USER_TASKS)
        return task
    if not isinstance(task, dict):
        raise ConfigError("task", f'must be "classify", "regress" or a table with factory, '
                                  f"got {task!r}")
    for key in task:
        if key not in ("factory", "kwargs"):
            _unknown(f"task.{key}", ["task.factory", "task.kwargs"])
    if "factory" not in task:
        raise ConfigError("task.factory", 'missing; give "module:function" returning '
                                          "(loss_fn, metrics_fn), or set task = \"classify\"")
    check_entry_point(task["factory"], "task.factory")
    if not isinstance(task.get("kwargs", {}), dict):
        raise ConfigError("task.kwargs", f"must be a table, got {task['kwargs']!r}")
    return dict(task)


def check_run_name(name: Any, field: str = "name") -> str:
    """A run name, stripped: a non-empty string of at most :data:`MAX_NAME` characters
    without control characters (newlines, tabs, terminal escapes); else ConfigError."""
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(field, f"must be a non-empty string, got {name!r}")
    if len(name) > MAX_NAME:
        raise ConfigError(field, f"at most {MAX_NAME} characters, got {len(name)}; "
                                 "choose a shorter run name")
    if any(ord(ch) < 32 or 127 <= ord(ch) < 160 for ch in name):
        raise ConfigError(field, "control characters (newlines, tabs, terminal escapes) "
                                 "are not allowed in a run name; use plain text")
    return name.strip()


def _all_field_names() -> list[str]:
    return [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


def _unknown(key: str, candidates: list[str]) -> None:
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise ConfigError(key, f"unknown key{hint}")


def _build_section(section: str, cls: type, values: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        full = f"{section}.{key}"
        if key not in names:
            _unknown(full, [f"{section}.{n}" for n in names] + _all_field_names())
        kwargs[key] = _coerce(full, value, hints[key])
    return cls(**kwargs)


def _coerce(full: str, value: Any, tp: Any) -> Any:
    """Check ``value`` against the annotation ``tp``; ints are accepted for floats."""
    ok, out = _match(value, tp)
    if not ok:
        raise ConfigError(full, f"must be {_describe(tp)}, got {value!r}")
    return out


def _match(value: Any, tp: Any) -> tuple[bool, Any]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            ok, out = _match(value, arg)
            if ok:
                return True, out
        return False, None
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            return False, None
        items = [_match(v, item_tp) for v in value]
        return all(ok for ok, _ in items), [v for _, v in items]
    if origin is dict:
        return isinstance(value, dict), value
    if tp is type(None):
        return value is None, None
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False, None
        return True, float(value)
    if tp is str:
        return isinstance(value, str), value
    return True, value


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        parts = [_describe(a) for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(parts)
    if origin is list:
        return f"a list of {_describe(typing.get_args(tp)[0])}s"
    if origin is dict:
        return "a table"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
        tp, str(tp)
    )


# --------------------------------------------------------------------------- validation


def validate(cfg: Config) -> None:
    """Range and consistency checks (types were checked while building)."""
    m, c, t = cfg.model, cfg.comera, cfg.train
    _choice("model.name", m.name, MODEL_NAMES)
    _choice("model.preset", m.preset, PRESETS)
    for key, models in _MODEL_FIELDS.items():
        if getattr(m, key) is not None and m.name not in models:
            raise ConfigError(
                f"model.{key}", f"does not apply to {m.name} (only to {', '.join(models)})"
            )
    if m.tt_layers is not None:
        kinds = TT_LAYER_KINDS[m.name]
        for kind in m.tt_layers:
            if kind not in kinds:
                raise ConfigError(
                    "model.tt_layers",
                    f"{kind!r} is not a layer kind of {m.name} (choose from {', '.join(kinds)})",
                )
    for key in ("rank", "embedding_rank", "d_model", "n_layers", "n_heads", "d_ff"):
        _positive_int(f"model.{key}", getattr(m, key))
    for key in ("embedding_dim",):
        _positive_int(f"model.{key}", getattr(m, key))
    for key in ("hidden", "bottom_mlp", "top_mlp"):
        widths = getattr(m, key)
        if widths is not None:
            for w in widths:
                if w < 1:
                    raise ConfigError(f"model.{key}", f"widths must be positive, got {widths}")
    if m.tt_min_rows is not None and m.tt_min_rows < 0:
        raise ConfigError("model.tt_min_rows", f"must be >= 0, got {m.tt_min_rows}")
    if m.dropout is not None and not 0.0 <= m.dropout < 1.0:
        raise ConfigError("model.dropout", f"must be in [0, 1), got {m.dropout}")
    if m.d_model is not None and m.n_heads is not None and m.d_model % m.n_heads:
        raise ConfigError("model.n_heads", f"must divide d_model={m.d_model}, got {m.n_heads}")

    validate_user_model(m)
    validate_comera(c)
    validate_methods(cfg)

    if not (t.steps == 0 and m.init_from is not None):  # 0: evaluate an initialised model
        _positive_int("train.steps", t.steps)
    _positive_int("train.batch_size", t.batch_size)
    for key in ("eval_every", "ckpt_every", "num_workers"):
        if getattr(t, key) < 0:
            raise ConfigError(f"train.{key}", f"must be >= 0, got {getattr(t, key)}")
    _positive_int("train.eval_batches", t.eval_batches)
    _positive_int("train.keep_checkpoints", t.keep_checkpoints)
    _nonneg("train.grad_clip", t.grad_clip)
    if not (math.isfinite(t.lr) and t.lr > 0):
        raise ConfigError("train.lr", f"must be a positive number, got {t.lr}")
    _choice("train.precision", t.precision, ("auto", "fp32", "bf16"))
    if t.device not in ("auto", "cpu", "cuda") and not (
        t.device.startswith("cuda:") and t.device[5:].isdigit()
    ):
        raise ConfigError("train.device", f"must be auto, cpu, cuda or cuda:N, got {t.device!r}")


#: ``[model.tensorize]`` keys of a user model and what each must be.
TENSORIZE_KEYS = {"include": "a list of module-name globs", "exclude": "a list of "
                  "module-name globs", "rank": 'a positive integer or "auto"',
                  "embedding_rank": "a positive integer", "layout": '"tt" or "ttm"',
                  "min_features": "a positive integer"}


def validate_user_model(m: ModelConfig) -> None:
    """A user model's keys (``model.factory``, ``model.kwargs``, ``[model.tensorize]``),
    and that a built-in model names none of them. Nothing is imported here: whether the
    factory imports and builds a module is checked when the model is built (before a run
    is created)."""
    if m.name != "custom":
        for key in ("factory", "kwargs", "tensorize"):
            if getattr(m, key) is not None:
                raise ConfigError(f"model.{key}", f'is for a user model (model.name = "custom", '
                                                  f"the default with model.factory), not "
                                                  f"{m.name}; drop it or model.name")
        return
    if m.factory is None:
        raise ConfigError("model.factory", 'missing; a "custom" model is built by '
                                           '"package.module:function" returning an nn.Module')
    check_entry_point(m.factory, "model.factory")
    for key in ("tt_impl", "linear_layout", "tt_layers", "init_from"):
        if getattr(m, key) is not None:
            fix = {"linear_layout": "model.tensorize.layout",
                   "tt_layers": "model.tensorize.include / exclude"}.get(key)
            raise ConfigError(f"model.{key}", "does not apply to a user model (model.factory)"
                              + (f"; use {fix}" if fix else "; drop it"))
    t = m.tensorize or {}
    for key, value in t.items():
        if key not in TENSORIZE_KEYS:
            _unknown(f"model.tensorize.{key}", [f"model.tensorize.{k}" for k in TENSORIZE_KEYS])
        ok = {
            "include": isinstance(value, list) and all(isinstance(v, str) for v in value),
            "exclude": isinstance(value, list) and all(isinstance(v, str) for v in value),
            "rank": value == "auto" or (isinstance(value, int) and not isinstance(value, bool)
                                        and value >= 1),
            "embedding_rank": isinstance(value, int) and not isinstance(value, bool)
            and value >= 1,
            "layout": value in LINEAR_LAYOUTS,
            "min_features": isinstance(value, int) and not isinstance(value, bool)
            and value >= 1,
        }[key]
        if not ok:
            raise ConfigError(f"model.tensorize.{key}", f"must be {TENSORIZE_KEYS[key]}, got "
                                                        f"{value!r}")


def _validate_shrink(cfg: Config) -> None:
    """``comera.method = "prune"`` and ``model.quantize``: of a dense run's model."""
    m, c, t = cfg.model, cfg.comera, cfg.train
    if m.quantize is not None:
        _choice("model.quantize", m.quantize, QUANTIZE)
        if t.steps != 0:
            raise ConfigError("train.steps", "model.quantize evaluates a trained run's "
                                             "quantized model: set train.steps = 0")
    what = "model.quantize" if m.quantize is not None else 'comera.method = "prune"'
    if m.init_from is None:
        raise ConfigError("model.init_from", f"{what} starts from a trained dense (or "
                                             "pruned) run: name its run folder or checkpoint")
    if not m.dense and m.quantize is None:  # a TT run's int8: its cores, per core
        raise ConfigError("model.dense", f"{what} works on the dense model; set "
                                         "model.dense = true")
    if c.method == "prune" and m.quantize is None and c.target_compression is None:
        raise ConfigError("comera.target_compression", 'comera.method = "prune" prunes to '
                                                       "the target's size: set a target")


def validate_methods(cfg: Config) -> None:
    """The peer methods' switches (docs/METHODS.md) against each other: ``comera.method``,
    ``model.tt_impl``, ``model.init_from`` and ``train.optimizer`` with its settings."""
    m, c, t = cfg.model, cfg.comera, cfg.train
    _choice("comera.method", c.method, METHODS)
    if m.tt_impl is not None:
        _choice("model.tt_impl", m.tt_impl, TT_IMPLS)
    if m.linear_layout is not None:
        _choice("model.linear_layout", m.linear_layout, LINEAR_LAYOUTS)
    if m.linear_layout == "tt" and m.tt_impl == "tltorch" and not m.dense:
        raise ConfigError("model.linear_layout", 'tltorch linears are TT matrices ("ttm"), '
                                                 'not the "tt" layout: set it to "ttm", drop '
                                                 'it, or set model.tt_impl = "comera"')
    _choice("train.optimizer", t.optimizer, OPTIMIZERS)
    if m.tt_impl == "tltorch" and not m.dense and c.method == "tt_svd":
        raise ConfigError("model.tt_impl", 'TT-SVD initialises the engine\'s TT layers; use '
                                           'model.tt_impl = "comera" with comera.method = '
                                           '"tt_svd"')
    if m.tt_impl == "tltorch" and not m.dense and c.method != "fixed":
        raise ConfigError("comera.method", f"tltorch layers have no rank gates, so "
                                           f"{c.method!r} cannot train them; set "
                                           'comera.method = "fixed"')
    if c.method == "tt_svd":
        if m.init_from is None:
            raise ConfigError("model.init_from", 'comera.method = "tt_svd" decomposes a '
                                                 "trained dense model: name its run folder "
                                                 "or checkpoint")
        if m.dense:
            raise ConfigError("model.dense", 'comera.method = "tt_svd" builds the TT model; '
                                             "set model.dense = false")
    elif c.method == "prune" or m.quantize is not None:
        _validate_shrink(cfg)
    elif m.init_from is not None:
        raise ConfigError("model.init_from", 'is only read by comera.method = "tt_svd" / '
                                             '"prune" and by model.quantize (method is '
                                             f"{c.method!r}); drop it or set the method")
    if m.init_from is not None and not m.init_from.strip():
        raise ConfigError("model.init_from", "must name a run folder or checkpoint, got ''")
    if t.steps == 0 and m.init_from is None:
        raise ConfigError("train.steps", "must be a positive integer, got 0 (0 evaluates "
                                         "without training: only with model.init_from)")
    if t.optimizer == "galore" and not m.dense:
        raise ConfigError("train.optimizer", "GaLore optimises the dense model's weight "
                                             "matrices; set model.dense = true (TT models "
                                             'use train.optimizer = "adamw")')
    _positive_int("train.galore_rank", t.galore_rank)
    _positive_int("train.galore_update_proj_gap", t.galore_update_proj_gap)
    if not (math.isfinite(t.galore_scale) and t.galore_scale > 0):
        raise ConfigError("train.galore_scale", f"must be a positive number, got {t.galore_scale}")


#: ``comera.schedule`` → the value of every switch it leaves unset (docs/METHODS.md).
SCHEDULES: dict[str, dict[str, Any]] = {
    "paper": {"late_norm": "initial", "size_off_at_target": False, "plateau_min_drop": 0.0,
              "rank_floor": False, "ranks_from_target": False, "balance": False,
              "gate_speed": False, "deadline": False, "pace": False},
    "comera": {"late_norm": "current", "size_off_at_target": True, "plateau_min_drop": 0.01,
               "rank_floor": True, "ranks_from_target": True, "balance": True,
               "gate_speed": True, "deadline": True, "pace": False},
    "paced": {"late_norm": "current", "size_off_at_target": True, "plateau_min_drop": 0.01,
              "rank_floor": True, "ranks_from_target": True, "balance": False,
              "gate_speed": False, "deadline": True, "pace": True},
}


def resolve_schedule(c: CoMERAConfig) -> CoMERAConfig:
    """``c`` with every switch it leaves unset taken from its ``schedule``
    (:data:`SCHEDULES`); an unknown schedule is refused naming the choices."""
    _choice("comera.schedule", c.schedule, tuple(SCHEDULES))
    unset = {k: v for k, v in SCHEDULES[c.schedule].items() if getattr(c, k) is None}
    return dataclasses.replace(c, **unset) if unset else c


def schedule_label(c: CoMERAConfig) -> str:
    """The schedule, and the switches set against it: ``"paced"``,
    ``"comera (pace on)"``."""
    own = SCHEDULES.get(c.schedule, {})
    changed = [f"{k} {_word(getattr(c, k))}" for k, v in own.items()
               if getattr(c, k) is not None and getattr(c, k) != v]
    return c.schedule + (f" ({', '.join(changed)})" if changed else "")


def method_label(config: Any) -> str:
    """Which method trained a run, in words, from its config (a :class:`Config` or its
    plain ``to_dict``): ``"CoMERA, schedule paced"``, ``"fixed-rank TT"``,
    ``"TT-SVD of a dense run"``, ``"dense baseline"``."""
    raw = config.to_dict() if isinstance(config, Config) else dict(config or {})
    model, c = raw.get("model") or {}, raw.get("comera") or {}
    if model.get("quantize"):
        return f"{model['quantize']} weights (torchao) of a trained run"
    if model.get("dense") and c.get("method") == "prune":
        return "structured pruning (torch-pruning) of a dense run, fine-tuned"
    if model.get("dense"):
        galore = (raw.get("train") or {}).get("optimizer") == "galore"
        return "dense baseline" + (" (GaLore)" if galore else "")
    method = c.get("method", "comera")
    if method != "comera":
        return {"fixed": "fixed-rank TT", "tt_svd": "TT-SVD of a dense run"}.get(method, method)
    if not c.get("enabled", True):
        return "TT at its initial ranks (comera.enabled = false)"
    known = {f.name for f in dataclasses.fields(CoMERAConfig)}
    try:
        label = schedule_label(CoMERAConfig(**{k: v for k, v in c.items() if k in known}))
    except TypeError:  # a value of the wrong kind in an old record
        label = str(c.get("schedule", "paced"))
    return f"CoMERA, schedule {label}"


def _word(value: Any) -> str:
    return {True: "on", False: "off"}.get(value, str(value)) if isinstance(value, bool) else (
        f"{value:g}" if isinstance(value, float) else str(value))


@dataclass(frozen=True)
class SwitchPlan:
    """When the late stage starts, by the ``[comera]`` switch rule (:func:`switch_plan`):
    ``switch`` a step, ``"plateau"`` or ``"never"``; ``latest`` the step by which it
    starts whatever ``switch`` says (``None``: no deadline); ``reach``
    the step by which the pace lands the size at the target (``None``: no pace)."""

    switch: int | str
    latest: int | None
    reach: int | None


def step_of(fraction: float, steps: int) -> int:
    """The step at ``fraction`` of ``steps`` (at least 1): ``ceil(fraction · steps)``."""
    return max(1, math.ceil(fraction * steps))


def switch_plan(c: CoMERAConfig, steps: int, steps_per_epoch: int = 0) -> SwitchPlan:
    """The one switch rule, for the rank controller and the preview alike: ``comera.switch``
    (``"auto"``: on a loss plateau with a target, else never) or ``comera.switch_epoch``
    epochs (with ``steps_per_epoch``); with a target and a step budget the late stage
    starts by ``switch_by`` of the steps at the latest when ``comera.deadline`` or the
    pace is on, and with the pace the size is at the target by ``reach_at`` of them."""
    c = resolve_schedule(c)
    switch: int | str = c.switch
    if c.switch_epoch is not None and steps_per_epoch:
        switch = c.switch_epoch * steps_per_epoch
    if switch == "auto":
        switch = "plateau" if c.target_compression is not None else "never"
    budget = c.target_compression is not None and steps > 0
    pacing = bool(c.pace and budget)
    due = pacing or bool(c.deadline and budget)  # the pace always needs its deadline
    latest = step_of(c.switch_by, steps) if due and switch != "never" else None
    return SwitchPlan(switch, latest, step_of(c.reach_at, steps) if pacing else None)


def validate_comera(c: CoMERAConfig) -> None:
    """Range and consistency checks of the ``[comera]`` section (also run by the
    objective, so settings built in code are checked the same way)."""
    _nonneg("comera.gamma", c.gamma)
    if isinstance(c.balance_every, bool) or not isinstance(c.balance_every, int) or (
            c.balance_every < 1):
        raise ConfigError("comera.balance_every",
                          f"must be a whole number of steps >= 1, got {c.balance_every!r}")
    if c.gamma_warmup < 0:
        raise ConfigError("comera.gamma_warmup", f"must be >= 0, got {c.gamma_warmup}")
    _nonneg("comera.l2_cores", c.l2_cores)
    if not 0.0 <= c.tau < 1.0:
        raise ConfigError("comera.tau", f"must be in [0, 1), got {c.tau}")
    if c.target_compression is not None and not (
            math.isfinite(c.target_compression) and c.target_compression > 1.0):
        raise ConfigError(
            "comera.target_compression",
            f"must be a finite ratio > 1 (e.g. 50 for 50x smaller), got {c.target_compression}",
        )
    _choice("comera.target_scope", c.target_scope, ("model", "tensorized"))
    _choice("comera.schedule", c.schedule, tuple(SCHEDULES))
    if c.late_norm is not None:
        _choice("comera.late_norm", c.late_norm, ("current", "initial"))
    if c.plateau_min_drop is not None and not 0.0 <= c.plateau_min_drop < 1.0:
        raise ConfigError("comera.plateau_min_drop",
                          f"must be a fraction in [0, 1) (0: off), got {c.plateau_min_drop}")
    if isinstance(c.switch, str):
        _choice("comera.switch", c.switch, ("auto", "plateau", "never"))
    elif c.switch < 0:
        raise ConfigError(
            "comera.switch", f"must be a step >= 0, 'auto', 'plateau' or 'never', got {c.switch}"
        )
    if c.switch_epoch is not None:
        if isinstance(c.switch_epoch, bool) or not isinstance(c.switch_epoch, int) or (
                c.switch_epoch < 0):
            raise ConfigError("comera.switch_epoch",
                              f"must be a whole number of epochs >= 0, got {c.switch_epoch!r}")
        if c.switch not in ("auto",):
            raise ConfigError("comera.switch_epoch",
                              f"give either comera.switch ({c.switch!r}) or comera.switch_epoch, "
                              "not both")
        if c.enabled and c.method == "comera" and c.target_compression is None:
            raise ConfigError("comera.target_compression",
                              "the late stage (comera.switch_epoch) needs a target compression "
                              "ratio; set one or drop comera.switch_epoch")
    if (c.enabled and c.method == "comera" and c.switch not in ("never", "auto")
            and c.target_compression is None):
        raise ConfigError(
            "comera.target_compression",
            f"the late stage (comera.switch = {c.switch!r}) needs a target compression ratio; "
            'set one or use comera.switch = "never"',
        )
    for key in ("switch_by", "reach_at"):
        value = getattr(c, key)
        if not (math.isfinite(value) and 0.0 < value <= 1.0):
            raise ConfigError(f"comera.{key}",
                              f"must be a fraction of the steps in (0, 1], got {value}")
    if c.switch_by >= c.reach_at:
        raise ConfigError("comera.switch_by",
                          f"must be below comera.reach_at ({c.reach_at}): the late stage needs "
                          f"steps to reach the target; got {c.switch_by}")
    if not (math.isfinite(c.headroom) and c.headroom >= 1.0):
        raise ConfigError("comera.headroom",
                          f"must be a number >= 1 (the start size over the target size), "
                          f"got {c.headroom}")
    _positive_int("comera.plateau_patience", c.plateau_patience)
    _nonneg("comera.plateau_min_delta", c.plateau_min_delta)
    for key in ("rho_f", "rho_s"):
        _nonneg(f"comera.{key}", getattr(c, key))
    if c.weight_decay is not None:
        _nonneg("comera.weight_decay", c.weight_decay)
    for key in ("lr_cores", "lr_embedding", "lr_gates", "lr_dense"):
        value = getattr(c, key)
        if value is None:
            continue
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"comera.{key}", f"must be a positive number, got {value}")


_TRANSFORMERS = ("transformer_cls", "transformer_mlm")
#: Model fields that only some models have.
_MODEL_FIELDS: dict[str, tuple[str, ...]] = {
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
METHODS = ("comera", "fixed", "tt_svd", "prune")
QUANTIZE = ("int8",)
TT_IMPLS = ("comera", "tltorch")
#: Core layouts of a TT linear weight (model.linear_layout; layers.tt_linear.TTLinear):
#: "tt" (the paper's order-2d train, input factors then output factors) and "ttm" (a TT
#: matrix: one input and one output factor per core).
LINEAR_LAYOUTS = ("tt", "ttm")
OPTIMIZERS = ("adamw", "galore")


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        close = difflib.get_close_matches(value, choices, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(name, f"unknown value {value!r}{hint}; choose from {', '.join(choices)}")


def _positive_int(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise ConfigError(name, f"must be a positive integer, got {value}")


def _nonneg(name: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ConfigError(name, f"must be a finite number >= 0, got {value}")


# --------------------------------------------------------------------------- writing


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML text (what ``--print-config`` shows)."""
    d = cfg.to_dict()
    lines = [f"name = {_toml_value(d['name'])}"]
    if "task" in d:
        lines.append(f"task = {_toml_value(d['task'])}")
    for section in ("model", "data", "comera", "train"):
        lines += ["", f"[{section}]"]
        lines += [f"{k} = {_toml_value(v)}" for k, v in d[section].items()]
    return "\n".join(lines) + "\n"


def _toml_key(key: str) -> str:
    """A table key: bare when it may be, else quoted."""
    return key if key and all(ch.isascii() and (ch.isalnum() or ch in "_-") for ch in key) \
        else json.dumps(key)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}"
                                for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {value!r} as TOML")
