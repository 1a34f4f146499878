"""Optimizer parameter groups, the gates' own Adam under an SGD-like optimizer, gate
refresh, rank events and truncation with the optimizer state."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..layers import TLTorchEmbedding, TTEmbedding, peer_layers, tt_layers
from ..tensor.size import gate_entries, refresh_entries
from ..tensor.tt import swap_param

__all__ = ["GATE_MIN_STEPS", "GATE_TRAVEL", "GRADIENT_SCALED", "GateAdam", "RankEvent",
           "RankTracker", "RateWatch", "gate_lr", "param_groups", "refresh_gates",
           "refresh_gates_on_device", "truncate_model_and_optimizer"]


#: A gate can fall from 1 to ``tau`` within this fraction of the steps before the target
#: is due, and never in fewer than ``GATE_MIN_STEPS`` (:func:`gate_lr`).
GATE_TRAVEL = 0.1
GATE_MIN_STEPS = 50


def gate_lr(tau: float, steps_to_target: int) -> float | None:
    """The gates' learning rate from the schedule: ``(1 - tau) / max(GATE_MIN_STEPS,
    GATE_TRAVEL · steps_to_target)``.

    Adam moves a parameter by about its learning rate a step, so a gate at 1 needs about
    ``(1 - tau) / lr`` steps to reach the threshold ``tau``. At this rate it can do so
    within a tenth of the steps before the size is due at the target (the pace's reach
    step, else the run's last): the early stage's size term can tell the gates that
    matter from those that do not in time for the pace to prune by them, whatever the
    model's own learning rate (experiments/results/own_loop.json: a rate that lets a
    gate cross only in half the late stage cost 5-12 points on untuned networks). In a
    short run it takes at least 50 steps, so a few noisy batches cannot kill an entry.
    ``None`` without a step budget (``steps_to_target <= 0``): the optimizer's rate then
    applies."""
    if steps_to_target <= 0:
        return None
    return (1.0 - tau) / max(GATE_MIN_STEPS, GATE_TRAVEL * steps_to_target)


def param_groups(model: nn.Module, lr_cores: float | None = None,
                 lr_gates: float | None = None, lr_dense: float | None = None,
                 weight_decay: float | None = None, lr_embedding: float | None = None
                 ) -> list[dict]:
    """Optimizer parameter groups: ``cores`` (TT cores: the engine's layers' and the
    tltorch peers' factors), ``embedding`` (the TT embedding tables' cores, only with
    ``lr_embedding``), ``gates`` (rank gates, never weight decay) and ``dense``
    (everything else). A group carries ``lr`` / ``weight_decay`` only where one is given:
    otherwise the optimizer's own apply (PEFT's convention: the user's optimizer and
    lr). Empty groups are dropped."""
    cores, emb, gates = [], [], []
    tables = (TTEmbedding, TLTorchEmbedding) if lr_embedding is not None else ()
    for _, m in tt_layers(model):
        (emb if isinstance(m, tables) else cores).extend(m.tt.cores)
        gates.append(m.tt.gate)
    for _, m in peer_layers(model):  # TT-matrix factors, no gates
        (emb if isinstance(m, tables) else cores).extend(m.factors())
    ids = {id(p) for p in cores + emb + gates}
    dense = [p for p in model.parameters() if id(p) not in ids]

    def group(name: str, params: list, lr: float | None, decay: float | None) -> dict:
        out = {"name": name, "params": params}
        if lr is not None:
            out["lr"] = lr
        if decay is not None:
            out["weight_decay"] = decay
        return out

    groups = [group("cores", cores, lr_cores, weight_decay),
              group("embedding", emb, lr_embedding, weight_decay),
              group("gates", gates, lr_gates, 0.0),
              group("dense", dense, lr_dense, weight_decay)]
    return [g for g in groups if g["params"]]


#: Optimizers whose step is not about their learning rate: SGD's and ASGD's are the rate
#: times the gradient (and its momentum), Adagrad's shrinks with every gradient seen. Under
#: them the gates' rate from the schedule would not set the gates' speed, so the gates take
#: their own Adam steps (:class:`GateAdam`).
GRADIENT_SCALED: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.ASGD, torch.optim.Adagrad)


class RateWatch:
    """Watches the optimizer's learning rates before every ``optimizer.step()`` (a step
    pre-hook), for a scheduler of the user's that moves every group alike:

    * a group holding rank gates whose rate was moved is set back to the gates' rate (the
      rank schedule's, :func:`gate_lr`: decayed, a gate no longer reaches its threshold
      before the target is due), said once; so is weight decay on the gates' group (a
      group of the user's at AdamW's default), set to 0;
    * when another group's rate falls below 0.9 of its highest so far before ``hold``
      (the step at which the pace fixes the ranks), that is said once: a network shrunk
      while its rate falls recovers less (experiments/results/own_loop_cosine.json against
      own_loop_cosine-held.json), and ``ce.lr_scheduler`` decays from ``hold`` instead.

    A rate held as a tensor (a captured CUDA graph's) is left alone."""

    def __init__(self, gates: list[Tensor], rate: float, hold: int | None = None,
                 step_now: Callable[[], int] = lambda: 0) -> None:
        self.ids = {id(p) for p in gates}
        self.rate = float(rate)
        self.hold, self.step_now = hold, step_now
        self.top: dict[int, float] = {}  # group index -> its highest rate seen
        self.said: set[str] = set()
        self._handle: Any = None

    def hook_into(self, optimizer: torch.optim.Optimizer) -> None:
        """Watch before every ``optimizer.step()`` from now on (the hook on an optimizer
        hooked before is removed, with the rates seen on it)."""
        if self._handle is not None:
            self._handle.remove()
        self.top.clear()
        self._handle = optimizer.register_step_pre_hook(self.before_step)

    def _say(self, what: str, text: str) -> None:
        if what not in self.said:
            self.said.add(what)
            print("CoMERA: " + text, file=sys.stderr)

    def before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        step = None
        for i, group in enumerate(optimizer.param_groups):
            lr = group.get("lr")
            if not isinstance(lr, (int, float)):
                continue
            if any(id(p) in self.ids for p in group["params"]):
                if lr != self.rate:
                    self._say("gates", f"the rank gates' learning rate was {lr:.3g} (a "
                              "group of your own, or a learning-rate scheduler moved it); "
                              f"it is set to {self.rate:.3g}, the rate at which the ranks "
                              "reach the target in time (comera.lr_gates sets another)")
                    group["lr"] = self.rate
                decay = group.get("weight_decay")
                if isinstance(decay, (int, float)) and decay > 0:
                    self._say("decay", f"the rank gates' group had weight_decay {decay:g} "
                              "(AdamW's default, say), which pulls every gate to 0 and "
                              "prunes ranks the task needs; it is set to 0 "
                              "(comera.param_groups() gives the gates none)")
                    group["weight_decay"] = 0.0
                continue
            top = max(self.top.get(i, lr), lr)
            self.top[i] = top
            if self.hold and "fall" not in self.said and lr < 0.9 * top:
                step = self.step_now() if step is None else step
                if step < self.hold:
                    self._say("fall", f"the learning rates fall (to {lr / top:.2f} of their "
                              f"highest) at step {step}, before step {self.hold}, where the "
                              "pace fixes the ranks; a network shrunk while its rate falls "
                              "recovers less: ce.lr_scheduler(optimizer, \"cosine\", "
                              "comera=comera) starts the decay there")


class GateAdam:
    """The rank gates' own Adam, for a user's optimizer whose step is not about its
    learning rate (:data:`GRADIENT_SCALED`).

    :func:`gate_lr` sets the gates' speed through their learning rate, which holds for
    an optimizer that moves a parameter by about its rate a step (Adam, AdamW, RMSprop,
    Lion, ...). Under SGD a gate moves by the rate times its gradient, a few thousandths
    of what the schedule needs: the gates barely move and the pace prunes bonds whose
    gates all look alike (own_loop.py's MLP with SGD at 0.05: 91.7 % held out against
    98.0 % dense; experiments/results/own_loop_sgd.json has the figures with this class).
    So under those optimizers the gates take Adam's steps at the schedule's
    rate: :meth:`hook_into` registers :meth:`before_step` as the optimizer's pre-step
    hook, which steps Adam with the gates' gradients and then clears them, so the
    optimizer passes over the gates (SGD, ASGD and Adagrad skip a parameter without a
    gradient: no momentum, no weight decay). The gates stay in the optimizer's groups:
    its state dict, its learning-rate schedulers and resuming it are as without this.

    Args:
        gates: every TT layer's ``gate`` parameter.
        lr: the gates' rate (:meth:`comera_engine.CoMERA.lr_gates`).
    """

    def __init__(self, gates: Sequence[nn.Parameter], lr: float) -> None:
        self.adam = torch.optim.Adam(list(gates), lr=lr, weight_decay=0.0)
        self._handle: Any = None  # the hook on the optimizer hooked last

    def hook_into(self, optimizer: torch.optim.Optimizer) -> None:
        """Step the gates before every ``optimizer.step()`` (from now on; the hook on an
        optimizer hooked before is removed)."""
        if self._handle is not None:
            self._handle.remove()
        self._handle = optimizer.register_step_pre_hook(self.before_step)

    def before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Adam's step over the gates, then their gradients cleared (``None``)."""
        self.adam.step()
        self.adam.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, Any]:
        """Adam's state as plain values (JSON alike: the gates are a few hundred numbers),
        keyed by the gate's position."""
        return {str(i): {k: v.tolist() if torch.is_tensor(v) else v for k, v in s.items()}
                for i, s in self.adam.state_dict()["state"].items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` gave (the gates already at the saved shapes)."""
        full = self.adam.state_dict()
        full["state"] = {int(i): {k: torch.tensor(v, dtype=torch.float32 if k == "step"
                                                  else torch.float64)
                                  for k, v in s.items()} for i, s in state.items()}
        self.adam.load_state_dict(full)  # casts each moment to its gate's dtype and device


@dataclass(frozen=True)
class RankEvent:
    """A bond of a layer changed its effective rank at ``step``."""

    step: int
    layer: str
    bond: int
    old: int
    new: int

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return f"{self.layer} bond {self.bond}: rank {self.old} -> {self.new} (step {self.step})"


def refresh_gates(model: nn.Module, step: int = 0,
                  layers: list[tuple[str, nn.Module]] | None = None,
                  floor: bool = True) -> list[RankEvent]:
    """After an optimizer step: make pruning permanent in every TT layer and return one
    event per bond whose effective rank changed.

    First one check over every gate of the model (one host read whatever the number of
    layers): when no live entry is at or below its threshold nothing dies and nothing is
    touched. ``layers``: ``model``'s ``(name, TT layer)`` pairs when the caller keeps
    them; ``floor``: no bond loses its last entry (``comera.rank_floor``)."""
    layers = tt_layers(model) if layers is None else layers
    trains = [m.tt for _, m in layers if m.tt.bond_ranks]
    if not trains:
        return []
    with torch.no_grad():
        g, alive, form = gate_entries(trains)
        if not bool((alive & (g.abs() <= form.tau)).any()):
            return []
    events = []
    for name, m in layers:
        for ch in m.tt.refresh_(floor):
            events.append(RankEvent(step, name, ch.bond, ch.old, ch.new))
    return events


@torch.no_grad()
def refresh_gates_on_device(model: nn.Module, floor: bool = True) -> Tensor:
    """:func:`refresh_gates` without host reads (a captured CUDA graph can run it): per
    bond, entries with ``|g| <= tau`` die for good and are zeroed, except that (with
    ``floor``) a bond about to lose its last entry keeps its strongest one, held at
    ``±1.5·tau``. Returns the alive count of every bond (layers in ``tt_layers`` order),
    as one device tensor: :func:`comera_engine.tensor.size.refresh_entries` over the
    model's trains, every bond at once."""
    return refresh_entries([layer.tt for _, layer in tt_layers(model)], floor)


class RankTracker:
    """Remembers effective ranks per layer and reports changes between snapshots (also
    catches changes not made through ``refresh_gates``)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.last = self.snapshot()

    def snapshot(self) -> dict[str, list[int]]:
        return {name: m.effective_ranks() for name, m in tt_layers(self.model)}

    def update(self, step: int) -> list[RankEvent]:
        now = self.snapshot()
        events = []
        for name, ranks in now.items():
            old = self.last.get(name, ranks)
            for b, (o, n) in enumerate(zip(old, ranks)):
                if o != n:
                    events.append(RankEvent(step, name, b, o, n))
        self.last = now
        return events


def held_by_a_graph(model: nn.Module) -> list[str]:
    """The TT layers of ``model`` with dead rank entries to slice whose parameters an
    autograd graph never backpropagated still holds (a validation loss computed with
    gradients on, losses kept in a list): slicing swaps each parameter's tensor for a
    fresh one (:func:`~comera_engine.tensor.tt.swap_param`), which torch refuses then,
    and a ``.data`` slice would make the next backward fail against the old shapes, so
    they stay masked until the graph is gone. Probed by that swap with each parameter's
    own values (its gradient dropped, as slicing drops it)."""
    return [name for name, m in tt_layers(model)
            if m.tt.effective_ranks() != list(m.tt.bond_ranks)
            and any(not swap_param(p, p.data) for p in m.tt.parameters())]


@torch.no_grad()
def truncate_model_and_optimizer(model: nn.Module, *optimizers: torch.optim.Optimizer | None
                                 ) -> dict[str, list[tuple[int, int, int]]]:
    """Physically slice every TT layer to its effective ranks, and the optimizers' state
    (AdamW ``exp_avg``, ``exp_avg_sq``, any state tensor shaped like its parameter) with
    the same indices, so training continues from the truncated state with unchanged
    outputs. The ``nn.Parameter`` objects are kept, so parameter groups stay valid.
    State laid out otherwise (Adafactor's row and column factors) cannot be sliced: that
    parameter's state is dropped, and the optimizer starts it afresh at its next step, as
    at its first. ``None`` optimizers are skipped. Returns ``{layer: [(bond, old, new),
    …]}``."""
    states = [opt.state for opt in optimizers if opt is not None]

    def slice_state(p: nn.Parameter, dim: int, keep: torch.Tensor) -> None:
        for state in states:
            st = state.get(p)
            if st and any(torch.is_tensor(v) and v.numel() > 1 and v.shape != p.shape
                          for v in st.values()):
                del state[p]  # not shaped like p: the optimizer's own layout
                continue
            for key, v in list((st or {}).items()):
                if torch.is_tensor(v) and v.shape == p.shape:
                    st[key] = v.index_select(dim, keep.to(v.device)).contiguous()

    out: dict[str, list[tuple[int, int, int]]] = {}
    for name, m in tt_layers(model):
        changes = m.tt.truncate_(on_slice=slice_state)
        if changes:
            out[name] = [(c.bond, c.old, c.new) for c in changes]
    return out
