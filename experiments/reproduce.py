"""Reproduce the paper's claims side by side with the peers: target compression × seeds
for each task and method, every cell an ordinary run through the launcher and the run
store (so the dashboard's Sweeps and Compare pages show them), then one JSON per task.

    python experiments/reproduce.py                      # CPU size (make reproduce)
    python experiments/reproduce.py --quick              # 1 seed, 2 targets, fewer steps
    python experiments/reproduce.py --scale paper        # the paper-size configs (GPU)
    python experiments/reproduce.py --tasks digits --methods dense comera fixed
    python experiments/reproduce_report.py               # docs/RESULTS.md + figures

Methods (same task, data, steps and evaluation; docs/METHODS.md):
  dense      the dense model (every layer nn.Linear / nn.Embedding)
  comera     CoMERA: rank gates, early + late stage, the target enforced (schedule paced)
  sched_comera  CoMERA, schedule comera: the objective alone prunes, no pace
  sched_paper   CoMERA, schedule paper: the spec's objective alone (from the target's ranks)
  fixed      fixed-rank TT of the target's size, trained from scratch without gates
  tt_svd     the trained dense model (same seed) cut to the target by TT-SVD, no training
  tt_svd_ft  the same, then fine-tuned for a fraction of the steps
  tltorch    tensorly-torch TT-factorised linear layers at the target's size (linear tasks)
  prune      the trained dense model (same seed) pruned by torch-pruning to the size CoMERA's
             model has at the target, then fine-tuned for as many steps as CoMERA trains
             after reaching it ((1 - comera.reach_at) of the steps)
  int8       the trained dense model's weights in int8 (torchao), no training
  prune_int8 the fine-tuned pruned model's weights in int8 (torchao)
  comera_int8 CoMERA's model as its int8 export stores it (a scale per core, per row), no
             training: its bytes are about the TT bytes / 4

The compressed-embedding peers (task ``criteo`` only: DLRM on Criteo-shaped clicks at
full table size; comera_engine.layers.embedding_peers, the user model
comera_engine.models.dlrm:peer_dlrm of experiments/configs/dlrm_criteo_peers.toml), each
table at 1/target of its dense bytes, trained by row-sparse Adam in the backward:
  hash       the hashing trick (id mod m)
  qr         quotient-remainder compositional embeddings (Shi et al. 2020)
  mixed_dim  mixed dimensions by popularity (Ginart et al.): the training split's most
             frequent ids at full width, the rest narrow, hashed and projected
  int8_table row-wise int8 tables (QAT through an fp32 master; hashed to fit the budget)
  dense_sparse  the dense tables with sparse-gradient Adam (the reference; no target)
Beside the runs, each (method, target) of the task is measured alone in a fresh process
for its peak training memory (model + optimizer state + activations: the RSS it adds
over the process before the model is built) and step time (``--no-probe``: not).

Results go to experiments/results/reproduce/<task>.json; the store (``--store``, default
$COMERA_HOME or ./runs) keeps every run. A task whose data is missing is skipped with
the reason.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import machine  # noqa: E402

from comera_engine.errors import ConfigError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "experiments" / "configs"
OUT = ROOT / "experiments" / "results" / "reproduce"
TARGETS = (5.0, 10.0, 30.0, 100.0)
QUICK_TARGETS = (10.0, 30.0)


@dataclass(frozen=True)
class Task:
    """One task: a config per scale, overrides for that scale, and which methods apply."""

    name: str
    title: str
    config: dict[str, str]  # scale -> config file under experiments/configs
    overrides: dict[str, tuple[str, ...]] = field(default_factory=dict)  # scale -> --set
    quick: tuple[str, ...] = ()  # --set for --quick (fewer steps)
    linear: bool = True  # has TT linear layers (tltorch applies)
    needs: str | None = None  # a file that must exist (relative to the repository)
    # at CPU size (no --quick, --targets or --methods given): fewer targets for the slow
    # tasks, and methods left out, so that `make reproduce` fits in an hour on 2 cores
    cpu_targets: tuple[float, ...] | None = None
    cpu_skip: tuple[str, ...] = ()
    # writes data the task's runs read and returns the --set overrides naming it
    prepare: Callable[[], tuple[str, ...]] | None = None
    # the compressed-embedding peers run here (from this config, per scale)
    peer_config: dict[str, str] = field(default_factory=dict)
    # methods left out at every scale, --quick too (unless --methods names them)
    never: tuple[str, ...] = ()


#: The pruning and int8 peers: at CPU size on digits, MovieLens and SNLI-tiny only (the
#: hour's budget); ``--methods`` or ``--scale paper`` runs them anywhere.
SHRINK = ("prune", "int8", "prune_int8", "comera_int8")
#: CoMERA's other schedules beside the default (docs/METHODS.md, "Schedules"): at CPU size
#: on digits and SNLI-tiny only, as the peers above.
SCHEDULES = ("sched_comera", "sched_paper")


def _heldout_overrides() -> tuple[str, ...]:
    """The held-out SNLI files written (experiments/heldout.py), as --set overrides."""
    import heldout

    return heldout.overrides()


TASKS: dict[str, Task] = {t.name: t for t in (
    Task("digits", "scikit-learn digits, TT MLP",
         {"cpu": "digits_tt_mlp.toml", "paper": "digits_tt_mlp_paper.toml"},
         quick=("train.steps=300", "train.eval_every=100")),
    Task("snli_tiny", "SNLI (dev split), transformer tiny",
         {"cpu": "snli_transformer_tiny.toml", "paper": "mnli_transformer_paper.toml"},
         overrides={"cpu": ("train.steps=400", "train.eval_every=200", "train.ckpt_every=400")},
         quick=("train.steps=150", "train.eval_every=150"),
         needs="../shared/data/snli/dev.jsonl"),
    # the claim on data no run or setting saw: SNLI-tiny at its config's 800 steps, scored
    # on examples held out of the config's training part (experiments/heldout.py), against
    # dense and fixed ranks at 10x
    Task("snli_heldout", "SNLI-tiny scored on held-out SNLI (dev examples no run or "
         "tuning saw)", {"cpu": "snli_transformer_tiny.toml"},
         quick=("train.steps=150", "train.eval_every=150"),
         needs="../shared/data/snli/dev.jsonl", cpu_targets=(10.0,),
         cpu_skip=("tt_svd", "tt_svd_ft", "tltorch", *SHRINK, *SCHEDULES),
         prepare=_heldout_overrides),
    # the small preset is 8x slower a step on a CPU: 200 steps and the targets the claims
    # name (10x, 30x) fit the budget, without tltorch (its TT-matrix layers take 5 min a
    # run here against 1 min for CoMERA: 12 more minutes);
    # its dense model (6 layers, d 256) stays at chance at lr_dense 1e-3 (33.1 %), and
    # learns at 3e-4 (44.5 % at 200 steps, 45.8 % at 400), for every method alike
    Task("snli_small", "SNLI (dev split), transformer small",
         {"cpu": "snli_transformer_tiny.toml", "paper": "mnli_transformer_paper.toml"},
         overrides={"cpu": ("model.preset=\"small\"", "train.steps=200", "train.eval_every=100",
                            "train.ckpt_every=200", "comera.lr_dense=3e-4")},
         quick=("train.steps=60", "train.eval_every=60"),
         needs="../shared/data/snli/dev.jsonl",
         cpu_targets=(10.0, 30.0), cpu_skip=("tltorch", *SHRINK, *SCHEDULES)),
    Task("movielens", "MovieLens-100k clicks (rating ≥ 4), DLRM with TT embeddings",
         {"cpu": "dlrm_movielens_tiny.toml"}, quick=("train.steps=200",),
         cpu_skip=SCHEDULES),
    Task("adult", "Adult income, DLRM with TT embeddings",
         {"cpu": "dlrm_adult_tiny.toml"}, quick=("train.steps=200",),
         cpu_skip=(*SHRINK, *SCHEDULES)),
    Task("reviews", "Women's clothing reviews (recommended), transformer tiny",
         {"cpu": "reviews_transformer_tiny.toml"},
         overrides={"cpu": ("train.steps=400", "train.eval_every=200", "train.ckpt_every=400")},
         quick=("train.steps=100", "train.eval_every=100"), cpu_targets=(10.0, 30.0),
         cpu_skip=(*SHRINK, *SCHEDULES)),
    # TT where it is meant to be used: tables of millions of rows (33.8 M in all), against
    # the compressed embeddings recommender engineers use; the dense DLRM (AdamW over
    # 2.2 GB of tables) and the methods that start from it are left out: the dense
    # reference is dense_sparse (row-sparse Adam)
    Task("criteo", "Criteo-shaped clicks at full table size (33.8 M rows), DLRM: TT "
         "against the compressed-embedding peers",
         {"cpu": "dlrm_criteo.toml"}, peer_config={"cpu": "dlrm_criteo_peers.toml"},
         quick=("data.scale=1000", "data.num_samples=4000", "data.num_eval=2000",
                "train.steps=30", "train.eval_every=30", "train.ckpt_every=30",
                "train.batch_size=128"),
         cpu_targets=(100.0, 300.0, 1000.0),
         never=("dense", "tt_svd", "tt_svd_ft", "tltorch", *SHRINK, *SCHEDULES)),
    # the shipped code-MLM configs never start the late stage (switch = "never"): a
    # target sweep needs it, so the stage switch is the default here
    Task("code_mlm", "code MLM on the standard library",
         {"cpu": "code_mlm_tiny.toml", "paper": "code_mlm_paper.toml"},
         overrides={"cpu": ('comera.switch="auto"',), "paper": ('comera.switch="auto"',)},
         quick=("train.steps=150",), cpu_skip=(*SHRINK, *SCHEDULES)),
)}


@dataclass(frozen=True)
class Method:
    """A method as ``--set`` overrides of the task's config, per target (``None``: the
    dense model, which has no target) and, for TT-SVD, the dense run it starts from."""

    name: str
    title: str
    overrides: Callable[[float | None, str | None], list[str]]
    per_target: bool = True  # False: one cell per seed (dense)
    needs_dense: bool = False  # starts from the trained dense run of the same seed
    linear_only: bool = False
    after: str | None = None  # starts from that method's run of the same seed and target
    peer: str | None = None  # an embedding peer (layers.embedding_peers): the task's
    # peer_config with model.kwargs.peer = this


def _peer_kwargs(peer: str, target: float | None, counts: str | None = None) -> list[str]:
    """``model.kwargs`` of :func:`comera_engine.models.dlrm.peer_dlrm` (an inline table:
    --set replaces it whole)."""
    items = [f'peer = "{peer}"', 'preset = "tiny"', "lr_table = 0.01"]
    if target is not None:
        items.append(f"target = {float(target)}")
    if counts:
        items.append(f"counts = {json.dumps(counts)}")
    return ["model.kwargs={" + ", ".join(items) + "}"]


def _target(t: float | None) -> list[str]:
    return [] if t is None else [f"comera.target_compression={t}"]


def _from_dense(folder: str | None) -> list[str]:
    return ['comera.method="tt_svd"', f"model.init_from={json.dumps(str(folder))}"]


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("dense", "dense", lambda t, d: ["model.dense=true"], per_target=False),
    Method("comera", "CoMERA", lambda t, d: _target(t)),
    Method("sched_comera", "CoMERA, schedule comera (no pace)",
           lambda t, d: ['comera.schedule="comera"', *_target(t)]),
    # the paper's schedule keeps the preset's ranks, which compress more than some targets
    # ask (refused): it starts from the ranks the target gives, as the others do
    Method("sched_paper", "CoMERA, schedule paper",
           lambda t, d: ['comera.schedule="paper"', "comera.ranks_from_target=true",
                         *_target(t)]),
    Method("fixed", "fixed-rank TT", lambda t, d: ['comera.method="fixed"', *_target(t)]),
    Method("tt_svd", "TT-SVD", lambda t, d: [*_from_dense(d), "train.steps=0", *_target(t)],
           needs_dense=True),
    Method("tt_svd_ft", "TT-SVD + fine-tune", lambda t, d: [*_from_dense(d), *_target(t)],
           needs_dense=True),
    Method("tltorch", "tltorch TT", lambda t, d: ['model.tt_impl="tltorch"',
                                                  'comera.method="fixed"', *_target(t)]),
    Method("prune", "pruning + fine-tune",
           lambda t, d: ["model.dense=true", 'comera.method="prune"',
                         f"model.init_from={json.dumps(str(d))}", *_target(t)],
           needs_dense=True),
    Method("int8", "int8 (dense)",
           lambda t, d: ["model.dense=true", 'model.quantize="int8"', "train.steps=0",
                         f"model.init_from={json.dumps(str(d))}"],
           per_target=False, needs_dense=True),
    Method("prune_int8", "pruning + int8",
           lambda t, d: ["model.dense=true", 'model.quantize="int8"', "train.steps=0",
                         f"model.init_from={json.dumps(str(d))}", *_target(t)],
           after="prune"),
    Method("comera_int8", "CoMERA + int8",
           lambda t, d: ['model.quantize="int8"', "train.steps=0",
                         f"model.init_from={json.dumps(str(d))}", *_target(t)],
           after="comera"),
    Method("hash", "hashing trick", lambda t, d: _peer_kwargs("hash", t, d), peer="hash"),
    Method("qr", "quotient-remainder", lambda t, d: _peer_kwargs("qr", t, d), peer="qr"),
    Method("mixed_dim", "mixed dimension", lambda t, d: _peer_kwargs("mixed", t, d),
           peer="mixed"),
    Method("int8_table", "int8 tables", lambda t, d: _peer_kwargs("int8", t, d), peer="int8"),
    Method("dense_sparse", "dense, sparse Adam",
           lambda t, d: _peer_kwargs("dense", None), per_target=False, peer="dense"),
)}
#: The embedding peers (only where a task has a ``peer_config``).
EMBEDDING_PEERS = tuple(m.name for m in METHODS.values() if m.peer)
#: The fine-tune after TT-SVD gets this fraction of the task's steps.
FINE_TUNE_FRACTION = 0.25


def check_task(task: Task, scale: str) -> str | None:
    """Why ``task`` cannot run here, or ``None``."""
    if scale not in task.config:
        return f"no {scale}-size config"
    if task.needs and not (ROOT / task.needs).exists():
        return f"{task.needs} is missing"
    return None


def feasible_targets(config: Path, base: list[str], targets: list[float]
                     ) -> tuple[list[float], dict[str, str]]:
    """The targets every TT method can reach on this task (the launcher's own check, for
    CoMERA's plan and for the fixed ranks), and why the others are refused."""
    from comera_engine.launch import resolve_config
    from comera_engine.preview import check_runnable

    ok, refused = [], {}
    for t in targets:
        try:
            for method in ("comera", "fixed"):
                cfg = resolve_config(config, [*base, f'comera.method="{method}"',
                                              f"comera.target_compression={t}"])
                check_runnable(cfg)
            ok.append(t)
        except ConfigError as e:
            refused[f"{t:g}"] = str(e)
            print(f"  {t:g}× refused: {e}", file=sys.stderr)
    return ok, refused


def fine_tune_steps(config: Path, base: list[str]) -> list[str]:
    """``train.steps`` (and a matching eval cadence) for the fine-tune after TT-SVD:
    :data:`FINE_TUNE_FRACTION` of the task's steps."""
    from comera_engine.launch import resolve_config

    train = resolve_config(config, base).train
    steps = max(1, int(train.steps * FINE_TUNE_FRACTION))
    every = min(train.eval_every, steps) if train.eval_every else 0
    return [f"train.steps={steps}", f"train.eval_every={every}",
            f"train.ckpt_every={steps}"]


def after_target_steps(config: Path, base: list[str]) -> list[str]:
    """``train.steps`` (and a matching eval cadence) for the fine-tune after pruning: as
    many steps as CoMERA trains once at its target, ``(1 - comera.reach_at)`` of them."""
    from comera_engine.launch import resolve_config

    cfg = resolve_config(config, base)
    steps = max(1, round(cfg.train.steps * (1.0 - cfg.comera.reach_at)))
    every = min(cfg.train.eval_every, steps) if cfg.train.eval_every else 0
    return [f"train.steps={steps}", f"train.eval_every={every}", f"train.ckpt_every={steps}"]


def cell_overrides(task: Task, scale: str, quick: bool) -> list[str]:
    return [*task.overrides.get(scale, ()), *(task.quick if quick else ())]


def run_task(task: Task, methods: list[str], scale: str, targets: list[float], seeds: int,
             quick: bool, store: Any, parallel: int, probe: bool = True) -> dict[str, Any]:
    """Queue every method's sweep for ``task`` (TT-SVD after its dense runs), wait for all
    of them, and return the task's results (:func:`sweep_report` per method)."""
    from comera_engine.launch.sweep import create_sweep, sweep_report, wait_sweeps

    config = CONFIGS / task.config[scale]
    base = [*(task.prepare() if task.prepare else ()), *cell_overrides(task, scale, quick)]
    targets, refused = feasible_targets(config, base, targets)
    if not targets:
        raise ConfigError("comera.target_compression", "no target of the sweep fits this "
                          "task: " + "; ".join(refused.values()))
    sweeps: dict[str, list[str]] = {}
    t0 = time.time()
    peers = [m for m in methods if METHODS[m].peer]
    methods = [m for m in methods if not METHODS[m].peer]
    not_trained: dict[str, str] = {}
    if peers:
        queued, not_trained = queue_peers(task, peers, scale, base, targets, seeds, store,
                                          parallel)
        sweeps.update(queued)
    order = [m for m in methods if not (METHODS[m].needs_dense or METHODS[m].after)]
    last = [m for m in methods if METHODS[m].after]
    later = [m for m in methods if METHODS[m].needs_dense]
    for m in last:  # the runs they start from
        first = METHODS[m].after
        if first not in order + later:
            (later if METHODS[first].needs_dense else order).append(first)
    if later and "dense" not in order:
        order.insert(0, "dense")
    for name in order:
        m = METHODS[name]
        grid = ({"comera.target_compression": list(targets)} if m.per_target
                else {"model.dense": [True]})
        sets = [*base, *m.overrides(None, None)]
        sweeps[name] = [create_sweep(config, grid, seeds, sets, store,
                                     name=f"reproduce {task.name} {name}",
                                     max_parallel=parallel)]
        print(f"{task.name}/{name}: sweep {sweeps[name][0]}", file=sys.stderr)
    if later:
        wait_sweeps(store, sweeps["dense"], 2.0, indent="  ")
        dense_dirs = {r["cell"]["seed"]: str(store.run_dir(r["id"]))
                      for r in store.sweep_runs(sweeps["dense"][0]) if r["status"] == "finished"}
        for name in later:
            m = METHODS[name]
            sweeps[name] = []
            for seed, folder in sorted(dense_dirs.items()):
                sets = [*base, *m.overrides(None, folder), f"train.seed={seed}"]
                if name == "tt_svd_ft":
                    sets += fine_tune_steps(config, base)
                if name == "prune":
                    sets += after_target_steps(config, base)
                grid = ({"comera.target_compression": list(targets)} if m.per_target
                        else {"model.dense": [True]})
                sweeps[name].append(create_sweep(
                    config, grid, 1, sets, store,
                    name=f"reproduce {task.name} {name}", max_parallel=parallel))
    for name in last:
        first = METHODS[name].after
        wait_sweeps(store, sweeps[first], 2.0, indent="  ")
        done = {(r["cell"]["seed"], float(r["config"]["comera"]["target_compression"])):
                str(store.run_dir(r["id"]))
                for s in sweeps[first] for r in store.sweep_runs(s)
                if r["status"] == "finished"}
        sweeps[name] = [create_sweep(
            config, {"comera.target_compression": [t]}, 1,
            [*base, *METHODS[name].overrides(t, folder), f"train.seed={seed}"], store,
            name=f"reproduce {task.name} {name}", max_parallel=parallel)
            for (seed, t), folder in sorted(done.items())]
    wait_sweeps(store, [s for ids in sweeps.values() for s in ids], 2.0, indent="  ")
    results: dict[str, Any] = {}
    for name, ids in sweeps.items():
        reps = [sweep_report(store, s) for s in ids]
        results[name] = merge_reports(reps, METHODS[name].per_target)
        results[name]["sweeps"] = ids
        if task.peer_config:
            add_cell_metrics(store, results[name])
    out = {"task": task.name, "title": task.title, "scale": scale, "quick": quick,
           "config": task.config[scale], "overrides": base, "targets": list(targets),
           "refused": refused,
           "seeds": seeds, "wall_s": time.time() - t0, "machine": machine(),
           "methods": results}
    if task.peer_config:
        out["peer_config"] = task.peer_config[scale]
        out["data"] = data_facts_of(store, results)
        out["not_trained"] = not_trained
        if probe:
            out["probe"] = probe_all(task, [*methods, *peers], scale, base, targets)
    return out


#: The per-run metrics the embedding task adds to each cell and group (mean ± std).
CELL_METRICS = {"log_loss": "eval/loss", "rss_mb": "mem/rss_mb"}


def add_cell_metrics(store: Any, result: dict[str, Any]) -> None:
    """Each cell's :data:`CELL_METRICS` from its run's last values, and each group's mean
    and std over its finished cells (in place)."""
    from comera_engine.launch.sweep import _mean_std

    for c in result["cells"]:
        latest = {k: v for k, (_, v) in store.latest_metrics(c["run"]).items()}
        for key, metric in CELL_METRICS.items():
            c[key] = latest.get(metric)
    for g in result["groups"]:
        done = [c for c in result["cells"] if c["status"] == "finished"
                and (c["target"] == g["target"] or not result["groups"][1:])]
        for key in CELL_METRICS:
            g[key], g[f"{key}_std"] = _mean_std([c.get(key) for c in done])


def data_facts_of(store: Any, results: dict[str, Any]) -> dict[str, Any]:
    """The data set's identity facts (Bayes AUC and log-loss, sizes) from a finished run."""
    for res in results.values():
        for c in res["cells"]:
            path = Path(store.run_dir(c["run"])) / "dataset.json"
            if c["status"] == "finished" and path.exists():
                ident = json.loads(path.read_text())
                return {k: ident.get(k) for k in ("params", "extra", "num_examples")}
    return {}


def peer_counts(config: Path, base: list[str], store: Any) -> str:
    """The training split's ids by falling frequency per field (the mixed-dimension
    tables' hot ids), written once per data setting beside the store; its path."""
    import hashlib

    import numpy as np

    from comera_engine.data.criteo_synth import training_hot_ids
    from comera_engine.launch import resolve_config

    data = dict(resolve_config(config, base).data)
    key = hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()
    path = Path(store.root) / f"criteo_hot_ids-{key[:16]}.npz"
    if not path.exists():
        np.savez(path, **training_hot_ids(data))
    return str(path)


#: Training steps a memory/step-time probe takes (the median of the last half is its step).
PROBE_STEPS = 20


def probe_all(task: Task, methods: list[str], scale: str, base: list[str],
              targets: list[float]) -> dict[str, Any]:
    """Every (method, target) of the embedding task measured alone, one fresh process
    each (:func:`probe_cell`), one after the other: ``{method: {target: row}}`` (target
    ``"none"`` for the dense reference). A cell whose tables and Adam state would not fit
    in half the memory available is not started: its row says what it would need."""
    import subprocess

    import psutil

    out: dict[str, Any] = {}
    for name in methods:
        m = METHODS[name]
        config = CONFIGS / (task.peer_config[scale] if m.peer else task.config[scale])
        out[name] = {}
        for t in (targets if m.per_target else [None]):
            sets = [*base, *m.overrides(t, None)] if m.peer else [*base, *m.overrides(t, None),
                                                                   *_target(t)]
            need = predicted_train_bytes(config, sets)
            free = psutil.virtual_memory().available
            key = "none" if t is None else f"{t:g}"
            if need > free / 2:
                out[name][key] = {"skipped": f"needs about {need / 2**30:.1f} GiB (tables, "
                                  f"Adam state); {free / 2**30:.1f} GiB available",
                                  "predicted_bytes": need}
                continue
            cmd = [sys.executable, str(Path(__file__)), "--probe-cell", json.dumps(
                {"config": str(config), "sets": sets})]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            row = (json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0
                   else {"error": done.stderr.strip().splitlines()[-1:]})
            out[name][key] = {**row, "predicted_bytes": need}
            print(f"  probe {name} {key}: {row}", file=sys.stderr)
    return out


def predicted_train_bytes(config: Path, sets: list[str]) -> int:
    """Tables and their Adam moments of a cell, 3 × 4 bytes a float of the model's
    stored parameters (an upper bound for the compressed ones, whose int8 masters and
    TT cores are a few MB): what decides whether a probe can start."""
    from comera_engine.data.criteo_synth import criteo_cardinalities
    from comera_engine.launch import resolve_config

    cfg = resolve_config(config, sets)
    rows = sum(criteo_cardinalities(float(cfg.data.get("scale", 1.0))))
    kwargs = cfg.model.kwargs or {}
    target = float(kwargs.get("target") or cfg.comera.target_compression or 1.0) \
        if cfg.model.name == "custom" else float(cfg.comera.target_compression or 1.0)
    return int(3 * rows * 16 * 4 / target)


def probe_cell(spec: dict[str, Any]) -> dict[str, Any]:
    """One cell's peak training memory and step time, alone in this process, one thread:
    the model built as its run builds it, :data:`PROBE_STEPS` AdamW steps (the row tables
    update themselves in the backward) on batches drawn from the task's world at the
    run's batch size. ``peak_train_mb``: the peak RSS (:class:`PeakRSS`) over the RSS
    before the model was built (model + optimizer state + activations + the allocator's
    slack); ``step_s``:
    the median of the last half of the steps; ``table_bytes``: the model's parameters as
    stored."""
    import gc
    import statistics

    import numpy as np
    import psutil
    import torch

    from comera_engine.data.criteo_synth import CriteoWorld, criteo_cardinalities, shape
    from comera_engine.launch import resolve_config
    from comera_engine.layers import stored_nbytes
    from comera_engine.runplan import plan_initial_ranks
    from comera_engine.train.methods import build_run_model

    torch.set_num_threads(1)
    cfg = resolve_config(spec["config"], spec["sets"])
    data_cfg = dict(cfg.data)
    scale = float(data_cfg.get("scale", 1.0))
    world = CriteoWorld.create(criteo_cardinalities(scale), int(data_cfg.get("seed", 0)))
    facts = shape(data_cfg)
    data = argparse.Namespace(task="ctr", num_classes=2, vocab_size=None, seq_len=None,
                              meta=facts["meta"], name="clicks_criteo")
    batch = cfg.train.batch_size
    batches = [world.draw(batch, seed=step, stream=7) for step in range(PROBE_STEPS)]

    def train(model: torch.nn.Module, steps: list[dict[str, np.ndarray]]) -> list[float]:
        model.train()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        times = []
        for rows in steps:
            dense = torch.from_numpy(np.log1p(rows["dense_raw"]).astype(np.float32))
            labels = torch.rand(batch).lt(0.25).float()
            t0 = time.perf_counter()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(
                model(dense, torch.from_numpy(rows["sparse"])), labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
        return times

    # warm-up on the same model with every table 2 rows: the libraries and thread pools a
    # first training step loads (about 150 MB) are not the model's
    tiny = argparse.Namespace(**{**vars(data), "meta": {**data.meta, "bucket_sizes": [2] * 26,
                                                          "cardinalities": [2] * 26}})
    train(build_run_model(cfg, tiny), [{k: v % 2 if k == "sparse" else v for k, v in b.items()}
                                       for b in batches[:2]])
    gc.collect()
    cfg, plan = plan_initial_ranks(cfg, data)  # the target's ranks, as the trainer's
    rss0 = psutil.Process().memory_info().rss
    with PeakRSS() as watch:
        model = build_run_model(cfg, data, plan)
        times = train(model, batches)
    peak = watch.peak
    table_bytes = int(sum(stored_nbytes(p) for p in model.parameters()))
    return {"peak_train_mb": (peak - rss0) / 2**20, "peak_rss_mb": peak / 2**20,
            "step_s": statistics.median(times[PROBE_STEPS // 2:]),
            "table_bytes": table_bytes,
            "batch_size": batch}


class PeakRSS:
    """The process's peak RSS while in the ``with`` block, sampled every millisecond by a
    thread (``/proc``'s own peak cannot be reset everywhere, and imports peak before the
    model is built): ``peak`` in bytes after the block."""

    def __init__(self) -> None:
        import threading

        import psutil

        self._proc, self._stop = psutil.Process(), threading.Event()
        self.peak = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            self._stop.wait(0.001)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)


def queue_peers(task: Task, peers: list[str], scale: str, base: list[str],
                targets: list[float], seeds: int, store: Any, parallel: int
                ) -> tuple[dict[str, list[str]], dict[str, str]]:
    """The embedding peers' sweeps: one per target (``comera.target_compression`` is the
    target the report groups by; the table sizes follow ``model.kwargs.target``), one for
    the dense reference; and the methods not trained, with why: a method whose cells
    running side by side would need more than half the memory available (the dense
    tables: 6.5 GB a cell at full size)."""
    import psutil

    from comera_engine.launch.sweep import create_sweep

    config = CONFIGS / task.peer_config[scale]
    counts = peer_counts(config, base, store) if "mixed_dim" in peers else None
    out: dict[str, list[str]] = {}
    skipped: dict[str, str] = {}
    for name in peers:
        m = METHODS[name]
        cells = [(t, {"comera.target_compression": [t]}) for t in targets] if m.per_target \
            else [(None, {"model.dense": [True]})]
        need = max(predicted_train_bytes(config, [*base, *m.overrides(t, None)])
                   for t, _ in cells) * min(parallel, seeds)
        free = psutil.virtual_memory().available
        if need > free / 2:
            skipped[name] = (f"not trained: {min(parallel, seeds)} cells side by side need "
                             f"about {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB available")
            print(f"{task.name}/{name}: {skipped[name]}", file=sys.stderr)
            continue
        out[name] = [create_sweep(config, grid, seeds, [*base, *m.overrides(t, counts)], store,
                                  name=f"reproduce {task.name} {name}", max_parallel=parallel)
                     for t, grid in cells]
        print(f"{task.name}/{name}: sweeps {', '.join(out[name])}", file=sys.stderr)
    return out, skipped


def merge_reports(reports: list[dict[str, Any]], per_target: bool = True) -> dict[str, Any]:
    """One method's results from its sweeps (TT-SVD has one sweep per seed): the cells of
    all, regrouped per target (``per_target=False``: one group, target ``None``: dense)."""
    from comera_engine.launch.sweep import _mean_std

    cells = [c for r in reports for c in r["cells"]]
    metric = next((r["metric"] for r in reports if r["metric"]), None)
    higher = next((r["higher_is_better"] for r in reports if r["metric"]), True)
    groups: dict[Any, list[dict[str, Any]]] = {}
    for c in cells:
        groups.setdefault(c["target"] if per_target else None, []).append(c)
    rows = []
    for target, cs in sorted(groups.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)):
        done = [c for c in cs if c["status"] == "finished"]
        row: dict[str, Any] = {"target": target, "cells": len(cs), "finished": len(done),
                               "statuses": sorted({c["status"] for c in cs})}
        for key in ("score", "compression", "step_time_s", "peak_mem_mb", "params", "bytes"):
            mean, std = _mean_std([c[key] for c in done])
            row[key], row[f"{key}_std"] = mean, std
        rows.append(row)
    return {"metric": metric, "higher_is_better": higher, "groups": rows, "cells": cells,
            "step_time": "median"}  # each cell's: its run's median step (sweep_report)


def add_methods(old: dict[str, Any], new: dict[str, Any], methods: list[str]
                ) -> dict[str, Any]:
    """A task's results ``old`` with ``methods`` taken from a later run of them
    (``new``), their machine and time kept under ``added`` (the page names where they
    ran when that is another machine)."""
    asked = sorted(m for m in methods if m in new["methods"])
    out = {**old, "methods": {**old["methods"], **{m: new["methods"][m] for m in asked}}}
    out["wall_s"] = old.get("wall_s", 0.0) + new["wall_s"]
    out["added"] = [*old.get("added", []), {"methods": asked, "machine": new["machine"],
                                             "wall_s": new["wall_s"]}]
    return out


def rereport(folder: Path, store_path: str | None, tasks: list[str] | None = None) -> int:
    """Rewrite every result JSON under ``folder`` (those of ``tasks``) from its sweeps in
    the store (e.g. after ``comera resume`` of failed cells)."""
    from comera_engine.launch import open_store
    from comera_engine.launch.sweep import sweep_report

    store = open_store(store_path)
    for path in sorted(folder.glob("*.json")):
        result = json.loads(path.read_text())
        if tasks and result.get("task") not in tasks:
            continue
        for name, old in result["methods"].items():
            reps = [sweep_report(store, s) for s in old["sweeps"]]
            result["methods"][name] = merge_reports(reps, METHODS[name].per_target)
            result["methods"][name]["sweeps"] = old["sweeps"]
            if result.get("peer_config"):
                add_cell_metrics(store, result["methods"][name])
        if result.get("peer_config"):
            result["data"] = data_facts_of(store, result["methods"]) or result.get("data")
        path.write_text(json.dumps(result, indent=1, default=str), encoding="utf-8")
        print(f"rewrote {path}", file=sys.stderr)
    return 0


def _default_parallel() -> int:
    """One cell per GPU; on a CPU one per core (each cell then trains on one thread: the
    CPU-size models gain little from more, and two cells use both cores fully)."""
    import os

    import torch

    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return max(1, os.cpu_count() or 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", choices=("cpu", "paper"), default="cpu")
    ap.add_argument("--quick", action="store_true", help="1 seed, targets 10 and 30, fewer "
                    "steps (a smoke test of the whole pipeline)")
    ap.add_argument("--tasks", nargs="+", choices=sorted(TASKS), default=None)
    ap.add_argument("--methods", nargs="+", choices=sorted(METHODS), default=None)
    ap.add_argument("--targets", nargs="+", type=float, default=None)
    ap.add_argument("--seeds", type=int, default=None)
    ap.add_argument("--max-parallel", type=int, default=None,
                    help="cells at once in all (default: one per GPU, else one per core)")
    ap.add_argument("--store", default=None, help="run store (default: $COMERA_HOME or ./runs)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--no-probe", action="store_true", help="the embedding task: skip the "
                    "per-cell memory / step-time probes")
    ap.add_argument("--probes-only", action="store_true", help="the embedding task: run "
                    "only its memory / step-time probes (into probes/<task>.json under --out, "
                    "replacing the methods probed; a later run without probes takes it up)")
    ap.add_argument("--probe-cell", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rereport", action="store_true",
                    help="train nothing: read the sweeps recorded in the JSON files under "
                    "--out back from the store and rewrite them (e.g. after a change to "
                    "how cells are scored)")
    args = ap.parse_args(argv)
    if args.probe_cell:  # one probe, in its own process (probe_all)
        print(json.dumps(probe_cell(json.loads(args.probe_cell))))
        return 0
    if args.rereport:
        return rereport(args.out, args.store, args.tasks)

    from comera_engine.launch import open_store, set_max_concurrent

    targets = args.targets or list(QUICK_TARGETS if args.quick else TARGETS)
    seeds = args.seeds or (1 if args.quick else 3)
    if seeds < 1 or any(t <= 1 for t in targets):
        ap.error("--seeds must be >= 1 and every --targets value above 1")
    parallel = args.max_parallel or _default_parallel()
    store = open_store(args.store)
    before = store.get_setting("max_concurrent")
    set_max_concurrent(store, parallel)  # all the sweeps together; restored at the end
    try:
        return _run_all(args, store, targets, seeds, parallel)
    finally:
        set_max_concurrent(store, before)


def task_grid(task: Task, args: argparse.Namespace, targets: list[float]
              ) -> tuple[list[str], list[float]]:
    """The methods and targets ``task`` runs: the command line's, else every method and
    every target but, at CPU size (not ``--quick``), the task's ``cpu_skip`` methods and
    only its ``cpu_targets`` when it has them; ``--quick`` leaves out CoMERA's other
    schedules (the ``comera`` method with one more setting)."""
    cpu = args.scale == "cpu" and not args.quick
    methods = args.methods or [m for m in METHODS if not (cpu and m in task.cpu_skip)
                               and not (args.quick and m in SCHEDULES) and m not in task.never]
    if not args.targets and cpu and task.cpu_targets:
        targets = list(task.cpu_targets)
    return [m for m in methods if (task.linear or not METHODS[m].linear_only)
            and (task.peer_config or not METHODS[m].peer)], targets


def _run_all(args: argparse.Namespace, store: Any, targets: list[float], seeds: int,
             parallel: int) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.tasks or list(TASKS):
        task = TASKS[name]
        why = check_task(task, args.scale)
        if why:
            print(f"skip {name}: {why}", file=sys.stderr)
            continue
        use, task_targets = task_grid(task, args, targets)
        suffix = "_quick" if args.quick else ("" if args.scale == "cpu" else f"_{args.scale}")
        probes = args.out / "probes" / f"{name}{suffix}.json"
        if args.probes_only:
            if task.peer_config:
                base = cell_overrides(task, args.scale, args.quick)
                probes.parent.mkdir(parents=True, exist_ok=True)
                old = json.loads(probes.read_text())["probe"] if probes.exists() else {}
                new = probe_all(task, use, args.scale, base, task_targets)
                probes.write_text(json.dumps({"machine": machine(), "probe": {**old, **new}},
                                             indent=1), encoding="utf-8")
                print(f"{name}: probes -> {probes}", file=sys.stderr)
            continue
        print(f"{name}: {', '.join(use)} × {len(task_targets)} targets × {seeds} seeds",
              file=sys.stderr)
        try:
            result = run_task(task, use, args.scale, task_targets, seeds, args.quick, store,
                              parallel, probe=not args.no_probe)
        except ConfigError as e:
            print(f"skip {name}: {e}", file=sys.stderr)
            continue
        path = args.out / f"{name}{suffix}.json"
        if args.methods and path.exists():  # a subset of the methods: added to the others
            result = add_methods(json.loads(path.read_text()), result, args.methods)
        if task.peer_config and "probe" not in result and probes.exists():  # --probes-only's
            result["probe"] = json.loads(probes.read_text())["probe"]
        path.write_text(json.dumps(result, indent=1, default=str), encoding="utf-8")
        print(f"{name}: {result['wall_s'] / 60:.1f} min -> {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
