"""The CPU backend as a prebuilt plugin: a killed or running build never stalls a run, a
run never times anything or writes to the home folder, and the install's GEMM ways come
from the backend folder."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from comera_engine import backends
from comera_engine.backends.cpu import BackendUnavailable, load
from comera_engine.backends.cpu.gemm import ROLES, Ways

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "experiments" / "configs" / "digits_tt_mlp.toml"

# a short training run: prints the seconds from process start to the first logged step,
# then the final metrics as JSON
_TRAIN = r"""
import time
T0 = time.time()
import json, sys
from comera_engine.metrics import NullSink
from comera_engine.train import load_config, train

first, last = [], {}

class Sink(NullSink):
    def log_metrics(self, step, metrics):
        if not first:
            first.append(time.time() - T0)
        last.update(metrics)

cfg = load_config(sys.argv[1], ["train.steps=%s" % sys.argv[3], "train.eval_every=0",
                                "train.ckpt_every=0", "train.seed=3"])
train(cfg, sys.argv[2], sink=Sink(), progress=False)
print("FIRST_STEP_S", first[0])
print("METRICS", json.dumps(last, sort_keys=True))
"""


def _train(tmp: Path, env: dict, steps: int = 3, name: str = "run"
           ) -> tuple[float, dict, str]:
    """Run :data:`_TRAIN` in a subprocess: (seconds to the first step, last metrics,
    stderr)."""
    run_dir = tmp / name
    run_dir.mkdir()
    out = subprocess.run([sys.executable, "-c", _TRAIN, str(CONFIG), str(run_dir), str(steps)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines()
                 if line.startswith(("FIRST_STEP_S", "METRICS")))
    return float(lines["FIRST_STEP_S"]), json.loads(lines["METRICS"]), out.stderr


def _env(folder: Path, home: Path) -> dict:
    env = {**os.environ, "COMERA_CPU_BACKEND_DIR": str(folder), "HOME": str(home),
           "XDG_CACHE_HOME": str(home / ".cache"), "PYTHONPATH": str(ROOT)}
    env.pop("COMERA_NATIVE", None)
    return env


def _fallback_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "CPU backend not in use" in line]


def test_a_run_trains_at_once_while_a_build_runs_and_after_it_is_killed(tmp_path) -> None:
    """Start a build, launch a run while it compiles (its lock held), SIGKILL the build,
    launch another: each run starts on the PyTorch path without waiting for the build,
    the one after the kill takes its first step within 30 s of starting (5 s idle), each
    says why on one line of stderr with how to build, and the killed build left nothing
    loadable."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler here: there is no build to interrupt")
    folder, home = tmp_path / "backend", tmp_path / "home"
    home.mkdir()
    env = _env(folder, home)
    build = subprocess.Popen([sys.executable, "-m", "comera_engine.backends.cpu", "build",
                              "--dir", str(folder)], cwd=ROOT, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)  # its own group: compiler included
    try:
        deadline = time.time() + 60
        while not list(folder.glob(".build-*")) and time.time() < deadline:
            time.sleep(0.1)  # the build's temporary folder: compiling from here on
        assert build.poll() is None, "the build ended before it could be interrupted"
        first, _, err = _train(tmp_path, env, name="during")
        # the compiler shares the CPU meanwhile: the bound is that the run does not wait
        # for the build (a minute or more), not the 5 s of an idle machine
        assert first < 30.0, f"first step {first:.1f} s after start while a build runs"
        lines = _fallback_lines(err)
        assert len(lines) == 1 and "build is in progress" in lines[0]
        assert "make install" in lines[0]
    finally:
        os.killpg(build.pid, signal.SIGKILL)  # the build and its compiler processes
        build.wait()
    assert not (folder / "ready").exists()
    with pytest.raises(BackendUnavailable, match="not built"):
        load(folder)
    first, _, err = _train(tmp_path, env, name="after")
    # 5 s on an idle machine, 10 s and more beside `make test`'s other worker on CI's 2
    # cores: the bound is that nothing waits for a build (a minute or more)
    assert first < 30.0, f"first step {first:.1f} s after start after a killed build"
    lines = _fallback_lines(err)
    assert len(lines) == 1 and "not built" in lines[0] and "make install" in lines[0]


def test_two_runs_of_one_seed_on_one_install_give_identical_metrics(tmp_path,
                                                                    cpu_backend_dir) -> None:
    """With the backend in use: the same seed twice gives the same numbers, no fallback
    line, and nothing written to the home folder's cache (no timing, no choices file)."""
    home = tmp_path / "home"
    home.mkdir()
    env = _env(cpu_backend_dir, home)
    _, m1, err1 = _train(tmp_path, env, steps=4, name="a")
    _, m2, err2 = _train(tmp_path, env, steps=4, name="b")
    def numbers(m: dict) -> dict:  # the run's results, not its timing or memory
        return {k: v for k, v in m.items() if not k.startswith(("perf/", "mem/", "sys/"))}

    assert numbers(m1) == numbers(m2) and any(k.startswith("loss") for k in numbers(m1))
    assert not _fallback_lines(err1) and not _fallback_lines(err2)
    assert not (home / ".cache" / "comera").exists()
    assert not (home / ".cache" / "torch_extensions").exists()


def test_a_run_never_times_gemm_ways(monkeypatch, cpu_backend) -> None:
    """A layer step at the size that takes the install's ways runs with the timing code
    and the clock it reads made to fail: nothing in a run times anything."""
    from comera_engine import TTLinear
    from comera_engine.backends.cpu import tune

    def boom(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("a run timed GEMM ways")

    monkeypatch.setattr(tune, "tune_ways", boom)
    monkeypatch.setattr(tune, "best", boom)
    monkeypatch.setattr(tune.time, "perf_counter", boom)
    lin = TTLinear(96, 64, rank=10, in_factors=[4, 4, 6], out_factors=[4, 4, 4],
                   path="halves")
    x = torch.randn(2048, 96, requires_grad=True)
    lin(x).sum().backward()
    assert x.grad is not None


def test_ways_read_from_the_backend_folder(tmp_path, cpu_backend_dir) -> None:
    """The GEMM ways a run takes are the ``choices.json`` of its backend folder's build;
    unknown roles and way names are ignored, and no file means way 0 everywhere."""
    folder = tmp_path / "copy"
    shutil.copytree(cpu_backend_dir / "ready", folder / "ready")
    (folder / "ready" / "choices.json").write_text(json.dumps({"ways": {
        "xl": "onednn", "dr": "ba", "halves-bwd": "blocked", "dl": "sideways", "nope": "mkl"}}))
    ways = load(folder).ways
    assert ways.chosen == {"xl": 1, "dr": 1, "halves-bwd": 1}
    assert ways.names()["dl"] == "ab" and ways.names()["halves-fwd"] == "gemms"
    (folder / "ready" / "choices.json").unlink()
    assert load(folder).ways.chosen == {}
    assert set(Ways().names()) == set(ROLES)


@pytest.mark.parametrize("role", [r for r, k in ROLES.items() if k != "step"])
@pytest.mark.parametrize("rows", [4096, 130])
def test_each_way_of_each_product_is_the_float64_product(role: str, rows: int) -> None:
    """Every product role, way 0 and way 1 (oneDNN where this torch has it), large (the
    install's way) and small (the fixed rule), is the float64 product to fp32 accuracy."""
    from comera_engine.backends.cpu.gemm import onednn_linear

    kind = ROLES[role]
    g = torch.Generator().manual_seed(1)
    a = torch.randn(rows, 96, generator=g)
    b = torch.randn(*{"nn": (96, 40), "nt": (40, 96), "tn": (rows, 40)}[kind], generator=g)
    ad, bd = a.double(), b.double()
    ref = ad @ bd if kind == "nn" else ad @ bd.t() if kind == "nt" else ad.t() @ bd
    for way in (0, 1):
        if way == 1 and kind != "tn" and onednn_linear() is None:
            continue
        got = Ways({role: way}).product(role, a, b, default=way)
        assert got.dtype == torch.float32 and got.shape == ref.shape
        assert float((got.double() - ref).norm() / ref.norm()) < 1e-6


def test_a_stale_build_is_refused_with_one_line(tmp_path, cpu_backend_dir, monkeypatch,
                                                capsys) -> None:
    """A build for another torch is not loaded; the hook says so once and returns None
    (the PyTorch path), however often it is asked."""
    folder = tmp_path / "stale"
    shutil.copytree(cpu_backend_dir / "ready", folder / "ready")
    manifest = json.loads((folder / "ready" / "manifest.json").read_text())
    (folder / "ready" / "manifest.json").write_text(json.dumps({**manifest, "torch": "0.1"}))
    monkeypatch.setenv("COMERA_CPU_BACKEND_DIR", str(folder))
    monkeypatch.setenv("COMERA_NATIVE", "1")
    backends._load_once.cache_clear()
    try:
        assert backends.cpu_backend() is None and backends.cpu_backend() is None
        err = capsys.readouterr().err
        assert len(_fallback_lines(err)) == 1 and "torch 0.1" in err
    finally:
        backends._load_once.cache_clear()
