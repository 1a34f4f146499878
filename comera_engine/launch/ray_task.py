"""What a Ray task runs on a worker: one sweep cell's trainer, its live records sent to
the driver, its run folder packed to come back.

:func:`run_cell` writes the cell's ``config.toml`` into a temporary folder, trains it as
a subprocess (``python -m comera_engine.cli train config.toml --run-dir DIR --no-store
--no-progress``, so a stop or a kill is the trainer's own), sends the new records of its
``metrics.jsonl`` every :data:`STREAM_EVERY_S` seconds to the driver's
:class:`CellStream` actor, and returns its exit code, the last :data:`LOG_LIMIT` bytes
of its log and :func:`pack_run_folder`'s archive. The driver side is
:mod:`comera_engine.launch.ray_backend`. Nothing here imports Ray at module level.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from comera_engine.launch.env import child_env
from comera_engine.launch.liveness import this_host
from comera_engine.launch.runs import CONFIG_FILENAME, DEFAULT_STOP_TIMEOUT
from comera_engine.store import LOG_FILENAME, list_checkpoints

__all__ = ["LOG_LIMIT", "STREAM_EVERY_S", "CellStream", "pack_run_folder", "run_cell",
           "unpack_run_folder"]

#: The most of a trainer's log (its end) a task sends back, in bytes.
LOG_LIMIT = 256 * 1024
#: Seconds between a task's sends of its trainer's new records to the driver.
STREAM_EVERY_S = 0.5
#: How often (seconds) a task looks at its trainer, so a cancel reaches it at once.
_TASK_POLL_S = 0.2


# ---------------------------------------------------------------------- the task


def _newest_checkpoint(run_dir: Path) -> set[str]:
    """Names (relative to ``run_dir``) of the newest complete checkpoint's two files."""
    found = list_checkpoints(run_dir / "checkpoints")
    if not found:
        return set()
    sidecar = found[-1][1]
    tensors = sidecar.with_suffix(".safetensors")
    return {f"checkpoints/{sidecar.name}", f"checkpoints/{tensors.name}"}


def pack_run_folder(run_dir: str | os.PathLike[str]) -> bytes:
    """A gzipped tar of what a cell sends back: ``run_dir``'s top-level files (not its
    ``.lock``) and its newest complete checkpoint (older ones stay behind)."""
    folder = Path(run_dir)
    names = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != ".lock")
    names += sorted(_newest_checkpoint(folder))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=1) as tar:
        for name in names:
            tar.add(folder / name, arcname=name, recursive=False)
    return buf.getvalue()


def _safe_member(member: tarfile.TarInfo) -> bool:
    path = PurePosixPath(member.name)
    return (member.isfile() and not path.is_absolute() and ".." not in path.parts
            and len(path.parts) <= 2)


def unpack_run_folder(data: bytes, run_dir: str | os.PathLike[str]) -> list[str]:
    """Unpack :func:`pack_run_folder`'s archive into ``run_dir`` (files replaced; a
    member that is not a plain file inside the folder is skipped). Returns the names."""
    folder = Path(run_dir)
    names = []
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for member in tar.getmembers():
            if not _safe_member(member):
                continue
            src = tar.extractfile(member)
            if src is None:
                continue
            target = folder / member.name
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(target.name + ".part")
            with open(tmp, "wb") as out:
                shutil.copyfileobj(src, out)
            os.replace(tmp, target)
            names.append(member.name)
    return names


def _wait_trainer(proc: subprocess.Popen[bytes]) -> int:
    """Wait for the trainer in short slices: Ray delivers a cancel (KeyboardInterrupt)
    between Python bytecodes, never inside a blocking wait."""
    while True:
        try:
            return proc.wait(timeout=_TASK_POLL_S)
        except subprocess.TimeoutExpired:
            continue


def _stop_trainer(proc: subprocess.Popen[bytes], grace: float) -> int:
    """SIGTERM to the trainer (it checkpoints and reports ``stopped``), SIGKILL to its
    process group after ``grace`` seconds. Returns its exit code."""
    try:
        proc.send_signal(signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            return proc.wait(timeout=_TASK_POLL_S)
        except subprocess.TimeoutExpired:
            continue
        except KeyboardInterrupt:  # a second cancel: no more waiting
            break
    _kill_group(proc)
    return proc.wait()


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _log_tail(path: Path, limit: int = LOG_LIMIT) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def _shielded(fn: Callable[[], Any], tries: int = 3) -> Any:
    """``fn()``, run again when a late cancel interrupts it (the trainer has already
    ended, so its results are still worth sending)."""
    for attempt in range(tries):
        try:
            return fn()
        except KeyboardInterrupt:
            if attempt == tries - 1:
                raise
    return None  # pragma: no cover


def _cancellable() -> Callable[[], None]:
    """Let a graceful ``ray.cancel`` reach this task: Ray raises its KeyboardInterrupt
    the way SIGINT does, which does nothing where SIGINT is ignored (a worker of a Ray
    started in the background inherits that). Returns what puts the old handler back."""
    try:
        old = signal.getsignal(signal.SIGINT)
        if old in (signal.SIG_IGN, signal.SIG_DFL, None):
            signal.signal(signal.SIGINT, signal.default_int_handler)
            return lambda: signal.signal(signal.SIGINT, old)
    except ValueError:  # not the main thread: nothing to change from here
        pass
    return lambda: None


def run_cell(
    config_text: str,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    run_id: str = "cell",
    stop_timeout: float = DEFAULT_STOP_TIMEOUT,
    threads: int = 1,
    stream: Any = None,
) -> dict[str, Any]:
    """Train one cell in a temporary folder on this machine (what a Ray task runs).

    ``config_text``: the cell's ``config.toml``; ``env``: its recorded launch environment
    (replaces this machine's run-shaping variables; ``OMP_NUM_THREADS`` defaults to
    ``threads``, the CPUs Ray gave the task); ``cwd``: where relative data paths are
    taken from, when that folder exists here; ``stream``: a :class:`CellStream` actor
    that gets the trainer's records while it trains (every :data:`STREAM_EVERY_S`
    seconds). A cancel (KeyboardInterrupt) stops the trainer gracefully within
    ``stop_timeout`` seconds. Returns ``{"exit_code", "log",
    "archive", "folder", "host", "cancelled"}`` (``archive``: :func:`pack_run_folder`,
    ``folder``: the temporary run folder, gone once this returns)."""
    restore = _cancellable()
    tmp = Path(tempfile.mkdtemp(prefix=f"comera-{run_id}-"))
    run_dir = tmp / "run"
    run_dir.mkdir()
    log_path = tmp / LOG_FILENAME
    try:
        (run_dir / CONFIG_FILENAME).write_text(config_text, encoding="utf-8")
        cmd = [sys.executable, "-m", "comera_engine.cli", "train", str(run_dir / CONFIG_FILENAME),
               "--run-dir", str(run_dir), "--no-store", "--no-progress"]
        recorded = dict(env or {})
        recorded.setdefault("OMP_NUM_THREADS", str(max(1, int(threads))))
        child = child_env(os.environ.get("CUDA_VISIBLE_DEVICES"), recorded)  # Ray's GPUs
        workdir = cwd if cwd and os.path.isdir(cwd) else str(tmp)
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, cwd=workdir, env=child,
                                    start_new_session=True)
        tail = _Tail(run_dir / "metrics.jsonl", run_id, stream) if stream is not None else None
        if tail is not None:
            tail.start()
        cancelled = False
        try:
            code = _wait_trainer(proc)
        except KeyboardInterrupt:  # ray.cancel(ref): the trainer checkpoints and stops
            cancelled = True
            code = _shielded(lambda: _stop_trainer(proc, stop_timeout))
        finally:
            if proc.poll() is None:
                _kill_group(proc)
                proc.wait()
        if tail is not None:
            _shielded(tail.close)
        return _shielded(lambda: {
            "exit_code": code, "log": _log_tail(log_path), "archive": pack_run_folder(run_dir),
            "folder": str(run_dir), "host": this_host(), "cancelled": cancelled})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        restore()



# ---------------------------------------------------------------------- the stream


class CellStream:
    """A Ray actor the tasks send their cells' records to while they train, and the
    driver drains (``put`` / ``drain``): metrics, rank snapshots, events and phases,
    as the trainer appends them to its ``metrics.jsonl``."""

    def __init__(self) -> None:
        self._records: dict[str, list[dict[str, Any]]] = {}

    def put(self, run_id: str, records: list[dict[str, Any]]) -> int:
        self._records.setdefault(run_id, []).extend(records)
        return len(records)

    def drain(self) -> dict[str, list[dict[str, Any]]]:
        out, self._records = self._records, {}
        return out


#: The record kinds a task streams (artifacts and the status come back with the folder).
_STREAMED = ("metrics", "ranks", "event", "phase")


class _Tail(threading.Thread):
    """Follows a growing ``metrics.jsonl`` and sends its whole new lines to the stream
    every ``every`` seconds; :meth:`close` sends the rest and waits for the sends."""

    def __init__(self, path: Path, run_id: str, stream: Any, every: float = STREAM_EVERY_S
                 ) -> None:
        super().__init__(name=f"tail-{run_id}", daemon=True)
        self.path, self.run_id, self.stream, self.every = path, run_id, stream, every
        self._offset = 0
        self._done = threading.Event()
        self._lock = threading.Lock()  # one send at a time, in file order

    def run(self) -> None:
        while not self._done.wait(self.every):
            self._send()

    def close(self) -> None:
        self._done.set()
        self.join(timeout=30)
        self._send()

    def _send(self) -> None:
        with self._lock:
            self._send_new()

    def _send_new(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return
        whole = data[:data.rfind(b"\n") + 1]
        if not whole:
            return
        records = []
        for line in whole.decode("utf-8", errors="replace").splitlines():
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if isinstance(r, dict) and r.get("type") in _STREAMED:
                records.append(r)
        try:
            import ray

            if records:  # waited for: the driver has every record once the task returns
                ray.get(self.stream.put.remote(self.run_id, records))
            self._offset += len(whole)
        except Exception:  # the driver is gone: the records come back with the folder
            self._done.set()
