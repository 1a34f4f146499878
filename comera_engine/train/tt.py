"""The CoMERA side of a run, in one object: optimizer groups, objective, stages, ranks.

:class:`CoMERAState` wires ``comera_engine.rank`` (the objective of each stage, the
plateau detector, the gate refresh, truncation of cores and optimizer state) and
``comera_engine.layers`` (size reports) into the shape the training loop needs, and
holds what a checkpoint must save about them. A model without TT layers (the dense
baseline) or ``comera.enabled = false`` gives plain task-loss training. The objective
itself is :class:`comera_engine.rank.CoMERAObjective` (one implementation, on device
tensors, eager and under CUDA graphs alike).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from comera_engine.config import CoMERAConfig, Config

Objective = Callable[[Tensor], tuple[Tensor, dict[str, Any]]]


def tt_layers(model: nn.Module) -> dict[str, nn.Module]:
    """TT layers of ``model`` by qualified name."""
    from comera_engine.layers import tt_layers as pairs

    return dict(pairs(model))


def factorized_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The engine's TT layers and the peer (tltorch) TT layers of ``model``, by name, in
    the order :func:`comera_engine.rank.size_spec` lists them."""
    from comera_engine.layers import peer_layers
    from comera_engine.layers import tt_layers as pairs

    return dict(pairs(model) + peer_layers(model))


def _what(changes: dict[str, list[tuple[int, int, int]]]) -> str:
    """``layer bonds k: old->new, …; …`` for a pace message."""
    return "; ".join(f"{name} bonds " + ", ".join(f"{k}: {o}->{n}" for k, o, n in ch)
                     for name, ch in changes.items())


def plan_initial_ranks(cfg: Config, data: Any) -> tuple[Config, Any]:
    """The run's target plan before the first step (:func:`comera_engine.rank.plan_target`
    on a meta-device model built from ``cfg.model`` and ``data``'s shape facts: a
    ``DataBundle`` or the preview's ``data_shape``; nothing is allocated or read).

    Returns ``(cfg, plan)``: ``cfg`` with ``model.rank`` / ``model.embedding_rank`` set
    to the ranks chosen from the target when the plan chose them (else ``cfg`` itself),
    and the :class:`~comera_engine.rank.TargetPlan` (``None``: no target to plan for:
    dense baseline, ``comera.enabled = false``, or no target).

    The fixed-rank methods (``comera.method`` ``"fixed"`` / ``"tt_svd"``, docs/METHODS.md)
    with a target get :func:`comera_engine.rank.plan_fixed_ranks`: the per-bond ranks of
    the TT model of the target size (``plan.bond_ranks``, applied by
    :func:`comera_engine.train.methods.build_run_model`), ``model.rank`` /
    ``model.embedding_rank`` set to the largest of them (the ranks are the target's:
    the config's are not read, so planning a planned config gives the same plan).

    Raises:
        ConfigError: the target is below the floor, or a fixed ``model.rank`` already
            compresses more than asked.
    """
    import dataclasses

    from comera_engine import rank
    from comera_engine.models import build_model

    c = cfg.comera
    fixed = c.method != "comera"  # "fixed" / "tt_svd": the ranks that meet the target
    if cfg.model.dense or not (c.enabled or fixed) or c.target_compression is None:
        return cfg, None
    with torch.device("meta"):
        model = build_model(cfg.model, data)
    if not factorized_layers(model):
        return cfg, None
    if fixed:
        plan = rank.plan_fixed_ranks(rank.size_spec(model), c.target_scope,
                                     c.target_compression)
        changes = {k: v for k, v in (("rank", plan.rank),
                                     ("embedding_rank", plan.embedding_rank)) if v is not None}
        return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **changes)), plan
    plan = rank.plan_target(rank.size_spec(model), c.target_scope, c.target_compression,
                            rank_fixed=cfg.model.rank is not None,
                            embedding_rank_fixed=cfg.model.embedding_rank is not None,
                            headroom=c.headroom)
    if plan.rank is None and plan.embedding_rank is None:
        return cfg, plan
    changes = {k: v for k, v in (("rank", plan.rank), ("embedding_rank", plan.embedding_rank))
               if v is not None}
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **changes)), plan


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
        # the CoMERA objective runs for comera.method = "comera" only: "fixed" / "tt_svd"
        # train the task loss at fixed ranks (gates frozen: train.methods.freeze_gates)
        self.enabled = cfg.enabled and cfg.method == "comera" and self.has_tt
        self.has_peers = len(factorized_layers(model)) > len(tt_layers(model))
        self.objective: Any = None
        self.plateau: Any = None
        self.steps_per_epoch = 0  # set by the loop; turns comera.switch_epoch into a step
        self.total_steps = 0  # set by the loop; turns switch_by / reach_at into steps
        self.pace: Any = None  # the planned size path (rank.PacePlan) once the late stage runs
        self.frozen = False  # the target size was reached: ranks are fixed from here
        self._counts: list[int] | None = None  # alive count per bond (device refresh)
        if self.has_tt:
            from comera_engine import rank

            for layer in tt_layers(model).values():
                layer.tt.tau = cfg.tau  # the gate threshold lives on the layers
            # a plateau counts once the smoothed loss is 1 % below where it started:
            # a network still at its initial loss (at chance) is not pruned for it
            self.plateau = rank.PlateauDetector(
                patience=cfg.plateau_patience, rel_tol=cfg.plateau_min_delta, min_drop=0.01
            )
        if self.enabled:
            from comera_engine import rank

            self.objective = rank.CoMERAObjective(model, cfg)

    # ------------------------------------------------------------------ optimizer

    def make_optimizer(self, capturable: bool = False) -> torch.optim.Optimizer:
        """AdamW with the groups of :func:`comera_engine.rank.param_groups` (``cores``,
        ``embedding`` with ``lr_embedding``, ``gates``, ``dense``; each its own lr).

        On CPU the fused AdamW kernel: a TT model has hundreds of small parameters
        (cores and gates of every layer), and the default per-parameter loop costs more
        than the update itself (``experiments/bench_step_overheads.py``). Elsewhere
        torch's default (``foreach`` on CUDA)."""
        c = self.cfg
        if self.has_tt or self.has_peers:  # peer TT cores learn at lr_cores too
            from comera_engine import rank

            groups = rank.param_groups(
                self.model, c.lr_cores, c.lr_gates, c.lr_dense, c.weight_decay,
                lr_embedding=c.lr_embedding)
            for g in groups:  # frozen gates (fixed ranks) are not optimised
                g["params"] = [p for p in g["params"] if p.requires_grad]
            groups = [g for g in groups if g["params"]]
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

    def objective_fn(self) -> Objective | None:
        """``task_loss -> (total, info)`` of the current stage, or ``None`` (plain loss);
        free of host synchronisation, so it can be captured into a CUDA graph."""
        return self.objective if self.enabled else None

    def begin_step(self, index: int) -> None:
        """Tell the objective which (0-based) step comes next (in place on the device,
        for a captured graph)."""
        if self.enabled:
            self.objective.begin_step(index)

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
        from comera_engine.rank import refresh_gates_on_device

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
        due = (switch == "plateau" and plateaued) or (isinstance(switch, int) and step >= switch)
        latest = self._pacing() and switch != "never" and step >= self._step_of(
            self.cfg.switch_by)
        if not (due or latest):
            return None
        self.objective.switch_to_late(z_f=self.plateau.value)
        text = f"late stage after step {step} (z_f = {self.objective.z_f:.4g})"
        if latest and not due:
            text += f" (comera.switch_by: the latest start, {self.cfg.switch_by} of the steps)"
        if self._pacing() and not self.frozen:
            from comera_engine import rank

            self.pace = rank.PacePlan(step, self.current_size(), self._step_of(self.cfg.reach_at),
                                      float(self.objective.target_size))
            text += (f"; size {self.pace.start_size:.0f} -> target "
                     f"{self.pace.target:.0f} by step {self.pace.reach_step}")
        return text

    # ------------------------------------------------------------------ pace

    def _pacing(self) -> bool:
        """The pace is on: comera.pace with a target and a step budget."""
        return (self.enabled and self.cfg.pace and self.objective.target_size is not None
                and self.total_steps > 0)

    def _step_of(self, fraction: float) -> int:
        return max(1, math.ceil(fraction * self.total_steps))

    def current_size(self, counts: list[float] | None = None) -> float:
        """The effective size in the target's scope, from the bond counts a device refresh
        returned (or the gates); the same count as ``effective_size`` and ``size_report``."""
        from comera_engine import rank

        layers = tt_layers(self.model)
        ranks = self.effective_ranks(counts)
        return rank.host_size([list(m.tt.mode_sizes) for m in layers.values()],
                              [ranks[n] for n in layers], self._extra())

    def _extra(self) -> float:
        if getattr(self, "_extra_size", None) is None:
            from comera_engine import rank

            full = rank.model_sizes(self.model)
            cores = sum(m.tt.num_params(True) for m in tt_layers(self.model).values())
            extra = full["tensorized"] - cores
            if self.cfg.target_scope == "model":
                extra += full["other"]
            self._extra_size = float(extra)
        return self._extra_size

    def pace_step(self, step: int, ranks_changed: bool, counts: list[float] | None = None
                  ) -> tuple[list[str], bool]:
        """After a step: prune ranks that lag the planned path (at every pace check, and
        every step from ``reach_at`` on until the target is met), and fix the ranks once
        the size is at the target. Returns the messages (one per action) and whether the
        step must be rebuilt (the ranks were fixed: the gate threshold changed)."""
        if not self._pacing() or self.frozen:
            return [], False
        from comera_engine import rank
        from comera_engine.metrics import TARGET_TOLERANCE

        target = float(self.objective.target_size)
        messages: list[str] = []
        pace = self.pace
        check = pace is not None and (step >= pace.reach_step
                                      or (step - pace.start_step) % pace.every() == 0)
        if not (check or ranks_changed):
            return [], False
        size = self.current_size(counts)
        low = target / (1 + TARGET_TOLERANCE)
        if check and size > pace.goal(step):
            goal = pace.goal(step)
            new, changes = rank.prune_to(self.model, goal, low if goal <= target else 0.0,
                                         self._extra())
            if changes:
                messages.append(f"pace: pruned to size {new:.0f} (planned {goal:.0f} at step "
                                f"{step}, was {size:.0f}): {_what(changes)}")
            size = new
        if size > target * (1 + 2 * TARGET_TOLERANCE):
            self._sync_counts()
            return messages, False
        # close to the target: land in the band [T/(1+tol), T] here, then fix the ranks
        if size > target:
            new, changes = rank.prune_to(self.model, target, low, self._extra())
            if changes:
                messages.append(f"pace: pruned to the target, size {new:.0f} (was {size:.0f}): "
                                f"{_what(changes)}")
            size = new
        if size < low:
            new, changes = rank.grow_to(self.model, low, target, self._extra())
            if changes:
                messages.append(f"pace: the last deaths overshot (size {size:.0f}, below "
                                f"{low:.0f}); revived {_what(changes)}: size {new:.0f}")
            size = new
        self._sync_counts()
        self.freeze()
        dense = rank.dense_size(self.model)[self.cfg.target_scope]
        messages.append(f"target size reached at step {step}: {size:.0f} params "
                        f"({dense / size:.1f}x); ranks fixed from here")
        return messages, True

    def _sync_counts(self) -> None:
        """After a prune or a revival: the device refresh's bond snapshot follows, so
        the next step reports no rank change for what the pace did (it has its event)."""
        if self._counts is not None:
            self._counts = [int(m.sum()) for m in self._all_masks()]

    def _all_masks(self) -> list[Tensor]:
        return [mk for m in tt_layers(self.model).values() for mk in m.tt.masks()]

    def freeze(self) -> None:
        """Fix the ranks: no gate entry dies any more (threshold 0) and the objective is
        the task loss alone."""
        self.frozen = True
        for layer in tt_layers(self.model).values():
            layer.tt.tau = 0.0
        if self.enabled:
            self.objective.frozen = True

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
        if not self.has_tt and not self.has_peers:
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
        from comera_engine.layers import size_report

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

    def needs_truncation(self) -> bool:
        """Some bond holds dead rank entries (fewer effective than allocated ranks)."""
        return self.has_tt and any(
            int(mk.sum()) < mk.numel() for m in tt_layers(self.model).values()
            for mk in m.tt.masks())

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
            "pace": self.pace.state_dict() if self.pace is not None else None,
            "frozen": self.frozen,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.plateau is not None and state.get("plateau") is not None:
            self.plateau.load_state_dict(state["plateau"])
        if self.enabled and state.get("stage") == "late":
            self.objective.switch_to_late(z_f=state["z_f"])
        if self.enabled and state.get("pace"):
            from comera_engine import rank

            self.pace = rank.PacePlan(**state["pace"])
        if state.get("frozen"):
            self.freeze()
