"""Task heads: a model plus its loss and accuracy, called on a whole batch dict.

``TaskModel(model, task)(batch)`` returns 0-d tensors ``loss`` (mean task loss, fp32),
``correct`` and ``count`` (for accuracy), and per-example ``scores``/``targets`` for
metrics that need them (AUC for click prediction). The trainer (and DDP, which must see
the forward call) only ever calls this wrapper, so the models keep a plain
tensors-in/logits-out ``forward`` for export.

Tasks and batch keys (see ``comera_engine.data.DataBundle``):
``classification`` (``x``, ``labels``), ``nli`` and ``text`` (``input_ids``,
``token_type_ids``, ``attention_mask``, ``labels``: a sentence pair, or a text's parts,
one class each), ``mlm`` (``input_ids``, ``attention_mask``, ``labels``
with -100 on positions that are not predicted) and ``ctr`` (``dense``, ``sparse``,
``labels`` in {0, 1}).

The tasks of user models and user data (``task = ...`` in a config, :func:`run_task`):
``classify`` (cross-entropy; accuracy, and AUC for two classes), ``regress`` (MSE;
``eval/rmse`` and ``eval/r2``) and a :class:`UserTask` from ``task.factory`` (its loss
function, and its metrics function over the whole eval split). These call the model on
the batch's inputs in order: every key but ``labels`` (``x``, ``categorical``,
``input_ids`` for ``data.name = "files"``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from comera_engine.metrics import roc_auc

TASKS = ("classification", "nli", "text", "mlm", "ctr", "classify", "regress")
IGNORE_INDEX = -100


@dataclass(frozen=True)
class UserTask:
    """A task from ``task.factory``: ``loss(outputs, labels) -> 0-d tensor`` and
    ``metrics(outputs, labels) -> {name: float}`` over the whole eval split (logged as
    ``eval/<name>``)."""

    spec: str
    loss: Callable[[Any, torch.Tensor], torch.Tensor]
    metrics: Callable[[torch.Tensor, torch.Tensor], dict[str, float]] | None


def run_task(cfg: Any, data: Any) -> str | UserTask:
    """The task a run trains: the config's ``task`` (``"classify"``, ``"regress"``, or
    ``task.factory``, imported and called here) else the dataset's own.

    Raises:
        ConfigError: ``task.factory`` does not import, is not callable, raises, or does
            not return ``(loss_fn, metrics_fn)``.
    """
    import os

    from comera_engine.entry import call_entry, resolve_entry
    from comera_engine.errors import ConfigError

    task = getattr(cfg, "task", None)
    if task is None:
        return data.task
    if isinstance(task, str):
        return task
    spec = task["factory"]
    fn = resolve_entry(spec, "task.factory", (os.getcwd(),))
    made = call_entry(fn, spec, "task.factory", dict(task.get("kwargs") or {}))
    if isinstance(made, tuple) and len(made) == 2 and callable(made[0]) and (
            made[1] is None or callable(made[1])):
        return UserTask(spec, made[0], made[1])
    raise ConfigError("task.factory", f"{spec} returned {type(made).__name__}; return "
                                      "(loss_fn, metrics_fn): loss_fn(outputs, labels) -> "
                                      "tensor, metrics_fn(outputs, labels) -> dict or None")


class TaskModel(nn.Module):
    """Wraps ``model`` with the loss and counts of ``task`` (a name of :data:`TASKS` or a
    :class:`UserTask`)."""

    def __init__(self, model: nn.Module, task: str | UserTask) -> None:
        super().__init__()
        if not isinstance(task, UserTask) and task not in TASKS:
            raise ValueError(f"task: unknown task {task!r} (known: {', '.join(TASKS)})")
        self.model = model
        self.user_task = task if isinstance(task, UserTask) else None
        self.task = "user" if isinstance(task, UserTask) else task

    @property
    def has_accuracy(self) -> bool:
        """Whether ``correct / count`` is an accuracy (not for regression or user tasks)."""
        return self.task not in ("regress", "user")

    def eval_metrics(self, scores: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
        """Metrics over the whole eval split from the per-example ``scores`` and
        ``targets`` the forward returned: AUC (two classes, clicks), RMSE and R²
        (regression), or the user task's own."""
        if self.user_task is not None:
            if self.user_task.metrics is None:
                return {}
            from comera_engine.errors import ConfigError

            try:
                found = self.user_task.metrics(scores, targets)
                return {f"eval/{k}": float(v) for k, v in dict(found).items()}
            except Exception as exc:
                raise ConfigError("task.factory", f"{self.user_task.spec}'s metrics function "
                                  f"raised {type(exc).__name__}: {exc}") from None
        if self.task == "regress":
            err = scores.double() - targets.double()
            mse = float((err**2).mean())
            var = float(((targets.double() - targets.double().mean()) ** 2).mean())
            return {"eval/rmse": math.sqrt(mse),
                    "eval/r2": 1.0 - mse / var if var > 0 else float("nan")}
        return {"eval/auc": roc_auc(scores, targets)}

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.task in ("classify", "regress", "user"):
            inputs = [v for k, v in batch.items() if k != "labels"]
            out = self.model(*inputs)
            if self.task == "classify":
                return _classify(out, batch["labels"])
            if self.task == "regress":
                return _regress(out, batch["labels"])
            return self._user(out, batch["labels"])
        if self.task == "classification":
            return _classify(self.model(batch["x"]), batch["labels"])
        if self.task in ("nli", "text"):
            logits = self.model(
                batch["input_ids"], batch.get("token_type_ids"), batch.get("attention_mask")
            )
            return _classify(logits, batch["labels"])
        if self.task == "mlm":
            return self._mlm(batch)
        return _click(self.model(batch["dense"], batch["sparse"]), batch["labels"])

    def _mlm(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        labels = batch["labels"]
        predict = labels != IGNORE_INDEX
        args = (batch["input_ids"], batch.get("token_type_ids"), batch.get("attention_mask"))
        if _static_shapes_needed(labels):
            # Under CUDA-graph capture shapes must not depend on the data: score every
            # position and let the ignore index drop the unmasked ones (same loss).
            logits = self.model(*args).flatten(0, 1)
            targets = labels.flatten()
        else:
            logits = self.model(*args, select=predict)  # [n_masked, V]
            targets = labels[predict]
        logits = logits.float()
        count = predict.sum().float()
        loss_sum = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
        loss = loss_sum / count.clamp(min=1.0)
        hit = (logits.argmax(-1) == targets) & (targets != IGNORE_INDEX)
        return {
            "loss": loss,
            "correct": hit.sum().float(),
            "count": count,
            "scores": logits.new_zeros(0),
            "targets": logits.new_zeros(0),
        }


    def _user(self, out: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        assert self.user_task is not None
        loss = self.user_task.loss(out, labels)
        zero = loss.new_zeros(())
        return {"loss": loss.float(), "correct": zero,
                "count": loss.new_full((), float(labels.shape[0])),
                "scores": out.detach().float(), "targets": labels.detach().float()}


def _regress(pred: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """Mean squared error; the predictions and targets (flattened) for RMSE and R²."""
    pred = pred.float().reshape(labels.shape[0], -1)
    target = labels.float().reshape(labels.shape[0], -1)
    if pred.shape != target.shape:
        raise ValueError(f"task: regress needs outputs of shape {list(target.shape)} (one per "
                         f"target), the model gave {list(pred.shape)}")
    loss = F.mse_loss(pred, target)
    return {"loss": loss, "correct": loss.new_zeros(()),
            "count": loss.new_full((), float(labels.shape[0])),
            "scores": pred.detach().flatten(), "targets": target.flatten()}


def _static_shapes_needed(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _classify(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """Cross-entropy and hits; with two classes also the class-1 probabilities as
    ``scores`` (the evaluation's AUC, telling more than the accuracy when one class
    dominates)."""
    logits = logits.float()
    loss = F.cross_entropy(logits, labels)
    correct = (logits.argmax(-1) == labels).sum().float()
    binary = logits.shape[-1] == 2
    return {
        "loss": loss,
        "correct": correct,
        "count": logits.new_full((), float(labels.numel())),
        "scores": torch.softmax(logits.detach(), -1)[:, 1] if binary else logits.new_zeros(0),
        "targets": labels.float() if binary else logits.new_zeros(0),
    }


def _click(logit: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    logit = logit.float()
    target = labels.float()
    loss = F.binary_cross_entropy_with_logits(logit, target)
    correct = ((logit > 0) == (target > 0.5)).sum().float()
    return {
        "loss": loss,
        "correct": correct,
        "count": logit.new_full((), float(labels.numel())),
        "scores": torch.sigmoid(logit.detach()),
        "targets": target,
    }


