"""What a rank controller reports (:meth:`comera_engine.CoMERA.report`): the compression
in the target's scope against the target, the ranks, the sizes and the one-line verdict;
and the bookkeeping of the other methods the trainer runs through the same controller
(fixed ranks, TT-SVD, a pruned or int8 model: their target and stored bytes).

All counts come from :func:`comera_engine.layers.size_report` (docs/SIZE_AND_TARGET.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from ..config import CoMERAConfig
from ..layers import dense_size_metrics, size_report
from ..metrics import target_outcome, target_status

if TYPE_CHECKING:
    from .controller import CoMERA

__all__ = ["outcome", "report", "size_metrics", "target_of"]


def size_metrics(model: nn.Module, factorized: bool) -> dict[str, float]:
    """Parameters, bytes and compression against the dense model, at the effective ranks
    (``size_report``'s count): ``params/*``, ``bytes/*``, ``compression/*``. A model
    stored in int8 (``model.comera_stored_bytes``) counts those bytes; a model without TT
    layers (``factorized`` false) is its own dense baseline."""
    if not factorized:
        return dense_size_metrics(model)
    rep = size_report(model)
    whole, tensorized = rep["model"], rep["tensorized"]
    stored = getattr(model, "comera_stored_bytes", None)  # its int8 form
    if stored is not None:
        whole = {**whole, "effective_bytes": stored}
    return {
        "params/effective": float(whole["effective_params"]),
        "params/allocated": float(whole["allocated_params"]),
        "params/dense": float(whole["dense_params"]),
        "bytes/effective": float(whole["effective_bytes"]),
        "bytes/dense": float(whole["dense_bytes"]),
        "compression/model": float(whole["compression"]),
        "compression/tensorized": float(tensorized["compression"]),
        "params/tensorized_effective": float(tensorized["effective_params"]),
    }


def target_of(model: nn.Module, cfg: CoMERAConfig, factorized: bool) -> float | None:
    """The target ``model`` is held to: a pruned model's own (``comera_reference``), none
    for an int8 one (judged in bytes), else ``cfg.target_compression`` where there is
    something to compress and a method that aims at it (``None`` otherwise)."""
    ref = getattr(model, "comera_reference", None)
    if ref is not None:  # pruned (its target) / int8 (none: judged in bytes)
        return ref.get("target")
    if not factorized or not (cfg.enabled or cfg.method != "comera"):
        return None
    return cfg.target_compression


def outcome(comera: CoMERA, reached: float | None, final: bool = True) -> str | None:
    """One line on the target at compression ``reached`` (in the target's scope):
    ``"target 20x · reached 20.4x (+2 %)"`` or ``"… missed by X % (why)"`` when
    ``final``; before, progress (:func:`comera_engine.metrics.target_status`):
    ``"target 20x · now 8.1x at step 300 of 1,500 (still training)"``. ``None`` without
    a target."""
    target = comera.target_compression
    if target is None or reached is None:
        return None
    steps = comera.steps_done
    if not final:  # the studio's own words for a run on its way
        return target_status(target, reached, "running", steps, comera.total_steps or None)
    if not comera.enabled:  # a fixed-rank method: the ranks it was given decide
        reason = (f"{comera.cfg.method} keeps the ranks it starts at; ce.tensorize(model, "
                  "config) with this config plans ranks of the target size")
    elif not comera.total_steps:
        reason = ("no total_steps, so no pace planned the size to the target: give "
                  "CoMERA(..., total_steps=...)")
    elif comera.stage_name == "early":
        reason = "the late stage never started"
    else:
        reason = f"the late stage did not prune enough by step {steps}"
    return target_outcome(target, reached, reason)


def report(comera: CoMERA) -> dict[str, Any]:
    """Where the model stands, from ``size_report``: ``compression`` (in the target's
    scope, ``scope``), ``target`` (``None`` without one), ``ranks`` (effective, per TT
    layer), ``params`` (effective, whole model), ``dense_params`` (whole model),
    ``scope_params`` / ``scope_dense_params`` (the same in the target's scope:
    ``compression`` is their ratio), ``stage``, ``step``,
    ``removed`` (rank entries removed by the objective and by the pace), ``schedule``
    (which method ran: ``comera.schedule`` and the switches set against it; the method's
    name when the objective is off) and ``message`` (:func:`outcome`: a verdict once the
    ranks are fixed or the steps are done, progress before)."""
    rep = size_report(comera.model)
    scope = comera.cfg.target_scope
    factorized = comera.has_tt or comera.has_peers
    reached = float(rep[scope]["compression"]) if factorized else 1.0
    steps, total = comera.steps_done, comera.total_steps
    done = comera.frozen or (total > 0 and steps >= total)
    message = outcome(comera, reached, final=done or not total)
    if message is None and not factorized:
        message = "dense model (no TT layers: comera_engine.tensorize makes them); no target"
    elif message is None:
        message = f"{reached:.1f}x smaller than dense ({scope}); no target"
    return {"compression": reached, "scope": scope, "target": comera.target_compression,
            "removed": dict(comera.removed),
            "schedule": comera.schedule if comera.enabled else comera.cfg.method,
            "ranks": comera.effective_ranks(), "params": int(rep["model"]["effective_params"]),
            "dense_params": int(rep["model"]["dense_params"]),
            "scope_params": int(rep[scope]["effective_params"]),
            "scope_dense_params": int(rep[scope]["dense_params"]), "stage": comera.stage,
            "step": steps, "message": message}
