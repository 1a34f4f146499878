"""Run store: schema, sink batching, queries, concurrency, foreign files."""

from __future__ import annotations

import hashlib
import json
import math
import os
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from comera_engine.metrics import MetricsSink
from comera_engine.store import (
    SCHEMA_VERSION,
    STATUSES,
    RunNotFoundError,
    RunStore,
    StoreError,
    StoreSink,
    default_store_path,
    schema,
)

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.fixture()
def store(tmp_path: Path) -> RunStore:
    return RunStore(tmp_path / "comera.db")


# ------------------------------------------------------------------------------ basics


def test_default_path_follows_comera_home(tmp_path, monkeypatch):
    monkeypatch.delenv("COMERA_HOME", raising=False)
    monkeypatch.chdir(tmp_path)
    assert default_store_path() == Path("runs") / "comera.db"
    st = RunStore()
    assert st.path == tmp_path / "runs" / "comera.db" and st.path.is_file()
    monkeypatch.setenv("COMERA_HOME", str(tmp_path / "home"))
    st2 = RunStore()
    assert st2.path == tmp_path / "home" / "comera.db"
    assert st2.run_dir("abc") == tmp_path / "home" / "abc"
    # a folder given as the store means <folder>/comera.db; so does a new suffix-less path
    assert RunStore(tmp_path / "home").path == st2.path
    assert RunStore(tmp_path / "fresh").path == tmp_path / "fresh" / "comera.db"
    assert RunStore(tmp_path / "my.db").path == tmp_path / "my.db"


def test_create_false_refuses_missing_store(tmp_path):
    with pytest.raises(StoreError, match="no run store"):
        RunStore(tmp_path / "nope.db", create=False)
    assert not (tmp_path / "nope.db").exists()


def test_schema_version_wal_and_marker(store):
    con = sqlite3.connect(store.path)
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert con.execute("PRAGMA application_id").fetchone()[0] == schema.APPLICATION_ID
    versions = [r[0] for r in con.execute("SELECT version FROM schema_version")]
    assert versions == list(range(1, SCHEMA_VERSION + 1))
    tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"runs", "metrics", "rank_snapshots", "events", "artifacts"} <= tables
    con.close()


def test_runs_crud_filters_and_resolve(store):
    a = store.create_run("digits-tt", {"train": {"steps": 5}}, device="cpu")
    b = store.create_run("snli-small", {"x": 1}, status="running")
    c = store.create_run("digits-dense", {}, status="finished")
    run = store.get_run(a)
    assert run["config"] == {"train": {"steps": 5}} and run["status"] == "queued"
    assert run["device"] == "cpu" and run["nproc"] == 1
    assert store.get_run(b)["started_at"] is not None
    store.update_run(a, device="cuda:0", config={"y": 2})
    assert store.get_run(a)["device"] == "cuda:0" and store.get_run(a)["config"] == {"y": 2}
    with pytest.raises(ValueError, match="bogus"):
        store.update_run(a, bogus=1)
    assert {r["id"] for r in store.list_runs()} == {a, b, c}
    assert [r["id"] for r in store.list_runs(status="running")] == [b]
    assert {r["id"] for r in store.list_runs(status=["queued", "finished"])} == {a, c}
    assert {r["id"] for r in store.list_runs(name_like="DIGITS")} == {a, c}
    assert len(store.list_runs(limit=2)) == 2
    assert store.resolve(a) == a
    assert store.resolve("snli-small") == b
    assert store.resolve(c[:-1]) == c or len({a[:-1], b[:-1], c[:-1]}) < 3
    with pytest.raises(RunNotFoundError):
        store.resolve("no-such-run")
    assert store.get_run("missing") is None
    with pytest.raises(StoreError):
        store.run_dir("../etc")


def test_many_sessions_opening_a_new_store_together_all_succeed(tmp_path):
    """Eight threads open a store that does not exist yet, forty times over. SQLite may
    refuse ``PRAGMA journal_mode = WAL`` at once (no busy wait) while another connection
    creates the schema; the store retries it like ``BEGIN IMMEDIATE`` (before: about one
    trial in sixty failed under CPU load, one session getting 'database is locked')."""
    import threading

    for trial in range(40):
        path = tmp_path / f"t{trial}" / "comera.db"
        path.parent.mkdir()
        errors: list[BaseException] = []

        def open_store(p: Path = path, errs: list[BaseException] = errors) -> None:
            try:
                RunStore(p).list_runs()
            except BaseException as e:  # noqa: BLE001 (collected and asserted below)
                errs.append(e)

        threads = [threading.Thread(target=open_store) for _ in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors, f"trial {trial}: {errors[0]!r}"
        with sqlite3.connect(path) as conn:
            assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_a_connection_collected_while_the_count_lock_is_held_does_not_deadlock(tmp_path):
    """sqlite3 connections sit in a reference cycle (the statement cache wraps the
    connection), so the finalizer that drops a connection's per-file count runs inside the
    garbage collector, in whichever thread allocates: possibly one that holds the count's
    lock, as RunStore.__init__ does while it reads the header. Here the collector runs
    under that lock on purpose; the count must still come back to zero and later stores
    open (before: the thread deadlocked on itself and every later store in the process
    hung, which stalled CI in test_store)."""
    code = textwrap.dedent(
        """
        import faulthandler, gc, sys
        from pathlib import Path
        from comera_engine.store import RunStore, connection as db

        faulthandler.dump_traceback_later(30, exit=True)
        path = Path(sys.argv[1])
        gc.disable()
        store = RunStore(path)
        store.list_runs()
        key = db._file_key(path)
        with db._LIVE_LOCK:
            assert db._live_count(key) == 1
        del store  # its connection is now cyclic garbage, still counted
        with db._LIVE_LOCK:
            assert gc.collect() > 0
            assert db._live_count(key) == 0
        RunStore(path).create_run("after", {})
        print("count", db._live_count(key))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "comera.db")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and "count" in proc.stdout, proc.stderr[-3000:]


def test_second_store_object_in_one_process_keeps_writes_visible(tmp_path):
    """Closing any file descriptor drops all of a process's POSIX locks on that file. If a
    second RunStore read the header while the first was connected, the first would lose
    its SQLite lock, the next process to close its connection would think it was the last
    one and delete the WAL, and the first's later writes would be invisible to others."""
    path = tmp_path / "comera.db"
    first = RunStore(path)
    first.create_run("before", {})
    second = RunStore(path)
    second.list_runs()
    code = (
        "import sys; from comera_engine.store import RunStore; "
        "st = RunStore(sys.argv[1], create=False); "
        "print(st.get_run(sys.argv[2]) is not None if len(sys.argv) > 2 else 'open'); "
        "st.close()"
    )

    def other_process(*args: str) -> str:
        return subprocess.run(
            [sys.executable, "-c", code, str(path), *args],
            env=_env(), capture_output=True, text=True, check=True, timeout=60,
        ).stdout.strip()

    assert other_process() == "open"  # another process opens and closes the store
    rid = first.create_run("after", {})
    assert other_process(rid) == "True"
    second.close()


# ------------------------------------------------------------------------------ sink


def test_store_sink_is_a_metrics_sink_and_counts_exactly(store, tmp_path):
    rid = store.create_run("r", {})
    ck = tmp_path / "ck.bin"
    ck.write_bytes(b"x" * 1234)
    with StoreSink(store, rid, flush_every=0.05) as sink:
        assert isinstance(sink, MetricsSink)
        sink.set_status("running")
        for step in range(300):
            sink.log_metrics(step, {"loss/task": 1.0 / (step + 1), "lr": 1e-3})
            if step % 100 == 0:
                sink.log_ranks(step, {"fc1": [1, 8, 8, 1], "fc2": [1, 4, 1]})
        sink.log_event("rank_change", "fc1 8->6", step=150)
        sink.log_artifact("checkpoint", ck)
        sink.set_status("finished")
    run = store.get_run(rid)
    assert run["status"] == "finished" and run["ended_at"] and run["error"] is None
    assert run["last_step"] == 299 and run["pid"] == os.getpid()
    assert store.counts(rid) == {"metrics": 600, "rank_snapshots": 6, "events": 1, "artifacts": 1}
    assert store.metric_names(rid) == ["loss/task", "lr"]
    assert store.latest_metrics(rid)["loss/task"] == (299, pytest.approx(1 / 300))
    assert store.latest_ranks(rid) == {"fc1": [1, 8, 8, 1], "fc2": [1, 4, 1]}
    assert [h["step"] for h in store.rank_history(rid, "fc2")] == [0, 100, 200]
    (ev,) = store.events(rid)
    assert (ev["kind"], ev["text"], ev["step"]) == ("rank_change", "fc1 8->6", 150)
    assert store.events(rid, since_id=ev["id"]) == []
    (art,) = store.artifacts(rid)
    assert art["size"] == 1234 and art["exists"] and art["path"] == str(ck)


def test_sink_records_the_process_it_is_given_only_when_no_pid_is_known(store):
    rid = store.create_run("r", {})
    me = {"pid": 4242, "pid_started": 1234.5, "host": "trainer-host"}
    with StoreSink(store, rid, process=me) as sink:
        sink.set_status("running")
    run = store.get_run(rid)
    assert {k: run[k] for k in me} == me
    other = store.create_run("supervised", {})
    store.update_run(other, pid=77, pid_started=9.0, host="h")  # the supervisor's record
    with StoreSink(store, other, process=me) as sink:
        sink.set_status("running")
    run = store.get_run(other)
    assert (run["pid"], run["pid_started"], run["host"]) == (77, 9.0, "h")


def test_the_store_imports_neither_psutil_nor_the_launcher():
    """Process liveness is the launcher's: the store (and its sink) load without psutil and
    without comera_engine.launch (which imports the store: no cycle)."""
    code = textwrap.dedent(
        """
        import sys
        import comera_engine.store
        print(sorted(m for m in sys.modules if m == "psutil" or m.startswith(
            ("comera_engine.launch", "torch"))))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=60,
        check=True,
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_sink_writes_in_background_within_flush_interval(store):
    rid = store.create_run("r", {})
    reader = RunStore(store.path)  # a second connection
    sink = StoreSink(store, rid, flush_every=0.5)
    try:
        t0 = time.time()
        sink.log_metrics(0, {"a": 1.0})
        assert reader.count_metrics(rid) == 0  # buffered, not written per step
        while reader.count_metrics(rid) == 0:
            assert time.time() - t0 < 1.5, "not flushed within the flush interval"
            time.sleep(0.02)
        assert time.time() - t0 <= 0.5 + 0.3
        hb = reader.get_run(rid)["heartbeat_at"]
        assert hb is not None and hb >= t0
        time.sleep(0.7)  # heartbeats continue without new records
        assert reader.get_run(rid)["heartbeat_at"] > hb
    finally:
        sink.close()


def test_a_checkpoint_artifact_writes_through(store, tmp_path):
    rid = store.create_run("r", {})
    reader = RunStore(store.path)
    ck = tmp_path / "step_000002.safetensors"
    ck.write_bytes(b"x")
    with StoreSink(store, rid, flush_every=60) as sink:
        sink.log_metrics(1, {"a": 1.0})
        sink.log_metrics(2, {"a": 2.0})
        sink.log_artifact("export", ck)  # not a checkpoint: stays buffered
        assert reader.count_metrics(rid) == 0
        sink.log_artifact("checkpoint", ck)
        assert reader.count_metrics(rid) == 2 and len(reader.artifacts(rid)) == 2


def test_sink_keeps_records_when_a_write_fails(store, monkeypatch):
    rid = store.create_run("r", {})
    sink = StoreSink(store, rid, flush_every=60)
    sink.log_metrics(1, {"a": 1.0})
    real = store.write_batch
    def broken(*a: object, **k: object) -> None:
        raise StoreError("x")

    monkeypatch.setattr(store, "write_batch", broken)
    with pytest.raises(StoreError):
        sink.flush()
    assert sink.pending() == 1
    monkeypatch.setattr(store, "write_batch", real)
    sink.log_metrics(2, {"a": 2.0})
    sink.close()
    assert [(r["step"], r["value"]) for r in store.metrics_since(rid)] == [(1, 1.0), (2, 2.0)]


def test_nan_and_non_numeric_metrics(store):
    rid = store.create_run("r", {})
    with StoreSink(store, rid) as sink:
        sink.log_metrics(0, {"loss": float("nan"), "inf": float("inf")})
        with pytest.raises(ValueError, match="stage"):
            sink.log_metrics(1, {"stage": "early"})
    rows = {r["name"]: r["value"] for r in store.metrics_since(rid)}
    assert math.isnan(rows["loss"]) and rows["inf"] == math.inf


def test_status_rules(store):
    rid = store.create_run("r", {})
    with StoreSink(store, rid) as sink:
        sink.set_status("running")
        assert store.get_run(rid)["status"] == "running"
        store.set_status(rid, "stopping")
        sink.set_status("running")  # a pending stop wins over a late "running"
        assert store.get_run(rid)["status"] == "stopping"
        sink.set_status("stopped")
        sink.set_status("running")  # final stays final
        assert store.get_run(rid)["status"] == "stopped"
    rid2 = store.create_run("r2", {}, status="running")
    store.set_status(rid2, "crashed", "no heartbeat")
    with StoreSink(store, rid2) as sink:  # the trainer itself may correct a crash verdict
        sink.set_status("finished")
    assert store.get_run(rid2)["status"] == "finished"
    assert store.get_run(rid2)["error"] is None
    with pytest.raises(ValueError, match="status"):
        store.set_status(rid2, "exploded")


def test_resumed_attempt_replaces_rows_from_its_first_step(store):
    rid = store.create_run("r", {})
    with StoreSink(store, rid) as s1:
        for step in range(100):
            s1.log_metrics(step, {"loss": 1.0, "acc": 0.5})
        s1.log_ranks(90, {"fc": [1, 5, 1]})
    # crash after step 99; the checkpoint was at step 60, so attempt 2 starts at 61
    with StoreSink(store, rid) as s2:
        for step in range(61, 120):
            s2.log_metrics(step, {"loss": 2.0, "acc": 0.7})
    rows = store.metrics_since(rid)
    assert len(rows) == 240
    assert len({(r["step"], r["name"]) for r in rows}) == 240
    by_step = {(r["step"], r["name"]): r["value"] for r in rows}
    assert by_step[(60, "loss")] == 1.0 and by_step[(61, "loss")] == 2.0
    assert by_step[(99, "loss")] == 2.0
    assert store.rank_history(rid) == []  # the snapshot at 90 came from the lost attempt


# ------------------------------------------------------------------------------ queries


def test_metrics_since_is_incremental(store):
    rid = store.create_run("r", {})
    with StoreSink(store, rid) as sink:
        for step in range(10):
            sink.log_metrics(step, {"a": step, "b": -step})
    assert len(store.metrics_since(rid, -1)) == 20
    assert [r["step"] for r in store.metrics_since(rid, 7)] == [8, 8, 9, 9]
    assert [r["value"] for r in store.metrics_since(rid, 7, names=["b"])] == [-8, -9]
    assert store.metrics_since(rid, 9) == []


def test_median_metric_is_the_median_of_every_logged_value(store):
    """A run's typical value of a metric (its step time), against statistics.median over
    the values logged, NaN rows left out; odd and even counts; None without rows."""
    import random
    import statistics

    rng = random.Random(0)
    rid = store.create_run("r", {})
    odd = [rng.lognormvariate(-5, 0.3) for _ in range(301)]
    odd[-1] = 50.0  # the last step: a prune, a checkpoint, a busy machine
    even = [rng.uniform(0, 1) for _ in range(40)]
    with StoreSink(store, rid, flush_every=60) as sink:
        for step, v in enumerate(odd):
            sink.log_metrics(step, {"perf/step_time_s": v})
        for step, v in enumerate(even):
            sink.log_metrics(step, {"even": v if step % 7 else float("nan")})
    assert store.median_metric(rid, "perf/step_time_s") == pytest.approx(
        statistics.median(odd), rel=1e-12)
    assert store.latest_metrics(rid)["perf/step_time_s"][1] == 50.0  # what it is not
    kept = [v for i, v in enumerate(even) if i % 7]
    assert len(kept) % 2 == 0
    assert store.median_metric(rid, "even") == pytest.approx(statistics.median(kept), rel=1e-12)
    assert store.median_metric(rid, "nothing") is None
    assert store.median_metric("no-such-run", "even") is None


def test_series_downsampling_keeps_ends_and_extremes(store):
    rid = store.create_run("r", {})
    n = 50_000
    with StoreSink(store, rid, flush_every=60) as sink:
        for step in range(n):
            v = math.sin(step / 500.0)
            if step == 12_345:
                v = 42.0  # a spike
            if step == 33_333:
                v = -17.0
            sink.log_metrics(step, {"loss": v})
        sink.log_metrics(0, {"short": 1.0})
    s = store.series(rid, "loss", max_points=2000)
    assert s["total"] == n and s["downsampled"]
    assert 1000 < len(s["step"]) <= 2000
    assert s["step"] == sorted(set(s["step"]))
    assert s["step"][0] == 0 and s["step"][-1] == n - 1
    assert max(s["value"]) == 42.0 and s["step"][s["value"].index(42.0)] == 12_345
    assert min(s["value"]) == -17.0
    small = store.series(rid, "loss", max_points=10)
    assert len(small["step"]) <= 10 and 42.0 in small["value"] and -17.0 in small["value"]
    assert store.series(rid, "short") == {
        "step": [0], "value": [1.0], "total": 1, "downsampled": False
    }
    assert store.series(rid, "nothing")["step"] == []
    with pytest.raises(ValueError, match="max_points"):
        store.series(rid, "loss", max_points=2)


def test_claim_queued_respects_the_limit(store):
    a = store.create_run("a", {})
    b = store.create_run("b", {})
    assert store.claim_queued(max_active=1) == a
    assert store.claim_queued(max_active=1) is None  # a is dispatched
    store.set_status(a, "finished")
    assert store.claim_queued(max_active=1) == b
    assert store.claim_queued() is None


# ------------------------------------------------------------------------------ migrations


def test_migrations_upgrade_an_older_store_in_place(tmp_path, monkeypatch):
    path = tmp_path / "comera.db"
    st = RunStore(path)
    rid = st.create_run("kept", {"a": 1})
    st.close()

    def to_next(c: sqlite3.Connection) -> None:
        c.execute("ALTER TABLE runs ADD COLUMN colour TEXT")

    nxt = schema.SCHEMA_VERSION + 1
    monkeypatch.setattr(schema, "MIGRATIONS", [*schema.MIGRATIONS, (nxt, to_next)])
    monkeypatch.setattr(schema, "SCHEMA_VERSION", nxt)
    st2 = RunStore(path)
    assert st2.get_run(rid)["name"] == "kept" and "colour" in st2.get_run(rid)
    versions = st2.read(lambda c: [r[0] for r in c.execute("SELECT version FROM schema_version")])
    assert versions == list(range(1, nxt + 1))


def test_a_version_1_store_gains_sweeps_and_phases_and_keeps_its_runs(tmp_path, monkeypatch):
    path = tmp_path / "comera.db"
    monkeypatch.setattr(schema, "MIGRATIONS", schema.MIGRATIONS[:1])
    monkeypatch.setattr(schema, "SCHEMA_VERSION", 1)
    st = RunStore(path)
    rid = "20250101-000000-abcd"
    st.write(lambda c: c.execute(
        "INSERT INTO runs (id, name, config, status, created_at, updated_at) "
        "VALUES (?, 'old', '{\"a\": 1}', 'finished', 0, 0)", (rid,)))
    st.close()
    monkeypatch.undo()
    st2 = RunStore(path)
    run = st2.get_run(rid)
    assert run["name"] == "old" and run["folder"] is None and run["sweep_id"] is None
    assert st2.run_dir(rid) == tmp_path / rid
    sid = st2.create_sweep("s", {"a": 1}, {"comera.target_compression": [5, 10]}, 1)
    assert st2.get_sweep(sid)["status"] == "finished" and st2.list_sweeps()[0]["id"] == sid


def test_sweep_cells_wait_for_their_sweeps_parallel_limit(tmp_path):
    st = RunStore(tmp_path)
    sid = st.create_sweep("s", {}, {"x": [1, 2, 3]}, 1, max_parallel=2)
    cells = [st.create_run(f"c{i}", {}, sweep_id=sid, cell={"x": i}) for i in range(3)]
    other = st.create_run("plain", {})
    ray = st.create_sweep("r", {}, {"x": [1]}, 1, backend="ray")
    st.create_run("on-ray", {}, sweep_id=ray, cell={"x": 1})
    # two cells, then the sweep is full: the plain run goes next; Ray cells never
    assert [st.claim_queued() for _ in range(4)] == [cells[0], cells[1], other, None]
    assert st.get_sweep(sid)["counts"] == {"queued": 3}
    st.set_status(cells[0], "running")
    st.set_status(cells[0], "finished")
    assert st.claim_queued() == cells[2]
    assert st.get_run(cells[2])["cell"] == {"x": 2}
    st.set_status(cells[1], "crashed")
    st.set_status(cells[2], "finished")
    assert st.get_sweep(sid)["status"] == "failed"
    assert st.resolve_sweep(sid[len("sweep-"):]) == sid and st.resolve_sweep("s") == sid
    assert [r["id"] for r in st.sweep_runs(sid)] == cells


@pytest.mark.parametrize("statuses, expected", [
    ([], "finished"), (["queued", "queued"], "queued"), (["finished", "queued"], "running"),
    (["running", "stopped"], "running"), (["finished", "finished"], "finished"),
    (["finished", "stopped"], "stopped"), (["stopped", "crashed"], "failed"),
])
def test_sweep_status_reads_its_cells(statuses, expected):
    from comera_engine.store import sweep_status

    assert sweep_status(statuses) == expected


def test_phase_and_foreign_folder_are_recorded(tmp_path):
    st = RunStore(tmp_path / "s")
    rid = st.create_run("fg", {}, "running", folder=tmp_path / "elsewhere")
    assert st.run_dir(rid) == tmp_path / "elsewhere"
    assert st.run_for_folder(tmp_path / "elsewhere") == rid
    plain = st.create_run("p", {})
    assert st.run_for_folder(st.run_dir(plain)) == plain
    assert st.run_for_folder(tmp_path / "nowhere") is None
    st.set_phase(rid, "training", 1.7)
    run = st.get_run(rid)
    assert (run["phase"], run["phase_progress"]) == ("training", 1.0)
    with pytest.raises(ValueError, match="phase"):
        st.set_phase(rid, "napping")


def test_newer_schema_is_refused_untouched(tmp_path):
    path = tmp_path / "comera.db"
    RunStore(path).close()
    con = sqlite3.connect(path)
    con.execute("INSERT INTO schema_version VALUES (99, 0)")
    con.commit()
    con.close()
    before = _sha(path)
    with pytest.raises(StoreError, match="newer"):
        RunStore(path)
    assert _sha(path) == before


# ------------------------------------------------------------------------------ foreign files


def _sqlite_file(p: Path, *statements: str) -> None:
    con = sqlite3.connect(p)
    for sql in statements:
        con.execute(sql)
    con.commit()
    con.close()


def _foreign_sqlite(p: Path) -> None:
    _sqlite_file(
        p,
        "CREATE TABLE customers (id INTEGER, name TEXT)",
        "INSERT INTO customers VALUES (1, 'ada')",
    )


def _other_app(p: Path) -> None:
    _sqlite_file(
        p, "PRAGMA application_id = 1234", "CREATE TABLE comera_meta (key TEXT, value TEXT)"
    )


def _garbage(p: Path) -> None:
    p.write_bytes(os.urandom(8192))


def _text(p: Path) -> None:
    p.write_text("name = 'this is a TOML file, not a database'\n" * 50)


def _truncated(p: Path) -> None:
    st = RunStore(p)
    st.create_run("r", {})
    st.close()
    data = p.read_bytes()
    p.write_bytes(data[:60])


@pytest.mark.parametrize(
    "make, message",
    [
        (_garbage, "not a SQLite database"),
        (_text, "not a SQLite database"),
        (_truncated, "not a SQLite database"),
        (_foreign_sqlite, "not a CoMERA run store"),
        (_other_app, "another application"),
    ],
)
def test_foreign_or_corrupt_file_is_refused_and_never_written(tmp_path, make, message):
    path = tmp_path / "comera.db"
    make(path)
    before, size = _sha(path), path.stat().st_size
    with pytest.raises(StoreError, match=message) as exc:
        RunStore(path)
    assert isinstance(exc.value, ValueError)
    assert str(path) in str(exc.value)
    assert _sha(path) == before and path.stat().st_size == size
    assert not (tmp_path / "comera.db-wal").exists()


def test_corrupt_pages_give_a_clear_error_and_file_is_untouched(tmp_path):
    path = tmp_path / "comera.db"
    st = RunStore(path)
    rid = st.create_run("r", {})
    with StoreSink(st, rid, flush_every=60) as sink:
        for step in range(3000):
            sink.log_metrics(step, {"loss": 1.0, "acc": 2.0})
    st.read(lambda c: c.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall())
    st.close()
    data = bytearray(path.read_bytes())
    page = 4096
    assert len(data) > 10 * page
    data[2 * page :] = os.urandom(len(data) - 2 * page)  # keep the header and the schema page
    path.write_bytes(bytes(data))
    before = _sha(path)
    with pytest.raises(StoreError, match="corrupt"):
        s2 = RunStore(path)
        s2.metrics_since(rid)
        s2.series(rid, "loss")
        s2.list_runs()
    assert _sha(path) == before


def test_an_open_store_follows_a_repaired_file(tmp_path):
    """A long-lived store (the dashboard's) whose file ``comera repair`` moved aside and
    rebuilt reads the rebuilt file, not the damaged one its connection was opened on;
    a path with no file for a moment keeps the open connection (none is created)."""
    path = tmp_path / "comera.db"
    st = RunStore(path)
    old = st.create_run("old", {})
    assert [r["id"] for r in st.list_runs()] == [old]
    for suffix in ("", "-wal", "-shm"):  # as repair moves a damaged store aside
        src = path.with_name(path.name + suffix)
        if src.exists():
            os.replace(src, path.with_name(f"{path.name}.damaged{suffix}"))
    assert [r["id"] for r in st.list_runs()] == [old] and not path.exists()
    with RunStore(path) as rebuilt:
        new = rebuilt.create_run("new", {})
    assert [r["id"] for r in st.list_runs()] == [new]
    st.set_status(new, "running")  # and writes go to the rebuilt file
    with RunStore(path, create=False) as again:
        assert again.get_run(new)["status"] == "running"
    st.close()


# ------------------------------------------------------------------------------ processes

_WRITER = textwrap.dedent(
    """
    import sys, time
    from comera_engine.store import RunStore, StoreSink
    path, rid, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    sink = StoreSink(RunStore(path), rid, flush_every=0.01)  # many small transactions
    sink.set_status("running")
    for step in range(steps):
        sink.log_metrics(step, {"loss": 1.0 / (step + 1), "acc": step % 10, "lr": 1e-3})
        if step % 10 == 0:
            sink.log_ranks(step, {"fc1": [1, 8, 8, 1], "fc2": [1, 6, 1]})
        if step % 100 == 0:
            sink.log_event("info", f"step {step}", step)
        if step % 50 == 0:
            time.sleep(0.01)
    sink.set_status("finished")
    sink.close()
    """
)

_READER = textwrap.dedent(
    """
    import json, sys, time
    from comera_engine.store import RunStore, FINAL_STATUSES
    path, ids = sys.argv[1], sys.argv[2].split(",")
    st = RunStore(path, create=False)
    seen = {rid: set() for rid in ids}
    last = {rid: -1 for rid in ids}
    dup = polls = 0
    t0 = time.time()
    while time.time() - t0 < 60:
        polls += 1
        runs = {r["id"]: r for r in st.list_runs()}
        for rid in ids:
            for r in st.metrics_since(rid, last[rid]):
                key = (r["step"], r["name"])
                dup += key in seen[rid]
                seen[rid].add(key)
                last[rid] = max(last[rid], r["step"])
            st.series(rid, "loss", max_points=200)
            st.latest_ranks(rid)
        if all(runs[rid]["status"] in FINAL_STATUSES for rid in ids):
            # one more pass after the final status: the last batch is committed with it
            for rid in ids:
                for r in st.metrics_since(rid, last[rid]):
                    key = (r["step"], r["name"])
                    dup += key in seen[rid]
                    seen[rid].add(key)
            break
    print(json.dumps({"polls": polls, "dup": dup, "seen": {k: len(v) for k, v in seen.items()}}))
    """
)


def test_three_writers_and_a_polling_reader_lose_and_duplicate_nothing(store):
    steps = 2500
    ids = [store.create_run(f"w{i}", {}) for i in range(3)]
    reader = subprocess.Popen(
        [sys.executable, "-c", _READER, str(store.path), ",".join(ids)],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(store.path), rid, str(steps)],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rid in ids
    ]
    outs = [w.communicate(timeout=90) for w in writers]
    rout, rerr = reader.communicate(timeout=90)
    for w, (_, err) in zip(writers, outs):
        assert w.returncode == 0, err
        assert "locked" not in err and "comera store" not in err, err
    assert reader.returncode == 0, rerr
    assert "locked" not in rerr
    summary = json.loads(rout)
    assert summary["dup"] == 0 and summary["polls"] >= 3
    fresh = RunStore(store.path)
    for rid in ids:
        assert fresh.get_run(rid)["status"] == "finished"
        assert fresh.counts(rid) == {
            "metrics": 3 * steps,
            "rank_snapshots": 2 * (steps // 10),
            "events": steps // 100,
            "artifacts": 0,
        }
        rows = fresh.metrics_since(rid)
        assert len({(r["step"], r["name"]) for r in rows}) == 3 * steps
        assert summary["seen"][rid] == 3 * steps  # the reader, polling, saw every row once


def test_a_new_reader_process_sees_every_run_and_status(store):
    expected = {}
    for status in ("queued", "running", "stopping", "finished", "stopped", "failed",
                   "diverged", "crashed"):
        rid = store.create_run(f"run-{status}", {"s": status})
        if status != "queued":
            store.set_status(rid, status, "boom" if status == "failed" else None)
        expected[rid] = status
    code = (
        "import json, sys; from comera_engine.store import RunStore; "
        "st = RunStore(sys.argv[1], create=False); "
        "print(json.dumps({r['id']: [r['status'], r['name'], r['error']] "
        "for r in st.list_runs()}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(store.path)],
        env=_env(), capture_output=True, text=True, check=True, timeout=60,
    )
    seen = json.loads(out.stdout)
    assert {k: v[0] for k, v in seen.items()} == expected
    failed = next(v for v in seen.values() if v[0] == "failed")
    assert failed[2] == "boom"


# ---------------------------------------------------------------------- the lifecycle


def test_every_transition_of_the_table_and_no_other(tmp_path: Path) -> None:
    """Each action of ``store.lifecycle.TRANSITIONS`` from every status to every status:
    it applies exactly where the table allows it (and sets what the table says), leaves
    the run as it was elsewhere, and refuses a status it never sets before writing."""
    from comera_engine.store.lifecycle import TRANSITIONS, TransitionError, allowed

    store = RunStore(tmp_path)
    rid = store.create_run("r", {})
    life = store.lifecycle(rid)
    tried = 0
    for action, (sources, targets) in TRANSITIONS.items():
        assert sources <= set(STATUSES) and targets <= set(STATUSES), action
        for current in STATUSES:
            for status in STATUSES:
                store.set_status(rid, current, None, dispatched_at=None)  # the primitive
                if status not in targets:
                    with pytest.raises(TransitionError, match=action):
                        life.transition(action, status)
                    assert store.get_run(rid)["status"] == current
                    continue
                changed = life.transition(action, status, event=("test", action))
                assert changed == allowed(action, current, status) == (current in sources)
                assert store.get_run(rid)["status"] == (status if changed else current)
                tried += 1
    assert tried == sum(len(t) for _, t in TRANSITIONS.values()) * len(STATUSES)
    assert len(store.events(rid)) == sum(len(s) * len(t) for s, t in TRANSITIONS.values())
    # a stale writer moves nothing: ``where`` must still hold, the owner must still own it
    store.set_status(rid, "running", None, attempt=2, pid=7, host="h", pid_started=None)
    assert not life.crash("gone", where={"attempt": 1})
    with pytest.raises(StoreError, match="owned by pid 7"):
        store.lifecycle(rid, {"pid": 8, "host": "h", "pid_started": None}).end("failed")
    assert store.get_run(rid)["status"] == "running"


def test_no_status_write_or_sql_outside_the_store() -> None:
    """Statuses change only through ``store.lifecycle``; SQL is written only in store/."""
    import re

    pattern = re.compile(r"only_from|\.execute(many|script)?\(|\bUPDATE runs\b|INSERT INTO|"
                         r"\bst(ore)?\.set_status\(|\bsqlite3\b")
    found = []
    for folder in ("comera_engine", "app"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if (ROOT / "comera_engine" / "store") in path.parents:
                continue
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if pattern.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)
