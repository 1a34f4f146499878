"""Launcher end to end against the real trainer (``comera train``) on the digits TT-MLP.

Crash (kill -9) → crashed with the log tail, metrics intact, resume as the same run,
graceful stop with a checkpoint, crash detection without a supervisor, a queue with a
concurrency limit, failures, and the ``launch/runs/logs/stop/resume`` commands.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from comera_engine.errors import ConfigError
from comera_engine.launch import (
    LaunchError,
    checkpoint_steps,
    child_env,
    launch,
    logs,
    reap,
    resolve_config,
    resume,
    stop,
)
from comera_engine.launch.liveness import (
    pid_alive,
    process_start_time,
    this_host,
    this_process,
)
from comera_engine.launch.supervisor import trainer_command
from comera_engine.metrics import read_jsonl
from comera_engine.store import FINAL_STATUSES, RunStore

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "experiments" / "configs" / "digits_tt_mlp.toml"
#: every step logs metrics; no eval until the end; the kill test needs a long run
LONG = ["train.steps=100000", "train.eval_every=0", "train.ckpt_every=15"]
SHORT = ["train.steps=25", "train.eval_every=0", "train.ckpt_every=0"]
START_TIMEOUT = 90.0  # a trainer imports torch and builds its data first


def wait_for(pred: Callable[[], Any], timeout: float, what: str, every: float = 0.05) -> Any:
    t0 = time.time()
    while True:
        value = pred()
        if value:
            if os.environ.get("COMERA_TEST_TIMING"):
                print(f"[{time.strftime('%H:%M:%S')}] {what}: {time.time() - t0:.1f} s",
                      file=sys.__stderr__)
            return value
        if time.time() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(every)


@pytest.fixture()
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[RunStore]:
    monkeypatch.chdir(tmp_path)
    st = RunStore(tmp_path / "store" / "comera.db")
    yield st
    # never leave processes behind: kill what this test's runs started
    for run in st.list_runs():
        for pid in (run["pid"], run["supervisor_pid"]):
            if pid and pid_alive(pid):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except OSError:
                    pass


def _status(st: RunStore, rid: str) -> str:
    return st.get_run(rid)["status"]


def _steps(st: RunStore, rid: str, name: str = "loss/task") -> list[int]:
    return [r["step"] for r in st.metrics_since(rid, -1, names=[name])]


# ------------------------------------------------------------------------------ no processes


def test_invalid_config_fails_at_once_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    db = tmp_path / "store" / "comera.db"
    with pytest.raises(ConfigError, match=r"^train\.stepz: unknown key \(did you mean"):
        launch(CONFIG, ["train.stepz=3"], store=db)
    assert not (tmp_path / "store").exists()  # not even the database
    st = RunStore(db)
    with pytest.raises(ConfigError, match="^train.steps"):
        launch(CONFIG, ["train.steps=-1"], store=st)
    with pytest.raises(ConfigError, match="^gpus"):
        launch(CONFIG, gpus="0,x", store=st)
    with pytest.raises(ConfigError, match="^nproc"):
        launch(CONFIG, nproc=4, gpus="0,1", store=st)
    with pytest.raises(ConfigError, match="^config"):
        launch(tmp_path / "missing.toml", store=st)
    assert st.list_runs() == []
    assert sorted(p.name for p in (tmp_path / "store").iterdir() if p.is_dir()) == []

    from comera_engine.cli import main

    assert main(["launch", str(CONFIG), "--set", "model.name=resnet", "--store", str(db)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("comera: error: model.name: unknown value 'resnet'")
    assert st.list_runs() == []


def test_launch_environment_is_recorded_without_credentials(monkeypatch):
    from comera_engine.launch import child_env, run_env

    monkeypatch.setenv("COMERA_NATIVE", "0")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    monkeypatch.setenv("UNRELATED_VAR", "x")
    got = run_env()
    assert got["COMERA_NATIVE"] == "0" and got["OMP_NUM_THREADS"] == "3"
    assert "HF_TOKEN" not in got and "UNRELATED_VAR" not in got
    recorded = {"COMERA_NATIVE": "1", "MKL_NUM_THREADS": "1"}
    env = child_env("2", recorded)  # the resumer's own run-shaping variables give way
    assert env["COMERA_NATIVE"] == "1" and env["MKL_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in env and env["UNRELATED_VAR"] == "x"
    assert env["CUDA_VISIBLE_DEVICES"] == "2" and env["PYTHONUNBUFFERED"] == "1"


def test_trainer_command_gpus_and_torchrun(tmp_path):
    st = RunStore(tmp_path / "comera.db")
    rid = st.create_run("r", {}, gpus="1,2", nproc=2)
    run = st.get_run(rid)
    cmd = trainer_command(st, run, resume=True)
    assert cmd[:5] == [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
    ]
    assert cmd[5:] == [
        "-m", "comera_engine.cli", "train", str(st.run_dir(rid) / "config.toml"),
        "--store", str(st.path), "--run-id", rid, "--resume",
    ]
    single = trainer_command(st, {**run, "nproc": 1}, resume=False)
    assert single[:4] == [sys.executable, "-m", "comera_engine.cli", "train"]
    assert "--resume" not in single
    env = child_env("1,2")
    assert env["CUDA_VISIBLE_DEVICES"] == "1,2" and env["PYTHONUNBUFFERED"] == "1"
    assert str(ROOT) in env["PYTHONPATH"].split(os.pathsep)
    if "CUDA_VISIBLE_DEVICES" not in os.environ:
        assert "CUDA_VISIBLE_DEVICES" not in child_env(None)


def test_resolve_config_from_a_dict_applies_overrides():
    import tomllib

    raw = tomllib.loads(CONFIG.read_text())
    cfg = resolve_config(raw, ["train.steps=7", "name=other"])
    assert cfg.train.steps == 7 and cfg.name == "other"
    assert raw["train"]["steps"] == 600  # the caller's dict is not modified
    with pytest.raises(ConfigError, match="^comera.tau"):
        resolve_config(raw, ["comera.tau=2.0"])


# ------------------------------------------------------------------------------ reaping
# (stores whose runs hold made-up pids: never the `store` fixture, which kills run pids)


@pytest.fixture()
def bare_store(tmp_path: Path) -> RunStore:
    return RunStore(tmp_path / "comera.db")


def test_reap_marks_a_dead_pid_on_this_host_with_its_log_tail(bare_store):
    rid = bare_store.create_run("r", {}, status="running")
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    bare_store.update_run(rid, pid=p.pid, host=this_host(), heartbeat_at=time.time())
    bare_store.run_dir(rid).mkdir()
    bare_store.log_path(rid).write_text("step 10\nRuntimeError: CUDA out of memory\n")
    alive = bare_store.create_run("alive", {}, status="running")
    bare_store.update_run(alive, pid=os.getpid(), host=this_host(), heartbeat_at=time.time() - 99)
    assert reap(bare_store) == [rid]
    run = bare_store.get_run(rid)
    assert run["status"] == "crashed" and "CUDA out of memory" in run["error"]
    assert bare_store.get_run(alive)["status"] == "running"  # a live pid on this host is trusted
    assert [e["kind"] for e in bare_store.events(rid)] == ["crash"]
    assert reap(bare_store) == []


def test_reap_uses_the_heartbeat_for_other_hosts(bare_store):
    old = bare_store.create_run("old", {}, status="running")
    fresh = bare_store.create_run("fresh", {}, status="stopping")
    bare_store.update_run(old, host="elsewhere", pid=1, heartbeat_at=time.time() - 11)
    bare_store.update_run(fresh, host="elsewhere", pid=1, heartbeat_at=time.time() - 1)
    assert reap(bare_store) == [old]
    assert bare_store.get_run(old)["status"] == "crashed"
    assert "heartbeat" in bare_store.get_run(old)["error"]
    assert bare_store.get_run(fresh)["status"] == "stopping"


def test_this_process_identifies_this_process_and_not_a_reused_pid():
    import psutil

    me = this_process()
    assert me["pid"] == os.getpid() and me["host"] == this_host()
    assert me["pid_started"] == pytest.approx(psutil.Process().create_time(), abs=1e-3)
    assert pid_alive(me["pid"], me["pid_started"])
    assert not pid_alive(me["pid"], me["pid_started"] - 60)  # same pid, another process
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert not pid_alive(p.pid) and process_start_time(p.pid) is None


def test_resume_and_stop_refuse_wrong_states(store):
    rid = store.create_run("r", {}, status="finished")
    with pytest.raises(LaunchError, match="only stopped, crashed or failed"):
        resume(rid, store=store)
    assert stop(rid, store=store) == "finished"
    other = store.create_run("remote", {}, status="running")
    store.update_run(other, host="elsewhere", heartbeat_at=time.time())
    with pytest.raises(LaunchError, match="elsewhere"):
        stop(other, store=store)


# ------------------------------------------------------------------------------ real trainer


def _trainer_env(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(kv.decode().split("=", 1) for kv in raw if b"=" in kv)


def test_kill9_crash_then_resume_stop_and_reap(store, monkeypatch):
    """kill -9 mid-run → crashed (metrics up to the kill kept) → resume as the same run →
    graceful stop with a checkpoint → resume → both processes killed → reap → crashed.
    The resumed trainer runs with the launch environment, not the resumer's."""
    st = store
    monkeypatch.setenv("COMERA_RUN_MARK", "launched")
    rid = launch(CONFIG, LONG, store=st, name="kill-test")
    monkeypatch.setenv("COMERA_RUN_MARK", "resumer")
    monkeypatch.setenv("OMP_SCHEDULE", "set-by-the-resumer")
    run_dir = st.run_dir(rid)
    assert (run_dir / "config.toml").is_file()
    assert _status(st, rid) in ("queued", "running")

    # --- attempt 1: wait for a checkpoint and steps after it, then kill -9 the trainer
    wait_for(lambda: checkpoint_steps(run_dir), START_TIMEOUT, "a first checkpoint")
    ckpt1 = checkpoint_steps(run_dir)[-1]
    wait_for(lambda: (st.get_run(rid)["last_step"] or 0) > ckpt1 + 3, 30, "steps past it")
    run = st.get_run(rid)
    assert run["status"] == "running" and run["attempt"] == 1
    sup1 = run["supervisor_pid"]
    assert pid_alive(run["pid"]) and pid_alive(sup1)

    def fresh() -> bool:  # kill while the trainer is visibly writing
        rows = st.metrics_since(rid, (st.get_run(rid)["last_step"] or 0) - 1, names=["loss/task"])
        return bool(rows) and rows[-1]["time"] > time.time() - 0.4

    def trained_for(seconds: float) -> bool:
        first = st.metrics_since(rid, -1, names=["loss/task"], limit=1)
        return bool(first) and first[0]["time"] < time.time() - seconds

    wait_for(lambda: trained_for(1.5), 30, "1.5 s of training")  # so 'up to 1 s before' has rows
    wait_for(fresh, 30, "a fresh flush")
    t_kill = time.time()
    os.kill(run["pid"], signal.SIGKILL)
    wait_for(lambda: _status(st, rid) == "crashed", 10, "status crashed within 10 s")
    assert time.time() - t_kill < 10
    run = st.get_run(rid)
    assert "SIGKILL" in run["error"] and "last log lines" in run["error"]
    assert run["exit_code"] == -signal.SIGKILL

    # metrics up to 1 s before the kill are present: steps contiguous from the first one,
    # the last stored step was logged less than 1 s before the kill, and every metric the
    # JSONL witness file recorded earlier than that is in the store too
    steps1 = _steps(st, rid)
    assert steps1 == list(range(steps1[0], steps1[-1] + 1)) and steps1[-1] > ckpt1
    last_time = st.metrics_since(rid, steps1[-1] - 1, names=["loss/task"])[-1]["time"]
    assert last_time >= t_kill - 1.0
    stored = {(r["step"], r["name"]) for r in st.metrics_since(rid)}
    witness = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["type"] == "metrics"]
    early = {(r["step"], k) for r in witness if r["t"] <= t_kill - 1.0 for k in r["values"]}
    assert early and early <= stored
    ckpt_crash = checkpoint_steps(run_dir)[-1]

    # --- attempt 2: resume as the same run, continue from the checkpoint, stop gracefully
    t_resume = time.time()
    assert resume(rid, store=st) == rid
    assert _status(st, rid) in ("queued", "running")

    def resumed_steps() -> list[dict]:
        rows = st.metrics_since(rid, ckpt_crash, names=["loss/task"])
        return [r for r in rows if r["time"] > t_resume]

    wait_for(lambda: len(resumed_steps()) > 3, START_TIMEOUT, "steps after the resume")
    env = _trainer_env(st.get_run(rid)["pid"])
    assert env["COMERA_RUN_MARK"] == "launched" and "OMP_SCHEDULE" not in env
    assert "resume: with the launch environment" in logs(rid, store=st)
    assert resumed_steps()[0]["step"] == ckpt_crash + 1  # step numbers continue
    resumed = [e for e in st.events(rid) if e["text"].startswith("resumed from")]
    assert resumed and resumed[-1]["step"] == ckpt_crash
    assert stop(rid, store=st, timeout=60) == "stopped"
    run = st.get_run(rid)
    assert run["status"] == "stopped" and run["error"] is None and run["attempt"] == 2
    stop_ckpt = checkpoint_steps(run_dir)[-1]
    assert stop_ckpt == run["last_step"] > ckpt_crash
    assert any(e["kind"] == "checkpoint" and e["step"] == stop_ckpt for e in st.events(rid))
    assert not pid_alive(run["pid"])

    # step numbers continue: one row per (step, name); attempt 1's rows up to the crash
    # checkpoint, then attempt 2's. (Steps between the last flush and a checkpoint written
    # just before the kill would be a gap: lost with the last half second, never redone.)
    rows = st.metrics_since(rid, -1, names=["loss/task"])
    steps = [r["step"] for r in rows]
    kept = range(steps1[0], min(steps1[-1], ckpt_crash) + 1)
    assert steps == [*kept, *range(ckpt_crash + 1, stop_ckpt + 1)]
    assert all(r["time"] > t_resume for r in rows if r["step"] > ckpt_crash)
    assert all(r["time"] < t_resume for r in rows if r["step"] <= ckpt_crash)

    # --- attempt 3: kill the supervisor and the trainer; reap() (what `comera runs` and
    # the dashboard call) finds the run dead and marks it crashed with its log tail
    resume(rid, store=st)
    wait_for(lambda: (st.get_run(rid)["last_step"] or 0) > stop_ckpt + 2, START_TIMEOUT,
             "steps of attempt 3")
    run = st.get_run(rid)
    assert run["attempt"] == 3 and run["supervisor_pid"] != sup1
    os.kill(run["supervisor_pid"], signal.SIGKILL)
    os.kill(run["pid"], signal.SIGKILL)
    t_kill = time.time()
    wait_for(lambda: rid in reap(st), 10, "reap to mark the run crashed")
    assert time.time() - t_kill < 10
    run = st.get_run(rid)
    assert run["status"] == "crashed" and "process is gone" in run["error"]
    assert "last log lines" in run["error"]
    assert "attempt 3" in logs(rid, store=st)


def test_queue_limit_concurrent_runs_torchrun_failures_and_cli(store, capsys):
    st = store
    from comera_engine.cli import main

    a = launch(CONFIG, SHORT, store=st, name="a", max_concurrent=2)
    b = launch(CONFIG, SHORT, store=st, name="b", nproc=2)  # two processes via torchrun
    c = launch(CONFIG, SHORT, store=st, name="c")
    d = launch(CONFIG, SHORT, store=st, name="d")
    assert st.get_run(c)["status"] == "queued" and st.get_run(c)["dispatched_at"] is None
    assert main(["stop", d, "--store", str(st.path)]) == 0  # queued: stopped at once
    assert capsys.readouterr().out.strip() == f"{d}: stopped"
    assert st.get_run(d)["status"] == "stopped" and st.get_run(d)["pid"] is None

    most = 0
    t0 = time.time()
    while not all(st.get_run(r)["exit_code"] is not None for r in (a, b, c)):
        active = [r for r in st.list_runs() if r["status"] in ("running", "stopping")]
        most = max(most, len(active))
        assert time.time() - t0 < 3 * START_TIMEOUT, "runs did not finish"
        time.sleep(0.05)
    assert most == 2  # two at once, never three
    ra, rb, rc = (st.get_run(r) for r in (a, b, c))
    assert [r["status"] for r in (ra, rb, rc)] == ["finished"] * 3
    assert rc["started_at"] >= min(ra["ended_at"], rb["ended_at"]) - 0.5
    log_b = logs(b, store=st)
    # the attempt line names no server path outside the run store (the dashboard shows it)
    assert (f": python -m torch.distributed.run --standalone --nproc_per_node=2 -m "
            f"comera_engine.cli train {b}/config.toml --store {st.path.name} ") in log_b
    assert sys.executable not in log_b and "world 2" in log_b
    for r in (ra, rb, rc):
        assert r["exit_code"] == 0 and r["last_step"] == 25
        # the store holds exactly what the trainer logged (JSONL written alongside)
        witness = [x for x in read_jsonl(st.run_dir(r["id"]) / "metrics.jsonl")
                   if x["type"] == "metrics"]
        assert st.count_metrics(r["id"]) == sum(len(x["values"]) for x in witness)
        assert _steps(st, r["id"]) == list(range(1, 26))
        assert any(x["kind"] == "checkpoint" for x in st.artifacts(r["id"]))

    # an unknown dataset is refused before a run exists (the registry knows the names)
    with pytest.raises(ConfigError, match="^data.name: unknown dataset 'nope'"):
        launch(CONFIG, [*SHORT, "data.name=nope"], store=st, name="refused")
    # so is a split fraction outside (0, 1)
    with pytest.raises(ConfigError, match="^data.split_fraction: must be a fraction"):
        launch(CONFIG, [*SHORT, "data.split_fraction=2"], store=st, name="refused")
    # so is a number out of its bound (issue 48)
    with pytest.raises(ConfigError, match=r"^data.seed: must be an integer >= 0, got -1 "):
        launch(CONFIG, [*SHORT, "data.seed=-1"], store=st, name="refused")
    # a run whose data cannot be built (a value only the builder checks: its type) fails
    # with the trainer's one-line error
    bad = launch(CONFIG, [*SHORT, 'data.seed="x"'], store=st, name="bad")
    wait_for(lambda: st.get_run(bad)["status"] in FINAL_STATUSES, START_TIMEOUT, "bad to end")
    run = st.get_run(bad)
    assert run["status"] == "failed" and "data.seed" in run["error"]
    assert run["exit_code"] == 2

    # the commands
    assert main(["runs", "--json", "--store", str(st.path)]) == 0
    listed = {r["id"]: r["status"] for r in json.loads(capsys.readouterr().out)}
    assert listed == {a: "finished", b: "finished", c: "finished", d: "stopped", bad: "failed"}
    assert main(["runs", "--store", str(st.path), "--status", "failed"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["ID", "NAME", "STATUS"] and len(out) == 2 and bad in out[1]
    assert main(["logs", a, "-n", "3", "--store", str(st.path)]) == 0
    tail = capsys.readouterr().out.splitlines()
    assert len(tail) == 3 and "status finished" in tail[-1]
    assert main(["logs", a, "-f", "--store", str(st.path)]) == 0  # a finished run: returns
    assert "finished at step 25" in capsys.readouterr().out
    assert main(["resume", a, "--store", str(st.path)]) == 2
    assert "only stopped, crashed or failed" in capsys.readouterr().err
    assert main(["runs", "--store", str(st.path.parent / "nothing")]) == 0
    assert "no runs" in capsys.readouterr().out


class _FakeExecutor:
    """An executor whose trainers end when the test says (no process)."""

    force_after = 0.0
    start_error = "fake: cannot start"

    def __init__(self) -> None:
        self.done: dict[str, int] = {}  # run id -> exit code, once it ended
        self.cancels: list[tuple[str, bool]] = []
        self.lines: list[str] = []

    def submit(self, run: Any, attempt: int) -> tuple[Any, dict[str, Any]]:
        if run["name"] == "broken":
            raise OSError("no such file")
        return run["id"], {"pid": 4242}

    def started(self, slot: Any) -> str:
        return f"attempt {slot.attempt}"

    def wait(self, slots: list[Any], timeout: float) -> list[Any]:
        return [s for s in slots if s.run_id in self.done]

    def cancel(self, slot: Any, force: bool) -> None:
        self.cancels.append((slot.run_id, force))
        if force:
            self.done[slot.run_id] = -9

    def outcome(self, slot: Any, run: Any) -> Any:
        from comera_engine.launch.scheduler import Outcome

        code = slot.exit_code = self.done[slot.run_id]
        status = "stopped" if run["status"] == "stopping" else "crashed"
        return Outcome(status, None if status == "stopped" else "gone", code, ("end", status))

    def ended(self, slot: Any, note: str) -> None:
        self.lines.append(f"{slot.run_id}: {note}")

    def say(self, text: str) -> None:
        self.lines.append(text)


def test_the_scheduler_queues_limits_stops_forces_and_records_ends(tmp_path: Path) -> None:
    """The scheduler both executors share, with a fake executor: at most the limit in
    flight, a failed submit recorded, a stop cancelled then forced past its deadline,
    ends recorded once through the lifecycle, a run that moved on left alone."""
    from comera_engine.launch.scheduler import Scheduler

    st = RunStore(tmp_path)
    a, b, c = (st.create_run(n, {}) for n in ("a", "b", "c"))
    broken = st.create_run("broken", {})
    ex = _FakeExecutor()
    sched = Scheduler(st, ex, lambda: (st.get_run(r) if (r := st.claim_queued(2)) else None),
                      poll=0.01, stop_timeout=0.0)
    sched.tick()
    assert set(sched.inflight) == {a, b}  # the limit
    assert {st.get_run(r)["status"] for r in (a, b)} == {"running"}
    assert st.get_run(a)["pid"] == 4242 and st.get_run(a)["attempt"] == 1
    ex.done[a] = 0
    sched.tick()  # a ends (crashed: no final status)
    assert st.get_run(a)["status"] == "crashed" and st.get_run(a)["exit_code"] == 0
    sched.tick()  # c starts in its slot
    assert set(sched.inflight) == {b, c}
    st.lifecycle(b).request_stop(time.time() - 1)  # past its deadline already
    sched.tick()
    assert (b, False) in ex.cancels
    sched.tick()
    assert (b, True) in ex.cancels  # forced, and its end recorded
    assert st.get_run(b)["status"] == "stopped"
    st.update_run(c, attempt=7)  # another attempt took it over
    ex.done[c] = 1
    sched.tick()  # the broken run could not start
    assert st.get_run(c)["status"] == "running" and f"{c}: the run has moved on" in ex.lines
    run = st.get_run(broken)
    assert run["status"] == "failed" and run["error"] == "fake: cannot start: no such file"
    assert not sched.inflight and not sched.tick()
    assert [e["kind"] for e in st.events(a)] == ["start", "end"]
