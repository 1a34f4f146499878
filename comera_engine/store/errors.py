"""The run store's errors (all are ``ValueError``s, so the CLI prints them as one line)."""

from __future__ import annotations


class StoreError(ValueError):
    """The run store cannot be used: foreign or corrupt file, newer schema, unknown run."""


class StoreLocked(StoreError):
    """Another process held the store's write lock for longer than this one would wait
    (e.g. a trainer frozen in the middle of a write); reads still work."""


class RunNotFoundError(StoreError):
    """No run matches the given id, id prefix or name."""


class NotOwnerError(StoreError):
    """A write by a process that no longer owns the run (another trainer took it over)."""


def is_damaged(e: BaseException) -> bool:
    """Whether a store error says the file itself is damaged (corrupt pages, a zeroed
    header): what ``comera repair`` rebuilds."""
    text = str(e)
    return any(w in text for w in ("corrupt", "malformed", "not a database",
                                   "not a SQLite database"))
