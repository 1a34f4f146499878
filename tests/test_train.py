"""The trainer: learning on real data, checkpoints and resume, divergence, stop, DDP, CUDA graphs.

All CPU except the CUDA-graph test (skipped without a GPU). Tiny presets throughout;
single-threaded torch (tiny models are faster so on small shared CPUs).
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from comera_engine.config import config_from_dict, to_toml
from comera_engine.errors import ConfigError
from comera_engine.metrics import JSONLSink, read_jsonl
from comera_engine.rank.schedule import switch_plan
from comera_engine.train import checkpoint as ckpt
from comera_engine.train.loop import TrainResult, train
from comera_engine.train.lr_schedule import lr_factor

ROOT = Path(__file__).resolve().parents[1]
SNLI_DEV = ROOT.parent / "shared" / "data" / "snli" / "dev.jsonl"
#: metric names that depend on wall-clock time or the machine, not on the numbers
TIMING = ("perf/", "mem/", "sys/")  # readings of the clock and the machine


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def digits_cfg(**sections: dict[str, Any]) -> dict[str, Any]:
    """A TT-MLP-on-digits config dict; ``sections`` update the tables."""
    raw: dict[str, Any] = {
        "name": "digits",
        "model": {"name": "tt_mlp", "preset": "tiny", "tt_layers": ["hidden"]},
        "data": {"name": "digits"},
        "comera": {
            "gamma": 0.01,
            "switch": 150,
            "target_compression": 60.0,
            "target_scope": "tensorized",
            "lr_cores": 3e-3,
            "lr_gates": 1e-2,
            "lr_dense": 3e-3,
            "weight_decay": 0.0,
        },
        "train": {"steps": 500, "batch_size": 64, "eval_every": 100, "ckpt_every": 250},
    }
    for name, values in sections.items():
        raw[name].update(values)
    return raw


class StopAt(JSONLSink):
    """JSONL sink that raises the stop flag once ``step`` has been logged."""

    def __init__(self, path: Path, step: int, flag: threading.Event) -> None:
        super().__init__(path)
        self.stop_step, self.flag = step, flag

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        super().log_metrics(step, metrics)
        if step == self.stop_step:
            self.flag.set()


def run(
    raw: dict[str, Any],
    run_dir: Path,
    resume: bool = False,
    stop_at: int | None = None,
) -> tuple[TrainResult, list[dict[str, Any]]]:
    cfg = config_from_dict(copy.deepcopy(raw))
    cfg.base_dir = str(ROOT)
    run_dir.mkdir(parents=True, exist_ok=True)
    flag = threading.Event()
    sink = (
        StopAt(run_dir / "metrics.jsonl", stop_at, flag)
        if stop_at
        else JSONLSink(run_dir / "metrics.jsonl")
    )
    try:
        result = train(cfg, run_dir, sink, resume=resume, stop_flag=flag, progress=False)
    finally:
        sink.close()
    return result, read_jsonl(run_dir / "metrics.jsonl")


def metric_rows(records: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """step -> metrics without the timing-dependent ones (last record per step wins)."""
    rows: dict[int, dict[str, float]] = {}
    for r in records:
        if r["type"] == "metrics":
            rows[r["step"]] = {k: v for k, v in r["values"].items() if not k.startswith(TIMING)}
    return rows


# ---------------------------------------------------------------------- learning


def test_digits_tt_mlp_reaches_90_percent_in_under_60_s(tmp_path) -> None:
    """The shipped digits setup (TT-matrix linears, experiments/configs/digits_tt_mlp.toml)
    at 60x in 500 steps."""
    raw = digits_cfg(model={"linear_layout": "ttm"})
    t0 = time.perf_counter()
    result, records = run(raw, tmp_path / "run")
    elapsed = time.perf_counter() - t0
    rows = metric_rows(records)
    before, after = rows[150]["compression/tensorized"], rows[500]["compression/tensorized"]
    print(
        f"digits TT-MLP: eval acc {result.metrics['eval/acc']:.3f} in {elapsed:.1f} s; "
        f"late stage: tensorized compression {before:.1f}x -> {after:.1f}x (target 60x)"
    )
    assert result.status == "finished" and result.step == 500
    assert result.metrics["eval/acc"] >= 0.90
    assert elapsed < 60.0
    assert set(rows) == set(range(1, 501))  # a metrics record at every step
    last = rows[500]
    for key in (
        "loss/task",
        "loss/total",
        "acc/train",
        "grad_norm",
        "params/effective",
        "params/dense",
        "compression/model",
        "compression/tensorized",
        "lr/cores",
        "lr/gates",
        "lr/dense",
        "stage",
        "comera/lambda",
        "eval/loss",
        "eval/acc",
    ):
        assert key in last, key  # fmt: skip
    assert rows[150]["stage"] == 0.0 and rows[151]["stage"] == 1.0  # late stage after 150
    # the late stage prunes ranks toward the target: the model gets smaller, for real
    assert after > 1.3 * before
    kinds = {r["kind"] for r in records if r["type"] == "event"}
    assert "pace" in kinds or "rank_change" in kinds
    assert after == pytest.approx(60.0, rel=0.05)  # the target is met, within 5 %
    raw_last = [r for r in records if r["type"] == "metrics"][-1]["values"]
    assert raw_last["perf/step_time_s"] > 0 and raw_last["mem/rss_mb"] > 0
    ranks = [r for r in records if r["type"] == "ranks"]
    assert ranks[0]["step"] == 1 and set(ranks[0]["ranks"]) == {"body.0", "body.3"}
    assert sum(map(sum, ranks[-1]["ranks"].values())) < sum(map(sum, ranks[0]["ranks"].values()))
    assert [r["status"] for r in records if r["type"] == "status"] == ["running", "finished"]
    # truncated checkpoints really are smaller than the cores were at the start
    meta = json.loads((tmp_path / "run" / "checkpoints" / "step_000500.json").read_text())
    fresh = _fresh_shapes(raw)
    n_ckpt = sum(math.prod(meta["shapes"][k]) for k in fresh if ".tt.cores." in k)
    n_fresh = sum(math.prod(fresh[k]) for k in fresh if ".tt.cores." in k)
    assert n_ckpt < n_fresh


def test_code_mlm_loss_falls(tmp_path) -> None:
    raw = {
        "name": "mlm",
        "model": {"name": "transformer_mlm", "preset": "tiny"},
        "data": {"name": "code_mlm", "seq_len": 32, "max_files": 12, "vocab_size": 500},
        "comera": {"switch": "never", "lr_cores": 3e-3, "lr_gates": 1e-2, "lr_dense": 2e-3},
        "train": {"steps": 120, "batch_size": 16, "eval_every": 60, "eval_batches": 4,
                  "ckpt_every": 0},
    }  # fmt: skip
    result, records = run(raw, tmp_path / "run")
    rows = metric_rows(records)
    first = sum(rows[s]["loss/task"] for s in range(1, 11)) / 10
    last = sum(rows[s]["loss/task"] for s in range(111, 121)) / 10
    ppl = result.metrics["eval/ppl"]
    print(f"code MLM: train loss {first:.3f} -> {last:.3f}, eval loss "
          f"{rows[60]['eval/loss']:.3f} -> {rows[120]['eval/loss']:.3f}, eval ppl {ppl:.1f}")
    assert last < first - 0.5
    assert rows[60]["eval/loss"] > rows[120]["eval/loss"]


def test_bf16_autocast_trains_like_fp32(tmp_path) -> None:
    """precision=bf16 (the GPU default) through both stages: same learning as fp32 within
    bf16 noise. The TT-linear backward once crashed here (fp32 input, bf16 gradient)."""
    accs = {}
    for prec in ("fp32", "bf16"):
        raw = digits_cfg(comera={"target_compression": 30.0},  # reached in 90 late steps
                         train={"steps": 300, "batch_size": 64, "eval_every": 150,
                                "ckpt_every": 300, "precision": prec})
        result, records = run(raw, tmp_path / prec)
        assert result.status == "finished" and result.step == 300
        stages = {r["values"].get("stage") for r in records if r["type"] == "metrics"}
        assert stages == {0.0, 1.0}, stages  # both stages ran (early = 0, late = 1)
        accs[prec] = result.metrics["eval/acc"]
    print(f"digits eval acc: fp32 {accs['fp32']:.3f}, bf16 {accs['bf16']:.3f}")
    assert accs["bf16"] >= 0.8 and abs(accs["bf16"] - accs["fp32"]) <= 0.08


@pytest.mark.parametrize(
    "name", ["digits_tt_mlp", "snli_transformer_tiny", "code_mlm_tiny", "dlrm_synthetic_tiny"]
)
def test_cpu_example_configs_train(tmp_path, monkeypatch, name) -> None:
    from comera_engine.config import load_config

    if name.startswith("snli") and not SNLI_DEV.is_file():
        pytest.skip(f"SNLI dev file not found at {SNLI_DEV} (needs ../shared/data)")
    monkeypatch.chdir(ROOT)  # data paths in the configs are relative to the repository
    overrides = [
        "train.steps=4",
        "train.eval_every=2",
        "train.eval_batches=2",
        "train.ckpt_every=2",
    ]
    cfg = load_config(ROOT / "experiments" / "configs" / f"{name}.toml", overrides)
    sink = JSONLSink(tmp_path / "metrics.jsonl")
    result = train(cfg, tmp_path, sink, progress=False)
    sink.close()
    assert result.status == "finished" and result.step == 4
    assert math.isfinite(result.metrics["eval/loss"])
    if name.startswith("dlrm"):
        assert 0.0 <= result.metrics["eval/auc"] <= 1.0
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path / "checkpoints")] == [2, 4]


# ---------------------------------------------------------------------- checkpoints, resume


@pytest.mark.pytorch_path
def test_resume_gives_identical_metrics(tmp_path) -> None:
    # Strong pruning so that ranks shrink and cores are physically truncated at the
    # step-10 checkpoint; late stage from step 12; stop at 20 (a checkpoint of both runs).
    # The rates warm up then decay (train.lr_schedule): a function of the step, so the
    # resumed run goes on along the same curve.
    raw = digits_cfg(
        comera={"gamma": 0.5, "lr_gates": 5e-2, "switch": 12, "target_compression": 50.0},
        train={"steps": 30, "batch_size": 32, "eval_every": 10, "ckpt_every": 10,
               "lr_schedule": "cosine", "warmup_steps": 4},
        model={"dropout": 0.1},
    )
    full, full_records = run(raw, tmp_path / "full")
    part, _ = run(raw, tmp_path / "part", stop_at=20)
    assert part.status == "stopped" and part.step == 20
    resumed, part_records = run(raw, tmp_path / "part", resume=True)
    assert resumed.status == "finished" and resumed.step == 30

    a, b = metric_rows(full_records), metric_rows(part_records)
    assert sorted(a) == sorted(b) == list(range(1, 31))
    for step in a:
        assert a[step] == b[step], f"step {step}"
    # the decay waits for the pace to fix the ranks (reach_at 0.8 of 30 steps: 24)
    hold = switch_plan(config_from_dict(raw).comera, 30).reach
    assert hold == 24
    base = a[1]["lr/dense"] / lr_factor(0, 30, "cosine", 4, hold)
    for step in (1, 4, 5, 21, 25, 26, 30):  # the curve, the gates' rate kept
        assert a[step]["lr/dense"] == pytest.approx(
            base * lr_factor(step - 1, 30, "cosine", 4, hold))
        assert a[step]["lr/gates"] == a[1]["lr/gates"]
    assert a[24]["lr/dense"] == a[5]["lr/dense"] > a[26]["lr/dense"]
    # the run shrank ranks and truncated before the stop, so resume rebuilt smaller cores
    meta = json.loads((tmp_path / "part" / "checkpoints" / "step_000020.json").read_text())
    fresh = _fresh_shapes(raw)
    assert any(meta["shapes"][k] != fresh[k] for k in fresh), "no truncation happened"
    # final weights are bit-identical
    wa = _tensors(tmp_path / "full" / "checkpoints" / "step_000030.safetensors")
    wb = _tensors(tmp_path / "part" / "checkpoints" / "step_000030.safetensors")
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.pytorch_path
def test_a_seeded_run_trains_alike_on_the_cpu_backend_and_in_pytorch(tmp_path, monkeypatch,
                                                                     cpu_backend) -> None:
    """The digits run (both stages, pruning, truncation, checkpoints) on the CPU backend's
    ops and on the pure PyTorch path (``COMERA_NATIVE=0``): the same losses within float32
    rounding, step by step, and the same ranks at the end (the backend only reorders
    float32 sums, it computes the same function)."""
    raw = digits_cfg(train={"steps": 200, "batch_size": 32, "eval_every": 100,
                            "ckpt_every": 100}, model={"linear_layout": "ttm"},
                     comera={"switch": 60})
    native, native_records = run(raw, tmp_path / "native")
    monkeypatch.setenv("COMERA_NATIVE", "0")
    plain, plain_records = run(raw, tmp_path / "pytorch")
    a, b = metric_rows(native_records), metric_rows(plain_records)
    assert native.status == plain.status == "finished" and sorted(a) == sorted(b)
    for step in a:
        assert a[step]["loss/task"] == pytest.approx(b[step]["loss/task"], rel=2e-3, abs=1e-4)
    ranks = [[r for r in recs if r["type"] == "ranks"][-1]["ranks"]
             for recs in (native_records, plain_records)]
    assert ranks[0] == ranks[1]
    assert native.metrics["eval/acc"] == pytest.approx(plain.metrics["eval/acc"], abs=0.02)


def _fresh_shapes(raw: dict[str, Any]) -> dict[str, list[int]]:
    from comera_engine.data import build_dataset
    from comera_engine.models import build_model

    cfg = config_from_dict(copy.deepcopy(raw))
    model = build_model(cfg.model, build_dataset({"name": "digits"}))
    return {k: list(v.shape) for k, v in model.state_dict().items()}


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("saved_capturable", [True, False])
def test_resume_keeps_this_optimizers_implementation_flags(tmp_path, saved_capturable) -> None:
    """A checkpoint of a CUDA-graph run (capturable AdamW) resumes into a CPU optimizer,
    and a CPU checkpoint into a capturable one: hyper-parameters and moments come from
    the checkpoint, ``capturable``/``foreach``/``fused`` from the optimizer resuming."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    saver = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05,
                              capturable=saved_capturable, foreach=False)
    if not saved_capturable:  # a CPU run: one real step, so there are moments to restore
        model(torch.randn(5, 4)).sum().backward()
        saver.step()
    ckpt.save_checkpoint(tmp_path, 1, model, saver, {})
    meta, tensors = ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path))
    resumed = torch.optim.AdamW(model.parameters(), lr=1.0, capturable=not saved_capturable)
    resumed.load_state_dict(ckpt.optimizer_state(resumed, meta, tensors))
    group = resumed.param_groups[0]
    assert group["capturable"] is (not saved_capturable)
    assert group["lr"] == 3e-3 and group["weight_decay"] == 0.05 and group["foreach"] is None
    if saved_capturable:  # resumed on the CPU: the next step must run
        model(torch.randn(5, 4)).sum().backward()
        resumed.step()
    else:
        torch.testing.assert_close(resumed.state[model.weight]["exp_avg"],
                                   saver.state[model.weight]["exp_avg"])


def test_checkpoint_layout_and_atomic_files(tmp_path) -> None:
    raw = digits_cfg(comera={"switch": "never"},  # no stage checkpoint in 6 steps
                     train={"steps": 6, "batch_size": 32, "ckpt_every": 2, "keep_checkpoints": 2})
    result, records = run(raw, tmp_path / "run")
    d = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in d.iterdir()) == [
        "step_000004.json", "step_000004.safetensors", "step_000006.json",
        "step_000006.safetensors",
    ]  # fmt: skip
    meta = json.loads((d / "step_000006.json").read_text())
    for key in ("step", "comera", "rng", "data", "config", "ranks", "shapes", "optimizer"):
        assert key in meta
    assert meta["step"] == 6 and meta["config"]["train"]["steps"] == 6
    assert isinstance(meta["rng"]["torch"], list)
    tensors = _tensors(d / "step_000006.safetensors")
    assert any(k.startswith("model/") for k in tensors)
    assert any(k.startswith("optim/") and k.endswith("exp_avg") for k in tensors)
    assert result.checkpoint == str(d / "step_000006.safetensors")
    arts = [r for r in records if r["type"] == "artifact"]
    assert [Path(a["path"]).name for a in arts][-1] == "step_000006.safetensors"


def test_a_cpu_run_keeps_freed_memory(tmp_path, monkeypatch) -> None:
    """train sets glibc's thresholds (cpu_memory.keep_freed_memory) before a CPU run's
    first step, so its steps reuse freed pages."""
    from comera_engine.train import loop

    calls: list[int] = []
    monkeypatch.setattr(loop, "keep_freed_memory", lambda: calls.append(1) or 0)
    result, _ = run(digits_cfg(train={"steps": 2, "batch_size": 16, "ckpt_every": 0}),
                    tmp_path / "run")
    assert result.status == "finished" and calls == [1]


def test_divergence_stops_with_status_diverged(tmp_path, monkeypatch) -> None:
    # the loss turns infinite from the 21st call on (a config can no longer ask for a
    # learning rate large enough to overflow: comera.lr_* are bounded)
    import torch.nn.functional as F

    real, calls = F.cross_entropy, [0]

    def blows_up(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls[0] += 1
        loss = real(*args, **kwargs)
        return loss * float("inf") if calls[0] > 20 else loss

    monkeypatch.setattr(F, "cross_entropy", blows_up)
    raw = digits_cfg(
        model={"dense": True},
        train={"steps": 50, "batch_size": 32, "ckpt_every": 1, "grad_clip": 0.0,
               "keep_checkpoints": 100},
    )  # fmt: skip
    result, records = run(raw, tmp_path / "run")
    assert result.status == "diverged"
    final = [r for r in records if r["type"] == "status"][-1]
    assert final["status"] == "diverged"
    assert final["error"].startswith("non-finite loss or gradient at step")  # why, for `runs`
    assert any(r["type"] == "event" and r["kind"] == "error" for r in records)
    steps = [s for s, _ in ckpt.list_checkpoints(tmp_path / "run" / "checkpoints")]
    assert steps and max(steps) < result.step  # nothing saved at or after the bad step
    logged = metric_rows(records)
    assert all(math.isfinite(v["loss/task"]) for v in logged.values())


def test_stop_flag_checkpoints_and_reports_stopped(tmp_path) -> None:
    raw = digits_cfg(train={"steps": 100, "batch_size": 32, "ckpt_every": 0})
    result, records = run(raw, tmp_path / "run", stop_at=7)
    assert result.status == "stopped" and result.step == 7
    assert ckpt.latest_checkpoint(tmp_path / "run" / "checkpoints").name == "step_000007.json"
    assert [r["status"] for r in records if r["type"] == "status"][-1] == "stopped"
    # where it stands toward its target, which resuming goes on toward: not a verdict
    (said,) = [r["text"] for r in records if r["type"] == "event" and r["kind"] == "target"]
    assert said.startswith("target ") and " at step 7 of 100 when it stopped" in said
    assert "missed" not in said and "reached" not in said
    assert result.target == said


def test_sigterm_stops_a_cli_run(tmp_path) -> None:
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(to_toml(config_from_dict(digits_cfg(train={"steps": 100000}))))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "comera_engine.cli", "train", str(cfg), "--run-dir",
         str(tmp_path / "run"), "--no-progress"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 90
    while time.time() < deadline:
        if metrics.exists() and '"metrics"' in metrics.read_text():
            break
        time.sleep(0.2)
    proc.terminate()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    records = read_jsonl(metrics)
    assert records[-1] == {**records[-1], "type": "status", "status": "stopped"}
    last_step = max(r["step"] for r in records if r["type"] == "metrics")
    latest = ckpt.latest_checkpoint(tmp_path / "run" / "checkpoints")
    assert latest is not None and latest.name == f"step_{last_step:06d}.json"


# ---------------------------------------------------------------------- objective


def _objective_reference(model, cfg, stage, z_f, target_size, S0, ramp, f, frozen=False,
                         paper=False, scale=1.0):
    """comera-method.md §2 written out in float64 from the gates and cores alone:
    ``Ŝ = Σ_layers Σ_k s_k·‖g_{k-1}‖₁·‖g_k‖₁`` over active entries (outer bonds 1),
    ``S`` the same with entry counts (plus the TT biases; plus every other parameter for
    the model scope), then the early scalarisation (``Ŝ`` over the initial allocated
    size) or the late one (over the current cores' size, the size terms off once the
    target is reached), or the task loss alone once the ranks are fixed. ``paper``: the
    spec's late stage as it is written (``Ŝ/S₀``; λ and ``ρ_S`` whatever the size).
    ``scale``: every size term's factor (``comera.loss_scale``: ``min(1, f₀)``).
    Returns the total and λ; gradients flow to ``f``, gates and cores (float64 leaves)."""
    from comera_engine.layers import tt_layers

    s_hat = torch.zeros((), dtype=torch.float64)
    size = cores_size = 0.0
    reg = torch.zeros((), dtype=torch.float64)
    leaves = []
    for _, layer in tt_layers(model):
        tt = layer.tt
        masks = [((g.detach().abs() > tt.tau) & a) for g, a in zip(tt.gates, tt.bond_alive())]
        gates = [g.detach().double().requires_grad_() for g in tt.gates]
        cores = [c.detach().double().requires_grad_() for c in tt.cores]
        leaves.append((tt, gates, cores))
        norms = [(g.abs() * m.double()).sum() for g, m in zip(gates, masks)]
        counts = [float(m.sum()) for m in masks]
        one = torch.ones((), dtype=torch.float64)
        R, C = [one, *norms, one], [1.0, *counts, 1.0]
        for k, sk in enumerate(tt.mode_sizes):
            s_hat = s_hat + sk * R[k] * R[k + 1]
        if min(C) > 0:
            cores_size += sum(sk * C[k] * C[k + 1] for k, sk in enumerate(tt.mode_sizes))
        bias = getattr(layer, "bias", None)
        size += bias.numel() if bias is not None else 0
        reg = reg + sum((c ** 2).sum() for c in cores)
    if cfg.target_scope == "model":
        from comera_engine.rank.size import dense_size

        size += dense_size(model)["other"]
    size += cores_size
    reg = cfg.l2_cores * reg
    if frozen:  # ranks fixed at the target: the task loss alone
        return f + reg, 0.0, leaves
    if stage == "early":  # normalised by the initial allocated size
        return f + cfg.gamma * ramp * scale * s_hat / S0 + reg, 0.0, leaves
    s_hat = scale * s_hat / (S0 if paper else cores_size)  # ours: by the current size
    fv = float(f.detach())
    reached = size <= target_size and not paper
    lam = 1.0 if ((fv - z_f) / fv < (size - target_size) / size and not reached) else 0.0
    rho_s = 0.0 if reached else cfg.rho_s
    traded = 0.0 if cfg.keep_task_loss else lam  # keep_task_loss: λ only adds the size
    total = cfg.rho_f * f + rho_s * s_hat + lam * s_hat + (1 - traded) * f + reg
    return total, lam, leaves


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("schedule", ["paced", "paper"])
@pytest.mark.parametrize("scope", ["tensorized", "model"])
def test_objective_matches_the_method_formula_in_float64(scope, schedule, keep) -> None:
    """The one objective (device tensors, no host reads, the form CUDA graphs capture)
    gives the loss, lambda and gradients of the method's formula computed independently
    in float64, in both stages, during the gamma warm-up and for both lambda outcomes;
    with ``comera.schedule = "paper"`` the spec's formula as written. A task loss that
    started at 0.3 scales the size terms by 0.3 / ln 2 (``loss_scale``, not the
    paper's), one that started above ln 2 (any classifier's) leaves them as they are.
    ``keep_task_loss`` (``keep``): λ = 1 adds the size term, the task loss keeps its
    weight."""
    from types import SimpleNamespace

    from comera_engine.config import CoMERAConfig, ModelConfig
    from comera_engine.layers import tt_layers as pairs
    from comera_engine.models import build_model
    from comera_engine.rank import CoMERA
    from comera_engine.rank.objective import gamma_ramp
    from comera_engine.rank.optim import refresh_gates

    def tt_layers(m: torch.nn.Module) -> dict:
        return dict(pairs(m))

    torch.manual_seed(0)
    data = SimpleNamespace(name="x", task="classification", num_classes=10, meta={"input_dim": 64})
    model = build_model(ModelConfig(name="tt_mlp", preset="tiny"), data)
    target = 40.0 if scope == "tensorized" else 20.0  # not reached yet (33x, 15x now)
    cfg = CoMERAConfig(
        gamma=0.3, gamma_warmup=10, target_compression=target, target_scope=scope, l2_cores=1e-3,
        schedule=schedule, keep_task_loss=keep)
    paper = schedule == "paper"
    state = CoMERA(model, config=cfg)
    with torch.no_grad():  # kill a few ranks so that the masks matter
        for layer in tt_layers(model).values():
            layer.tt.gates[1][:3] = 0.0
    refresh_gates(model)
    obj = state.objective
    obj.recount()  # the cores' size after the ranks changed (the controller's step does it)
    obj.loss_start = 0.3  # where the task loss started: the size terms' units
    scale = 1.0 if paper else 0.3 / math.log(2)

    def check(f_value: float, step: int = 100) -> float:
        state.steps_done = step  # the γ warm-up of the step after `step` steps
        model.zero_grad()
        f = torch.tensor(f_value, requires_grad=True)
        total, info = obj(f)
        total.backward()
        f64 = torch.tensor(f_value, dtype=torch.float64, requires_grad=True)
        ref, lam, leaves = _objective_reference(
            model, cfg, obj.stage, obj.z_f, obj.target_size, obj.S0,
            gamma_ramp(cfg.gamma_warmup, step), f64, frozen=obj.frozen, paper=paper,
            scale=scale)
        ref.backward()
        assert float(total.detach()) == pytest.approx(float(ref.detach()), rel=1e-6)
        assert float(info["lambda"]) == lam
        assert f.grad.item() == pytest.approx(f64.grad.item(), rel=1e-6)
        for tt, gates, cores in leaves:
            d_gate = tt.gate.grad if tt.gate.grad is not None else torch.zeros_like(tt.gate)
            mine = [*d_gate.split(tt.bond_ranks),
                    *(c.grad if c.grad is not None else torch.zeros_like(c) for c in tt.cores)]
            for got, ref_leaf in zip(mine, [*gates, *cores]):
                want = ref_leaf.grad if ref_leaf.grad is not None else torch.zeros_like(ref_leaf)
                torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7)
        return lam

    assert check(0.7, step=3) == 0.0  # early stage, gamma still warming up
    assert check(0.7) == 0.0  # early stage
    obj.loss_start, scale = 0.7, 1.0  # a loss that starts above ln 2: the spec's weights
    assert check(0.7) == 0.0
    obj.loss_start, scale = 0.3, 1.0 if paper else 0.3 / math.log(2)
    obj.switch_to_late(z_f=0.69)  # task loss near its target: size is further -> lambda 1
    assert check(0.7) == 1.0
    obj.z_f = -10.0  # task loss far above its target: lambda 0
    assert check(0.7) == 0.0
    obj.z_f, obj.target_size = 0.69, 1e9  # target reached: lambda 0, no size augmentation
    assert check(0.7) == 0.0
    obj.z_f = 1e9  # reached, the loss far below z_f: ours keeps λ 0, the paper's gives 1
    assert check(0.7) == (1.0 if paper else 0.0)
    state.freeze()  # ranks fixed at the target: the task loss alone, no gate dies
    assert check(0.7) == 0.0
    assert all(layer.tt.tau == 0.0 for layer in tt_layers(model).values())


def test_graph_path_step_trains_like_the_eager_step_on_cpu() -> None:
    """The step the CUDA graph captures (device-side gate refresh, no host reads) follows
    the same trajectory as the eager step with the host refresh, through both stages and
    gate pruning; run here on the CPU."""
    from comera_engine.config import CoMERAConfig, ModelConfig
    from comera_engine.data import build_dataset
    from comera_engine.models import TaskModel, build_model
    from comera_engine.rank import CoMERA
    from comera_engine.train.step import TrainStep

    bundle = build_dataset({"name": "digits"})
    x, y = bundle.train.tensors["x"], bundle.train.tensors["labels"]
    cfg = CoMERAConfig(
        gamma=0.5,
        gamma_warmup=5,
        target_compression=60.0,
        target_scope="tensorized",
        lr_cores=3e-3,
        lr_gates=5e-2,
        lr_dense=3e-3,
    )
    runs = []
    for graph_safe in (False, True):
        torch.manual_seed(0)
        model = build_model(ModelConfig(name="tt_mlp", preset="tiny", dropout=0.0), bundle)
        state = CoMERA(model, config=cfg, total_steps=40)  # with the pace's prunes
        opt = state.make_optimizer()
        step = TrainStep(
            TaskModel(model, "classification"),
            opt,
            state.objective_fn(),
            model.parameters(),
            1.0,
            None,
            refresh=state.refresh_fn() if graph_safe else None,  # device-side gate refresh
        )
        losses, events = [], []
        for i in range(40):
            if i == 20:
                state.objective.switch_to_late(z_f=0.3)
                step.objective = state.objective_fn()
            out = step({"x": x[i * 32 : (i + 1) * 32], "labels": y[i * 32 : (i + 1) * 32]})
            counts = out["gate_counts"].tolist() if graph_safe else None
            done = state.step(opt, loss=float(out["loss/task"]), counts=counts, truncate=False)
            events += [f"{e.kind}: {e.text}" for e in done if e.kind in ("rank_change", "pace")]
            losses.append(float(out["loss/total"]))
            # the objective's S_c is the gates' count after every step, pace prunes too
            assert state.objective.size_cores == sum(
                m.tt.num_params(True) for m in state._layers.values()), i
        runs.append((losses, events, state.effective_ranks()))
    (l1, e1, r1), (l2, e2, r2) = runs
    assert e1 == e2 and r1 == r2  # same rank-change and pace events, same ranks
    assert any(e.startswith("pace") for e in e1), e1
    assert l2 == pytest.approx(l1, rel=1e-5, abs=1e-6)


def test_graph_constant_marks_a_function_as_torch_compiler_does() -> None:
    """The planner marks its choice and the layers' layout constant for Dynamo without
    importing it: the mark is the one ``torch.compiler.assume_constant_result`` sets."""
    from comera_engine.tensor.planner import graph_constant

    def ours() -> int:
        return 1

    def torchs() -> int:
        return 1

    graph_constant(ours)
    torch.compiler.assume_constant_result(torchs)
    marks = dict(vars(torchs))
    assert marks and vars(ours) == marks


@pytest.mark.filterwarnings("error:Dynamo detected a call to a `functools.lru_cache`")
@pytest.mark.filterwarnings("error:Dynamo does not know how to trace")
def test_compiled_step_trains_like_the_eager_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """``TrainStep(compile="default")``: the forward and the CoMERA objective traced by
    Dynamo and AOTAutograd (the TT Functions and the objective in one graph; the
    ``aot_eager`` backend here: Inductor's C++ code generation takes minutes on 2 cold
    CPU cores and is torch's own) give the eager step's losses and parameters over a
    few steps; the trace warns about none of the engine's caches (the planner's choice
    and the layers' layout are constants of the graph) and meets no C++ call it cannot
    trace (the CPU backend's: a traced graph takes the PyTorch path)."""
    import functools
    from types import SimpleNamespace

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))

    from comera_engine.config import ModelConfig
    from comera_engine.models import TaskModel, build_model
    from comera_engine.rank import CoMERA
    from comera_engine.train.step import TrainStep

    data = SimpleNamespace(name="x", task="classification", num_classes=10, meta={"input_dim": 64})
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
    runs = []
    for mode in (None, "default"):
        torch.manual_seed(0)
        model = build_model(ModelConfig(name="tt_mlp", preset="tiny", dropout=0.0), data)
        state = CoMERA(model)
        opt = state.make_optimizer()
        step = TrainStep(TaskModel(model, "classification"), opt, state.objective_fn(),
                         model.parameters(), 1.0, None, compile=mode)
        losses = []
        for _ in range(3):
            out = step({"x": x, "labels": y})
            state.step(opt, loss=float(out["loss/task"]), truncate=False)
            losses.append(float(out["loss/total"]))
        runs.append((losses, [p.detach().clone() for p in model.parameters()]))
    (l1, p1), (l2, p2) = runs
    assert l2 == pytest.approx(l1, rel=1e-5)
    for a, b in zip(p1, p2):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)

@pytest.mark.filterwarnings("error:Dynamo detected a call to a `functools.lru_cache`")
@pytest.mark.parametrize("path", ["sweep", "halves"])
def test_each_tt_linear_path_compiles_without_cache_warnings(path: str) -> None:
    """``torch.compile`` over one TT linear on each CPU path (the sweep is what a small
    batch takes, which the step above does not reach): no warning about the engine's
    caches, and the eager values and gradients."""
    from comera_engine.tensor.planner import tt_linear

    g = torch.Generator().manual_seed(0)
    cores = [torch.randn(s, generator=g, requires_grad=True)
             for s in ((1, 8, 6), (6, 8, 5), (5, 8, 7), (7, 8, 1))]
    x = torch.randn(2, 64, generator=g)

    def f(x: torch.Tensor, *cores: torch.Tensor) -> torch.Tensor:
        return tt_linear(x, list(cores), 2, path=path)

    outs = []
    for fn in (f, torch.compile(f, backend="aot_eager", fullgraph=True)):
        y = fn(x, *cores)
        grads = torch.autograd.grad(y.square().sum(), cores)
        outs.append((y.detach(), grads))
    torch.testing.assert_close(outs[1][0], outs[0][0])
    for a, b in zip(outs[0][1], outs[1][1]):
        torch.testing.assert_close(b, a)


def test_grouped_step_trains_like_the_per_layer_step() -> None:
    """``TrainStep(grouped=True)`` (a GPU step's default): the transformer's TT linears of
    each shape get their halves from one batched pass; three steps give the losses and
    parameters of the step where every layer merges its own."""
    import sys

    sys.path.insert(0, str(ROOT / "experiments"))
    from bench_train_step import build_transformer, nli_batch

    from comera_engine.models import TaskModel
    from comera_engine.rank import CoMERA
    from comera_engine.train.step import TrainStep

    data = nli_batch(4)
    runs = []
    for grouped in (False, True):
        torch.manual_seed(0)
        model = build_transformer("tiny", dense=False)
        state = CoMERA(model)
        opt = state.make_optimizer()
        step = TrainStep(TaskModel(model, "nli"), opt, state.objective_fn(),
                         model.parameters(), 1.0, None, grouped=grouped)
        losses = [float(step(data)["loss/total"]) for _ in range(3)]
        runs.append((losses, [p.detach().clone() for p in model.parameters()]))
        assert step.grouped_layers == (len(step.tt_linears()) if grouped else 0)
    from comera_engine.tensor.grouped import grouped_halves

    with grouped_halves([m.tt for m in step.tt_linears()]) as n:
        assert n == len(step.tt_linears()) >= 6  # every one in a group of its shape
    (l1, p1), (l2, p2) = runs
    assert l2 == pytest.approx(l1, rel=1e-5)
    for a, b in zip(p1, p2):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def test_device_gate_refresh_equals_the_reference() -> None:
    from types import SimpleNamespace

    from comera_engine.config import ModelConfig
    from comera_engine.layers import tt_layers as pairs
    from comera_engine.models import build_model
    from comera_engine.rank.optim import refresh_gates, refresh_gates_on_device

    def tt_layers(m: torch.nn.Module) -> dict:
        return dict(pairs(m))

    data = SimpleNamespace(name="x", task="classification", num_classes=10, meta={"input_dim": 64})
    torch.manual_seed(0)
    a = build_model(ModelConfig(name="tt_mlp", preset="tiny"), data)
    with torch.no_grad():
        for layer in tt_layers(a).values():
            for g in layer.tt.gates:
                g.copy_(torch.randn(g.shape) * 0.02)  # many entries at or below tau = 0.01
            layer.tt.gates[2].fill_(-0.004)  # a whole bond below tau: its strongest is kept
            layer.tt.gates[2][1] = -0.009
            layer.tt.bond_alive()[0][0] = False  # an entry pruned earlier stays dead
    b = copy.deepcopy(a)
    events = refresh_gates(a)
    counts = refresh_gates_on_device(b)
    for la, lb in zip(tt_layers(a).values(), tt_layers(b).values()):
        for k, (ga, gb) in enumerate(zip(la.tt.gates, lb.tt.gates)):
            assert torch.equal(ga, gb) and torch.equal(la.tt.bond_alive()[k], lb.tt.bond_alive()[k])
    ref = [int(m.tt.bond_alive()[k].sum()) for m in tt_layers(a).values() for k in range(5)]
    assert counts.tolist() == ref
    # the loop logs ranks from these counts (no gate reads): same as reading the gates
    from comera_engine.rank import CoMERA

    state = CoMERA(b)
    assert state.effective_ranks(counts.tolist()) == state.effective_ranks()
    assert len(events) > 0 and any(e.new == 1 for e in events)
    assert tt_layers(b)["body.0"].tt.gates[2][1].item() == pytest.approx(-0.015)


# ---------------------------------------------------------------------- DDP


def _train_on_two_processes(tmp_path: Path, raw: dict[str, Any], run_dir: Path,
                            launcher: str | None = None, launcher_args: tuple[str, ...] = (),
                            timeout: int = 180) -> subprocess.CompletedProcess:
    """``comera train`` of ``raw`` under torchrun with 2 gloo processes (1 thread each),
    through ``launcher`` (a test launcher's source, which ends in ``cli.main()``) when
    given, its ``launcher_args`` before the command."""
    raw = {**raw, "train": {**raw.get("train", {}), "device": "cpu"}}  # gloo, on a GPU box too
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(to_toml(config_from_dict(raw)))
    entry = ["-m", "comera_engine.cli"]
    if launcher is not None:
        path = tmp_path / "launcher.py"
        path.write_text(launcher)
        entry = [str(path), *launcher_args]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         *entry, "train", str(cfg), "--run-dir", str(run_dir), "--no-progress"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("layout", ["tt", "ttm"])
@pytest.mark.pytorch_path
def test_ddp_two_processes_match_one_process_with_the_global_batch(tmp_path, layout) -> None:
    """2 gloo processes with batch b train exactly like 1 process with batch 2b: same
    examples per step (the global batch is split), gradients averaged, in both linear
    layouts."""
    base = digits_cfg(
        model={"dropout": 0.0, "linear_layout": layout},
        comera={"switch": 8},
        train={"steps": 16, "batch_size": 16, "eval_every": 8, "ckpt_every": 8},
    )
    ddp_dir = tmp_path / "ddp"
    t0 = time.perf_counter()
    proc = _train_on_two_processes(tmp_path, base, ddp_dir)
    print(f"DDP run: {time.perf_counter() - t0:.1f} s")
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_jsonl(ddp_dir / "metrics.jsonl")
    steps = [r["step"] for r in records if r["type"] == "metrics"]
    assert steps == list(range(1, 17))  # one stream: each step logged once
    assert [r["status"] for r in records if r["type"] == "status"] == ["running", "finished"]
    assert [s for s, _ in ckpt.list_checkpoints(ddp_dir / "checkpoints")] == [8, 16]

    single = copy.deepcopy(base)
    single["train"]["batch_size"] = 32
    _, single_records = run(single, tmp_path / "single")
    a, b = metric_rows(records), metric_rows(single_records)
    for step in (1, 8, 16):
        assert a[step]["loss/task"] == pytest.approx(b[step]["loss/task"], rel=1e-4, abs=1e-5)
    assert a[16]["eval/acc"] == pytest.approx(b[16]["eval/acc"], abs=0.01)
    wa = _tensors(ddp_dir / "checkpoints" / "step_000016.safetensors")
    wb = _tensors(tmp_path / "single" / "checkpoints" / "step_000016.safetensors")
    for key in wa:
        if key.startswith("model/"):
            torch.testing.assert_close(wa[key], wb[key], rtol=1e-3, atol=1e-4)


_FAIL_ON_RANK_1 = """
import os, sys
from comera_engine.rank import controller
from comera_engine import cli

_step = controller.CoMERA.step


def step(self, *args, **kwargs):
    if os.environ["RANK"] == "1" and self.steps_done == 3:
        raise RuntimeError("injected failure on rank 1")
    return _step(self, *args, **kwargs)


controller.CoMERA.step = step
sys.exit(cli.main())
"""


def test_ddp_one_failing_process_ends_the_job(tmp_path) -> None:
    """When one process raises mid-run, the job ends with an error (the failed process
    leaves without the final barrier; torchrun then stops the other) instead of hanging
    until the process-group timeout. The failure is injected by a test launcher."""
    raw = digits_cfg(train={"steps": 50, "batch_size": 16, "eval_every": 0, "ckpt_every": 0})
    t0 = time.perf_counter()
    proc = _train_on_two_processes(tmp_path, raw, tmp_path / "run", _FAIL_ON_RANK_1,
                                   timeout=150)
    print(f"failed DDP job ended after {time.perf_counter() - t0:.1f} s")
    assert proc.returncode != 0
    assert "injected failure on rank 1" in proc.stderr


_RECORD_EACH_PROCESS = """
import json, os, sys
from comera_engine.rank import controller, objective
from comera_engine import cli

out = os.path.join(sys.argv.pop(1), "process_" + os.environ["RANK"] + ".jsonl")
_call, _truncate = objective.CoMERAObjective.__call__, controller.CoMERA.truncate


def call(self, f):
    total, info = _call(self, f)
    if self.stage == "late":
        with open(out, "a") as fh:
            fh.write(json.dumps({"lambda": float(info["lambda"])}) + "\\n")
    return total, info


def truncate(self, optimizer, **kwargs):
    done = _truncate(self, optimizer, **kwargs)
    with open(out, "a") as fh:
        fh.write(json.dumps({"ranks": self.effective_ranks(),
                             "shapes": {n: list(m.tt.ranks) for n, m in
                                        self._layers.items()}}) + "\\n")
    return done


objective.CoMERAObjective.__call__ = call
controller.CoMERA.truncate = truncate
sys.exit(cli.main())
"""


def test_ddp_processes_agree_on_lambda_and_on_the_ranks_after_truncation(tmp_path) -> None:
    """2 gloo processes, each with its own half of the batch (so its own batch loss): the
    late stage's λ is decided from the all-reduced loss, so both processes take the same λ
    at every step, and after every truncation (each evaluation, the checkpoints) both hold
    the same effective and allocated ranks. Recorded per process by a test launcher."""
    raw = digits_cfg(  # ranks pinned at 8 (24x): far enough from 120x for λ to alternate
        model={"rank": 8},
        comera={"switch": 6, "pace": False, "gamma": 0.5, "lr_gates": 5e-2,
                "target_compression": 120.0},
        train={"steps": 40, "batch_size": 16, "eval_every": 10, "ckpt_every": 20},
    )
    proc = _train_on_two_processes(tmp_path, raw, tmp_path / "run", _RECORD_EACH_PROCESS,
                                   (str(tmp_path),))
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = (read_jsonl(tmp_path / f"process_{r}.jsonl") for r in (0, 1))
    lam_a, lam_b = ([r["lambda"] for r in x if "lambda" in r] for x in (a, b))
    assert len(lam_a) == 34 and lam_a == lam_b
    assert 0.0 in lam_a and 1.0 in lam_a  # both outcomes happened, on both processes alike
    ranks_a, ranks_b = ([r for r in x if "ranks" in r] for x in (a, b))
    assert len(ranks_a) == len(ranks_b) >= 2 and ranks_a == ranks_b
    first = ranks_a[0]["ranks"]
    assert ranks_a[-1]["ranks"] != first  # ranks were pruned and truncated on the way


def test_slice_at_the_prune_the_next_step_runs_on_truncated_cores(tmp_path, monkeypatch
                                                                  ) -> None:
    """After every prune (the gates' or the pace's) the cores and the optimizer state are
    sliced before the next step: every step starts with no dead entry allocated, and the
    optimizer's moments have the cores' shapes."""
    from comera_engine.layers import tt_layers
    from comera_engine.train import step as step_module

    seen: list[tuple[bool, bool, list[int]]] = []
    call = step_module.TrainStep.__call__

    def recording(self, batch):  # noqa: ANN001, ANN202
        model = self.task_model.model
        layers = [m for _, m in tt_layers(model)]
        clean = all(bool(mk.all()) for m in layers for mk in m.tt.masks())
        state = self.optimizer.state
        fits = all(v.shape == p.shape for m in layers for p in m.tt.cores
                   for v in state.get(p, {}).values() if torch.is_tensor(v) and v.dim())
        seen.append((clean, fits, [r for m in layers for r in m.tt.ranks]))
        return call(self, batch)

    monkeypatch.setattr(step_module.TrainStep, "__call__", recording)
    raw = digits_cfg(model={"linear_layout": "ttm"},
                     train={"steps": 200, "eval_every": 0, "ckpt_every": 0})
    result, records = run(raw, tmp_path / "run")
    assert result.status == "finished" and len(seen) == 200
    assert all(clean and fits for clean, fits, _ in seen)
    assert seen[-1][2] != seen[0][2]  # the ranks did shrink on the way
    pruned = [r["step"] for r in records if r["type"] == "event" and r["kind"] == "pace"]
    cut = [r["step"] for r in records if r["type"] == "event" and r["kind"] == "truncate"]
    assert pruned and set(pruned) <= set(cut)  # each prune is sliced at its own step


_GRAPHED_STEP_UNDER_DDP = """
import sys
from comera_engine import cli
from comera_engine.rank import controller
from comera_engine.train import loop

_init, _make = loop._Run.__init__, controller.CoMERA.make_optimizer


def init(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    self.use_graph = True  # the CUDA path's GraphedStep, here on CPU: DDP turns graphs off


def make_optimizer(self, lr=1e-3, capturable=False):
    return _make(self, lr=lr, capturable=False)  # capturable AdamW needs a GPU


loop._Run.__init__ = init
controller.CoMERA.make_optimizer = make_optimizer
sys.exit(cli.main())
"""


def test_ddp_truncation_through_a_graphed_step_with_graphs_off(tmp_path) -> None:
    """The multi-GPU path on CPU: under DDP the step is a GraphedStep with graphs disabled
    and a device-side gate refresh; truncations release the wrapper and the step, then
    rebuild both (this crashed with an AttributeError in GraphedStep.reset)."""
    raw = digits_cfg(comera={"switch": 20}, train={"steps": 80, "batch_size": 16,
                                                   "eval_every": 40, "ckpt_every": 0})
    proc = _train_on_two_processes(tmp_path, raw, tmp_path / "run", _GRAPHED_STEP_UNDER_DDP)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    events = [r for r in records if r["type"] == "event"]
    assert any(e["kind"] == "slow_path" and "DistributedDataParallel" in e["text"]
               for e in events)
    assert sum(e["kind"] == "truncate" for e in events) >= 2
    assert [r["status"] for r in records if r["type"] == "status"][-1] == "finished"


# ---------------------------------------------------------------------- CUDA graphs


def _graph_test_config(snli: bool) -> dict[str, Any]:
    """The CUDA-graph test's run: both stages (a switch at step 60, so a re-capture)."""
    raw = {
        "name": "graph",
        "model": {"name": "transformer_cls", "preset": "tiny", "dropout": 0.0},
        "data": {"name": "snli", "path": str(SNLI_DEV), "seq_len": 32, "vocab_size": 1000},
        "comera": {"switch": 60, "target_compression": 4.0, "lr_cores": 1e-3,
                   "lr_gates": 1e-2, "lr_dense": 1e-3},
        "train": {"steps": 120, "batch_size": 32, "eval_every": 0, "ckpt_every": 0,
                  "precision": "fp32", "device": "cuda"},
    }  # fmt: skip
    if not snli:
        raw["data"] = {"name": "digits"}
        raw["model"] = {"name": "tt_mlp", "preset": "tiny", "dropout": 0.0}
    return raw


@pytest.mark.parametrize("snli", [True, False])
def test_graph_test_config_is_valid(snli: bool) -> None:
    """The GPU-only test below must not fail on its config before reaching the GPU (it
    once lacked the target a stage switch needs)."""
    cfg = config_from_dict(_graph_test_config(snli))
    assert cfg.train.device == "cuda" and cfg.comera.target_compression == 4.0


def _graph_and_eager(raw: dict[str, Any], tmp_path: Path) -> tuple[list, list]:
    """The records of ``raw`` trained with the CUDA graph (which must have been used) and
    eagerly."""
    graph, g_records = run(raw, tmp_path / "graph")
    eager_raw = copy.deepcopy(raw)
    eager_raw["train"]["cuda_graph"] = False
    _, e_records = run(eager_raw, tmp_path / "eager")
    assert graph.graph_reason is None, graph.graph_reason
    return g_records, e_records


@pytest.mark.gpu
def test_cuda_graph_matches_eager_and_is_faster(tmp_path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the CUDA-graph path needs a GPU")
    torch.set_num_threads(4)
    g_records, e_records = _graph_and_eager(_graph_test_config(SNLI_DEV.is_file()), tmp_path)
    a, b = metric_rows(g_records), metric_rows(e_records)
    for step in (1, 50, 100, 120):
        assert a[step]["loss/task"] == pytest.approx(b[step]["loss/task"], rel=2e-3, abs=1e-4)

    def median_step(records: list[dict[str, Any]]) -> float:
        times = sorted(
            r["values"]["perf/step_time_s"] for r in records
            if r["type"] == "metrics" and r["step"] > 70  # after re-capture at the switch
        )  # fmt: skip
        return times[len(times) // 2]

    ratio = median_step(e_records) / median_step(g_records)
    print(f"CUDA graph speed-up per step (eager / graph): {ratio:.2f}x")
    (ROOT / "experiments" / "results").mkdir(parents=True, exist_ok=True)
    (ROOT / "experiments" / "results" / "cuda_graph_step_ratio.json").write_text(
        json.dumps({"eager_over_graph": ratio, "device": torch.cuda.get_device_name()})
    )
    assert ratio > 1.0


def _scheduled(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` with a warm-up and a held cosine decay (train.lr_schedule)."""
    raw = copy.deepcopy(raw)
    raw["train"].update(lr_schedule="cosine", warmup_steps=20)
    return raw


def test_the_scheduled_graph_test_config_is_valid() -> None:
    cfg = config_from_dict(_scheduled(_graph_test_config(False)))
    assert (cfg.train.lr_schedule, cfg.train.warmup_steps) == ("cosine", 20)


@pytest.mark.gpu
def test_a_scheduled_rate_reaches_the_captured_step(tmp_path) -> None:
    """Under a CUDA graph the groups' rates are device tensors the captured optimizer step
    reads (train/lr_schedule.py): replayed, the warm-up and decay train as the eager step
    does (a rate baked into the graph at capture would drift from it at once)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the CUDA-graph path needs a GPU")
    g_records, e_records = _graph_and_eager(_scheduled(_graph_test_config(False)), tmp_path)
    a, b = metric_rows(g_records), metric_rows(e_records)
    for step in (1, 10, 30, 90, 120):
        assert a[step]["lr/dense"] == pytest.approx(b[step]["lr/dense"])
        assert a[step]["loss/task"] == pytest.approx(b[step]["loss/task"], rel=2e-3, abs=1e-4)
    assert a[10]["lr/dense"] < a[30]["lr/dense"] > a[120]["lr/dense"]


@pytest.mark.gpu
def test_grouped_step_in_a_cuda_graph_trains_like_the_per_layer_eager_step() -> None:
    """On a GPU the step groups the TT linears' halves by default; replayed from a CUDA
    graph it gives the losses of the eager step where every layer merges its own."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the grouped step in a CUDA graph needs a GPU")
    import sys

    sys.path.insert(0, str(ROOT / "experiments"))
    from bench_train_step import build_transformer, nli_batch

    from comera_engine.models import TaskModel
    from comera_engine.rank import CoMERA
    from comera_engine.train.step import GraphedStep, TrainStep

    data = nli_batch(8, "cuda")
    runs = []
    for grouped in (None, False):
        torch.manual_seed(0)
        model = build_transformer("tiny", dense=False).cuda()
        state = CoMERA(model)
        opt = state.make_optimizer(capturable=grouped is None)
        step = TrainStep(TaskModel(model, "nli"), opt, state.objective_fn(),
                         model.parameters(), 1.0, None, grouped=grouped)
        runner = GraphedStep(step, log=lambda text: None) if grouped is None else step
        runs.append([float(runner(data)["loss/total"]) for _ in range(8)])
        if grouped is None:
            assert step.grouped_layers == len(step.tt_linears()) >= 6
            assert runner.active, "the step was not captured"
    assert runs[0] == pytest.approx(runs[1], rel=1e-3)


def test_stage_switch_by_epoch(tmp_path) -> None:
    from comera_engine.train.batches import BatchPlan

    raw = digits_cfg(comera={"switch": "auto", "switch_epoch": 1, "switch_by": 0.9,
                             "reach_at": 0.95},
                     train={"steps": 40, "eval_every": 0, "ckpt_every": 0})
    result, records = run(raw, tmp_path / "run")
    assert result.status == "finished"
    stages = [r for r in records if r["type"] == "event" and r["kind"] == "stage"]
    cfg = config_from_dict(copy.deepcopy(raw))
    from comera_engine.data import build_dataset
    from comera_engine.runplan import data_config

    n_train = len(build_dataset(data_config(cfg), base_dir=str(ROOT)).train)
    per_epoch = BatchPlan(n_train, 64, cfg.train.seed, 0, 1).steps_per_epoch
    assert 0 < per_epoch < 40
    assert [r["step"] for r in stages] == [per_epoch]
    rows = metric_rows(records)
    assert rows[per_epoch - 1]["stage"] == 0 and rows[per_epoch + 1]["stage"] == 1


def test_switch_epoch_validation() -> None:
    for bad, field in (({"switch_epoch": -1}, "comera.switch_epoch"),
                       ({"switch_epoch": 1, "switch": 100}, "comera.switch_epoch"),
                       ({"switch_epoch": 1, "target_compression": None},
                        "comera.target_compression")):
        raw = digits_cfg(comera={"switch": "auto", **bad})
        with pytest.raises(ConfigError, match=f"^{field}"):
            config_from_dict(raw)


def test_explicit_gpu_index_under_torchrun_is_refused(monkeypatch) -> None:
    """``cuda:N`` with several torchrun processes would put them all on one GPU (NCCL
    then fails on duplicate devices): refused up front, naming the field and the fix."""
    from comera_engine.train.distributed import resolve_device

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"^train\.device.*use 'cuda' or 'auto'"):
        resolve_device("cuda:1", local_rank=1)
    assert resolve_device("cpu", local_rank=1) == torch.device("cpu")
