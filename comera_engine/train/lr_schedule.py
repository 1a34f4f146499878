"""The trainer's learning rates over a run: ``train.lr_schedule`` and
``train.warmup_steps`` (the ``[train]`` table: comera_engine/config/schema.py).

Every parameter group's rate is its own base rate (``train.lr``, or the ``[comera]`` group
rate that replaces it) times one factor of the step, ``f(i)`` at the 0-based step index
``i`` of ``N = train.steps``, with ``W = train.warmup_steps`` and the decay's start
``D = max(W, hold)``::

    f(i) = (i + 1) / W                        i < W   (linear warm-up, never 0)
    f(i) = 1                                  W ≤ i < D, and always when constant
    f(i) = ½ · (1 + cos(π · (i − D) / (N − D)))   cosine, i ≥ D
    f(i) = 1 − (i − D) / (N − D)                linear, i ≥ D

(the decays reach 0 one step after the last). ``hold`` is the step by which CoMERA's
pace fixes the ranks at the target (:attr:`comera_engine.rank.CoMERA.reach_step`; 0 for
a dense model, fixed ranks or a run without the pace): a network pruned while its rate
falls recovers less from each cut, so the decay runs over the fine-tuning at the final
ranks (``experiments/lr_schedule_check.py``: held, the cosine scores above the same
decay from the warm-up's end on digits and the clothing reviews; neither beats a
constant rate by more than the seeds' spread there). The rank gates keep their rate: it
is the rank schedule's own (:meth:`comera_engine.rank.CoMERA.lr_gates`, the speed at
which a gate can fall to its threshold before the target is due), and decaying it
would leave the size short of the target. A pure function of the step, so a resumed run
continues on the same curve with nothing saved, and a captured CUDA graph follows it
through the groups' rates held as device tensors (:func:`set_rates`). The run says its
schedule once (:func:`rates_text`) and logs each step's rates as ``lr/<group>``.

In your own loop the optimizer is yours, and so is its scheduler: :func:`lr_scheduler`
is this schedule as a ``torch.optim.lr_scheduler.LambdaLR`` over your optimizer, the hold
taken from your controller (``ce.lr_scheduler(opt, "cosine", comera=comera)``). A
scheduler of your own that decays every group from the start (``CosineAnnealingLR``)
leaves the gates at their rate anyway (:class:`comera_engine.rank.optim.RateWatch` sets
it back, and says when the rates fall before the ranks are fixed) but shrinks the
network at a falling rate: in ``experiments/own_loop.py`` the held cosine kept every
network within a point of dense where that one fell behind
(``experiments/results/own_loop_cosine.json``, ``own_loop_cosine-held.json``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from comera_engine.config import LR_SCHEDULES

__all__ = ["decay_start", "lr_factor", "lr_scheduler", "rates_text", "set_rates",
           "tensor_rates"]

#: The optimizer group whose rate no schedule touches (see the module doc).
KEEP = ("gates",)


def decay_start(steps: int, warmup: int = 0, hold: int = 0) -> int:
    """``D = max(W, hold)`` of the module doc, within the run (at most its last step)."""
    return max(warmup, min(hold, steps - 1))


def lr_factor(step: int, steps: int, schedule: str = "constant", warmup: int = 0,
              hold: int = 0) -> float:
    """``f(step)`` of the module doc: the factor on the base rates at 0-based step index
    ``step`` of a ``steps``-step run, warm-up ``warmup``, the decay from ``max(warmup,
    hold)``."""
    if step < warmup:
        return (step + 1) / warmup
    start = decay_start(steps, warmup, hold)
    if schedule == "constant" or step < start:
        return 1.0
    progress = min(1.0, (step - start) / max(1, steps - start))
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "linear":
        return 1.0 - progress
    raise ValueError(f"train.lr_schedule: one of {', '.join(LR_SCHEDULES)}; got {schedule!r}")


def lr_scheduler(optimizer: torch.optim.Optimizer, schedule: str = "cosine", *,
                 comera: Any = None, steps: int | None = None, warmup_steps: int = 0,
                 hold: int | None = None) -> torch.optim.lr_scheduler.LambdaLR:
    """The trainer's schedule for your own loop: a ``LambdaLR`` that sets every group's
    rate to its rate now times :func:`lr_factor` of the step, but the gates' (a group
    named ``gates``: their rate is the rank schedule's). Call its ``step()`` after each
    ``optimizer.step()``, as any scheduler's.

    ``schedule``: ``cosine``, ``linear`` or ``constant``; ``steps``: the run's optimizer
    steps (default ``comera.total_steps``); ``hold``: the decay's earliest start (default
    ``comera.reach_step``, where the pace fixes the ranks; 0 without a controller, for
    the dense baseline give the same number); ``warmup_steps``: a linear warm-up first.
    Bad arguments raise ``ValueError`` naming the argument."""
    if steps is None:
        steps = getattr(comera, "total_steps", None)
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"lr_scheduler: steps must be a positive int (the run's optimizer "
                         f"steps), got {steps!r}; pass steps= or a CoMERA with total_steps")
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"lr_scheduler: schedule must be {', '.join(LR_SCHEDULES[:-1])} or "
                         f"{LR_SCHEDULES[-1]}, got {schedule!r}")
    if not 0 <= warmup_steps < steps:
        raise ValueError(f"lr_scheduler: warmup_steps must be in [0, steps), got "
                         f"{warmup_steps!r} for {steps} steps")
    if hold is None:
        hold = getattr(comera, "reach_step", None) or 0

    def factor(step: int) -> float:
        return lr_factor(step, steps, schedule, warmup_steps, hold)

    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, [(lambda step: 1.0) if g.get("name") in KEEP else factor
                    for g in optimizer.param_groups])


def rates_text(steps: int, schedule: str, warmup: int = 0, hold: int = 0) -> str:
    """The schedule :func:`lr_factor` follows, in one line (the run says it once)."""
    parts = [f"warm-up over {warmup} steps"] if warmup else []
    start = decay_start(steps, warmup, hold)
    if schedule == "constant":
        parts.append("then constant" if warmup else "constant")
    else:
        if start > warmup:
            parts.append(f"held until step {start} (the pace fixes the ranks by then)")
        parts.append(f"{schedule} decay to 0 at step {steps}")
    return "learning rates: " + ", ".join(parts) + "; the rank gates' rate is kept"


def set_rates(optimizer: torch.optim.Optimizer, base: Sequence[float], factor: float) -> None:
    """Set every group's rate to its ``base`` rate times ``factor``, in place (a rate held
    as a tensor is filled, so a captured step reads the new one), but the gates'."""
    for group, rate in zip(optimizer.param_groups, base):
        if group.get("name") in KEEP:
            continue
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(rate * factor)
        else:
            group["lr"] = rate * factor


def tensor_rates(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Hold the scheduled groups' rates as 0-d float32 tensors on ``device``: what a CUDA
    graph of the optimizer step reads at each replay (torch's fused and capturable AdamW
    take a tensor rate); a Python float would be captured as a constant."""
    for group in optimizer.param_groups:
        if group.get("name") not in KEEP and not isinstance(group["lr"], torch.Tensor):
            group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)
