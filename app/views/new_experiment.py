"""New experiment: start from a config (a shipped preset, a model ``comera app --models``
registered or a config beside it, or a TOML uploaded into the run store's folder), tune
the settings that matter, see the rest (or edit it as TOML), preview the tensorisation,
launch. Every value reaches the engine as typed; the engine's validation refuses."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
import streamlit as st
import tomllib

from app.lib import fmt, plots, runs, ui
from app.lib.defaults import DEFAULT_PRESET
from app.lib.devices import list_gpus
from app.lib.form import FormValues, auto_run_name, check_all, form_to_config, raw_toml
from app.lib.presets import (
    CONFIG_PREFIX,
    MODEL_LABELS,
    UPLOAD_PREFIX,
    USER_PREFIX,
    Preset,
    browser_config_problems,
    load_presets,
    preset_label,
    registered_configs,
    remove_upload,
    save_upload,
    uploaded_configs,
    user_data,
    user_presets,
)
from comera_engine.config import (
    LR_SCHEDULES,
    SCHEDULE_NAMES,
    apply_override,
    parse_value,
    to_toml,
    toml_value,
)
from comera_engine.errors import ConfigError
from comera_engine.launch import resolve_config
from comera_engine.metrics import SCOPE_LABELS
from comera_engine.preview import (
    Preview,
    data_problems,
    datasets_for,
    default_tt_layers,
    memory_problem,
    preview,
    size_defaults,
)
from comera_engine.studio import read_registry

SIZES = ("tiny", "small", "paper")
TASKS = {"classify": "classify (cross-entropy; accuracy)", "regress": "regress (MSE; RMSE, R²)"}
#: The late-stage switch (comera.switch): when the late stage starts, if ever.
LATE_STAGE_SWITCHES = {
    "auto": "Early stage, then late stage when the loss plateaus (with a target; the "
            "engine's default)",
    "step": "Early stage, then late stage from a step",
    "plateau": "Early stage, then late stage when the loss plateaus",
    "never": "Early stage only (no late stage)",
}
LAYOUTS = {
    "tt": "tt (the paper's)",
    "ttm": "ttm (TT matrix)",
}
SCHEDULES = {
    "paced": "paced (the additions and the pace: reaches the target in time)",
    "comera": "comera (the objective with the additions, no pace)",
    "paper": "paper (the method's objective alone)",
}
#: The learning rates the form shows: (field, label, shown when unset).
RATES = (
    ("train.lr", "Learning rate (train.lr)", "1e-3"),
    ("comera.lr_cores", "TT cores", "train.lr"),
    ("comera.lr_dense", "Dense layers", "train.lr"),
    ("comera.lr_gates", "Rank gates", "the schedule's"),
    ("comera.lr_embedding", "TT embeddings", "TT cores'"),
    ("comera.weight_decay", "Weight decay", "the optimizer's"),
)
PRECISIONS = {
    "auto": "auto",
    "fp32": "fp32",
    "bf16": "bf16 autocast",
}

store = ui.require_store()


@st.cache_data(ttl=30, show_spinner=False)
def _presets() -> dict[str, Preset]:
    return load_presets()


@st.cache_data(ttl=60, show_spinner=False)
def _gpus() -> list[Any]:
    return list_gpus()


@st.cache_data(max_entries=64, show_spinner=False)
def _preview(raw_json: str, device: str) -> Preview:
    return preview(json.loads(raw_json), device)


def _dataset_options(presets: dict[str, Preset], chosen: Preset) -> list[tuple[str, dict]]:
    """Data tables the chosen model can train on: its own first, then those of other
    presets for the same task. Files come from presets only; the browser never types
    a path."""
    allowed = {info.name for info in datasets_for(chosen.model)}
    out: list[tuple[str, dict]] = []
    seen: set[str] = set()
    for p in [chosen, *presets.values()]:
        data = dict(p.raw.get("data", {}))
        if data.get("name") not in allowed:
            continue
        sig = json.dumps(data, sort_keys=True)
        if sig in seen:
            continue
        seen.add(sig)
        out.append((_data_label(data), data))
    return out


def _user_data_options() -> list[tuple[str, dict]]:
    """The data files ``comera app --data`` registered: what a user model trains on."""
    reg = REGISTRY["data"]
    return [(f"{name} · your file {reg[name]['train'].rsplit('/', 1)[-1]} "
             f"({reg[name]['rows']:,} rows)", table)
            for name, table in user_data(REGISTRY).items()]


def _own_data_label(data: dict) -> str:
    """The label of a config's own ``[data]`` table: its file names, never their folders."""
    files = [Path(str(data[key])).name for key in ("train", "eval", "path") if data.get(key)]
    label = f", label {data['label']}" if data.get("label") else ""
    return (f"the config's data · {' + '.join(files) or data.get('name', '?')}{label}")


def _upload() -> None:
    """The uploader's callback: keep the file in the run store's folder and start from it
    (runs before the page, so the picker can be set)."""
    f = st.session_state.get("upload")
    st.session_state.pop("upload_error", None)
    if f is None:  # removed from the uploader: its refusal goes with it
        return
    try:
        key = save_upload(STORE_FOLDER, f.name, f.getvalue())
    except ValueError as e:
        st.session_state["upload_error"] = (f.name, str(e).splitlines())
        return
    st.session_state["preset"] = key


def _remove_upload() -> None:
    """The Remove button's callback: the uploaded config at hand leaves the run store's
    folder and Start from (runs before the page, so the picker can be reset)."""
    key = st.session_state.get("preset")
    if isinstance(key, str) and remove_upload(STORE_FOLDER, key):
        st.session_state.pop("preset", None)
        st.session_state.pop("upload_error", None)


def _picked() -> None:
    """Start from's callback: another config chosen, a refused upload is no longer the
    config at hand."""
    st.session_state.pop("upload_error", None)


def number_text(where: Any, label: str, value: Any, key: str, help: str | None = None,
                placeholder: str | None = None, disabled: bool = False) -> Any:
    """A number typed as text and handed on as typed (TOML's reading: ``64`` an integer,
    ``2.5`` and ``1e9`` numbers, anything else a string), never rounded or clamped: the
    engine's validation refuses what does not fit. Blank: ``None`` (unset)."""
    text = where.text_input(label, value="" if value is None else toml_value(value),
                            key=key, help=help, placeholder=placeholder, disabled=disabled)
    text = str(text).strip()
    return None if not text else parse_value(text)


def _index(options: list[Any] | tuple[Any, ...], value: Any) -> int:
    """The place of ``value`` among a widget's ``options``; the first where it is not one
    (an uploaded config's unknown value: the check of the upload names it)."""
    return options.index(value) if value in options else 0


def _data_label(data: dict) -> str:
    name = data.get("name", "?")
    if data.get("hub"):
        return f"{name} · Hugging Face hub"
    if data.get("path"):
        return f"{name} · {data['path']}"
    info = next((i for m in MODEL_LABELS for i in datasets_for(m) if i.name == name), None)
    if info is None:
        return f"{name} · built in"
    get = {**info.defaults, **data}.get
    if name == "code_mlm":
        return f"{name} · Python stdlib code ({get('max_files')} files)"
    if name == "clicks_synthetic":
        return f"{name} · synthetic clicks ({get('num_samples'):,} rows)"
    return f"{name} · {info.summary}"


ui.page_header(
    "New experiment",
    "Choose a model and how small it must become; the preview on the right shows what the "
    "tensor-train version looks like before anything runs.",
    ":material/add_circle:",
)

FORM_KEYS: set[str] = {"preset", "device"}
SAVED = ui.restore_form()

REGISTRY = read_registry()  # what `comera app --models/--data` registered, never the browser
STORE_FOLDER = runs.store_path().parent  # uploaded configs are kept in its configs/
presets = {**registered_configs(REGISTRY), **user_presets(REGISTRY),
           **uploaded_configs(STORE_FOLDER), **_presets()}
gpus = _gpus()
msgs: dict[str, list[tuple[str, str]]] = {}


def say(field: str, level: str, text: str) -> None:
    """A message under ``field``; a server path outside the run store is shown by its
    file name only (an engine message names the config's data file in full), a value
    ``None`` as the blank field it is."""
    text = text.replace(", got None", "; the field is empty")  # TOML has no null: blank
    msgs.setdefault(field, []).append((level, fmt.server_paths_hidden(text, STORE_FOLDER)))


left, right = st.columns([5, 7], gap="large")
slots: dict[str, Any] = {}

with left:
    keys = list(presets)
    first = next((key for key in keys if key.startswith((CONFIG_PREFIX, USER_PREFIX))),
                 DEFAULT_PRESET)
    if st.session_state.get("preset") not in keys:
        st.session_state.pop("preset", None)
    pkey = st.selectbox(
        "Start from",
        keys,
        index=keys.index(first) if first in keys else 0,  # your config or model, if any
        format_func=lambda k: preset_label(presets[k]),
        key="preset", on_change=_picked,
        help="A config to start from: yours (beside a module `comera app --models` "
             "registered, or uploaded below), a registered model with its function's "
             "defaults, or a template from experiments/configs/. Every field below starts "
             "from it; what the form does not show is kept as it is (All settings).",
    )
    with st.popover("Upload a config (TOML)", icon=":material/upload_file:"):
        st.file_uploader("A run config, as `comera train` reads it", type=["toml"],
                         key="upload", on_change=_upload,
                         help="Kept in the run store's folder (configs/) and offered under "
                              "Start from. Its files and model code must be ones this "
                              "dashboard offers.")
        refused = st.session_state.get("upload_error")
        for line in refused[1] if refused else []:
            st.error(line, icon=":material/error:")
    if pkey.startswith(UPLOAD_PREFIX):
        st.button("Remove this uploaded config", key="remove-upload",
                  icon=":material/delete:", on_click=_remove_upload,
                  help="Deletes it from the run store's folder (configs/) and from Start "
                       "from; runs launched from it keep their own copy.")
    preset = presets[pkey]
    raw: dict[str, Any] = preset.config()
    model_name = preset.model
    user = model_name == "custom"  # a user model (model.factory)
    st.caption(
        f"{MODEL_LABELS.get(model_name, model_name)} · "
        f"{preset.description or 'no description'} ({preset.source})"
    )
    slots["upload"] = st.container()  # what is wrong with an uploaded file, every problem

    def k(name: str) -> str:
        key = f"{pkey}:{name}"
        FORM_KEYS.add(key)
        return key

    options = _user_data_options() if user else _dataset_options(presets, preset)
    own = 0  # a user config's own data comes first (its files, as it names them)
    if user and not pkey.startswith(USER_PREFIX) and raw.get("data"):
        options.insert(0, (_own_data_label(raw["data"]), dict(raw["data"])))
        own = 1
    ds = st.selectbox("Dataset", range(len(options)), format_func=lambda i: options[i][0],
                      key=k("data"),
                      help="The config's own data, or a data file `comera app --data` "
                           "registered." if user else
                      "Datasets this model's task can train on.")
    data = dict(options[ds][1]) if options else dict(raw.get("data", {}))
    if data.get("hub"):  # the one kind of data a run fetches: say so before it is launched
        st.caption(f":material/cloud_download: {data.get('hub_name') or data.get('name')} is "
                   "read from the Hugging Face hub by name: the run needs the network, or "
                   "the data set already in the local Hugging Face cache (`HF_HOME`); "
                   "without either it fails while preparing data.")
    task = None
    if user and options and ds >= own:  # the label column and the task of a registered file
        reg_name = list(user_data(REGISTRY))[ds - own]  # the options' order
        reg = REGISTRY["data"][reg_name]
        columns = list(reg.get("columns") or [])
        c1, c2 = st.columns(2)
        data["label"] = c1.selectbox(
            "Label column", columns,
            index=columns.index(data["label"]) if data.get("label") in columns else 0,
            key=k(f"label:{reg_name}"),
            help="The target; the model's inputs are the file's other numeric columns.")
        task = c2.radio("Task", list(TASKS), format_func=TASKS.get, horizontal=True,
                        index=list(TASKS).index(reg.get("task", "classify")),
                        key=k(f"task:{reg_name}"))
    slots["data"] = st.container()
    if user:
        kw0 = (raw.get("model") or {}).get("kwargs") or {}
        kwargs = number_text(
            st, "Model kwargs (a TOML table)", kw0, k("kwargs"),
            help="model.kwargs: what the factory is called with besides the data's facts "
                 "(in_features, num_classes, ...), e.g. { hidden = [64, 64], dropout = 0.1 }.")
        kwargs = None if kwargs == kw0 or (kwargs is None and not kw0) else (
            {} if kwargs is None else kwargs)
        slots["kwargs"] = st.container()
    if user and not options:
        say("data", "error", "No data file is registered: start the dashboard with "
                             "`comera app --models MODULE --data NAME=PATH,label=COLUMN`.")

    m = raw.setdefault("model", {})
    size = None
    if not user:  # a user model's architecture is its factory's
        size = st.radio("Model size", SIZES, index=_index(SIZES, m.get("preset", "tiny")),
                        horizontal=True, key=k("size"),
                        help="The architecture preset: tiny runs on a CPU, paper is the "
                             "paper's size (GPU).")
    dense = st.toggle("Dense baseline", value=bool(m.get("dense", False)), key=k("dense"),
                      help="Train the same network with ordinary dense layers: the reference "
                           "point for compression and accuracy on the Compare page.")

    c = raw.setdefault("comera", {})
    has_target = c.get("target_compression") is not None
    use_target = st.toggle("Enforce a target compression", value=has_target,
                           key=k("use_target"), disabled=dense,
                           help="Off: no size target (ranks only shrink under the early "
                                "stage's size penalty).")
    c1, c2 = st.columns([1, 1])
    target = number_text(
        c1, "Target compression (×)", c.get("target_compression") or 20.0, k("target"),
        disabled=dense or not use_target,
        help="How many times smaller than dense the late stage makes the model "
             "(e.g. 2× – 500×).")
    scope = c2.radio(
        "Measured on", ("tensorized", "model"),
        index=0 if c.get("target_scope", "tensorized") == "tensorized" else 1,
        format_func=lambda s: "TT layers only" if s == "tensorized" else "whole model",
        key=k("scope"), disabled=dense or not use_target,
    )
    slots["target"] = st.container()

    rank_default, emb_default = size_defaults(model_name, size or "tiny")
    tt_kinds = m.get("tt_layers")
    if tt_kinds is None:
        tt_kinds = default_tt_layers(model_name)
    has_emb = "embedding" in tt_kinds
    auto_rank = st.toggle(  # full width: in a half column its label was cut short
        "Initial ranks from the target", value=m.get("rank") is None, key=k("auto_rank"),
        disabled=dense or not use_target,
        help="Start at about this many times the target size and let the late stage prune "
             "to it (what `comera train` does when the config leaves model.rank unset). Off: "
             "start at the ranks below (refused if they already compress more than asked).")
    auto = bool(auto_rank) and bool(use_target) and not dense
    c1, c2 = st.columns(2)
    headroom = number_text(
        c1, "Start at (× the target size)", c.get("headroom", 3.0), k("headroom"),
        disabled=not auto,
        help="comera.headroom: 3 suits the transformers and the MLP; the DLRM presets start "
             "at 1.5 (docs/SIZE_AND_TARGET.md, \"How much headroom\").")
    c1, c2 = st.columns(2)
    # chosen from the target: the fields say so (the preview gives the ranks) instead of
    # showing a rank the run does not start at; their own values come back when unticked
    planned = ":auto" if auto else ""
    from_target = "from the target (see the preview)" if auto else None
    max_rank = number_text(
        c1, "Max rank (linear layers)",
        None if auto else (m.get("rank") or rank_default) if size == m.get("preset", "tiny")
        else rank_default,
        k(f"rank:{size}{planned}"), disabled=dense or auto, placeholder=from_target,
        help="TT ranks start here (clamped per bond to what the shapes allow) and are "
             "pruned by the rank gates while training.")
    emb_rank = None
    if has_emb:
        emb_rank = number_text(
            c2, "Max rank (embeddings)",
            None if auto else (m.get("embedding_rank") or emb_default)
            if size == m.get("preset", "tiny") else emb_default,
            k(f"erank:{size}{planned}"), disabled=dense or auto, placeholder=from_target)
    layout = None
    if user or (any(kind != "embedding" for kind in tt_kinds)
                and m.get("tt_impl") != "tltorch"):
        layout0 = (m.get("tensorize") or {}).get("layout") if user else m.get("linear_layout")
        layout = st.radio(
            "TT linear layout", list(LAYOUTS), format_func=LAYOUTS.get, horizontal=True,
            index=_index(list(LAYOUTS), layout0 or "tt"), key=k("layout"),
            disabled=dense,
            help="model.linear_layout: tt, the paper's (saves MACs); ttm, a TT matrix "
                 "(computes like a dense layer, more accurate at high compression).")
    slots["rank"] = st.container()

    sw = c.get("switch", "auto")
    late_switch0 = "step" if isinstance(sw, int) else (
        sw if sw in LATE_STAGE_SWITCHES else "auto")
    late_switch = st.selectbox(
        "Late-stage switch", list(LATE_STAGE_SWITCHES),
        index=list(LATE_STAGE_SWITCHES).index(late_switch0),
        format_func=LATE_STAGE_SWITCHES.get, key=k("late_switch"), disabled=dense,
        help="Early stage: loss + γ·size (stable convergence). Late stage: "
             "drive the size to the target.")
    t = raw.setdefault("train", {})
    steps_default = t.get("steps", 1000)
    switch_step = patience = None
    if late_switch == "step":
        switch_step = number_text(
            st, "Late stage from step", sw if isinstance(sw, int) else max(
                1, steps_default // 2) if isinstance(steps_default, int) else 1,
            k("switch_step"), disabled=dense)
    elif late_switch in ("plateau", "auto"):
        patience = number_text(
            st, "Plateau patience (steps)", c.get("plateau_patience", 200), k("patience"),
            disabled=dense,
            help="Steps without a relative loss improvement before the late stage starts.",
        )
    slots["late_switch"] = st.container()
    schedule = st.selectbox(
        "Schedule", list(SCHEDULE_NAMES),
        index=list(SCHEDULE_NAMES).index(c.get("schedule", "paced"))
        if c.get("schedule", "paced") in SCHEDULE_NAMES else 0,
        format_func=lambda name: SCHEDULES.get(name, name), key=k("schedule"), disabled=dense,
        help="comera.schedule: which method runs (docs/METHODS.md, \"Schedules\").")
    slots["schedule"] = st.container()

    st.markdown("**Learning rates**")
    rates: dict[str, Any] = {}
    shown = [r for r in RATES if r[0] != "comera.lr_embedding" or has_emb
             or c.get("lr_embedding") is not None]
    for i, (field, label, unset) in enumerate(shown):
        if i % 3 == 0:
            cols = st.columns(3)
        section, name = field.split(".")
        table = t if section == "train" else c
        value0 = table.get(name, 1e-3 if field == "train.lr" else None)
        rates[field] = number_text(
            cols[i % 3], label, value0, k(field), placeholder=unset,
            help=f"{field}; blank: unset ({unset})." if field != "train.lr" else
            "train.lr: the optimizer's rate, every group's unless set below.")
    c1, c2 = st.columns(2)
    now = t.get("lr_schedule", "constant")
    lr_schedule = c1.selectbox(
        "Rate schedule", list(LR_SCHEDULES), key=k("lr_schedule"),
        index=list(LR_SCHEDULES).index(now) if now in LR_SCHEDULES else 0,
        help="train.lr_schedule: the rates over the run, constant or decaying to 0 at the "
             "last step (cosine, linear); the rank gates keep theirs.")
    rates["train.lr_schedule"] = None if lr_schedule == "constant" else lr_schedule
    rates["train.warmup_steps"] = number_text(
        c2, "Warm-up steps", t.get("warmup_steps"), k("warmup_steps"), placeholder="0",
        help="train.warmup_steps: the rates rise linearly to theirs over these first steps.")
    slots["rates"] = st.container()

    c1, c2 = st.columns(2)
    devices = ["cpu"] + [f"cuda:{g.index}" for g in gpus]
    glabels = {f"cuda:{g.index}": g.label for g in gpus}
    device = c1.selectbox("Device", devices, key="device",
                          format_func=lambda d: "CPU" if d == "cpu" else glabels[d],
                          help="CPU, or one of the GPUs NVML reports on this machine.")
    precision = c2.selectbox("Precision", list(PRECISIONS), format_func=PRECISIONS.get,
                             index=_index(list(PRECISIONS), t.get("precision", "auto")),
                             key=k("precision"),
                             help="auto: bf16 autocast on a GPU, fp32 on a CPU.")
    slots["device"] = st.container()
    c1, c2 = st.columns(2)
    steps = number_text(c1, "Steps", steps_default, k("steps"))
    batch = number_text(c2, "Batch size", t.get("batch_size", 32), k("batch"))
    cuda_graph = st.toggle("CUDA Graph", value=bool(t.get("cuda_graph", True)),
                           key=k("cuda_graph"),
                           help="Capture the whole training step once per stage and replay "
                                "it (GPU only).")
    slots["steps"] = st.container()

    # a run of its own name: the config's, what it asks, and #2, #3 once taken
    auto_name = auto_run_name(raw, size, bool(dense),
                              target if use_target and not dense else None)
    # keyed: an expander opened stays open when a switch above adds or removes fields
    with st.expander("More settings", key="exp-more"):
        run_name = st.text_input(
            "Run name", value="", key=k("name"), placeholder=auto_name,
            help="The run's name in every list. Blank: the config's name and what the run "
                 f"asks (\"{auto_name}\"), numbered #2, #3, ... when a run has it already.")
        seed = number_text(st, "Seed", t.get("seed", 0), k("seed"))
        c1, c2 = st.columns(2)
        eval_every = number_text(c1, "Evaluate every (steps)", t.get("eval_every", 100),
                                 k("eval"))
        ckpt_every = number_text(c2, "Checkpoint every (steps)", t.get("ckpt_every", 500),
                                 k("ckpt"))
    slots["advanced"] = st.container()
    all_settings = st.expander("All settings · edit as TOML", icon=":material/data_object:",
                               key="exp-toml")

ui.save_form(SAVED, FORM_KEYS)

# ---------------------------------------------------------------- assemble and validate

raw, gpu_ids = form_to_config(raw, FormValues(  # numbers as typed: the engine refuses
    data=data, size=size or "tiny", task=task, dense=bool(dense), use_target=bool(use_target),
    target=target, scope=scope, rank=max_rank, embedding_rank=emb_rank,
    auto_rank=auto, headroom=headroom if auto else None, linear_layout=layout,
    late_switch=late_switch, switch_step=switch_step, patience=patience, steps=steps,
    batch_size=batch, seed=seed, eval_every=eval_every,
    ckpt_every=ckpt_every, precision=precision, cuda_graph=bool(cuda_graph),
    device=device, run_name=run_name if str(run_name).strip() else auto_name, rates=rates,
    kwargs=kwargs if user else None,
    schedule=schedule,
))

# ---------------------------------------------------------------- the rest, or all as TOML

trusted = {} if pkey.startswith(UPLOAD_PREFIX) else preset.raw  # what the server offered
with all_settings:
    as_toml = st.toggle("Edit as TOML", key=k("as_toml"),
                        help="Edit the whole config as `comera train` reads it; while on, "
                             "this text is what launches and the fields above are not read.")
    toml_key = k("toml")
    if not as_toml:
        st.session_state.pop(toml_key, None)
        settings_box = st.container()
    else:
        if toml_key not in st.session_state:
            st.session_state[toml_key] = raw_toml(raw)
        text = st.text_area("Config (TOML)", key=toml_key, height=420)
        slots["toml"] = st.container()
        settings_box = None
        try:
            edited = tomllib.loads(str(text))
        except (tomllib.TOMLDecodeError, RecursionError) as e:
            say("toml", "error", f"config: not valid TOML ({e})")
        else:
            raw = edited
#: what a config the browser wrote names that the server does not offer (code, files):
#: then nothing of it is imported, called or read, so the engine's checks below are skipped
blocked: list[tuple[str, str]] = []
if as_toml or pkey.startswith(UPLOAD_PREFIX):  # the browser wrote it: only what is offered
    blocked = browser_config_problems(raw, trusted, REGISTRY, STORE_FOLDER, Path.cwd())
    if not as_toml:  # the file as uploaded, whatever the form changed since
        blocked += [b for b in browser_config_problems(preset.raw, {}, REGISTRY, STORE_FOLDER,
                                                       Path.cwd()) if b not in blocked]
    for field, problem in blocked:
        say("toml" if as_toml else "data", "error", f"{field}: {problem}")

FIELD_SLOTS = {
    "data": "data", "model.preset": "data", "model.name": "data",
    "comera.target_compression": "target", "comera.target_scope": "target",
    "model.rank": "rank", "model.linear_layout": "rank", "model.embedding_rank": "rank",
    "comera.switch": "late_switch", "comera.plateau_patience": "late_switch",
    "train.device": "device",
    "train.precision": "device", "train.steps": "steps", "train.batch_size": "steps",
    "train.eval_every": "advanced", "train.ckpt_every": "advanced", "name": "advanced",
    "comera.headroom": "rank", "comera.switch_by": "late_switch", "train.seed": "advanced",
    "task": "data", "model.factory": "data", "model.kwargs": "kwargs" if user else "data",
    "model.tensorize": "rank", "comera.schedule": "schedule",
    **{field: "rates" for field, _, _ in RATES},
}

if refused := st.session_state.get("upload_error"):  # the file was not loaded at all
    say("upload", "note", f"{fmt.literal(refused[0])} was not loaded: fix it and upload it "
        "again, or remove it from the uploader (or pick a config under Start from) to launch "
        "another.")
    for line in refused[1]:
        say("upload", "error", line)
said: set[str] = set()
if pkey.startswith(UPLOAD_PREFIX) and not as_toml and not blocked:  # as written, each problem
    _, as_written = check_all(preset.raw, resolve_config)
    if as_written:
        say("upload", "note", f"{preset.source} as uploaded: {len(as_written)} problem"
            f"{'s' if len(as_written) > 1 else ''}, each below. Fix the file and upload it "
            "again, or edit the config under All settings · Edit as TOML.")
    for e in as_written:
        say("upload", "error", str(e))
        said.add(str(e))
cfg, refusals = (None, []) if blocked else check_all(raw, resolve_config)  # every problem
for e in refusals:
    if str(e) not in said:  # the file's own problem, said under the upload
        field = e.field.split(".")[0] if e.field.startswith("data") else e.field
        say("toml" if as_toml else FIELD_SLOTS.get(field, "advanced"), "error", str(e))
if settings_box is not None:
    with settings_box:
        if cfg is not None:
            st.caption("What launches, every setting (the engine's defaults included):")
            st.code(to_toml(cfg), language="toml")
        else:
            st.caption("Fix the highlighted fields to see every setting.")

# the batch as validated (a refused one is named above; the data are still checked)
problems, data_notes = ([], []) if blocked else data_problems(
    dict(raw.get("data") or {}), cfg.train.batch_size if cfg is not None else 1)
for p in problems:
    say("steps" if p.startswith("train.") else "data", "error", p)
for n in data_notes:
    say("data", "note", n)

on_gpu = device != "cpu"
if precision == "bf16" and not on_gpu:
    say("device", "warning", "bf16 autocast on a CPU is slow and rarely worth it; use fp32.")
if cuda_graph and not on_gpu:
    say("steps", "note", "CUDA Graphs need a GPU; this CPU run trains eagerly.")

pv: Preview | None = None
if cfg is not None:
    try:
        with st.spinner("Building the tensorisation preview…"):
            pv = _preview(json.dumps(raw, sort_keys=True), "cuda" if on_gpu else "cpu")
    except (ConfigError, ValueError) as e:
        say("data", "error", str(e))
if pv is not None:
    for field, text in pv.errors:
        say(FIELD_SLOTS.get(field, "target"), "error", f"{field}: {text}")
    stage = pv.stage  # the engine's own decision (comera_engine.preview.late_stage)
    if stage is not None and not dense and use_target:
        if stage.moved:
            say("late_switch", "warning", stage.moved)
        elif not stage.pursued and stage.why_not and not pv.errors:
            say("late_switch", "warning", f"The target is not reached: {stage.why_not}.")
        elif stage.step is not None and late_switch != "step":
            say("late_switch", "note", f"Late stage {stage.how}.")
    requested = {"linear": cfg.model.rank or 0, "embedding": cfg.model.embedding_rank or 0}
    clamped = [layer for layer in pv.layers if max(layer.ranks) < requested[layer.kind]]
    if auto and pv.layers:
        chosen = {kind: max(max(la.ranks) for la in pv.layers if la.kind == kind)
                  for kind in sorted({la.kind for la in pv.layers})}
        say("rank", "note", "Starts at max rank " + ", ".join(
            f"{r} ({kind})" for kind, r in chosen.items()) + f": {pv.compression():.1f}× "
            f"smaller, about {cfg.comera.headroom:g}× the target size; the late stage prunes to "
            "the target.")
    elif clamped and not dense:
        ex = clamped[0]
        say("rank", "note", f"Clamped per bond to what the shapes allow in {len(clamped)} "
            f"layer(s), e.g. {ex.name}: ranks {'-'.join(map(str, ex.ranks[1:-1]))}.")
    if not on_gpu and (mem_problem := memory_problem(pv, "cpu")) is not None:
        say("advanced" if mem_problem[0].startswith("train.") else "rank", "error",
            f"{mem_problem[0]}: {mem_problem[1]}")
    if on_gpu and gpus:
        gpu = next(g for g in gpus if f"cuda:{g.index}" == device)
        need = pv.memory["tt"]["total"] / 2**20
        if need > 0.9 * gpu.memory_total_mb:
            say("device", "error", f"{fmt.memory_label('estimate')} {fmt.mib(need)} exceeds 90% of "
                f"{gpu.label}; lower the batch size or the model size.")

for name, slot in slots.items():
    with slot:
        ui.messages(msgs, name)

n_errors = sum(1 for v in msgs.values() for level, _ in v if level == "error")

# ---------------------------------------------------------------- launch


#: a sweep of more cells than this launches only once its count is ticked
CONFIRM_CELLS = 24

#: the sweep CLI's flags as this form names the fields that give them
SWEEP_FIELDS = {"--seeds": "Seeds per target", "--max-parallel": "Cells at once",
                "--grid": "Other keys"}


def sweep_words(e: ConfigError) -> str:
    """The engine's refusal of a sweep in this form's words: a field named by its label,
    not by the CLI flag that gives it; too many cells named as the product of the three
    fields that make them."""
    field = SWEEP_FIELDS.get(e.field, e.field)
    if e.field == "--grid" and "cells; a sweep has at most" in e.problem:
        field = "Targets × Other keys × Seeds per target"
    problem = e.problem
    for flag, label in SWEEP_FIELDS.items():
        problem = problem.replace(flag, label)
    return f"{field}: {problem}"


@st.cache_data(max_entries=32, show_spinner=False)
def _sweep_problem(args_json: str) -> str | None:
    """The engine's refusal of a sweep (``comera_engine.launch.sweep.check_sweep``, with
    the launch's per-cell check), or ``None``: what a click on Launch sweep would say.
    A cell differing only by its seed is checked once."""
    from comera_engine.launch.sweep import check_sweep
    from comera_engine.preview import check_runnable

    a = json.loads(args_json)
    seen: set[str] = set()

    def once(cfg: Any) -> None:
        d = cfg.to_dict()
        d.pop("name", None)
        d["train"].pop("seed", None)
        key = json.dumps(d, sort_keys=True, default=str)
        if key not in seen:
            check_runnable(cfg)
            seen.add(key)

    try:
        check_sweep(a["raw"], a["grid"], a["seeds"], max_parallel=a["parallel"],
                    gpus=a["gpus"], check=once)
    except ConfigError as e:
        return sweep_words(e)
    return None


def _grid_problem(base: dict, grid: dict[str, list[Any]]) -> str | None:
    """The first value of Other keys that names code or a file the server does not offer
    (:func:`browser_config_problems` on the config with that value set), in the form's
    words; ``None`` when none does. Checked before any cell is resolved (which would
    import the code and read the files)."""
    def problems(raw: dict) -> list[tuple[str, str]]:
        return browser_config_problems(raw, trusted, REGISTRY, STORE_FOLDER, Path.cwd())

    known = problems(base)  # the form's own, said beside their fields
    for key, values in grid.items():
        for value in values:
            cell = json.loads(json.dumps(base))
            try:  # set as a sweep's cell sets it (comera_engine.launch.sweep.cell_overrides)
                apply_override(cell, f"{key}={toml_value(value)}")
            except ConfigError:
                continue  # the engine refuses it by its own check
            found = [p for p in problems(cell) if p not in known]
            if found:
                return f"Other keys: {found[0][0]}: {found[0][1]}"
    return None


def _sweep_section() -> None:
    """Launch this form's config as a sweep: several targets × seeds, N at once. Every
    value is checked as typed, by the engine, before the click."""
    import math

    from comera_engine.launch.sweep import default_parallel, parse_grid

    with st.expander("Sweep several targets", icon=":material/grid_view:", key="exp-sweep"):
        st.caption("Runs this configuration once per grid point and seed, as ordinary runs, "
                   "a few at a time; the Sweeps page shows them together with the Pareto "
                   "front of accuracy against compression.")
        text = st.text_input("Targets (×)", value="5, 10, 30, 100", key="sw-targets",
                             help="Compressions to sweep, separated by commas (blank: the "
                                  "form's target, when other keys are swept)")
        other = st.text_area(
            "Other keys (as `comera sweep --grid`)", value="", key="sw-grid", height=80,
            placeholder="comera.lr_cores=1e-3,3e-3", help="One section.key=v1,v2,... per "
            "line: any config key, each value read as TOML and checked by the engine in "
            "every cell.")
        c1, c2 = st.columns(2)
        seeds = number_text(c1, "Seeds per target", 3, "sw-seeds")
        parallel = number_text(
            c2, "Cells at once", default_parallel("cpu" if device == "cpu" else "auto"),
            "sw-parallel", help="Default: one per GPU, else one per 4 CPU cores")
        problem = None
        lines = [x for x in str(other).splitlines() if x.strip()]
        try:
            extra = parse_grid(lines)  # the engine's reading of --grid
        except ConfigError as e:
            extra, problem = {}, sweep_words(e)
        targets: list[float] = []
        if str(text).strip() or not extra:
            try:
                targets = runs.parse_targets(text)
            except ValueError as e:
                problem = problem or str(e)
        if dense and targets:
            problem = "A dense baseline has no target to sweep; switch Dense baseline off."
        grid = {**({"comera.target_compression": targets} if targets else {}), **extra}
        if "comera.target_compression" in extra and targets:
            problem = ("comera.target_compression is in both Targets and Other keys; give "
                       "it once")
        # each cell's ranks are chosen from its own target (a fixed rank fits one target)
        sweep_raw = json.loads(json.dumps(raw))
        if AUTO_NAMED:  # the cells are named "<config> · <cell>", not after the form's target
            sweep_raw["name"] = preset.title
        for key in ("rank", "embedding_rank") if targets else ():
            sweep_raw.get("model", {}).pop(key, None)
        if problem is None:  # the grid is the browser's: it may name only what is offered
            problem = _grid_problem(sweep_raw, extra)
        if problem is None and not n_errors:
            with st.spinner("Checking every cell…"):
                problem = _sweep_problem(json.dumps(
                    {"raw": sweep_raw, "grid": grid, "seeds": seeds, "parallel": parallel,
                     "gpus": gpu_ids}, sort_keys=True))
        unconfirmed = False
        if problem:
            st.error(problem, icon=":material/error:")
        elif not n_errors:
            points = math.prod(len(v) for v in grid.values())
            what = " × ".join([", ".join(f"{t:g}×" for t in targets)] if targets else [])
            what = " × ".join([w for w in [what, *(f"{k} {', '.join(map(str, v))}"
                                                   for k, v in extra.items())] if w])
            st.caption(f"{points * seeds} runs: {what} × {seeds} seed(s).")
            if points * seeds > CONFIRM_CELLS:  # a typo ("2…59") is not 174 runs at a click
                unconfirmed = not st.checkbox(f"Launch all {points * seeds} runs",
                                              key="sw-confirm")
        ui.save_form(SAVED, {"sw-targets", "sw-grid", "sw-seeds", "sw-parallel"})
        if targets:
            st.caption("The initial ranks of each run are chosen from its target.")
        sweep_token = runs.config_token(nonce, sweep_raw, {"gpus": gpu_ids, "grid": grid,
                                                           "seeds": seeds,
                                                           "parallel": parallel})
        if st.button("Launch sweep", key="sw-launch", icon=":material/rocket_launch:",
                     disabled=bool(problem or n_errors or unconfirmed), width="stretch"):
            try:
                sid, _ = runs.guarded_sweep(store, sweep_raw, sweep_token, grid, seeds,
                                            max_parallel=parallel, gpus=gpu_ids)
            except (ConfigError, ValueError) as e:
                st.error(sweep_words(e) if isinstance(e, ConfigError) else str(e),
                         icon=":material/error:")
                return
            ui.go_sweep(sid)


#: the run's name is the automatic one: the launch numbers it (#2, ...) when it is taken
AUTO_NAMED = raw.get("name") == auto_name
nonce = st.session_state.setdefault("form_nonce", uuid.uuid4().hex)
token = runs.config_token(nonce, raw, {"gpus": gpu_ids})
already = runs.launched_run(store, token)

with left:
    st.divider()
    if n_errors:
        st.error(f"Fix {n_errors} problem{'s' if n_errors > 1 else ''} above to launch.",
                 icon=":material/block:")
    if already:
        st.info(f"This exact configuration was launched from this form as run `{already}`. "
                "Launch opens it; **Launch another** starts a fresh copy.",
                icon=":material/info:")
    b1, b2 = st.columns([2, 1])
    clicked = b1.button("Launch", type="primary", disabled=bool(n_errors), key="launch",
                        icon=":material/rocket_launch:", width="stretch")
    if already and b2.button("Launch another", key="launch_another", width="stretch"):
        st.session_state["form_nonce"] = uuid.uuid4().hex
        st.rerun()
    if clicked and not n_errors:
        with st.status("Launching…", expanded=True) as status:
            status.write("Config validated")
            try:
                rid, started = runs.guarded_launch(store, raw, token, gpus=gpu_ids,
                                                   unique=AUTO_NAMED)
            except (ConfigError, ValueError) as e:
                status.update(label="Launch failed", state="error")
                st.error(str(e))
                st.stop()
            status.write(f"Run `{rid}` queued; the trainer starts in the background"
                         if started else f"Already launched as `{rid}`")
            status.update(label="Launched", state="complete")
        ui.go_live(rid)
    _sweep_section()

# ---------------------------------------------------------------- preview


def _layer_bars(pv: Preview, names: list[str], what: str, text: list[str] | None,
                axis_title: str, key: str) -> None:
    """Grouped horizontal bars per layer: dense, TT as allocated and, with a target, TT
    at the target ranks (``what``: ``params`` or ``macs``; log axis)."""
    fig = go.Figure()
    fig.add_bar(y=names, x=[getattr(layer, f"dense_{what}") for layer in pv.layers],
                name="dense", orientation="h", marker_color=plots.COLORS[7])
    fig.add_bar(y=names, x=[getattr(layer, f"tt_{what}") for layer in pv.layers],
                name="TT (allocated)", orientation="h", marker_color=plots.COLORS[0],
                text=text, textposition="auto" if text else None)
    if pv.target:
        fig.add_bar(y=names, x=[getattr(layer, f"target_{what}") for layer in pv.layers],
                    name="TT at target", orientation="h", marker_color=plots.COLORS[2])
    plots.log_ticks(fig, "x")
    fig.update_yaxes(autorange="reversed")
    fig.update_layout(barmode="group")
    plots.base_layout(fig, None, max(260, 60 + 26 * len(names) * (2 + bool(pv.target))),
                      axis_title)
    fig.update_layout(hovermode="closest")
    st.plotly_chart(fig, width="stretch", key=key)


def _memory_chart(pv: Preview) -> None:
    parts = ["weights", "gradients", "optimizer", "activations", "materialised"]
    fig = go.Figure()
    for i, part in enumerate(parts):
        fig.add_bar(y=["TT model", "dense model"],
                    x=[pv.memory["tt"][part] / 2**20, pv.memory["dense"][part] / 2**20],
                    name=part, orientation="h", marker_color=plots.COLORS[i])
    fig.update_layout(barmode="stack")
    plots.base_layout(fig, None, 220, f"{fmt.memory_label('estimate')}, MiB")
    fig.update_layout(hovermode="closest")
    st.plotly_chart(fig, width="stretch", key="pv-mem")


with right:
    st.subheader("Tensorisation preview", anchor=False)
    if pv is None:
        st.info("Fix the highlighted fields to see the preview.", icon=":material/visibility:")
        st.stop()
    unit = pv.token_unit
    k1, k2, k3, k4 = ui.tile_columns(4, per_row=2)  # half the page: rows of 2 tiles
    k1.metric("Parameters", fmt.count(pv.alloc_total),
              delta=f"dense {fmt.count(pv.dense_total)}", delta_color="off", delta_arrow="off",
              help="Whole model at the allocated ranks (dense layers included).")
    if pv.dense_model:
        k2.metric("Compression", "1.0×", help="The dense baseline is the 1× reference.")
    else:
        end, why = pv.at_target
        scope_label = SCOPE_LABELS[pv.scope]
        k2.metric(
            f"Compression ({scope_label})",
            fmt.ratio(pv.compression("alloc")),
            delta=(f"{fmt.ratio(end)} at the end" if end is not None else
                   "no target" if pv.target is None else "target not reached"),
            delta_color="off", delta_arrow="off",
            help=f"Dense / TT parameters of the {scope_label} (the target's scope) at the "
                 f"start; at the end of the run: {why}.",
        )
    k3.metric(f"MACs / {unit}", fmt.count(pv.tt_macs),
              delta=f"dense {fmt.count(pv.dense_macs)}", delta_color="off", delta_arrow="off",
              help="Forward multiply-accumulates of the linear and embedding layers per "
                   f"{unit}, on the path the planner picks at batch {pv.tokens_per_batch}.")
    k4.metric(fmt.memory_label("estimate"), fmt.nbytes(pv.memory["tt"]["total"]),
              delta=f"dense {fmt.nbytes(pv.memory['dense']['total'])}", delta_color="off",
              delta_arrow="off", help=fmt.memory_help("estimate"))
    if not pv.dense_model and pv.layers:
        dense = pv.dense_tt if pv.scope == "tensorized" else pv.dense_total
        st.plotly_chart(plots.size_bar(dense, pv.start_size, pv.floor_size, pv.target,
                                       pv.scope), width="stretch", key="pv-size")
    for n in pv.notes:
        st.caption(f":material/info: {n}")

    if pv.layers:
        rows = []
        for layer in pv.layers:
            a, b = layer.factors
            rows.append({
                "layer": layer.name,
                "shape": f"{layer.shape[0]}×{layer.shape[1]}",
                "factors": f"{'·'.join(map(str, a))} | {'·'.join(map(str, b))}",
                "ranks": "-".join(map(str, layer.ranks[1:-1])),
                "ranks at target": "-".join(map(str, layer.target_ranks[1:-1])),
                "dense": layer.dense_params,
                "TT": layer.tt_params,
                "at target": layer.target_params,
                "×": layer.compression,
                f"dense MACs/{unit}": layer.dense_macs,
                f"TT MACs/{unit}": layer.tt_macs,
                "path": layer.path,
            })
        ui.table(
            rows, height=min(420, 40 + 35 * len(rows)),
            column_config={
                # the full module name, kept in view while the wide table scrolls
                "layer": st.column_config.TextColumn(width="medium", pinned=True),
                "dense": st.column_config.NumberColumn(
                    format="compact", help="Parameters of the dense layer (bias included)."),
                "TT": st.column_config.NumberColumn(
                    format="compact", help="TT parameters at the allocated ranks."),
                "at target": st.column_config.NumberColumn(
                    format="compact", help="TT parameters at the predicted target ranks."),
                "×": st.column_config.NumberColumn(format="%.1f×"),
                f"dense MACs/{unit}": st.column_config.NumberColumn(format="compact"),
                f"TT MACs/{unit}": st.column_config.NumberColumn(format="compact"),
                "path": st.column_config.TextColumn(
                    help="The path the planner picks for the layer at this batch (from "
                         "timings measured on the GPU where it has a profile, else a cost "
                         "model): reconstructed (dense: W or the table from the cores), "
                         "factorised (halves (X·L)·R, a core-by-core sweep, gather from two "
                         "half tables) or fused (the Triton kernels)."),
            },
        )
        if pv.target and not pv.dense_model:
            st.caption("Ranks at target: an illustration, every bond scaled by one factor "
                       "until the TT layers fit the target (whole ranks, so they may land "
                       "below it); the run itself prunes entry by entry to the target.")
        tab1, tab2, tab3 = st.tabs(["Parameters per layer", f"MACs per {unit}",
                                    fmt.memory_label("estimate")])
        names = [layer.name for layer in pv.layers]
        with tab1:
            _layer_bars(pv, names, "params", None, "parameters (log)", "pv-params")
        with tab2:
            _layer_bars(pv, names, "macs", [layer.path for layer in pv.layers],
                        f"MACs per {unit} (log); embeddings: dense lookup is free", "pv-macs")
        with tab3:
            _memory_chart(pv)
    else:
        _memory_chart(pv)
