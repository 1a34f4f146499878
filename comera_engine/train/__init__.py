"""Training: config dataclasses and TOML validation, the training loop, checkpoints,
CUDA Graphs and DDP.

>>> from comera_engine.train import load_config, train
>>> cfg = load_config("experiments/configs/digits_tt_mlp.toml", ["train.steps=100"])
>>> result = train(cfg, "runs/demo", sink)       # any comera_engine.metrics.MetricsSink
"""

from __future__ import annotations

from comera_engine.config import (
    CoMERAConfig,
    Config,
    ModelConfig,
    TrainConfig,
    apply_override,
    config_from_dict,
    load_config,
    to_toml,
)
from comera_engine.train.loop import TrainResult, evaluate, train

__all__ = [
    "CoMERAConfig",
    "Config",
    "ModelConfig",
    "TrainConfig",
    "TrainResult",
    "apply_override",
    "config_from_dict",
    "evaluate",
    "load_config",
    "to_toml",
    "train",
]
