"""One training step, run eagerly or replayed from a CUDA graph.

:class:`TrainStep` is the step itself: forward through the task model, the CoMERA
objective of the current stage, backward, gradient clipping and ``optimizer.step()``.
It returns 0-d tensors (no host sync). On the graph path the gate refresh that makes
pruning permanent is part of the step (device-side); otherwise the loop runs the
reference refresh after it.

:class:`GraphedStep` runs the same :class:`TrainStep` through a ``torch.cuda.CUDAGraph``:
the first ``warmup`` steps run eagerly on a side stream (they are real training steps;
they also create the optimizer state and let lazy CUDA initialisation happen), then the
next step is captured with its batch copied into static buffers, and every later step
copies its batch into those buffers and replays. The graph is dropped (:meth:`reset`)
when the step function changes: at a stage change and after a physical truncation.
When capture is impossible the step falls back to eager execution and remembers why.

The graph and eager paths compute the same numbers; the graph only removes the
per-kernel launch cost, which dominates TT training (many small kernels). The warm-up and
the capture plan every TT op for a graph (:func:`comera_engine.tensor.planner.graph_planning`:
the device profile's graphed timings), so the paths warmed up are the ones captured.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch
from torch import nn

from ..backends import cpu_backend
from ..layers import groupable_linears
from ..tensor.grouped import grouped_halves
from ..tensor.planner import graph_planning

Batch = dict[str, torch.Tensor]


def clip_grad_norm_(params: list[nn.Parameter], grads: list[torch.Tensor],
                    max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_(params, max_norm)``: the 2-norm of all gradients
    together, each scaled by ``max_norm / (norm + 1e-6)`` where that is below 1. On the CPU
    backend in one pass where it takes ``grads`` (the parameters' gradients: dense,
    contiguous, one float dtype, on the CPU); else torch's. A TT model has hundreds of
    small gradients, and torch's CPU path runs a norm and a multiply per tensor."""
    backend = cpu_backend(grads[0]) if grads and not torch.jit.is_tracing() else None
    if backend is not None:
        norm = backend.ops.clip_grad_norm(grads, float(max_norm))
        if norm is not None:
            return norm
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


class TrainStep:
    """Forward, objective, backward, clip, optimizer step (no host synchronisation).

    ``refresh``: the gate refresh that makes pruning permanent, as device work returning
    the alive count of every bond (``result["gate_counts"]``); ``None`` leaves the
    refresh to the caller (the reference refresh reads gates on the host).

    ``grouped``: the forward inside :func:`comera_engine.tensor.grouped.grouped_halves`
    over the model's TT linears (layout ``tt``, path unforced, ``halves`` or
    reconstructed): the halves of every shape shared by several layers merged in one
    batched pass, so the step's kernels for the merges do not grow with the layers.
    None (the default): on where the batch is on a GPU and the step is not compiled
    (on a CPU the C++ backend runs each layer's merges in one call already).

    ``compile``: ``torch.compile`` mode (``"default"``, ``"reduce-overhead"``, …) for
    the forward and the objective (Inductor compiles their backward with them; the
    clipping and the optimizer run as they are), or None (eager). Compiled on the first
    step; a new objective (stage change) or new shapes compile again.
    """

    def __init__(
        self,
        task_model: nn.Module,
        optimizer: torch.optim.Optimizer,
        objective: Callable[[torch.Tensor], tuple[torch.Tensor, dict]] | None,
        params: Iterable[nn.Parameter],
        grad_clip: float,
        autocast_dtype: torch.dtype | None,
        refresh: Callable[[], torch.Tensor] | None = None,
        compile: str | None = None,  # noqa: A002 - torch.compile's word
        grouped: bool | None = None,
    ) -> None:
        self.task_model = task_model
        self.optimizer = optimizer
        self.objective = objective
        self.params = [p for p in params if p.requires_grad]
        self.grad_clip = grad_clip
        self.autocast_dtype = autocast_dtype
        self.refresh = refresh
        self.grouped = grouped if grouped is not None or compile is None else False
        self._tt_linears: list[nn.Module] | None = None
        self.grouped_layers = 0
        self.forward = (self._forward if compile is None
                        else torch.compile(self._forward, mode=compile, dynamic=False))

    def _forward(self, batch: Batch) -> tuple[dict, torch.Tensor, torch.Tensor, dict]:
        """The task model's output, its loss (float32), the total loss and the objective's
        terms."""
        device_type = next(iter(batch.values())).device.type
        autocast = (
            torch.autocast(device_type, dtype=self.autocast_dtype, cache_enabled=False)
            if self.autocast_dtype is not None
            else contextlib.nullcontext()
        )
        if self.grouped if self.grouped is not None else device_type == "cuda":
            with autocast, grouped_halves([m.tt for m in self.tt_linears()]) as n:
                out = self.task_model(batch)
            self.grouped_layers = n  # how many TT linears took grouped halves
        else:  # (the plain block: what torch.compile traces, grouped off there)
            with autocast:
                out = self.task_model(batch)
        task_loss = out["loss"].float()
        if self.objective is not None:
            total, info = self.objective(task_loss)
        else:
            total, info = task_loss, {}
        return out, task_loss, total, info

    def tt_linears(self) -> list[nn.Module]:
        """The task model's TT linears that :attr:`grouped` takes (found once: a
        truncation replaces their cores, not the layers)."""
        if self._tt_linears is None:
            self._tt_linears = list(groupable_linears(self.task_model))
        return self._tt_linears

    def __call__(self, batch: Batch) -> dict[str, torch.Tensor | float]:
        self.optimizer.zero_grad(set_to_none=True)
        out, task_loss, total, info = self.forward(batch)
        total.backward()
        grads = [p.grad for p in self.params if p.grad is not None]
        if self.grad_clip > 0:
            grad_norm = clip_grad_norm_(self.params, grads, self.grad_clip)
        elif grads:
            grad_norm = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])
            )
        else:
            grad_norm = task_loss.new_zeros(())
        self.optimizer.step()
        if self.refresh is not None:
            gate_counts = self.refresh()
        result: dict[str, torch.Tensor | float] = {
            "loss/task": task_loss.detach(),
            "loss/total": total.detach().float(),
            "correct": out["correct"].detach().float(),
            "count": out["count"].detach().float(),
            "grad_norm": grad_norm.detach().float(),
        }
        if self.refresh is not None:
            result["gate_counts"] = gate_counts
        for key, value in info.items():  # tensors (graph-safe objective) or floats
            if isinstance(value, torch.Tensor):
                if value.requires_grad or value.dtype != torch.float32 or value.dim():
                    value = value.detach().float().reshape(())
                result[f"comera/{key}"] = value
            elif isinstance(value, (int, float)):
                result[f"comera/{key}"] = float(value)
        return result


def settled(stepper: object) -> bool:
    """Whether a step function is past its warm-up: an eager step always, a
    :class:`GraphedStep` once its graph is captured or the graph path is off."""
    if not isinstance(stepper, GraphedStep):
        return True
    return stepper.active or stepper.reason is not None


class GraphedStep:
    """:class:`TrainStep` captured into a CUDA graph (see the module docstring).

    Attributes:
        reason: why the step runs eagerly (``None`` while the graph path is on).
        captures: how many graphs were captured so far.
    """

    def __init__(self, step: TrainStep, warmup: int = 3, log: Callable[[str], None] = print):
        self.step = step
        self.warmup = warmup
        self.log = log
        self.reason: str | None = None
        self.captures = 0
        self._warm = 0
        self._graph: torch.cuda.CUDAGraph | None = None
        self._static_in: Batch | None = None
        self._static_out: dict[str, torch.Tensor] | None = None
        self._stream: torch.cuda.Stream | None = None

    @property
    def active(self) -> bool:
        return self._graph is not None

    def disable(self, reason: str) -> None:
        """Run eagerly from now on, logging ``reason`` once."""
        if self.reason is None:
            self.reason = reason
            self.log(f"CUDA graph off: {reason}")
        self._drop()

    def reset(self, step: TrainStep) -> None:
        """New step function (stage change, truncation): re-warm and re-capture."""
        self._drop()
        self.step = step
        self._warm = 0

    def _drop(self) -> None:
        self._graph = None
        self._static_in = None
        self._static_out = None
        if self.step is not None:  # None: released before a truncation under DDP
            self.step.optimizer.zero_grad(set_to_none=True)  # grads lived in the graph's pool

    def __call__(self, batch: Batch) -> dict[str, torch.Tensor]:
        if self.reason is not None:
            return self.step(batch)
        if self._graph is None and self._warm < self.warmup:
            self._warm += 1
            return self._on_side_stream(batch)
        if self._graph is None:
            try:
                return self._capture(batch)
            except Exception as exc:  # noqa: BLE001 - any capture failure means eager
                torch.cuda.synchronize()
                self.disable(f"capture failed: {type(exc).__name__}: {_first_line(exc)}")
                return self.step(batch)
        assert self._static_in is not None and self._static_out is not None
        for key, value in batch.items():
            self._static_in[key].copy_(value, non_blocking=True)
        self._graph.replay()
        return self._static_out

    def _side_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream

    def _on_side_stream(self, batch: Batch) -> dict[str, torch.Tensor]:
        stream = self._side_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), graph_planning():
            out = self.step(batch)
        torch.cuda.current_stream().wait_stream(stream)
        return out

    def _capture(self, batch: Batch) -> dict[str, torch.Tensor]:
        static_in = {k: v.clone() for k, v in batch.items()}
        self.step.optimizer.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=self._side_stream(),
                              capture_error_mode="thread_local"), graph_planning():
            static_out = self.step(static_in)
        self._graph, self._static_in, self._static_out = graph, static_in, static_out
        self.captures += 1
        graph.replay()  # capture records only; this runs the step for this batch
        return static_out


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else ""
