"""Many TT linears' halves made at once, for one forward (:func:`grouped_halves`).

Inside ``with grouped_halves(trains):`` the trains that share a structure (core shapes,
``d``, ``tau``, device and dtype; two or more of them) have their gated halves ``L``,
``R`` merged together, one batched pass per structure
(:func:`comera_engine.ops.tt_halves_group.tt_halves_group`; the middle rank zero-padded
to a multiple of 8, so the batch GEMMs below run aligned), and
:func:`comera_engine.tensor.planner.tt_linear` runs such a train's ``halves`` or
reconstructed path on them: ``(X·L)·R + b`` or ``X·(L·R) + b``, autograd through both
(the batch products and their backward are ``nn.Linear``'s). The halves are made when the
block is entered, from the parameters as they are then, and forgotten when it is left: a
training step enters it around its forward (:class:`comera_engine.train.step.TrainStep`,
on a GPU), under the step's autocast and inside its CUDA graph. Outside the block every
layer merges its own cores.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

from torch import Tensor

from ..ops.tt_halves_group import tt_halves_group

if TYPE_CHECKING:
    from .tt import TensorTrain

__all__ = ["grouped_halves", "prepared_halves"]

_STATE = threading.local()


@contextmanager
def grouped_halves(trains: Sequence[TensorTrain]) -> Iterator[int]:
    """Make the halves of ``trains`` (TT-linear trains, ``2d`` three-way cores each), one
    batched pass per structure shared by two or more, for the block; yields how many
    trains were grouped. Trains of a structure of their own are left to their layer."""
    groups: dict[tuple, list[tuple[list[Tensor], Tensor, Tensor]]] = {}
    for t in trains:
        cores, gate, alive = t.flat_parts()
        if len(cores) != 2 * t.d or cores[0].dim() != 3 or not gate.numel():
            continue
        key = (tuple(c.shape for c in cores), t.d, float(t.tau), cores[0].device,
               cores[0].dtype)
        groups.setdefault(key, []).append((cores, gate, alive))
    table: dict[int, tuple[Tensor, tuple[Tensor, Tensor]]] = {}
    for (_, d, tau, _, _), members in groups.items():
        if len(members) < 2:
            continue
        for parts, halves in zip(members, tt_halves_group(members, d, tau)):
            table[id(parts[0][0])] = (parts[0][0], halves)
    prev = getattr(_STATE, "table", None)
    _STATE.table = table
    try:
        yield len(table)
    finally:
        _STATE.table = prev


def prepared_halves(first_core: Tensor) -> tuple[Tensor, Tensor] | None:
    """The ``(L, R)`` made by the enclosing :func:`grouped_halves` for the train whose
    first core is ``first_core``, or None."""
    table = getattr(_STATE, "table", None)
    if not table:
        return None
    hit = table.get(id(first_core))
    return hit[1] if hit is not None and hit[0] is first_core else None
