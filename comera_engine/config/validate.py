"""Validating a config: ranges and the consistency of its settings (a model's fields,
the ``[comera]`` section, the peer methods' switches, a user model's keys, the task, the
run name), each refusal a :class:`~comera_engine.errors.ConfigError` naming the field.
Torch-free.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from typing import Any

from ..errors import ConfigError
from .schema import (
    ANY_NUMBER,
    BOUNDS,
    DATA_BOUNDS,
    LINEAR_LAYOUTS,
    LR_SCHEDULES,
    MAX_NAME,
    METHODS,
    MODEL_FIELDS,
    MODEL_NAMES,
    OPTIMIZERS,
    PRESETS,
    QUANTIZE,
    SCHEDULE_NAMES,
    TENSORIZE_BOUNDS,
    TENSORIZE_KEYS,
    TT_IMPLS,
    TT_LAYER_KINDS,
    USER_TASKS,
    Bound,
    CoMERAConfig,
    Config,
    ModelConfig,
)


def validate(cfg: Config) -> None:
    """Range and consistency checks (types were checked while building)."""
    m, c, t = cfg.model, cfg.comera, cfg.train
    check_choice("model.name", m.name, MODEL_NAMES)
    check_choice("model.preset", m.preset, PRESETS)
    for key, models in MODEL_FIELDS.items():
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
    check_choice("train.precision", t.precision, ("auto", "fp32", "bf16"))
    if t.device not in ("auto", "cpu", "cuda") and not (
        t.device.startswith("cuda:") and t.device[5:].isdigit()
    ):
        raise ConfigError("train.device", f"must be auto, cpu, cuda or cuda:N, got {t.device!r}")


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
            refuse_unknown(f"model.tensorize.{key}",
                           [f"model.tensorize.{k}" for k in TENSORIZE_KEYS])
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
        if key in TENSORIZE_BOUNDS:
            check_number(f"model.tensorize.{key}", value, TENSORIZE_BOUNDS[key])


def _validate_shrink(cfg: Config) -> None:
    """``comera.method = "prune"`` and ``model.quantize``: of a dense run's model."""
    m, c, t = cfg.model, cfg.comera, cfg.train
    if m.quantize is not None:
        check_choice("model.quantize", m.quantize, QUANTIZE)
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
    check_choice("comera.method", c.method, METHODS)
    if m.tt_impl is not None:
        check_choice("model.tt_impl", m.tt_impl, TT_IMPLS)
    if m.linear_layout is not None:
        check_choice("model.linear_layout", m.linear_layout, LINEAR_LAYOUTS)
    if m.linear_layout == "tt" and m.tt_impl == "tltorch" and not m.dense:
        raise ConfigError("model.linear_layout", 'tltorch linears are TT matrices ("ttm"), '
                                                 'not the "tt" layout: set it to "ttm", drop '
                                                 'it, or set model.tt_impl = "comera"')
    check_choice("train.optimizer", t.optimizer, OPTIMIZERS)
    check_choice("train.lr_schedule", t.lr_schedule, LR_SCHEDULES)
    if t.steps and t.warmup_steps >= t.steps:
        raise ConfigError("train.warmup_steps", f"must be below train.steps ({t.steps}), "
                                                f"got {t.warmup_steps}")
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


def validate_comera(c: CoMERAConfig) -> None:
    """Type, range and consistency checks of the ``[comera]`` section (also run by the
    objective, so settings built in code are checked the same way)."""
    check_types("comera", c)
    check_choice("comera.method", c.method, METHODS)
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
    check_choice("comera.target_scope", c.target_scope, ("model", "tensorized"))
    check_choice("comera.schedule", c.schedule, SCHEDULE_NAMES)
    if c.late_norm is not None:
        check_choice("comera.late_norm", c.late_norm, ("current", "initial"))
    if c.plateau_min_drop is not None and not 0.0 <= c.plateau_min_drop < 1.0:
        raise ConfigError("comera.plateau_min_drop",
                          f"must be a fraction in [0, 1) (0: off), got {c.plateau_min_drop}")
    if isinstance(c.switch, str):
        check_choice("comera.switch", c.switch, ("auto", "plateau", "never"))
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


def check_number(field: str, value: Any, bound: Bound) -> None:
    """Refuse a number (or a list's numbers) outside ``bound``, naming ``field`` and the
    range (one line); anything that is not a number is left to the type checks."""
    for v in value if isinstance(value, list) else [value]:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        problem = bound.problem(v)
        if problem is not None:
            raise ConfigError(field, problem)


def check_data_numbers(data: dict[str, Any]) -> None:
    """Every number of a ``[data]`` table within its key's bound
    (:data:`~comera_engine.config.schema.DATA_BOUNDS`, else finite and within
    ±10^15); nested tables (a factory's ``kwargs``) are the user's own."""
    for key, value in data.items():
        if not isinstance(value, dict):
            check_number(f"data.{key}", value, DATA_BOUNDS.get(str(key), ANY_NUMBER))


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
        check_choice("task", task, USER_TASKS)
        return task
    if not isinstance(task, dict):
        raise ConfigError("task", f'must be "classify", "regress" or a table with factory, '
                                  f"got {task!r}")
    for key in task:
        if key not in ("factory", "kwargs"):
            refuse_unknown(f"task.{key}", ["task.factory", "task.kwargs"])
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
    if any(0xD800 <= ord(ch) <= 0xDFFF for ch in name):  # undecodable bytes of an argument
        raise ConfigError(field, "is not valid UTF-8 text (bytes of another encoding); "
                                 "type the name in UTF-8")
    return name.strip()


def refuse_unknown(key: str, candidates: list[str]) -> None:
    """Refuse the unknown key ``key``, naming the closest of ``candidates``."""
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise ConfigError(key, f"unknown key{hint}")


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    """Refuse ``value`` of field ``name`` unless it is one of ``choices`` (naming the
    closest one and every choice)."""
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


def check_types(section: str, obj: Any) -> None:
    """Every field of ``obj``, a config section built in code (``CoMERAConfig(...)``),
    against its annotation and bounds, as a TOML value is read: a string where a number
    is due, ``enabled="no"``, is refused in one line naming ``section.field``."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, full = getattr(obj, f.name), f"{section}.{f.name}"
        coerce_value(full, value, hints[f.name])
        if full in BOUNDS:
            check_number(full, value, BOUNDS[full])


def coerce_value(full: str, value: Any, tp: Any) -> Any:
    """Check ``value`` against the annotation ``tp``; ints are accepted for floats."""
    ok, out = _match(value, tp)
    if not ok:
        allowed = f" (allowed: {BOUNDS[full].text()})" if full in BOUNDS else ""
        if (isinstance(value, float) and value.is_integer() and abs(value) < 2**63
                and _match(int(value), tp)[0]):  # 1e9 or 100.0 where an integer is due
            beyond = BOUNDS[full].problem(int(value)) if full in BOUNDS else None
            raise ConfigError(full, beyond or f"must be an integer, got {value!r}: write it "
                                              f"as {int(value)}, without a decimal point or "
                                              "exponent")
        raise ConfigError(full, f"must be {_describe(tp)}, got {value!r}{allowed}")
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
        try:
            return True, float(value)
        except OverflowError:  # an integer past any float: the bounds refuse it
            return True, math.inf if value > 0 else -math.inf
    if tp is str:
        return isinstance(value, str), value
    return True, value


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        parts = [_describe(a) for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(parts)
    if origin is list:  # "a list of integers", not "a list of an integers"
        item = _describe(typing.get_args(tp)[0]).removeprefix("an ").removeprefix("a ")
        return f"a list of {item}s"
    if origin is dict:
        return "a table"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
        tp, str(tp)
    )
