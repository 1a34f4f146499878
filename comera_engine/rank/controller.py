"""``CoMERA``: the rank controller, CoMERA's method for any model and any training loop.

::

    import comera_engine as ce

    config = ce.CoMERAConfig(target_compression=20)
    model = ce.tensorize(MyNet(), config, exclude=["head"])  # any nn.Module
    comera = ce.CoMERA(model, config, total_steps=1500)
    opt = torch.optim.AdamW(comera.param_groups(), lr=2e-3)  # your lr (the gates': derived)
    for step in range(1500):
        loss = comera.loss(task_loss(model, batch))         # + the stage's rank terms
        opt.zero_grad(); loss.backward(); opt.step()
        comera.step(opt)                                    # gates, stages, pace, truncation
                                                            # (or comera.attach(opt) once)
    comera.report()["message"]                              # "target 20x · reached 20.4x (+2 %)"

What one :meth:`CoMERA.step` does, after the optimizer step (docs/SIZE_AND_TARGET.md):

1. **gates**: entries with ``|g| <= tau`` die for good (a bond keeps at least one);
   one ``rank_change`` event per bond whose rank changed;
2. **stage**: the early stage (task loss + ``γ``·size surrogate) switches to the late
   one (achievement scalarisation toward the target) at ``comera.switch`` or on a loss
   plateau, and by ``switch_by`` of ``total_steps`` at the latest (a ``stage`` event);
3. **pace** (with a target and ``total_steps``): the size follows a path planned from the
   late stage's start to the target by ``reach_at`` of the steps; ranks that lag it are
   pruned by importance (``pace`` events), and once the size is at the target the ranks
   are fixed and the rest of the run fine-tunes (a ``target_met`` event);
4. **truncation**: dead rank entries are sliced out of the cores and out of the
   optimizer's state (AdamW/Adam ``exp_avg``, ``exp_avg_sq``, SGD's momentum: any state
   tensor shaped like its parameter), so they stop costing compute and memory; the
   ``nn.Parameter`` objects are kept, so the optimizer stays valid (a ``truncate``
   event).

The settings are the ``[comera]`` table's keys (:class:`~comera_engine.config.CoMERAConfig`:
one set of names and defaults for the config file, ``comera train`` and this class),
given as keywords or as ``config=``. ``comera train`` is one recipe over this class
(:mod:`comera_engine.train.loop`).

Under DDP the late stage's ``λ`` and the plateau are decided from the loss averaged over
the processes; shapes must not change under a live ``DistributedDataParallel`` wrapper,
so pass ``truncate=False`` and call :meth:`CoMERA.truncate` when you rebuild it (as the
built-in trainer does). :meth:`CoMERA.loss` is free of host synchronisation, so it can be
captured in a CUDA graph; :meth:`CoMERA.step` runs on the host between graph replays
(:meth:`CoMERA.refresh_fn` gives the gate refresh as device work for a captured step).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..config import CoMERAConfig, validate_comera
from ..errors import ConfigError, TrainingDiverged
from ..layers import factorized_layers, groupable_linears, tt_layers
from ..metrics import TARGET_TOLERANCE
from ..ops.adamw import AdamW
from ..tensor.grouped import grouped_halves
from . import report as _report
from .balance import balance_gates
from .objective import CoMERAObjective, PlateauDetector, _mean_over_processes
from .optim import (
    GRADIENT_SCALED,
    GateAdam,
    RankEvent,
    RateWatch,
    gate_lr,
    held_by_a_graph,
    param_groups,
    refresh_gates,
    refresh_gates_on_device,
)
from .optim import truncate_model_and_optimizer as _truncate_all
from .pace import PacePlan, grow_to, host_size, prune_to
from .schedule import SwitchPlan, resolve_schedule, schedule_label, switch_plan
from .size import dense_size, size_extra

__all__ = ["EVENT_KINDS", "CoMERA", "Event"]

#: What :class:`Event` ``kind`` can be.
EVENT_KINDS = ("rank_change", "stage", "pace", "target_met", "truncate")


@dataclass(frozen=True)
class Event:
    """Something the controller did at ``step`` (the number of steps done): ``kind`` one
    of :data:`EVENT_KINDS`, ``text`` one line for a log, ``data`` the facts (e.g.
    ``layer``, ``bond``, ``old``, ``new`` for a rank change)."""

    step: int
    kind: str
    text: str
    data: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.text


def _what(changes: dict[str, list[tuple[int, int, int]]]) -> str:
    """``layer bonds k: old->new, …; …`` for a pace message."""
    return "; ".join(f"{name} bonds " + ", ".join(f"{k}: {o}->{n}" for k, o, n in ch)
                     for name, ch in changes.items())


def _settings(config: CoMERAConfig | None, settings: dict[str, Any]) -> CoMERAConfig:
    """``config`` (or the defaults) with ``settings`` applied, validated; an unknown key,
    or a ``config`` that is not a :class:`CoMERAConfig`, is refused naming it."""
    if config is not None and not isinstance(config, CoMERAConfig):
        raise ConfigError("config", f"give a comera_engine.CoMERAConfig (e.g. "
                                    f"CoMERAConfig(target_compression=20)), got {config!r}")
    known = {f.name for f in dataclasses.fields(CoMERAConfig)}
    for key in settings:
        if key not in known:
            raise ConfigError(f"comera.{key}", "is not a CoMERA setting; the settings are "
                                               "the [comera] table's keys: "
                                               + ", ".join(sorted(known)))
    cfg = dataclasses.replace(config or CoMERAConfig(), **settings)
    validate_comera(cfg)
    return resolve_schedule(cfg)  # every switch set: the schedule's, or the caller's


class Attachment:
    """A controller attached to an optimizer (:meth:`CoMERA.attach`)."""

    def __init__(self, comera: CoMERA, handle: Any, optimizer: torch.optim.Optimizer) -> None:
        self._comera, self._handle, self._optimizer = comera, handle, optimizer
        # marked, so that a second controller is not attached to it too
        optimizer._comera_attached = weakref.ref(comera)  # type: ignore[attr-defined]

    def remove(self) -> None:
        """Stop running the controller's step after the optimizer's."""
        self._handle.remove()
        mark = getattr(self._optimizer, "_comera_attached", None)
        if mark is not None and mark() is self._comera:
            del self._optimizer._comera_attached  # type: ignore[attr-defined]
        if self._comera._attached is self:
            self._comera._attached = None


def _check_gate_groups(optimizer: torch.optim.Optimizer, gates: set[int]) -> None:
    """Refuse an optimizer that trains the rank gates ``gates`` (their ids) in a group
    with other parameters: built from ``model.parameters()``, the gates share the model's
    group, whose rate the controller would have to overwrite (the model's too).
    ``comera.param_groups()`` gives the gates a group of their own. One that holds none
    of them is said once (another optimizer of the user's may step them)."""
    if not gates:
        return
    held = False
    for group in optimizer.param_groups:
        n = sum(id(p) in gates for p in group["params"])
        if n and n != len(group["params"]):
            raise ConfigError("optimizer", "a param group holds the rank gates with other "
                                           "parameters (built from model.parameters()?), so "
                                           "one rate would drive both: build the optimizer "
                                           "from comera.param_groups(), the gates in a group "
                                           "of their own")
        held = held or n > 0
    if not held:
        print("CoMERA: the optimizer holds none of the rank gates; unless another optimizer "
              "steps them, no rank is learned (comera.param_groups() gives them a group)",
              file=sys.stderr)


class CoMERA:
    """The rank controller of one model (see the module doc for the loop it drops into).

    Args:
        model: a model with TT layers (:func:`comera_engine.tensorize`). A model without
            any trains on the task loss alone (the dense baseline).
        config: a :class:`~comera_engine.config.CoMERAConfig` (the ``[comera]`` table;
            the one given to :func:`~comera_engine.tensorize`): the target
            (``target_compression`` in ``target_scope``; ``None``: no target, the early
            stage alone prunes what the size surrogate finds unneeded) and every other
            setting. Keywords in ``settings`` override its fields.
        total_steps: the steps the loop will run: the pace plans the path to the target
            over them (``0``: no pace, the objective alone decides the size).
        steps_per_epoch: turns ``switch_epoch`` into a step.
        on_event: called with every :class:`Event` as it happens (e.g. to log it to
            TensorBoard or W&B); :attr:`events` keeps them all.
        **settings: any ``[comera]`` key: ``target_compression``, ``gamma``, ``switch``,
            ``lr_cores``, …

    Raises:
        ConfigError: an unknown or out-of-range setting, or a target beyond what rank 1
            everywhere allows (the field and the fix in one line).
    """

    def __init__(self, model: nn.Module, config: CoMERAConfig | None = None,
                 total_steps: int = 0, *, steps_per_epoch: int = 0,
                 on_event: Callable[[Event], None] | None = None, **settings: Any) -> None:
        for name, value in (("total_steps", total_steps), ("steps_per_epoch", steps_per_epoch)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(name, f"must be a whole number of steps >= 0, got {value!r}")
        self.cfg = cfg = _settings(config, settings)
        #: which method runs: the schedule and any switch set against it ("paced")
        self.schedule = schedule_label(cfg)
        self.model = model
        self.total_steps = total_steps
        self.steps_per_epoch = steps_per_epoch
        self.on_event = on_event
        self.events: list[Event] = []
        self._pairs = tt_layers(model)  # the model's structure is fixed: walked once
        self._layers = dict(self._pairs)
        self._grouped_trains = [m.tt for m in groupable_linears(model)]  # (grouped())
        self.has_tt = bool(self._layers)
        self.has_peers = len(factorized_layers(model)) > len(self._layers)
        # the objective runs for method "comera" only; "fixed" / "tt_svd" train the task
        # loss at fixed ranks (their gates frozen by the trainer)
        self.enabled = cfg.enabled and cfg.method == "comera" and self.has_tt
        self.objective: CoMERAObjective | None = None
        self.plateau: PlateauDetector | None = None
        self.pace: PacePlan | None = None  # the planned size path once the late stage runs
        self.frozen = False  # the target size was reached: ranks are fixed from here
        self._steps = 0
        self._counts: list[int] | None = None  # alive count per bond (device refresh)
        # the target scope's parameters outside the TT cores (TT biases; with the model
        # scope every other parameter too): constant through training
        self._extra = size_extra(model, cfg.target_scope)
        self._task_loss: Tensor | None = None  # the step's task loss (summed over calls)
        self._loss_calls = 0  # loss() calls since the last step (micro-batches)
        self._dirty = False  # entries died since the last truncation
        #: rank entries removed so far by the objective (gates at or below tau) and by
        #: the pace (its prunes, less what it revived)
        self.removed = {"objective": 0, "pace": 0}
        self.info: dict[str, Tensor] = {}  # the last loss()'s terms (0-d device tensors)
        for layer in self._layers.values():
            layer.tt.tau = cfg.tau  # the gate threshold lives on the layers
        if self.has_tt:
            # with plateau_min_drop, a plateau counts only once the smoothed loss is that
            # much below where it started: a network still at chance is not pruned for it
            self.plateau = PlateauDetector(patience=cfg.plateau_patience,
                                           rel_tol=cfg.plateau_min_delta,
                                           min_drop=float(cfg.plateau_min_drop or 0.0))
        if self.enabled:
            self.objective = CoMERAObjective(model, cfg)
        self._plan_key: tuple[int, int] | None = None
        self._attached: Attachment | None = None  # attach(): the optimizer runs step
        self._rates_said = False  # param_groups printed the rates it set
        self._held_said = False  # said that a live graph holds the cores (truncate)
        self._budget_said = False  # a target without total_steps was said
        # under an SGD-like optimizer the gates take their own Adam steps (_hook_optimizer)
        self._gate_adam: GateAdam | None = None
        self._gate_adam_saved: dict[str, Any] | None = None  # loaded before it was made
        self._optimizer_seen: Any = None  # the optimizer _hook_optimizer last looked at
        self._rates: RateWatch | None = None  # the gates' rate kept, an early decay said

    # ------------------------------------------------------------------ optimizer

    def param_groups(self) -> list[dict[str, Any]]:
        """Optimizer parameter groups: ``cores`` (TT cores), ``embedding`` (the TT
        embedding tables' cores, when ``lr_embedding`` is set), ``gates`` (no weight
        decay) and ``dense`` (every other parameter).

        The learning rates are the optimizer's (``torch.optim.AdamW(comera.param_groups(),
        lr=...)``: the rate the same network trains at dense), except what is set on this
        controller (``lr_cores``, ``lr_embedding``, ``lr_dense``, ``weight_decay``) and the
        gates' rate, which follows the schedule (:meth:`lr_gates`); what CoMERA sets is
        printed once. Parameters that do not require grad (frozen gates of a fixed-rank
        model) are left out, empty groups dropped."""
        c = self.cfg
        if self.has_tt or self.has_peers:  # peer TT cores learn at lr_cores too
            groups = param_groups(self.model, c.lr_cores, self.lr_gates(), c.lr_dense,
                                  c.weight_decay, lr_embedding=c.lr_embedding)
            for g in groups:
                g["params"] = [p for p in g["params"] if p.requires_grad]
            groups = [g for g in groups if g["params"]]
        else:
            groups = param_groups(self.model, lr_dense=c.lr_dense, weight_decay=c.weight_decay)
            groups = [{**g, "params": [p for p in g["params"] if p.requires_grad]}
                      for g in groups]
        self._say_rates(groups)
        return groups

    def _say_rates(self, groups: list[dict[str, Any]]) -> None:
        """One line on stderr, once, naming the learning rates CoMERA set (the rest are
        the optimizer's)."""
        if self._rates_said:
            return
        self._rates_said = True
        own = [f"{g['name']} {g['lr']:.3g}" for g in groups if "lr" in g]
        if not own:
            return
        why = " (from the schedule)" if self.cfg.lr_gates is None and any(
            g["name"] == "gates" and "lr" in g for g in groups) else ""
        rest = [g["name"] for g in groups if "lr" not in g]
        print(f"CoMERA: learning rate {', '.join(own)}{why}"
              + (f"; {', '.join(rest)} at the optimizer's" if rest else ""), file=sys.stderr)

    def _say_budget(self) -> None:
        """One line on stderr, once, where a target has no step budget to be planned over
        (``total_steps`` 0): no pace and no deadline, the objective alone decides how far
        the size goes."""
        self._budget_said = True
        if self.objective is not None and self.target_compression is not None \
                and not self.total_steps:
            print(f"CoMERA: a {self.target_compression:g}x target without total_steps: no "
                  "pace plans the size's path to it, so the objective alone decides how far "
                  "the model shrinks (it may stop short); give CoMERA(model, config, "
                  "total_steps=...), the optimizer steps your loop runs", file=sys.stderr)

    def lr_gates(self) -> float | None:
        """The gates' learning rate. With a target and a step budget, the schedule's: the
        rate at which a gate can fall from 1 to ``tau`` within a tenth of the steps before
        the size is due at the target (:func:`.optim.gate_lr`). ``comera.lr_gates``, when
        set, replaces it (``comera.gate_speed`` raises it to the schedule's where lower).
        Neither: ``None``, the optimizer's rate."""
        c = self.cfg
        derived = None
        if self.objective is not None and self.total_steps:
            derived = gate_lr(c.tau, self._switch_plan().reach or self.total_steps)
        if c.lr_gates is None:
            return derived
        if c.gate_speed and derived is not None:
            return max(c.lr_gates, derived)
        return c.lr_gates

    def make_optimizer(self, lr: float = 1e-3, capturable: bool = False
                       ) -> torch.optim.Optimizer:
        """AdamW at ``lr`` over :meth:`param_groups` (the built-in trainer's optimizer:
        ``train.lr``). On CPU every group's update in one call of the CPU backend
        (:class:`comera_engine.ops.adamw.AdamW`, torch's fused AdamW where the backend is
        not built): a TT model has hundreds of small parameters, and a per-tensor step
        costs more than the update (``experiments/bench_op_adamw.py``); on CUDA the same
        class, torch's fused update (a few launches for all groups); elsewhere torch's
        default. ``capturable``: state on the device, for a CUDA graph."""
        groups = self.param_groups()
        params = [p for g in groups for p in g["params"]]
        cpu = bool(params) and all(p.device.type == "cpu" and p.is_floating_point()
                                   for p in params)
        if (cpu and not capturable) or (params and all(p.is_cuda for p in params)):
            return AdamW(groups, lr=lr, capturable=capturable)
        return torch.optim.AdamW(groups, lr=lr, capturable=capturable)

    def attach(self, optimizer: torch.optim.Optimizer) -> Attachment:
        """Run the controller's step after every ``optimizer.step()`` (the optimizer's
        post-step hook), so the loop needs only :meth:`loss`. Returns an
        :class:`Attachment`; its ``remove()`` detaches. Without attaching, call
        :meth:`step` after ``optimizer.step()`` yourself (it also takes ``loss=`` and
        ``counts=``)."""
        if self._attached is not None:
            raise RuntimeError("CoMERA.attach: already attached to an optimizer; call "
                               "remove() on what attach returned first")
        other = getattr(optimizer, "_comera_attached", None)
        if other is not None and other() is not None and other() is not self:
            raise ConfigError("optimizer", "already attached to another CoMERA (a cell run "
                                           "twice?): two controllers would both add rank "
                                           "terms and prune the same gates; build a fresh "
                                           "optimizer, or remove() the other's attachment")

        def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            self._step(opt)

        self._hook_optimizer(optimizer)
        self._attached = Attachment(self, optimizer.register_step_post_hook(hook), optimizer)
        return self._attached

    def _hook_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Hooks before each step of an optimizer that holds the gates: their rate is kept
        at :meth:`lr_gates` against a scheduler of the user's, and a decay of the other
        rates before :attr:`reach_step` is said once (:class:`.optim.RateWatch`); under
        an optimizer whose step is not about its learning rate (SGD, ASGD, Adagrad:
        :data:`.optim.GRADIENT_SCALED`) the gates also take their own Adam steps at that
        rate (:class:`.optim.GateAdam`), said once. Nothing is hooked without the
        objective or without a rate for the gates (no step budget)."""
        gates = [m.tt.gate for m in self._layers.values() if m.tt.gate.requires_grad]
        ids = {id(p) for p in gates}
        if self.objective is not None:  # before anything is hooked or remembered
            _check_gate_groups(optimizer, ids)
        self._optimizer_seen = optimizer
        if self.objective is None:
            return
        rate = self.lr_gates()
        if rate is None or not any(id(p) in ids for group in optimizer.param_groups
                                   for p in group["params"]):
            return
        if self._rates is None:  # a scheduler of the user's does not decay the gates
            self._rates = RateWatch(gates, rate, self.reach_step, lambda: self._steps)
        self._rates.hook_into(optimizer)
        if not isinstance(optimizer, GRADIENT_SCALED):
            return
        if self._gate_adam is None:
            self._gate_adam = GateAdam(gates, rate)
            if self._gate_adam_saved is not None:
                self._gate_adam.load_state_dict(self._gate_adam_saved)
            print(f"CoMERA: {type(optimizer).__name__} steps by its learning rate times the "
                  f"gradient; the gates take their own Adam steps at {rate:.3g} before each "
                  "of its steps", file=sys.stderr)
        self._gate_adam.hook_into(optimizer)

    def grouped(self) -> AbstractContextManager[int]:
        """A block for a training step's forward (on a GPU): the model's TT linears of
        one shape take their gated halves from one batched pass made on entering it
        (:func:`comera_engine.tensor.grouped.grouped_halves`), so their merges cost a few
        kernels for all of them instead of tens each; values and gradients as without
        it. ``with comera.grouped(): loss = comera.loss(criterion(model(x), y))``, then
        ``loss.backward()`` (inside or after the block). The trainer's step does this on a
        GPU by itself (``TrainStep(grouped=...)``). Yields how many layers it grouped."""
        return grouped_halves(self._grouped_trains)

    # ------------------------------------------------------------------ the loss

    @property
    def stage(self) -> str:
        """``"early"``, ``"late"``, ``"fixed"`` (ranks fixed at the target) or ``"plain"``
        (no CoMERA objective: a dense model, or a fixed-rank method)."""
        if not self.enabled:
            return "plain"
        if self.frozen:
            return "fixed"
        assert self.objective is not None
        return self.objective.stage

    @property
    def stage_name(self) -> str:
        """The objective's stage, ``"early"`` / ``"late"`` / ``"plain"`` (``"late"`` also
        once the ranks are fixed: the metric ``stage`` and the checkpoints use it)."""
        return self.objective.stage if self.objective is not None else "plain"

    def objective_fn(self) -> Callable[[Tensor], tuple[Tensor, dict[str, Tensor]]] | None:
        """``task_loss -> (total, info)`` of the current stage, free of host reads (a CUDA
        graph can capture it), or ``None`` for plain task-loss training."""
        return self.objective

    def loss(self, task_loss: Tensor) -> Tensor:
        """``task_loss`` plus the current stage's rank terms (the task loss itself when
        the objective is off). Keeps the task loss for the plateau of :meth:`step`
        and the terms in :attr:`info`. No host synchronisation.

        With gradient accumulation call it on every micro-batch's loss (its own mean)
        and divide the result by the number of micro-batches, as for the task loss alone:
        the rank terms then count once per optimizer step, and :meth:`step` judges the
        plateau on the mean of the task losses it saw since the last step. The late
        stage's ``λ`` is chosen per call, from that micro-batch's loss.

        Called without gradients (``torch.no_grad()``, ``inference_mode``: an evaluation)
        it returns ``task_loss`` as it is and counts nothing: a validation loss is no
        training step's."""
        if not isinstance(task_loss, Tensor):
            raise ConfigError("task_loss", f"give the loss tensor your loop backpropagates, "
                                           f"got {type(task_loss).__name__}")
        if task_loss.numel() != 1:
            raise ConfigError("task_loss", f"give the scalar loss your loop backpropagates "
                                           f"(its mean over the batch), got shape "
                                           f"{tuple(task_loss.shape)}")
        if not torch.is_grad_enabled():
            return task_loss
        f = task_loss if task_loss.dtype in (torch.float32, torch.float64) else task_loss.float()
        seen = f.detach()
        if self._loss_calls and self._task_loss is not None:
            seen = self._task_loss + seen  # a further micro-batch of this step: summed
        self._task_loss = seen
        self._loss_calls += 1
        if self.objective is None:
            self.info = {}
            return task_loss
        total, self.info = self.objective(f)
        return total

    # ------------------------------------------------------------------ the step

    @property
    def steps_done(self) -> int:
        """Optimizer steps :meth:`step` has seen (restored by :meth:`load_state_dict`)."""
        return self._steps

    @steps_done.setter
    def steps_done(self, value: int) -> None:
        self._steps = int(value)
        if self.objective is not None:
            self.objective.begin_step(self._steps)  # the γ warm-up's next step

    def step(self, optimizer: torch.optim.Optimizer | None = None, *,
             loss: float | Tensor | None = None, counts: list[float] | None = None,
             truncate: bool = True) -> list[Event]:
        """After ``optimizer.step()``: gates, stage switch, pace, truncation (module doc).

        Args:
            optimizer: the optimizer built from :meth:`param_groups`; its state is
                truncated with the cores (``None``: no truncation).
            loss: this step's task loss, for the plateau (default: the one
                :meth:`loss` saw, or the mean of those it saw since the last step,
                averaged over DDP processes). A float is taken as
                already agreed by every process.
            counts: the bond counts a device refresh (:meth:`refresh_fn`) returned.
            truncate: slice dead rank entries out of the cores and the optimizer state
                now (``False``: leave them masked until :meth:`truncate`).

        Returns this step's events (also appended to :attr:`events`).
        """
        if self._attached is not None:
            raise RuntimeError("CoMERA.step: this controller is attached to the optimizer "
                               "(attach), which runs its step after every optimizer.step(); "
                               "drop the comera.step call")
        return self._step(optimizer, loss=loss, counts=counts, truncate=truncate)

    def _step(self, optimizer: torch.optim.Optimizer | None = None, *,
              loss: float | Tensor | None = None, counts: list[float] | None = None,
              truncate: bool = True) -> list[Event]:
        if optimizer is not None and optimizer is not self._optimizer_seen:
            self._hook_optimizer(optimizer)
        if not self._budget_said:
            self._say_budget()
        if self._loss_calls > 1 and self._task_loss is not None:  # micro-batches: their mean
            self._task_loss = self._task_loss / self._loss_calls
        self._loss_calls = 0
        value = None  # the task loss: the plateau's, and judged while the ranks move
        if self.objective is not None and (self.objective.stage == "early" or not self.frozen):
            value = self._loss_value(loss)
            if not math.isfinite(value):  # before any gate or rank is judged by it
                raise TrainingDiverged(
                    self._steps + 1, value,
                    f"CoMERA.step: the task loss is {value} at step {self._steps + 1}: "
                    "training diverged; lower the learning rate (under SGD a TT layer "
                    "steps further than its dense layer at the same rate) or clip the "
                    "gradients, and go on from the last checkpoint")
        self._steps += 1
        step = self._steps
        events: list[Event] = []
        if (self.objective is not None and not self.frozen and self.cfg.balance
                and step % self.cfg.balance_every == 0):
            balance_gates(self._layers.values())  # before the refresh judges the gates
        rank_events = self._refresh(step, counts)
        if rank_events:
            events += [Event(step, "rank_change", str(e), e.as_dict()) for e in rank_events]
            self.removed["objective"] += sum(e.old - e.new for e in rank_events)
        if self.objective is not None and self.objective.stage == "early":
            assert value is not None
            switched = self._maybe_switch(step, value)
            if switched is not None:
                events.append(switched)
        paced = self._pace_step(step, bool(rank_events), counts)
        if paced:
            for e in paced:  # prunes count up, revivals down
                for changes in e.data.get("changes", {}).values():
                    self.removed["pace"] += sum(old - new for _, old, new in changes)
            events += paced
        if rank_events and not paced:
            met = self._stop_at_target(step, counts)
            if met is not None:
                events.append(met)
        if rank_events or paced:
            self._dirty = True
            if self.objective is not None:  # its S: counted again at each rank change
                # from the bond snapshot, which follows a pace prune (_sync_counts);
                # the counts passed in predate it
                snapshot = self._counts if counts is not None else None
                self.objective.recount(self.current_size(snapshot) - self._extra)
        if truncate and optimizer is not None and self._dirty and not self._held():
            done = self.truncate(optimizer, emit=False)
            if done is not None:
                events.append(done)
        if self.objective is not None:
            self.objective.begin_step(step)  # the γ warm-up's next step
        if events:
            self._emit(events)
        return events

    def _emit(self, events: list[Event]) -> None:
        self.events.extend(events)
        if self.on_event is not None:
            for e in events:
                self.on_event(e)

    def _loss_value(self, loss: float | Tensor | None) -> float:
        if loss is None:
            if self._task_loss is None:
                raise RuntimeError("CoMERA.step: no task loss to judge the step by; call "
                                   "comera.loss(task_loss) in the step, or pass "
                                   "comera.step(opt, loss=...)")
            return float(_mean_over_processes(self._task_loss))
        if isinstance(loss, Tensor):
            return float(_mean_over_processes(loss.detach().float()))
        return float(loss)

    # ------------------------------------------------------------------ gates

    def _refresh(self, step: int, counts: list[float] | None) -> list[RankEvent]:
        """Make the gates' verdicts permanent (host path) or read them off the counts a
        device refresh returned; the rank changes as events."""
        if not self.has_tt:
            return []
        if counts is not None:
            return self._events_from_counts(step, counts)
        if self.frozen:  # the ranks are fixed: nothing dies any more
            return []
        return refresh_gates(self.model, step, layers=self._pairs,
                             floor=bool(self.cfg.rank_floor))

    def refresh_fn(self) -> Callable[[], Tensor] | None:
        """The gate refresh as device work (for a captured step): returns the alive count
        of every bond, to pass to :meth:`step` as ``counts``."""
        if not self.has_tt:
            return None
        self._counts = [int(a.sum()) for m in self._layers.values()
                        for a in m.tt.bond_alive()]
        model, floor = self.model, bool(self.cfg.rank_floor)
        return lambda: refresh_gates_on_device(model, floor=floor)

    def _events_from_counts(self, step: int, counts: list[float]) -> list[RankEvent]:
        bonds = [(n, k) for n, m in self._layers.items() for k in range(len(m.tt.bond_ranks))]
        new = [int(c) for c in counts]
        if self._counts is None:  # refresh_fn() takes the first snapshot
            self._counts = new
            return []
        events = [RankEvent(step, name, k, old, now)
                  for (name, k), old, now in zip(bonds, self._counts, new) if old != now]
        self._counts = new
        return events

    def _sync_counts(self) -> None:
        """After a prune or a revival: the device refresh's bond snapshot follows, so
        the next step reports no rank change for what the pace did (it has its event)."""
        if self._counts is not None:
            self._counts = [int(mk.sum()) for m in self._layers.values()
                            for mk in m.tt.masks()]

    # ------------------------------------------------------------------ stages

    @property
    def reach_step(self) -> int | None:
        """The step by which the pace lands the size at the target and fixes the ranks
        (``reach_at`` of ``total_steps``); ``None`` without the pace."""
        return self._switch_plan().reach if self._pacing() else None

    def _pacing(self) -> bool:
        """The pace is on: ``pace`` with a target and a step budget (the switch rule's
        ``reach`` step exists)."""
        return self.objective is not None and self._switch_plan().reach is not None

    def _switch_plan(self) -> SwitchPlan:
        """:func:`~comera_engine.rank.schedule.switch_plan` of the settings and the step budget
        (worked out again only if ``total_steps`` or ``steps_per_epoch`` is changed)."""
        key = (self.total_steps, self.steps_per_epoch)
        if key != self._plan_key:
            self._plan = switch_plan(self.cfg, self.total_steps, self.steps_per_epoch)
            self._plan_key = key
        return self._plan

    def _set_loss_start(self, loss: float) -> None:
        """Give the objective where the task loss starts (its first value: the untrained
        network's), and say once if that scales the size terms (``loss_scale``)."""
        if self.objective is None:
            return
        self.objective.loss_start = loss
        scale = self.objective.loss_scale()
        if scale < 1.0:
            print(f"CoMERA: the task loss starts at {loss:.3g}, so the size terms are "
                  f"weighed at {scale:.3g} (comera.loss_scale: the objective's weights are "
                  "set for a cross-entropy, which starts at ln 2 or more)", file=sys.stderr)

    def _maybe_switch(self, step: int, task_loss: float) -> Event | None:
        """Switch to the late stage when its time has come."""
        assert self.objective is not None and self.plateau is not None
        c = self.cfg
        plan = self._switch_plan()
        if self.objective.loss_start is None:  # f₀: the size terms' units (loss_scale)
            self._set_loss_start(task_loss)
        plateaued = self.plateau.update(task_loss)
        due = (plan.switch == "plateau" and plateaued) or (
            isinstance(plan.switch, int) and step >= plan.switch)
        latest = plan.latest is not None and step >= plan.latest
        if not (due or latest):
            return None
        self.objective.switch_to_late(z_f=self.plateau.value)  # type: ignore[arg-type]
        text = f"late stage after step {step} (z_f = {self.objective.z_f:.4g})"
        if latest and not due:
            text += f" (comera.switch_by: the latest start, {c.switch_by} of the steps)"
        data: dict[str, Any] = {"z_f": self.objective.z_f}
        if plan.reach is not None and not self.frozen:  # the pace is on
            self.pace = PacePlan(step, self.current_size(), plan.reach,
                                 float(self.objective.target_size))  # type: ignore[arg-type]
            text += (f"; size {self.pace.start_size:.0f} -> target "
                     f"{self.pace.target:.0f} by step {self.pace.reach_step}")
            data["pace"] = self.pace.state_dict()
        return Event(step, "stage", text, data)

    # ------------------------------------------------------------------ pace

    def current_size(self, counts: list[float] | None = None) -> float:
        """The effective size in the target's scope, from the bond counts a device refresh
        returned (or the gates): the same count as ``size_report``."""
        ranks = self.effective_ranks(counts)
        return host_size([list(m.tt.mode_sizes) for m in self._layers.values()],
                         [ranks[n] for n in self._layers], self._extra)

    def _pace_step(self, step: int, ranks_changed: bool, counts: list[float] | None
                   ) -> list[Event]:
        """Prune ranks that lag the planned path (at every pace check, and every step from
        ``reach_at`` on until the target is met), and fix the ranks once the size is at
        the target."""
        pace = self.pace
        if (pace is None and not ranks_changed) or not self._pacing() or self.frozen:
            return []  # (no pace yet: nothing to check unless ranks changed)
        assert self.objective is not None and self.objective.target_size is not None
        check = pace is not None and (step >= pace.reach_step
                                      or (step - pace.start_step) % pace.every() == 0)
        if not (check or ranks_changed):
            return []
        target = float(self.objective.target_size)
        events: list[Event] = []
        size = self.current_size(counts)
        low = target / (1 + TARGET_TOLERANCE)
        if check and pace is not None and size > pace.goal(step):
            goal = pace.goal(step)
            new, changes = prune_to(self.model, goal, low if goal <= target else 0.0,
                                    self._extra)
            if changes:
                events.append(Event(step, "pace", f"pace: pruned to size {new:.0f} (planned "
                                    f"{goal:.0f} at step {step}, was {size:.0f}): "
                                    f"{_what(changes)}", {"size": new, "changes": changes}))
            size = new
        if size > target * (1 + 2 * TARGET_TOLERANCE):
            self._sync_counts()
            return events
        # close to the target: land in the band [T/(1+tol), T] here, then fix the ranks
        if size > target:
            new, changes = prune_to(self.model, target, low, self._extra)
            if changes:
                events.append(Event(step, "pace", f"pace: pruned to the target, size "
                                    f"{new:.0f} (was {size:.0f}): {_what(changes)}",
                                    {"size": new, "changes": changes}))
            size = new
        if size < low:
            new, changes = grow_to(self.model, low, target, self._extra)
            if changes:
                events.append(Event(step, "pace", f"pace: the last deaths overshot (size "
                                    f"{size:.0f}, below {low:.0f}); revived {_what(changes)}: "
                                    f"size {new:.0f}", {"size": new, "changes": changes}))
            size = new
        self._sync_counts()
        events.append(self._target_met(step, size))
        return events

    def _stop_at_target(self, step: int, counts: list[float] | None) -> Event | None:
        """Without the pace, with ``size_off_at_target``: the late stage's size terms are
        off once the size is at the target, and entries already on their way down stop
        dying there too (the ranks are fixed: a ``target_met`` event)."""
        obj = self.objective
        if (obj is None or self.frozen or obj.stage != "late" or self._pacing()
                or not self.cfg.size_off_at_target or obj.target_size is None):
            return None
        size = self.current_size(counts)
        if size > float(obj.target_size):
            return None
        return self._target_met(step, size)

    def _target_met(self, step: int, size: float) -> Event:
        """Fix the ranks at ``size`` (at the target): the ``target_met`` event."""
        self.freeze()
        dense = dense_size(self.model)[self.cfg.target_scope]
        return Event(step, "target_met", f"target size reached at step {step}: {size:.0f} "
                     f"params ({dense / size:.1f}x); ranks fixed from here",
                     {"size": size, "compression": dense / size})

    def freeze(self) -> None:
        """Fix the ranks: no gate entry dies any more (threshold 0) and the objective is
        the task loss alone."""
        self.frozen = True
        for layer in self._layers.values():
            layer.tt.tau = 0.0
        if self.objective is not None:
            self.objective.frozen = True

    def _unfreeze(self) -> None:
        """Undo :meth:`freeze` (a state from before the ranks were fixed is loaded): the
        gates die at ``tau`` again and the objective has its size terms."""
        self.frozen = False
        for layer in self._layers.values():
            layer.tt.tau = self.cfg.tau
        if self.objective is not None:
            self.objective.frozen = False

    # ------------------------------------------------------------------ truncation

    def needs_truncation(self) -> bool:
        """Some bond holds dead rank entries (fewer effective than allocated ranks)."""
        return any(int(mk.sum()) < mk.numel() for m in self._layers.values()
                   for mk in m.tt.masks())

    def _held(self) -> bool:
        """Whether a live autograd graph holds cores that the step would slice
        (:func:`.optim.held_by_a_graph`): the next backward would fail against their old
        shapes, so they stay masked until it is gone (said once). An explicit
        :meth:`truncate` (once DDP's wrapper, which holds them too, is done) slices."""
        held = held_by_a_graph(self.model)
        if held and not self._held_said:
            self._held_said = True
            print(f"CoMERA: {', '.join(map(repr, held))} keep their dead rank entries "
                  "masked, not sliced: a graph built before is still alive (a loss kept "
                  "without its backward; compute a validation loss under torch.no_grad() "
                  "and keep loss.item())", file=sys.stderr)
        return bool(held)

    def truncate(self, optimizer: torch.optim.Optimizer | None, *, emit: bool = True
                 ) -> Event | None:
        """Slice every TT layer to its effective ranks, and ``optimizer``'s state with the
        same indices (outputs unchanged). Returns the ``truncate`` event (``None`` when
        nothing shrank)."""
        self._dirty = False
        if not self.has_tt:
            return None
        changed = _truncate_all(self.model, optimizer,
                                self._gate_adam.adam if self._gate_adam is not None else None)
        if not changed:
            return None
        bonds = sum(len(v) for v in changed.values())
        event = Event(self._steps, "truncate", f"{bonds} bonds in {len(changed)} layers",
                      {"changes": changed})
        if emit:
            self._emit([event])
        return event

    # ------------------------------------------------------------------ sizes

    def effective_ranks(self, counts: list[float] | None = None) -> dict[str, list[int]]:
        """Effective internal ranks per TT layer. ``counts``: the bond counts a device
        refresh just returned (used as they are, without reading the gates)."""
        if counts is None:
            return {name: list(m.effective_ranks()) for name, m in self._layers.items()}
        out, i = {}, 0
        for name, m in self._layers.items():
            n = len(m.tt.bond_ranks)
            out[name] = [int(c) for c in counts[i : i + n]]
            i += n
        return out

    def size_metrics(self) -> dict[str, float]:
        """Parameters, bytes and compression against the dense model, at the effective
        ranks (``size_report``'s count): ``params/*``, ``bytes/*``, ``compression/*``
        (:func:`.report.size_metrics`)."""
        return _report.size_metrics(self.model, self.has_tt or self.has_peers)

    @property
    def target_compression(self) -> float | None:
        """The target this model is held to (``None``: none, or nothing to compress)."""
        return _report.target_of(self.model, self.cfg, self.has_tt or self.has_peers)

    def outcome(self, reached: float | None, final: bool = True) -> str | None:
        """One line on the target at compression ``reached`` (:func:`.report.outcome`):
        ``"target 20x · reached 20.4x (+2 %)"`` or ``"… missed by X % (why)"`` when
        ``final``; progress before. ``None`` without a target."""
        return _report.outcome(self, reached, final)

    def report(self) -> dict[str, Any]:
        """Where the model stands (:func:`.report.report`): ``compression`` (in the
        target's scope, ``scope``), ``target``, ``ranks``, ``params``, ``dense_params``,
        ``stage``, ``step``, ``removed``, ``schedule`` and ``message``."""
        return _report.report(self)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """Plain values (JSON and ``torch.load(weights_only=True)`` alike): the stage,
        ``z_f``, the plateau, the pace plan, whether the ranks are fixed, the steps done,
        the objective's ``S_c`` and the task loss's start, every TT layer's allocated ranks (so
        :meth:`load_state_dict` can shape a fresh model before its weights are loaded) and,
        under an SGD-like optimizer, the gates' own Adam state (``gate_adam``)."""
        obj = self.objective
        return {
            "stage": obj.stage if obj is not None else None,
            "z_f": obj.z_f if obj is not None else None,
            "plateau": self.plateau.state_dict() if self.plateau is not None else None,
            "pace": self.pace.state_dict() if self.pace is not None else None,
            "frozen": self.frozen,
            "step": self._steps,
            "removed": dict(self.removed),
            "ranks": {n: list(m.tt.bond_ranks) for n, m in self._layers.items()},
            "S0": obj.S0 if obj is not None else None,
            # the objective's S_c as the run last counted it (on a GPU the gates die on
            # the device and S_c is counted at the next rank event, not each step): a
            # resume takes it as it was, so the continuation is the uninterrupted run's
            "size_cores": obj.size_cores if obj is not None else None,
            # where the task loss started: the size terms' units (comera.loss_scale)
            "loss_start": obj.loss_start if obj is not None else None,
        } | ({"gate_adam": self._gate_adam.state_dict()} if self._gate_adam is not None else {})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where :meth:`state_dict` left off, before or after
        ``model.load_state_dict`` (either reshapes the TT layers to the saved ranks;
        values come from the model's state dict), into fresh objects or into these ones
        after they ran on (a rollback: the saved stage, pace and unfixed ranks come back).
        Older states without ``step`` / ``ranks`` / ``S0`` keep the current ones."""
        for name, ranks in (state.get("ranks") or {}).items():
            layer = self._layers.get(name)
            if layer is None:
                raise ConfigError("state", f"the saved controller has a TT layer {name!r} "
                                           "this model does not; tensorize it the same way")
            if list(layer.tt.bond_ranks) != list(ranks):
                layer.tt.resize_(ranks)
        if self.plateau is not None and state.get("plateau") is not None:
            self.plateau.load_state_dict(state["plateau"])
        if self.objective is not None:  # older states kept no start: the plateau's head
            start = state.get("loss_start")
            if start is None and self.plateau is not None and self.plateau.n:
                start = self.plateau.head_sum / min(self.plateau.n, self.plateau.head)
            self.objective.loss_start = start
        if self.objective is not None and state.get("S0") is not None:
            self.objective.S0 = float(state["S0"])
        # the saved stage, pace and fixed ranks whatever this controller has run since
        # (a live run rolled back to an earlier checkpoint goes back to them)
        if self.objective is not None and state.get("stage") == "late":
            self.objective.switch_to_late(z_f=state["z_f"])
        elif self.objective is not None and state.get("stage") == "early":
            self.objective.stage, self.objective.z_f = "early", None
        if self.objective is not None and "pace" in state:
            self.pace = PacePlan(**state["pace"]) if state["pace"] else None
        if state.get("frozen"):
            self.freeze()
        elif "frozen" in state and self.frozen:
            self._unfreeze()
        self._task_loss, self._loss_calls = None, 0  # a micro-batch from before is not this
        if "step" in state:
            self.steps_done = int(state["step"])
        if self.objective is not None:
            self.objective.recount(state.get("size_cores"))  # older states: count now
        if "removed" in state:
            self.removed = {k: int(v) for k, v in state["removed"].items()}
        if state.get("gate_adam") is not None:  # the gates' own Adam (_hook_optimizer)
            if self._gate_adam is not None:
                self._gate_adam.load_state_dict(state["gate_adam"])
            else:  # made when the optimizer is first seen
                self._gate_adam_saved = state["gate_adam"]

    def __repr__(self) -> str:
        target = self.target_compression
        return (f"CoMERA({len(self._layers)} TT layers, schedule {self.schedule}, "
                f"stage {self.stage}, step {self._steps}"
                + (f", target {target:g}x {self.cfg.target_scope}" if target else "") + ")")
