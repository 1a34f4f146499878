"""The New experiment form as a pure function: form values -> run config, checked by the
engine's own validation (the launcher's resolve_config) on every shipped preset."""

from __future__ import annotations

import pytest

from app.lib.form import FormValues, form_to_config
from app.lib.presets import load_presets
from comera_engine.errors import ConfigError
from comera_engine.launch import resolve_config
from comera_engine.preview import datasets_for

PRESETS = load_presets()


def _values(preset, **over) -> FormValues:
    raw = preset.config()
    base = dict(data=dict(raw.get("data", {})), size=raw["model"].get("preset", "tiny"),
                rank=int(raw["model"].get("rank") or 4), steps=40, batch_size=16)
    base.update(over)
    return FormValues(**base)


@pytest.mark.parametrize("key", sorted(PRESETS))
def test_every_preset_round_trips_through_the_form_and_validates(key: str) -> None:
    preset = PRESETS[key]
    before = preset.config()
    raw, gpus = form_to_config(before, _values(preset, target=12.5, scope="model",
                                               schedule="step", switch_step=20))
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
                                                     schedule="plateau", patience=7))
    assert raw["model"]["dense"] is True
    assert "target_compression" not in raw["comera"] and raw["comera"]["switch"] == "never"


def test_schedule_gpu_name_and_patience() -> None:
    preset = PRESETS["digits_tt_mlp"]
    raw, gpus = form_to_config(preset.config(), _values(
        preset, schedule="plateau", patience=33, device="cuda:1", run_name="  mine  ",
        use_target=False))
    assert gpus == "1" and raw["train"]["device"] == "cuda"
    assert raw["comera"]["switch"] == "plateau" and raw["comera"]["plateau_patience"] == 33
    assert raw["name"] == "mine" and "target_compression" not in raw["comera"]
    raw, _ = form_to_config(preset.config(), _values(preset, run_name="   "))
    assert raw["name"] == preset.config()["name"]  # blank name: the preset's


@pytest.mark.parametrize("field, over", [
    ("model.rank", {"rank": 0}),
    ("train.steps", {"steps": 0}),
    ("train.batch_size", {"batch_size": 0}),
    ("comera.target_compression", {"target": 0.5}),
    ("train.precision", {"precision": "fp8"}),
])
def test_bad_form_values_are_refused_naming_the_field(field: str, over: dict) -> None:
    preset = PRESETS["digits_tt_mlp"]
    raw, _ = form_to_config(preset.config(), _values(preset, **over))
    with pytest.raises(ConfigError) as exc:
        resolve_config(raw)
    assert exc.value.field == field and "\n" not in str(exc.value)
