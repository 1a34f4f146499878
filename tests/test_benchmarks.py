"""The benchmark scripts run end to end (a smoke test: no timing is asserted here;
speed is measured by running the scripts, see docs/BENCHMARKS.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def script(path: str | Path) -> Any:
    """The benchmark script at ``path`` as a module (its ``main(argv)`` is what its
    ``__main__`` runs: ``raise SystemExit(main())``)."""
    import importlib.util

    path = Path(path)
    spec = importlib.util.spec_from_file_location(f"_bench_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def refused(capsys: pytest.CaptureFixture[str], cmd: list[str]) -> str:
    """Run the script ``cmd[1]``'s ``main`` on the flags ``cmd[2:]`` in this process: it
    must exit non-zero before doing anything; its error text (stderr, or the exit's
    message)."""
    module = script(cmd[1])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        module.main(cmd[2:])
    code = exit_.value.code
    assert code not in (0, None), f"{Path(cmd[1]).name} {cmd[2:]}: exit {code!r}"
    return capsys.readouterr().err + (code if isinstance(code, str) else "")


def test_bench_tt_linear_writes_table_and_json(tmp_path) -> None:
    cmd = [sys.executable, str(ROOT / "experiments" / "bench_tt_linear.py"), "--device", "cpu",
           "--ranks", "4", "--tokens", "16", "--rounds", "1", "--out", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "| shape" in out.stdout and "768x3072" in out.stdout
    data = json.loads((tmp_path / "bench_tt_linear_cpu.json").read_text())
    rows = data["rows"]
    assert [(r["shape"], r["tokens"], r["rank"]) for r in rows] == [
        ("768x768", 16, 4), ("768x3072", 16, 4), ("3072x768", 16, 4)]
    for r in rows:
        assert r["path"] in ("halves", "sweep", "dense")
        assert r["dense_ms"] > 0 and r["tt_ms"] > 0 and r["speedup_best"] > 0
        assert r["params_ratio"] > 100  # rank 4 at these shapes: hundreds of times smaller
    assert data["summary"]["speedup_768_r30_4096"] is None  # that row was not asked for


def test_bench_tt_linear_group_times_per_layer(tmp_path, capsys) -> None:
    """``--group N``: N layers of a shape on one input, the TT ones grouped
    (tensor.grouped); a row per case, marked with its group, timed per layer; a group
    below 1 is refused."""
    path = ROOT / "experiments" / "bench_tt_linear.py"
    assert script(path).main(["--device", "cpu", "--shapes", "768x768", "--ranks", "4",
                              "--tokens", "16", "--rounds", "1", "--group", "3",
                              "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "bench_tt_linear_cpu_group3.json").read_text())["rows"]
    assert [(r["shape"], r["rank"], r["group"]) for r in rows] == [("768x768", 4, 3)]
    assert rows[0]["dense_ms"] > 0 and rows[0]["tt_ms"] > 0
    assert "--group" in refused(capsys, ["python", str(path), "--group", "0"])
    # --paths: the planner's row and each forced path's, side by side in one run
    assert script(path).main(["--device", "cpu", "--shapes", "768x768", "--ranks", "4",
                              "--tokens", "16", "--rounds", "1", "--group", "2",
                              "--paths", "planner", "dense", "halves",
                              "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "bench_tt_linear_cpu_group2.json").read_text())["rows"]
    assert [r["source"] == "forced" for r in rows] == [False, True, True]
    assert [r["path"] for r in rows[1:]] == ["dense", "halves"]
    assert all(r["tt_ms"] > 0 and r["group"] == 2 for r in rows)


def test_bench_tt_linear_parts_writes_table_and_json(tmp_path, capsys) -> None:
    cmd = [sys.executable, str(ROOT / "experiments" / "bench_tt_linear_parts.py"),
           "--rank", "8", "--tokens", "16", "--rounds", "1", "--reps", "1", "--device", "cpu",
           "--out", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    data = json.loads((tmp_path / "bench_tt_linear_parts_cpu.json").read_text())
    assert [r["variant"] for r in data["rows"]] == [
        "nn.Linear", "layer", "function, gates given", "function, no gates",
        "function, no gates, no bias"]
    assert all(r["ms"] > 0 for r in data["rows"]) and "| variant" in out.stdout
    assert "--reps" in refused(capsys, [*cmd[:2], "--reps", "0"])
    assert "--ref" in refused(capsys, [*cmd, "--ref", "no-such-revision"])


def test_bench_gemm_backends_writes_table_and_json(tmp_path, capsys) -> None:
    """The halves step's six batch GEMMs both ways, and the way the layer takes: without
    the CPU backend (an empty backend folder) the fixed rule (MKL; dR as (bᵀ·a)ᵀ at the
    padded width 32, dL as aᵀ·b), and nothing written anywhere but the JSON."""
    from comera_engine.backends.cpu.gemm import onednn_linear

    if onednn_linear() is None:
        pytest.skip("this PyTorch build has no oneDNN linear op")
    env = {**os.environ, "COMERA_CPU_BACKEND_DIR": str(tmp_path / "no-backend"),
           "HOME": str(tmp_path / "home")}
    cmd = [sys.executable, str(ROOT / "experiments" / "bench_gemm_backends.py"),
           "--rank", "30", "--tokens", "1024", "--rounds", "1", "--out", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads((tmp_path / "bench_gemm_backends_cpu.json").read_text())["rows"]
    assert [r["kind"] for r in rows] == ["nn", "nn", "nt", "tn", "nt", "tn"]
    assert [(r["m"], r["k"], r["n"]) for r in rows] == [
        (1024, 768, 32), (1024, 32, 768), (1024, 768, 32), (32, 1024, 768), (1024, 32, 768),
        (768, 1024, 32)]
    assert all(r["way0_ms"] > 0 and r["way1_ms"] > 0 for r in rows)
    assert [r["chosen"] for r in rows] == ["mkl", "mkl", "mkl", "ba", "mkl", "ab"]
    assert "| product" in out.stdout and "not in use" in out.stdout
    assert not (tmp_path / "home").exists() and not (tmp_path / "no-backend").exists()
    assert "--rank" in refused(capsys, [*cmd[:2], "--rank", "0"])


@pytest.mark.parametrize("op", ["tt_linear_halves", "tt_linear_sweep", "ttm_lookup",
                                "ttm_matrix", "adamw"])
def test_bench_op_writes_table_and_json(tmp_path, op: str) -> None:
    """Each op's benchmark runs (one round) and writes its table and JSON."""
    cmd = [sys.executable, str(ROOT / "experiments" / f"bench_op_{op}.py"), "--rounds", "1",
           "--out", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads((tmp_path / f"bench_op_{op}.json").read_text())["rows"]
    assert len(rows) >= 2 and all(r["reference_ms"] > 0 and r["op_pytorch_ms"] > 0
                                  for r in rows)
    assert "| case" in out.stdout


def test_bench_tt_linear_parts_fixed_cost_shape_path_and_threads(tmp_path, capsys) -> None:
    """``--shape 8x8`` (negligible arithmetic), a forced ``--path`` and ``--threads``
    reach the layer and the JSON; a bad thread count is refused by name."""
    cmd = [sys.executable, str(ROOT / "experiments" / "bench_tt_linear_parts.py"),
           "--shape", "8x8", "--rank", "2", "--tokens", "4", "--rounds", "1", "--reps", "1",
           "--path", "sweep", "--threads", "1", "--device", "cpu", "--out", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    data = json.loads((tmp_path / "bench_tt_linear_parts_cpu.json").read_text())
    assert data["threads"] == 1 and data["path"] == "sweep" and data["shape"] == "8x8"
    assert {r["path"] for r in data["rows"] if r["variant"] != "nn.Linear"} == {"sweep"}
    assert "--threads" in refused(capsys, [*cmd, "--threads", "-1"])


def test_bench_tt_linear_parts_times_a_git_revision_side_by_side(tmp_path) -> None:
    """``--ref REV`` adds the layer as it was at that commit (here HEAD, so the same code
    through a second import) after checking both compute the same outputs."""
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"],
                      capture_output=True).returncode != 0:
        pytest.skip("not a git checkout: --ref needs the repository's history")
    cmd = [sys.executable, str(ROOT / "experiments" / "bench_tt_linear_parts.py"),
           "--rank", "8", "--tokens", "16", "--rounds", "1", "--reps", "1", "--device", "cpu",
           "--out", str(tmp_path), "--ref", "HEAD"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    data = json.loads((tmp_path / "bench_tt_linear_parts_cpu.json").read_text())
    names = [r["variant"] for r in data["rows"]]
    assert names[:3] == ["nn.Linear", "layer", "layer @ HEAD"] and data["ref"] == "HEAD"
    same = {r["variant"]: r["path"] for r in data["rows"]}
    assert same["layer"] == same["layer @ HEAD"]


def test_bench_train_step_times_until_min_seconds_and_writes_json(tmp_path, capsys) -> None:
    """Smoke run on the tiny preset: each configuration in its own process, at least
    ``--steps`` timed and more until ``--min-seconds``; the dense model once and CoMERA
    per path choice (``--paths``: the planner's, and every TT op reconstructed), each
    row with the paths the planner chose and a ratio against the dense row; docs
    untouched with ``--no-docs``."""
    out_json = tmp_path / "train_step.json"
    cmd = [sys.executable, str(ROOT / "experiments" / "bench_train_step.py"),
           "--presets", "tiny", "--batches", "1", "--steps", "2", "--min-seconds", "0.3",
           "--threads", "1", "--paths", "auto", "reconstructed", "--no-docs",
           "--out", str(out_json)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    data = json.loads(out_json.read_text())
    rows = {(r["variant"], r["paths"]): r for r in data["rows"]}
    assert set(rows) == {("dense", "auto"), ("comera", "auto"), ("comera", "reconstructed")}
    for r in rows.values():
        assert r["steps_timed"] >= 2 and r["step_ms_median"] > 0
        # the stopping rule: steps are timed until their sum reaches --min-seconds (a
        # median times a count undercounts when a few steps are slow)
        assert r["seconds_timed"] >= 0.3 or r["steps_timed"] == 200
        assert r["seconds_timed"] >= 0.999 * r["steps_timed"] * r["step_ms_min"] / 1e3
    assert rows[("dense", "auto")]["paths_chosen"] == []
    assert "tt_linear:halves:model" in rows[("comera", "auto")]["paths_chosen"]
    assert {p.split(":")[1] for p in rows[("comera", "reconstructed")]["paths_chosen"]} == {
        "dense"}
    assert [(r["paths"], r["speedup"] > 0) for r in data["ratios"]] == [
        ("auto", True), ("reconstructed", True)]
    assert "| tiny | 1 | no | auto |" in out.stdout
    assert "| tiny | 1 | no | reconstructed |" in out.stdout
    assert "--steps" in refused(capsys, [*cmd, "--steps", "0"])


def test_bench_train_step_sets_the_cublas_workspace_per_row_and_pairs_by_it(capsys) -> None:
    """``--cublas-workspace-mb``: a row's process gets cuBLAS's and cuBLASLt's workspace in
    their environment variables' units (KiB, one workspace a stream), nothing for
    PyTorch's default; a CoMERA row is compared with the dense row of its own workspace;
    a size that is not a positive number of MiB is refused."""
    bts = script(ROOT / "experiments" / "bench_train_step.py")
    assert bts.workspace_env(None) == {}
    assert bts.workspace_env(4) == {"CUBLAS_WORKSPACE_CONFIG": ":4096:1",
                                    "CUBLASLT_WORKSPACE_SIZE": "4096"}
    row = {"preset": "tiny", "batch": 1, "graph": False, "step_ms_median": 1.0,
           "peak_mem_mb": 1.0, "params": 1}
    rows = [{**row, "variant": "dense", "cublas_workspace_mb": None, "peak_mem_mb": 40.0},
            {**row, "variant": "dense", "cublas_workspace_mb": 4, "peak_mem_mb": 12.0},
            {**row, "variant": "comera", "cublas_workspace_mb": 4, "peak_mem_mb": 3.0},
            {**row, "variant": "comera", "cublas_workspace_mb": None, "peak_mem_mb": 10.0}]
    got = {r["cublas_workspace_mb"]: r["mem_ratio"] for r in bts.ratios(rows)}
    assert got == {4: 4.0, None: 4.0}
    for bad in ("0", "x", "-4"):
        assert "--cublas-workspace-mb" in refused(
            capsys, [sys.executable, str(ROOT / "experiments" / "bench_train_step.py"),
                     "--cublas-workspace-mb", bad])


def test_bench_memory_counts_live_storages_as_a_hand_count_gives() -> None:
    """The CPU proxy of a step's peak memory (experiments/bench_memory.py) follows each
    storage an op creates until it is freed: a view adds nothing, an in-place op nothing,
    a freed tensor leaves the count; the peak is the most held at once."""
    bm = script(ROOT / "experiments" / "bench_memory.py")
    with bm.LiveBytes() as live:
        x = torch.ones(1024)  # 4 KiB
        v = x.view(32, 32).t()  # a view: nothing new
        x.add_(1)  # in place: nothing new
        y = x * 2  # 4 KiB more
        del x, v
        z = y + 1  # x freed first: still 8 KiB at most
        assert live.now == 8192
        del y, z
    assert live.now == 0 and live.peak == 8192


def test_bench_memory_splits_a_steps_peak_into_state_and_step(tmp_path, capsys,
                                                              monkeypatch) -> None:
    """Smoke run on the tiny transformer, fp32 (each row measured in this process, not in
    one of its own): per variant the state the step starts from is the parameters and
    AdamW's two moments (3 × 4 bytes a parameter, counted here from the parameter count;
    AdamW's step counters aside), the step's own peak holds at least the gradients, and
    CoMERA's whole peak is below dense's."""
    bm = script(ROOT / "experiments" / "bench_memory.py")
    monkeypatch.setattr(bm, "_one", lambda spec, out: out.write_text(
        json.dumps(bm.measure(**spec))))
    bm.main(["--presets", "tiny", "--batches", "1", "--amp", "off", "--out", str(tmp_path)])
    rows = {r["variant"]: r for r in json.loads(
        (tmp_path / "bench_memory_cpu.json").read_text())["rows"]}
    for r in rows.values():
        assert r["state_mb"] == pytest.approx(12 * r["params"] / 2**20, rel=1e-2)
        assert r["step_peak_mb"] >= r["grads_mb"] >= 4 * r["params"] / 2**20 * 0.99
        assert r["peak_mb"] == pytest.approx(r["state_mb"] + r["step_peak_mb"])
    assert rows["dense"]["peak_mb"] > rows["comera"]["peak_mb"]
    assert rows["comera"]["ratio"] == pytest.approx(
        rows["dense"]["peak_mb"] / rows["comera"]["peak_mb"])
    table = capsys.readouterr().out.splitlines()
    assert [line.split("|")[3].strip() for line in table[2:4]] == ["dense", "comera"]


def test_bench_step_overheads_writes_table_and_json(tmp_path, capsys) -> None:
    cmd = [sys.executable, str(ROOT / "experiments" / "bench_step_overheads.py"),
           "--preset", "tiny", "--rounds", "1", "--reps", "1", "--out", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    data = json.loads((tmp_path / "bench_step_overheads_cpu.json").read_text())
    got = {(r["part"], r["model"], r["variant"]) for r in data["rows"]}
    for model in ("comera", "dense"):
        for impl in ("per-parameter", "foreach", "fused"):
            assert ("AdamW step", model, impl) in got
    assert ("size surrogate", "comera", "one pass") in got
    assert ("gate refresh", "comera", "refresh_gates") in got
    assert all(r["ms"] > 0 for r in data["rows"]) and "| part" in out.stdout
    assert "--reps" in refused(capsys, [*cmd, "--reps", "0"])


def test_bench_tt_linear_key_row_and_backend_check(tmp_path, cpu_backend_dir) -> None:
    """The 768×768 rank-30 4096-token row gets its summary line, and with the CPU
    backend built the backend check times TT with the backend on and off against
    nn.Linear; ``--backend off`` runs the table on the pure PyTorch ops, no check."""
    env = {**os.environ, "COMERA_CPU_BACKEND_DIR": str(cpu_backend_dir)}
    cmd = [sys.executable, str(ROOT / "experiments" / "bench_tt_linear.py"), "--device", "cpu",
           "--shapes", "768x768", "--ranks", "30", "--tokens", "4096", "--rounds", "1",
           "--out", str(tmp_path)]
    for backend in ("on", "off"):
        out = subprocess.run([*cmd, "--backend", backend], capture_output=True, text=True,
                             timeout=600, cwd=ROOT, env=env)
        assert out.returncode == 0, out.stderr[-2000:]
        data = json.loads((tmp_path / "bench_tt_linear_cpu.json").read_text())
        summary = data["summary"]
        assert [r["shape"] for r in data["rows"]] == ["768x768"]
        assert summary["speedup_768_r30_4096"] > 0 and summary["cpu_backend"] == backend
        assert "768x768 r30 4096 tokens" in out.stdout
        if backend == "off":
            assert "backend_check" not in summary
            continue
        chk = summary["backend_check"]
        assert all(chk[k] > 0 for k in ("linear_ms", "tt_on_ms", "tt_off_ms", "speedup_on",
                                        "speedup_off", "backend_speedup"))
        assert set(chk["ways"]) >= {"halves-fwd", "halves-bwd"}
        assert "backend check" in out.stdout


def test_bench_controller_writes_table_and_json(tmp_path, capsys) -> None:
    """The controller's cost against fixed ranks: every stage's row, at the same ranks, the
    median of two processes, each process's overhead kept."""
    cmd = [sys.executable, str(ROOT / "experiments" / "bench_controller.py"), "--configs",
           "digits_tt_mlp", "--rounds", "2", "--reps", "1", "--processes", "2", "--out",
           str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads((tmp_path / "bench_controller_cpu.json").read_text())["rows"]
    assert [r["variant"] for r in rows] == ["fixed", "gates trained", "early", "late",
                                           "fixed ranks reached"]
    assert all(r["ms"] > 0 for r in rows) and rows[0]["overhead"] == 0.0
    assert all(len(r["overhead_runs"]) == 2 for r in rows)
    assert rows[0]["overhead_runs"] == [0.0, 0.0]
    for r in rows:  # the row is the median of the processes' overheads
        assert r["overhead"] == pytest.approx(sum(r["overhead_runs"]) / 2)
    assert "| digits_tt_mlp" in out.stdout and "per process" in out.stdout
    assert "--configs" in refused(capsys, [*cmd[:2], "--configs", "no_such_config"])
    # --ablate: each part of the early stage's objective on the gates-trained step (built
    # here, not timed), in its own results file (the page's stays as it was)
    bc = script(ROOT / "experiments" / "bench_controller.py")
    fns, _, _ = bc._variants("digits_tt_mlp", ablate=True)
    assert list(fns) == ["fixed", "gates trained", "+ loss root", "+ size value",
                         "+ size term", "early", "late", "fixed ranks reached"]
    for fn in fns.values():
        fn()  # each variant's step runs
    assert (bc._name(True), bc._name(False)) == ("bench_controller_ablate_cpu.json",
                                                 "bench_controller_cpu.json")


def test_own_loop_example_trains_to_the_target_against_dense(tmp_path) -> None:
    """experiments/own_loop.py (the README's loop, no CoMERA learning rate) end to end,
    briefly, on the MLP and the regression network: the dense learning rate chosen on
    validation, dense, fixed ranks and CoMERA per seed, both TT networks within ±5 % of
    the target, their held-out score (accuracy; R² for the regression) above chance,
    the JSON written."""
    out_json = tmp_path / "own_loop.json"
    cmd = [sys.executable, str(ROOT / "experiments" / "own_loop.py"), "--networks", "mlp",
           "regression", "--steps", "200", "--seeds", "0", "--lrs", "1e-3", "3e-3", "--out",
           str(out_json)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    nets = json.loads(out_json.read_text())["networks"]
    for name, chance in (("mlp", 0.1), ("regression", 0.0)):
        net = nets[name]
        assert set(net["lr_search"]) == {"0.001", "0.003"} and net["lr"] in (1e-3, 3e-3)
        assert [r["method"] for r in net["runs"]] == ["dense", "fixed ranks", "CoMERA"]
        for tt in net["runs"][1:]:  # fixed ranks and CoMERA: both at the target
            assert abs(tt["compression"] / net["target"] - 1) <= 0.05, name
            assert tt["test_score"] > chance + 0.4, name
    assert nets["regression"]["task"] == "regress"
    assert "mlp: asked 20× (TT layers)" in out.stdout
    assert "regression: asked 30× (TT layers)" in out.stdout and "held-out R²" in out.stdout
    assert "the optimizer's" in out.stderr  # CoMERA says which rates it set (the gates')


def test_own_loop_merges_a_run_of_some_networks_into_its_file(tmp_path) -> None:
    """A run of some networks replaces theirs in a results file of the same settings and
    keeps the others, in the script's order; a file of other settings is replaced."""
    import argparse

    sys.path.insert(0, str(ROOT / "experiments"))
    import own_loop

    settings = {"steps": 1500, "seeds": [0, 1, 2], "optimizer": "adamw",
                "schedule": "constant"}
    path = tmp_path / "own_loop.json"
    path.write_text(json.dumps({**settings, "networks": {"mlp": 1, "regression": 2}}))
    args = argparse.Namespace(**settings)
    merged = own_loop._merged(path, {"torch_encoder": 3, "mlp": 4}, args)
    assert merged == {"mlp": 4, "torch_encoder": 3, "regression": 2}
    assert list(merged) == ["mlp", "torch_encoder", "regression"]
    args.steps = 200
    assert own_loop._merged(path, {"mlp": 4}, args) == {"mlp": 4}
    assert own_loop._merged(tmp_path / "none.json", {"mlp": 4}, args) == {"mlp": 4}


def test_bench_launches_counts_the_ops_a_hand_count_gives() -> None:
    """The CPU proxy of experiments/bench_launches.py: ``nn.Linear`` forward + backward is
    ``addmm`` then ``mm`` (dX), ``mm`` (dW) and ``sum`` (db), three GEMMs without a bias;
    views are not counted, a host read is a sync, not an op."""
    sys.path.insert(0, str(ROOT / "experiments"))
    import bench_launches as bl

    dev = torch.device("cpu")
    for bias, ops in ((True, 4), (False, 3)):
        lin = torch.nn.Linear(16, 8, bias=bias)
        x = torch.randn(4, 16, requires_grad=True)
        got = bl.count(bl._fwd_bwd(lin, x, torch.randn(4, 8), list(lin.parameters())), dev)
        assert got["ops"] == ops and got["syncs"] == 0, got
        assert got["top"]["mm"] == (2 if bias else 3)
    t = torch.randn(3)
    got = bl.count(lambda: float(t.view(3, 1).t().sum()), dev, reps=3)
    assert got == {"ops": 1, "syncs": 1, "top": {"sum": 1}}


def test_bench_dashboard_times_the_live_pages_charts_both_ways(tmp_path, capsys) -> None:
    """The Live page's eight charts, as specs and as validated figures: a row each and one
    for the whole refresh (their sums), a table and the JSON."""
    bench = ROOT / "experiments" / "bench_dashboard.py"
    assert script(bench).main(["--points", "40", "--rounds", "1", "--reps", "1",
                               "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "bench_dashboard.json").read_text())["rows"]
    assert [r["chart"] for r in rows] == [
        "loss", "accuracy", "compression", "throughput", "rank heatmap", "rank bars",
        "memory", "system", "one refresh (all eight)"]
    assert rows[-1]["spec_ms"] == pytest.approx(sum(r["spec_ms"] for r in rows[:-1]))
    assert all(r["spec_ms"] > 0 and r["figure_ms"] > 0 for r in rows)
    assert "| chart" in capsys.readouterr().out
    assert "--points" in refused(capsys, [sys.executable, str(bench), "--points", "1"])


def test_bench_launches_sorts_real_kernel_names_by_what_they_do() -> None:
    """``kernel_kind`` on kernel names the profiler recorded on an H200: cuDNN's fused
    attention is attention though it names a GEMM instruction, cuBLAS's split-K reduce is
    part of a GEMM, a bf16 copy or a fill is not arithmetic, a Triton kernel of ours is
    ``other``."""
    sys.path.insert(0, str(ROOT / "experiments"))
    import bench_launches as bl

    said = {
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7": "attention",
        "nvjet_sm90_tst_64x32_64x16_1x4_h_bz_splitK_NNT": "gemm",
        "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16": "gemm",
        "std::enable_if<!(false), void>::type internal::gemvx::kernel<int, int": "gemm",
        "void at::native::vectorized_elementwise_kernel<8, at::native::bfloat16_copy_kern":
            "copy / cat / fill",
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>":
            "copy / cat / fill",
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy_contig<at::native":
            "copy / cat / fill",
        "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float": (
            "layer norm"),
        "void at::native::lpnorm_cleanup<float, (at::native::NormType)1, float": "reduction",
        "void at::native::reduce_kernel<256, 2, at::native::ReduceOp<float": "reduction",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native":
            "optimizer",
        "void at::native::_scatter_gather_elementwise_kernel<128, 8, at::native": (
            "gather / scatter"),
        "void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float":
            "elementwise",
        "void at::native::(anonymous namespace)::fused_dropout_kernel": "elementwise",
        "void at::native::radixSortKVInPlace<-2, -1, 32, 32, long, long": "sort / scan",
        "chain_kernel": "other",
    }
    assert {name: bl.kernel_kind(name) for name in said} == said
