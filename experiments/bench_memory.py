"""Peak memory of one training step, dense and CoMERA, counted on the CPU: what a GPU
step's ``torch.cuda.max_memory_allocated`` is made of, on any machine (the CPU proxy of
the step benchmark's peak, as ``bench_launches.py`` is of its kernels).

    python experiments/bench_memory.py                        # paper, batch 1
    python experiments/bench_memory.py --presets tiny --batches 1 32 --amp off

For each preset, batch and variant, in its own process (a fresh heap): the transformer of
the step benchmark (``bench_train_step.build_transformer``: the six-encoder classifier,
dense or CoMERA's TT model), the controller's AdamW groups, and
:class:`comera_engine.train.step.TrainStep` as a GPU step builds it: bf16 autocast
(``--amp bf16``), the TT linears' halves grouped per shape, every TT linear on the
``halves`` path (the path the planner picks for all of them on the H100 and H200; the
CPU's own planner would pick ``sweep`` for some), the pure-PyTorch ops
(``COMERA_NATIVE=0``: the ops a GPU runs). Two steps create the optimizer state; the
gradients are dropped (``zero_grad(set_to_none=True)``, as the step itself does first);
then one step runs under a ``TorchDispatchMode`` that follows every tensor storage an op
creates until it is freed. Per row:

- ``state_mb``: what the step starts from: parameters and the optimizer's moments;
- ``step_peak_mb``: the most the step held at once on top of it (activations saved for
  backward, gradients, temporaries of the moment);
- ``peak_mb``: their sum, the counterpart of ``max_memory_allocated`` over a step;
- ``grads_mb``: the gradients' bytes (part of ``step_peak_mb``).

What a GPU adds and this does not count: cuBLAS's workspace (32 MiB per stream on
Hopper, PyTorch's default; 4 MiB before), the caching allocator's rounding, and a CUDA
graph's pool. Beyond batch 1 the CPU counts more than a GPU holds: its attention with a
padding mask materialises the probabilities (a GPU's fused attention does not). Prints a
table and writes experiments/results/bench_memory_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import weakref
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

MB = 2**20


class LiveBytes:
    """The bytes of tensor storages created while it is entered (as a dispatch mode)
    and not yet freed: ``now`` and the most at once, ``peak``. A storage counts once
    (views and in-place results share it); storages that existed before are not counted,
    and their frees are not subtracted."""

    def __init__(self) -> None:
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        self.now = 0
        self.peak = 0
        self._live: set[int] = set()
        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
                out = func(*args, **(kwargs or {}))
                for t in out if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(t, torch.Tensor):
                        tracker._add(t.untyped_storage())
                return out

        self._mode = _Mode()

    def _add(self, storage) -> None:  # noqa: ANN001
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in self._live:
            return
        self._live.add(key)
        self.now += size
        self.peak = max(self.peak, self.now)
        weakref.finalize(storage, self._drop, key, size)

    def _drop(self, key: int, size: int) -> None:
        if key in self._live:
            self._live.discard(key)
            self.now -= size

    def __enter__(self) -> LiveBytes:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)


def measure(preset: str, batch: int, variant: str, amp: str) -> dict:
    """One row: the step's memory for ``variant`` (``dense`` or ``comera``)."""
    import torch
    from bench_train_step import build_transformer, nli_batch
    from benchlib import state_bytes, tensor_bytes

    from comera_engine.layers import groupable_linears
    from comera_engine.models import TaskModel
    from comera_engine.rank import CoMERA
    from comera_engine.train.step import TrainStep

    torch.manual_seed(0)
    model = build_transformer(preset, dense=variant == "dense")
    for layer in groupable_linears(model):
        layer.path = "halves"  # the GPU's choice (module doc)
    state = CoMERA(model)
    optimizer = state.make_optimizer()
    step = TrainStep(TaskModel(model, "nli"), optimizer, state.objective_fn(),
                     model.parameters(), grad_clip=1.0,
                     autocast_dtype=torch.bfloat16 if amp == "bf16" else None,
                     grouped=True)
    data = nli_batch(batch)
    for _ in range(2):  # the optimizer's moments
        step(data)
    optimizer.zero_grad(set_to_none=True)

    held = state_bytes(model.parameters(), optimizer)  # no gradients yet
    with LiveBytes() as live:
        step(data)
    grads = tensor_bytes(p.grad for p in model.parameters())
    return {"preset": preset, "batch": batch, "variant": variant, "amp": amp,
            "params": sum(p.numel() for p in model.parameters()),
            "state_mb": held / MB, "step_peak_mb": live.peak / MB,
            "peak_mb": (held + live.peak) / MB, "grads_mb": grads / MB}


def _one(spec: dict, out: Path) -> None:
    """Measure one row in a fresh process (a fresh heap, nothing cached from another)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", json.dumps(spec),
           "--one-out", str(out)]
    env = {**os.environ, "COMERA_NATIVE": "0"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.stderr.write(done.stderr)
        raise SystemExit(f"bench_memory: {spec} failed")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", nargs="+", default=["paper"],
                    choices=["tiny", "small", "paper"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1])
    ap.add_argument("--amp", choices=["bf16", "off"], default="bf16")
    ap.add_argument("--out", type=Path, default=None, help="JSON folder (experiments/results)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--one-out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        spec = json.loads(args.one)
        args.one_out.write_text(json.dumps(measure(**spec)))
        return
    if any(b < 1 for b in args.batches):
        ap.error("--batches: each must be a positive integer")
    import benchlib as bl

    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets:
            for batch in args.batches:
                pair = {}
                for variant in ("dense", "comera"):
                    out = Path(tmp) / f"{preset}-{batch}-{variant}.json"
                    _one({"preset": preset, "batch": batch, "variant": variant,
                          "amp": args.amp}, out)
                    pair[variant] = json.loads(out.read_text())
                    rows.append(pair[variant])
                for row in pair.values():  # dense's peak over the row's (dense: 1)
                    row["ratio"] = pair["dense"]["peak_mb"] / row["peak_mb"]
    cols = [("preset", "preset", "s"), ("batch", "batch", "d"), ("variant", "variant", "s"),
            ("state_mb", "state MB", ".1f"), ("step_peak_mb", "step peak MB", ".1f"),
            ("grads_mb", "of it grads MB", ".1f"), ("peak_mb", "peak MB", ".1f"),
            ("ratio", "dense peak / this", ".2f")]
    bl.print_and_write(rows, cols, "bench_memory_cpu",
                       {"machine": bl.machine(), "amp": args.amp, "rows": rows,
                        "not_counted": "cuBLAS workspace (32 MiB a stream on Hopper), "
                                       "allocator rounding, a CUDA graph's pool"},
                       args.out)


if __name__ == "__main__":
    main()
