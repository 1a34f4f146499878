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

With ``keep_task_loss`` (on in the ``paced`` schedule) λ = 1 adds the size term and the
task loss keeps its weight: ``L = (1 + ρ_f)·f + (ρ_S + λ)·Ŝ/S_c``. In the spec's form
λ = 1 weighs the task loss at ``ρ_f`` (0.1, an eleventh of λ = 0's): the gates then
shrink by size alone, so the pace, which prunes by them, cuts entries the task needs
(``experiments/own_loop.py``: the autoencoder and the regression under a decaying rate).
Under the pace the size reaches the target whatever λ's pull; the ``comera`` schedule,
where only the objective prunes, keeps the spec's trade.

With ``loss_scale`` (on in our schedules, off in the paper's) every size term above is
multiplied by ``s = min(1, f₀ / ln 2)``, ``f₀`` where the task loss starts (its first
value, the untrained network's: :attr:`loss_start`, set by the controller). The paper's weights are
set for a classifier's cross-entropy, which starts at ``ln K >= ln 2`` for ``K`` classes
(``s = 1``: the spec's objective); a loss that starts lower (an MSE on values in
[0, 1] starts near 0.2) would weigh several times less against the size, and the late
stage can prune a network into one that answers a constant. Below ``ln 2``, multiplying
the task loss by a constant multiplies the whole objective by it.

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

``Ŝ`` comes from :func:`comera_engine.tensor.size.surrogate` (one pass over all gates,
plain PyTorch); ``S`` changes only when ranks die or are pruned, so it is counted then,
on the host (:meth:`CoMERAObjective.recount`, which the controller calls on every rank
change), and everything that depends on it alone (``S``, ``1/S_c``, ``(S − z_S)/S``,
whether the size is above the target) is kept in small device tensors refilled in
place. The loss is the expressions above, differentiated by autograd. Under DDP, λ is
decided from the loss averaged over all processes (as the stage switch is), so every
process optimises the same objective. Nothing per step is read back to the host, so the
same code runs eagerly and inside a captured CUDA graph (whose replays read the refilled
tensors). The settings are the run config's
:class:`~comera_engine.config.CoMERAConfig` (one set of names and defaults).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..config import CoMERAConfig, validate_comera
from ..errors import ConfigError
from ..layers import tt_layers
from ..tensor.size import surrogate
from .schedule import resolve_schedule
from .size import size_extra, size_spec
from .target import plan_target

__all__ = ["LOSS_UNIT", "CoMERAObjective", "PlateauDetector", "gamma_ramp"]

#: ``ln 2``: where a classifier's cross-entropy starts at the least (two classes); a task
#: loss that starts below it has the size terms scaled to its units (``loss_scale``)
LOSS_UNIT = math.log(2.0)


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
    ``γ`` warm-up and :meth:`recount` the cores' size after ranks change (both refill
    their device tensors in place).

    Raises:
        ConfigError: bad settings, or a target below what rank 1 everywhere allows.
    """

    def __init__(self, model: nn.Module, cfg: CoMERAConfig) -> None:
        validate_comera(cfg)
        self.cfg = cfg = resolve_schedule(cfg)
        self.stage = "early"
        self._z_f: float | None = None
        self._start: float | None = None  # f₀, where the task loss starts (loss_scale)
        self._target: float | None = None
        self._consts: dict[str, Tensor] = {}  # the per-stage constants, on the loss's device
        self.frozen = False  # ranks fixed at the target: the task loss alone
        self.step_index = 0
        self._trains = [m.tt for _, m in tt_layers(model)]  # the model's layers are fixed
        #: the cores' allocated size at the start: ``Ŝ/S₀`` starts at 1
        self.S0 = float(max(1, sum(t.num_params(False) for t in self._trains)))
        # the target scope's parameters outside the TT cores (TT biases, other layers)
        self._extra = size_extra(model, cfg.target_scope)
        self.target_size: float | None = None
        if cfg.target_compression is not None:  # refuses a target below the floor
            self.target_size = plan_target(size_spec(model), cfg.target_scope,
                                           cfg.target_compression).target
        self._cores = 0.0  # the cores' effective size (recount)
        self.recount()

    @property
    def z_f(self) -> float | None:
        """The late stage's reference loss (the early stage's plateau)."""
        return self._z_f

    @z_f.setter
    def z_f(self, value: float | None) -> None:
        self._z_f = None if value is None else float(value)
        self._fill()

    @property
    def loss_start(self) -> float | None:
        """``f₀``: where the task loss starts (its first value, the untrained network's;
        ``None`` before any). With ``loss_scale`` the size terms are scaled by
        ``min(1, f₀ / ln 2)``."""
        return self._start

    @loss_start.setter
    def loss_start(self, value: float | None) -> None:
        value = None if value is None else float(value)
        if value != self._start:
            self._start = value
            self._fill()

    def loss_scale(self) -> float:
        """The size terms' factor: ``min(1, f₀ / ln 2)`` with ``loss_scale`` and a
        positive, finite ``f₀``, else 1."""
        f0 = self._start
        if not self.cfg.loss_scale or f0 is None or not 0.0 < f0 < math.inf:
            return 1.0
        return min(1.0, f0 / LOSS_UNIT)

    @property
    def target_size(self) -> float | None:
        """``z_S``: the size the target compression asks for, in the target's scope."""
        return self._target

    @target_size.setter
    def target_size(self, value: float | None) -> None:
        self._target = None if value is None else float(value)
        self._fill()

    # ------------------------------------------------------------------ state

    @property
    def size_cores(self) -> float:
        """``S_c`` as last counted (:meth:`recount`)."""
        return self._cores

    def recount(self, cores: float | None = None) -> None:
        """The cores' effective size ``S_c`` (``Σ`` of :func:`tt_size` at the effective
        ranks; given as ``cores`` when the caller counted it), after ranks changed."""
        self._cores = float(sum(t.num_params(True) for t in self._trains)
                            if cores is None else cores)
        self._fill()

    def switch_to_late(self, z_f: float) -> None:
        """Enter the late stage. ``z_f``: the early-stage plateau loss."""
        if self.target_size is None:
            raise ConfigError("comera.target_compression",
                              "the late stage needs a target compression")
        self.stage = "late"
        self.z_f = float(z_f)

    def begin_step(self, index: int) -> None:
        """The 0-based index of the step about to run (drives the ``γ`` warm-up)."""
        if gamma_ramp(self.cfg.gamma_warmup, index) != gamma_ramp(self.cfg.gamma_warmup,
                                                                  self.step_index):
            self.step_index = index
            self._fill()
        self.step_index = index

    def _values(self) -> dict[str, float]:
        """The current constants: ``coef`` (``s·γ·ramp/S₀``), ``gamma`` (``γ·ramp``), the
        size ``S``, ``gap_s`` (``(S − z_S)/S``), ``pursue`` (the size terms on: above the
        target, or always in the paper's schedule), ``inv_norm`` (``s/S_c``, or ``s/S₀``
        with ``late_norm = "initial"``), ``rho_s`` (``s·ρ_S·pursue/S_c``), ``one_rho_f``
        (``1 + ρ_f``), ``z_f``, ``target_size``."""
        cfg = self.cfg
        gamma = cfg.gamma * gamma_ramp(cfg.gamma_warmup, self.step_index)
        size = self._cores + self._extra
        target = self.target_size if self.target_size is not None else math.nan
        norm = self.S0 if cfg.late_norm == "initial" else max(1.0, self._cores)
        above = size > target if cfg.size_off_at_target is not False else True
        pursue = float(above)
        scale = self.loss_scale()  # the size terms in the task loss's units
        return {"coef": gamma * scale / self.S0, "gamma": gamma, "size": size,
                "gap_s": (size - target) / size if size > 0 else -1.0,
                "pursue": pursue, "inv_norm": scale / norm,
                "rho_s": self.cfg.rho_s * pursue * scale / norm,
                "one_rho_f": 1.0 + self.cfg.rho_f,
                "z_f": self.z_f if self.z_f is not None else 0.0,
                "target_size": target, "zero": 0.0}

    def _fill(self, like: Tensor | None = None) -> None:
        """Refill the constants' device tensors in place (made on first use, like the
        loss: its device and dtype)."""
        if like is not None and (not self._consts or self._consts["zero"].device != like.device
                                 or self._consts["zero"].dtype != like.dtype):
            self._consts = {k: like.new_full((), v) for k, v in self._values().items()}
            return
        if self._consts:
            for key, value in self._values().items():
                self._consts[key].fill_(value)

    # ------------------------------------------------------------------ the loss

    def __call__(self, f: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        c = self._consts
        if not c or c["zero"].device != f.device or c["zero"].dtype != f.dtype:
            self._fill(f)
            c = self._consts
        info: dict[str, Tensor] = {"lambda": c["zero"]}
        if self.frozen:  # ranks fixed: the task loss alone, the size a constant
            total = f
            info["size"] = c["size"]
        elif self.stage == "early":  # f + γ·ramp·Ŝ/S₀
            s_hat = surrogate(self._trains).to(f.dtype)
            total = torch.addcmul(f, c["coef"], s_hat)
            info["size_surrogate"] = s_hat.detach()
            info["gamma"] = c["gamma"]
        else:  # (1 + ρ_f − λ)·f + (ρ_S + λ)·Ŝ/S_c, the size terms off at the target
            s_hat = surrogate(self._trains).to(f.dtype)
            fv = _mean_over_processes(f.detach())  # every process picks the same λ
            lam = torch.where((fv - c["z_f"]) / fv < c["gap_s"], c["pursue"], c["zero"])
            weight_s = torch.addcmul(c["rho_s"], lam, c["inv_norm"])
            weight_f = c["one_rho_f"] if self.cfg.keep_task_loss else c["one_rho_f"] - lam
            total = torch.addcmul(weight_f * f, weight_s, s_hat)
            info.update(size_surrogate=s_hat.detach(), size=c["size"], z_f=c["z_f"],
                        **{"lambda": lam})
        if self.cfg.l2_cores > 0:  # the cores' L2 term (comera.l2_cores; off by default)
            reg = sum(core.pow(2).sum() for t in self._trains for core in t.cores)
            total = total + self.cfg.l2_cores * reg
        if self.target_size is not None:
            info["target_size"] = c["target_size"]
        return total, info


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


