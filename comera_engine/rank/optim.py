"""Optimizer parameter groups, gate refresh, rank events and truncation with AdamW state."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from ..layers import TLTorchEmbedding, TTEmbedding, peer_layers, tt_layers
from .size import GateBank

__all__ = ["RankEvent", "RankTracker", "gate_lr", "param_groups", "refresh_gates",
           "refresh_gates_on_device", "truncate_model_and_optimizer"]


def gate_lr(lr_gates: float, tau: float, late_steps: int) -> float:
    """The gates' learning rate under ``comera.gate_speed``:
    ``max(lr_gates, 2·(1 - tau) / late_steps)``.

    Adam moves a parameter by about its learning rate a step, so a gate at 1 needs about
    ``(1 - tau) / lr`` steps to reach the threshold ``tau``. With this rate half of the
    late stage's ``late_steps`` (the fewest it can have: from the switch step, or from
    the deadline when the switch waits for a plateau) is enough, and the size objective
    alone can prune to the target within the run. ``late_steps <= 0`` (no step budget,
    or no late stage): ``lr_gates``."""
    if late_steps <= 0:
        return lr_gates
    return max(lr_gates, 2.0 * (1.0 - tau) / late_steps)


def param_groups(model: nn.Module, lr_cores: float = 1e-4, lr_gates: float = 1e-3,
                 lr_dense: float = 5e-5, weight_decay: float = 0.0,
                 lr_embedding: float | None = None) -> list[dict]:
    """AdamW groups: ``cores`` (TT cores: the engine's layers' and the tltorch peers'
    factors), ``gates`` (rank gates, no weight decay) and ``dense`` (everything else);
    with ``lr_embedding``, the cores of the TT embedding tables form their own
    ``embedding`` group at that rate. Empty groups are dropped."""
    cores, emb, gates = [], [], []
    tables = (TTEmbedding, TLTorchEmbedding) if lr_embedding is not None else ()
    for _, m in tt_layers(model):
        (emb if isinstance(m, tables) else cores).extend(m.tt.cores)
        gates.extend(m.tt.gates)
    for _, m in peer_layers(model):  # TT-matrix factors, no gates
        (emb if isinstance(m, tables) else cores).extend(m.factors())
    ids = {id(p) for p in cores + emb + gates}
    dense = [p for p in model.parameters() if id(p) not in ids]
    groups = [
        {"name": "cores", "params": cores, "lr": lr_cores, "weight_decay": weight_decay},
        {"name": "embedding", "params": emb, "lr": lr_embedding, "weight_decay": weight_decay},
        {"name": "gates", "params": gates, "lr": lr_gates, "weight_decay": 0.0},
        {"name": "dense", "params": dense, "lr": lr_dense, "weight_decay": weight_decay},
    ]
    return [g for g in groups if g["params"]]


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
                  floor: bool = True, bank: GateBank | None = None) -> list[RankEvent]:
    """After an optimizer step: make pruning permanent in every TT layer and return one
    event per bond whose effective rank changed.

    First one check over every gate of the model (concatenated: a handful of ops and one
    host read, whatever the number of layers): when no live entry is at or below its
    threshold nothing dies and nothing is touched (a dead entry's gate, zeroed when it
    died, is masked everywhere, so the optimizer's drift of it changes nothing). ``layers``:
    ``model``'s ``(name, TT layer)`` pairs when the caller keeps them, and ``bank`` their
    :class:`~comera_engine.rank.size.GateBank`; ``floor``: no bond loses its last entry
    (``comera.rank_floor``)."""
    layers = tt_layers(model) if layers is None else layers
    if bank is None:
        bank = GateBank([m for _, m in layers])
    gates, alive, _ = bank.flat()
    if not gates:
        return []
    backend = bank.backend()
    if backend is not None:  # the same check in one call
        if not backend.ops.layout_dying(bank.native(backend.ops), gates, alive):
            return []
    else:
        g = torch.cat(gates).detach()
        tau = bank.plan(g.device, g.dtype)[1]
        if not bool((torch.cat(alive) & (g.abs() <= tau)).any()):
            return []
    events = []
    for name, m in layers:
        for ch in m.tt.refresh_(floor):
            events.append(RankEvent(step, name, ch.bond, ch.old, ch.new))
    return events


@torch.no_grad()
def refresh_gates_on_device(model: nn.Module, floor: bool = True) -> Tensor:
    """``comera_engine.rank.refresh_gates`` without host reads: per bond, entries with
    ``|g| <= tau`` die for good and are zeroed, except that (with ``floor``) a bond about
    to lose its last entry keeps its strongest one, held at ``±1.5·tau``. Returns the
    alive count of every bond (layers in ``tt_layers`` order), as one device tensor."""
    counts = []
    for _, layer in tt_layers(model):
        tt = layer.tt
        for k, g in enumerate(tt.gates):
            alive = tt.alive(k)
            survivors = alive & (g.abs() > tt.tau)
            rescue = alive.any() & ~survivors.any() & floor
            strongest = torch.argmax(g.abs().masked_fill(~alive, -1.0))
            keep = (torch.arange(g.shape[0], device=g.device) == strongest) & rescue
            held = torch.where(g < 0, -1.5 * tt.tau, 1.5 * tt.tau).to(g.dtype)
            g.copy_(torch.where(keep, held, g))
            alive &= survivors | keep
            g.masked_fill_(~alive, 0.0)
            counts.append(alive.sum())
    return torch.stack(counts)


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


@torch.no_grad()
def truncate_model_and_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer | None
                                 ) -> dict[str, list[tuple[int, int, int]]]:
    """Physically slice every TT layer to its effective ranks, and the optimizer state
    (AdamW ``exp_avg``, ``exp_avg_sq``, any state tensor shaped like its parameter) with
    the same indices, so training continues from the truncated state with unchanged
    outputs. The ``nn.Parameter`` objects are kept, so parameter groups stay valid.
    Returns ``{layer: [(bond, old, new), …]}``."""
    state = optimizer.state if optimizer is not None else {}

    def slice_state(p: nn.Parameter, dim: int, keep: torch.Tensor) -> None:
        st = state.get(p)
        for key, v in list((st or {}).items()):
            if torch.is_tensor(v) and v.shape == p.shape:
                st[key] = v.index_select(dim, keep.to(v.device)).contiguous()

    out: dict[str, list[tuple[int, int, int]]] = {}
    for name, m in tt_layers(model):
        changes = m.tt.truncate_(on_slice=slice_state)
        if changes:
            out[name] = [(c.bond, c.old, c.new) for c in changes]
    return out
