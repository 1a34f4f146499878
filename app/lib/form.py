"""The New experiment form as data: what the widgets collect, and the pure function that
turns it into a run config (no streamlit here, so it is tested like any function)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from comera_engine.config import MAX_NAME, toml_value
from comera_engine.errors import ConfigError

__all__ = ["FormValues", "auto_run_name", "check_all", "form_to_config", "raw_toml"]

T = TypeVar("T")

#: Fields the others are checked against (which model, which data, which task): once
#: one is refused, what the engine says of the rest would be about another config.
DECISIVE_FIELDS = ("model", "model.name", "model.factory", "data", "data.name",
                   "data.factory", "task", "comera", "train")


@dataclass
class FormValues:
    """Every value the New experiment widgets collect.

    ``late_switch`` (``comera.switch``): ``"step"`` (late stage from ``switch_step``),
    ``"plateau"`` (when the loss plateaus, after ``patience`` steps without improvement),
    ``"auto"`` (the engine's default: on a plateau when there is a target) or
    ``"never"``.
    ``device``: ``"cpu"`` or ``"cuda:N"``. ``embedding_rank`` is ``None`` when the model
    has no TT embedding. ``auto_rank``: the initial ranks are chosen from the target
    (``headroom`` × its size, as ``comera train`` does with a config that leaves
    ``model.rank`` unset) and ``rank`` / ``embedding_rank`` are not used. A user model
    (``model.name = "custom"``) has no ``size``; its ``linear_layout`` is
    ``model.tensorize.layout``, and ``task`` (``"classify"`` | ``"regress"``) is the
    run's ``task``.

    ``rates``: the learning rates, weight decay and rate schedule the form shows, ``{"train.lr": x,
    "comera.lr_cores": y, ...}`` (``None``: unset, the optimizer's own ``train.lr``).
    ``kwargs``: a user model's ``model.kwargs`` (``None``: the config's, untouched).
    ``schedule``: ``comera.schedule`` (``None``: the config's). Numbers (``Any``) are
    passed on as typed, never coerced: the engine's validation refuses a wrong type.
    """

    data: dict[str, Any]
    size: str = "tiny"
    dense: bool = False
    use_target: bool = True
    target: Any = 20.0
    scope: str = "tensorized"
    rank: Any = 8
    embedding_rank: Any = None
    auto_rank: bool = False
    headroom: Any = None
    linear_layout: str | None = None  # "tt" | "ttm"; None: the preset's
    late_switch: str = "plateau"
    switch_step: Any = None
    patience: Any = None
    steps: Any = 1000
    batch_size: Any = 32
    seed: Any = 0
    eval_every: Any = 100
    ckpt_every: Any = 500
    precision: str = "auto"
    cuda_graph: bool = True
    device: str = "cpu"
    run_name: str = ""
    task: str | None = None  # a user model's task; None: the preset's
    rates: dict[str, Any] | None = None  # "section.key" -> value or None (unset)
    kwargs: Any = None  # a user model's model.kwargs; None: the preset's
    schedule: str | None = None  # comera.schedule; None: the preset's


def form_to_config(preset: dict[str, Any], v: FormValues) -> tuple[dict[str, Any], str | None]:
    """The run config the form describes, and the GPU ids to launch on (``None``: CPU).

    ``preset`` is the chosen preset's config (left unchanged); every form value replaces
    the field it edits, and the rest of the preset is kept. The dense baseline trains
    without stages and without a target. Nothing is validated, coerced or replaced here
    (``2.5`` steps stay 2.5, a blank run name stays blank): the launcher's validation
    names any bad field.
    """
    raw = copy.deepcopy(preset)
    m = raw.setdefault("model", {})
    c = raw.setdefault("comera", {})
    t = raw.setdefault("train", {})
    raw["name"] = v.run_name  # a blank name is refused by the validation, never replaced
    raw["data"] = dict(v.data)
    user = m.get("name", "custom" if "factory" in m else None) == "custom"
    if v.task is not None:
        raw["task"] = v.task
    m["dense"] = bool(v.dense)
    if user:  # a user model: no size preset; [model.tensorize] says the layout and rank
        tens = dict(m.get("tensorize") or {})
        if v.linear_layout is not None:
            tens["layout"] = v.linear_layout
        if not (v.auto_rank and v.use_target and not v.dense and tens.get("rank") == "auto"):
            tens.pop("rank", None)  # the form's rank (or the plan's) is model.rank
        m["tensorize"] = tens
        if v.kwargs is not None:
            m["kwargs"] = v.kwargs
    else:
        m["preset"] = v.size
        if v.linear_layout is not None:
            m["linear_layout"] = v.linear_layout
    if v.use_target and not v.dense:
        c["target_compression"] = v.target
    else:
        c.pop("target_compression", None)
    if v.auto_rank and "target_compression" in c:  # the plan picks them (docs/SIZE_AND_TARGET)
        m.pop("rank", None)
        m.pop("embedding_rank", None)
        if v.headroom is not None:
            c["headroom"] = v.headroom
    else:
        m["rank"] = v.rank
        if v.embedding_rank is not None:
            m["embedding_rank"] = v.embedding_rank
    c["target_scope"] = v.scope
    if v.late_switch == "step":
        c["switch"] = v.switch_step
    else:
        c["switch"] = v.late_switch
    if v.dense:  # the baseline has no ranks to learn: plain training, no stages
        c["switch"] = "never"
    if v.late_switch in ("plateau", "auto") and v.patience is not None:
        c["plateau_patience"] = v.patience
    if v.schedule is not None:
        c["schedule"] = v.schedule
    for key, value in (v.rates or {}).items():
        section, name = key.split(".", 1)
        table = {"train": t, "comera": c}[section]
        if value is None:
            table.pop(name, None)
        else:
            table[name] = value
    t.update(
        steps=v.steps, batch_size=v.batch_size, seed=v.seed,
        eval_every=v.eval_every, ckpt_every=v.ckpt_every, precision=v.precision,
        cuda_graph=bool(v.cuda_graph), device="cpu" if v.device == "cpu" else "cuda",
    )
    gpu_ids = None if v.device == "cpu" else v.device.split(":", 1)[1]
    return raw, gpu_ids


def auto_run_name(preset: Mapping[str, Any], size: str | None, dense: bool,
                  target: Any) -> str:
    """The name of a run launched from the form without a name typed: the config's own
    name, then what this run asks of it: its model size where it is not the config's,
    then ``dense``, its target (``20×``) or ``no target`` (``target``: the target asked,
    ``None`` for none). ``"mnli-transformer-paper · 20×"``, ``"digits-tt-mlp · small ·
    dense"``. The launch makes it unique (``app.lib.runs.unique_name``)."""
    parts = [str(preset.get("name") or "").strip() or "run"]
    model = preset.get("model") or {}
    if size is not None and size != model.get("preset", "tiny"):
        parts.append(size)
    if dense:
        parts.append("dense")
    elif target is None:
        parts.append("no target")
    else:
        number = isinstance(target, (int, float)) and not isinstance(target, bool)
        parts.append(f"{target:g}×" if number else f"{target}×")
    return " · ".join(parts)[:MAX_NAME]


def check_all(raw: Mapping[str, Any], check: Callable[[dict[str, Any]], T],
              most: int = 40) -> tuple[T | None, list[ConfigError]]:
    """``(check(raw), [])`` when the engine's ``check`` (``resolve_config``) accepts
    ``raw``; else ``(None, problems)``, every problem it finds, one per field, in order.

    The engine stops at its first refusal, so each field it refuses is taken out of a
    copy of ``raw`` (its default stands in) and the copy checked again, until it passes,
    refuses a field that is not there to take out (a missing one) or one already
    refused, or refuses one of :data:`DECISIVE_FIELDS` (the rest would be checked
    against another model, data set or task). ``raw`` is left unchanged."""
    work = copy.deepcopy(dict(raw))
    problems: list[ConfigError] = []
    for _ in range(most):
        try:
            result = check(work)
        except ConfigError as e:
            if any(e.field == p.field for p in problems):
                break
            problems.append(e)
            if e.field in DECISIVE_FIELDS or not _take_out(work, e.field):
                break
            continue
        return (None, problems) if problems else (result, [])
    return None, problems


def _take_out(raw: dict[str, Any], field: str) -> bool:
    """Delete the value at the dotted ``field`` from ``raw``; whether it was there."""
    *tables, key = field.split(".")
    for name in tables:
        raw = raw.get(name)  # type: ignore[assignment]
        if not isinstance(raw, dict):
            return False
    return raw.pop(key, _MISSING) is not _MISSING


_MISSING = object()


def raw_toml(raw: dict[str, Any]) -> str:
    """A config's tables (as the form holds them, not yet validated) as TOML text that
    ``comera train`` reads back to the same tables: top-level values first, then one
    ``[section]`` per table (nested tables inline)."""
    lines = [f"{key} = {toml_value(value)}" for key, value in raw.items()
             if not isinstance(value, dict)]
    for section, table in raw.items():
        if isinstance(table, dict):
            lines += ["", f"[{section}]"]
            lines += [f"{key} = {toml_value(value)}" for key, value in table.items()
                      if value is not None]
    return "\n".join(lines) + "\n"
