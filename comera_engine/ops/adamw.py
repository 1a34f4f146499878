"""AdamW whose step runs every parameter group's update in one call of the CPU backend.

``torch.optim.AdamW(fused=True)`` on the CPU runs its kernel once per tensor (a few
microseconds each) and its Python once per group: a TT model has hundreds of small
parameters in four groups (cores, embedding, gates, dense), and at a small model's sizes
that costs more than the update itself. :class:`AdamW` is that optimizer (same
arguments, state and ``state_dict``) with :meth:`AdamW.step` handing all groups to the
backend's ``adamw_step`` (``csrc/adamw.cpp``: a plain loop per parameter) where it takes
them: float32/float64 CPU tensors, dense contiguous gradients, no ``amsgrad``,
``maximize``, ``capturable``, ``differentiable``, closure or tensor ``lr``. Anything
else, and a build without the backend, runs torch's step: the reference.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..backends import cpu_backend

__all__ = ["AdamW"]


def _unwrapped(method: Callable[..., Any]) -> Callable[..., Any]:
    """The function a ``functools.wraps`` decorator wrapped (its ``__wrapped__``); the
    method itself where torch exposes none."""
    return getattr(method, "__wrapped__", method)


class AdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` (fused on the CPU and on CUDA, the default elsewhere) whose
    step runs on the CPU backend in one call where it can (module doc). ``params`` and
    the keywords as torch's.

    On CUDA torch's ``fused`` update is one kernel per group and dtype (plus one adding
    the step counts), against about a dozen ``foreach`` kernels per group for the
    default; its step counts live on the device (a CUDA graph captures it where
    ``capturable`` is passed too, as torch's capture check asks). ``fused`` or
    ``foreach`` given by the caller is kept."""

    # torch.optim.Optimizer wraps these four in ``torch._disable_dynamo``, whose first call
    # imports Dynamo (with sympy and FSDP: about a second of every training process's
    # start) only to mark them as never traced. Nothing compiles this optimizer (a
    # compiled step compiles the forward and the objective, not the update), so it calls
    # torch's own functions unwrapped (:func:`_unwrapped`).
    add_param_group = _unwrapped(torch.optim.Optimizer.add_param_group)
    zero_grad = _unwrapped(torch.optim.Optimizer.zero_grad)
    state_dict = _unwrapped(torch.optim.Optimizer.state_dict)
    load_state_dict = _unwrapped(torch.optim.Optimizer.load_state_dict)

    def __init__(self, params: Iterable[Any], **kwargs: Any) -> None:
        params = [dict(x, params=list(x["params"])) if isinstance(x, dict) else x
                  for x in params]
        device = _float_device(params)
        free = "fused" not in kwargs and not kwargs.get("foreach") and not kwargs.get(
            "differentiable")
        if free and (device == "cuda" or (device == "cpu" and not kwargs.get("capturable"))):
            kwargs["fused"] = True
        super().__init__(params, **kwargs)
        self._on_cpu = device == "cpu"  # the backend's update takes CPU tensors only

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        if closure is None and self._native_step():
            return None
        return super().step(closure)

    def _native_step(self) -> bool:
        """The update on the backend; False (nothing changed but lazily made state) where
        it does not take these groups, or no backend is built (then nothing is gathered:
        torch's step gathers its own)."""
        backend = cpu_backend()
        if backend is None or not self._on_cpu:
            return False  # (a CUDA step: torch's fused update, no per-tensor gathering)
        params: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        exp_avgs: list[torch.Tensor] = []
        exp_avg_sqs: list[torch.Tensor] = []
        steps: list[torch.Tensor] = []
        counts: list[int] = []
        hyper: list[float] = []
        for group in self.param_groups:
            lr = group["lr"]
            if (group["amsgrad"] or group["maximize"] or group["capturable"]
                    or group["differentiable"] or isinstance(lr, torch.Tensor)):
                return False
            n = 0
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                state = self.state[p]
                if not state:
                    if p.device.type != "cpu":
                        return False
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p,
                                                           memory_format=torch.preserve_format)
                params.append(p)
                grads.append(g)
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                steps.append(state["step"])
                n += 1
            counts.append(n)
            beta1, beta2 = group["betas"]
            hyper += [float(lr), float(beta1), float(beta2), float(group["weight_decay"]),
                      float(group["eps"])]
        if not params:
            return True  # no gradient anywhere: torch's step does nothing either
        return bool(backend.ops.adamw_step(params, grads, exp_avgs, exp_avg_sqs, steps,
                                           counts, hyper))


def _float_device(params: list[Any]) -> str | None:
    """The device type of the parameters (given bare or in groups) where all are float
    tensors on one device type, else None."""
    tensors = [t for x in params for t in (x["params"] if isinstance(x, dict) else [x])]
    if not tensors or not all(isinstance(t, torch.Tensor) and t.is_floating_point()
                              for t in tensors):
        return None
    kinds = {t.device.type for t in tensors}
    return kinds.pop() if len(kinds) == 1 else None
