"""A run's phase (preparing data, training tokenizer, building, training, evaluating,
checkpointing, done): the sinks that record it, the trainer that reports it, and
`comera runs` that shows it. The Live run page's part is in test_app.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from comera_engine.cli import main
from comera_engine.launch.liveness import process_start_time, this_process
from comera_engine.launch.owner import claim_run
from comera_engine.metrics import JSONLSink, MultiSink, read_jsonl
from comera_engine.store import PHASES, RunStore, StoreSink
from comera_engine.store.errors import NotOwnerError

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "experiments" / "configs" / "digits_tt_mlp.toml"
CODE_MLM = ROOT / "experiments" / "configs" / "code_mlm_tiny.toml"


@pytest.fixture()
def store(tmp_path: Path) -> RunStore:
    return RunStore(tmp_path / "comera.db")


def _phase(st: RunStore, rid: str) -> tuple[str | None, float | None]:
    run = st.get_run(rid)
    assert run is not None
    return run["phase"], run["phase_progress"]


class _WriteSpy:
    """Wraps ``RunStore.write_batch`` of one store object: the phases it was asked to
    write, in order."""

    def __init__(self, st: RunStore, monkeypatch: pytest.MonkeyPatch) -> None:
        self.phases: list[tuple[str | None, float | None]] = []
        real = st.write_batch

        def spy(run_id: str, **kw: object) -> bool:
            if kw.get("phase") is not None:
                self.phases.append(kw["phase"])  # type: ignore[arg-type]
            return real(run_id, **kw)

        monkeypatch.setattr(st, "write_batch", spy)


# ------------------------------------------------------------------------- StoreSink


def test_a_phase_change_is_written_through_with_what_came_before(store: RunStore) -> None:
    rid = store.create_run("r", {})
    reader = RunStore(store.path)  # another connection sees only what was written
    with StoreSink(store, rid, flush_every=60) as sink:  # no background flush meanwhile
        sink.log_metrics(1, {"loss": 1.0})
        assert reader.count_metrics(rid) == 0  # buffered
        sink.set_phase("building")
        assert _phase(reader, rid) == ("building", None)
        assert reader.count_metrics(rid) == 1  # the records before it, in the same write
        sink.set_phase("evaluating", 0.0)
        assert _phase(reader, rid) == ("evaluating", 0.0)
        for i in range(1, 50):  # progress within the phase: buffered, the newest kept
            sink.set_phase("evaluating", i / 49)
        assert _phase(reader, rid) == ("evaluating", 0.0) and sink.pending() == 1
        sink.flush()
        assert _phase(reader, rid) == ("evaluating", 1.0) and sink.pending() == 0
        sink.set_phase("evaluating", 3.5)  # clamped to 0..1
        sink.flush()
        assert _phase(reader, rid) == ("evaluating", 1.0)
        with pytest.raises(ValueError, match="phase: must be one of"):
            sink.set_phase("compiling")  # refused in the caller, never buffered
        assert sink.pending() == 0
        sink.set_phase("done")
    assert _phase(reader, rid) == ("done", None)


def test_progress_is_written_by_the_flush_thread_at_most_every_interval(
        store: RunStore, monkeypatch: pytest.MonkeyPatch) -> None:
    rid = store.create_run("r", {})
    spy = _WriteSpy(store, monkeypatch)
    reader = RunStore(store.path)
    interval, updates, pause = 0.1, 200, 0.0025
    with StoreSink(store, rid, flush_every=interval) as sink:
        sink.set_phase("evaluating", 0.0)
        t0 = time.monotonic()
        for i in range(1, updates + 1):
            sink.set_phase("evaluating", i / updates)
            time.sleep(pause)
        elapsed = time.monotonic() - t0
        deadline = time.monotonic() + 10 * interval
        while _phase(reader, rid) != ("evaluating", 1.0):  # the thread writes the last one
            assert time.monotonic() < deadline, "progress never reached the store"
            time.sleep(interval / 5)
    writes = len(spy.phases)
    assert writes <= 2 + elapsed / interval + 2  # the change, one per tick, the end
    assert writes < updates / 10
    assert spy.phases[0] == ("evaluating", 0.0)


def test_a_sink_that_lost_the_run_writes_no_phase(store: RunStore) -> None:
    rid = store.create_run("r", {})
    owner = claim_run(store, rid)
    sink = StoreSink(store, rid, flush_every=60, owner=owner)
    sink.set_phase("building")
    assert _phase(store, rid) == ("building", None)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:  # another process took the run over
        store.update_run(rid, pid=other.pid, pid_started=process_start_time(other.pid),
                         host=this_process()["host"])
        sink.set_phase("training")
        sink.set_phase("evaluating", 0.5)
        sink.close()
        assert sink.owner_lost
        assert _phase(store, rid) == ("building", None)
        with pytest.raises(NotOwnerError):
            store.write_batch(rid, phase=("training", None), owner=owner)
    finally:
        other.kill()
        other.wait()


# ------------------------------------------------------------------------- JSONL, fan-out


class _OldSink:
    """A sink written before the protocol had phases."""

    def __init__(self) -> None:
        self.statuses: list[str] = []

    def set_status(self, status: str, error: str | None = None) -> None:
        self.statuses.append(status)

    def close(self) -> None:
        pass


def test_jsonl_sink_writes_a_record_per_phase_change_only(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    old = _OldSink()
    sink = MultiSink(JSONLSink(path), old)
    sink.set_phase("building")
    sink.set_phase("evaluating", 0.0)
    for i in range(1, 20):
        sink.set_phase("evaluating", i / 19)
    sink.set_phase("training")
    sink.set_phase("training")
    sink.set_status("finished")
    sink.close()
    records = [r for r in read_jsonl(path) if r["type"] == "phase"]
    assert [(r["phase"], r["progress"]) for r in records] == [
        ("building", None), ("evaluating", 0.0), ("training", None)]
    assert all(isinstance(r["t"], float) for r in records)
    assert old.statuses == ["finished"]  # the old sink still gets everything else


# ------------------------------------------------------------------------- data layer


def test_a_dataset_build_reports_its_tokenizer_training(tmp_path: Path) -> None:
    from comera_engine.data import build_dataset

    folder = tmp_path / "src"
    folder.mkdir()
    for i in range(4):  # a few small Python files to learn a vocabulary from
        (folder / f"m{i}.py").write_text(
            "\n".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}\n" for j in range(20)))
    tok = tmp_path / "tok" / "tokenizer.json"
    cfg = {"name": "code_mlm", "root": str(folder), "seq_len": 16, "vocab_size": 80,
           "min_frequency": 1, "max_files": None, "split_fraction": 0.5,
           "tokenizer_path": str(tok)}
    heard: list[tuple[str, float | None]] = []
    build_dataset(cfg, on_phase=lambda phase, progress: heard.append((phase, progress)))
    assert heard == [("preparing data", None), ("training tokenizer", None),
                     ("preparing data", None)]
    assert tok.is_file() and all(p in PHASES for p, _ in heard)
    heard.clear()
    build_dataset(cfg, on_phase=lambda phase, progress: heard.append((phase, progress)))
    assert heard == [("preparing data", None)]  # the saved tokenizer is reused
    build_dataset(cfg)  # nobody listening: nothing to tell


# ------------------------------------------------------------------------- the trainer


def test_a_foreground_run_goes_through_its_phases_and_ends_done(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`comera train` on the digits config: phases are reported on changes only (never
    once per training step), evaluation reports progress per eval batch, and the row
    ends in ``done``."""
    calls: list[tuple[str, float | None]] = []
    real = StoreSink.set_phase

    def spy(self: StoreSink, phase: str, progress: float | None = None) -> None:
        calls.append((phase, progress))
        real(self, phase, progress)

    monkeypatch.setattr(StoreSink, "set_phase", spy)
    monkeypatch.chdir(tmp_path)
    steps, every = 12, 4
    rc = main(["train", str(DIGITS), "--no-progress", "--run-dir", "out",
               "--set", f"train.steps={steps}", "--set", f"train.eval_every={every}",
               "--set", "train.ckpt_every=8"])
    assert rc == 0
    st = RunStore(Path(os.environ["COMERA_HOME"]) / "comera.db")  # the default store
    (run,) = st.list_runs()
    assert run["status"] == "finished"
    assert (run["phase"], run["phase_progress"]) == ("done", None)
    names = [p for p, _ in calls]
    assert names[0] == "building" and names[-1] == "done"
    assert {"training", "evaluating", "checkpointing"} <= set(names)
    assert names.count("training") < steps  # not once per step
    assert all(a != b for a, b in zip(calls, calls[1:]) if a[1] is None)  # no repeats
    evals = _runs_of(calls, "evaluating")
    assert len(evals) == steps // every
    for progress in evals:  # 0 at the start, then one value per eval batch up to 1
        assert progress[0] == 0.0 and progress[-1] == pytest.approx(1.0)
        assert progress == sorted(progress) and len(progress) > 2
    jsonl = [r["phase"] for r in read_jsonl(tmp_path / "out" / "metrics.jsonl")
             if r["type"] == "phase"]
    assert jsonl == [name for i, name in enumerate(names) if i == 0 or name != names[i - 1]]


def _runs_of(calls: list[tuple[str, float | None]], phase: str) -> list[list[float]]:
    """The progress values of each uninterrupted stretch of ``phase`` in ``calls``."""
    out: list[list[float]] = []
    previous = None
    for name, progress in calls:
        if name == phase:
            if previous != phase:
                out.append([])
            if progress is not None:
                out[-1].append(progress)
        previous = name
    return out


def test_a_launched_text_run_reports_preparing_data_and_its_tokenizer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """`comera train --run-id` (what the supervisor starts): the row exists, so the
    phases before the trainer takes the run (preparing data, training tokenizer) are
    recorded too, in order, and the run ends ``done``."""
    st = RunStore(tmp_path / "comera.db")
    rid = st.create_run("code", {}, "queued")
    st.update_run(rid, **this_process())  # the supervisor records the trainer's pid
    written: list[tuple[str | None, float | None]] = []
    real = RunStore.write_batch

    def spy(self: RunStore, run_id: str, **kw: object) -> bool:
        if run_id == rid and kw.get("phase") is not None:
            written.append(kw["phase"])  # type: ignore[arg-type]
        return real(self, run_id, **kw)

    monkeypatch.setattr(RunStore, "write_batch", spy)
    # another folder is refused, naming the run's own (this process is its owner: not "in
    # use by" itself)
    assert main(["train", str(CODE_MLM), "--no-progress", "--store", str(st.path),
                 "--run-id", rid, "--run-dir", str(tmp_path / "elsewhere")]) == 2
    said = capsys.readouterr().err
    assert f"--run-id: run {rid} lives in" in said and "owned by pid" not in said
    rc = main(["train", str(CODE_MLM), "--no-progress", "--store", str(st.path),
               "--run-id", rid, "--run-dir", str(st.run_dir(rid)),  # the run's own folder
               "--set", "train.steps=2", "--set", "train.eval_batches=2",
               "--set", "data.max_files=8", "--set", "model.tt_layers=[\"attention\"]"])
    assert rc == 0
    names = [p for p, _ in written]
    changes = [n for i, n in enumerate(names) if i == 0 or n != names[i - 1]]
    assert changes[:4] == ["preparing data", "training tokenizer", "preparing data",
                           "building"]
    assert changes[-1] == "done" and "evaluating" in changes and "checkpointing" in changes
    run = st.get_run(rid)
    assert run["status"] == "finished"
    assert (run["phase"], run["phase_progress"]) == ("done", None)


def test_a_trainer_refused_on_a_live_run_writes_no_phase(tmp_path: Path) -> None:
    st = RunStore(tmp_path / "comera.db")
    rid = st.create_run("busy", {}, "running")
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:  # the run's live owner is another process
        st.update_run(rid, pid=other.pid, pid_started=process_start_time(other.pid),
                      host=this_process()["host"])
        st.set_phase(rid, "training")
        rc = main(["train", str(DIGITS), "--no-progress", "--store", str(st.path),
                   "--run-id", rid, "--run-dir", str(tmp_path / "run"),
                   "--set", "train.steps=2"])
        assert rc == 2  # refused: the run is in use
        assert _phase(st, rid) == ("training", None)  # untouched
    finally:
        other.kill()
        other.wait()


# ------------------------------------------------------------------------- comera runs


def test_comera_runs_shows_the_phase_of_active_runs(
        store: RunStore, capsys: pytest.CaptureFixture[str]) -> None:
    live = store.create_run("live-one", {}, "running")
    store.update_run(live, **this_process())  # alive: housekeeping leaves it running
    store.heartbeat(live)
    store.set_phase(live, "evaluating", 0.4)
    waiting = store.create_run("starting", {}, "running")
    store.update_run(waiting, **this_process())
    store.heartbeat(waiting)
    store.set_phase(waiting, "preparing data")
    over = store.create_run("over", {}, "running")
    store.set_phase(over, "done")
    store.set_status(over, "finished")
    assert main(["runs", "--store", str(store.path)]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert "running · evaluating 40%" in rows[live]
    assert "running · preparing data" in rows[waiting] and "%" not in rows[waiting]
    assert "finished" in rows[over] and "·" not in rows[over] and "done" not in rows[over]
    assert main(["runs", "--json", "--store", str(store.path)]) == 0
    got = {r["id"]: (r["phase"], r["phase_progress"]) for r in
           json.loads(capsys.readouterr().out)}
    assert got == {live: ("evaluating", 0.4), waiting: ("preparing data", None),
                   over: ("done", None)}


def test_a_resumed_run_starts_without_the_old_phase(
        store: RunStore, monkeypatch: pytest.MonkeyPatch) -> None:
    import comera_engine.launch as launch

    rid = store.create_run("r", {}, "running")
    store.run_dir(rid).mkdir(parents=True)
    (store.run_dir(rid) / launch.CONFIG_FILENAME).write_text(DIGITS.read_text())
    store.set_phase(rid, "training")
    store.set_status(rid, "crashed", "killed")
    monkeypatch.setattr("comera_engine.launch.runs.dispatch", lambda st: None)  # start none
    launch.resume(rid, store=store)
    run = store.get_run(rid)
    assert run["status"] == "queued" and (run["phase"], run["phase_progress"]) == (None, None)
