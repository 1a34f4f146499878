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

``Ŝ`` and ``S`` come from :func:`comera_engine.tensor.size.train_sizes` (one pass over
all gates, plain PyTorch); the loss is the expressions above, differentiated by
autograd. Under DDP, λ is decided from the loss averaged over all processes (as the
stage switch is), so every process optimises the same objective. Every quantity stays
on the device (``λ``, the effective size ``S`` counted from the gate masks), so the same
code runs eagerly and inside a captured CUDA graph; values are read back to the host
only for logging. The settings are the run config's
:class:`~comera_engine.config.CoMERAConfig` (one set of names and defaults).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..config import CoMERAConfig, resolve_schedule, validate_comera
from ..errors import ConfigError
from ..layers import tt_layers
from ..tensor.size import train_sizes
from .size import size_extra, size_spec
from .target import plan_target

__all__ = ["CoMERAObjective", "PlateauDetector", "gamma_ramp"]


def gamma_ramp(warmup_steps: int, step: int) -> float:
    """Early-stage ``γ`` warm-up factor at 0-based ``step``: ``min(1, (step+1)/warmup)``."""
    return min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0


class CoMERAObjective:
    """The task loss combined with the size objective of the current stage.

    ``obj(f)`` returns ``(total_loss, info)``: ``info`` holds 0-d device tensors for
    logging (``lambda``; ``size_surrogate`` until the ranks are fixed; ``gamma`` in the
    early stage, ``size`` and ``z_f`` in the late one and once the ranks are fixed,
    ``target_size`` when a target is set). Nothing is read back to the host, so the call
    can be captured into a CUDA graph. :meth:`begin_step` sets the step that drives the
    ``γ`` warm-up (in place on the device).

    Raises:
        ConfigError: bad settings, or a target below what rank 1 everywhere allows.
    """

    def __init__(self, model: nn.Module, cfg: CoMERAConfig) -> None:
        validate_comera(cfg)
        self.cfg = cfg = resolve_schedule(cfg)
        self.stage = "early"
        self.z_f: float | None = None
        self.frozen = False  # ranks fixed at the target: the task loss alone
        self.step_index = 0
        self._trains = [m.tt for _, m in tt_layers(model)]  # the model's layers are fixed
        #: the cores' allocated size at the start: ``Ŝ/S₀`` starts at 1
        self.S0 = float(max(1, sum(t.num_params(False) for t in self._trains)))
        # the target scope's parameters outside the TT cores (TT biases, other layers)
        self._extra = size_extra(model, cfg.target_scope)
        self._ramp: Tensor | None = None  # γ's warm-up factor, on the loss's device
        self._fixed_size: Tensor | None = None  # the size once the ranks are fixed
        self.target_size: float | None = None
        if cfg.target_compression is not None:  # refuses a target below the floor
            self.target_size = plan_target(size_spec(model), cfg.target_scope,
                                           cfg.target_compression).target

    def switch_to_late(self, z_f: float) -> None:
        """Enter the late stage. ``z_f``: the early-stage plateau loss."""
        if self.target_size is None:
            raise ConfigError("comera.target_compression",
                              "the late stage needs a target compression")
        self.z_f = float(z_f)
        self.stage = "late"

    def begin_step(self, index: int) -> None:
        """The 0-based index of the step about to run (drives the ``γ`` warm-up; the
        factor is filled in place, so a captured graph reads the new value)."""
        self.step_index = index
        if self._ramp is not None:
            self._ramp.fill_(gamma_ramp(self.cfg.gamma_warmup, index))

    def _ramp_on(self, like: Tensor) -> Tensor:
        if self._ramp is None or self._ramp.device != like.device:
            self._ramp = torch.full((), gamma_ramp(self.cfg.gamma_warmup, self.step_index),
                                    dtype=torch.float32, device=like.device)
        return self._ramp

    def __call__(self, f: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        info: dict[str, Tensor] = {}
        if self.frozen:  # ranks fixed: the size is a constant, counted once
            if self._fixed_size is None or self._fixed_size.device != f.device:
                cores = train_sizes(self._trains)[1]
                assert cores is not None
                self._fixed_size = (cores + self._extra).to(f.dtype)
            total = f
            info["lambda"] = f.new_zeros(())  # not chosen (logged only)
            info["size"] = self._fixed_size
        elif self.stage == "early":
            total = self._early(f, info)
        else:
            total = self._late(f, info)
        if self.cfg.l2_cores > 0:  # the cores' L2 term (comera.l2_cores; off by default)
            reg = sum(c.pow(2).sum() for t in self._trains for c in t.cores)
            total = total + self.cfg.l2_cores * reg
        if self.target_size is not None:
            info["target_size"] = f.new_full((), self.target_size)
        return total, info

    def _early(self, f: Tensor, info: dict[str, Tensor]) -> Tensor:
        """``f + γ·ramp·Ŝ/S₀``."""
        s_hat = train_sizes(self._trains, sizes=False)[0]
        gamma = self.cfg.gamma * self._ramp_on(f).to(f.dtype)
        info["size_surrogate"] = s_hat.detach()
        info["lambda"] = f.new_zeros(())  # λ is not chosen (logged only)
        info["gamma"] = gamma
        return f + gamma * s_hat.to(f.dtype) / self.S0

    def _late(self, f: Tensor, info: dict[str, Tensor]) -> Tensor:
        """``ρ_f·f + ρ_S·Ŝ/S_c + λ·Ŝ/S_c + (1−λ)·f`` (module doc), the size terms off once
        the size is at the target unless the schedule keeps them."""
        cfg = self.cfg
        assert self.z_f is not None and self.target_size is not None
        s_hat, cores = train_sizes(self._trains)
        assert cores is not None
        info["size_surrogate"] = s_hat.detach()
        size = (cores + self._extra).to(f.dtype)
        norm = self.S0 if cfg.late_norm == "initial" else cores.to(f.dtype).clamp_min(1.0)
        s_term = s_hat.to(f.dtype) / norm
        fv = _mean_over_processes(f.detach())  # every process picks the same λ
        gap_f = torch.where(fv != 0, (fv - self.z_f) / fv, 0.0)
        gap_s = torch.where(size > 0, (size - self.target_size) / size, -1.0)
        if cfg.size_off_at_target is False:  # the paper's: the size terms stay on
            pursue = torch.ones_like(size)
        else:  # the size terms, until the size is at the target
            pursue = (size > self.target_size).to(f.dtype)
        lam = (gap_f < gap_s).to(f.dtype) * pursue
        info["lambda"] = lam
        info["size"] = size
        info["z_f"] = f.new_full((), self.z_f)
        return cfg.rho_f * f + (cfg.rho_s * pursue + lam) * s_term + (1 - lam) * f


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


