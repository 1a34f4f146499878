"""The embedded default experiment: a tiny TT MLP on scikit-learn's 8x8 digits.

It ships inside the package so that ``comera app`` has an experiment ready to launch
even when the repository's ``experiments/configs/`` folder is not around.
"""

from __future__ import annotations

import copy
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

DEFAULT_PRESET = "digits_tt_mlp"

DEFAULT_CONFIG_TOML = """\
# TT MLP on scikit-learn's 8x8 digits: CPU size (about 10 s on 2 cores). Both CoMERA stages.
# Dense baseline of the same network: --set model.dense=true
name = "digits-tt-mlp"

[model]
name = "tt_mlp"
preset = "tiny"          # hidden 256-256, TT rank 8
tt_layers = ["hidden"]
linear_layout = "ttm"    # TT-matrix cores: at 10-100x far more accurate here than the
                         # paper's "tt" layout (docs/RESULTS.md); "tt" saves MACs instead

[data]
name = "digits"
split_fraction = 0.8

[comera]
gamma = 0.01
tau = 0.01
target_compression = 60.0  # starts at 17.8x (rank 6: ~3x the target size)
target_scope = "tensorized"
switch = 100             # late stage after 100 steps (schedule comera prunes in the 500 after)
lr_cores = 3e-3
lr_gates = 1e-2
lr_dense = 3e-3
weight_decay = 0.0

[train]
steps = 600
batch_size = 64
eval_every = 100
ckpt_every = 300
grad_clip = 1.0
seed = 0
"""

_DEFAULT = tomllib.loads(DEFAULT_CONFIG_TOML)


def default_config() -> dict[str, Any]:
    """A fresh copy of the default experiment's config (TOML tables as dicts)."""
    return copy.deepcopy(_DEFAULT)
