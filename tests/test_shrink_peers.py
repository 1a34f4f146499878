"""The pruning and int8 peers (comera_engine/train/shrink.py): a dense digits run is
pruned by torch-pruning to a 10x target and fine-tuned, then its weights are quantized
by torchao; sizes are checked against counts made here from the saved tensors, and bad
configs are refused naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from comera_engine.errors import ConfigError
from tests.run_checks import train_final_eval

pytestmark = pytest.mark.usefixtures("one_thread")
pytest.importorskip("torch_pruning")
pytest.importorskip("torchao")

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "experiments" / "configs" / "digits_tt_mlp.toml")


def _train(run: Path, *sets: str) -> dict[str, float]:
    """A dense digits run without checkpoints (:func:`train_final_eval`)."""
    return train_final_eval(CONFIG, run, "model.dense=true", "train.ckpt_every=0", *sets)


def test_prune_then_int8(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    dense = _train(tmp_path / "dense", "train.steps=150", "train.eval_every=0")
    pruned = _train(tmp_path / "prune", 'comera.method="prune"',
                    f'model.init_from="{tmp_path / "dense"}"', "comera.target_compression=10",
                    "train.steps=40", "train.eval_every=0")
    # hidden layers of the digits MLP (the TT scope): 64*256+256*256 weights and biases
    # (TT layers count their bias); the output layer (256*10+10) is the rest
    scope, rest = 64 * 256 + 256 + 256 * 256 + 256, 256 * 10 + 10
    saved = load_file(str(sorted((tmp_path / "prune" / "checkpoints").glob("*.safetensors"))[-1]))
    n = sum(t.numel() for k, t in saved.items() if k.startswith("model/"))
    assert pruned["params/effective"] == n
    assert n <= rest + scope / 10 and n > rest + scope / 10 * 0.8  # at the target, not far below
    assert pruned["compression/tensorized"] == pytest.approx(scope / (n - rest))
    assert pruned["bytes/effective"] == 4 * n and dense["bytes/effective"] == 4 * (scope + rest)
    assert pruned["eval/acc"] > 0.8
    q = _train(tmp_path / "int8", 'model.quantize="int8"',
               f'model.init_from="{tmp_path / "prune"}"', "train.steps=0")
    # int8 per row: one byte a weight, a float32 scale and an int8 zero point a row;
    # the biases stay float32
    shapes = [t.shape for k, t in saved.items() if k.startswith("model/") and t.dim() == 2]
    biases = sum(t.numel() for k, t in saved.items() if k.startswith("model/") and t.dim() == 1)
    want = sum(a * b + 5 * a for a, b in shapes) + 4 * biases
    assert q["bytes/effective"] == want
    assert q["compression/model"] == pytest.approx(4 * (scope + rest) / want)
    assert abs(q["eval/acc"] - pruned["eval/acc"]) <= 0.02


@pytest.mark.parametrize("sets, field", [
    (['comera.method="prune"', "comera.target_compression=10"], "model.init_from"),
    (['model.quantize="int8"', 'model.init_from="x"'], "train.steps"),
    (['model.quantize="int4"', 'model.init_from="x"', "train.steps=0"], "model.quantize"),
])
def test_bad_configs_name_the_field(sets: list[str], field: str) -> None:
    from comera_engine.launch import resolve_config

    with pytest.raises(ConfigError) as exc:
        resolve_config(CONFIG, ["model.dense=true", *sets])
    assert exc.value.args[0] == field or str(exc.value).startswith(field)


def test_stored_bytes_of_a_torchao_weight() -> None:
    from comera_engine.layers import stored_nbytes
    from comera_engine.train.shrink import quantize_int8

    m = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 4))
    quantize_int8(m)
    assert stored_nbytes(m[0].weight) == 50 * 8 + 50 * 5
    assert stored_nbytes(m[1].weight) == 4 * 8 + 4 * 5


@pytest.mark.parametrize("target", [20_000, 8_000, 3_000])
def test_pruned_transformer_still_runs(target: int) -> None:
    """Pruning narrows attention heads and the residual width separately; the pruned
    encoder must still run (its heads split the projection's own width, a multiple of
    the head count) and be at most the asked size."""
    from comera_engine.models.common import LayerFactory
    from comera_engine.models.transformer import TransformerClassifier, TransformerSize
    from comera_engine.train.shrink import prune_to_target

    torch.manual_seed(0)
    size = TransformerSize(d_model=32, n_layers=2, n_heads=2, d_ff=64, rank=4,
                           embedding_rank=4, dropout=0.0)
    model = TransformerClassifier(size, LayerFactory((), 4, 4, dense=True), vocab_size=300,
                                  max_len=16, num_classes=3)
    batch = (torch.randint(1, 300, (4, 16)), torch.zeros(4, 16, dtype=torch.long),
             torch.ones(4, 16, dtype=torch.long))  # as the SNLI batches come
    prune_to_target(model, batch, target, lambda m, x: m(*x).sum())
    assert sum(p.numel() for p in model.parameters()) <= target
    assert model(*batch).shape == (4, 3)
    for layer in model.encoder.layers:
        assert layer.attn.q.out_features % 2 == 0
