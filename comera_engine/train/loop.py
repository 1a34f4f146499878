"""The training recipe: ``train(cfg, run_dir, sink)``.

Read top to bottom, one run is:

1. join the process group when under torchrun; pick the device and precision;
2. build the dataset, the model (TT or its dense baseline) and the task head;
3. on ``resume``: rebuild the TT layers at the checkpoint's ranks and load it;
4. AdamW with separate groups for TT cores, rank gates and dense parameters;
5. loop over steps: deterministic batch -> one step (eager or CUDA graph) -> metrics;
   rank-change events; the switch from the early to the late CoMERA stage (at a step or
   on a loss plateau) and the pace (all :class:`comera_engine.rank.CoMERA`); after every
   prune the TT cores and the optimizer state are physically truncated before the next
   step; evaluation every ``eval_every`` steps; checkpoints every ``ckpt_every`` steps and
   at stage changes; stop on NaN/inf (status ``diverged``) or on SIGTERM / a stop
   flag (checkpoint, status ``stopped``);
6. a final evaluation and checkpoint (status ``finished``).

Phases (``sink.set_phase``, only when they change: nothing per training step):
``preparing data`` (when ``train`` builds the dataset itself; ``training tokenizer``
while a WordPiece tokenizer is trained), ``building`` (model, optimizer, resume, and the
first steps until a CUDA graph is captured or given up), ``training``, ``evaluating``
(progress over the eval batches), ``checkpointing``, and ``done`` before the final
status.

Before step 1 the run is planned from shapes alone (:func:`comera_engine.runplan.plan_run`,
or the plan ``comera train`` made and hands over): the target refused when unreachable,
initial ranks chosen from it when ``model.rank`` is not fixed.

Metrics per step (through the one :class:`~comera_engine.metrics.MetricsSink`):
``loss/task``, ``loss/total``, ``acc/train``, ``grad_norm``, ``comera/*`` (objective
terms), ``stage`` (0 early, 1 late; absent for plain training), ``lr/<group>`` (the
step's rate: ``train.lr_schedule``),
``params/*``, ``bytes/*``, ``compression/*``, ``perf/step_time_s`` (the step itself:
its batch to the device, the step, the controller), ``perf/step_wall_s`` (the step on
the trainer's clock: also the wait for its batch and the logging; evaluations and
checkpoints left out), ``perf/samples_per_s`` and ``perf/tokens_per_s`` (text) over the last 50
steps, ``perf/train_s`` (training seconds so far), ``perf/eta_s`` (the mean step of
the last 50, plus the evaluations' and checkpoints' time a step so far, times the steps
left; :class:`~comera_engine.train.clock.StepClock`),
``mem/*`` (CUDA peak allocated /
reserved and NVML device used / total on GPU, RSS on CPU), ``sys/*`` (the process's
CPU %, system RAM used / total, process RSS, GPU utilisation from NVML; read at most
once a second: :class:`~comera_engine.train.sysinfo.SystemMeter`), ``epoch``; every
``eval_every`` steps also ``eval/loss``, ``eval/acc`` (and ``eval/auc`` for clicks,
``eval/ppl`` for MLM) and, with a target, ``compression/target``, ``compression/error``
(``reached/target - 1``, signed) and ``compression/target_met``, and for CoMERA
``ranks/removed_by_objective`` / ``ranks/removed_by_pace`` (rank entries each has
removed so far: who pruned); at the end an event
``target`` says "target 10x · reached 10.2x (+2 %)" or "... missed by X % (why)" (also
``TrainResult.target``). Effective ranks per TT layer go to ``log_ranks`` at the first
step, whenever they change and at each evaluation (they are piecewise constant).
"""

from __future__ import annotations

import gc
import math
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from comera_engine.backends import keep_freed_memory
from comera_engine.config import Config
from comera_engine.errors import ConfigError
from comera_engine.layers import factorized_layers
from comera_engine.metrics import (
    TARGET_TOLERANCE,
    MetricsSink,
    NullSink,
    run_compression,
    target_error,
    target_status,
)
from comera_engine.models import TaskModel, run_task
from comera_engine.rank import CoMERA, Event
from comera_engine.runplan import RunPlan, data_config, plan_run
from comera_engine.tensor.planner import choices_made, describe_choices
from comera_engine.train import checkpoint as ckpt
from comera_engine.train import methods
from comera_engine.train.batches import (
    BatchPlan,
    eval_batch_count,
    eval_batches,
    iterate_batches,
    mix_seed,
)
from comera_engine.train.clock import StepClock
from comera_engine.train.distributed import (
    DistInfo,
    all_reduce_values,
    barrier,
    init_distributed,
    resolve_device,
    shutdown,
)
from comera_engine.train.lr_schedule import lr_factor, rates_text, set_rates, tensor_rates
from comera_engine.train.progress import ProgressBar
from comera_engine.train.step import GraphedStep, TrainStep, settled
from comera_engine.train.sysinfo import MemoryMeter, SystemMeter


@dataclass
class TrainResult:
    """What a finished ``train`` call reports."""

    status: str  # finished | stopped | diverged
    step: int
    metrics: dict[str, float] = field(default_factory=dict)  # last step's metrics (+ eval)
    checkpoint: str | None = None
    graph_reason: str | None = None  # why the CUDA graph path was off (None: it was on)
    target: str | None = None  # "target 10x · reached 10.2x (+2 %)" or "... missed by X %"


def train(
    cfg: Config,
    run_dir: str | os.PathLike[str],
    sink: MetricsSink | None = None,
    *,
    resume: bool = False,
    stop_flag: threading.Event | None = None,
    bundle: Any = None,
    progress: bool = True,
    plan: RunPlan | None = None,
) -> TrainResult:
    """Train the run described by ``cfg`` in ``run_dir`` (checkpoints under ``checkpoints/``).

    Args:
        cfg: a validated config (see :mod:`comera_engine.config`).
        run_dir: the run folder; must exist.
        sink: where metrics go (only rank 0 writes; ``None``: nowhere).
        resume: continue from the newest checkpoint in ``run_dir`` (fresh start if none).
        stop_flag: set it (or send SIGTERM) to stop after the current step with a
            checkpoint and status ``stopped``.
        bundle: an already built ``DataBundle`` (else built from ``cfg.data``).
        progress: draw a progress bar on stderr (rank 0).
        plan: the run's plan (:func:`comera_engine.runplan.plan_run` of ``cfg``; its
            config, with the initial ranks, is the one trained). ``None``, or a plan made
            from shape facts the built dataset does not have: planned here from the data.
    """
    run_dir = Path(run_dir)
    stop_flag = stop_flag or threading.Event()
    device = resolve_device(cfg.train.device, int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cuda":  # streams, CUDA graphs and syncs act on the current device
        torch.cuda.set_device(device)
    else:  # a step's tensors reuse the last step's pages instead of faulting in new ones
        keep_freed_memory()
    dist = init_distributed(device)
    sink = sink if (sink is not None and dist.is_main) else NullSink()
    restore_signals = _install_signal_handlers(stop_flag)
    finished = False
    try:
        run = _Run(cfg, run_dir, sink, dist, device, stop_flag, bundle, progress and dist.is_main,
                   plan)
        try:
            result = run.fit(resume)
            finished = True
            return result
        except Exception as exc:
            sink.set_status("failed", ckpt.failure_text(exc, run_dir))
            sink.flush()
            raise
    finally:
        restore_signals()
        if dist.enabled:
            # free the DDP model (its reducer and pending Gloo work hold tensors) while the
            # interpreter is alive, so nothing of the process group is torn down during
            # interpreter finalization (a known source of SIGABRT at exit)
            run = None  # noqa: F841
            gc.collect()
        # after a failure the other processes are inside a step's collective: a barrier
        # here would wait for them forever; leave, and torchrun ends the job
        shutdown(dist, barrier=finished)


class _Run:
    """State of one training run (the pieces :func:`train` wires together)."""

    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        sink: MetricsSink,
        dist: DistInfo,
        device: torch.device,
        stop_flag: threading.Event,
        bundle: Any,
        progress: bool,
        plan: RunPlan | None = None,
    ) -> None:
        self.cfg, self.run_dir, self.sink, self.dist = cfg, run_dir, sink, dist
        self.device, self.stop_flag, self.show_progress = device, stop_flag, progress
        self.ckpt_dir = run_dir / "checkpoints"
        # a sink written before the protocol had phases has no set_phase: phases are skipped
        self._phase_fn = getattr(sink, "set_phase", None)
        self._phase_now: str | None = None
        t = cfg.train
        if t.precision == "bf16" or (t.precision == "auto" and device.type == "cuda"):
            self.autocast_dtype: torch.dtype | None = torch.bfloat16
        else:
            self.autocast_dtype = None

        if bundle is None:
            from comera_engine.data import build_dataset

            self._set_phase("preparing data")
            bundle = build_dataset(data_config(cfg), base_dir=cfg.base_dir,
                                   on_phase=self._set_phase)
        self._set_phase("building")
        self.bundle = bundle
        # the target's feasibility and the initial ranks, before any weight is made
        if plan is None or not plan.fits(bundle):
            plan = plan_run(cfg, bundle)
        cfg, self.target_plan = plan.config, plan.target
        self.cfg = cfg
        _seed_everything(t.seed)
        # the method's model: CoMERA's, fixed ranks, TT-SVD of a dense run (train/methods.py)
        self.model = methods.build_run_model(cfg, bundle, self.target_plan)
        self.task_model = TaskModel(self.model, run_task(cfg, bundle)).to(device)
        self.plan = BatchPlan(len(bundle.train), t.batch_size, t.seed, dist.rank, dist.world_size)
        self.use_graph = t.cuda_graph and device.type == "cuda"
        # the method itself: gates, stages, pace, truncation (comera_engine.rank.CoMERA)
        self.comera = CoMERA(self.model, config=cfg.comera, total_steps=t.steps,
                             steps_per_epoch=self.plan.steps_per_epoch)
        self.step = 0
        self.ddp: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.stepper: GraphedStep | TrainStep | None = None
        self.memory = MemoryMeter(device)
        self.system = SystemMeter(device)
        self.last_metrics: dict[str, float] = {}
        self.last_ckpt: str | None = None
        self._size_cache: dict[str, float] | None = None
        self._ranks_cache: dict[str, list[int]] | None = None

    # ------------------------------------------------------------------ setup

    def _set_phase(self, phase: str, progress: float | None = None) -> None:
        """Tell the sink the run's phase; a call that repeats the current phase without
        progress costs a comparison and reaches no sink."""
        if phase == self._phase_now and progress is None:
            return
        self._phase_now = phase
        if self._phase_fn is not None:
            self._phase_fn(phase, progress)

    def _build_optimizer(self) -> None:
        if self.cfg.train.optimizer == "galore":  # the dense model's GaLore peer
            self.optimizer = methods.galore_optimizer(self.model, self.cfg)
        else:
            self.optimizer = self.comera.make_optimizer(lr=self.cfg.train.lr,
                                                       capturable=self.use_graph)
        # the groups' own rates, before a checkpoint's (scheduled) ones are loaded over them
        self._base_lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
        self._lr_factor = 1.0  # train.lr_schedule's at the step running

    def _wrap(self) -> None:
        """(Re)build the DDP wrapper and the step function (after setup or a truncation)."""
        if self.dist.enabled:
            from torch.nn.parallel import DistributedDataParallel as DDP

            ids = [self.device.index] if self.device.type == "cuda" else None
            self.ddp = DDP(self.task_model, device_ids=ids)
        step = TrainStep(
            self.ddp if self.ddp is not None else self.task_model,
            self.optimizer,
            self.comera.objective_fn(),
            self.model.parameters(),
            self.cfg.train.grad_clip,
            self.autocast_dtype,
            refresh=self.comera.refresh_fn() if self.use_graph else None,
        )
        if not self.use_graph:
            self.stepper = step
        elif isinstance(self.stepper, GraphedStep):
            self.stepper.reset(step)
        else:
            self.stepper = GraphedStep(step, log=self._slow_path)
            if self.dist.enabled:
                self.stepper.disable("DistributedDataParallel runs eagerly (no whole-step graph)")
            if self.cfg.train.optimizer == "galore":
                self.stepper.disable("GaLore's optimizer step (SVDs, host-side step counts) "
                                     "cannot be captured")
        self._size_cache = None

    def _resume(self) -> bool:
        path, skipped = ckpt.resume_point(self.ckpt_dir)  # newest undamaged checkpoint
        if skipped:
            self._info(skipped)
        if path is None:
            self._info("resume: no checkpoint in the run folder; starting from step 0")
            return False
        meta, tensors = ckpt.load_checkpoint(path)
        saved = meta.get("config", {})
        if saved.get("model") != self.cfg.to_dict()["model"]:
            raise ConfigError("model", "differs from the checkpoint's model config; cannot resume")
        if meta["data"]["global_batch"] != self.plan.global_batch:
            raise ConfigError(
                "train.batch_size",
                f"the checkpoint used a global batch of {meta['data']['global_batch']}, "
                f"this run {self.plan.global_batch}; cannot resume identically",
            )
        ckpt.resize_to_shapes(self.model, meta["shapes"])
        self.model.load_state_dict(ckpt.model_state(tensors))
        self.model.to(self.device)
        self._build_optimizer()
        assert self.optimizer is not None
        self.optimizer.load_state_dict(ckpt.optimizer_state(self.optimizer, meta, tensors))
        self.comera.load_state_dict(meta["comera"])
        _set_rng_state(meta["rng"])
        self.step = int(meta["step"])
        self.comera.steps_done = self.step  # checkpoints before the controller kept no count
        self.last_ckpt = str(path.with_suffix(".safetensors"))
        self.sink.log_event("info", f"resumed from {path.name} (step {self.step})", self.step)
        return True

    # ------------------------------------------------------------------ loop

    def fit(self, resume: bool) -> TrainResult:
        t = self.cfg.train
        self.sink.set_status("running")
        resumed = self._resume() if resume else False
        if not resumed:
            self._build_optimizer()
        scheduled = t.lr_schedule != "constant" or t.warmup_steps > 0
        # the decay waits while the pace moves the ranks (a network pruned at a falling
        # rate recovers less; train/lr_schedule.py): it starts where they are fixed
        hold = self.comera.reach_step or 0  # (a constant schedule has no decay to hold)
        if scheduled and not resumed:
            self._info(rates_text(t.steps, t.lr_schedule, t.warmup_steps, hold))
        if scheduled and self.use_graph and t.optimizer != "galore":  # (GaLore: eager)
            # a captured step reads the rates from the device
            tensor_rates(self.optimizer, self.device)
        self._wrap()
        self._log_setup(resumed)

        bar = ProgressBar(t.steps, self.step) if self.show_progress else None
        status = "finished"
        error: str | None = None
        metrics: dict[str, float] = {}
        choices_made(clear=True)  # what this run's steps plan, not an earlier run's
        batches = iterate_batches(
            self.bundle.train,
            self.plan,
            self.step,
            t.steps,
            self.bundle.collate_fn,
            t.num_workers,
            pin_memory=self.device.type == "cuda",
        )
        self.clock = StepClock()
        mark = time.perf_counter()  # the clock runs from here, less evals and checkpoints
        excluded = 0.0
        for index, batch in batches:
            t0 = time.perf_counter()
            torch.manual_seed(mix_seed(t.seed, index, self.dist.rank, 0x5EED))
            batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
            if scheduled:
                self._lr_factor = lr_factor(index, t.steps, t.lr_schedule, t.warmup_steps,
                                            hold)
                set_rates(self.optimizer, self._base_lrs, self._lr_factor)
            out = self.stepper(batch)  # type: ignore[misc]
            self.step = index + 1
            raw, counts = _to_floats(out)  # one host sync
            if self._phase_now != "training" and (
                self._phase_now != "building" or settled(self.stepper)
            ):
                self._set_phase("training")  # building lasts until a graph is captured
                self._log_paths()
            raw = self._reduce(raw)

            if not all(math.isfinite(raw[k]) for k in ("loss/task", "loss/total", "grad_norm")):
                status = "diverged"
                text = (
                    f"non-finite loss or gradient at step {self.step} "
                    f"(task {raw['loss/task']}, total {raw['loss/total']}, "
                    f"grad norm {raw['grad_norm']}); last good checkpoint: {self.last_ckpt}"
                )
                self.sink.log_event("error", text, self.step)
                self._info(text)
                error = text  # the run's error column says why it stopped
                break

            stage = self.comera.stage_name  # the stage this step trained in
            # gates, stage switch, pace; the truncation is the loop's (below), which
            # rebuilds the DDP wrapper and the captured graph around the new shapes
            events = self.comera.step(self.optimizer, loss=raw["loss/task"], counts=counts,
                                      truncate=False)
            now = time.perf_counter()
            step_time = now - t0  # the step itself: batch to device, step, controller
            wall, other, mark, excluded = now - mark - excluded, excluded, now, 0.0
            metrics = self._step_metrics(raw, step_time, wall, batch, stage, other)
            switched, fixed, paced = self._log_events(events, counts)
            pruned = paced or any(e.kind == "rank_change" for e in events)
            # slice at the prune: the next step runs on the truncated cores and optimizer
            # state, so pruned ranks stop costing compute and memory at once
            shrunk = pruned and self._truncate()
            if pruned:
                metrics.update(self.comera.size_metrics())
            if fixed and not switched and not shrunk:
                self._wrap()  # the gate threshold changed: new step (re-captured graph)
            is_last = self.step == t.steps
            evaluating = (t.eval_every and self.step % t.eval_every == 0) or is_last
            if evaluating:
                t_eval = time.perf_counter()
                metrics.update(self.evaluate())
                metrics.update(self._target_metrics(metrics))
                if self.comera.enabled:  # who pruned: the objective's gates or the pace
                    metrics.update({f"ranks/removed_by_{k}": float(v)
                                    for k, v in self.comera.removed.items()})
                self._log_ranks(force=True, counts=None if paced else counts)
                excluded += time.perf_counter() - t_eval
            self.sink.log_metrics(self.step, metrics)
            self.last_metrics = metrics
            if bar is not None:
                bar.update(self.step, _bar_info(metrics, self.comera.stage_name,
                                                self.cfg.to_dict()),
                           rate=self.clock.samples_per_s, unit="samples/s",
                           eta=metrics.get("perf/eta_s"))

            stop = self._should_stop()
            if stop:
                status = "stopped"
            if switched or stop or is_last or (t.ckpt_every and self.step % t.ckpt_every == 0):
                t_save = time.perf_counter()
                self.save(_ckpt_reason(stop, is_last, bool(switched)))
                excluded += time.perf_counter() - t_save
            if stop:
                break
        if t.steps == 0:  # evaluate only (a model initialised from model.init_from)
            metrics = self._evaluate_only()
        if bar is not None:
            bar.close()
        outcome = self._target_outcome(metrics, status)
        if outcome:
            self.sink.log_event("target", outcome, self.step)
            self._say(outcome)
        self._set_phase("done")
        self.sink.set_status(status, error)
        self.sink.flush()
        graph_reason = self.stepper.reason if isinstance(self.stepper, GraphedStep) else None
        if not self.use_graph:
            graph_reason = (
                "train.cuda_graph = false" if self.device.type == "cuda" else "not on a GPU"
            )
        return TrainResult(status, self.step, metrics, self.last_ckpt, graph_reason, outcome)

    def _evaluate_only(self) -> dict[str, float]:
        """A run of ``train.steps = 0``: sizes, one evaluation and the target metrics at
        step 0, and a final checkpoint (the initialised model)."""
        metrics = {**self.comera.size_metrics(), **self.memory.read(), **self.evaluate()}
        metrics.update(self._target_metrics(metrics))
        self._log_ranks(force=True)
        self.sink.log_metrics(0, metrics)
        self.last_metrics = metrics
        self.save("final")
        return metrics

    def _target_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """``compression/target`` and ``compression/error`` (``reached/target - 1``, in
        the target's scope) and ``compression/target_met`` (1: within
        ``TARGET_TOLERANCE`` below the target or beyond it), at an evaluation."""
        target = self.comera.target_compression
        reached = metrics.get(f"compression/{self.comera.cfg.target_scope}")
        if target is None or reached is None:
            return {}
        err = target_error(target, reached)
        return {"compression/target": target, "compression/error": err,
                "compression/target_met": float(err >= -TARGET_TOLERANCE)}

    def _target_outcome(self, metrics: dict[str, float], status: str) -> str | None:
        """The run's word on its target as it ends (``None`` without one): a verdict when
        it finished its steps; stopped or diverged part way, where it stands
        (:func:`~comera_engine.metrics.target_status`: resuming goes on toward it)."""
        reached = metrics.get(f"compression/{self.comera.cfg.target_scope}")
        target = self.comera.target_compression
        if status == "finished" or target is None or reached is None:
            return self.comera.outcome(reached)
        return target_status(target, reached, status, self.step, self.cfg.train.steps)

    def _reduce(self, raw: dict[str, float]) -> dict[str, float]:
        """Average the step's scalars over processes (counts are summed)."""
        if not self.dist.enabled:
            return raw
        keys = list(raw)
        summed = all_reduce_values(self.dist, [raw[k] for k in keys], "sum")
        out = {k: v / self.dist.world_size for k, v in zip(keys, summed)}
        for key in ("correct", "count"):  # totals over processes, not means
            out[key] = summed[keys.index(key)]
        return out

    def _should_stop(self) -> bool:
        """Stop requested (flag or SIGTERM) in any process: all processes agree."""
        flag = float(self.stop_flag.is_set())
        return all_reduce_values(self.dist, [flag], "max")[0] > 0

    def _log_events(self, events: list[Event], counts: list[float] | None
                    ) -> tuple[bool, bool, bool]:
        """Log one step's controller events (rank changes, the stage switch, the pace, the
        target met) and the ranks; returns (the stage switched, the ranks were fixed, the
        pace acted)."""
        switched = fixed = paced = False
        for e in events:
            if e.kind == "rank_change":
                self.sink.log_event("rank_change", e.text, self.step)
        self._log_ranks(counts=counts)
        for e in events:
            if e.kind == "stage":
                switched = True
                self.sink.log_event("stage", e.text, self.step)
                self._say(e.text)
            elif e.kind in ("pace", "target_met"):
                paced = True
                # the store keeps the target met among the pace's events (the dashboard
                # reads "ranks fixed" there)
                self.sink.log_event("pace", e.text, self.step)
                if e.kind == "target_met":
                    fixed = True
                    self._say(e.text)
        if paced:
            self._size_cache = None
            self._log_ranks()
        return switched, fixed, paced

    def _step_metrics(
        self, raw: dict[str, float], step_time: float, wall: float,
        batch: dict[str, torch.Tensor], stage: str, other: float = 0.0,
    ) -> dict[str, float]:
        samples = self.plan.global_batch
        tokens = (batch["input_ids"].numel() * self.dist.world_size
                  if "input_ids" in batch else 0)
        self.clock.add(wall, samples, tokens, other)
        m: dict[str, float] = {
            "loss/task": raw["loss/task"],
            "loss/total": raw["loss/total"],
            "acc/train": raw["correct"] / max(raw["count"], 1.0),
            "grad_norm": raw["grad_norm"],
            "epoch": self.step / self.plan.steps_per_epoch,
            "perf/step_time_s": step_time,
            "perf/step_wall_s": wall,
            "perf/samples_per_s": self.clock.samples_per_s or 0.0,
            "perf/train_s": self.clock.train_s,
            "perf/eta_s": self.clock.eta(self.cfg.train.steps - self.step) or 0.0,
        }
        if tokens:
            m["perf/tokens_per_s"] = self.clock.tokens_per_s or 0.0
        m.update({k: v for k, v in raw.items() if k.startswith("comera/") and k != "comera/stage"})
        if self.comera.enabled:
            m["stage"] = float(stage == "late")
        assert self.optimizer is not None
        for i, group in enumerate(self.optimizer.param_groups):
            lr = group["lr"]  # a rate held on the device (graph path): its value as set
            m[f"lr/{group.get('name', i)}"] = float(
                self._base_lrs[i] * self._lr_factor if torch.is_tensor(lr) else lr)
        if self._size_cache is None:
            self._size_cache = self.comera.size_metrics()
        m.update(self._size_cache)
        m.update(self.memory.read())
        m.update(self.system.read())
        return m

    def _log_ranks(self, force: bool = False, counts: list[float] | None = None) -> None:
        ranks = self.comera.effective_ranks(counts)
        if ranks and (force or ranks != self._ranks_cache):
            self.sink.log_ranks(self.step, ranks)
            if ranks != self._ranks_cache:
                self._size_cache = None
            self._ranks_cache = ranks

    # ------------------------------------------------------------------ eval

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Metrics on the eval split (rank 0 computes them; the others wait); phase
        ``evaluating`` with its progress over the eval batches."""
        out: dict[str, float] = {}
        self._set_phase("evaluating", 0.0)
        if self.dist.is_main:
            out = evaluate(
                self.task_model,
                self.bundle.eval,
                self.cfg.train.batch_size,
                self.device,
                self.autocast_dtype,
                self.cfg.train.eval_batches,
                progress=lambda done: self._set_phase("evaluating", done),
            )
        barrier(self.dist)
        return out

    # ------------------------------------------------------------------ checkpoints

    def _truncate(self) -> bool:
        """Slice the TT cores (and optimizer state) to the effective ranks; on a change,
        log it and rebuild the step (new DDP wrapper, re-captured graph)."""
        assert self.optimizer is not None
        if not self.comera.needs_truncation():
            return False
        if self.ddp is not None:
            # DDP's reducer holds each parameter's gradient accumulator, which remembers
            # the parameter's shape: release the old wrapper before any shape changes, or
            # the next backward meets accumulators of the old (untruncated) shapes
            self.ddp = None
            if isinstance(self.stepper, GraphedStep):
                self.stepper.step = None  # type: ignore[assignment]  # _wrap sets the new one
            else:
                self.stepper = None
            gc.collect()
        truncated = self.comera.truncate(self.optimizer)
        if truncated is not None:
            self.sink.log_event("truncate", f"physically truncated: {truncated}", self.step)
        self._wrap()
        return True

    def save(self, reason: str) -> None:
        """Truncate the TT cores to their effective ranks, then checkpoint (rank 0)."""
        self._set_phase("checkpointing")
        if not self._truncate() and reason == "stage":
            self._wrap()  # the objective changed: re-capture
        if self.dist.is_main:
            self.sink.flush()  # every metric up to this step is durable before the checkpoint
            meta = {
                "format": 1,
                "reason": reason,
                "comera": self.comera.state_dict(),
                "ranks": self.comera.effective_ranks(),
                "rng": _rng_state(),
                "data": {
                    "seed": self.cfg.train.seed,
                    "global_batch": self.plan.global_batch,
                    "epoch": self.plan.epoch_of(self.step),
                    "step_in_epoch": self.step % self.plan.steps_per_epoch,
                },
                "config": self.cfg.to_dict(),
                "world_size": self.dist.world_size,
                "metrics": self.last_metrics,
            }
            path = ckpt.save_checkpoint(
                self.ckpt_dir,
                self.step,
                self.model,
                self.optimizer,
                meta,
                keep=self.cfg.train.keep_checkpoints,
            )
            self.last_ckpt = str(path)
            self.sink.log_artifact("checkpoint", str(path))
            self.sink.log_event("checkpoint", f"{path.name} ({reason})", self.step)
        barrier(self.dist)

    # ------------------------------------------------------------------ logging

    def _log_paths(self) -> None:
        """The path each TT op of the training step took (the planner's choices, with
        where their times came from; evaluation's left out): an event the Live run page
        shows, logged again only when it changed (after a truncation the ranks are new)."""
        made = [(c, ch) for c, ch in choices_made(clear=True) if c.training]
        text = describe_choices(made) if made else None
        step = getattr(self.stepper, "step", self.stepper)
        grouped = getattr(step, "grouped_layers", 0)
        if text is not None and grouped:
            text += (f" Halves of {grouped} TT linears merged per shape, one batched pass "
                     "each (tensor.grouped).")
        if text is not None and text != getattr(self, "_paths_text", None):
            self._paths_text = text
            self.sink.log_event("paths", text, self.step)

    def _slow_path(self, text: str) -> None:
        """A fallback to a slower path (the CUDA graph off): its own event kind, shown
        on the Live run page."""
        self.sink.log_event("slow_path", text, self.step)
        self._say(text)

    def _info(self, text: str) -> None:
        self.sink.log_event("info", text, self.step)
        self._say(text)

    def _say(self, text: str) -> None:
        if self.show_progress:
            try:
                print(text, file=sys.stderr, flush=True)
            except OSError:  # a terminal that went away (EIO) before its SIGHUP came:
                pass  # the text is in the run's events; the hangup stops the run cleanly

    def _log_setup(self, resumed: bool) -> None:
        plan = self.target_plan
        if plan is not None and plan.note:
            self._info(plan.note)
        size = self.comera.size_metrics()
        n_tt = len(factorized_layers(self.model))  # the engine's or a peer's TT layers
        what = "dense baseline" if n_tt == 0 else f"{n_tt} TT layers"
        if self.comera.enabled:  # which method runs (docs/METHODS.md, "Schedules")
            what += f", CoMERA schedule {self.comera.schedule}"
        elif n_tt:
            what += f", method {self.cfg.comera.method}"
        self._info(
            f"{self.cfg.model.name}/{self.cfg.model.preset} ({what}), "
            f"{int(size.get('params/effective', 0)):,} effective params, compression "
            f"{run_compression(self.cfg.to_dict(), size).text('x')}; device {self.device}, "
            f"{'bf16' if self.autocast_dtype else 'fp32'}, world {self.dist.world_size}"
            + (", resumed" if resumed else "")
        )


# ---------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(
    task_model: nn.Module,
    dataset: Any,
    batch_size: int,
    device: torch.device,
    autocast_dtype: torch.dtype | None = None,
    max_batches: int | None = None,
    progress: Callable[[float], None] | None = None,
) -> dict[str, float]:
    """``eval/loss``, ``eval/acc`` (+ ``eval/auc`` for clicks, ``eval/ppl`` for MLM);
    ``progress(fraction)`` after each batch (fraction of the batches done)."""
    was_training = task_model.training
    task_model.eval()
    loss_sum = correct = count = 0.0
    scores, targets = [], []
    total = eval_batch_count(len(dataset), batch_size, max_batches)
    for index, batch in enumerate(eval_batches(dataset, batch_size, max_batches), 1):
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        if autocast_dtype is not None:
            with torch.autocast(device.type, dtype=autocast_dtype):
                out = task_model(batch)
        else:
            out = task_model(batch)
        n = float(out["count"])
        loss_sum += float(out["loss"]) * n
        correct += float(out["correct"])
        count += n
        if out["scores"].numel():
            scores.append(out["scores"].float().cpu())
            targets.append(out["targets"].float().cpu())
        if progress is not None:
            progress(index / max(total, 1))
    task_model.train(was_training)
    metrics = {"eval/loss": loss_sum / max(count, 1.0), "eval/acc": correct / max(count, 1.0)}
    if not getattr(task_model, "has_accuracy", True):  # regression, a user task
        del metrics["eval/acc"]
    if scores:  # AUC; RMSE and R²; a user task's own (models/tasks.py)
        metrics.update(task_model.eval_metrics(torch.cat(scores), torch.cat(targets)))
    if getattr(task_model, "task", None) == "mlm":
        metrics["eval/ppl"] = math.exp(min(metrics["eval/loss"], 50.0))
    return metrics


# ---------------------------------------------------------------------- helpers


def _to_floats(out: dict[str, Any]) -> tuple[dict[str, float], list[float] | None]:
    """Step outputs (0-d tensors, floats, and the ``gate_counts`` vector if present) as
    floats, with a single device sync."""
    keys = [k for k, v in out.items() if torch.is_tensor(v) and k != "gate_counts"]
    parts = [out[k].float().reshape(1) for k in keys]
    if "gate_counts" in out:
        parts.append(out["gate_counts"].float().reshape(-1))
    values = torch.cat(parts).tolist() if parts else []
    floats = {k: float(v) for k, v in out.items() if not torch.is_tensor(v)}
    counts = values[len(keys) :] if "gate_counts" in out else None
    return {**dict(zip(keys, values[: len(keys)])), **floats}, counts


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _rng_state() -> dict[str, Any]:
    py = random.getstate()
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state().tolist(),
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), *[float(x) for x in np_state[2:]]],
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), int(pos), int(has_gauss), cached))
    if "cuda" in state and torch.cuda.is_available():
        cuda = [torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)


def _install_signal_handlers(stop_flag: threading.Event):  # noqa: ANN202
    """SIGTERM, SIGHUP (the terminal closed) and a first Ctrl-C set ``stop_flag``;
    returns a function that undoes it. On SIGHUP the closed terminal's output goes to
    /dev/null, so the checkpoint and the final records are written all the same."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {}
    terminal = ProgressBar.terminal_fds()  # noted now: after a hangup they are no tty

    def on_signal(signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and stop_flag.is_set():
            raise KeyboardInterrupt
        if signum == signal.SIGHUP:
            ProgressBar.detach_terminal(terminal)
        stop_flag.set()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        previous[sig] = signal.signal(sig, on_signal)

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore


def _ckpt_reason(stop: bool, last: bool, switched: bool) -> str:
    if stop:
        return "stop"
    if last:
        return "final"
    return "stage" if switched else "periodic"


def _bar_info(metrics: dict[str, float], stage: str, config: dict[str, Any]
              ) -> dict[str, str | float]:
    """The bar's figures: the loss, the eval accuracy (percent) and the run's one
    compression in its scope (:func:`~comera_engine.metrics.run_compression`, as every
    page shows it)."""
    info: dict[str, str | float] = {"loss": metrics["loss/task"]}
    if "eval/acc" in metrics:
        info["eval acc"] = f"{metrics['eval/acc'] * 100:.1f} %"
    comp = run_compression(config, metrics)
    if comp.value is not None:
        info["compression"] = comp.text("x")
    info["stage"] = stage
    return info
