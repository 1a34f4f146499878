"""What a dataset build is doing, told to whoever asked (a trainer showing its phase).

The data layer never writes to the run store: :func:`comera_engine.data.build_dataset`
takes an ``on_phase(phase, progress)`` callable and installs it here for the duration
of the build (a context variable, so builders keep their ``builder(cfg, base_dir)``
signature). Long steps inside a builder announce themselves with :func:`phase`, e.g.
``with phase("training tokenizer"): ...``; the build is ``"preparing data"`` otherwise.
No torch here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar

#: ``on_phase(phase, progress)``: ``progress`` is 0..1, or ``None`` when unknown.
PhaseCallback = Callable[[str, "float | None"], None]

#: The phase a dataset build is in between its named steps.
PREPARING = "preparing data"

_on_phase: ContextVar[PhaseCallback | None] = ContextVar("comera_data_on_phase", default=None)


@contextlib.contextmanager
def reporting(on_phase: PhaseCallback | None) -> Iterator[None]:
    """Send the phases of the build inside this block to ``on_phase`` (``None``: to
    nobody); says :data:`PREPARING` on entry."""
    token = _on_phase.set(on_phase)
    try:
        report(PREPARING)
        yield
    finally:
        _on_phase.reset(token)


def report(name: str, progress: float | None = None) -> None:
    """Tell the current listener (if any) that the build is in phase ``name``."""
    callback = _on_phase.get()
    if callback is not None:
        callback(name, progress)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """A named step of a build (e.g. ``"training tokenizer"``, progress unknown); the
    build is back to :data:`PREPARING` after it."""
    report(name)
    try:
        yield
    finally:
        report(PREPARING)
