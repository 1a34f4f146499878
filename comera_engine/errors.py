"""Exceptions shared across the engine."""

from __future__ import annotations

#: The longest field name and problem a message shows; longer text (a value echoed
#: back, an unknown key) is cut in the middle.
MAX_FIELD_CHARS = 120
MAX_PROBLEM_CHARS = 600


def shorten(text: str, limit: int) -> str:
    """``text`` cut to about ``limit`` characters, keeping its start and its end."""
    text = str(text)
    if len(text) <= limit:
        return text
    keep = max(8, limit // 2 - 20)
    return f"{text[:keep]}... ({len(text) - 2 * keep:,} characters cut) ...{text[-keep:]}"


class ConfigError(ValueError):
    """Bad user input (config field, CLI flag, form field).

    The message is one line that names the field and says how to fix it, e.g.
    ``model.rank: must be a positive integer, got -3``; a very long field or problem
    (an echoed value) is cut (:func:`shorten`).
    """

    def __init__(self, field: str, problem: str) -> None:
        self.field = shorten(field, MAX_FIELD_CHARS)
        self.problem = shorten(problem, MAX_PROBLEM_CHARS)
        super().__init__(f"{self.field}: {self.problem}")


class TrainingDiverged(FloatingPointError):
    """The task loss turned non-finite: training diverged. ``step`` is the 1-based step
    whose loss it was and ``loss`` its value; the message says what to do. A
    ``FloatingPointError``, so code that catches that catches this."""

    def __init__(self, step: int, loss: float, message: str) -> None:
        self.step = int(step)
        self.loss = float(loss)
        super().__init__(message)
