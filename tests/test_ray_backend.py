"""Sweeps as Ray tasks (comera_engine/launch/ray_backend.py), against a local Ray instance
on this machine (2 CPUs): cells that finish and come back into the store, a cell that
fails at run time, a cell that is stopped, a stop of the driver and the driver's death.
Without Ray these tests skip (and the driver's one-line refusal is still checked)."""

from __future__ import annotations

import io
import math
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from comera_engine.config import load_config, to_toml
from comera_engine.launch import ray_backend as rb
from comera_engine.launch import reap, resolve_config, stop
from comera_engine.launch.liveness import pid_alive
from comera_engine.metrics import read_jsonl
from comera_engine.store import RunStore, list_checkpoints

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "experiments" / "configs" / "digits_tt_mlp.toml"
SHORT = ["train.steps=20", "train.eval_every=5", "train.ckpt_every=10"]
LONG = ["train.steps=200000", "train.eval_every=1000", "train.ckpt_every=100000"]


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    """One local Ray instance for the module (2 CPUs, no dashboard), shipping this
    checkout's engine to its workers; its address lets a detached driver join it."""
    ray = pytest.importorskip(
        "ray", reason="Ray is not installed: pip install 'comera-studio[cluster]'")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env=rb.engine_runtime_env())
    try:
        yield str(ray.get_runtime_context().gcs_address)
    finally:
        ray.shutdown()


def _cell(st: RunStore, sid: str, cfg: Any, cell: dict[str, Any]) -> str:
    """A queued cell with its config.toml written, as the sweep launcher leaves it."""
    rid = st.create_run(cfg.name, cfg.to_dict(), "queued", sweep_id=sid, cell=cell,
                        cwd=str(ROOT))
    folder = st.run_dir(rid)
    folder.mkdir(parents=True)
    (folder / "config.toml").write_text(to_toml(cfg), encoding="utf-8")
    return rid


def _digits_sweep(st: RunStore, cells: Sequence[Sequence[str]],
                  max_parallel: int | None = None) -> tuple[str, list[str]]:
    sid = st.create_sweep("digits", {}, {"comera.target_compression": [10, 20]}, 1,
                          max_parallel=max_parallel, backend="ray")
    rids = [_cell(st, sid, load_config(DIGITS, list(o)), {"overrides": list(o)})
            for o in cells]
    return sid, rids


def _wait_for(what: str, check: Any, timeout: float = 60.0) -> Any:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        got = check()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _training(rid: str) -> bool:
    """The cell's trainer (on this machine's Ray worker) has logged its first records."""
    return any(Path(tempfile.gettempdir()).glob(f"comera-{rid}-*/run/metrics.jsonl"))


def _metric_rows_of_jsonl(path: Path) -> set[tuple[int, str, float]]:
    rows = set()
    for r in read_jsonl(path):
        if r.get("type") == "metrics":
            for k, v in r["values"].items():
                rows.add((int(r["step"]), k, round(float(v), 9)))
    return rows


def _metric_rows_of_store(st: RunStore, rid: str) -> set[tuple[int, str, float]]:
    return {(m["step"], m["name"], round(m["value"], 9)) for m in st.metrics_since(rid)
            if not math.isnan(m["value"])}


# ---------------------------------------------------------------------- without Ray


def test_without_ray_the_driver_says_how_to_install_it(tmp_path: Path) -> None:
    code = textwrap.dedent(f"""
        import importlib.abc, sys
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] == "ray":
                    raise ImportError("blocked: " + name)
        sys.meta_path.insert(0, Block())
        from comera_engine.errors import ConfigError
        from comera_engine.launch import ray_backend
        from comera_engine.store import RunStore
        st = RunStore({str(tmp_path)!r})
        sid = st.create_sweep("s", {{}}, {{}}, 1, backend="ray")
        try:
            ray_backend.run_ray_sweep(st, sid)
        except ConfigError as e:
            print(e)
        assert "ray" not in sys.modules
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "backend: " + rb.RAY_MISSING


def test_outcome_of_a_cell() -> None:
    assert rb.cell_outcome(0, {"status": "finished"}) == ("finished", None)
    assert rb.cell_outcome(0, {"status": "stopped"}, stop_requested=True) == ("stopped", None)
    assert rb.cell_outcome(3, {"status": "diverged", "error": "nan"}) == ("diverged", "nan")
    status, error = rb.cell_outcome(2, None, "some\ncomera: error: data.path: gone\n")
    assert status == "failed" and error is not None and error.endswith("data.path: gone")
    assert rb.cell_outcome(-9, None, "", stop_requested=True) == ("stopped", None)
    assert rb.cell_outcome(-9, None, "x")[0] == "failed"
    assert rb.cell_outcome(None, None, failure="WorkerCrashedError: gone") == (
        "failed", "the Ray task failed: WorkerCrashedError: gone")
    assert rb.cell_outcome(None, None, stop_requested=True, failure="cancelled") == (
        "stopped", None)
    assert rb.cell_outcome(0, None)[0] == "failed"  # exited without a final status


def test_archive_keeps_the_newest_checkpoint_and_refuses_paths_outside(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    for step in (10, 20):
        (run / "checkpoints" / f"step_{step:06d}.json").write_text("{}")
        (run / "checkpoints" / f"step_{step:06d}.safetensors").write_bytes(b"x" * step)
    (run / "checkpoints" / "step_000030.safetensors").write_bytes(b"torn, no sidecar")
    (run / "metrics.jsonl").write_text("{}\n")
    (run / ".lock").write_text("pid")
    back = tmp_path / "back"
    back.mkdir()
    names = rb.unpack_run_folder(rb.pack_run_folder(run), back)
    assert sorted(names) == ["checkpoints/step_000020.json",
                             "checkpoints/step_000020.safetensors", "metrics.jsonl"]
    assert (back / "checkpoints" / "step_000020.safetensors").read_bytes() == b"x" * 20

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name in ("../evil.txt", "/abs.txt", "ok.txt"):
            info = tarfile.TarInfo(name)
            info.size = 2
            tar.addfile(info, io.BytesIO(b"hi"))
    assert rb.unpack_run_folder(buf.getvalue(), back) == ["ok.txt"]
    assert not (tmp_path / "evil.txt").exists()


# ---------------------------------------------------------------------- on Ray


def test_two_cells_run_as_ray_tasks_and_come_back_into_the_store(
        ray_address: str, tmp_path: Path) -> None:
    st = RunStore(tmp_path / "store")
    sid, rids = _digits_sweep(st, [[*SHORT, "comera.target_compression=10"],
                                   [*SHORT, "comera.target_compression=20"]])
    t0 = time.monotonic()
    counts = rb.run_ray_sweep(st, sid, poll=0.2)
    print(f"2 digits cells on Ray: {time.monotonic() - t0:.1f} s")
    assert counts == {"finished": 2}
    assert st.get_sweep(sid)["status"] == "finished"
    for rid in rids:
        run = st.get_run(rid)
        folder = st.run_dir(rid)
        assert run["status"] == "finished" and run["exit_code"] == 0 and run["error"] is None
        assert run["pid"] == os.getpid() and run["last_step"] == 20
        rows = _metric_rows_of_jsonl(folder / "metrics.jsonl")
        assert rows and _metric_rows_of_store(st, rid) == rows
        assert st.rank_history(rid) and st.latest_ranks(rid)
        assert [step for step, _ in list_checkpoints(folder / "checkpoints")] == [20]
        ckpts = st.artifacts(rid, "checkpoint")
        assert [a["exists"] for a in ckpts] == [False, True]  # only the newest came back
        assert all(a["path"].startswith(str(folder)) for a in ckpts)
        for name in ("config.toml", "data_spec.json", "dataset.json"):
            assert (folder / name).is_file()
        log = st.log_path(rid).read_text()
        assert "finished at step 20" in log and "status finished" in log
        kinds = [e["kind"] for e in st.events(rid)]
        assert kinds[0] == "start" and "checkpoint" in kinds and kinds[-1] == "end"


def test_a_cell_that_fails_at_run_time_fails_alone(ray_address: str, tmp_path: Path) -> None:
    """The clicks file a cell was made with is gone when it runs (as on a worker that
    does not have it): that cell fails with the trainer's one line, the other finishes."""
    st = RunStore(tmp_path / "store")
    sid, (ok,) = _digits_sweep(st, [SHORT])
    data = tmp_path / "clicks.tsv"
    data.write_text("0" + "\t" * 39 + "\n")
    raw = load_config(ROOT / "experiments/configs/dlrm_synthetic_tiny.toml").to_dict()
    raw["data"] = {"name": "clicks", "path": str(data), "bucket_sizes": 20}
    raw["train"]["steps"] = 10
    bad = _cell(st, sid, resolve_config(raw), {"data.path": str(data)})  # validated
    data.unlink()
    counts = rb.run_ray_sweep(st, sid, poll=0.2)
    assert counts == {"finished": 1, "failed": 1}
    run = st.get_run(bad)
    assert run["status"] == "failed" and run["exit_code"] == 2
    assert f"data.path: {data} is not on this server" in run["error"]
    assert st.count_metrics(bad) == 0
    assert st.get_run(ok)["status"] == "finished"
    assert st.get_sweep(sid)["status"] == "failed"


def test_a_stopped_cell_is_cancelled_and_the_others_go_on(
        ray_address: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``comera stop`` of a Ray cell marks it; the driver (this process, whose pid the
    cell carries) cancels the task, whose trainer checkpoints and reports stopped. A
    queued cell stopped before it started never runs; the other cell finishes."""
    import comera_engine.launch as launch
    from comera_engine.launch import signals

    def no_signal(*args: Any, **kwargs: Any) -> bool:
        raise AssertionError("stop() signalled the pid of a Ray cell (the driver)")

    for name in ("send_stop_signal", "signal_group", "kill_owner"):
        monkeypatch.setattr(signals, name, no_signal)
    st = RunStore(tmp_path / "store")
    sid, (long, short, waiting) = _digits_sweep(st, [LONG, SHORT, SHORT], max_parallel=2)
    out: dict[str, Any] = {}
    driver = threading.Thread(
        target=lambda: out.update(rb.run_ray_sweep(st, sid, poll=0.2)), daemon=True)
    driver.start()
    _wait_for("the long cell to start", lambda: st.get_run(long)["status"] == "running")
    assert stop(waiting, store=st) == "stopped"  # still queued: at once, never started
    _wait_for("the long cell's trainer", lambda: _training(long))
    t0 = time.monotonic()
    assert stop(long, timeout=30, store=st) == "stopped"
    print(f"stop of a Ray cell: {time.monotonic() - t0:.1f} s")
    driver.join(60)
    assert not driver.is_alive()
    assert out == {"stopped": 2, "finished": 1}
    run = st.get_run(long)
    assert run["exit_code"] == 0 and run["error"] is None and 0 < run["last_step"] < 200000
    assert list_checkpoints(st.run_dir(long) / "checkpoints")  # its stop checkpoint came back
    assert st.count_metrics(long) > 0
    with pytest.raises(launch.LaunchError, match="cell of Ray sweep"):
        launch.resume(long, store=st)  # the local launcher would never start it
    assert st.get_run(short)["status"] == "finished"
    queued = st.get_run(waiting)
    assert queued["started_at"] is None and queued["dispatched_at"] is None
    assert st.count_metrics(waiting) == 0


def test_two_cells_stream_rising_steps_into_the_store_while_they_run(
        ray_address: str, tmp_path: Path) -> None:
    """The cells' records reach the store while they train (not when their task ends):
    each running cell shows a rising ``last_step`` and growing metric rows; stopped,
    the store holds exactly their ``metrics.jsonl``'s rows, every event once."""
    st = RunStore(tmp_path / "store")
    sid, rids = _digits_sweep(st, [LONG, LONG], max_parallel=2)
    driver = threading.Thread(target=rb.run_ray_sweep, args=(st, sid), kwargs={"poll": 0.2},
                              daemon=True)
    driver.start()
    seen: dict[str, list[int]] = {rid: [] for rid in rids}

    def rising() -> bool:
        for rid in rids:
            run = st.get_run(rid)
            assert run["status"] in ("queued", "running"), run["error"]
            step = run["last_step"]
            if run["status"] == "running" and step and (not seen[rid] or step > seen[rid][-1]):
                seen[rid].append(step)
        return all(len(steps) >= 3 for steps in seen.values())

    t0 = time.monotonic()
    _wait_for("both cells' steps to rise in the store", rising, timeout=120)
    print(f"streamed steps after {time.monotonic() - t0:.1f} s: {seen}")
    for rid in rids:
        assert st.get_run(rid)["status"] == "running" and st.count_metrics(rid) > 0
    for rid in rids:
        assert stop(rid, timeout=30, store=st) == "stopped"
    driver.join(60)
    assert not driver.is_alive()
    for rid in rids:
        jsonl = read_jsonl(st.run_dir(rid) / "metrics.jsonl")
        assert _metric_rows_of_store(st, rid) == _metric_rows_of_jsonl(
            st.run_dir(rid) / "metrics.jsonl")
        trainer = [(r["kind"], r["text"]) for r in jsonl if r.get("type") == "event"]
        stored = [(e["kind"], e["text"]) for e in st.events(rid)]
        assert sorted(e for e in stored if e in trainer) == sorted(trainer)  # each once


def _driver_sweep(st: RunStore, cells: int) -> tuple[str, list[str]]:
    return _digits_sweep(st, [LONG] * cells, max_parallel=1)


def test_a_detached_driver_stops_on_sigterm_and_its_death_is_reaped(
        ray_address: str, tmp_path: Path) -> None:
    """The dashboard's way: a detached driver joins the cluster. SIGTERM stops its sweep
    (the cell in flight stopped, the queued one never started); a driver killed outright
    leaves its cell to `reap`, which marks it crashed, and Ray ends the trainer."""
    import psutil

    st = RunStore(tmp_path / "store")
    sid, (first, second) = _driver_sweep(st, 2)
    pid = rb.spawn_ray_driver(st, sid, address=ray_address)
    _wait_for("the first cell to train", lambda: _training(first), timeout=90)
    os.kill(pid, signal.SIGTERM)
    _wait_for("the driver to exit", lambda: not pid_alive(pid), timeout=60)
    log = rb.driver_log_path(st, sid).read_text()
    assert "stopping the sweep: the driver got SIGTERM" in log, log
    assert st.get_run(first)["status"] == "stopped"
    assert st.get_run(second)["status"] == "stopped"
    assert st.get_run(second)["started_at"] is None

    sid, (cell,) = _driver_sweep(st, 1)
    pid = rb.spawn_ray_driver(st, sid, address=ray_address)
    _wait_for("the cell to train", lambda: _training(cell), timeout=90)
    assert st.get_run(cell)["pid"] == pid
    _wait_for("the cell's rows streamed", lambda: st.count_metrics(cell) > 0, timeout=60)
    os.kill(pid, signal.SIGKILL)
    _wait_for("the driver to be gone", lambda: not pid_alive(pid))
    kept = st.count_metrics(cell)
    assert reap(st) == [cell]
    run = st.get_run(cell)
    assert run["status"] == "crashed" and "its process is gone" in run["error"]
    assert st.count_metrics(cell) == kept > 0 and run["last_step"] > 0  # what it sent stays

    def trainer_gone() -> bool:
        for p in psutil.process_iter(["cmdline"]):
            if any(f"comera-{cell}-" in part for part in (p.info["cmdline"] or [])):
                return False
        return True

    _wait_for("Ray to end the dead driver's trainer", trainer_gone, timeout=30)
    for left in Path(tempfile.gettempdir()).glob(f"comera-{cell}-*"):  # killed: no cleanup
        shutil.rmtree(left, ignore_errors=True)


def test_comera_sweep_with_the_ray_backend_end_to_end(ray_address: str, tmp_path: Path) -> None:
    """``comera sweep --backend ray --address ADDR --wait``: the cells are created by the
    sweep launcher, run by a detached driver on the cluster, and reported like local ones."""
    import json

    env = {**os.environ, "COMERA_HOME": str(tmp_path / "home")}
    out = subprocess.run(
        [sys.executable, "-m", "comera_engine.cli", "sweep", str(DIGITS), "--grid",
         "comera.target_compression=10,20", "--backend", "ray", "--address", ray_address,
         "--max-parallel", "2", *[a for s in SHORT for a in ("--set", s)], "--wait", "--json"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rep = json.loads(out.stdout)
    assert rep["sweep"]["backend"] == "ray" and rep["sweep"]["counts"] == {"finished": 2}
    st = RunStore(tmp_path / "home")
    for c in rep["cells"]:
        assert c["score"] is not None and c["step"] == 20
        rows = _metric_rows_of_jsonl(st.run_dir(c["run"]) / "metrics.jsonl")
        assert rows == _metric_rows_of_store(st, c["run"])
    assert [g["target"] for g in rep["groups"]] == [10, 20]
