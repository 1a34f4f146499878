"""Exceptions shared across the engine."""

from __future__ import annotations


class ConfigError(ValueError):
    """Bad user input (config field, CLI flag, form field).

    The message is one line that names the field and says how to fix it, e.g.
    ``model.rank: must be a positive integer, got -3``.
    """

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}")
