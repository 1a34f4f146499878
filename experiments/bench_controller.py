"""What the rank controller costs: a CoMERA training step against the same TT model at
fixed ranks, side by side in one process.

For each shipped config (default: digits and SNLI-tiny) the model is built at the ranks
the run starts from (``comera train``'s plan) and trained on one batch of the config's
shape, through the trainer's own step (:class:`comera_engine.train.step.TrainStep`, the
fused CPU AdamW) followed by :meth:`comera_engine.CoMERA.step`, in four variants:

* ``fixed``: gates frozen at 1 (``comera.method = "fixed"``: task loss alone, no gate
  gradients, the controller's step a no-op refresh);
* ``gates trained``: the same, but the gates train (in the optimizer's ``gates`` group,
  through the task loss alone): what CoMERA's own parameters cost before the controller
  does anything, the floor of the rows below;
* ``early``: the CoMERA objective of the early stage (size surrogate, gate gradients,
  gate refresh, plateau; ``switch = "never"`` keeps it there);
* ``late``: the late stage (λ, the effective size, the pace's checks);
* ``fixed ranks reached``: after the target is met (ranks fixed, task loss alone).

``--ablate`` adds three rows between ``gates trained`` and ``early``, each the ``gates
trained`` step with one part of the early stage's objective added to its loss (no
controller work): ``+ loss root`` (``f + c·k``, ``k`` a constant: the objective's own
node), ``+ size value`` (``f + c·Ŝ`` with ``Ŝ`` computed without a gradient) and ``+ size
term`` (``f + c·Ŝ`` through autograd, as the early stage adds it); written to
experiments/results/bench_controller_ablate_cpu.json instead.

No gate dies while timing (the threshold is 0), so every variant keeps the same ranks,
and every round starts each variant from where it was after the warm-up (its parameters,
buffers and optimizer state put back in place): trained on and on, the one batch is learnt
by heart and a step's cost drifts by more than what is timed here.
Rows are the median of alternating rounds (a new random order each round; the rounds
spread over ``--builds`` fresh builds of the variants, since where a model's tensors lie
moves its time for the whole process), then the median over ``--processes`` runs in
fresh processes (the JSON keeps each process's overhead: ``overhead_runs``), in
milliseconds per step, wall-clock (``ms``) and the process's CPU time (``cpu_ms``: on a
shared machine what other processes take does not count); ``overhead`` and
``cpu_overhead`` are against ``fixed``, paired by round: the median over rounds of the
variant's time over ``fixed``'s in the same round. The process keeps freed memory as ``comera
train`` does on CPU (:func:`comera_engine.backends.keep_freed_memory`; the JSON's
``mmap_threshold``, 0 where it is off). Prints a table and writes
experiments/results/bench_controller_cpu.json.

    python experiments/bench_controller.py [--configs digits_tt_mlp snli_transformer_tiny]
        [--rounds 15] [--reps 20] [--builds 5] [--processes 3]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import add_rounds_args, apply_rounds_args, machine, print_and_write, time_rounds  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "experiments" / "configs"


def _batch(shape, batch_size: int) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """A random batch of the dataset's shape (values do not change the time)."""
    g = torch.Generator().manual_seed(0)
    classes = shape.num_classes or 2
    if shape.seq_len is not None:
        ids = torch.randint(1, shape.vocab_size, (batch_size, shape.seq_len), generator=g)
        return {"input_ids": ids, "token_type_ids": torch.zeros_like(ids),
                "attention_mask": torch.ones_like(ids),
                "labels": torch.randint(0, classes, (batch_size,), generator=g)}
    dim = int(shape.meta["input_dim"])
    return {"x": torch.randn(batch_size, dim, generator=g),
            "labels": torch.randint(0, classes, (batch_size,), generator=g)}


#: ``--ablate``'s rows: a part of the early stage's objective added to the loss of the
#: ``gates trained`` step (module doc)
ABLATIONS = ("+ loss root", "+ size value", "+ size term")


def _ablation(name: str, trains: list, coef: float) -> Callable:  # noqa: ANN001
    """The objective ``f -> (f + coef·x, {})`` of an ``--ablate`` row: ``x`` a constant,
    ``Ŝ`` without a gradient, or ``Ŝ`` through autograd."""
    from comera_engine.tensor.size import surrogate

    c = torch.tensor(coef)
    const = torch.tensor(1.0)

    def objective(f: torch.Tensor) -> tuple[torch.Tensor, dict]:
        if name == "+ loss root":
            x = const
        elif name == "+ size value":
            with torch.no_grad():
                x = surrogate(trains)
        else:
            x = surrogate(trains)
        return torch.addcmul(f, c, x), {}

    return objective


def _variants(config: str, ablate: bool = False) -> tuple[dict[str, Callable[[], object]],
                                                          dict[str, Callable[[], None]], dict]:
    """One step function per variant, each over its own copy of the model, and for each
    the function that puts it back at its starting state (:func:`_restorer`); with
    ``ablate`` the :data:`ABLATIONS` rows too."""
    from comera_engine.config import load_config
    from comera_engine.layers import freeze_gates, tt_layers
    from comera_engine.models import TaskModel
    from comera_engine.preview import data_shape
    from comera_engine.rank import CoMERA
    from comera_engine.rank.objective import CoMERAObjective
    from comera_engine.runplan import plan_initial_ranks
    from comera_engine.train.methods import build_run_model
    from comera_engine.train.step import TrainStep

    cfg = load_config(CONFIGS / f"{config}.toml", base_dir=ROOT)
    shape = data_shape(cfg.data)
    cfg, plan = plan_initial_ranks(cfg, shape)
    torch.manual_seed(0)
    base = build_run_model(cfg, shape, plan)
    batch = _batch(shape, cfg.train.batch_size)
    task = shape.task
    fns: dict[str, Callable[[], object]] = {}
    resets: dict[str, Callable[[], None]] = {}
    info: dict = {"params": sum(p.numel() for p in base.parameters()),
                  "batch": cfg.train.batch_size}
    variants = ("fixed", "gates trained", *(ABLATIONS if ablate else ()), "early", "late",
                "fixed ranks reached")
    for variant in variants:
        model = copy.deepcopy(base)
        settings = dataclasses.replace(cfg.comera, tau=0.0)
        if variant in ("fixed", "gates trained", *ABLATIONS):
            settings = dataclasses.replace(settings, method="fixed")
        if variant == "early":  # stays in the early stage however long it is timed
            settings = dataclasses.replace(settings, switch="never")
        if variant == "fixed":
            freeze_gates(model)
        comera = CoMERA(model, config=settings, total_steps=10**6)
        if variant == "late" or variant == "fixed ranks reached":
            comera.objective.switch_to_late(z_f=1.0)  # type: ignore[union-attr]
        if variant == "fixed ranks reached":
            comera.freeze()
        opt = comera.make_optimizer()
        objective = comera.objective_fn()
        if variant in ABLATIONS:  # the early stage's coefficient, γ/S₀, as its objective has it
            early = CoMERAObjective(model, dataclasses.replace(settings, method="comera"))
            objective = _ablation(variant, [m.tt for _, m in tt_layers(model)],
                                  early.cfg.gamma / early.S0)
        step = TrainStep(TaskModel(model, task), opt, objective,
                         model.parameters(), cfg.train.grad_clip, None)

        def run(step: TrainStep = step, comera: CoMERA = comera,
                opt: torch.optim.Optimizer = opt) -> None:
            out = step(batch)
            comera.step(opt, loss=float(out["loss/task"]), truncate=False)

        fns[variant] = run
        resets[variant] = _restorer(model, opt)
    return fns, resets, info


def _restorer(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Callable[[], None]:
    """A function that puts ``model``'s parameters and buffers and ``opt``'s state back
    where they were at its first call (after the warm-up), in place: every round then
    times the same steps from the same state. Trained on and on, one batch is learnt by
    heart and the step's cost drifts (gradients towards subnormal numbers, a variant's
    own state), by more than the differences timed here."""
    snap: list[tuple[torch.Tensor, torch.Tensor]] = []

    def restore() -> None:
        tensors = [*model.parameters(), *model.buffers(),
                   *(v for st in opt.state.values() for v in st.values()
                     if isinstance(v, torch.Tensor))]
        with torch.no_grad():
            if not snap:
                snap.extend((t, t.detach().clone()) for t in tensors)
            for t, saved in snap:
                t.copy_(saved)

    return restore


def bench(config: str, rounds: int, reps: int, builds: int, ablate: bool = False
          ) -> list[dict]:
    """The rows of one config: ``rounds`` rounds in all, spread over ``builds`` fresh
    builds of the variants (new tensors at new addresses: where a model's tensors happen
    to lie moved one variant's time by a few per cent for a whole process)."""
    times: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    for b in range(builds):
        fns, resets, info = _variants(config, ablate)
        part = rounds // builds + (1 if b < rounds % builds else 0)
        part_cpu: dict[str, list[float]] = {}
        part_times = time_rounds(fns, torch.device("cpu"), part, reps, warmup=3,
                                 cpu=part_cpu, reset=resets)
        for k, v in part_times.items():
            times.setdefault(k, []).extend(v)
            cpu.setdefault(k, []).extend(part_cpu[k])
        del fns, resets
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    cpu_ms = {k: statistics.median(v) * 1e3 for k, v in cpu.items()}
    return [{"config": config, "variant": k, "ms": v, "overhead": _paired(times, k),
             "cpu_ms": cpu_ms[k], "cpu_overhead": _paired(cpu, k), **info}
            for k, v in ms.items()]


def _paired(times: dict[str, list[float]], variant: str) -> float:
    """The median over rounds of ``variant``'s time over ``fixed``'s in the same round,
    less 1: within a round the variants run one right after another, so a round's ratio
    leaves out what the machine drifts by over the seconds between rounds (the same
    step's time moved by 20 % within a process on the shared VMs)."""
    return statistics.median(t / f for t, f in zip(times[variant], times["fixed"])) - 1.0


def _in_processes(argv: list[str], processes: int) -> list[dict]:
    """The rows of ``processes`` runs of this script, one after another, each in its own
    process (``--processes 1``): per config and variant the median of the processes' ms
    and overheads, and every process's overhead (``overhead_runs``, ``cpu_overhead_runs``).
    Processes differ by more than rounds of one process do (the same step ran 15 % faster
    in one process than in the next), so one process's ratio is one sample."""
    runs: list[list[dict]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(processes):
            out = Path(tmp) / str(i)
            cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--processes", "1",
                   "--out", str(out)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                sys.stderr.write(done.stderr)
                raise SystemExit(f"bench_controller: process {i + 1} of {processes} failed")
            runs.append(json.loads((out / _name("--ablate" in argv)).read_text())["rows"])
    rows = []
    for k, row in enumerate(runs[0]):
        same = [run[k] for run in runs]
        rows.append({**row, **{key: statistics.median(r[key] for r in same)
                               for key in ("ms", "overhead", "cpu_ms", "cpu_overhead")},
                     "overhead_runs": [r["overhead"] for r in same],
                     "cpu_overhead_runs": [r["cpu_overhead"] for r in same]})
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", default=["digits_tt_mlp", "snli_transformer_tiny"])
    add_rounds_args(ap, rounds=15, reps=20, reps_help="steps per round and variant")
    ap.add_argument("--builds", type=int, default=5,
                    help="fresh builds of the variants the rounds are spread over")
    ap.add_argument("--processes", type=int, default=3,
                    help="runs in fresh processes; rows are their medians")
    ap.add_argument("--ablate", action="store_true",
                    help="also the gates-trained step plus each part of the early stage's "
                         "objective (module doc)")
    args = ap.parse_args(argv)
    for name in ("builds", "processes"):
        if getattr(args, name) < 1:
            ap.error(f"--{name}: must be a positive integer")
    args.builds = min(args.builds, args.rounds)  # a build times one round at least
    for name in args.configs:
        if not (CONFIGS / f"{name}.toml").is_file():
            ap.error(f"--configs: no experiments/configs/{name}.toml")
    apply_rounds_args(ap, args)
    from comera_engine.backends import keep_freed_memory

    heap = keep_freed_memory()  # the heap settings `comera train` runs a CPU step under
    cols = [("config", "config", ""), ("variant", "variant", ""),
            ("ms", "ms per step", ".3f"), ("overhead", "vs fixed", "+.1%"),
            ("cpu_ms", "CPU ms", ".3f"), ("cpu_overhead", "vs fixed (CPU)", "+.1%")]
    if args.processes > 1:
        inner = _strip(argv, ("--processes", "--out"))
        rows = _in_processes(inner, args.processes)
        for r in rows:
            r["range"] = (f"{100 * min(r['overhead_runs']):+.1f} to "
                          f"{100 * max(r['overhead_runs']):+.1f} %")
        cols.append(("range", "vs fixed, per process", ""))
    else:
        rows = [row for name in args.configs
                for row in bench(name, args.rounds, args.reps, args.builds, args.ablate)]
    print(f"\nrank controller cost per training step, CPU, {args.threads} thread(s)"
          + (f", median of {args.processes} processes" if args.processes > 1 else ""))
    print_and_write(rows, cols, _name(args.ablate).removesuffix(".json"),
                    {"machine": machine(), "threads": args.threads, "rounds": args.rounds,
                     "reps": args.reps, "builds": args.builds, "processes": args.processes,
                     "paired": True, "mmap_threshold": heap, "rows": rows}, args.out)
    if args.processes > 1:  # the README quotes it from the results file
        print(sentence(rows))
    return 0


NAMES = {"digits_tt_mlp": "digits", "snli_transformer_tiny": "SNLI-tiny"}


def _name(ablate: bool) -> str:
    """The results file: the ``--ablate`` rows in their own (the page and README read
    bench_controller_cpu.json)."""
    return "bench_controller_ablate_cpu.json" if ablate else "bench_controller_cpu.json"


def sentence(rows: list[dict]) -> str:
    """What a run showed, in one sentence (the README quotes it): per config the early
    and late stages' overhead over fixed ranks."""
    by = {(r["config"], r["variant"]): r["overhead"] for r in rows}
    parts = [f"{100 * by[c, 'early']:+.1f} % early and {100 * by[c, 'late']:+.1f} % late on "
             f"{NAMES.get(c, c)}" for c in dict.fromkeys(r["config"] for r in rows)
             if (c, "early") in by and (c, "late") in by]
    return ("a CoMERA step costs " + ", ".join(parts)
            + " over the same TT model at fixed ranks")


def _strip(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """``argv`` without ``options`` and their values (``--opt v`` or ``--opt=v``)."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in options:
            skip = True
            continue
        if any(a.startswith(o + "=") for o in options):
            continue
        out.append(a)
    return out


if __name__ == "__main__":
    sys.exit(main())
