"""Detached run supervisor: ``python -m comera_engine.launch.supervisor --store DB --run-id ID``.

Started by the launcher in its own session. It runs the trainer in a new process group
(stdout/stderr appended to ``<run_dir>/train.log``), records its pid, heartbeats, turns a
``stopping`` status into SIGTERM (and SIGKILL after the stop deadline), and when the
trainer exits without a final status records ``crashed`` (``failed`` when it died with a
Python traceback) with the log tail. Then it starts queued runs that now fit.

It is the :class:`~comera_engine.launch.scheduler.Scheduler` every run goes through,
with :class:`LocalExecutor` (the trainer's process group) and a queue of one run: the
run the launcher dispatched to it (:func:`comera_engine.launch.dispatch` fills the local
queue, within the store's ``max_concurrent``, by starting one supervisor a run).
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from comera_engine.launch.env import child_env, recorded_env, run_env
from comera_engine.launch.liveness import process_start_time, this_host
from comera_engine.launch.runs import (
    CONFIG_FILENAME,
    DEFAULT_STOP_TIMEOUT,
    checkpoint_steps,
    dispatch,
)
from comera_engine.launch.scheduler import Outcome, Scheduler, Slot
from comera_engine.launch.signals import send_stop_signal, signal_group
from comera_engine.store import RunStore, StoreError
from comera_engine.store.errors import is_damaged
from comera_engine.store.layout import log_error, log_tail_line, traceback_error

#: Seconds between the supervisor's looks at the store (the trainer's exit is seen at once).
POLL_S = 0.3


def trainer_command(store: RunStore, run: dict[str, Any], resume: bool) -> list[str]:
    """The trainer command line for ``run`` (through torchrun when ``nproc > 1``)."""
    rid = run["id"]
    args = [
        "-m",
        "comera_engine.cli",
        "train",
        str(store.run_dir(rid) / CONFIG_FILENAME),
        "--store",
        str(store.path),
        "--run-id",
        rid,
    ]
    if resume:
        args.append("--resume")
    nproc = int(run.get("nproc") or 1)
    if nproc > 1:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            *args,
        ]
    return [sys.executable, *args]


def shown_command(cmd: list[str], root: Path) -> str:
    """``cmd`` as the run's log says it: the interpreter as ``python`` and paths inside
    the run store relative to its folder (``<run id>/config.toml``), so the log, which the
    dashboard shows, names no server path outside the run store."""
    def shown(i: int, arg: str) -> str:
        if i == 0 and arg == sys.executable:
            return "python"
        path = Path(arg)
        if path.is_absolute() and path.is_relative_to(root):
            return str(path.relative_to(root))
        return arg

    return shlex.join(shown(i, a) for i, a in enumerate(cmd))


def _signame(rc: int) -> str:
    try:
        return signal.Signals(-rc).name
    except ValueError:
        return f"signal {-rc}"


def _read_since(path: Path, offset: int, max_bytes: int = 65536) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            end = f.tell()
            f.seek(max(offset, end - max_bytes))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def _ignore(signum: int, frame: Any) -> None:
    pass


def _log(path: Path, text: str) -> None:
    """A ``[comera time] text`` line in the run's log (none when its folder is gone: the
    supervisor goes on, and the store keeps the record)."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"[comera {stamp}] {text}\n")
    except OSError:
        pass


class LocalExecutor:
    """The local executor: a run's trainer as a subprocess in its own process group
    (stdout/stderr appended to the run's ``train.log``), stopped by SIGCONT and SIGTERM,
    forced by SIGKILL to its group at the stop deadline."""

    force_after = 0.0
    start_error = "launch: cannot start the trainer"

    def __init__(self, store: RunStore, run_id: str) -> None:
        self.store = store
        self.log_path = store.log_path(run_id)
        self.offset = 0
        self.resume = False

    def submit(self, run: Mapping[str, Any], attempt: int
               ) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
        st, rid = self.store, str(run["id"])
        self.resume = bool(run["resume_pending"]) and bool(checkpoint_steps(st.run_dir(rid)))
        cmd = trainer_command(st, dict(run), self.resume)
        recorded = recorded_env(st.run_dir(rid))
        if self.resume and recorded is not None:
            here = run_env()
            differ = sorted(k for k in set(recorded) | set(here) if recorded.get(k) != here.get(k))
            if differ:
                _log(self.log_path, "resume: with the launch environment (differs here in "
                     f"{', '.join(differ)})")
        _log(self.log_path,
             f"attempt {attempt} on {this_host()}: {shown_command(cmd, st.root)}")
        with open(self.log_path, "ab") as log:
            self.offset = log.tell()
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=child_env(run["gpus"], recorded),
                start_new_session=True,  # own process group: signals reach only it
                close_fds=True,
            )
        return proc, {"pid": proc.pid, "pid_started": process_start_time(proc.pid)}

    def started(self, slot: Slot) -> str:
        note = " (resume)" if self.resume else ""
        return f"attempt {slot.attempt}: trainer pid {slot.handle.pid}{note}"

    def wait(self, slots: list[Slot], timeout: float) -> list[Slot]:
        ended = []
        for slot in slots:
            try:
                slot.exit_code = slot.handle.wait(timeout=timeout / len(slots))
                ended.append(slot)
            except subprocess.TimeoutExpired:
                pass
        return ended

    def cancel(self, slot: Slot, force: bool) -> None:
        proc = slot.handle
        if force:
            _log(self.log_path, "stop timed out: SIGKILL to the trainer")
            signal_group(proc.pid, signal.SIGKILL)
            return
        _log(self.log_path, "stop requested: SIGTERM to the trainer")
        run = self.store.get_run(slot.run_id) or {}
        send_stop_signal(proc.pid, int(run.get("nproc") or 1))

    def outcome(self, slot: Slot, run: Mapping[str, Any]) -> Outcome:
        """A trainer that exited without a final status: ``crashed`` (``failed`` when it
        reported an error on its way out, ``stopped`` when a stop ended it before
        training), with its log tail."""
        signal_group(slot.handle.pid, signal.SIGKILL)  # leftovers (workers, data loaders)
        rc = int(slot.exit_code if slot.exit_code is not None else slot.handle.wait())
        how = _how(rc)
        text = _read_since(self.log_path, self.offset)
        tail = "\n".join(text.splitlines()[-40:])
        status, error, event = "crashed", "", ""
        if run["status"] == "stopping":
            if slot.forced:
                error = "stop: the trainer did not stop in time and was killed (SIGKILL)"
                event = "killed after the stop timeout; resume continues from the last checkpoint"
            elif rc == -signal.SIGTERM:
                status, error = "stopped", None
                event = "the trainer ended on SIGTERM before training started"
            else:
                error = f"stop: the trainer exited ({how}) without confirming the stop"
        elif rc < 0:
            error = f"crashed: the trainer was killed by {how} without a final status"
        elif rc > 0:  # an error it reported on the way out (traceback or one-line error)
            status = "failed"
            error = log_error(text, self.log_path.name) or f"the trainer exited with {how}"
        else:
            error = f"crashed: the trainer exited ({how}) without a final status"
        if error and status == "crashed" and tail:
            error += f"; last log lines: {log_tail_line(tail)}"
        kind = "stop" if status == "stopped" else "crash"
        return Outcome(status, error, rc, (kind, event or (error or "").split("\n")[0]))

    def ended(self, slot: Slot, note: str) -> None:
        rc = slot.exit_code
        _log(self.log_path, f"trainer exited ({'?' if rc is None else _how(rc)}); {note}")

    def say(self, text: str) -> None:
        print(f"supervisor: {text}", file=sys.stderr, flush=True)


def _how(rc: int) -> str:
    return f"code {rc}" if rc >= 0 else _signame(rc)


class Supervisor:
    """One run's scheduler with the local executor: it takes the run the launcher
    dispatched to it, watches its trainer to the end, then starts queued runs."""

    def __init__(self, store: RunStore, run_id: str) -> None:
        self.store = store
        self.run_id = run_id
        self.log_path = store.log_path(run_id)
        self.executor = LocalExecutor(store, run_id)
        self.scheduler = Scheduler(store, self.executor, self._claim,
                                   waiting=lambda: not self._claimed, poll=POLL_S,
                                   stop_timeout=DEFAULT_STOP_TIMEOUT,
                                   name=("the run", "the supervisor"))
        self._claimed = False
        self._tries = 0
        self.status = 0

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        slot = next(iter(self.scheduler.inflight.values()), None)
        return slot.handle if slot is not None else None

    def _claim(self) -> Mapping[str, Any] | None:
        """The run, once: ``None`` when it is gone, stopped meanwhile or not queued."""
        if self._claimed:
            return None
        st, rid = self.store, self.run_id
        try:
            run = st.get_run(rid)
        except StoreError as e:  # tried again next round, for a while
            self._tries += 1
            if is_damaged(e) or self._tries >= 20:
                self._claimed = True
            raise
        self._claimed = True
        if run is None:
            print(f"supervisor: no run {rid} in {st.path}", file=sys.stderr)
            self.status = 2
            return None
        st.update_run(rid, supervisor_pid=os.getpid(), host=this_host())
        if run["status"] == "stopping":  # stopped between dispatch and now
            st.lifecycle(rid).end("stopped", event=("stop", "stopped before the trainer started"))
            _log(self.log_path, "stopped before the trainer started")
            return None
        if run["status"] != "queued":
            _log(self.log_path, f"supervisor: run is {run['status']}, not queued; nothing to do")
            return None
        return run

    def run(self) -> int:
        # a handler, not SIG_IGN: ignored signals would stay ignored in the trainer
        signal.signal(signal.SIGINT, _ignore)
        signal.signal(signal.SIGHUP, _ignore)
        self.scheduler.run()  # SIGTERM to the supervisor stops the run
        if self.status != 2:
            try:
                dispatch(self.store)
            except StoreError as e:  # a damaged store: the run folder keeps the record
                _log(self.log_path, f"supervisor: could not start queued runs ({e})")
        return self.status


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m comera_engine.launch.supervisor")
    p.add_argument("--store", required=True)
    p.add_argument("--run-id", required=True)
    args = p.parse_args(argv)
    try:
        store = RunStore(args.store, create=False)
    except StoreError as e:
        print(f"supervisor: {e}", file=sys.stderr)
        return 2
    sup = Supervisor(store, args.run_id)
    try:
        return sup.run()
    except Exception:
        import traceback

        tb = traceback.format_exc()
        print(tb, file=sys.stderr)
        _log(store.log_path(args.run_id), f"supervisor failed:\n{tb}")
        try:
            if sup.proc is None:
                store.lifecycle(args.run_id).end(
                    "failed", f"supervisor failed before starting the trainer: "
                    f"{traceback_error(tb)} (traceback in {store.log_path(args.run_id).name})")
        except Exception:
            pass
        return 1


if __name__ == "__main__":
    sys.exit(main())
