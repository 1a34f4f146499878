"""The CoMERA side of a run, in one object: optimizer groups, objective, stages, ranks.

:class:`CoMERAState` wires ``comera_engine.rank`` (the objective of each stage, the
plateau detector, the gate refresh, truncation of cores and optimizer state) and
``comera_engine.layers`` (size reports) into the shape the training loop needs, and
holds what a checkpoint must save about them. A model without TT layers (the dense
baseline) or ``comera.enabled = false`` gives plain task-loss training.

:func:`graph_safe_objective` is the same objective as
``CoMERAObjective.objective`` computed without reading anything back to the host (the
late stage's ``λ`` and the effective size stay on the device), so that it can be
captured into a CUDA graph; it is tested equal to the reference on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from comera_engine.errors import ConfigError
from comera_engine.train.config import CoMERAConfig

Objective = Callable[[Tensor], tuple[Tensor, dict[str, Any]]]


def tt_layers(model: nn.Module) -> dict[str, nn.Module]:
    """TT layers of ``model`` by qualified name."""
    from comera_engine.layers import tt_layers as pairs

    return dict(pairs(model))


class CoMERAState:
    """Everything about the rank-adaptive objective a training run needs.

    Raises:
        ConfigError: the rank settings do not fit the model (e.g. a target compression
            beyond what rank 1 everywhere allows).
    """

    def __init__(self, model: nn.Module, cfg: CoMERAConfig) -> None:
        self.cfg = cfg
        self.model = model
        self.has_tt = bool(tt_layers(model))
        self.enabled = cfg.enabled and self.has_tt
        self.objective: Any = None
        self.plateau: Any = None
        self.step_index = 0  # 0-based index of the step being computed (drives γ warm-up)
        self.steps_per_epoch = 0  # set by the loop; turns comera.switch_epoch into a step
        self._counts: list[int] | None = None  # alive count per bond (device refresh)
        self._ramp: Tensor | None = None  # the same warm-up factor, on the device (graphs)
        if self.has_tt:
            from comera_engine import rank

            for layer in tt_layers(model).values():
                layer.tt.tau = cfg.tau  # the gate threshold lives on the layers
            self.plateau = rank.PlateauDetector(
                patience=cfg.plateau_patience, rel_tol=cfg.plateau_min_delta
            )
        if self.enabled:
            from comera_engine import rank

            rank_cfg = rank.RankConfig(
                gamma=cfg.gamma,
                tau=cfg.tau,
                target_compression=cfg.target_compression,
                target_scope=cfg.target_scope,
                rho_f=cfg.rho_f,
                rho_s=cfg.rho_s,
                core_l2=cfg.l2_cores,
                warmup_steps=cfg.gamma_warmup,
            )
            try:
                self.objective = rank.CoMERAObjective(model, rank_cfg)
            except ValueError as exc:
                field, _, problem = str(exc).partition(": ")
                raise ConfigError(f"comera.{field}", problem) from None

    # ------------------------------------------------------------------ optimizer

    def make_optimizer(self, capturable: bool = False) -> torch.optim.Optimizer:
        """AdamW with groups ``cores``, ``gates`` and ``dense`` (each its own lr).

        On CPU the fused AdamW kernel: a TT model has hundreds of small parameters
        (cores and gates of every layer), and the default per-parameter loop costs more
        than the update itself (paper-size CoMERA model, one thread: 38 → 8 ms a step;
        ``experiments/bench_step_overheads.py``). Elsewhere torch's default (``foreach``
        on CUDA)."""
        c = self.cfg
        if self.has_tt:
            from comera_engine import rank

            groups = rank.param_groups(
                self.model, c.lr_cores, c.lr_gates, c.lr_dense, c.weight_decay
            )
        else:
            params = [p for p in self.model.parameters() if p.requires_grad]
            groups = [{"name": "dense", "params": params, "lr": c.lr_dense}]
            groups[0]["weight_decay"] = c.weight_decay
        params = [p for g in groups for p in g["params"]]
        cpu = bool(params) and all(p.device.type == "cpu" and p.is_floating_point()
                                   for p in params)
        if cpu and not capturable:
            return torch.optim.AdamW(groups, fused=True)
        return torch.optim.AdamW(groups, capturable=capturable)

    # ------------------------------------------------------------------ step

    @property
    def stage_name(self) -> str:
        return self.objective.stage if self.enabled else "plain"

    def objective_fn(self, graph_safe: bool = False) -> Objective | None:
        """``task_loss -> (total, info)`` of the current stage, or ``None`` (plain loss).

        ``graph_safe``: the version with no host synchronisation (for CUDA graphs).
        """
        if not self.enabled:
            return None
        objective = self.objective
        if graph_safe:
            return lambda f: graph_safe_objective(objective, f, self._ramp_on(f.device))
        return lambda f: objective.objective(f, step=self.step_index)

    def begin_step(self, index: int) -> None:
        """Tell the objective which (0-based) step comes next; in place on the device
        for a captured graph."""
        self.step_index = index
        if self._ramp is not None:
            self._ramp.fill_(gamma_ramp(self.cfg.gamma_warmup, index))

    def _ramp_on(self, device: torch.device) -> Tensor:
        if self._ramp is None or self._ramp.device != device:
            ramp = gamma_ramp(self.cfg.gamma_warmup, self.step_index)
            self._ramp = torch.full((), ramp, dtype=torch.float32, device=device)
        return self._ramp

    def after_step(self, step: int) -> list[str]:
        """Make newly pruned ranks permanent (after every optimizer step); returns one
        message per bond whose effective rank changed."""
        if not self.has_tt:
            return []
        from comera_engine import rank

        return [str(e) for e in rank.refresh_gates(self.model, step)]

    def refresh_fn(self) -> Callable[[], Tensor] | None:
        """The gate refresh as device work (for a captured step): returns the alive count
        of every bond; :meth:`events_from_counts` turns them into rank-change messages."""
        if not self.has_tt:
            return None
        model = self.model
        self._counts = [
            int(m.tt.alive(k).sum())
            for m in tt_layers(model).values()
            for k in range(len(m.tt.gates))
        ]
        return lambda: refresh_gates_on_device(model)

    def events_from_counts(self, step: int, counts: list[float]) -> list[str]:
        """Rank-change messages from the bond counts a device refresh returned."""
        from comera_engine.rank import RankEvent

        bonds = [(n, k) for n, m in tt_layers(self.model).items() for k in range(len(m.tt.gates))]
        new = [int(c) for c in counts]
        if self._counts is None:  # refresh_fn() takes the first snapshot
            self._counts = new
            return []
        events = [
            str(RankEvent(step, name, k, old, now))
            for (name, k), old, now in zip(bonds, self._counts, new)
            if old != now
        ]
        self._counts = new
        return events

    def maybe_switch(self, step: int, task_loss: float) -> str | None:
        """Switch to the late stage when its time has come; returns a message if it did."""
        if not self.enabled or self.objective.stage != "early":
            return None
        switch = self.cfg.switch
        if self.cfg.switch_epoch is not None and self.steps_per_epoch:
            switch = self.cfg.switch_epoch * self.steps_per_epoch
        if switch == "auto":
            switch = "plateau" if self.cfg.target_compression is not None else "never"
        plateaued = self.plateau.update(task_loss)
        if switch == "never" or (switch == "plateau" and not plateaued):
            return None
        if isinstance(switch, int) and step < switch:
            return None
        self.objective.switch_to_late(z_f=self.plateau.value)
        return f"late stage after step {step} (z_f = {self.objective.z_f:.4g})"

    # ------------------------------------------------------------------ ranks and size

    def effective_ranks(self, counts: list[float] | None = None) -> dict[str, list[int]]:
        """Effective ranks per TT layer. ``counts``: the bond counts a device refresh just
        returned (after a refresh every alive entry is above ``tau``, so they are the
        effective ranks): used as they are, without reading the gates from the device."""
        layers = tt_layers(self.model)
        if counts is None:
            return {name: list(m.effective_ranks()) for name, m in layers.items()}
        out, i = {}, 0
        for name, m in layers.items():
            n = len(m.tt.gates)
            out[name] = [int(c) for c in counts[i : i + n]]
            i += n
        return out

    def size_metrics(self) -> dict[str, float]:
        """Parameters, bytes and compression vs the dense baseline (effective ranks)."""
        if not self.has_tt:
            params = list(self.model.parameters())
            n = float(sum(p.numel() for p in params))
            nbytes = float(sum(p.numel() * p.element_size() for p in params))
            return {
                "params/effective": n,
                "params/allocated": n,
                "params/dense": n,
                "bytes/effective": nbytes,
                "bytes/dense": nbytes,
                "compression/model": 1.0,
            }
        from comera_engine import size_report

        rep = size_report(self.model)
        model, tensorized = rep["model"], rep["tensorized"]
        return {
            "params/effective": float(model["effective_params"]),
            "params/allocated": float(model["allocated_params"]),
            "params/dense": float(model["dense_params"]),
            "bytes/effective": float(model["effective_bytes"]),
            "bytes/dense": float(model["dense_bytes"]),
            "compression/model": float(model["compression"]),
            "compression/tensorized": float(tensorized["compression"]),
            "params/tensorized_effective": float(tensorized["effective_params"]),
        }

    def truncate(self, optimizer: torch.optim.Optimizer) -> str:
        """Physically slice cores (and AdamW state) to the effective ranks; returns a
        summary of what shrank (empty if nothing did)."""
        if not self.has_tt:
            return ""
        from comera_engine import rank

        changed = rank.truncate_model_and_optimizer(self.model, optimizer)
        if not changed:
            return ""
        bonds = sum(len(v) for v in changed.values())
        return f"{bonds} bonds in {len(changed)} layers"

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        return {
            "stage": self.objective.stage if self.enabled else None,
            "z_f": self.objective.z_f if self.enabled else None,
            "plateau": self.plateau.state_dict() if self.plateau is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.plateau is not None and state.get("plateau") is not None:
            self.plateau.load_state_dict(state["plateau"])
        if self.enabled and state.get("stage") == "late":
            self.objective.switch_to_late(z_f=state["z_f"])


# ---------------------------------------------------------------------- graph-safe objective


def gamma_ramp(warmup_steps: int, step: int) -> float:
    """Early-stage ``γ`` warm-up factor at 0-based ``step`` (as ``CoMERAObjective``)."""
    return min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0


def graph_safe_objective(
    obj: Any, f: Tensor, ramp: Tensor | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """``CoMERAObjective.objective(f, step)`` with every quantity kept on the device.

    Early: ``f + γ·ramp·Ŝ/S₀ (+ l2)``, ``ramp`` the γ warm-up factor of this step (a
    0-d tensor the loop updates in place). Late, with ``reached = S <= z_S``:
    ``λ = [(f − z_f)/f < (S − z_S)/S and not reached]`` and
    ``ρ_f·f + ρ_S'·Ŝ/S₀ + λ·Ŝ/S₀ + (1−λ)·f (+ l2)`` where ``ρ_S' = 0`` once reached, with
    the effective size ``S`` counted from the gate masks on the device. Reads the
    objective's state (stage, ``S₀``, ``z_f``, target) but never a value back to the host.
    """
    from comera_engine import rank

    cfg = obj.cfg
    model = obj.model
    s_hat = rank.surrogate_size(model).to(f.dtype) / obj.S0
    reg = f.new_zeros(())
    if cfg.core_l2 > 0:
        for m in tt_layers(model).values():
            for c in m.tt.cores:
                reg = reg + c.pow(2).sum()
        reg = cfg.core_l2 * reg
    info: dict[str, Tensor] = {"size_surrogate": s_hat.detach() * obj.S0}
    if obj.stage == "early":
        ramp = f.new_ones(()) if ramp is None else ramp.to(f.dtype)
        total = f + cfg.gamma * ramp * s_hat + reg
        info["lambda"] = f.new_zeros(())
        info["gamma"] = cfg.gamma * ramp
    else:
        size = effective_size(model, cfg.target_scope).to(f.dtype)
        fv = f.detach()
        gap_f = torch.where(fv != 0, (fv - obj.z_f) / fv, torch.zeros_like(fv))
        gap_s = torch.where(size > 0, (size - obj.target_size) / size, -torch.ones_like(size))
        reached = size <= obj.target_size
        lam = ((gap_f < gap_s) & ~reached).to(f.dtype)
        rho_s = torch.where(reached, torch.zeros_like(s_hat), torch.full_like(s_hat, cfg.rho_s))
        total = cfg.rho_f * f + rho_s * s_hat + lam * s_hat + (1 - lam) * f + reg
        info["lambda"] = lam
        info["size"] = size
    return total, info


@torch.no_grad()
def refresh_gates_on_device(model: nn.Module) -> Tensor:
    """``comera_engine.rank.refresh_gates`` without host reads: per bond, entries with
    ``|g| <= tau`` die for good and are zeroed, except that a bond about to lose its last
    entry keeps its strongest one, held at ``±1.5·tau``. Returns the alive count of every
    bond (layers in ``tt_layers`` order), as one device tensor."""
    counts = []
    for layer in tt_layers(model).values():
        tt = layer.tt
        for k, g in enumerate(tt.gates):
            alive = tt.alive(k)
            survivors = alive & (g.abs() > tt.tau)
            rescue = alive.any() & ~survivors.any()
            strongest = torch.argmax(g.abs().masked_fill(~alive, -1.0))
            keep = (torch.arange(g.shape[0], device=g.device) == strongest) & rescue
            held = torch.where(g < 0, -1.5 * tt.tau, 1.5 * tt.tau).to(g.dtype)
            g.copy_(torch.where(keep, held, g))
            alive &= survivors | keep
            g.masked_fill_(~alive, 0.0)
            counts.append(alive.sum())
    return torch.stack(counts)


def effective_size(model: nn.Module, scope: str) -> Tensor:
    """Effective size ``S`` (``"tensorized"`` or ``"model"``) as a device tensor: per TT
    layer ``Σ_k s_k R_{k-1} R_k`` over gate-mask counts, 0 if a bond is dead."""
    from comera_engine.rank import dense_size

    total: Tensor | None = None
    for layer in tt_layers(model).values():
        tt = layer.tt
        counts = [m.sum().to(torch.float64) for m in tt.masks()]
        one = tt.cores[0].new_ones((), dtype=torch.float64)
        ranks = [one, *counts, one]
        size = sum(s * ranks[k] * ranks[k + 1] for k, s in enumerate(tt.mode_sizes))
        alive = torch.stack([r > 0 for r in ranks]).all()
        size = torch.where(alive, size, torch.zeros_like(size))
        total = size if total is None else total + size
    if total is None:
        total = torch.zeros((), dtype=torch.float64)
    if scope == "model":
        total = total + dense_size(model)["other"]
    return total
