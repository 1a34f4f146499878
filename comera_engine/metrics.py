"""The one metrics sink interface the trainer writes through, and the metrics' maths.

The trainer calls a :class:`MetricsSink`; where the records go (a JSONL file in the run
folder, the SQLite run store, both) is the sink's business. Records are plain JSON-able
values so every sink can persist them without knowing the trainer. The scores a run or a
data set reports (:func:`roc_auc`, :func:`log_loss`) and the target's outcome are
computed here, once, for the trainer, the data generators and the dashboard.
"""

from __future__ import annotations

import errno
import json
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class MetricsSink(Protocol):
    """What the trainer needs from a metrics destination.

    - ``log_metrics(step, {"loss/task": 0.7, ...})``: scalar metrics at a step.
    - ``log_ranks(step, {"encoder.0.attn.q": [12, 30, 30, 30, 12], ...})``: effective
      bond ranks per TT layer.
    - ``log_event(kind, text, step)``: e.g. ``rank_change``, ``checkpoint``, ``stage``,
      ``error``, ``info``.
    - ``log_artifact(kind, path)``: a file written for the run (checkpoint, export, log).
    - ``set_status(status, error=None)``: lifecycle status (running, finished, stopped,
      failed, diverged).
    - ``set_phase(phase, progress=None)``: what the run is doing now (one of
      :data:`comera_engine.store.PHASES`: preparing data, training tokenizer, building,
      training, evaluating, checkpointing, exporting, done) and how far along (0..1,
      ``None``: unknown). Called on every phase change, and with progress within a long
      phase (per eval batch): a sink keeps that cheap (writes progress at most every
      so often, or not at all).
    - ``flush()`` / ``close()``.
    """

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None: ...
    def log_ranks(self, step: int, ranks: dict[str, list[int]]) -> None: ...
    def log_event(self, kind: str, text: str, step: int | None = None) -> None: ...
    def log_artifact(self, kind: str, path: str) -> None: ...
    def set_status(self, status: str, error: str | None = None) -> None: ...
    def set_phase(self, phase: str, progress: float | None = None) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


class NullSink(MetricsSink):
    """A sink that keeps nothing (every method is the protocol's no-op): for processes
    that must not write (DDP ranks other than 0)."""


class JSONLSink:
    """Append-only JSON-lines file: one record per line, ``{"t": time, "type": ..., ...}``.

    Lines are written at most ``flush_every`` seconds apart, and always on ``flush``/``close``.
    A phase is one ``{"type": "phase", "phase": ..., "progress": ...}`` line when it
    changes; progress within a phase is not written. A write that fails (a full disk)
    is cut back to the last whole line before the error is raised: the file never ends
    in half a record.
    """

    def __init__(self, path: str | os.PathLike[str], flush_every: float = 0.5) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT
                                       | os.O_CLOEXEC, 0o644)
        self._size = os.fstat(self._fd).st_size  # the file's whole lines
        self._buf: list[str] = []
        self._flush_every = flush_every
        self._last_flush = time.monotonic()
        self._phase: str | None = None

    def _write(self, record: dict[str, Any]) -> None:
        record = {"t": time.time(), **record}
        self._buf.append(json.dumps(record) + "\n")
        if time.monotonic() - self._last_flush >= self._flush_every:
            self.flush()

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self._write({"type": "metrics", "step": int(step), "values": metrics})

    def log_ranks(self, step: int, ranks: dict[str, list[int]]) -> None:
        self._write({"type": "ranks", "step": int(step), "ranks": ranks})

    def log_event(self, kind: str, text: str, step: int | None = None) -> None:
        self._write({"type": "event", "kind": kind, "text": text, "step": step})

    def log_artifact(self, kind: str, path: str) -> None:
        self._write({"type": "artifact", "kind": kind, "path": str(path)})

    def set_status(self, status: str, error: str | None = None) -> None:
        self._write({"type": "status", "status": status, "error": error})

    def set_phase(self, phase: str, progress: float | None = None) -> None:
        if phase != self._phase:
            self._phase = phase
            self._write({"type": "phase", "phase": phase, "progress": progress})

    def flush(self) -> None:
        if self._fd is None or not self._buf:
            return
        if os.fstat(self._fd).st_nlink == 0:  # someone deleted the run folder (or file)
            raise FileNotFoundError(errno.ENOENT, deleted_text(self.path), str(self.path))
        data = "".join(self._buf).encode("utf-8")
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
        except OSError:
            try:  # no half record: back to the last whole line (the lines are kept)
                os.ftruncate(self._fd, self._size)
            except OSError:
                pass
            raise
        self._buf.clear()
        self._size += len(data)
        self._last_flush = time.monotonic()

    def close(self) -> None:
        if self._fd is None:
            return
        try:
            self.flush()
        finally:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:  # a sink dropped unclosed still writes what it holds
        try:
            self.close()
        except Exception:  # noqa: BLE001 (at collection time there is no one to tell)
            pass


class MultiSink:
    """Fan records out to several sinks (a sink without ``set_phase``, written before the
    protocol had it, is skipped for phases). Every sink gets every record: one that
    fails (a full disk under the folder's file) does not keep the others from theirs;
    its error is raised after all were called."""

    def __init__(self, *sinks: MetricsSink) -> None:
        self.sinks = list(sinks)

    def _each(self, method: str, *args: Any) -> None:
        error: BaseException | None = None
        for s in self.sinks:
            fn = getattr(s, method, None)
            if fn is None:
                continue
            try:
                fn(*args)
            except Exception as e:  # noqa: BLE001 (raised below, once all were called)
                error = error or e
        if error is not None:
            raise error

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self._each("log_metrics", step, metrics)

    def log_ranks(self, step: int, ranks: dict[str, list[int]]) -> None:
        self._each("log_ranks", step, ranks)

    def log_event(self, kind: str, text: str, step: int | None = None) -> None:
        self._each("log_event", kind, text, step)

    def log_artifact(self, kind: str, path: str) -> None:
        self._each("log_artifact", kind, path)

    def set_status(self, status: str, error: str | None = None) -> None:
        self._each("set_status", status, error)

    def set_phase(self, phase: str, progress: float | None = None) -> None:
        self._each("set_phase", phase, progress)

    def flush(self) -> None:
        self._each("flush")

    def close(self) -> None:
        self._each("close")


def deleted_text(path: str | os.PathLike[str]) -> str:
    """The one-line cause a run records when ``path`` (its folder, or a file in it) was
    deleted under it, whichever of its writes met that first."""
    return f"{path} was deleted while the run trained (its folder removed?); the run stops here"


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Read a JSONL sink file back, skipping a line that does not read back (a torn last
    line from a crash, a damaged line): the intact lines after it are kept."""
    out: list[dict[str, Any]] = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                out.append(record)
    return out


# ---------------------------------------------------------------------- scores


def _float64(values: Any) -> Any:
    """``values`` (a NumPy array, a torch tensor on any device, a list) as a flat float64
    NumPy array."""
    import numpy as np

    if hasattr(values, "detach"):  # a torch tensor
        values = values.detach().cpu().double().numpy()
    return np.asarray(values, dtype=np.float64).ravel()


def roc_auc(scores: Any, labels: Any) -> float:
    """Area under the ROC curve of ``scores`` [n] against binary ``labels`` [n] (> 0.5 is
    positive); tied scores get half credit; NaN when only one class is present.

    From ranks (Mann-Whitney U): ``(Σ ranks of the positives − P(P+1)/2) / (P·N)``, the
    ranks 1-based and each tie group at its mean rank.
    """
    import numpy as np

    scores = _float64(scores)
    pos = _float64(labels) > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    _, first, counts = np.unique(scores[order], return_index=True, return_counts=True)
    ranks = np.empty(len(scores))
    ranks[order] = np.repeat(first + (counts + 1) / 2.0, counts)  # mean rank of each tie
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def log_loss(probability: Any, labels: Any) -> float:
    """Mean binary cross-entropy ``−mean(y·log p + (1−y)·log(1−p))`` of ``probability``
    [n] against ``labels`` [n] in {0, 1}, ``p`` clipped to ``[1e-12, 1 − 1e-12]``."""
    import numpy as np

    p = np.clip(_float64(probability), 1e-12, 1 - 1e-12)
    y = _float64(labels)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log1p(-p)))


# ---------------------------------------------------------------------- the target's outcome

#: A run whose compression is at most this far below its target (relative) reached it.
TARGET_TOLERANCE = 0.05


def target_error(target: float, reached: float) -> float:
    """``compression/error``: ``reached / target - 1`` (signed, relative; +0.02 is 2 %
    more compressed than asked, -0.3 is 30 % short of it)."""
    return reached / target - 1.0


def target_outcome(target: float, reached: float, reason: str = "", short: bool = False
                   ) -> str:
    """What a run made of its target, in one line: ``"target 10x · reached 10.2x (+2 %)"``,
    or ``"target 60x · reached 39.8x: missed by 34 % (reason)"`` when the compression is
    more than :data:`TARGET_TOLERANCE` below the target. ``short`` (for a table column):
    ``"10x→10.2x +2%"`` / ``"60x→39.8x miss 34%"``. A miss is reported, not a failure."""
    err = target_error(target, reached)
    missed = err < -TARGET_TOLERANCE
    if short:
        tail = f"miss {-err * 100:.0f}%" if missed else f"{err * 100:+.0f}%"
        return f"{target:g}x→{reached:.1f}x {tail}"
    if missed:
        return (f"target {target:g}x · reached {reached:.1f}x: missed by {-err * 100:.0f} %"
                + (f" ({reason})" if reason else ""))
    return f"target {target:g}x · reached {reached:.1f}x ({err * 100:+.0f} %)"


# ---------------------------------------------------------------------- metric figures

#: Metrics logged as fractions that every place states in percent (one unit for
#: accuracy: the Live tile, the tables, the sweep report, the model card).
PERCENT_METRICS = ("acc/train", "eval/acc")


def format_metric(name: str, value: Any, std: Any = None) -> str:
    """A metric's value as every table writes it: accuracies in percent (``98.2%``),
    others to four significant digits; ``std`` (a spread over seeds) after ``±`` when
    there is one (none for one seed); ``""`` for a value not there yet (a pending cell
    is blank, never "None")."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(
            value):
        return ""
    has_std = isinstance(std, (int, float)) and not isinstance(std, bool) and math.isfinite(
        std)
    if name in PERCENT_METRICS:
        return f"{value * 100:.1f}%" + (f" ± {std * 100:.1f}" if has_std else "")
    return f"{value:.4g}" + (f" ± {std:.2g}" if has_std else "")


# ---------------------------------------------------------------------- the compression figure

#: What a compression is measured on (``comera.target_scope``), as every page names it.
SCOPE_LABELS = {"tensorized": "TT layers", "model": "whole model"}


def compression_scope(config: Mapping[str, Any] | None) -> str:
    """The scope a run's compression is stated in: the one its target is asked in
    (``comera.target_scope``, default ``tensorized``), with or without a target."""
    comera = (config or {}).get("comera") if isinstance(config, Mapping) else None
    scope = comera.get("target_scope") if isinstance(comera, Mapping) else None
    return scope if scope in SCOPE_LABELS else "tensorized"


def compression_metric(scope: str) -> str:
    """The metric holding the compression in ``scope``: ``compression/tensorized`` or
    ``compression/model``."""
    return f"compression/{scope}"


@dataclass(frozen=True)
class Compression:
    """A run's compression (dense / effective parameters) in its scope."""

    value: float | None
    scope: str

    @property
    def label(self) -> str:
        """``"TT layers"`` or ``"whole model"``."""
        return SCOPE_LABELS[self.scope]

    def text(self, unit: str = "×") -> str:
        """``"60.6× (TT layers)"``, ``"– (TT layers)"`` before the first evaluation."""
        return f"{format_ratio(self.value, unit)} ({self.label})"


def format_ratio(x: float | None, unit: str = "×") -> str:
    """``60.6×`` (one decimal, as the tables' ``%.1f×`` columns show it); ``∞×`` for a
    model pruned to nothing; ``–`` when unknown. One format, so a figure reads the same
    wherever it is shown."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        if math.isinf(x) and x > 0:
            return f"∞{unit}"
        if math.isfinite(x):
            return f"{x:.1f}{unit}"
    return "–"


def run_compression(config: Mapping[str, Any] | None, latest: Mapping[str, Any]) -> Compression:
    """THE compression of a run, everywhere it is shown: its latest value of the metric in
    its scope (:func:`compression_scope`); the dense baseline (:func:`is_dense_baseline`)
    is the whole dense model, 1× by definition, in the whole model's scope (it has no TT
    layers to state a figure of); a dense model with compressed embedding peers logs its
    tables' ratio and shows it.
    ``latest`` maps metric names to values (or ``(step, value)`` pairs, as the store's
    ``latest_metrics`` gives them)."""
    if is_dense_baseline(config):
        return Compression(1.0, "model")
    scope = compression_scope(config)
    model = (config or {}).get("model") if isinstance(config, Mapping) else None
    if isinstance(model, Mapping) and model.get("quantize") and model.get("dense"):
        scope = "model"  # int8 weights of a dense or pruned run: judged in bytes, whole model
    value = latest.get(compression_metric(scope))
    if isinstance(value, (tuple, list)):
        value = value[1]
    value = float(value) if isinstance(value, (int, float)) else None
    return Compression(value, scope)


def is_dense_baseline(config: Mapping[str, Any] | None) -> bool:
    """The run trains the dense model as it is, the baseline the others are measured
    against: ``model.dense``, neither pruned (``comera.method = "prune"``) nor quantized
    (``model.quantize``), and no compressed embedding tables (``model.kwargs.peer``
    other than ``"dense"``)."""
    if not isinstance(config, Mapping):
        return False
    model, comera = config.get("model"), config.get("comera")
    if not isinstance(model, Mapping) or not model.get("dense") or model.get("quantize"):
        return False
    if isinstance(comera, Mapping) and comera.get("method") == "prune":
        return False
    kwargs = model.get("kwargs")
    return (kwargs.get("peer") if isinstance(kwargs, Mapping) else None) in (None, "dense")


def run_target(config: Mapping[str, Any] | None) -> float | None:
    """THE compression a run asks for (``comera.target_compression``), everywhere it is
    shown; ``None`` when it asks none, and for the dense baseline, whose config may carry
    a target from the config it was made from that nothing in it pursues. Structured
    pruning, compressed embedding tables (``model.kwargs.peer``) and int8 weights keep
    theirs (int8: the size of the pruned or TT run they quantize)."""
    comera = config.get("comera") if isinstance(config, Mapping) else None
    target = comera.get("target_compression") if isinstance(comera, Mapping) else None
    if (not isinstance(target, (int, float)) or isinstance(target, bool)
            or is_dense_baseline(config)):
        return None
    return float(target)


#: Statuses of a run that trains no further unless it is resumed (comera_engine.store).
_HALTED = ("stopped", "failed", "crashed", "diverged")


def target_status(target: float, reached: float | None, status: str, step: int | None = None,
                  steps: int | None = None, short: bool = False) -> str:
    """Where a run stands with its target, in one line. A verdict (reached, or missed by
    how much: :func:`target_outcome`) belongs to a run that finished its steps; a run
    still training, or stopped, failed or crashed part way, shows its progress toward
    the target instead: ``"target 60x · now 26.8x at step 551 of 20,000 (still
    training)"`` (``short``: ``"60x, now 26.8x"``, ``"60x, at 26.8x (stopped)"``)."""
    if reached is None:
        return f"{target:g}x, not measured yet" if short else (
            f"target {target:g}x · not measured yet")
    if status == "finished":
        return target_outcome(target, reached, short=short)
    halted = status in _HALTED
    ratio = format_ratio(reached, "x")
    if short:
        return f"{target:g}x, at {ratio} ({status})" if halted else f"{target:g}x, now {ratio}"
    where = "" if step is None else f" at step {step:,}" + (f" of {steps:,}" if steps else "")
    if not halted:
        return f"target {target:g}x · now {ratio}{where} (still training)"
    if status == "diverged":
        return f"target {target:g}x · {ratio}{where} when it {status}"
    if target_error(target, reached) >= -TARGET_TOLERANCE:  # already there: not "toward"
        return (f"target {target:g}x · {ratio}{where} when it {status}: the target is "
                "reached; resume it to finish its steps at this size")
    return (f"target {target:g}x · {ratio}{where} when it {status}: resume it to go on "
            "toward the target")
