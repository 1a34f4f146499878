"""Peak training memory of the peer methods on the SNLI transformer (docs/METHODS.md):
dense + AdamW, dense + GaLore, CoMERA's TT model (gated, at the ranks the trainer starts
from for the config's target) and the fixed-rank TT of the same target, at batch 1 and 32,
for ``experiments/configs/snli_transformer_tiny.toml``, its ``small`` preset and the
paper's transformer (``paper``: d 768, sequence 128, 30522 words, ranks 30 / 32, the 80x
whole-model target; batch 1, as the paper compares with GaLore).

    python experiments/bench_memory_peers.py                 # tiny, small (batch 1, 32), paper (1)
    python experiments/bench_memory_peers.py --presets tiny --batches 1

Each case runs in its own process (a fresh heap) with the trainer's own pieces: the run's
model (``train.methods.build_run_model``), its optimizer (CoMERA's AdamW groups, or
``galore_optimizer``), the CoMERA objective where the method has one, and
``train.step.TrainStep`` on real SNLI batches, with freed memory kept as ``train`` keeps
it on a CPU (``benchlib.keep_freed_memory_as_training_does``). Two warm-up steps create the
optimizer state (GaLore's projections included), then one measured step. Two figures:

- ``held``: bytes of the tensors a step holds at its peak: parameters, gradients,
  optimizer state (moments, GaLore projection matrices; every tensor in
  ``optimizer.state``) and the tensors autograd saves for backward (unique storages that
  are not parameters, counted through ``saved_tensors_hooks`` as
  ``benchlib.training_bytes`` does). The CPU has no allocator statistics, so this is an
  accounting, the CPU counterpart of CUDA's ``max_memory_allocated``.
- ``rss``: the process's peak resident memory over the three steps above its resident
  memory just before them (Linux: the peak is reset through ``/proc/self/clear_refs``),
  i.e. what training added to the built model: gradients, optimizer state, activations,
  temporaries and allocator slack (freed memory is kept, as ``train`` keeps it), with
  the parameters themselves already resident before.

Writes ``experiments/results/reproduce/memory/bench_memory_peers.json`` (kept with the
reproduction results: ``docs/RESULTS.md`` checks the GaLore claim from it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import tomllib
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import keep_freed_memory_as_training_does, machine, print_table, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "experiments" / "configs" / "snli_transformer_tiny.toml"
METHODS = {
    "dense+adamw": {"model.dense": True},
    "dense+galore": {"model.dense": True, "train.optimizer": "galore"},
    "comera-tt": {},
    "fixed-tt": {"comera.method": "fixed"},
}
MIB = 2**20
MEMORY_DIR = ROOT / "experiments" / "results" / "reproduce" / "memory"

#: The paper's comparison with GaLore (batch 1, RTX 3090): its six-encoder transformer at
#: d 768, sequence 128, a 30522-word vocabulary, TT ranks 30 (linears) and 32 (the TTM
#: word embedding) as CoMERA starts, and the 80x whole-model size it ends at. The
#: batches are SNLI's, tokenised to that vocabulary size.
PAPER = {"data.seq_len": 128, "data.vocab_size": 30522, "model.rank": 30,
         "model.embedding_rank": 32, "comera.target_compression": 80.0,
         "comera.target_scope": "model"}


def _raw(preset: str, method: str) -> dict[str, Any]:
    raw = tomllib.loads(CONFIG.read_text())
    raw["model"]["preset"] = preset
    for key, value in {**(PAPER if preset == "paper" else {}), **METHODS[method]}.items():
        section, name = key.split(".")
        raw.setdefault(section, {})[name] = value
    return raw


def _batches(preset: str, sizes: list[int], path: Path) -> None:
    """Real SNLI batches of each size (the first ``max(sizes)`` training examples), saved
    as plain tensors for the measuring processes."""
    from comera_engine.config import config_from_dict
    from comera_engine.data import build_dataset
    from comera_engine.runplan import data_config

    cfg = config_from_dict(_raw(preset, "dense+adamw"))
    cfg.base_dir = str(ROOT)
    bundle = build_dataset(data_config(cfg), base_dir=cfg.base_dir)
    from torch.utils.data import default_collate

    collate = bundle.collate_fn or default_collate  # what the trainer's batches use
    out = {}
    for b in sizes:
        batch = collate([bundle.train[i] for i in range(b)])
        out.update({f"{b}/{k}": v for k, v in batch.items()})
    torch.save(out, path)


def _rss() -> tuple[int, int]:
    """(current, peak) resident bytes of this process (Linux /proc)."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


def measure(preset: str, method: str, batch_size: int, batches: Path) -> dict[str, Any]:
    """One case, in this process (called in a child process by :func:`main`)."""
    from comera_engine.config import config_from_dict
    from comera_engine.models import TaskModel
    from comera_engine.preview import data_shape
    from comera_engine.rank import CoMERA
    from comera_engine.runplan import plan_initial_ranks
    from comera_engine.train.methods import build_run_model, galore_optimizer
    from comera_engine.train.step import TrainStep

    keep_freed_memory_as_training_does()
    torch.manual_seed(0)
    cfg = config_from_dict(_raw(preset, method))
    cfg.base_dir = str(ROOT)
    saved = torch.load(batches, weights_only=True)
    batch = {k.split("/", 1)[1]: v for k, v in saved.items()
             if k.startswith(f"{batch_size}/")}
    shape = data_shape(cfg.data)
    cfg, plan = plan_initial_ranks(cfg, shape)
    model = build_run_model(cfg, shape, plan)
    task = TaskModel(model, "nli")
    state = CoMERA(model, config=cfg.comera)
    if cfg.train.optimizer == "galore":
        opt = galore_optimizer(model, cfg)
    else:
        opt = state.make_optimizer()
    step = TrainStep(task, opt, state.objective_fn(), model.parameters(),
                     cfg.train.grad_clip, None)
    params = [p for p in model.parameters()]
    owned = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in owned:  # a weight saved for backward is counted with the parameters
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with open("/proc/self/clear_refs", "w") as f:  # reset the peak (VmHWM) to now
        f.write("5")
    before, _ = _rss()
    for i in range(3):  # the first two create the optimizer state (GaLore: projections)
        if i < 2:
            out = step(batch)
        else:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = step(batch)
        state.step(opt, loss=float(out["loss/task"]), truncate=False)
    _, peak = _rss()

    pbytes = sum(p.numel() * p.element_size() for p in params)
    gbytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    obytes = 0
    for s in opt.state.values():
        for v in s.values():
            if torch.is_tensor(v):
                obytes += v.numel() * v.element_size()
            elif hasattr(v, "ortho_matrix") and torch.is_tensor(v.ortho_matrix):
                obytes += v.ortho_matrix.numel() * v.ortho_matrix.element_size()
    saved_bytes = sum(seen.values())
    sizes = state.size_metrics()
    return {
        "preset": preset, "method": method, "batch": batch_size,
        "params": int(sum(p.numel() for p in params)),
        "compression": float(sizes.get("compression/model", 1.0)),
        "param_mib": pbytes / MIB, "grad_mib": gbytes / MIB, "optim_mib": obytes / MIB,
        "saved_mib": saved_bytes / MIB,
        "held_mib": (pbytes + gbytes + obytes + saved_bytes) / MIB,
        "rss_train_mib": (peak - before) / MIB,
        "galore_rank": "default (min side / 4)" if cfg.train.optimizer == "galore" else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", nargs="+", default=["tiny", "small", "paper"],
                    choices=["tiny", "small", "paper"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    ap.add_argument("--paper-batches", nargs="+", type=int, default=[1],
                    help="batch sizes for the paper preset (default 1, the paper's GaLore "
                         "comparison; 32 takes minutes a step on one CPU thread)")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.child:
        preset, method, b, path = args.child
        print(json.dumps(measure(preset, method, int(b), Path(path))))
        return 0
    if any(b < 1 for b in [*args.batches, *args.paper_batches]):
        ap.error("--batches, --paper-batches: must be positive integers")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets:
            path = Path(tmp) / f"{preset}.pt"
            batches = args.paper_batches if preset == "paper" else args.batches
            _batches(preset, batches, path)
            for b in batches:
                for method in args.methods:
                    cmd = [sys.executable, __file__, "--threads", str(args.threads),
                           "--child", preset, method, str(b), str(path)]
                    done = subprocess.run(cmd, capture_output=True, text=True, check=False,
                                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
                    if done.returncode:
                        print(done.stderr[-2000:], file=sys.stderr)
                        return 1
                    rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print_table(rows, [("preset", "preset", ""), ("batch", "batch", ""),
                       ("method", "method", ""), ("params", "params", ","),
                       ("compression", "x smaller", ".1f"), ("param_mib", "params MiB", ".2f"),
                       ("optim_mib", "optim MiB", ".2f"), ("saved_mib", "saved act MiB", ".2f"),
                       ("held_mib", "held MiB", ".2f"), ("rss_train_mib", "RSS +train MiB", ".1f")])
    out = write_json("bench_memory_peers", {"machine": machine(), "config": str(
        CONFIG.relative_to(ROOT)), "rows": rows}, MEMORY_DIR)
    print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
