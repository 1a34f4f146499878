"""One writer per run: the run folder's lock and the run's owner token.

Two guards, both taken by the trainer before it changes anything:

* an OS lock (``fcntl.flock``) on ``<run_dir>/.lock``, held for the trainer's lifetime
  and released by the OS when the process ends, ``kill -9`` included. The file holds
  the owner's token as JSON so a refusal can name it;
* the owner token in the run's row (``pid``, ``pid_started``, ``host``: see
  :func:`comera_engine.launch.liveness.this_process`), taken in one SQLite transaction
  by :func:`claim_run` and checked by every status and metric write of the trainer's
  :class:`~comera_engine.store.StoreSink`.

A second trainer on the same folder, or on the same run in another folder, is refused
with :class:`RunBusyError` (one line; the CLI exits 2) before anything is written.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from comera_engine.errors import ConfigError
from comera_engine.launch.liveness import pid_alive, this_process
from comera_engine.store import RunStore
from comera_engine.store.runs import owner_token, same_owner

__all__ = ["LOCK_FILENAME", "RunBusyError", "RunLock", "claim_run", "lock_holder",
           "owned_here"]

#: The lock file in a run folder.
LOCK_FILENAME = ".lock"


class RunBusyError(ConfigError):
    """The run (or its folder) already has a live writer."""

    def __init__(self, problem: str) -> None:
        super().__init__("run", problem)


def _describe(token: Mapping[str, Any] | None) -> str:
    if not token or not token.get("pid"):
        return "another process"
    return f"pid {token['pid']} on {token.get('host') or 'this host'}"


#: Descriptors of the run locks this process holds. A forked child (a DataLoader
#: worker) closes its copies at once: a flock belongs to the open file, so a child's
#: copy would keep the lock after the trainer died (``kill -9``) until the child ended.
_HELD: set[int] = set()


def _drop_inherited_locks() -> None:
    for fd in list(_HELD):
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


os.register_at_fork(after_in_child=_drop_inherited_locks)


class RunLock:
    """An exclusive, non-blocking ``flock`` on ``<run_dir>/.lock``.

    ``acquire()`` raises :class:`RunBusyError` when another open file holds it (another
    process, or another ``RunLock`` in this one); the lock lasts until ``release()`` or
    the process ends. Usable as a context manager.
    """

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.path = Path(run_dir) / LOCK_FILENAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, token: Mapping[str, Any] | None = None) -> RunLock:
        """Take the lock and write ``token`` (default: this process) into the file."""
        if self._fd is not None:
            return self
        # the token first, so the file holds it within microseconds of the lock
        data = json.dumps(dict(token or this_process())).encode()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_token(fd)
            for _ in range(20):  # a holder that has just locked writes its token next
                if holder:
                    break
                time.sleep(0.01)
                holder = _read_token(fd)
            os.close(fd)
            raise RunBusyError(
                f"{self.path.parent} is in use by {_describe(holder)}; "
                "stop that run first (comera stop RUN)"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        self._fd = fd
        _HELD.add(fd)
        return self

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            _HELD.discard(fd)
            os.close(fd)  # closing the only descriptor drops the flock

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_token(fd: int) -> dict[str, Any] | None:
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"null")
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def lock_holder(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The token of the process holding ``<run_dir>/.lock`` (``{}`` if it wrote none), or
    ``None`` when nobody holds it. Creates nothing."""
    path = Path(run_dir) / LOCK_FILENAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_token(fd) or {}
        return None
    finally:
        os.close(fd)  # also drops the shared lock just taken


def _ancestors(pid: int) -> set[int]:
    try:
        import psutil

        return {p.pid for p in psutil.Process(pid).parents()}
    except Exception:
        return set()


def _mine(held: Mapping[str, Any], me: Mapping[str, Any], parents: set[int]) -> bool:
    """Whether the owner token ``held`` names ``me`` or one of my parents (the supervisor
    records the trainer's pid, or torchrun's)."""
    return bool(held["pid"]) and held["host"] == me["host"] and (
        same_owner(held, me) or held["pid"] in parents)


def owned_here(store: RunStore, run_id: str,
               me: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """The run's owner token when it already names this process (``me``, default
    :func:`this_process`) or a parent of it, else ``None``; changes nothing. A launched
    trainer uses it to report its phase before it has claimed the run (a trainer that
    is not the run's will be refused by :func:`claim_run`, and must not write before)."""
    run = store.get_run(run_id)
    if run is None:
        return None
    me = dict(me or this_process())
    held = owner_token(run)
    return held if _mine(held, me, _ancestors(int(me["pid"]))) else None


def claim_run(
    store: RunStore, run_id: str, me: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Take run ``run_id`` for process ``me`` (default :func:`this_process`) in one
    transaction and return the owner token its writes must carry.

    The recorded owner is kept when it is ``me`` or one of ``me``'s parents (the
    supervisor records the trainer's pid, or torchrun's); it is replaced when it is
    missing or its process is gone; a live other owner raises :class:`RunBusyError` and
    nothing changes. The status is left alone (the trainer's ``running`` follows)."""
    me = dict(me or this_process())
    parents = _ancestors(int(me["pid"]))

    def refuse(held: Mapping[str, Any], status: str) -> None:
        if held["pid"] and held["host"] == me["host"]:
            if pid_alive(held["pid"], held["pid_started"]):
                raise RunBusyError(
                    f"{run_id} is {status} and owned by {_describe(held)}; "
                    "stop it first (comera stop RUN)"
                )
        elif held["pid"] and status in ("running", "stopping"):
            raise RunBusyError(f"{run_id} is {status} on host {held['host']}; stop it there first")

    return store.lifecycle(run_id).claim(me, lambda held: _mine(held, me, parents), refuse)
