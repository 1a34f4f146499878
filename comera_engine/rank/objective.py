"""The two-stage rank-adaptive objective (comera-method.md §2).

Early stage (stable convergence), linear scalarisation::

    L = f + γ · Ŝ/S₀  (+ core_l2 · Σ‖G‖²)

Late stage (reach the requested size), achievement scalarisation toward ``z = (z_f, z_S)``::

    λ = 1 if (f − z_f)/f < (S − z_S)/S else 0
    L = ρ_f·f + ρ_S·Ŝ/S₀ + λ·Ŝ/S₀ + (1−λ)·f

Pruning is irreversible, so once ``S <= z_S`` the size terms are switched off (λ = 0,
no ``ρ_S`` term): the size lands on the target instead of overshooting it while the loss
happens to beat ``z_f``.

``S₀`` is the initial allocated TT size (so ``Ŝ/S₀`` starts at 1). ``z_S`` is the target
size set by the user's compression ratio, over the whole model (``scope="model"``: every
parameter counts, dense ones included) or over the tensorised layers only
(``scope="tensorized"``). ``z_f`` defaults to the early-stage loss plateau (the smoothed
loss when the stage switches), never a hard-coded constant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor, nn

from ..layers import tt_layers
from .size import dense_size, min_size, model_sizes, surrogate_size

__all__ = ["RankConfig", "CoMERAObjective", "PlateauDetector"]


@dataclass
class RankConfig:
    """Rank-adaptive training settings.

    gamma: early-stage weight on ``Ŝ/S₀``.
    tau: gate threshold (carried by the layers; recorded here for configs).
    target_compression: dense size / target size (> 1), or None for no late stage target.
    target_scope: ``"model"`` or ``"tensorized"``: what the ratio is measured on.
    rho_f, rho_s: augmentation weights of the late stage.
    z_f: late-stage loss reference; None = the early-stage plateau.
    core_l2: optional l2 on cores (stops cores growing to cancel shrinking gates).
    warmup_steps: the early-stage ``γ`` ramps linearly from 0 over these steps, so the
        size term cannot prune ranks before the task loss has started to fit.
    """

    gamma: float = 0.01
    tau: float = 1e-2
    target_compression: float | None = None
    target_scope: str = "model"
    rho_f: float = 0.1
    rho_s: float = 0.01
    z_f: float | None = None
    core_l2: float = 0.0
    warmup_steps: int = 0

    def validate(self) -> None:
        if self.gamma < 0:
            raise ValueError(f"gamma: must be >= 0, got {self.gamma}")
        if self.target_scope not in ("model", "tensorized"):
            raise ValueError(
                f"target_scope: must be 'model' or 'tensorized', got {self.target_scope!r}")
        if self.target_compression is not None and not (
                isinstance(self.target_compression, (int, float))
                and math.isfinite(self.target_compression) and self.target_compression > 1):
            raise ValueError(
                f"target_compression: must be a ratio > 1 (dense size / target size), got "
                f"{self.target_compression!r}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps: must be >= 0, got {self.warmup_steps}")
        for name in ("rho_f", "rho_s", "core_l2"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")


class CoMERAObjective:
    """Combines the task loss with the size objective for the current stage.

    ``objective(f)`` returns ``(total_loss, info)``; ``info`` holds plain floats for
    logging (``size``, ``size_surrogate``, ``target_size``, ``lambda``, ``stage``...).
    """

    def __init__(self, model: nn.Module, cfg: RankConfig) -> None:
        cfg.validate()
        self.model = model
        self.cfg = cfg
        self.stage = "early"
        self.z_f = cfg.z_f
        self.S0 = float(max(1, sum(m.tt.num_params(False) for _, m in tt_layers(model))))
        self.dense = dense_size(model)
        self.target_size: float | None = None
        if cfg.target_compression is not None:
            scope = cfg.target_scope
            self.target_size = self.dense[scope] / cfg.target_compression
            floor = min_size(model)[scope]
            if self.target_size < floor:
                raise ValueError(
                    f"target_compression: {cfg.target_compression:g}x needs a {scope} size of "
                    f"{self.target_size:.0f} params, below the {floor} that rank 1 everywhere "
                    f"allows (at most {self.dense[scope] / floor:.1f}x)")

    def switch_to_late(self, z_f: float | None = None) -> None:
        """Enter the late stage. ``z_f``: the early-stage plateau loss (or the config's)."""
        if self.target_size is None:
            raise ValueError("target_compression: the late stage needs a target compression")
        if z_f is not None and self.cfg.z_f is None:
            self.z_f = float(z_f)
        if self.z_f is None:
            raise ValueError("z_f: unknown; pass the early-stage plateau loss to switch_to_late")
        self.stage = "late"

    def sizes(self) -> dict[str, float]:
        s = model_sizes(self.model)
        scope = self.cfg.target_scope
        return {
            "size": float(s[scope]),
            "size_model": float(s["model"]),
            "size_tensorized": float(s["tensorized"]),
            "compression": self.dense[scope] / s[scope] if s[scope] else float("inf"),
            "compression_model": self.dense["model"] / s["model"] if s["model"] else math.inf,
            "compression_tensorized": (self.dense["tensorized"] / s["tensorized"]
                                       if s["tensorized"] else math.inf),
        }

    def objective(self, f: Tensor, step: int | None = None) -> tuple[Tensor, dict[str, float]]:
        """Total loss for the current stage and logging info. ``step`` drives the
        ``γ`` warm-up (omitted: counts calls)."""
        cfg = self.cfg
        self._calls = getattr(self, "_calls", 0) + 1
        step = self._calls - 1 if step is None else step
        s_hat = surrogate_size(self.model).to(f.dtype) / self.S0
        info: dict[str, float] = {"size_surrogate": float(s_hat.detach()) * self.S0,
                                  "stage": 0.0 if self.stage == "early" else 1.0}
        reg = f.new_zeros(())
        if cfg.core_l2 > 0:
            for _, m in tt_layers(self.model):
                for c in m.tt.cores:
                    reg = reg + c.pow(2).sum()
            reg = cfg.core_l2 * reg
        if self.stage == "early":
            ramp = min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0
            total = f + cfg.gamma * ramp * s_hat + reg
            info["lambda"] = 0.0
            info["gamma"] = cfg.gamma * ramp
        else:
            assert self.z_f is not None and self.target_size is not None
            S = self.sizes()["size"]
            fv = float(f.detach())
            gap_f = (fv - self.z_f) / fv if fv != 0 else 0.0
            gap_s = (S - self.target_size) / S if S > 0 else -1.0
            reached = S <= self.target_size
            lam = 1.0 if (gap_f < gap_s and not reached) else 0.0
            rho_s = 0.0 if reached else cfg.rho_s
            total = cfg.rho_f * f + rho_s * s_hat + lam * s_hat + (1 - lam) * f + reg
            info["lambda"] = lam
            info["z_f"] = self.z_f
        if self.target_size is not None:
            info["target_size"] = self.target_size
        return total, info


class PlateauDetector:
    """Detects a loss plateau: an exponential moving average of the loss that has not
    improved by ``rel_tol`` (relative) for ``patience`` updates, after ``min_steps``.

    ``value`` is the smoothed loss (used as ``z_f``).
    """

    def __init__(self, patience: int = 100, rel_tol: float = 1e-3, beta: float = 0.95,
                 min_steps: int = 0) -> None:
        if patience < 1:
            raise ValueError(f"patience: must be >= 1, got {patience}")
        self.patience, self.rel_tol, self.beta, self.min_steps = patience, rel_tol, beta, min_steps
        self.value: float | None = None
        self.best = math.inf
        self.since_best = 0
        self.n = 0

    def update(self, loss: float) -> bool:
        """Feed one loss; True once the loss has plateaued."""
        self.n += 1
        self.value = loss if self.value is None else self.beta * self.value + (1 - self.beta) * loss
        if self.value < self.best * (1 - self.rel_tol):
            self.best = self.value
            self.since_best = 0
        else:
            self.since_best += 1
        return self.n >= self.min_steps and self.since_best >= self.patience

    def state_dict(self) -> dict:
        return {"value": self.value, "best": self.best, "since_best": self.since_best, "n": self.n}

    def load_state_dict(self, s: dict) -> None:
        self.value, self.best = s["value"], s["best"]
        self.since_best, self.n = s["since_best"], s["n"]


