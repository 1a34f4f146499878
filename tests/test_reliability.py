"""Issue 21, items 1 and 2: one writer per run, checkpoints that survive damage.

Unit tests of the run-folder lock, the owner token and the checkpoint checks, then the
issue's cases end to end against the real trainer on the digits TT-MLP: a second
``comera train --resume`` (same folder or another), ``comera resume`` and two
``comera train --resume --run-dir X`` at once are refused while the live trainer keeps
every row; a truncated newest checkpoint is skipped with one logged line and the run
(left ``failed`` by it) resumes and finishes; only damaged checkpoints give one line,
exit 2, nothing changed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from comera_engine.cli import main
from comera_engine.errors import ConfigError
from comera_engine.launch import child_env, launch, stop
from comera_engine.launch.liveness import process_start_time, this_process
from comera_engine.launch.owner import RunBusyError, RunLock, claim_run, lock_holder
from comera_engine.metrics import read_jsonl
from comera_engine.store import RunStore, StoreSink
from comera_engine.store.layout import checkpoint_problem, resume_point
from comera_engine.train import checkpoint as ckpt
from tests.test_cli import DIGITS  # a two-step dense digits run
from tests.test_launch import CONFIG, START_TIMEOUT, _status, _steps, store, wait_for

__all__ = ["store"]  # the fixture, shared with test_launch

CLI = [sys.executable, "-m", "comera_engine.cli"]


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def _token(pid: int) -> dict:
    return {"pid": pid, "pid_started": process_start_time(pid), "host": this_process()["host"]}


def _one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


# ------------------------------------------------------------------------- one writer


def test_run_lock_is_exclusive_and_the_os_drops_it_on_kill9(tmp_path: Path) -> None:
    code = (
        "import sys, time; from comera_engine.launch.owner import RunLock; "
        f"RunLock({str(tmp_path)!r}).acquire(); print('held', flush=True); time.sleep(60)"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                             env=child_env())
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"held"
        assert lock_holder(tmp_path)["pid"] == child.pid
        with pytest.raises(RunBusyError, match=rf"^run: .* in use by pid {child.pid} "):
            RunLock(tmp_path).acquire()
    finally:
        child.kill()
        child.wait()
    assert lock_holder(tmp_path) is None  # released by the OS, no cleanup ran
    with RunLock(tmp_path) as lock:
        assert lock.held and lock_holder(tmp_path)["pid"] == os.getpid()
        with pytest.raises(RunBusyError):  # another open file, same process: refused too
            RunLock(tmp_path).acquire()
    assert lock_holder(tmp_path) is None


def test_claim_run_refuses_a_live_owner_and_takes_over_a_dead_one(tmp_path: Path) -> None:
    st = RunStore(tmp_path / "comera.db")
    rid = st.create_run("r", {}, status="running")
    other = _sleeper()
    try:
        st.update_run(rid, **_token(other.pid))
        before = st.get_run(rid)
        with pytest.raises(RunBusyError, match=rf"^run: {rid} is running and owned by pid "):
            claim_run(st, rid)
        assert st.get_run(rid) == before  # nothing changed
    finally:
        other.kill()
        other.wait()
    mine = claim_run(st, rid)  # its owner is gone
    assert mine["pid"] == os.getpid()
    assert {k: st.get_run(rid)[k] for k in mine} == mine
    assert claim_run(st, rid) == mine  # the owner again: kept
    # the supervisor records the trainer's parent (torchrun): a child keeps that token
    parent = _token(os.getppid())
    st.update_run(rid, **parent)
    assert claim_run(st, rid) == parent and st.get_run(rid)["pid"] == os.getppid()


def test_every_sink_write_checks_the_owner(tmp_path: Path, capsys) -> None:
    st = RunStore(tmp_path / "comera.db")
    rid = st.create_run("r", {})
    owner = claim_run(st, rid)
    sink = StoreSink(st, rid, flush_every=60, owner=owner)
    sink.set_status("running")
    sink.log_metrics(1, {"loss": 1.0})
    sink.flush()
    assert _steps(st, rid, "loss") == [1] and _status(st, rid) == "running"
    other = _sleeper()
    try:
        st.update_run(rid, **_token(other.pid))  # another process took the run
        sink.log_metrics(2, {"loss": 2.0})
        sink.set_status("running")  # `running` after `running`: checked, not applied
        sink.set_status("stopped")
        sink.close()
    finally:
        other.kill()
        other.wait()
    assert sink.owner_lost
    assert _steps(st, rid, "loss") == [1] and _status(st, rid) == "running"
    assert st.get_run(rid)["pid"] == other.pid
    assert "now owned by pid" in capsys.readouterr().err


# ------------------------------------------------------------------------- checkpoints


def _save(folder: Path, step: int, reason: str = "periodic", keep: int = ckpt.DEFAULT_KEEP):
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return ckpt.save_checkpoint(folder, step, model, opt, {"reason": reason}, keep=keep)


def test_checkpoints_are_fsynced_and_pruned_to_k_plus_the_stage_one(tmp_path, monkeypatch):
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    folder = tmp_path / "checkpoints"
    _save(folder, 1)
    # tensors, the folder, the sidecar, the folder: each before the next step counts
    assert [Path(p).name for p in synced] == [
        "step_000001.safetensors.tmp", "checkpoints", "step_000001.json.tmp", "checkpoints",
    ]
    assert ckpt.DEFAULT_KEEP == 2
    _save(folder, 2, reason="stage")
    for step in (3, 4, 5):
        _save(folder, step)
    assert [s for s, _ in ckpt.list_checkpoints(folder)] == [2, 4, 5]  # K = 2 + stage
    assert sorted(p.name for p in folder.iterdir()) == [
        f"step_00000{s}.{ext}" for s in (2, 4, 5) for ext in ("json", "safetensors")
    ]


def test_damage_is_detected_and_resume_falls_back_to_the_newest_good(tmp_path):
    folder = tmp_path / "checkpoints"
    for step in (10, 20, 30):
        _save(folder, step, keep=5)
    paths = {s: p for s, p in ckpt.list_checkpoints(folder)}
    assert all(checkpoint_problem(p) is None for p in paths.values())
    assert resume_point(folder) == (paths[30], None)

    tensors = paths[30].with_suffix(".safetensors")
    tensors.write_bytes(tensors.read_bytes()[:-7])  # truncated
    assert "truncated" in checkpoint_problem(paths[30])
    start, note = resume_point(folder)
    assert start == paths[20]
    assert note.startswith("resume: skipped damaged step_000030") and "\n" not in note
    assert note.endswith("resuming from step_000020")

    meta = json.loads(paths[20].read_text())  # a tensor the sidecar needs has another shape
    meta["shapes"]["weight"] = [9, 9]
    paths[20].write_text(json.dumps(meta))
    assert "model/weight has the wrong shape" in checkpoint_problem(paths[20])
    paths[10].with_suffix(".safetensors").write_bytes(b"\x00" * 5)
    assert "shorter than a safetensors header" in checkpoint_problem(paths[10])
    with pytest.raises(ConfigError, match=r"^--resume: no usable checkpoint in .*step_000010"):
        resume_point(folder)
    assert resume_point(tmp_path / "none") == (None, None)


def test_train_resume_with_only_damaged_checkpoints_is_one_line_exit_2(tmp_path, capsys):
    run_dir = tmp_path / "run"
    folder = run_dir / "checkpoints"
    _save(folder, 4)
    folder.joinpath("step_000004.safetensors").write_bytes(b"junk")
    cfg = run_dir / "config.toml"
    cfg.write_text(DIGITS)
    before = sorted(p.name for p in run_dir.rglob("*"))
    assert main(["train", str(cfg), "--resume", "--no-progress"]) == 2
    assert _one_line(capsys.readouterr().err).startswith(
        "comera: error: --resume: no usable checkpoint in"
    )
    assert sorted(p.name for p in run_dir.rglob("*")) == before  # nothing written


# ------------------------------------------------------------------------- end to end


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=child_env(),
                          timeout=timeout)


def test_a_second_writer_is_refused_while_the_first_keeps_every_row(store, tmp_path):
    rid = launch(CONFIG, ["train.steps=100000", "train.eval_every=0", "train.ckpt_every=0"],
                 store=store)
    run_dir = store.run_dir(rid)
    jsonl = run_dir / "metrics.jsonl"
    wait_for(lambda: len(_steps(store, rid)) >= 5, START_TIMEOUT, "first steps")
    inode = jsonl.stat().st_ino
    config_text = (run_dir / "config.toml").read_text()
    db = str(store.path)
    seen = len(_steps(store, rid))

    # the command: the same folder (its lock refuses it)
    same = _cli("train", str(run_dir / "config.toml"), "--store", db, "--run-id", rid,
                "--resume", "--no-progress")
    assert same.returncode == 2
    assert "is in use by pid" in _one_line(same.stderr)
    # the same run from another folder (the owner token refuses it)
    (tmp_path / "x").mkdir()
    other = _cli("train", str(run_dir / "config.toml"), "--run-dir", str(tmp_path / "x"),
                 "--store", db, "--run-id", rid, "--resume", "--no-progress")
    assert other.returncode == 2
    assert f"{rid} is running and owned by pid" in _one_line(other.stderr)
    assert not (tmp_path / "x" / "metrics.jsonl").exists()
    # a resume of the live run
    again = _cli("resume", rid, "--store", db)
    assert again.returncode == 2 and "is running" in _one_line(again.stderr)

    assert _status(store, rid) == "running"
    wait_for(lambda: len(_steps(store, rid)) > seen + 20, 60, "training goes on")
    assert stop(rid, store=store) == "stopped"
    steps = _steps(store, rid)
    assert steps == list(range(1, steps[-1] + 1))  # no row lost, none twice
    assert jsonl.stat().st_ino == inode  # metrics.jsonl is still the file it wrote
    assert [r["step"] for r in read_jsonl(jsonl) if r.get("type") == "metrics"] == steps
    assert (run_dir / "config.toml").read_text() == config_text
    assert store.get_run(rid)["pid"] is not None


def test_two_trainers_on_one_folder_at_once_one_wins(tmp_path):
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(CONFIG.read_text())
    run_dir = tmp_path / "run"
    cmd = [*CLI, "train", str(cfg), "--run-dir", str(run_dir), "--resume", "--no-progress",
           "--set", "train.steps=100000", "--set", "train.eval_every=0",
           "--set", "train.ckpt_every=0"]
    run_dir.mkdir()
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=child_env()) for _ in range(2)]
    try:
        loser = wait_for(lambda: next((p for p in procs if p.poll() is not None), None),
                         START_TIMEOUT, "one trainer refused")
        winner = procs[1 - procs.index(loser)]
        assert loser.returncode == 2
        assert "is in use by pid" in _one_line(loser.communicate()[1])
        assert lock_holder(run_dir)["pid"] == winner.pid
        wait_for(lambda: (run_dir / "metrics.jsonl").exists(), 60, "the winner trains")
        winner.send_signal(signal.SIGTERM)  # graceful stop: checkpoint, exit 0
        assert winner.wait(timeout=60) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("type") == "metrics"]
    assert steps == list(range(1, steps[-1] + 1))
    assert lock_holder(run_dir) is None


def test_a_truncated_newest_checkpoint_is_skipped_and_the_failed_run_resumes(store, tmp_path):
    rid = launch(CONFIG, ["train.steps=400", "train.eval_every=0", "train.ckpt_every=10"],
                 store=store)
    folder = store.run_dir(rid) / "checkpoints"
    wait_for(lambda: len(ckpt.list_checkpoints(folder)) >= 2, START_TIMEOUT, "two checkpoints")
    assert stop(rid, store=store) == "stopped"
    found = ckpt.list_checkpoints(folder)
    (newest, meta), (previous, _) = found[-1], found[-2]
    tensors = meta.with_suffix(".safetensors")
    tensors.write_bytes(tensors.read_bytes()[: tensors.stat().st_size // 2])
    # the state the issue left it in: failed on the damaged checkpoint
    store.set_status(rid, "failed", "SafetensorError: incomplete metadata, file not fully covered")
    log_size = store.log_path(rid).stat().st_size

    done = _cli("resume", rid, "--store", str(store.path))
    assert done.returncode == 0 and done.stdout.strip() == rid, done.stderr
    wait_for(lambda: _status(store, rid) in ("finished", "failed", "crashed"), 180, "the end")
    assert _status(store, rid) == "finished"
    log = store.log_path(rid).read_text()[log_size:]
    assert "Traceback" not in log
    lines = [x for x in log.splitlines() if "skipped damaged" in x]
    assert len(lines) == 1 and lines[0].startswith(f"resume: skipped damaged step_{newest:06d}")
    assert lines[0].endswith(f"resuming from step_{previous:06d}")
    events = [e["text"] for e in store.events(rid) if "skipped damaged" in e["text"]]
    assert events == [lines[0]]
    assert any(f"resumed from step_{previous:06d}.json" in e["text"] for e in store.events(rid))
    steps = _steps(store, rid)
    assert steps == list(range(1, 401))


def test_resume_with_only_damaged_checkpoints_is_one_line_and_changes_nothing(store, capsys):
    rid = store.create_run("r", {}, status="failed")
    run_dir = store.run_dir(rid)
    run_dir.mkdir()
    (run_dir / "config.toml").write_text(CONFIG.read_text())
    _save(run_dir / "checkpoints", 3)
    (run_dir / "checkpoints" / "step_000003.safetensors").write_bytes(b"\x01" * 9)
    before = store.get_run(rid)
    assert main(["resume", rid, "--store", str(store.path)]) == 2
    assert _one_line(capsys.readouterr().err).startswith(
        f"comera: error: run: {rid} has no checkpoint that reads back (no usable checkpoint in"
    )
    assert store.get_run(rid) == before and store.events(rid) == []


@pytest.fixture()
def stubborn_run(tmp_path):
    """A running run whose owner ignores SIGTERM and leads no process group (a killpg
    alone would miss it); no supervisor."""
    st = RunStore(tmp_path / "comera.db")
    rid = st.create_run("r", {}, status="running")
    code = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ready', flush=True); time.sleep(60)")
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert owner.stdout is not None and owner.stdout.readline().strip() == b"ready"
        st.update_run(rid, **_token(owner.pid))
        yield st, rid, owner
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()


def test_stop_kills_an_owner_that_ignores_sigterm_and_only_then_says_so(stubborn_run, capsys):
    st, rid, owner = stubborn_run
    assert main(["stop", rid, "--timeout", "0.2", "--store", str(st.path)]) == 0
    assert capsys.readouterr().out.strip() == f"{rid}: crashed"
    assert owner.wait(timeout=5) == -signal.SIGKILL
    assert "killed (SIGKILL)" in st.get_run(rid)["error"]


def test_stop_says_when_it_could_not_stop_the_owner(stubborn_run, capsys, monkeypatch):
    from comera_engine.launch import runs, signals

    st, rid, owner = stubborn_run

    class Clock:  # stop's 15 s of waiting, at once
        now = time.time()
        monotonic = staticmethod(time.monotonic)

        def time(self) -> float:
            self.now += 0.5
            return self.now

        def sleep(self, seconds: float) -> None:
            pass

    monkeypatch.setattr(runs, "time", Clock())
    monkeypatch.setattr(signals, "kill_owner", lambda run: False)  # SIGKILL had no effect
    assert main(["stop", rid, "--timeout", "0.2", "--store", str(st.path)]) == 1
    out = capsys.readouterr()
    assert out.out == "" and _one_line(out.err) == (
        f"{rid}: could not stop it: still stopping, pid {owner.pid} on "
        f"{this_process()['host']} did not report a final status"
    )
    assert owner.poll() is None and _status(st, rid) == "stopping"  # not called crashed


def test_train_into_a_missing_store_or_run_is_one_line_exit_2(tmp_path, capsys):
    st = RunStore(tmp_path / "comera.db")
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(DIGITS)
    for db, rid in ((tmp_path / "none.db", "x"), (st.path, "no-such-run")):
        run_dir = tmp_path / f"run-{rid}"
        assert main(["train", str(cfg), "--run-dir", str(run_dir), "--store", str(db),
                     "--run-id", rid, "--no-progress"]) == 2
        assert _one_line(capsys.readouterr().err).startswith("comera: error: --store: ")
        assert not (run_dir / "config.toml").exists() and lock_holder(run_dir) is None
    assert not (tmp_path / "none.db").exists() and st.list_runs() == []


#: A dense digits MLP wide enough that one step takes about 1.5 s on 2 cores.
SLOW_STEPS = ["model.dense=true", "model.hidden=[4096, 4096]", "train.batch_size=1024",
              "train.steps=1000", "train.eval_every=0", "train.ckpt_every=0"]


def test_a_graceful_stop_ends_within_its_timeout_plus_one_step(store):
    """Case 7: a stop during long steps ends ``stopped`` (with a checkpoint at the step it
    stopped at) within the timeout plus one step, not killed as ``crashed``."""
    rid = launch(CONFIG, SLOW_STEPS, store=store)
    wait_for(lambda: (store.get_run(rid)["last_step"] or 0) >= 2, START_TIMEOUT + 60,
             "two slow steps")
    step_s = max(store.series(rid, "perf/step_time_s")["value"])
    timeout = 10.0
    t0 = time.monotonic()
    assert stop(rid, timeout=timeout, store=store) == "stopped"
    took = time.monotonic() - t0
    run = store.get_run(rid)
    assert took <= timeout + step_s + 2.0, (took, step_s)
    assert (store.run_dir(rid) / "checkpoints" / f"step_{run['last_step']:06d}.json").is_file()
    assert [e["text"] for e in store.events(rid) if e["kind"] == "stop"][0].startswith(
        "stop requested")


def test_a_foreground_run_is_recorded_crashes_when_killed_and_resumes_as_itself(tmp_path):
    """Issue 18: ``comera train`` in a terminal records its run (running, owned by its own
    process); ``kill -9`` makes it ``crashed`` (reap); ``--resume`` of its folder continues
    the same run to the end, steps contiguous."""
    env = {**os.environ, "COMERA_HOME": str(tmp_path / "home")}
    folder = tmp_path / "fg"
    args = [sys.executable, "-m", "comera_engine.cli", "train", str(CONFIG), "--no-progress",
            "--run-dir", str(folder), "--set", "train.steps=1200", "--set",
            "train.ckpt_every=200", "--set", "train.eval_every=0"]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    store = RunStore(tmp_path / "home")
    try:
        def recorded() -> dict | None:
            runs = store.list_runs() if store.path.exists() else []
            return runs[0] if runs and (runs[0]["last_step"] or 0) > 250 else None

        run = wait_for(recorded, START_TIMEOUT + 60, "the terminal run past a checkpoint")
        assert run["status"] == "running" and run["pid"] == proc.pid
        assert run["folder"] == str(folder) and store.run_dir(run["id"]) == folder
    finally:
        proc.kill()
        proc.wait()
    from comera_engine.launch import reap

    assert reap(store) == [run["id"]] and _status(store, run["id"]) == "crashed"
    done = subprocess.run([*args, "--resume"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [r["id"] for r in store.list_runs()] == [run["id"]]  # the same run, not a new one
    assert _status(store, run["id"]) == "finished"
    assert _steps(store, run["id"]) == list(range(1, 1201))
    out = tmp_path / "model.safetensors"  # exportable by its id, like a launched run
    exported = subprocess.run([sys.executable, "-m", "comera_engine.cli", "export", run["id"],
                               "--out", str(out)], env=env, capture_output=True, text=True,
                              timeout=300)
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert out.stat().st_size > 0 and "compressed" in exported.stdout + exported.stderr
