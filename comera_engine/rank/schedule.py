"""What ``comera.schedule`` means, torch-free: the switches each schedule sets
(:data:`SCHEDULES`), a config with them resolved, their labels, and the one rule for
when the late stage starts (:func:`switch_plan`), which the rank controller and the
preview both follow.

The config (:mod:`comera_engine.config`) only knows the schedules' names, to refuse an
unknown one; their meaning lives here, beside the method that follows it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from ..config import CoMERAConfig, Config, check_choice
from ..metrics import is_dense_baseline

__all__ = ["SCHEDULES", "SwitchPlan", "method_label", "resolve_schedule", "schedule_label",
           "step_of", "switch_plan"]

#: ``comera.schedule`` → the value of every switch it leaves unset (docs/METHODS.md).
SCHEDULES: dict[str, dict[str, Any]] = {
    "paper": {"late_norm": "initial", "size_off_at_target": False, "plateau_min_drop": 0.0,
              "rank_floor": False, "ranks_from_target": False, "balance": False,
              "gate_speed": False, "deadline": False, "pace": False, "loss_scale": False,
              "keep_task_loss": False},
    "comera": {"late_norm": "current", "size_off_at_target": True, "plateau_min_drop": 0.01,
               "rank_floor": True, "ranks_from_target": True, "balance": True,
               "gate_speed": True, "deadline": True, "pace": False, "loss_scale": True,
               "keep_task_loss": False},
    "paced": {"late_norm": "current", "size_off_at_target": True, "plateau_min_drop": 0.01,
              "rank_floor": True, "ranks_from_target": True, "balance": False,
              "gate_speed": False, "deadline": True, "pace": True, "loss_scale": True,
              "keep_task_loss": True},
}


def resolve_schedule(c: CoMERAConfig) -> CoMERAConfig:
    """``c`` with every switch it leaves unset taken from its ``schedule``
    (:data:`SCHEDULES`); an unknown schedule is refused naming the choices."""
    check_choice("comera.schedule", c.schedule, tuple(SCHEDULES))
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
    plain ``to_dict``): ``"CoMERA, schedule paced"``, ``"fixed-rank TT"`` (``"fixed-rank
    TT (tltorch)"``), ``"TT-SVD of a dense run"`` (``", fine-tuned"`` when it trains),
    ``"dense baseline"``, ``"int8 TT cores of a trained TT run"``."""
    raw = config.to_dict() if isinstance(config, Config) else dict(config or {})
    model, c = raw.get("model") or {}, raw.get("comera") or {}
    train = raw.get("train") or {}
    if model.get("quantize"):
        if model.get("dense"):
            return f"{model['quantize']} weights (torchao) of a trained dense or pruned run"
        return f"{model['quantize']} TT cores of a trained TT run"
    if model.get("dense") and c.get("method") == "prune":
        return "structured pruning (torch-pruning) of a dense run, fine-tuned"
    if is_dense_baseline(raw):
        galore = train.get("optimizer") == "galore"
        return "dense baseline" + (" (GaLore)" if galore else "")
    if model.get("dense"):  # what else a dense model is: compressed embedding tables
        peer = model["kwargs"]["peer"]
        return _PEER_LABELS.get(peer, f"{peer} embedding tables")
    method = c.get("method", "comera")
    if method == "tt_svd":
        return "TT-SVD of a dense run" + (", fine-tuned" if train.get("steps") else "")
    if method != "comera":
        label = {"fixed": "fixed-rank TT"}.get(method, method)
        return label + (" (tltorch)" if model.get("tt_impl") == "tltorch" else "")
    if not c.get("enabled", True):
        return "TT at its initial ranks (comera.enabled = false)"
    known = {f.name for f in dataclasses.fields(CoMERAConfig)}
    try:
        label = schedule_label(CoMERAConfig(**{k: v for k, v in c.items() if k in known}))
    except TypeError:  # a value of the wrong kind in an old record
        label = str(c.get("schedule", "paced"))
    return f"CoMERA, schedule {label}"


#: ``model.kwargs.peer`` of a dense model with compressed embedding tables
#: (comera_engine.layers.embedding_peers), in words
_PEER_LABELS = {"hash": "hashing-trick embedding tables",
                "qr": "quotient-remainder embedding tables",
                "mixed": "mixed-dimension embedding tables", "int8": "int8 embedding tables",
                "tt": "TT embedding tables at fixed ranks"}


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
