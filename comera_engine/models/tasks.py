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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

TASKS = ("classification", "nli", "text", "mlm", "ctr")
IGNORE_INDEX = -100


class TaskModel(nn.Module):
    """Wraps ``model`` with the loss and counts of ``task``."""

    def __init__(self, model: nn.Module, task: str) -> None:
        super().__init__()
        if task not in TASKS:
            raise ValueError(f"task: unknown task {task!r} (known: {', '.join(TASKS)})")
        self.model = model
        self.task = task

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
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


def roc_auc(scores: torch.Tensor, targets: torch.Tensor) -> float:
    """Area under the ROC curve (ties get half credit); NaN if only one class is present.

    Computed from ranks (Mann-Whitney U): ``(sum of positive ranks - P(P+1)/2) / (P N)``.
    """
    scores = scores.double().flatten()
    pos = targets.flatten() > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = torch.argsort(scores)
    sorted_scores = scores[order]
    ranks = torch.empty_like(scores)
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=torch.float64)
    # average the ranks of tied scores
    uniq, inverse, counts = torch.unique_consecutive(
        sorted_scores, return_inverse=True, return_counts=True
    )
    ends = torch.cumsum(counts, 0).double()
    mean_rank = ends - (counts.double() - 1) / 2
    ranks[order] = mean_rank[inverse]
    u = ranks[pos].sum() - n_pos * (n_pos + 1) / 2
    return float(u / (n_pos * n_neg))
