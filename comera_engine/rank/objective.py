"""The two-stage rank-adaptive objective (comera-method.md §2): the one implementation.

Early stage (stable convergence), linear scalarisation::

    L = f + γ·ramp · Ŝ/S₀  (+ l2_cores · Σ‖G‖²)

Late stage (reach the requested size), achievement scalarisation toward ``z = (z_f, z_S)``::

    λ = 1 if (f − z_f)/f < (S − z_S)/S else 0
    L = ρ_f·f + ρ_S·Ŝ/S_c + λ·Ŝ/S_c + (1−λ)·f

Two of our additions to the spec are switches (``comera.schedule``, docs/METHODS.md):
pruning is irreversible, so once ``S <= z_S`` the size terms are switched off (λ = 0,
no ``ρ_S`` term; ``size_off_at_target``): the size lands on the target instead of
overshooting it while the loss happens to beat ``z_f``; and the late stage's ``Ŝ`` is
divided by ``S_c`` (``late_norm = "current"``; the spec's ``"initial"`` divides by
``S₀``). With ``schedule = "paper"`` both are off. Once the run fixes the ranks at the
target (``frozen``, see :mod:`comera_engine.rank.pace`) the objective is the task loss
alone.

``S₀`` is the initial allocated size of the TT cores (so ``Ŝ/S₀`` starts at 1); ``S_c``
is the cores' *current* effective size (a constant in the gradient). The late stage
normalises by ``S_c``, as the λ test does: after the early stage has shrunk the model
tens of times, ``Ŝ/S₀`` would pull tens of times more weakly than the comparison that
chose λ = 1 asks for (docs/SIZE_AND_TARGET.md). ``z_S`` is
the target size set by the user's compression ratio, over the whole model
(``target_scope="model"``: every parameter counts, dense ones included) or over the
tensorised layers only (``"tensorized"``: TT cores + TT biases), counted as
:mod:`comera_engine.rank.size` says (the same count as ``size_report``); the target and
its floor come from :func:`comera_engine.rank.target.plan_target`. ``z_f`` is the
early-stage loss plateau (the smoothed loss when the stage switches), never a hard-coded
constant. ``ramp`` is the early-stage warm-up factor
``min(1, (step+1)/gamma_warmup)``.

Under DDP, λ is decided from the loss averaged over all processes (as the stage switch
is), so every process optimises the same objective. Every quantity stays on the device
(``λ``, the effective size ``S`` counted from the gate masks), so the same code runs
eagerly and inside a captured CUDA graph; values are read back to the host only for
logging. The settings are the run config's
:class:`~comera_engine.config.CoMERAConfig` (one set of names and defaults).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..backends import cpu_backend
from ..config import CoMERAConfig, validate_comera
from ..errors import ConfigError
from ..layers import tt_layers
from .schedule import resolve_schedule
from .size import (
    GateBank,
    dense_size,
    effective_core_size,
    gate_size_pass,
    gate_sizes,
    size_extra,
    size_spec,
)
from .target import plan_target

__all__ = ["CoMERAObjective", "PlateauDetector", "gamma_ramp"]


def gamma_ramp(warmup_steps: int, step: int) -> float:
    """Early-stage ``γ`` warm-up factor at 0-based ``step``: ``min(1, (step+1)/warmup)``."""
    return min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0


class CoMERAObjective:
    """The task loss combined with the size objective of the current stage.

    ``obj(f)`` returns ``(total_loss, info)``: ``info`` holds 0-d device tensors for
    logging (``lambda``; ``size_surrogate`` until the ranks are fixed; ``gamma`` in the
    early stage, ``size`` and ``z_f`` in the late one, ``target_size`` when a target is
    set). Nothing is read back
    to the host, so the call can be captured into a CUDA graph. :meth:`begin_step` sets
    the step that drives the ``γ`` warm-up (in place on the device).

    Raises:
        ConfigError: bad settings, or a target below what rank 1 everywhere allows.
    """

    def __init__(self, model: nn.Module, cfg: CoMERAConfig) -> None:
        validate_comera(cfg)
        self.model = model
        self.cfg = cfg = resolve_schedule(cfg)
        self.stage = "early"
        self.z_f: float | None = None
        self._layers = [m for _, m in tt_layers(model)]  # the model's structure is fixed
        self.bank = GateBank(self._layers)  # their gates, laid out once per structure
        self.S0 = float(max(1, sum(m.tt.num_params(False) for m in self._layers)))
        self._backend_ops = None  # the CPU backend's module, for the layers' pairs
        self._early_settings = [self.S0, cfg.gamma]  # the backend's, per stage
        self._late_settings: list[float | None] = [None] * 8  # made at the first call
        self.dense = dense_size(model)
        self.step_index = 0
        self._ramp: Tensor | None = None
        self._ramp_value = 0.0  # what _ramp holds
        self.target_size: float | None = None
        # the layers' own size outputs (SizeTap: a TT matrix's node gives its layer's Ŝ
        # and S), used where every layer gives them
        taps = [getattr(m.tt, "size_tap", None) for m in self._layers]
        self._taps = taps if taps and all(t is not None for t in taps) else None
        self._slots: list[Tensor | None] | None = None  # what the taps leave, per layer
        if self._taps is not None:
            self._slots = [None] * len(self._taps)
            for index, tap in enumerate(self._taps):
                tap.index = index
        self.frozen = False  # ranks fixed at the target: the task loss alone
        self._fixed_size: Tensor | None = None  # the size once frozen (a constant)
        self._consts: dict[str, tuple] = {}
        # the target scope's parameters outside the TT cores (TT biases, other layers)
        self._extra = size_extra(model, cfg.target_scope)
        if cfg.target_compression is not None:  # refuses a target below the floor
            self.target_size = plan_target(size_spec(model), cfg.target_scope,
                                           cfg.target_compression).target

    @property
    def frozen(self) -> bool:
        """The ranks are fixed at the target: the objective is the task loss alone."""
        return self._frozen

    @frozen.setter
    def frozen(self, value: bool) -> None:
        self._frozen = bool(value)
        self._empty_slots()
        for tap in self._taps or ():  # the layers' size outputs, while the size counts
            tap.slots = None if self._frozen else self._slots

    def switch_to_late(self, z_f: float) -> None:
        """Enter the late stage. ``z_f``: the early-stage plateau loss."""
        if self.target_size is None:
            raise ConfigError("comera.target_compression",
                              "the late stage needs a target compression")
        self.z_f = float(z_f)
        self.stage = "late"

    def begin_step(self, index: int) -> None:
        """The 0-based index of the step about to run (drives the ``γ`` warm-up)."""
        self.step_index = index
        self._empty_slots()  # the layers' size outputs from before are stale
        ramp = gamma_ramp(self.cfg.gamma_warmup, index)
        if self._ramp is not None and ramp != self._ramp_value:  # 1 after the warm-up
            self._ramp.fill_(ramp)
            self._ramp_value = ramp

    def _ramp_on(self, device: torch.device) -> Tensor:
        if self._ramp is None or self._ramp.device != device:
            ramp = gamma_ramp(self.cfg.gamma_warmup, self.step_index)
            self._ramp = torch.full((), ramp, dtype=torch.float32, device=device)
            self._ramp_value = ramp
        return self._ramp

    def __call__(self, f: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        info: dict[str, Tensor] = {}
        if self._frozen:  # ranks fixed: the size is a constant, counted once
            if self._fixed_size is None or self._fixed_size.device != f.device:
                self._fixed_size = (effective_core_size(self.model, self.bank)
                                    + self._extra).to(f.dtype)
            total = f
            info["lambda"] = self._const(f, "zero", 0.0)  # not chosen (logged only)
            info["size"] = self._fixed_size
        else:
            sized = self._layer_sizes()  # taken on every call: each is of one step
            # the layers' own pairs come from the backend's nodes only (no autocast)
            total = None if sized is None else self._native_terms(self._ops(), f, info, sized)
            if total is None:
                total = self._gate_terms(f, info)
        if self.cfg.l2_cores > 0:  # the cores' L2 term (comera.l2_cores; off by default)
            reg = f.new_zeros(())
            for m in self._layers:
                for c in m.tt.cores:
                    reg = reg + c.pow(2).sum()
            total = total + self.cfg.l2_cores * reg
        if self.target_size is not None:
            info["target_size"] = self._const(f, "target_size", self.target_size)
        return total, info

    def _terms(self, f: Tensor, s_raw: Tensor, cores64: Tensor | None,
               info: dict[str, Tensor]) -> tuple[Tensor, Callable[[Tensor], tuple]]:
        """The current stage's loss from the task loss ``f``, the surrogate ``Ŝ``
        (``s_raw``) and, in the late stage, the cores' effective size (``cores64``), its
        terms logged in ``info``; and the function that takes ``dL/d(loss)`` to
        ``(dL/df, dL/dŜ)``, each product and sum as autograd would form them through
        these expressions (:class:`_Scalarised`: the same bits)."""
        cfg = self.cfg
        s_hat = s_raw.to(f.dtype) / self.S0
        info["size_surrogate"] = s_raw.detach()
        if self.stage == "early":
            gamma = cfg.gamma * self._ramp_on(f.device).to(f.dtype)
            info["lambda"] = self._const(f, "zero", 0.0)  # λ is not chosen (logged only)
            info["gamma"] = gamma
            return f + gamma * s_hat, lambda d: (d, ((d * gamma) / self.S0).to(s_raw.dtype))
        assert self.z_f is not None and self.target_size is not None
        assert cores64 is not None
        size = (cores64 + self._extra).to(f.dtype)
        norm = None
        if cfg.late_norm != "initial":  # Ŝ / S_c (ours); the paper's is Ŝ / S₀
            norm = self.S0 / cores64.to(f.dtype).clamp_min(1.0)
            s_hat = s_hat * norm
        fv = _mean_over_processes(f.detach())  # every process picks the same λ
        gap_f = torch.where(fv != 0, (fv - self.z_f) / fv, 0.0)
        gap_s = torch.where(size > 0, (size - self.target_size) / size, -1.0)
        if cfg.size_off_at_target is False:  # the paper's: the size terms stay on
            pursue = torch.ones_like(size)
        else:  # the size terms, until the size is at the target
            pursue = (size > self.target_size).to(f.dtype)
        lam = (gap_f < gap_s).to(f.dtype) * pursue
        on_s, off_f = pursue * cfg.rho_s, 1 - lam
        total = cfg.rho_f * f + on_s * s_hat + lam * s_hat + off_f * f
        info["lambda"] = lam
        info["size"] = size
        info["z_f"] = self._const(f, "z_f", self.z_f)

        def grads(d: Tensor) -> tuple[Tensor, Tensor]:
            d_s = d * on_s + d * lam
            d_s = d_s if norm is None else d_s * norm
            return d * cfg.rho_f + d * off_f, (d_s / self.S0).to(s_raw.dtype)

        return total, grads

    def _layer_sizes(self) -> list[Tensor] | None:
        """Every layer's ``(Ŝ, S)`` pair as its own forward output it in this step (its
        :class:`~comera_engine.tensor.tt.SizeTap`), each taken once; ``None`` where some
        layer left none (it did not run with gradients on the backend's node since the
        last step or call): the objective then makes its own pass over the gates."""
        if self._slots is None:
            return None
        sized = self._slots.copy()
        self._empty_slots()
        for pair in sized:
            if pair is None:
                return None
        return sized  # type: ignore[return-value]

    def _empty_slots(self) -> None:
        """No layer's size output is left to take (in place: the taps share the list)."""
        if self._slots is not None:
            self._slots[:] = [None] * len(self._slots)

    def _gate_terms(self, f: Tensor, info: dict[str, Tensor]) -> Tensor:
        """The loss over the gates themselves: the CPU backend's node where it takes
        them and ``f``, else one autograd node in PyTorch (:class:`_Scalarised`), else
        (single-core layers only, no bond) autograd through the expressions."""
        backend = self.bank.backend()  # not None: the gates are float CPU tensors
        if backend is not None and f.is_cpu and f.dim() == 0 and (
                f.dtype in (torch.float32, torch.float64)):
            total = self._native_terms(backend.ops, f, info)
            assert total is not None
            return total
        gates = self.bank.flat()[0]
        if gates:
            return _Scalarised.apply(self, info, f, *gates)
        s_raw, cores64 = gate_sizes(self.model, counts=self.stage != "early", bank=self.bank)
        return self._terms(f, s_raw, cores64, info)[0]

    def _ops(self):  # noqa: ANN202
        """The CPU backend's module (looked up once)."""
        if self._backend_ops is None:
            backend = cpu_backend()
            assert backend is not None, "the layers' size outputs come from the backend"
            self._backend_ops = backend.ops
        return self._backend_ops

    def _native_terms(self, ops, f: Tensor, info: dict[str, Tensor],  # noqa: ANN001
                      sized: list[Tensor] | None = None) -> Tensor | None:
        """The loss of :meth:`_terms` as one autograd node of the CPU backend
        (``csrc/gate_size.cpp``: every scalar op of the expressions rounded as the tensor
        op rounds it, and the backward's products and sums as autograd forms them): over
        the layers' own ``(Ŝ, S)`` pairs where ``sized`` holds them (``None`` where the
        node does not take ``f``), else over the gates."""
        late = self.stage != "early"
        if late:
            assert self.z_f is not None and self.target_size is not None
            side = _mean_over_processes(f)  # every process picks the same λ (read only)
            settings = self._late_settings
            if settings[2] != self.z_f or settings[3] != self.target_size:
                cfg = self.cfg
                settings = self._late_settings = [
                    self.S0, self._extra, self.z_f, self.target_size, cfg.rho_f, cfg.rho_s,
                    float(cfg.late_norm != "initial"),
                    float(cfg.size_off_at_target is not False)]
        else:
            side = self._ramp
            if side is None or not side.is_cpu:
                side = self._ramp_on(f.device)
            settings = self._early_settings
        gates, alive, _ = self.bank.flat()
        if sized is not None:
            out = ops.size_objective_layers(sized, f, side, late, settings,
                                            gates[0].dtype is torch.float64)
            if not out:
                return None
            total, s_raw, first, lam = out
        else:
            total, s_raw, first, lam = ops.size_objective(self.bank.native(ops), gates, alive,
                                                          f, side, late, settings)
        info["size_surrogate"] = s_raw
        info["lambda"] = lam  # the early stage's 0: λ is not chosen there (logged only)
        if late:
            info["size"] = first
            info["z_f"] = self._const(f, "z_f", self.z_f)
        else:
            info["gamma"] = first
        return total

    def _const(self, like: Tensor, name: str, value: float) -> Tensor:
        """``value`` as a 0-d tensor like ``like``, made once (logged every step)."""
        t = self._consts.get(name)
        if t is not None and t[0] == value and t[1] is like.dtype and (
                t[2] == like.get_device()):  # a device's index: no device object
            return t[3]
        made = like.new_full((), value)
        self._consts[name] = (value, like.dtype, like.get_device(), made)
        return made


class _Scalarised(torch.autograd.Function):
    """The CoMERA objective's loss (:meth:`CoMERAObjective._terms`) as one autograd node:
    inputs the objective, the ``info`` dict it fills, the task loss ``f`` and the gates
    of its :class:`~comera_engine.rank.size.GateBank`. The surrogate comes from
    :func:`~comera_engine.rank.size.gate_size_pass` with its gradient worked out; the
    backward multiplies as autograd would through the expressions, so the gradients have
    the same bits as differentiating them, without a node per term and per scalar op
    (each small op costs more than its arithmetic, several times its own time right
    after a model's forward). The CPU backend has the node itself
    (:meth:`CoMERAObjective._native_terms`)."""

    @staticmethod
    def forward(ctx, obj: CoMERAObjective, info: dict[str, Tensor],  # noqa: ANN001
                f: Tensor, *gates: Tensor) -> Tensor:
        s_raw, cores64, to_gates = gate_size_pass(obj.bank, obj.stage != "early")
        total, ctx.grads = obj._terms(f, s_raw, cores64, info)
        ctx.to_gates = to_gates
        return total

    @staticmethod
    def backward(ctx, d: Tensor):  # type: ignore[override]  # noqa: ANN205
        d_f, d_s = ctx.grads(d)
        return (None, None, d_f if ctx.needs_input_grad[2] else None, *ctx.to_gates(d_s))


def _mean_over_processes(value: Tensor) -> Tensor:
    """``value`` averaged over the processes of a running process group (itself alone,
    as it is). Under DDP each process sees its own share of the batch, so its own loss;
    deciding λ from it would have the processes optimise different objectives. (DDP
    steps run eagerly: no CUDA graph captures this collective.)"""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return value
    total = value.detach().clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()


class PlateauDetector:
    """Detects a loss plateau: an exponential moving average of the loss that has not
    improved by ``rel_tol`` (relative) for ``patience`` updates, after ``min_steps``.

    With ``min_drop`` the patience runs only while the smoothed loss is that much
    (relative) below where it started, the mean of the first ``head`` losses: a model
    stuck at its initial loss (a classifier at chance) has not converged, and switching it
    to the late stage would prune a network that has learned nothing.

    ``value`` is the smoothed loss (used as ``z_f``).
    """

    def __init__(self, patience: int = 100, rel_tol: float = 1e-3, beta: float = 0.95,
                 min_steps: int = 0, min_drop: float = 0.0, head: int = 20) -> None:
        if patience < 1:
            raise ValueError(f"patience: must be >= 1, got {patience}")
        if not 0.0 <= min_drop < 1.0 or head < 1:
            raise ValueError(f"min_drop, head: need 0 <= min_drop < 1 and head >= 1, "
                             f"got {min_drop}, {head}")
        self.patience, self.rel_tol, self.beta, self.min_steps = patience, rel_tol, beta, min_steps
        self.min_drop, self.head = min_drop, head
        self.value: float | None = None
        self.best = math.inf
        self.since_best = 0
        self.n = 0
        self.head_sum = 0.0  # sum of the first `head` losses

    @property
    def start(self) -> float | None:
        """Where the loss started: the mean of its first ``head`` values (None before)."""
        return self.head_sum / self.head if self.n >= self.head else None

    @property
    def learned(self) -> bool:
        """The smoothed loss is now ``min_drop`` below its start (always, without
        ``min_drop``). The current value, not the best: the first smoothed values are
        single noisy batches."""
        if self.min_drop <= 0.0:
            return True
        return (self.start is not None and self.value is not None
                and self.value < self.start * (1.0 - self.min_drop))

    def update(self, loss: float) -> bool:
        """Feed one loss; True once the loss has plateaued (after learning something)."""
        self.n += 1
        if self.n <= self.head:
            self.head_sum += loss
        self.value = loss if self.value is None else self.beta * self.value + (1 - self.beta) * loss
        if self.value < self.best * (1 - self.rel_tol):
            self.best = self.value
            self.since_best = 0
        elif self.learned:  # the patience runs only once the loss has fallen
            self.since_best += 1
        else:
            self.since_best = 0
        return self.n >= self.min_steps and self.since_best >= self.patience

    def state_dict(self) -> dict:
        return {"value": self.value, "best": self.best, "since_best": self.since_best, "n": self.n,
                "head_sum": self.head_sum}

    def load_state_dict(self, s: dict) -> None:
        self.value, self.best = s["value"], s["best"]
        self.since_best, self.n = s["since_best"], s["n"]
        # checkpoints from before min_drop kept no start: the smoothed loss stands in
        # for the losses seen of the first `head`
        self.head_sum = s.get("head_sum", (self.value or 0.0) * min(self.n, self.head))


