"""experiments/heldout.py: the held-out SNLI test set is cut from the SNLI configs' own
training part (never from the evaluation part their settings were tuned on), the files
hold exactly those examples, and a run reads them as its train and eval data."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))
import heldout  # noqa: E402

pytestmark = pytest.mark.skipif(not heldout.SOURCE.is_file(),
                                reason=f"SNLI dev file not found at {heldout.SOURCE} "
                                       "(needs ../shared/data)")


def _texts(ex, idx=None):  # noqa: ANN001, ANN202
    idx = range(len(ex)) if idx is None else idx
    return [(ex.premises[i], ex.hypotheses[i], ex.labels[i]) for i in idx]


def test_the_test_set_comes_from_the_configs_training_part_only(tmp_path) -> None:
    from comera_engine.config import load_config
    from comera_engine.data.nli import build_nli, read_nli_file

    everything = read_nli_file(heldout.SOURCE)
    parts = heldout.split(len(everything), n_test=300)
    sets = {k: set(v) for k, v in parts.items()}
    assert len(parts["test"]) == 300
    assert not (sets["test"] & sets["eval"]) and not (sets["test"] & sets["train"])
    assert not (sets["train"] & sets["eval"])
    assert sets["train"] | sets["test"] | sets["eval"] == set(range(len(everything)))
    # the reference: the trainer's own data for the shipped config, whose eval part must
    # be exactly the part left out, and whose training part the other two make up
    data = dict(load_config(heldout.CONFIG).data)
    data["path"] = str(heldout.SOURCE)
    bundle = build_nli(data)
    assert len(bundle.eval) == len(parts["eval"])
    assert len(bundle.train) == len(parts["train"]) + len(parts["test"])
    assert bundle.eval.tensors["labels"].tolist() == [everything.labels[i] for i in parts["eval"]]

    train, test = heldout.write(tmp_path, n_test=300)
    assert _texts(read_nli_file(test)) == _texts(everything, parts["test"])
    assert _texts(read_nli_file(train)) == _texts(everything, parts["train"])
    # nothing half-written left behind: the two files and nothing else
    assert sorted(p.name for p in tmp_path.iterdir()) == ["test.jsonl", "train.jsonl"]
    run = build_nli({**data, "path": str(train), "eval_path": str(test)})
    assert (len(run.train), len(run.eval)) == (len(parts["train"]), 300)
