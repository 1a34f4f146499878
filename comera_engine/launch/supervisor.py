"""Detached run supervisor: ``python -m comera_engine.launch.supervisor --store DB --run-id ID``.

Started by the launcher in its own session. It runs the trainer in a new process group
(stdout/stderr appended to ``<run_dir>/train.log``), records its pid, heartbeats, turns a
``stopping`` status into SIGTERM (and SIGKILL after the stop deadline), and when the
trainer exits without a final status records ``crashed`` (``failed`` when it died with a
Python traceback) with the log tail. Then it starts queued runs that now fit.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from comera_engine.launch import (
    CONFIG_FILENAME,
    DEFAULT_STOP_TIMEOUT,
    checkpoint_steps,
    child_env,
    dispatch,
    recorded_env,
    run_env,
    send_stop_signal,
    signal_group,
)
from comera_engine.launch.liveness import process_start_time, this_host
from comera_engine.store import FINAL_STATUSES, RunStore, StoreError, extract_traceback

POLL_S = 0.1
STATUS_EVERY_S = 0.3
HEARTBEAT_EVERY_S = 2.0


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
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"[comera {stamp}] {text}\n")


class Supervisor:
    def __init__(self, store: RunStore, run_id: str) -> None:
        self.store = store
        self.run_id = run_id
        self.log_path = store.log_path(run_id)
        self.proc: subprocess.Popen[bytes] | None = None
        self.stop_signal_sent = False
        self.killed = False
        self.self_stop = False
        self.attempt = 0

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self.self_stop = True  # handled in the loop (no DB access in a signal handler)

    def run(self) -> int:
        st, rid = self.store, self.run_id
        signal.signal(signal.SIGTERM, self._on_sigterm)
        # a handler, not SIG_IGN: ignored signals would stay ignored in the trainer
        signal.signal(signal.SIGINT, _ignore)
        signal.signal(signal.SIGHUP, _ignore)
        run = st.get_run(rid)
        if run is None:
            print(f"supervisor: no run {rid} in {st.path}", file=sys.stderr)
            return 2
        st.update_run(rid, supervisor_pid=os.getpid(), host=this_host())
        if run["status"] == "stopping":  # stopped between dispatch and now
            st.lifecycle(rid).end("stopped", event=("stop", "stopped before the trainer started"))
            _log(self.log_path, "stopped before the trainer started")
            dispatch(st)
            return 0
        if run["status"] != "queued":
            _log(self.log_path, f"supervisor: run is {run['status']}, not queued; nothing to do")
            return 0

        resume = bool(run["resume_pending"]) and bool(checkpoint_steps(st.run_dir(rid)))
        cmd = trainer_command(st, run, resume)
        recorded = recorded_env(st.run_dir(rid))
        if resume and recorded is not None:
            here = run_env()
            differ = sorted(k for k in set(recorded) | set(here) if recorded.get(k) != here.get(k))
            if differ:
                _log(self.log_path, "resume: with the launch environment (differs here in "
                     f"{', '.join(differ)})")
        attempt = int(run["attempt"] or 0) + 1
        _log(self.log_path, f"attempt {attempt} on {this_host()}: {shlex.join(cmd)}")
        with open(self.log_path, "ab") as log:
            offset = log.tell()
            try:
                self.proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=child_env(run["gpus"], recorded_env(st.run_dir(rid))),
                    start_new_session=True,  # own process group: signals reach only it
                    close_fds=True,
                )
            except OSError as e:
                st.lifecycle(rid).end("failed", f"launch: cannot start the trainer: {e}")
                dispatch(st)
                return 1
        proc = self.proc
        self.attempt = attempt
        st.update_run(
            rid,
            pid=proc.pid,
            pid_started=process_start_time(proc.pid),
            attempt=attempt,
            resume_pending=0,
            heartbeat_at=time.time(),
            exit_code=None,
        )
        st.lifecycle(rid).start()
        note = " (resume)" if resume else ""
        st.log_event(rid, "start", f"attempt {attempt}: trainer pid {proc.pid}{note}")

        rc = self._watch(proc)
        try:
            self._finalize(rc, offset)
            dispatch(st)
        except StoreError as e:  # a damaged store: the run folder keeps the record
            _log(self.log_path, f"trainer exited (code {rc}); the store could not record it "
                 f"({e})")
        return 0

    def _watch(self, proc: subprocess.Popen[bytes]) -> int:
        st, rid = self.store, self.run_id
        last_status = last_beat = 0.0
        while True:
            try:
                return proc.wait(timeout=POLL_S)
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            try:
                if self.self_stop:
                    self.self_stop = False
                    st.lifecycle(rid).request_stop(time.time() + DEFAULT_STOP_TIMEOUT)
                if now - last_status >= STATUS_EVERY_S:
                    last_status = now
                    run = st.get_run(rid)
                    if run is not None and run["status"] == "stopping":
                        if not self.stop_signal_sent:
                            self.stop_signal_sent = True
                            _log(self.log_path, "stop requested: SIGTERM to the trainer")
                            send_stop_signal(proc.pid, int(run["nproc"] or 1))
                        deadline = run["stop_deadline"]
                        if deadline is not None and time.time() > deadline and not self.killed:
                            self.killed = True
                            _log(self.log_path, "stop timed out: SIGKILL to the trainer")
                            signal_group(proc.pid, signal.SIGKILL)
                if now - last_beat >= HEARTBEAT_EVERY_S:
                    last_beat = now
                    st.heartbeat(rid)
            except StoreError as e:  # keep supervising through a transient store problem
                print(f"supervisor: store error: {e}", file=sys.stderr)

    def _finalize(self, rc: int, offset: int) -> None:
        st, rid = self.store, self.run_id
        assert self.proc is not None
        signal_group(self.proc.pid, signal.SIGKILL)  # leftovers (workers, data loaders)
        run = st.get_run(rid)
        assert run is not None
        how = f"code {rc}" if rc >= 0 else _signame(rc)
        mine = {"attempt": self.attempt, "pid": self.proc.pid}
        if any(run[k] != v for k, v in mine.items()):
            _log(self.log_path, f"trainer exited ({how}); the run has moved on")
            return
        if run["status"] in FINAL_STATUSES:
            st.update_run(rid, exit_code=rc)  # same attempt and pid: checked above
            _log(self.log_path, f"trainer exited ({how}); status {run['status']}")
            return
        text = _read_since(self.log_path, offset)
        tail = "\n".join(text.splitlines()[-40:])
        tb = extract_traceback(text)
        status, error, event = "crashed", "", ""
        if run["status"] == "stopping":
            if self.killed:
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
            error = tb or "\n".join(ln for ln in tail.splitlines()[-10:] if ln.strip())
            error = error or f"the trainer exited with {how}"
        else:
            error = f"crashed: the trainer exited ({how}) without a final status"
        if error and status == "crashed" and tail:
            error += f"; last log lines:\n{tail}"
        kind = "stop" if status == "stopped" else "crash"
        st.lifecycle(rid).end(status, error, where=mine, exit_code=rc,
                              event=(kind, event or (error or "").split("\n")[0]))
        _log(self.log_path, f"trainer exited ({how}); status {status}")


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
        try:
            if sup.proc is None:
                store.lifecycle(args.run_id).end(
                    "failed", f"supervisor failed before starting the trainer:\n{tb}")
        except Exception:
            pass
        return 1


if __name__ == "__main__":
    sys.exit(main())
