"""The New experiment form as a pure function: form values -> run config, checked by the
engine's own validation (the launcher's resolve_config) on every shipped preset."""

from __future__ import annotations

import pytest

from app.lib.form import FormValues, check_all, form_to_config
from app.lib.presets import load_presets
from comera_engine.errors import ConfigError
from comera_engine.launch import resolve_config
from comera_engine.preview import datasets_for

PRESETS = load_presets()


def _values(preset, **over) -> FormValues:
    raw = preset.config()
    base = dict(data=dict(raw.get("data", {})), size=raw["model"].get("preset", "tiny"),
                rank=int(raw["model"].get("rank") or 4), steps=40, batch_size=16,
                run_name=raw["name"])  # the form starts with the preset's name
    base.update(over)
    return FormValues(**base)


@pytest.mark.parametrize("key", sorted(PRESETS))
def test_every_preset_round_trips_through_the_form_and_validates(key: str) -> None:
    preset = PRESETS[key]
    before = preset.config()
    raw, gpus = form_to_config(before, _values(preset, target=12.5, scope="model",
                                               late_switch="step", switch_step=20))
    assert before == preset.config()  # the preset is left unchanged
    assert gpus is None and raw["train"]["device"] == "cpu"
    assert raw["comera"]["target_compression"] == 12.5 and raw["comera"]["switch"] == 20
    assert raw["data"]["name"] in {i.name for i in datasets_for(raw["model"]["name"])}
    cfg = resolve_config(raw)  # the engine's validation accepts what the form produced
    assert cfg.train.steps == 40 and cfg.train.batch_size == 16
    assert cfg.comera.target_scope == "model" and cfg.model.rank == raw["model"]["rank"]
    # every key the preset had that the form does not edit is kept
    for section in ("model", "comera", "train"):
        for k, v in before.get(section, {}).items():
            if k not in raw[section]:
                raise AssertionError(f"{section}.{k} lost")
            if k not in ("preset", "rank", "dense", "target_compression", "target_scope",
                         "switch", "steps", "batch_size", "seed", "eval_every",
                         "ckpt_every", "precision", "cuda_graph", "device",
                         "embedding_rank", "plateau_patience"):
                assert raw[section][k] == v, (section, k)


def test_dense_baseline_has_no_target_and_no_stages() -> None:
    preset = PRESETS["digits_tt_mlp"]
    raw, _ = form_to_config(preset.config(), _values(preset, dense=True, use_target=True,
                                                     late_switch="plateau", patience=7))
    assert raw["model"]["dense"] is True
    assert "target_compression" not in raw["comera"] and raw["comera"]["switch"] == "never"


def test_late_switch_gpu_name_and_patience() -> None:
    preset = PRESETS["digits_tt_mlp"]
    raw, gpus = form_to_config(preset.config(), _values(
        preset, late_switch="plateau", patience=33, device="cuda:1", run_name="  mine  ",
        use_target=False))
    assert gpus == "1" and raw["train"]["device"] == "cuda"
    assert raw["comera"]["switch"] == "plateau" and raw["comera"]["plateau_patience"] == 33
    assert raw["name"].strip() == "mine" and "target_compression" not in raw["comera"]
    raw, _ = form_to_config(preset.config(), _values(preset, run_name="   "))
    with pytest.raises(ConfigError, match="^name: must be a non-empty string"):
        resolve_config(raw)  # a blank name is refused, never silently replaced


@pytest.mark.parametrize("field, over", [
    ("model.rank", {"rank": 0}),
    ("train.steps", {"steps": 0}),
    ("train.batch_size", {"batch_size": 0}),
    ("comera.target_compression", {"target": 0.5}),
    ("train.precision", {"precision": "fp8"}),
    ("train.steps", {"steps": -5}),
    ("comera.headroom", {"auto_rank": True, "headroom": 0.5}),
    ("name", {"run_name": ""}),
])
def test_bad_form_values_are_refused_naming_the_field(field: str, over: dict) -> None:
    preset = PRESETS["digits_tt_mlp"]
    raw, _ = form_to_config(preset.config(), _values(preset, **over))
    with pytest.raises(ConfigError) as exc:
        resolve_config(raw)
    assert exc.value.field == field and "\n" not in str(exc.value)


@pytest.mark.parametrize("key", sorted(PRESETS))
def test_ranks_from_the_target_start_where_comera_train_starts(key: str) -> None:
    """With "Initial ranks from the target" on, the form leaves model.rank unset, so the
    run starts where `comera train` starts with the same config: the plan's ranks, at
    least ``headroom`` times the target size (or the full-rank TT)."""
    from comera_engine.preview import data_shape, preview
    from comera_engine.runplan import plan_initial_ranks

    preset = PRESETS[key]
    before = preset.config()
    if "target_compression" not in before.get("comera", {}):
        pytest.skip(f"{key} asks for no target")
    target = float(before["comera"]["target_compression"])
    raw, _ = form_to_config(before, _values(
        preset, auto_rank=True, headroom=2.0, target=target, rank=1, embedding_rank=1,
        scope=before["comera"].get("target_scope", "tensorized")))
    assert "rank" not in raw["model"] and "embedding_rank" not in raw["model"]
    cli = {**before, "comera": {**before["comera"], "headroom": 2.0}}
    cli["model"] = {k: v for k, v in before["model"].items()
                    if k not in ("rank", "embedding_rank")}
    cfg_form, cfg_cli = resolve_config(raw), resolve_config(cli)
    shape = data_shape(raw["data"])
    planned = [plan_initial_ranks(c, shape)[0].model for c in (cfg_form, cfg_cli)]
    assert (planned[0].rank, planned[0].embedding_rank) == (
        planned[1].rank, planned[1].embedding_rank)
    pv = preview(raw)
    assert pv.start_size >= 2.0 * pv.target_size or pv.compression() < 2.0 * target


def test_fixed_ranks_are_kept_when_the_toggle_is_off() -> None:
    preset = PRESETS["digits_tt_mlp"]
    raw, _ = form_to_config(preset.config(), _values(preset, auto_rank=False, rank=5,
                                                     headroom=2.0))
    assert raw["model"]["rank"] == 5 and "headroom" not in raw["comera"]


@pytest.mark.parametrize("layout", ["tt", "ttm"])
def test_the_linear_layout_reaches_the_model(layout: str) -> None:
    """The form's layout choice builds TT linears of that layout (the digits preset ships
    ttm; choosing tt gives the paper's order-2d train)."""
    from comera_engine.layers import TTLinear
    from comera_engine.models import build_model
    from comera_engine.preview import data_shape

    preset = PRESETS["digits_tt_mlp"]
    raw, _ = form_to_config(preset.config(), _values(preset, linear_layout=layout))
    cfg = resolve_config(raw)
    model = build_model(cfg.model, data_shape(raw["data"]))
    layers = [m for m in model.modules() if isinstance(m, TTLinear)]
    assert layers and {m.layout for m in layers} == {layout}
    kept, _ = form_to_config(preset.config(), _values(preset))  # None: the preset's
    assert kept["model"]["linear_layout"] == preset.config()["model"]["linear_layout"]


def test_a_target_beyond_the_floor_is_refused_by_the_engines_plan() -> None:
    """Target 1e9: the config is well formed, the engine's plan refuses it; the preview
    the form shows carries that refusal (the form disables Launch on it)."""
    from comera_engine.preview import preview
    from comera_engine.runplan import plan_initial_ranks

    preset = PRESETS["digits_tt_mlp"]
    raw, _ = form_to_config(preset.config(), _values(preset, target=1e9))
    cfg = resolve_config(raw)
    from comera_engine.preview import data_shape

    with pytest.raises(ConfigError) as exc:
        plan_initial_ranks(cfg, data_shape(raw["data"]))
    pv = preview(raw)
    assert pv.errors == [(exc.value.field, exc.value.problem)]
    assert pv.at_target[0] is None and pv.at_target[1] == exc.value.problem


@pytest.mark.parametrize("steps, switch", [(200, 150), (600, 5000), (600, 150)])
def test_the_late_stage_the_form_states_is_where_the_engine_switches(
        steps: int, switch: int, tmp_path) -> None:
    """``preview.late_stage`` (what the form shows) against the trainer itself: the step
    of its ``stage`` event, and that the run then reaches the target."""
    from comera_engine.metrics import JSONLSink, read_jsonl
    from comera_engine.preview import late_stage
    from comera_engine.train.loop import train

    preset = PRESETS["digits_tt_mlp"]
    raw, _ = form_to_config(preset.config(), _values(
        preset, steps=steps, late_switch="step", switch_step=switch, target=10.0, batch_size=64,
        auto_rank=True, headroom=3.0,
        eval_every=0, ckpt_every=0))
    cfg = resolve_config(raw)
    stage = late_stage(cfg.comera, steps)
    assert stage.pursued
    assert (stage.moved is not None) == (switch > steps // 2)  # switch_by 0.5: the latest
    sink = JSONLSink(tmp_path / "metrics.jsonl")
    result = train(cfg, tmp_path, sink, progress=False)
    sink.close()
    events = [r for r in read_jsonl(tmp_path / "metrics.jsonl")
              if r.get("type") == "event" and r["kind"] == "stage"]
    assert [e["step"] for e in events] == [stage.step]
    assert abs(result.metrics["compression/error"]) <= 0.05


def test_check_all_names_every_problem_the_engine_finds() -> None:
    """The engine's validation stops at its first refusal; ``check_all`` gives every one,
    a line each naming its field and the fix, and the config when there is none."""
    preset = PRESETS["digits_tt_mlp"]
    cfg, problems = check_all(preset.config(), resolve_config)
    assert problems == [] and cfg.train.steps == 600
    raw = preset.config()
    raw["comera"].update(tau=3.0, batch_sise=4)
    raw["train"].update(grad_clip=-1.0, steps=2.5)
    before = preset.config()
    before["comera"].update(tau=3.0, batch_sise=4)
    before["train"].update(grad_clip=-1.0, steps=2.5)
    cfg, problems = check_all(raw, resolve_config)
    assert cfg is None and raw == before  # the config itself is left as it is
    assert [p.field for p in problems] == ["comera.tau", "comera.batch_sise", "train.steps",
                                           "train.grad_clip"]
    assert "did you mean train.batch_size?" in str(problems[1])
    assert all(str(p).startswith(p.field + ": ") and "\n" not in str(p) for p in problems)
    # the model's name refused: the rest would be judged against another model, so the
    # list stops there (no "does not apply to tt_mlp" about the fields of the one meant)
    raw = preset.config()
    raw["model"]["name"] = "tt_mpl"
    raw["comera"]["tau"] = 3.0
    _, problems = check_all(raw, resolve_config)
    assert [p.field for p in problems] == ["comera.tau", "model.name"]
    assert "did you mean tt_mlp?" in str(problems[1])
    # a missing field cannot be taken out: it is named once, and the list ends with it
    raw = preset.config()
    del raw["data"]["name"]
    raw["train"]["steps"] = 0
    _, problems = check_all(raw, resolve_config)
    assert [p.field for p in problems] == ["data.name"]
