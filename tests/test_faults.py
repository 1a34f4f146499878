"""The fault list (issue 21): bad configs, flags, files and homes. Every one is refused
with exit code 2 and one line on stderr naming what is wrong, no traceback, and the run
store is left as it was (or not created at all).

Then an unlucky machine (issue 33), one test per item: two runs sharing the cores, a
damaged store under a live run, oversized configs and flags, a full disk, a frozen
trainer, a closed terminal, a read-only home, a resume that cannot work, a deleted run
folder, names, checkpoint checksums and the run lock."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from comera_engine.cli import main
from comera_engine.config import nesting, read
from comera_engine.store import RunStore
from tests.store_checks import frozen_lock_holder
from tests.test_launch import store  # the fixture: a store whose processes are reaped

__all__ = ["store"]

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "experiments" / "configs" / "digits_tt_mlp.toml"

#: ``--set`` overrides for ``comera launch``, and the field the one line must name.
BAD_SETTINGS = [
    ('model.name="nope"', "model.name"),
    ('model.preset="huge"', "model.preset"),
    ("model.rank=0", "model.rank"),
    ("model.rank=-3", "model.rank"),
    ("model.dropout=1.5", "model.dropout"),
    ('model.tt_layers=["nope"]', "model.tt_layers"),
    ("model.d_model=64", "model.d_model"),
    ("model.hidden=[0, 4]", "model.hidden"),
    ("comera.gamma=-1", "comera.gamma"),
    ("comera.tau=2", "comera.tau"),
    ("comera.target_compression=0.5", "comera.target_compression"),
    ("comera.target_compression=1e9", "comera.target_compression"),
    ('comera.target_scope="all"', "comera.target_scope"),
    ('comera.switch="later"', "comera.switch"),
    ("comera.lr_cores=0", "comera.lr_cores"),
    ("comera.lr_embedding=-1e-3", "comera.lr_embedding"),
    ("comera.switch_by=0", "comera.switch_by"),
    ("comera.reach_at=1.5", "comera.reach_at"),
    ("comera.switch_by=0.9", "comera.switch_by"),
    ("comera.headroom=0.5", "comera.headroom"),
    ("comera.plateau_patience=0", "comera.plateau_patience"),
    ("train.steps=0", "train.steps"),
    ("train.batch_size=0", "train.batch_size"),
    ("train.batch_size=1e9", "train.batch_size"),
    ('train.precision="fp8"', "train.precision"),
    ('train.device="tpu"', "train.device"),
    ("train.keep_checkpoints=0", "train.keep_checkpoints"),
    ("train.grad_clip=-1", "train.grad_clip"),
    ("train.eval_every=-5", "train.eval_every"),
    ('data.name="nope"', "data.name"),
    ("data.bogus=1", "data.bogus"),
    ("data.split_fraction=1.0", "data.split_fraction"),
    ("foo.bar=1", "foo"),
    ("train.steps", "--set"),  # no '='
    ("train.steps=[1,", "train.steps"),  # not a TOML value: read as text
]


def _seeded_store(tmp_path: Path) -> RunStore:
    st = RunStore(tmp_path / "home" / "comera.db")
    rid = st.create_run("kept", {"name": "kept"}, "stopped")
    st.log_event(rid, "info", "seeded")
    return st


def _snapshot(st: RunStore) -> tuple:
    runs = st.list_runs()
    return (tuple((r["id"], r["status"]) for r in runs),
            tuple(len(st.events(r["id"])) for r in runs),
            tuple(sorted(p.name for p in (st.path.parent).iterdir())))


def _refused(argv: list[str], capsys: pytest.CaptureFixture, field: str) -> None:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own refusals leave through SystemExit
        code = exc.code
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert code == 2, (argv, code, out.err[-500:])
    assert len(lines) == 1 and "Traceback" not in out.err, lines
    assert field in lines[0], lines[0]


@pytest.mark.parametrize("setting,field", BAD_SETTINGS, ids=[s for s, _ in BAD_SETTINGS])
def test_bad_setting_is_one_line_exit_2_and_the_store_unchanged(
        setting: str, field: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    st = _seeded_store(tmp_path)
    before = _snapshot(st)
    _refused(["launch", str(CONFIG), "--set", setting, "--store", str(st.path)], capsys, field)
    assert _snapshot(st) == before


def _bad_files(tmp_path: Path) -> list[tuple[str, Path, str]]:
    broken = tmp_path / "broken.toml"
    broken.write_text('name = "x"\n[model\nname = "tt_mlp"\n')
    latin = tmp_path / "latin1.toml"
    latin.write_bytes(CONFIG.read_text().replace("digits-tt-mlp", "caf\u00e9").encode("latin-1"))
    folder = tmp_path / "folder.toml"
    folder.mkdir()
    extra = tmp_path / "extra.toml"
    extra.write_text(CONFIG.read_text() + "\n[foo]\nbar = 1\n")
    return [("missing", tmp_path / "missing.toml", "config"),
            ("not TOML", broken, "config"),
            ("not UTF-8", latin, "config"),
            ("a folder", folder, "config"),
            ("unknown table", extra, "foo")]


@pytest.mark.parametrize("which", ["missing", "not TOML", "not UTF-8", "a folder",
                                   "unknown table"])
def test_bad_config_file_is_one_line_exit_2(which: str, tmp_path: Path,
                                            capsys: pytest.CaptureFixture) -> None:
    st = _seeded_store(tmp_path)
    before = _snapshot(st)
    _, path, field = next(f for f in _bad_files(tmp_path) if f[0] == which)
    for command in ("launch", "train"):
        argv = [command, str(path), "--store", str(st.path)]
        if command == "train":
            argv = [command, str(path), "--run-dir", str(tmp_path / "run"), "--no-progress"]
        _refused(argv, capsys, field)
    assert _snapshot(st) == before and not (tmp_path / "run").exists()


BAD_FLAGS = [
    (["launch", "{cfg}", "--nproc", "0"], "nproc"),
    (["launch", "{cfg}", "--gpus", "a,b"], "gpus"),
    (["launch", "{cfg}", "--name", " "], "name"),
    (["runs", "--limit", "-1"], "--limit"),
    (["runs", "--status", "bogus"], "--status"),
    (["logs", "no-such-run"], "no-such-run"),
    (["stop", "no-such-run"], "no-such-run"),
    (["resume", "no-such-run"], "no-such-run"),
    # issue 33, item 3: a number past any sensible value (no OverflowError)
    (["runs", "--limit", str(10**20)], "--limit"),
    (["logs", "x", "--tail", str(10**20)], "--tail"),
    (["stop", "x", "--timeout", "nan"], "--timeout"),
    (["stop", "x", "--timeout", "1e308"], "--timeout"),
    (["launch", "{cfg}", "--nproc", str(10**20)], "--nproc"),
    (["launch", "{cfg}", "--max-concurrent", str(10**20)], "--max-concurrent"),
    (["sweep", "{cfg}", "--grid", "train.seed=1", "--seeds", str(10**20)], "--seeds"),
]


@pytest.mark.parametrize("argv,field", BAD_FLAGS, ids=[" ".join(a[:3])[:40] for a, _ in BAD_FLAGS])
def test_bad_flag_is_one_line_exit_2(argv: list[str], field: str, tmp_path: Path,
                                     capsys: pytest.CaptureFixture) -> None:
    st = _seeded_store(tmp_path)
    before = _snapshot(st)
    argv = [a.replace("{cfg}", str(CONFIG)) for a in argv] + ["--store", str(st.path)]
    _refused(argv, capsys, field)
    assert _snapshot(st) == before


@pytest.mark.parametrize("home", ["plain file", "under /proc"])
def test_unusable_home_is_one_line_exit_2(home: str, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture) -> None:
    if home == "plain file":
        path = tmp_path / "plain"
        path.write_text("not a folder")
    else:
        path = Path("/proc/comera-home")
    monkeypatch.setenv("COMERA_HOME", str(path))
    _refused(["launch", str(CONFIG)], capsys, str(path))
    assert not os.path.isdir(path)


# ------------------------------------------------------------------ issue 33
# Runs survive an unlucky machine. Each test below is one item of the issue; the
# promises and their tests are listed in docs/RELIABILITY.md.


def _no_supervisor(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Dispatch without starting processes: ``subprocess.Popen`` of the launcher is a
    stand-in (the thread budget is decided at dispatch, before any process starts)."""
    from comera_engine.launch import runs as launcher

    started: list[str] = []

    class _Proc:
        pid = 0

        def __init__(self, cmd: list[str], **kwargs: object) -> None:
            started.append(cmd[-1])

        def wait(self) -> int:
            return 0

    monkeypatch.setattr(launcher, "subprocess", types.SimpleNamespace(
        Popen=_Proc, DEVNULL=subprocess.DEVNULL, STDOUT=subprocess.STDOUT))
    return started


def test_two_launched_runs_split_the_cores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture) -> None:
    """Item 1: each launched run gets cores // runs in flight threads, recorded in its
    launch environment, logged as an event; the second launch says it shares the
    machine; a run whose environment sets OMP_NUM_THREADS keeps it."""
    import torch

    from comera_engine.launch import recorded_env
    from comera_engine.train.threads import ThreadBudget

    started = _no_supervisor(monkeypatch)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    db = tmp_path / "home" / "comera.db"
    argv = ["launch", str(CONFIG), "--set", "train.steps=5", "--store", str(db)]
    assert main(argv) == 0
    first = capsys.readouterr()
    assert main(argv) == 0
    second = capsys.readouterr()
    st = RunStore(db)
    a, b = first.out.strip(), second.out.strip()
    assert started == [a, b]
    env_a, env_b = recorded_env(st.run_dir(a)), recorded_env(st.run_dir(b))
    assert env_a["OMP_NUM_THREADS"] == str(cores)
    assert env_b["OMP_NUM_THREADS"] == str(max(1, cores // 2))
    assert "shares this machine" not in first.err
    assert f"{max(1, cores // 2)} thread(s) for it" in second.err
    assert "2 run(s) in flight" in st.events(b, kinds=["threads"])[0]["text"]
    from app.lib.runs import notices  # the Live run page shows it

    assert ("info", "CPU threads: " + st.events(b, kinds=["threads"])[0]["text"]) in \
        notices(st, st.get_run(b))
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's own setting is kept
    assert main(argv) == 0
    c = capsys.readouterr().out.strip()
    assert recorded_env(st.run_dir(c))["OMP_NUM_THREADS"] == "3"
    assert st.events(c, kinds=["threads"]) == []
    # the trainer follows the runs in flight: two, then one
    runs, seen = [2], []
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # a known start, below both budgets, whatever the machine's
    budget = ThreadBudget(lambda: runs[0], cores=4, every=0.01,
                          on_change=lambda t, n, step: seen.append((t, n)))
    try:
        for want, n in ((2, 2), (4, 1)):
            runs[0] = n
            for _ in range(500):
                budget.log_metrics(1, {})
                if torch.get_num_threads() == want:
                    break
                time.sleep(0.01)
            assert torch.get_num_threads() == want
    finally:
        budget.close()
        torch.set_num_threads(before)
    assert seen == [(2, 2), (4, 1)]


def _deep(n: int) -> str:
    return "[" * n + "]" * n


@pytest.mark.parametrize("case", ["million-entry list (file)", "million-entry list (--set)",
                                  "list of 300 (file)", "5000-deep (file)",
                                  "5000-deep (--set)", "7-deep (file)"])
def test_oversized_configs_are_refused_before_anything_is_built(
        case: str, tmp_path: Path, capsys: pytest.CaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 3: size, list length and nesting are bounded before the config is built:
    exit 2, one line naming the field, for ``launch`` and ``train``. Deep nesting is
    refused before ``tomllib`` sees it (a parse that reaches the recursion limit once broke
    a finalizer the garbage collector ran at that depth)."""
    parsed = []
    loads = read.tomllib.loads
    monkeypatch.setattr(read.tomllib, "loads",
                        lambda text: parsed.append(text) or loads(text))
    text = CONFIG.read_text()
    where, sets = "config", []
    if case == "million-entry list (file)":
        text = text.replace("[model]", "[model]\nhidden = [" + ",".join(["8"] * 10**6) + "]")
    elif case == "million-entry list (--set)":
        sets, where = ["--set", "model.hidden=[" + ",".join(["8"] * 10**6) + "]"], "--set"
    elif case == "list of 300 (file)":
        text = text.replace("[model]", "[model]\nhidden = [" + ",".join(["8"] * 300) + "]")
        where = "model.hidden"
    elif case == "5000-deep (file)":
        text = text.replace("[model]", f"[model]\nhidden = {_deep(5000)}")
    elif case == "5000-deep (--set)":
        sets, where = ["--set", f"model.hidden={_deep(5000)}"], "--set"
    else:
        text = text.replace("[model]", f"[model]\nhidden = {_deep(7)}")
        where = "model.hidden"
    path = tmp_path / "c.toml"
    path.write_text(text)
    db = tmp_path / "home" / "comera.db"
    _refused(["launch", str(path), *sets, "--store", str(db)], capsys, where)
    _refused(["train", str(path), *sets, "--run-dir", str(tmp_path / "run"), "--no-progress"],
             capsys, where)
    assert not db.exists() and not (tmp_path / "run").exists()
    assert not any("[" * 100 in text for text in parsed)


@pytest.mark.parametrize("value", [
    "1", "[1, [2, [3]]]", "{b = {c = [[1], [2]]}}", "[]", "[[[{}]]]  # ]]] [[[",
    '["[[[[", \'{{\', """\n]]] [[[ \n""", \'\'\'[[\'\'\', [{a = "}}"}]]',
])
def test_bracket_depth_counts_what_tomllib_recurses_into(value: str) -> None:
    """The depth counted without parsing is the depth of the parsed inline value (what
    tomllib recurses into); brackets in strings and comments count nothing, and a table
    header counts its own brackets, closed on its line."""
    def depth(item: object) -> int:
        if isinstance(item, dict | list):
            inner = item.values() if isinstance(item, dict) else item
            return 1 + max((depth(v) for v in inner), default=0)
        return 0
    for text in (f"v = {value}", f"[t]\n[[u]]\nv = {value}\n[w]\nx = 1"):
        parsed = read.tomllib.loads(text)
        inner = parsed["v"] if "v" in parsed else parsed["u"][0]["v"]
        assert nesting.bracket_depth(text) == max(depth(inner), 2 if "[[u]]" in text else 0)


def test_a_long_value_is_cut_in_the_message(tmp_path: Path,
                                            capsys: pytest.CaptureFixture) -> None:
    """Item 3: an unknown data.name of 120 KB is named, not echoed whole."""
    path = tmp_path / "c.toml"
    path.write_text(CONFIG.read_text().replace('name = "digits"', f'name = "{"a" * 120_000}"'))
    assert "a" * 120_000 in path.read_text()
    _refused(["launch", str(path), "--store", str(tmp_path / "h")], capsys, "data.name")
    _refused(["launch", str(CONFIG), "--set", f'data.{"b" * 3000}=1', "--store",
              str(tmp_path / "h")], capsys, "data.bbbb")
    for argv in (["launch", str(path), "--store", str(tmp_path / "h")],
                 ["logs", "r" * 100_000, "--store", str(_seeded_store(tmp_path).path)]):
        assert main(argv) == 2
        assert len(capsys.readouterr().err) < 1000


def _jsonl_steps(run_dir: Path) -> list[int]:
    from comera_engine.metrics import read_jsonl

    return [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")
            if r.get("type") == "metrics" and "loss/task" in r["values"]]


def _newest_checkpoint(run_dir: Path) -> int | None:
    from comera_engine.launch import checkpoint_steps

    steps = checkpoint_steps(run_dir)
    return steps[-1] if steps else None


def _own_terminal() -> None:
    """In the child, before exec: a new session whose controlling terminal is the pty
    on its stdin (as a shell in a terminal window has), so closing the window hangs it
    up and the kernel sends SIGHUP."""
    import fcntl
    import termios

    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def test_closing_the_terminal_stops_a_foreground_run_like_ctrl_c(store: RunStore) -> None:
    """Item 6 (issue 33), made real by issue 48: a foreground ``comera train`` in a pty
    that is its controlling terminal; the terminal is closed (no signal sent by hand:
    the hangup's SIGHUP comes from the kernel). Exit 0, ``stopped`` with no error, a
    checkpoint at its last step, every step of ``metrics.jsonl`` in the store (steps
    1..N), nothing written to the dead terminal raised; ``comera resume`` then goes on
    from that checkpoint."""
    import select
    import threading

    from comera_engine.launch import resume, stop
    from tests.test_launch import LONG, START_TIMEOUT, _steps, wait_for

    master, slave = os.openpty()
    run_dir, home = store.path.parent / "fg", store.path.parent
    cmd = [sys.executable, "-m", "comera_engine.cli", "train", str(CONFIG), "--run-dir",
           str(run_dir), "--store", str(home), *[a for s in LONG for a in ("--set", s)]]
    proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave,
                            preexec_fn=_own_terminal, env={**os.environ, "PYTHONPATH": str(ROOT)})
    os.close(slave)
    closing = threading.Event()

    def drain() -> None:  # the terminal window, reading what the run prints
        while not closing.is_set():
            if select.select([master], [], [], 0.1)[0]:
                try:
                    os.read(master, 65536)
                except OSError:
                    return

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        wait_for(lambda: (run_dir / "metrics.jsonl").exists() and len(_jsonl_steps(run_dir))
                 >= 30, START_TIMEOUT, "30 steps")
        closing.set()
        reader.join()
        os.close(master)  # the terminal window closes: the kernel hangs the pty up
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    (run,) = store.list_runs()
    assert run["status"] == "stopped" and run["error"] is None, run["error"]
    steps = _jsonl_steps(run_dir)
    assert steps == list(range(1, len(steps) + 1))
    assert _steps(store, run["id"]) == steps
    assert _newest_checkpoint(run_dir) == steps[-1] == run["last_step"]
    assert resume(run["id"], store=store) == run["id"]  # as a user would, from its folder
    wait_for(lambda: (store.get_run(run["id"])["last_step"] or 0) > steps[-1] + 5,
             START_TIMEOUT, "steps after the resume")
    assert stop(run["id"], timeout=60, store=store) == "stopped"
    again = _jsonl_steps(run_dir)
    assert again == list(range(1, len(again) + 1)) == _steps(store, run["id"])


def test_a_frozen_trainer_shows_stalled_and_stop_wakes_it_for_its_checkpoint(
        store: RunStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 5: a launched trainer frozen by SIGSTOP (its supervisor still beating the
    heartbeat) is ``stalled`` in ``comera runs`` once it has made no step for the floor
    (``COMERA_STALL_S``, lowered here from 60 s); a running one is not; ``comera stop``
    sends SIGCONT first, so the run ends ``stopped`` with a checkpoint at its last step
    and steps 1..N in the store."""
    from comera_engine.launch import launch, stop
    from tests.test_launch import LONG, START_TIMEOUT, _steps, wait_for

    monkeypatch.setenv("COMERA_STALL_S", "2")
    st = store
    rid = launch(CONFIG, [*LONG, "train.ckpt_every=0"], store=st)
    wait_for(lambda: (st.get_run(rid)["last_step"] or 0) >= 30, START_TIMEOUT, "30 steps")
    run = st.get_run(rid)
    assert st.stalled_for(run) is None
    os.kill(run["pid"], signal.SIGSTOP)
    wait_for(lambda: st.stalled_for(st.get_run(rid)) is not None, 60, "stalled", 0.2)
    frozen = st.get_run(rid)
    assert frozen["status"] == "running"
    assert time.time() - frozen["heartbeat_at"] < 5  # the supervisor keeps beating
    table = _runs_table(st)
    assert "running · stalled" in table and f"at step {frozen['last_step']}" in table
    from app.lib.runs import notices  # the Live run page's banners

    assert any(level == "warning" and text.startswith("Stalled: no step for")
               for level, text in notices(st, st.get_run(rid)))
    assert stop(rid, timeout=30, store=st) == "stopped"
    steps = _steps(st, rid)
    assert steps == list(range(1, len(steps) + 1))
    assert _newest_checkpoint(st.run_dir(rid)) == steps[-1]
    assert st.stalled_for(st.get_run(rid)) is None


def test_a_store_whose_write_lock_a_frozen_process_holds_is_still_listed(
        store: RunStore, capsys: pytest.CaptureFixture) -> None:
    """A process stopped in the middle of a write holds the store's write lock (here a
    SIGSTOPped one that took it): ``comera runs`` waits a moment for housekeeping, says in
    one line that it listed without it, and lists what is recorded (reads need no lock),
    as ``comera sweeps`` does; once the process goes on, housekeeping runs again."""
    from comera_engine.launch.cli import HOUSEKEEPING_WAIT_S

    rid = store.create_run("listed", {"name": "listed"}, "queued")
    with frozen_lock_holder(store.path):
        t0 = time.monotonic()
        assert main(["runs", "--store", str(store.path)]) == 0
        took = time.monotonic() - t0
        out, err = capsys.readouterr()
        assert rid in out and "queued" in out  # listed as recorded
        assert err.count("\n") == 1 and "stayed locked" in err and "without" in err
        assert took < HOUSEKEEPING_WAIT_S + 10  # not the store's 30 s wait
        assert main(["sweeps", "--store", str(store.path)]) == 0  # the other listing
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "stayed locked" in err
    assert main(["runs", "--store", str(store.path)]) == 0
    assert capsys.readouterr().err == ""  # the lock is free: housekeeping, no note


def test_stop_wakes_a_trainer_frozen_in_a_store_write_before_it_writes(
        store: RunStore) -> None:
    """``comera stop`` of a run whose trainer froze while it held the store's write lock:
    the stop request is a write, so ``stop`` wakes the trainer first (SIGCONT); the
    trainer finishes its write, the request gets the lock at once (not after the store's
    30 s wait, which ended in an error) and the trainer is signalled to stop."""
    from comera_engine.launch import stop

    holder = subprocess.Popen(
        [sys.executable, "-c", "import sqlite3, sys, time\n"
         "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
         "sys.stdin.readline(); c.execute('BEGIN IMMEDIATE'); print('held', flush=True)\n"
         "time.sleep(0.5); c.execute('COMMIT'); time.sleep(120)",
         str(store.path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        rid = store.create_run("frozen", {"name": "frozen"}, "running")
        store.update_run(rid, pid=holder.pid)  # the run's trainer
        holder.stdin.write("go\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "held"
        os.kill(holder.pid, signal.SIGSTOP)  # frozen in the middle of its write
        t0 = time.monotonic()
        assert stop(rid, timeout=5, store=store, wait=False) == "stopping"
        assert time.monotonic() - t0 < 10
        assert holder.wait(timeout=10) == -signal.SIGTERM  # woken, then told to stop
    finally:
        holder.kill()
        holder.wait()


def _runs_table(st: RunStore) -> str:
    """``comera runs`` as it prints (in this process)."""
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["runs", "--store", str(st.path)]) == 0
    return buf.getvalue()


@pytest.fixture
def small_disk(tmp_path: Path):  # noqa: ANN201
    """A 3 MB tmpfs where this process may mount one (``None`` elsewhere: the test then
    simulates ENOSPC), unmounted afterwards."""

    folder = tmp_path / "small"
    folder.mkdir()
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs",
                                  str(folder)], capture_output=True).returncode == 0
    except OSError:  # no mount command
        mounted = False
    yield folder if mounted else None
    if mounted:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def _no_tmp_files(folder: Path) -> list[str]:
    return [str(p) for p in folder.rglob("*") if ".tmp" in p.name]


def test_a_full_disk_is_one_line_and_leaves_nothing_half_written(
        small_disk: Path | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    """Item 4, on a real 3 MB file system where it can be mounted (else ENOSPC
    simulated): ``comera launch`` into a home without room for a checkpoint is refused
    in one line, before a run folder exists; a foreground run that fills the disk ends
    ``failed`` with ``disk full: free N MB in FOLDER`` as its error and one line on
    stderr, no ``.tmp`` file, and the store and ``metrics.jsonl`` hold the same steps;
    ``comera resume`` on the still-full disk is refused in one line and accepted once
    there is room."""
    import errno

    from comera_engine.launch import resume
    from tests.test_launch import LONG, _steps

    home = small_disk or tmp_path / "home"
    if small_disk is None:  # no tmpfs here: the disk has no room, by its own account
        import shutil

        from comera_engine.train import checkpoint

        real = shutil.disk_usage
        full = [True]
        monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1 << 20)
                            if full[0] else real(p))
        save = checkpoint.save_file

        def save_file(tensors, path, metadata=None):  # noqa: ANN001, ANN202
            save(tensors, path, metadata=metadata)  # a half-written file, then no room
            raise OSError(errno.ENOSPC, "No space left on device", path)

        monkeypatch.setattr(checkpoint, "save_file", save_file)
    _refused(["launch", str(CONFIG), "--store", str(home)], capsys, "disk full: free")
    assert not home.exists() or [p.name for p in home.iterdir()] in ([], ["comera.db"])
    run_dir = home / "run"
    argv = ["train", str(CONFIG), "--run-dir", str(run_dir), "--store", str(home),
            "--no-progress", *[a for s in [*LONG, "train.ckpt_every=50"] for a in ("--set", s)]]
    if small_disk is not None:
        out = subprocess.run([sys.executable, "-m", "comera_engine.cli", *argv],
                             capture_output=True, text=True, timeout=300,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        code, err = out.returncode, out.stderr
    else:
        code, err = main(argv), capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert [ln for ln in err.splitlines() if "error" in ln] == [
        next(ln for ln in err.splitlines() if ln.startswith("comera: error: disk full: free"))]
    st = RunStore(home, create=False)
    (run,) = st.list_runs()
    assert run["status"] == "failed"
    assert run["error"].startswith("disk full: free ") and f"MB in {run_dir}" in run["error"]
    assert "\n" not in run["error"] and _no_tmp_files(home) == []
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert all(json.loads(line) for line in lines)  # no half-written record
    steps, stored = _jsonl_steps(run_dir), _steps(st, run["id"])
    assert steps == list(range(1, len(steps) + 1)) and stored == list(range(1, len(stored) + 1))
    assert _newest_checkpoint(run_dir) <= min(len(steps), len(stored))
    if small_disk is None:  # the trainer ran in this process, which lives on
        st.update_run(run["id"], pid=None, pid_started=None)
    with pytest.raises(ValueError, match="disk full: free"):
        resume(run["id"], store=st)
    assert st.get_run(run["id"])["status"] == "failed"
    if small_disk is not None:
        subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    else:
        full[0] = False
    _no_supervisor(monkeypatch)
    assert resume(run["id"], store=st) == run["id"]
    assert st.get_run(run["id"])["status"] == "queued" and _no_tmp_files(home) == []


def _cli(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``comera ARGV`` in a fresh process (its own view of the store file)."""
    return subprocess.run([sys.executable, "-m", "comera_engine.cli", *argv],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_a_damaged_store_under_a_live_run_is_stopped_and_rebuilt(store: RunStore) -> None:
    """Item 2: page 1 of ``comera.db`` zeroed while one run trains and another has
    finished: ``comera runs`` says so in one line naming ``comera repair``; ``comera
    stop`` stops the live run through its folder; ``comera repair`` moves the damaged
    file aside and rebuilds a store in which ``comera runs`` lists both runs with all
    their steps (as in their ``metrics.jsonl``)."""
    from comera_engine.launch import launch
    from tests.test_launch import LONG, SHORT, START_TIMEOUT, wait_for

    st = store
    done = launch(CONFIG, SHORT, store=st)
    live = launch(CONFIG, [*LONG, "train.ckpt_every=0"], store=st)
    wait_for(lambda: st.get_run(done)["status"] == "finished"
             and (st.get_run(live)["last_step"] or 0) >= 30, START_TIMEOUT, "both runs")
    with open(st.path, "r+b") as f:  # the header page, as a truncated WAL left it
        f.write(bytes(4096))
    out = _cli("runs", "--store", str(st.path))
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "comera repair" in out.stderr
    out = _cli("stop", live, "--store", str(st.path), "--timeout", "30")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"{live}: stopped (the store is damaged: run `comera repair`)"
    # the stopped run's last connection may checkpoint its WAL into the file as it closes,
    # which can write page 1 back (a CI run saw the store sound again here), and a page 1
    # still in the WAL hides a zeroed one in the file: the WAL emptied into the file now
    # that no process writes to it, then page 1 zeroed again, so repair has something to
    # rebuild
    import sqlite3

    with contextlib.closing(sqlite3.connect(st.path)) as con:
        assert con.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0] == 0
    with open(st.path, "r+b") as f:
        f.write(bytes(4096))
    out = _cli("repair", "--store", str(st.path))
    assert out.returncode == 0, out.stderr
    assert "rebuilt 2 run(s)" in out.stdout and "damaged file is kept" in out.stdout
    out = _cli("runs", "--json", "--store", str(st.path))
    runs = {r["id"]: r for r in json.loads(out.stdout)}
    assert {runs[done]["status"], runs[live]["status"]} == {"finished", "stopped"}
    rebuilt = RunStore(st.path, create=False)
    for rid, n in ((done, 25), (live, None)):
        steps = [r["step"] for r in rebuilt.metrics_since(rid, -1, names=["loss/task"])]
        assert steps == _jsonl_steps(st.path.parent / rid)
        assert steps == list(range(1, (n or len(steps)) + 1))
        assert runs[rid]["last_step"] == steps[-1]
    assert rebuilt.check() == ["ok"]
    assert len(list(st.path.parent.glob("comera.db.damaged-*"))) >= 1


def test_a_trainer_whose_store_is_damaged_says_so_once_and_writes_no_more(
        store: RunStore, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 2: a trainer's store sink (``keep_going``) meets a damaged store: its flush,
    status and close never raise, it says so once, and it writes nothing more."""
    from comera_engine.store import StoreError, StoreSink

    rid = store.create_run("r", {})
    calls = []

    def broken(*a: object, **k: object) -> None:
        calls.append(1)
        raise StoreError(f"store: {store.path} is corrupt or unreadable (malformed)")

    sink = StoreSink(store, rid, flush_every=60, keep_going=True)
    monkeypatch.setattr(store, "write_batch", broken)
    sink.log_metrics(1, {"a": 1.0})
    sink.flush()
    sink.log_metrics(2, {"a": 2.0})
    sink.set_status("stopped")
    sink.close()
    assert sink.store_lost and len(calls) == 1 and sink.pending() == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "comera repair" in err[0]


def _trained_run(tmp_path: Path, home: Path, steps: int = 3) -> tuple[RunStore, str]:
    """A finished foreground run (dense digits, ``steps`` steps) recorded in ``home``."""
    from tests.test_cli import DIGITS

    cfg = tmp_path / "digits.toml"
    cfg.write_text(DIGITS.replace("steps = 2", f"steps = {steps}"))
    assert main(["train", str(cfg), "--store", str(home), "--no-progress"]) == 0
    st = RunStore(home, create=False)
    (run,) = st.list_runs()
    st.update_run(run["id"], pid=None, pid_started=None)  # its trainer (this process) is done
    return st, run["id"]


def _mount(*args: str) -> bool:
    try:
        return subprocess.run(["mount", *args], capture_output=True).returncode == 0
    except OSError:
        return False


def test_a_read_only_home_is_read_and_named(tmp_path: Path,
                                             capsys: pytest.CaptureFixture) -> None:
    """Item 7: on a read-only home (a tmpfs remounted read-only) ``runs``, ``sweeps``
    (issue 48), ``logs`` and ``export`` work (the store opened read-only); ``launch``
    and ``resume`` give one line naming the folder and the fix."""
    home = tmp_path / "home"
    home.mkdir()
    if not _mount("-t", "tmpfs", "-o", "size=64m", "tmpfs", str(home)):
        pytest.skip("cannot mount a tmpfs here (a read-only home needs one for root)")
    try:
        st, rid = _trained_run(tmp_path, home)
        st.set_status(rid, "stopped", only_from=("finished",))
        sid = st.create_sweep("sw", {"name": "sw"}, {"train.seed": [1, 2]}, 1)
        st.close()
        capsys.readouterr()
        assert _mount("-o", "remount,ro", str(home))
        assert main(["runs", "--store", str(home)]) == 0
        assert rid in capsys.readouterr().out
        for argv in (["sweeps"], ["sweeps", sid]):  # issue 48: it only reads
            assert main([*argv, "--store", str(home)]) == 0, capsys.readouterr().err
            assert "sw" in capsys.readouterr().out
        assert main(["logs", rid, "--store", str(home)]) == 0
        out = tmp_path / "model.safetensors"
        assert main(["export", rid, "--store", str(home), "--out", str(out)]) == 0
        assert out.is_file() and "read-only" in capsys.readouterr().err
        for argv in (["launch", str(CONFIG)], ["resume", rid]):
            _refused([*argv, "--store", str(home)], capsys, f"{home} is read-only")
    finally:
        subprocess.run(["umount", "-l", str(home)], capture_output=True)


def test_resume_checks_the_folder_and_mends_its_metrics(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 7: ``resume`` of a run whose ``config.toml`` no longer reads back, or whose
    folder is read-only, is refused in one line with the run unchanged; a run whose
    ``metrics.jsonl`` was deleted gets it back whole (from the store) when it resumes."""
    from comera_engine.launch import resume

    home = tmp_path / "home"
    st, rid = _trained_run(tmp_path, home)
    st.set_status(rid, "stopped", only_from=("finished",))
    folder = st.run_dir(rid)
    config = (folder / "config.toml").read_text()
    (folder / "config.toml").write_text(config.replace("[model]", "[model"))
    with pytest.raises(ValueError, match=r"config\.toml no longer reads back"):
        resume(rid, store=st)
    (folder / "config.toml").write_text(config)
    if _mount("--bind", str(folder), str(folder)):
        try:
            assert _mount("-o", "remount,ro,bind", str(folder))
            with pytest.raises(ValueError, match=f"{folder} is read-only"):
                resume(rid, store=st)
        finally:
            subprocess.run(["umount", "-l", str(folder)], capture_output=True)
    assert st.get_run(rid)["status"] == "stopped"
    (folder / "metrics.jsonl").unlink()
    assert main(["train", str(folder / "config.toml"), "--store", str(home), "--run-id", rid,
                 "--resume", "--no-progress"]) == 0
    assert _jsonl_steps(folder) == [1, 2, 3] == [r["step"] for r in
                                                 st.metrics_since(rid, -1, ["loss/task"])]


def _damage_step_line(folder: Path, step: int) -> list[str]:
    """Garble the ``metrics.jsonl`` line of ``step``'s metrics; returns the file's lines
    before."""
    path = folder / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    (i,) = [i for i, line in enumerate(lines)
            if json.loads(line).get("type") == "metrics" and json.loads(line)["step"] == step]
    path.write_bytes("".join(lines[:i]).encode() + b"\x00\x00garbage{{{\n"
                     + "".join(lines[i + 1:]).encode())
    return lines


def _metric_lines(lines: list[str]) -> dict[int, dict]:
    records = [json.loads(line) for line in lines]
    return {r["step"]: r["values"] for r in records if r.get("type") == "metrics"}


def test_a_damaged_metrics_line_loses_no_intact_step_in_repair_or_resume(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """One garbled line in the middle of ``metrics.jsonl``: a resume keeps every intact
    line after it (and takes the lost step back from the store); ``comera repair``
    rebuilds the run from every intact line (its final status and last step, not a
    crash at the damaged line); a resume after that keeps every intact step, and the
    partial note says the store lacks the lost one too."""
    from comera_engine.store.repair import repair

    home = tmp_path / "home"
    st, rid = _trained_run(tmp_path, home, steps=12)
    folder = st.run_dir(rid)
    config = str(folder / "config.toml")

    def resume_to(steps: int) -> None:
        st.set_status(rid, "stopped", only_from=("finished",))
        assert main(["train", config, "--store", str(home), "--run-id", rid, "--resume",
                     "--set", f"train.steps={steps}", "--no-progress"]) == 0

    before = _metric_lines(_damage_step_line(folder, 5))
    resume_to(14)  # the store holds step 5: the file gets it back
    after = _metric_lines((folder / "metrics.jsonl").read_text().splitlines())
    assert sorted(after) == list(range(1, 15))
    assert all(after[s] == pytest.approx(before[s]) for s in range(1, 13))
    capsys.readouterr()

    before = _metric_lines(_damage_step_line(folder, 5))
    st.close()
    for p in home.glob("comera.db*"):
        p.unlink()
    report = repair(home)
    assert report.runs == [rid]
    st = RunStore(home, create=False)
    run = st.get_run(rid)
    assert (run["status"], run["last_step"]) == ("finished", 14)
    kept = [s for s in range(1, 15) if s != 5]
    assert [r["step"] for r in st.metrics_since(rid, -1, ["loss/task"])] == kept
    assert "skipped unreadable line" in st.events(rid)[-1]["text"]
    capsys.readouterr()
    resume_to(16)
    after = _metric_lines(
        [line for line in (folder / "metrics.jsonl").read_text().splitlines()])
    assert sorted(after) == kept + [15, 16]
    assert all(after[s] == pytest.approx(before[s]) for s in kept)
    err = capsys.readouterr().err
    assert "lacks 1 of steps 1..14 (first 5); the run store lacks them too" in err
    assert "full record" not in err
    assert [r["step"] for r in st.metrics_since(rid, -1, ["loss/task"])] == kept + [15, 16]


def test_deleting_a_live_runs_folder_stops_it(store: RunStore) -> None:
    """Item 7: a launched run whose folder is deleted while it trains stops within
    moments, ``failed`` with an error that says its folder was deleted."""
    import shutil

    from comera_engine.launch import launch
    from tests.test_launch import LONG, START_TIMEOUT, wait_for

    rid = launch(CONFIG, LONG, store=store)
    wait_for(lambda: (store.get_run(rid)["last_step"] or 0) >= 30, START_TIMEOUT, "30 steps")
    # Move the folder aside before removing it: the run, seeing its files unlinked, drops
    # its own disk reserve by path, which would race an in-place rmtree over that file.
    # From the run's side this is the same deletion (its paths are gone, its files
    # unlinked).
    run_dir = Path(store.run_dir(rid))
    gone = run_dir.with_name(run_dir.name + ".deleted")
    run_dir.rename(gone)
    shutil.rmtree(gone)
    wait_for(lambda: store.get_run(rid)["status"] == "failed", 60, "failed")
    assert "was deleted while the run trained" in store.get_run(rid)["error"]


def test_a_write_that_meets_a_deleted_run_folder_says_the_folder_was_deleted(
        tmp_path: Path) -> None:
    """Whichever write meets the deletion first (a checkpoint's temporary file, or its
    safetensors write, here; the metrics log in the test above) records the same one-line
    cause; a failure while the folder still exists keeps its own message."""
    from comera_engine.train.checkpoint import failure_text

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    missing = FileNotFoundError(2, "No such file or directory",
                                str(run_dir / "checkpoints" / "step_000030.safetensors.tmp"))
    from safetensors import SafetensorError

    serializing = SafetensorError("Error while serializing: I/O error: No such file or "
                                  "directory (os error 2)")
    assert failure_text(missing, run_dir).startswith("FileNotFoundError: [Errno 2]")
    assert failure_text(serializing, run_dir).startswith("SafetensorError: Error while")
    assert failure_text(ValueError("bad"), run_dir) == "ValueError: bad"
    import errno  # a folder remounted read-only mid-run: worded as resume words it

    assert failure_text(OSError(errno.EROFS, "Read-only file system", str(run_dir / "x")),
                        run_dir) == (f"run: {run_dir} is read-only; make it writable (chmod "
                                     f"u+w {run_dir}, or remount it), then resume the run")
    run_dir.rename(tmp_path / "moved")
    text = failure_text(missing, run_dir)
    assert text == (f"FileNotFoundError: {run_dir} was deleted while the run trained (its "
                    "folder removed?); the run stops here")
    assert "\n" not in text
    assert failure_text(serializing, run_dir) == (
        f"SafetensorError: {run_dir} was deleted while the run trained (its folder "
        "removed?); the run stops here")


def test_names_checksums_and_the_run_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture) -> None:
    """Item 8: ``--name`` of 5,000 characters or with escapes is refused at launch; a
    flipped bit in a checkpoint's tensor data fails its checksum and resume falls back to
    the previous one; the run lock is not inherited by a forked child (a DataLoader
    worker), so ``kill -9`` of the holder frees it while the child lives."""
    from comera_engine.launch.owner import lock_holder
    from comera_engine.store.layout import resume_point

    _no_supervisor(monkeypatch)
    db = tmp_path / "home" / "comera.db"
    for name in ("x" * 5000, "a\x1b[31mred\nline"):
        _refused(["launch", str(CONFIG), "--name", name, "--store", str(db)], capsys, "name")
    assert not db.exists()
    run_dir = tmp_path / "run"
    from tests.test_cli import DIGITS

    cfg = tmp_path / "d.toml"
    cfg.write_text(DIGITS.replace("steps = 2", "steps = 4\nckpt_every = 2"))
    assert main(["train", str(cfg), "--run-dir", str(run_dir), "--no-store",
                 "--no-progress"]) == 0
    newest = run_dir / "checkpoints" / "step_000004.safetensors"
    data = bytearray(newest.read_bytes())
    data[-5] ^= 0x10  # one bit of the last tensor's data: header and size still fit
    newest.write_bytes(bytes(data))
    chosen, note = resume_point(run_dir / "checkpoints")
    assert chosen.name == "step_000002.json" and "checksum mismatch" in note
    code = ("import os, sys, time; from comera_engine.launch.owner import RunLock; "
            f"RunLock({str(tmp_path)!r}).acquire(); pid = os.fork()\n"
            "if pid == 0: print('forked', file=sys.stderr, flush=True); time.sleep(60); "
            "os._exit(0)\n"
            "print(pid, flush=True); time.sleep(60)")
    # the child says so on stderr once its at-fork hooks ran, the parent gives its pid on
    # stdout: two pipes, so the lines cannot interleave (unbuffered, as under xdist)
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    child = int(holder.stdout.readline())
    assert holder.stderr.readline().strip() == b"forked"
    try:
        assert lock_holder(tmp_path)["pid"] == holder.pid
        holder.kill()
        holder.wait()
        os.kill(child, 0)  # the forked child lives on ...
        assert lock_holder(tmp_path) is None  # ... and the lock died with its holder
    finally:
        os.kill(child, signal.SIGKILL)


def test_repair_finds_broken_pages_and_leaves_a_sound_store_alone(tmp_path: Path) -> None:
    """Item 2: damage past the header (broken pages, which open fine) is found by
    ``quick_check``; ``repair`` moves the file aside and rebuilds every run of the
    folders with its metrics, ranks and events; a sound store is left as it is."""
    import sqlite3

    from comera_engine.metrics import JSONLSink
    from comera_engine.store.repair import repair

    home = tmp_path / "home"
    st = RunStore(home)
    for i, steps in enumerate((300, 40)):
        rid = st.create_run(f"r{i}", {}, "running", run_id=f"20260101-00000{i}-abcd")
        folder = home / rid
        folder.mkdir()
        (folder / "config.toml").write_text(CONFIG.read_text())
        sink = JSONLSink(folder / "metrics.jsonl")
        for s in range(1, steps + 1):
            values = {"loss/task": 1.0 / s, "acc/train": s / steps}
            sink.log_metrics(s, values)
            st.log_metrics(rid, s, values)
        sink.log_ranks(steps, {"hidden.0": [1, 6, 1]})
        sink.log_event("stage", "late stage", 20)
        sink.set_status("finished")
        sink.close()
    st.read(lambda c: c.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall())
    st.close()
    assert repair(home).problem is None  # sound: nothing moved
    assert not list(home.glob("*.damaged-*"))
    data = bytearray((home / "comera.db").read_bytes())
    data[-8192:] = os.urandom(8192)  # the last two pages: metrics rows
    (home / "comera.db").write_bytes(bytes(data))
    report = repair(home)
    assert report.problem and report.moved_to and report.moved_to.exists()
    assert sorted(report.runs) == ["20260101-000000-abcd", "20260101-000001-abcd"]
    rebuilt = RunStore(home, create=False)
    assert rebuilt.check() == ["ok"]
    for rid, steps in (("20260101-000000-abcd", 300), ("20260101-000001-abcd", 40)):
        run = rebuilt.get_run(rid)
        assert run["status"] == "finished" and run["last_step"] == steps
        assert [r["step"] for r in rebuilt.metrics_since(rid, -1, ["loss/task"])] == \
            list(range(1, steps + 1))
        assert rebuilt.latest_ranks(rid) == {"hidden.0": [1, 6, 1]}
        assert [e["kind"] for e in rebuilt.events(rid)] == ["stage", "repair"]
    other = tmp_path / "other" / "comera.db"  # someone else's database is never moved
    other.parent.mkdir()
    with sqlite3.connect(other) as c:
        c.execute("CREATE TABLE t (x)")
    with pytest.raises(ValueError, match="not a CoMERA run store"):
        repair(other)
    assert other.exists()


def _recorded_runs(home: Path, steps: tuple[int, ...]) -> list[str]:
    """Finished runs of ``steps`` steps each, recorded in the store at ``home`` and in
    their folders (``config.toml``, ``metrics.jsonl``); the store is closed after."""
    from comera_engine.metrics import JSONLSink

    st = RunStore(home)
    ids = []
    for i, n in enumerate(steps):
        rid = st.create_run(f"r{i}", {}, "running", run_id=f"20260101-00000{i}-abcd")
        (home / rid).mkdir()
        (home / rid / "config.toml").write_text(CONFIG.read_text())
        sink = JSONLSink(home / rid / "metrics.jsonl")
        for s in range(1, n + 1):
            sink.log_metrics(s, {"loss/task": 1.0 / s})
            st.log_metrics(rid, s, {"loss/task": 1.0 / s})
        sink.set_status("finished")
        sink.close()
        st.set_status(rid, "finished")
        ids.append(rid)
    st.close()
    return ids


def _listed(home: Path) -> dict[str, tuple[str, list[int]]]:
    with RunStore(home, create=False) as st:
        return {r["id"]: (r["status"], [m["step"] for m in
                                        st.metrics_since(r["id"], -1, ["loss/task"])])
                for r in st.list_runs()}


def test_an_emptied_store_is_damaged_and_repair_adds_unrecorded_folders(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``comera.db`` truncated to 0 bytes beside run folders: ``comera runs`` used to
    write a fresh schema into it and say "no runs", and ``comera repair`` then called it
    sound. Now the listing is one line naming ``comera repair`` and leaves the file
    empty; repair rebuilds every run. A sound store without rows for some run folders
    (the store deleted, then a new one made) gets them from ``comera repair``, and
    ``comera runs`` says so first."""
    home = tmp_path / "home"
    ids = _recorded_runs(home, (5, 3))
    db = home / "comera.db"
    db.write_bytes(b"")
    assert main(["runs", "--store", str(home)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is empty" in err[0] and "comera repair" in err[0], err
    assert db.stat().st_size == 0
    assert main(["repair", "--store", str(home)]) == 0
    out = capsys.readouterr().out
    assert "rebuilt 2 run(s)" in out and out.count("damaged file is kept") == 1, out
    assert _listed(home) == {ids[0]: ("finished", [1, 2, 3, 4, 5]),
                             ids[1]: ("finished", [1, 2, 3])}
    for p in home.glob("comera.db*"):
        p.unlink()
    assert main(["runs", "--store", str(home)]) == 0
    assert "holds 2 run folder(s): `comera repair`" in capsys.readouterr().out
    RunStore(home).close()  # a new, empty store beside the folders
    assert main(["runs", "--store", str(home)]) == 0
    assert "holds 2 run folder(s): `comera repair`" in capsys.readouterr().out
    assert main(["repair", "--store", str(home)]) == 0
    assert "2 run folder(s) had no row in the store" in capsys.readouterr().out
    assert _listed(home) == {ids[0]: ("finished", [1, 2, 3, 4, 5]),
                             ids[1]: ("finished", [1, 2, 3])}
    assert main(["repair", "--store", str(home)]) == 0
    assert "sound" in capsys.readouterr().out
    assert main(["repair", "--store", str(tmp_path / "typo" / "x")]) == 2
    assert "--store" in capsys.readouterr().err and not (tmp_path / "typo").exists()


def test_a_repair_killed_mid_rebuild_leaves_the_damaged_store_to_the_next(
        tmp_path: Path) -> None:
    """The rebuild is made in a file beside the store and moved into place at the end: a
    repair killed (``os._exit``, as ``kill -9``) while it rebuilds leaves the damaged
    store where it was (not a partial store the next repair would call sound); the next
    repair clears the dead one's file and rebuilds every run."""
    home = tmp_path / "home"
    ids = _recorded_runs(home, (4, 4, 4))
    db = home / "comera.db"
    garbage = os.urandom(8192)
    db.write_bytes(garbage)
    code = ("import os, sys\n"
            "from comera_engine.store import repair as r\n"
            "real, done = r.rebuild_run, []\n"
            "def once(st, folder):\n"
            "    if done: os._exit(9)\n"
            "    done.append(folder); return real(st, folder)\n"
            "r.rebuild_run = once\n"
            "r.repair(sys.argv[1])\n")
    proc = subprocess.run([sys.executable, "-c", code, str(home)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 9, proc.stderr
    assert db.read_bytes() == garbage and not list(home.glob("*.damaged-*"))
    assert len(list(home.glob("comera.db.rebuild-*"))) >= 1  # the killed one's
    from comera_engine.store.repair import repair

    report = repair(home)
    assert sorted(report.runs) == ids and report.moved_to.read_bytes() == garbage
    assert not list(home.glob("comera.db.rebuild-*"))
    assert _listed(home) == {rid: ("finished", [1, 2, 3, 4]) for rid in ids}


def test_a_file_size_limit_is_one_line_and_resume_and_repair_fill_the_store(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A write past the file size limit (``ulimit -f``: EFBIG) is handled like a full
    disk: the run is ``failed`` with one line saying so, one ``comera: error`` line on
    stderr and no traceback (it was a 70-line traceback and a ``crashed`` run). Steps
    that ``metrics.jsonl`` holds and the store lacks (its writes failed while the run
    went on) are added back by a resume, and by ``comera repair`` on a sound store."""
    import errno
    import resource

    from comera_engine.store.layout import is_disk_full
    from comera_engine.store.repair import repair
    from tests.test_cli import DIGITS

    assert is_disk_full(OSError(errno.EFBIG, "File too large"))
    cfg = tmp_path / "digits.toml"
    cfg.write_text(DIGITS.replace("steps = 2", "steps = 3000\nckpt_every = 50"))
    home = tmp_path / "limited"

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (400 * 1024, resource.RLIM_INFINITY))

    proc = subprocess.run([sys.executable, "-m", "comera_engine.cli", "train", str(cfg),
                           "--store", str(home), "--no-progress"], cwd=ROOT, text=True,
                          capture_output=True, preexec_fn=limit, timeout=300)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("comera: error")]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert len(errors) == 1 and "file too large" in errors[0] and "ulimit -f" in errors[0]
    with RunStore(home, create=False) as st:
        (run,) = st.list_runs()
        assert run["status"] == "failed" and run["error"].startswith("file too large")

    home = tmp_path / "home"
    st, rid = _trained_run(tmp_path, home, steps=6)
    folder = st.run_dir(rid)
    gap = lambda c: c.execute("DELETE FROM metrics WHERE run_id = ? AND step BETWEEN 2 "  # noqa: E731
                              "AND 4", (rid,))
    st.write(gap)  # as when the store's writes failed while the run went on
    st.set_status(rid, "stopped", only_from=("finished",))
    capsys.readouterr()
    assert main(["train", str(folder / "config.toml"), "--store", str(home), "--run-id", rid,
                 "--resume", "--set", "train.steps=8", "--no-progress"]) == 0
    assert "the run store lacked 3 of steps 1..6: added from metrics.jsonl" in \
        capsys.readouterr().err
    assert sorted({r[0] for r in _store_rows(st, rid)}) == list(range(1, 9))
    assert _store_rows(st, rid) == sorted(_folder_rows(folder))
    st.write(gap)
    report = repair(home)
    assert report.moved_to is None and "lacked 3 step(s)" in report.problem
    assert _store_rows(st, rid) == sorted(_folder_rows(folder))
    assert repair(home).problem is None


# ------------------------------------------------------------------ issue 48
# No duplicate rows after an early crash, a closed terminal is a stop, every number
# bounded before a run exists, and quiet pipes (docs/RELIABILITY.md).


def _folder_rows(run_dir: Path) -> list[tuple[int, str, float | None]]:
    """Every metric row of ``metrics.jsonl`` as ``(step, name, value)`` (NaN as None, as
    the store keeps it), in the file's order."""
    import math

    from comera_engine.metrics import read_jsonl

    return [(r["step"], k, None if isinstance(v, float) and math.isnan(v) else float(v))
            for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("type") == "metrics"
            for k, v in r["values"].items()]


def _store_rows(st: RunStore, rid: str) -> list[tuple[int, str, float | None]]:
    rows = st.read(lambda c: c.execute("SELECT step, name, value FROM metrics WHERE run_id = ?"
                                       " ORDER BY step, name", (rid,)).fetchall())
    return [(s, n, v) for s, n, v in rows]


def test_kill9_at_any_moment_then_resume_keeps_each_step_once(store: RunStore) -> None:
    """Item 1: a launched run is killed (-9) before its first checkpoint, then at random
    moments after, and resumed each time; stopped at last, its ``metrics.jsonl`` and the
    store hold the same rows, row for row: steps 1..N once each, the same values."""
    import random

    from comera_engine.launch import checkpoint_steps, launch, resume, stop
    from tests.test_launch import START_TIMEOUT, _status, wait_for

    st, seed = store, random.randrange(10**6)
    rng = random.Random(seed)
    # checkpoints every 250 steps and no stage change (whose checkpoint would come at
    # the config's step 100): the first kill, at a step the store shows (up to half a
    # second behind the trainer), lands before the first checkpoint
    rid = launch(CONFIG, ["train.steps=100000", "train.eval_every=0", "train.ckpt_every=250",
                          "comera.switch=100000"], store=st)
    run_dir = st.run_dir(rid)
    last = 0
    for attempt, (low, high) in enumerate([(1, 10), (255, 330), (0, 0)], start=1):
        low, high = (low, high) if high else (last + 3, last + 100)
        at = rng.randrange(low, high)
        wait_for(lambda a=attempt, s=at: (run := st.get_run(rid))["attempt"] == a
                 and run["status"] == "running" and (run["last_step"] or 0) >= s,
                 START_TIMEOUT, f"attempt {attempt} at step {at} (seed {seed})")
        os.kill(st.get_run(rid)["pid"], signal.SIGKILL)
        wait_for(lambda: _status(st, rid) == "crashed", 30, "crashed")
        if attempt == 1:  # killed before its first checkpoint: the restart has none
            assert checkpoint_steps(run_dir) == [], f"seed {seed}"
        last = st.get_run(rid)["last_step"] or 0
        assert resume(rid, store=st) == rid
    wait_for(lambda: (st.get_run(rid)["last_step"] or 0) > last + 5, START_TIMEOUT,
             "steps of the last attempt")
    assert stop(rid, timeout=60, store=st) == "stopped"
    folder, stored = _folder_rows(run_dir), _store_rows(st, rid)
    steps = [s for s, n, _ in folder if n == "loss/task"]
    assert steps == list(range(1, len(steps) + 1)), f"seed {seed}: {len(steps)} rows"
    assert sorted(folder) == sorted(stored) and len(folder) == len(set(folder)), f"seed {seed}"
    assert st.get_run(rid)["last_step"] == steps[-1]


def _numeric_fields() -> list[tuple[str, bool]]:
    """Every bounded number of a config: ``(section.key, is a list)``, the dataclass
    fields of ``[model]``, ``[comera]``, ``[train]`` and the ``[data]`` keys."""
    import typing

    from comera_engine.config import BOUNDS, DATA_BOUNDS, SECTIONS

    fields = []
    for full in BOUNDS:
        section, key = full.split(".")
        hint = typing.get_type_hints(SECTIONS[section])[key]
        fields.append((full, "list" in str(hint)))
    return fields + [(f"data.{key}", False) for key in DATA_BOUNDS]


NUMERIC_FIELDS = _numeric_fields()
HUGE = ["100000000000000000000000", "-100000000000000000000000", "nan", "inf"]


@pytest.mark.parametrize("full,is_list", NUMERIC_FIELDS, ids=[f for f, _ in NUMERIC_FIELDS])
def test_every_number_is_bounded_before_a_run_exists(
        full: str, is_list: bool, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Item 3: 10^23, -10^23, nan and inf for every numeric field, through ``comera
    launch``, ``comera train`` and the form's ``resolve_config``: exit 2, one line naming
    the field and its range, no run row, no run folder."""
    import tomllib

    from comera_engine.config import BOUNDS, DATA_BOUNDS
    from comera_engine.errors import ConfigError
    from comera_engine.launch import resolve_config

    bound = BOUNDS.get(full) or DATA_BOUNDS[full.split(".", 1)[1]]
    st = _seeded_store(tmp_path)
    before = _snapshot(st)
    raw = tomllib.loads(CONFIG.read_text())
    for value in HUGE:
        setting = f"{full}=[{value}]" if is_list else f"{full}={value}"
        for argv in (["launch", str(CONFIG), "--set", setting, "--store", str(st.path)],
                     ["train", str(CONFIG), "--set", setting, "--store", str(st.path),
                      "--run-dir", str(tmp_path / "run"), "--no-progress"]):
            assert main(argv) == 2, argv
            lines = capsys.readouterr().err.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith(f"comera: error: {full}: "), lines
            assert f"(allowed: {bound.text()})" in lines[0], lines[0]
        with pytest.raises(ConfigError, match=f"^{full}: .*allowed: "):  # the form's check
            resolve_config(raw, [setting])
    assert _snapshot(st) == before and not (tmp_path / "run").exists()


def test_a_stored_error_is_one_line_and_the_traceback_stays_in_the_log(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Item 3: a trainer that dies with a Python traceback is recorded ``failed`` with
    the one line its traceback ended with (the frames stay in ``train.log``), and
    ``comera runs`` shows that line; any multi-line error reaching the store is one line."""
    from comera_engine.launch.scheduler import Slot
    from comera_engine.launch.supervisor import LocalExecutor

    st = RunStore(tmp_path / "home" / "comera.db")
    rid = st.create_run("tb", {"name": "tb"}, "running")
    st.run_dir(rid).mkdir(parents=True, exist_ok=True)
    executor = LocalExecutor(st, rid)
    with open(executor.log_path, "ab") as log:
        executor.offset = log.tell()
        proc = subprocess.Popen([sys.executable, "-c", "import torch\n"
                                 "torch.manual_seed(10**23)"], stdout=log,
                                stderr=subprocess.STDOUT)
    slot = Slot(rid, 1, handle=proc, exit_code=proc.wait())
    outcome = executor.outcome(slot, st.get_run(rid))
    st.lifecycle(rid).end(outcome.status, outcome.error)
    run = st.get_run(rid)
    assert run["status"] == "failed" and "\n" not in run["error"], run["error"]
    assert re.match(r"^\w+Error: .*Overflow", run["error"]), run["error"]
    assert run["error"].endswith("(traceback in train.log)")
    assert "Traceback (most recent call last)" in executor.log_path.read_text()
    assert main(["runs", "--store", str(st.path)]) == 0
    assert run["error"][:40] in capsys.readouterr().out
    other = st.create_run("multi", {"name": "multi"}, "running")
    st.lifecycle(other).end("failed", "first line\n  second line\n\nthird")
    assert st.get_run(other)["error"] == "first line | second line | third"
    st.update_run(other, error="rebuilt\nby repair")  # the other way an error is written
    assert st.get_run(other)["error"] == "rebuilt | by repair"


def test_a_closed_pipe_ends_every_listing_quietly(tmp_path: Path) -> None:
    """Item 4: ``comera runs | head -1`` (and ``head -c 10`` of the JSON) exits 0 with no
    traceback; so does every printing command whose reader has already gone (the
    pipe's read end closed before it writes: ``runs``, ``runs --json``, ``sweeps``,
    ``logs``, ``--help``)."""
    st = RunStore(tmp_path / "home" / "comera.db")
    rids = [st.create_run(f"run-{i}", {"name": f"run-{i}"}, "stopped") for i in range(400)]
    st.run_dir(rids[0]).mkdir(parents=True, exist_ok=True)
    st.log_path(rids[0]).write_text("a log line\n" * 20_000)
    st.create_sweep("sw", {"name": "sw"}, {"train.seed": [1, 2]}, 1)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    comera = f"{sys.executable} -m comera_engine.cli"
    for pipeline in (f"{comera} runs --store {st.path} | head -1",
                     f"{comera} runs --json --store {st.path} | head -c 10"):
        out = subprocess.run(["bash", "-c", f"set -o pipefail; {pipeline}"], env=env,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and out.stderr == "", (pipeline, out.stderr[-2000:])
        assert out.stdout.startswith(("ID ", "[")), out.stdout
    for argv in (["runs"], ["runs", "--json"], ["sweeps"], ["logs", rids[0]], ["--help"]):
        read, write = os.pipe()
        os.close(read)  # the reader is gone before the command writes a byte
        try:
            proc = subprocess.run([sys.executable, "-m", "comera_engine.cli", *argv,
                                   *(["--store", str(st.path)] if argv != ["--help"] else [])],
                                  stdout=write, stderr=subprocess.PIPE, env=env, timeout=120)
        finally:
            os.close(write)
        assert proc.returncode == 0 and proc.stderr == b"", (argv, proc.stderr[-2000:])


def test_a_config_path_that_is_no_file_says_what_it_is(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    """Item 4: a config path that is a folder, a FIFO, a device, a symlink loop or a
    symlink to nothing: ``launch`` and ``train`` exit 2 with one line saying which (not
    "file not found"), without blocking on the FIFO or writing anything."""
    folder, fifo, loop, dangling = (tmp_path / n for n in ("dir.toml", "fifo.toml",
                                                            "loop.toml", "dangling.toml"))
    folder.mkdir()
    os.mkfifo(fifo)
    loop.symlink_to(tmp_path / "loop2.toml")
    (tmp_path / "loop2.toml").symlink_to(loop)
    dangling.symlink_to(tmp_path / "gone.toml")
    cases = [(folder, "is a folder, not a config file"),
             (fifo, "is a FIFO (named pipe), not a regular file"),
             (Path(os.devnull), "is a device, not a regular file"),
             (loop, "is a symlink loop"),
             (dangling, f"is a symlink to {tmp_path / 'gone.toml'}, which does not exist")]
    for path, says in cases:
        for argv in (["launch", str(path), "--store", str(tmp_path / "home")],
                     ["train", str(path), "--run-dir", str(tmp_path / "run"),
                      "--store", str(tmp_path / "home"), "--no-progress"]):
            _refused(argv, capsys, "config")
            assert main(argv) == 2
            err = capsys.readouterr().err
            assert says in err and str(path) in err, err
    assert not (tmp_path / "home").exists() and not (tmp_path / "run").exists()
