"""The run store's errors (all are ``ValueError``s, so the CLI prints them as one line)."""

from __future__ import annotations


class StoreError(ValueError):
    """The run store cannot be used: foreign or corrupt file, newer schema, unknown run."""


class RunNotFoundError(StoreError):
    """No run matches the given id, id prefix or name."""


class NotOwnerError(StoreError):
    """A write by a process that no longer owns the run (another trainer took it over)."""
