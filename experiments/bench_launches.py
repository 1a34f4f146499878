"""Kernel launches per TT layer path and per training step: the count that sets a GPU step's
floor (about 17 µs a kernel on an H100 even inside a CUDA graph, docs/BENCHMARKS.md).

    python experiments/bench_launches.py                  # CPU proxy (any machine)
    python experiments/bench_launches.py --device cuda    # real kernel launches
    python experiments/bench_launches.py --quick          # layers only, no whole step

What is counted, per case, over ``--reps`` calls after one warm-up call (the per-call mean):

* on CUDA (``--device cuda``): every kernel, memcpy and memset the profiler records on the
  device (``torch.profiler``, CUDA activity): what a CUDA graph replays one by one; and
  their summed durations (``kernel_us``, µs per call) with the twelve kernel names that
  take the most of it (``top_kernel_us``), and the same time by kernel kind (GEMM,
  elementwise, reduction, copy, optimizer, ...: ``kernel_us_by_kind``): where a step's
  device time goes.
* on the CPU (the proxy): the ATen ops that reach the dispatcher below autograd (a
  ``TorchDispatchMode``: what autograd and the composite ops decompose into, each op once
  however it is implemented inside), less views (``OpOverload.is_view``) and ops that
  launch nothing on a GPU (allocations without a fill, ``detach``, conjugate flags, a
  Python number wrapped as a CPU scalar: ``_FREE``). Each counted op is about one kernel
  on a GPU; a ``_foreach_*`` / ``_fused_*`` op counts once (on a GPU one launch per chunk
  of tensors). The C++ CPU backend is off (``COMERA_NATIVE=0``): the PyTorch ops are the
  ones a GPU runs. ``syncs``: host reads (``item``, ``_local_scalar_dense``,
  ``is_nonzero``). On CUDA the proxy is counted too, side by side.

Everything runs under bf16 autocast by default (``--amp bf16``: what a GPU step runs; the
casts it adds are kernels too), on the CPU proxy as on CUDA; ``--amp off`` counts fp32.

Cases: each path of a TT linear (``tt`` layout: ``dense`` = reconstructed, ``halves``,
``sweep``, ``fused`` where the kernels run; ``ttm`` layout: ``dense``, ``sweep``), the TTM
embedding lookup (``dense``, ``gather``, ``fused`` where the kernels run) and the tied
decoder (``table``, ``tt``), each forward + backward at the paper's shapes
(``--tokens`` rows), the gates passed as the layers pass them; ``nn.Linear`` /
``nn.Embedding`` for reference. Then one whole training step of the paper transformer
(``--step-batch`` sequences of 128 tokens: forward, the CoMERA objective, backward,
clipping, AdamW as a graphed GPU step builds it, the gate refresh), split into its phases
(with two alternatives beside: torch's ``fused`` AdamW, and ``tensor.size.refresh_entries``,
the refresh of all bonds at once), and the dense baseline's. The step groups its TT
linears' halves per shape (``TrainStep(grouped=True)``, a GPU step's default;
``--ungrouped``: each layer merges its own). Prints a table and writes
experiments/results/bench_launches_<device>.json.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("COMERA_NATIVE", "0")  # the PyTorch ops: what a GPU runs

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))
import benchlib as bl  # noqa: E402

#: ops that launch nothing on a GPU besides views (which the proxy never counts)
_FREE = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided",
                   "resize_", "lift_fresh", "detach", "detach_", "alias", "set_",
                   "resolve_conj", "resolve_neg", "_conj", "conj", "scalar_tensor",
                   "_to_copy_noop", "is_same_size", "record_stream", "sym_size", "sym_stride",
                   "sym_numel", "sym_storage_offset", "size", "stride", "dim", "numel",
                   "_unsafe_view"})
_SYNCS = frozenset({"item", "_local_scalar_dense", "is_nonzero"})


class _OpCounter(TorchDispatchMode):
    """Records every op that reaches the dispatcher below autograd (the CPU proxy)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = func._schema.name.removeprefix("aten::")
        if name in _SYNCS:
            self.syncs += 1
        elif not func.is_view and name not in _FREE and not (
                name == "_to_copy" and _same_device_dtype(args, kwargs or {})):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def _same_device_dtype(args: tuple, kwargs: dict) -> bool:
    """A ``_to_copy`` to the dtype and device the tensor has (no work: never reached in
    practice, kept for clarity)."""
    t = args[0] if args else None
    return (isinstance(t, torch.Tensor) and kwargs.get("dtype", t.dtype) == t.dtype
            and kwargs.get("device", t.device) == t.device)


#: the paper's TT-linear shapes (factors as in the paper)
PAPER = {"768x768": ([12, 8, 8], [8, 8, 12]), "768x3072": ([12, 8, 8], [12, 16, 16]),
         "3072x768": ([16, 16, 12], [8, 8, 12])}


def count(fn: Callable[[], object], device: torch.device, reps: int = 2) -> dict:
    """Ops (CPU proxy) or kernels (CUDA) per call of ``fn`` (module doc), the host
    reads, and the most frequent op / kernel names."""
    fn()  # warm-up: lazy state, caches, the planner's choice
    bl.sync(device)
    counter = _OpCounter()
    with counter:
        for _ in range(reps):
            fn()
    out = {"ops": len(counter.ops) / reps, "syncs": counter.syncs / reps,
           "top": {k: v / reps for k, v in Counter(counter.ops).most_common(10)}}
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        bl.sync(device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn()
            bl.sync(device)
        # the device's own work: a ``record_function`` range (``Optimizer.step#...``) is a
        # CUDA event too, spanning kernels counted on their own
        dev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not getattr(e, "is_user_annotation", False)]
        out["kernels"] = len(dev) / reps
        out["top_kernels"] = {k: v / reps for k, v in
                              Counter(e.name[:60] for e in dev).most_common(10)}
        # where the device's time goes (the same kernels a graph replays, run eagerly
        # here): their summed durations, the twelve names that take the most, and by kind
        spent: Counter[str] = Counter()
        kinds: Counter[str] = Counter()
        for e in dev:
            us = e.time_range.elapsed_us()
            spent[e.name[:80]] += us
            kinds[kernel_kind(e.name)] += us
        out["kernel_us"] = sum(spent.values()) / reps
        out["top_kernel_us"] = {k: v / reps for k, v in spent.most_common(12)}
        out["kernel_us_by_kind"] = {k: v / reps for k, v in kinds.most_common()}
    return out


#: (kind, substrings of a kernel's name), the first match wins: attention before GEMM
#: (cuDNN's fused attention names its tensor-core instructions), a GEMM before the
#: elementwise kernels (cuBLAS's split-K reduce), a copy or fill before them too
KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("sdpa", "flash", "fmha", "attention")),
    ("gemm", ("gemm", "gemv", "cutlass", "cublas", "xmma", "nvjet", "wgmma", "matmul")),
    ("softmax / loss", ("softmax", "nll_loss", "cross_entropy")),
    ("layer norm", ("layer_norm",)),
    ("optimizer", ("multi_tensor_apply", "fused_adam", "adam")),
    ("gather / scatter", ("index", "gather", "scatter", "embedding")),
    ("sort / scan", ("sort", "scan")),
    ("copy / cat / fill", ("copy", "memcpy", "memset", "fill")),  # a cat is a copy
    ("reduction", ("reduce", "norm")),
    ("elementwise", ("elementwise", "dropout")),
)


def kernel_kind(name: str) -> str:
    """What a CUDA kernel does, from its name (``KINDS``; ``other`` where none matches):
    where a step's device time goes, by kind rather than by the 12 costliest names."""
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other")


# ---------------------------------------------------------------------- the layers
def _fwd_bwd(forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
             dy: torch.Tensor, params: list[torch.Tensor]) -> Callable[[], None]:
    """One forward + backward (``dy`` given: no loss op), gradients dropped after."""
    def run() -> None:
        y = forward(x)
        y.backward(dy)
        for p in params:
            p.grad = None
        if x.requires_grad:
            x.grad = None

    return run


def layer_cases(device: torch.device, tokens: int, rank: int, with_fused: bool
                ) -> list[tuple[str, str, str, Callable[[], None]]]:
    """``(layer, shape, path, fwd+bwd call)`` of every TT layer path (module doc)."""
    from comera_engine import TTEmbedding, TTLinear
    from comera_engine.tensor.planner import tt_linear, ttm_linear

    cases = []
    for shape, (ins, outs) in PAPER.items():
        n, m = (int(v) for v in shape.split("x"))
        x = torch.randn(tokens, n, device=device, requires_grad=True)
        dy = torch.randn(tokens, m, device=device)
        tt = TTLinear(n, m, rank=rank, in_factors=ins, out_factors=outs).to(device)
        params = list(tt.parameters())
        for path in ("dense", "halves", "sweep", *(("fused",) if with_fused else ())):
            def fwd(x: torch.Tensor, p: str = path, tt: TTLinear = tt) -> torch.Tensor:
                cores, gate, alive = tt.tt.flat_parts()  # as the layer passes them
                return tt_linear(x, cores, tt.tt.d, p, tt.bias, gate, tt.tt.tau, alive)

            cases.append(("tt_linear", shape, path, _fwd_bwd(fwd, x, dy, params)))
        ttm = TTLinear(n, m, rank=rank, in_factors=ins, out_factors=outs,
                       layout="ttm").to(device)
        for path in ("dense", "sweep"):
            def fwd_m(x: torch.Tensor, p: str = path, lay: TTLinear = ttm) -> torch.Tensor:
                cores, gates, alive = lay.tt.parts()
                return ttm_linear(x, cores, p, lay.bias, gates, alive, lay.tt.tau,
                                  lay.out_features)

            cases.append(("ttm_linear", shape, path,
                          _fwd_bwd(fwd_m, x, dy, list(ttm.parameters()))))
        lin = torch.nn.Linear(n, m).to(device)
        cases.append(("nn.Linear", shape, "-", _fwd_bwd(lin, x, dy, list(lin.parameters()))))

    vocab, dim = 30522, 768
    emb = TTEmbedding(vocab, dim, rank=rank).to(device)
    ids = torch.randint(0, vocab, (tokens,), device=device)
    dy = torch.randn(tokens, dim, device=device)
    for path in ("dense", "gather", *(("fused",) if with_fused else ())):
        emb.path = path
        cases.append(("ttm_lookup", f"{vocab}x{dim}", path,
                      _fwd_bwd(lambda i, e=emb, p=path: _lookup(e, i, p), ids, dy,
                               list(emb.parameters()))))
    emb.path = None
    h = torch.randn(tokens, dim, device=device, requires_grad=True)
    ds = torch.randn(tokens, vocab, device=device)
    for path in ("table", "tt"):
        cases.append(("ttm_decode", f"{dim}x{vocab}", path,
                      _fwd_bwd(lambda v, e=emb, p=path: e.decode(v, p), h, ds,
                               list(emb.parameters()))))
    plain = torch.nn.Embedding(vocab, dim).to(device)
    cases.append(("nn.Embedding", f"{vocab}x{dim}", "-",
                  _fwd_bwd(plain, ids, dy, list(plain.parameters()))))
    return cases


def _lookup(emb, ids: torch.Tensor, path: str) -> torch.Tensor:  # noqa: ANN001
    emb.path = path
    return emb(ids)


# ---------------------------------------------------------------------- one whole step
def step_cases(device: torch.device, batch: int, preset: str, amp: torch.dtype | None,
               grouped: bool = True) -> list[tuple[str, str, str, Callable[[], None]]]:
    """A training step of the transformer, CoMERA and dense, as the step benchmark builds
    it; CoMERA's also by phase (forward+objective+backward, clip, optimizer, refresh)."""
    from bench_train_step import build_transformer, nli_batch

    from comera_engine.layers import tt_layers
    from comera_engine.models import TaskModel
    from comera_engine.rank import CoMERA
    from comera_engine.tensor.size import refresh_entries
    from comera_engine.train.step import TrainStep, clip_grad_norm_

    cuda = device.type == "cuda"
    data = nli_batch(batch, device)
    cases = []
    for variant in ("comera", "dense"):
        torch.manual_seed(0)
        model = build_transformer(preset, dense=variant == "dense")
        task = TaskModel(model, "nli").to(device)
        state = CoMERA(model)
        opt = _optimizer(state, cuda)
        params = [p for p in model.parameters() if p.requires_grad]
        # grouped: the TT linears' halves merged per shape, as a GPU step runs (the
        # default on CUDA; forced here for the CPU proxy too)
        step = TrainStep(task, opt, state.objective_fn(), params, grad_clip=1.0,
                         autocast_dtype=amp, refresh=state.refresh_fn(), grouped=grouped)
        shape = f"{preset} b{batch}"
        cases.append((f"step {variant}", shape, "whole", lambda s=step: s(data)))
        if variant != "comera":
            continue

        def fwd_bwd(step=step, opt=opt) -> None:  # noqa: ANN001
            opt.zero_grad(set_to_none=True)
            step.forward(data)[2].backward()  # the step's forward and objective

        def clip(params=params) -> None:  # noqa: ANN001
            clip_grad_norm_(params, [p.grad for p in params if p.grad is not None], 1.0)

        fused = torch.optim.AdamW(state.param_groups(), lr=1e-3, fused=True, capturable=cuda)
        trains = [m.tt for _, m in tt_layers(model)]
        cases += [("step comera", shape, "fwd+obj+bwd", fwd_bwd),
                  ("step comera", shape, "clip", clip),
                  ("step comera", shape, "optimizer", lambda o=opt: o.step()),
                  ("step comera", shape, "optimizer fused", lambda o=fused: o.step()),
                  ("step comera", shape, "refresh", state.refresh_fn()),
                  ("step comera", shape, "refresh_entries",
                   lambda t=trains: refresh_entries(t))]
    return cases


def _optimizer(state, cuda: bool) -> torch.optim.Optimizer:  # noqa: ANN001
    """The optimizer of a graphed GPU step (the controller's, ``capturable``); on the CPU
    proxy torch's ``foreach`` AdamW, the same ops without ``capturable`` (the trainer's
    CPU optimizer runs the C++ backend or torch's CPU ``fused``, which a GPU does not)."""
    if cuda:
        return state.make_optimizer(capturable=True)
    return torch.optim.AdamW(state.param_groups(), lr=1e-3, foreach=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=256, help="rows of the layer cases")
    ap.add_argument("--rank", type=int, default=30)
    ap.add_argument("--step-batch", type=int, default=2, help="sequences of the step cases")
    ap.add_argument("--preset", default="paper", help="transformer preset of the step")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="the layers only")
    ap.add_argument("--ungrouped", action="store_true",
                    help="the step with every TT linear merging its own halves (the "
                         "default groups them per shape, as a GPU step does)")
    ap.add_argument("--amp", choices=["bf16", "off"], default="bf16",
                    help="autocast of the step and the layers: bf16 (default: what a GPU "
                         "step runs, on the CPU proxy too: its casts are kernels) or off")
    ap.add_argument("--step-only", action="store_true", help="the training step only")
    ap.add_argument("--graph-paths", action="store_true",
                    help="plan the step's TT layers as for a CUDA graph (the paths a "
                         "graphed step replays, run eagerly here so each kernel is seen)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if min(args.tokens, args.rank, args.step_batch, args.reps) < 1:
        ap.error("--tokens/--rank/--step-batch/--reps: must be positive")
    device = torch.device(args.device)
    torch.manual_seed(0)
    from comera_engine.kernels import runs_on_device
    from comera_engine.tensor.planner import graph_planning

    out = {"benchmark": "launches", "device": device.type, "machine": bl.machine(),
           "tokens": args.tokens, "rank": args.rank, "step_batch": args.step_batch,
           "preset": args.preset, "native": os.environ.get("COMERA_NATIVE"),
           "counted": ("ops: ATen ops below autograd that do work, per call (the CPU proxy); "
                       "kernels (CUDA): device kernels + memcpy/memset per call "
                       "(experiments/bench_launches.py)"),
           "command": "python experiments/bench_launches.py " + " ".join(argv or sys.argv[1:]),
           "rows": []}
    name = f"bench_launches_{device.type}"
    dtype = torch.bfloat16 if args.amp == "bf16" else None
    out["amp"] = args.amp
    out["grouped"] = not args.ungrouped
    # the step first (the most telling rows, if a time limit cuts the run short), planned
    # as a run plans it: the Triton kernels off unless the run asks; then the layers,
    # every path forced (fused where COMERA_KERNELS=1 lets the kernels run)
    out["graph_paths"] = args.graph_paths
    groups: list[tuple[Callable[[], list], bool, str | None]] = []
    if not args.quick:
        groups.append((lambda: step_cases(device, args.step_batch, args.preset, dtype,
                                          not args.ungrouped), False, "0"))
    if not args.step_only:
        groups.append((lambda: layer_cases(device, args.tokens, args.rank,
                                           runs_on_device(device.type)), True, None))
    asked = os.environ.get("COMERA_KERNELS")
    for make, amp, kernels in groups:
        os.environ["COMERA_KERNELS"] = kernels if kernels is not None else (asked or "0")
        for layer, shape, path, fn in make():
            # the layers in the step's precision (the step sets its own autocast); the
            # step planned as graphed where asked (the layers force their paths)
            with torch.autocast(device.type, dtype=dtype or torch.float32,
                                enabled=amp and dtype is not None, cache_enabled=False), \
                    graph_planning(args.graph_paths and not amp):
                got = count(fn, device, args.reps)
            out["rows"].append({"layer": layer, "shape": shape, "path": path, **got})
            print(f"{layer:>12} {shape:>12} {path:>16}  ops {got['ops']:7.0f}  syncs "
                  f"{got['syncs']:4.0f}" + (f"  kernels {got['kernels']:7.0f} "
                                            f"({got['kernel_us']:.0f} µs)"
                                            if "kernels" in got else ""), flush=True)
            bl.write_json(name, out, args.out)  # a run cut short keeps what it counted
    rows = out["rows"]
    cols = [("layer", "layer", ""), ("shape", "shape", ""), ("path", "path", ""),
            ("ops", "ops", ".0f"), ("syncs", "syncs", ".0f")]
    if device.type == "cuda":
        cols += [("kernels", "kernels", ".0f"), ("kernel_us", "kernel µs", ".0f")]
    print()
    steps = [r for r in rows if r.get("kernel_us_by_kind") and r["layer"].startswith("step")]
    if steps:  # where each step's device time goes, by kernel kind (µs per call)
        kinds = list(dict.fromkeys(k for r in steps for k in r["kernel_us_by_kind"]))
        bl.print_table([{"step": f"{r['layer']} {r['shape']}", "phase": r["path"],
                         **{k: r["kernel_us_by_kind"].get(k, 0.0) for k in kinds}}
                        for r in steps],
                       [("step", "step", ""), ("phase", "phase", ""),
                        *((k, k, ".0f") for k in kinds)])
        print()
    bl.print_and_write(rows, cols, name, out, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
