"""Run configuration, torch-free: four plain dataclasses, loaded from TOML, overridden
by ``--set``.

A config file has a top-level ``name`` and four tables::

    name = "digits-tt"

    [model]     # ModelConfig: which network, its size preset, which layers are TT
    [data]      # free-form table handed to comera_engine.data.build_dataset (it checks it)
    [comera]    # CoMERAConfig: rank adaptivity, the two stages, AdamW learning rates
    [train]     # TrainConfig: steps, batch size, eval/checkpoint cadence, device, precision

Everything is validated up front by :func:`load_config` / :func:`config_from_dict`:
unknown keys (with a "did you mean" suggestion), wrong types and out-of-range values
raise :class:`~comera_engine.errors.ConfigError` whose message names the field, e.g.
``train.batch_sise: unknown key (did you mean train.batch_size?)``.

The package: ``schema.py`` (the dataclasses, the names, every number's bound), ``read.py``
(TOML, ``--set``, coercion to the fields' types), ``nesting.py`` (how deep a TOML or JSON
text may nest before it is parsed), ``validate.py`` (ranges and consistency),
``write.py`` (back to TOML). What the schedules (``comera.schedule``) set is the
method's business: :mod:`comera_engine.rank.schedule`.
"""

from .nesting import PARSE_DEPTH, bracket_depth, loads_json, loads_toml
from .read import (
    apply_override,
    check_bounds,
    config_from_dict,
    load_config,
    parse_value,
)
from .schema import (
    ANY_NUMBER,
    BOUNDS,
    DATA_BOUNDS,
    DEFAULT_TT_LAYERS,
    LINEAR_LAYOUTS,
    LR_SCHEDULES,
    MAX_CONFIG_BYTES,
    MAX_DEPTH,
    MAX_LIST,
    MAX_NAME,
    MAX_OVERRIDE_CHARS,
    METHODS,
    MODEL_FIELDS,
    MODEL_NAMES,
    OPTIMIZERS,
    PRESETS,
    QUANTIZE,
    SCHEDULE_NAMES,
    SECTIONS,
    TENSORIZE_BOUNDS,
    TENSORIZE_KEYS,
    TT_IMPLS,
    TT_LAYER_KINDS,
    USER_TASKS,
    Bound,
    CoMERAConfig,
    Config,
    ModelConfig,
    TrainConfig,
)
from .validate import (
    check_choice,
    check_data_numbers,
    check_entry_point,
    check_number,
    check_run_name,
    check_task,
    refuse_unknown,
    validate,
    validate_comera,
    validate_methods,
    validate_user_model,
)
from .write import to_toml, toml_value

__all__ = [
    "ANY_NUMBER", "BOUNDS", "DATA_BOUNDS", "DEFAULT_TT_LAYERS", "LINEAR_LAYOUTS",
    "LR_SCHEDULES", "MAX_CONFIG_BYTES", "MAX_DEPTH", "MAX_LIST", "MAX_NAME", "MAX_OVERRIDE_CHARS",
    "METHODS", "MODEL_FIELDS", "MODEL_NAMES", "OPTIMIZERS", "PARSE_DEPTH", "PRESETS", "QUANTIZE",
    "SCHEDULE_NAMES", "SECTIONS", "TENSORIZE_BOUNDS", "TENSORIZE_KEYS", "TT_IMPLS",
    "TT_LAYER_KINDS", "USER_TASKS", "Bound", "CoMERAConfig", "Config", "ModelConfig", "TrainConfig",
    "apply_override", "bracket_depth", "check_bounds", "check_choice", "check_data_numbers",
    "check_entry_point", "check_number", "check_run_name", "check_task", "config_from_dict",
    "load_config", "loads_json", "loads_toml", "parse_value", "refuse_unknown", "to_toml",
    "toml_value", "validate", "validate_comera", "validate_methods", "validate_user_model",
]
