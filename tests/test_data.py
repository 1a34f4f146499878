"""Tests for comera_engine.data: loaders, tokenizer, corpora, identity, config errors."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from comera_engine.data import (
    DataBundle,
    TensorDictDataset,
    available_datasets,
    build_dataset,
    dataset_identity,
    file_sha256,
    nli,
    split_indices,
)
from comera_engine.data import clicks as clk
from comera_engine.data import code_corpus as cc
from comera_engine.data.digits import load_digits_split
from comera_engine.data.tokenizer import WordPieceTokenizer
from comera_engine.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
SNLI_DEV = REPO.parent / "shared/data/snli/dev.jsonl"


def _auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve via the rank-sum formula (no ties expected)."""
    ranks = np.empty(len(scores))
    ranks[np.argsort(scores)] = np.arange(1, len(scores) + 1)
    pos = labels == 1
    n_pos, n_neg = pos.sum(), (~pos).sum()
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


# --------------------------------------------------------------------------- imports


def test_package_imports_without_optional_libraries():
    """`import comera_engine.data` and a synthetic bundle need only torch and numpy."""
    code = """
import importlib.abc, sys
BLOCKED = {"datasets", "tokenizers", "sklearn", "pandas", "pyarrow"}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError("blocked " + name)
sys.meta_path.insert(0, Block())
import comera_engine
import comera_engine.data as data
for mod in ("base", "registry", "clicks", "code_corpus", "digits", "identity", "nli", "tokenizer"):
    __import__("comera_engine.data." + mod)
b = data.build_dataset({"name": "clicks_synthetic", "num_samples": 200})
assert len(b.train) == 160 and len(b.eval) == 40
try:
    data.build_dataset({"name": "digits"})
except data.ConfigError as exc:
    assert "scikit-learn" in str(exc), exc
else:
    raise AssertionError("digits without sklearn should fail")
print("ok")
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_registry_lists_all_names():
    assert available_datasets() == sorted(
        ["clicks", "clicks_synthetic", "clicks_criteo", "code_mlm", "digits", "mnli", "nli", "snli",
         "movielens", "adult", "reviews", "files", "factory"]
    )


def test_split_indices_deterministic_disjoint_complete():
    a_train, a_eval = split_indices(101, 0.8, seed=3)
    b_train, b_eval = split_indices(101, 0.8, seed=3)
    c_train, _ = split_indices(101, 0.8, seed=4)
    assert np.array_equal(a_train, b_train) and np.array_equal(a_eval, b_eval)
    assert not np.array_equal(a_train, c_train)
    assert len(a_train) == 81 and len(a_eval) == 20
    assert set(a_train).isdisjoint(a_eval)
    assert sorted(set(a_train) | set(a_eval)) == list(range(101))


def test_tensor_dict_dataset_items_and_length_check():
    ds = TensorDictDataset({"x": torch.arange(12).reshape(4, 3), "labels": torch.arange(4)})
    assert len(ds) == 4
    item = ds[2]
    assert item["x"].tolist() == [6, 7, 8] and int(item["labels"]) == 2
    assert len(ds.subset([0, 3])) == 2
    with pytest.raises(ValueError, match="tensors"):
        TensorDictDataset({"x": torch.zeros(3), "y": torch.zeros(4)})


# --------------------------------------------------------------------------- digits


def test_digits_shapes_split_and_normalisation():
    bundle = build_dataset({"name": "digits", "seed": 0, "split_fraction": 0.8})
    assert isinstance(bundle, DataBundle) and bundle.task == "classification"
    assert bundle.num_classes == 10 and bundle.meta["input_dim"] == 64
    assert len(bundle.train) + len(bundle.eval) == 1797
    assert abs(len(bundle.eval) - 0.2 * 1797) <= 10
    x = bundle.train.tensors["x"]
    assert x.shape == (len(bundle.train), 64) and x.dtype == torch.float32
    assert bundle.train.tensors["labels"].dtype == torch.int64
    # standardised with train statistics: per-pixel train mean ~0, std ~1 (or constant 0)
    assert x.mean(0).abs().max() < 1e-4
    std = x.std(0, unbiased=False)
    assert torch.all(((std - 1).abs() < 1e-3) | (std < 1e-6))
    # every class in both splits (stratified)
    assert set(bundle.train.tensors["labels"].tolist()) == set(range(10))
    assert set(bundle.eval.tensors["labels"].tolist()) == set(range(10))
    assert bundle.identity["num_examples"] == {"train": len(bundle.train), "eval": len(bundle.eval)}


def test_digits_split_deterministic_and_disjoint():
    a = load_digits_split(0.2, seed=1)
    b = load_digits_split(0.2, seed=1)
    c = load_digits_split(0.2, seed=2)
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    assert not np.array_equal(a.test_index, c.test_index)
    assert set(a.train_index.tolist()).isdisjoint(a.test_index.tolist())
    assert len(a.train_index) + len(a.test_index) == 1797


# --------------------------------------------------------------------------- NLI files

_WORDS = "a man woman dog cat runs sits plays in the park on grass red blue ball two kids".split()
_LABELS = ["entailment", "neutral", "contradiction"]


def _nli_rows(n: int, seed: int = 0) -> list[tuple[str, str, str]]:
    """n (premise, hypothesis, label) rows of random words, labels cycling."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        p = " ".join(rng.choice(_WORDS, size=8)) + " ."
        h = " ".join(rng.choice(_WORDS, size=5)) + " ."
        rows.append((p, h, _LABELS[i % 3]))
    return rows


def _write_glue_tsv(path: Path, rows, extra_bad: bool = True) -> None:
    """MNLI-layout TSV: many columns, text in sentence1/sentence2, label in gold_label."""
    header = [
        "index",
        "promptID",
        "pairID",
        "genre",
        "sentence1_binary_parse",
        "sentence2_binary_parse",
        "sentence1_parse",
        "sentence2_parse",
        "sentence1",
        "sentence2",
        "label1",
        "gold_label",
    ]
    lines = ["\t".join(header)]
    for i, (p, h, y) in enumerate(rows):
        lines.append(
            "\t".join([str(i), "1", f"{i}e", "fiction", "(x)", "(y)", "(X)", "(Y)", p, h, y, y])
        )
    if extra_bad:
        lines.append("\t".join(["99", "1", "99e", "fiction", "", "", "", "", "x", "y", "-", "-"]))
        lines.append("truncated\trow")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _write_jsonl(path: Path, rows) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for i, (p, h, y) in enumerate(rows):
            label = _LABELS.index(y) if i % 2 else y  # mix int and string labels
            f.write(json.dumps({"premise": p, "hypothesis": h, "label": label}) + "\n")
        f.write(json.dumps({"premise": "x", "hypothesis": "y", "label": -1}) + "\n")
        f.write(json.dumps({"premise": "x", "hypothesis": "y", "label": "-"}) + "\n")


def test_label_mapping():
    assert [nli.label_to_id(v) for v in ("entailment", "Neutral ", "contradiction")] == [0, 1, 2]
    assert [nli.label_to_id(v) for v in (0, 1, 2, "2", 1.0)] == [0, 1, 2, 2, 1]
    assert all(nli.label_to_id(v) is None for v in ("-", "", -1, 3, None, "maybe", True))


def test_glue_tsv_jsonl_parquet_read_the_same(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = _nli_rows(30)
    tsv, jsonl, parquet = tmp_path / "m.tsv", tmp_path / "m.jsonl", tmp_path / "m.parquet"
    _write_glue_tsv(tsv, rows)
    _write_jsonl(jsonl, rows)
    table = pa.table(
        {
            "premise": [r[0] for r in rows] + ["x"],
            "hypothesis": [r[1] for r in rows] + ["y"],
            "label": [_LABELS.index(r[2]) for r in rows] + [-1],
        }
    )
    pq.write_table(table, parquet)
    expected_labels = [_LABELS.index(r[2]) for r in rows]
    for path, dropped in ((tsv, 2), (jsonl, 2), (parquet, 1)):
        ex = nli.read_nli_file(path)
        assert ex.premises == [r[0] for r in rows], path.name
        assert ex.hypotheses == [r[1] for r in rows]
        assert ex.labels == expected_labels
        assert ex.dropped == dropped, path.name


def test_tsv_keeps_quotes_verbatim(tmp_path):
    rows = [('He said "hi there , ok .', 'It \'s "quoted" .', "neutral")] * 3
    path = tmp_path / "q.tsv"
    _write_glue_tsv(path, rows, extra_bad=False)
    ex = nli.read_glue_tsv(path)
    assert ex.premises[0] == rows[0][0] and ex.hypotheses[0] == rows[0][1]


def test_hub_split_conversion_drops_unlabelled():
    import datasets

    ds = datasets.Dataset.from_dict(
        {"premise": ["p1", "p2", "p3"], "hypothesis": ["h1", "h2", "h3"], "label": [0, -1, 2]}
    )
    ex = nli.examples_from_hub_split(ds)
    assert ex.labels == [0, 2] and ex.premises == ["p1", "p3"] and ex.dropped == 1


def test_hub_loader_end_to_end_on_a_local_dataset_folder(tmp_path):
    """`hub = true` runs `datasets.load_dataset` for real; a local folder stands in for the hub."""
    folder = tmp_path / "snli_like"
    folder.mkdir()
    for split, n in (("train", 40), ("validation", 10)):
        rows = [*_nli_rows(n, seed=n), ("x", "y", "-")]  # one column type: string labels
        lines = [json.dumps({"premise": p, "hypothesis": h, "label": y}) for p, h, y in rows]
        (folder / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    cfg = {
        "name": "snli",
        "hub": True,
        "hub_name": str(folder),
        "cache_dir": str(tmp_path / "c"),
        "seq_len": 16,
        "vocab_size": 100,
        "min_frequency": 1,
    }
    bundle = build_dataset(cfg)
    assert len(bundle.train) == 40 and len(bundle.eval) == 10  # '-' labels dropped
    ident = bundle.identity
    assert ident["source"] == f"hub:{folder}" and ident["extra"]["eval_split"] == "validation"
    assert ident["extra"]["train_fingerprint"] and ident["params"]["split_fraction"] is None
    with pytest.raises(ConfigError, match=r"^data\.hub: could not load snli"):
        build_dataset({**cfg, "eval_split": "no_such_split"})


def test_hub_without_network_is_a_config_error(tmp_path):
    code = (
        "from comera_engine.data import build_dataset, ConfigError\n"
        "try:\n    build_dataset({'name': 'mnli', 'hub': True})\n"
        "except ConfigError as exc:\n    print(exc)\n"
    )
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf"),
    }
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("data.hub: could not load mnli from the Hugging Face hub")


def test_nli_bundle_from_files_with_eval_path(tmp_path):
    train_path, eval_path = tmp_path / "train.tsv", tmp_path / "dev.jsonl"
    _write_glue_tsv(train_path, _nli_rows(60, seed=1))
    _write_jsonl(eval_path, _nli_rows(12, seed=2))
    bundle = build_dataset(
        {
            "name": "mnli",
            "path": "train.tsv",
            "eval_path": "dev.jsonl",
            "seq_len": 24,
            "vocab_size": 200,
            "min_frequency": 1,
        },
        base_dir=tmp_path,
    )
    assert bundle.task == "nli" and bundle.num_classes == 3 and bundle.seq_len == 24
    assert len(bundle.train) == 60 and len(bundle.eval) == 12
    batch = next(iter(torch.utils.data.DataLoader(bundle.train, batch_size=8)))
    assert batch["input_ids"].shape == (8, 24) and batch["labels"].shape == (8,)
    names = [Path(f["path"]).name for f in bundle.identity["files"]]
    assert names == ["train.tsv", "dev.jsonl"]
    assert bundle.identity["extra"]["dropped"] == 2


@pytest.fixture(scope="module")
def snli_bundle(tmp_path_factory):
    if not SNLI_DEV.is_file():
        pytest.skip(f"SNLI dev file not found at {SNLI_DEV} (needs ../shared/data)")
    tok_dir = tmp_path_factory.mktemp("snli_tok")
    cfg = {
        "name": "snli",
        "path": str(SNLI_DEV),
        "seq_len": 64,
        "vocab_size": 4000,
        "split_fraction": 0.8,
        "seed": 0,
        "tokenizer_path": str(tok_dir / "tokenizer.json"),
    }
    return cfg, build_dataset(cfg)


def test_snli_bundle_shapes_labels_and_balance(snli_bundle):
    cfg, bundle = snli_bundle
    assert len(bundle.train) + len(bundle.eval) == 9842
    assert len(bundle.train) == round(9842 * 0.8)
    t = bundle.train.tensors
    assert t["input_ids"].shape == (len(bundle.train), 64) and t["input_ids"].dtype == torch.int64
    assert bundle.vocab_size == 4000 and int(t["input_ids"].max()) < bundle.vocab_size
    assert torch.all(t["input_ids"][:, 0] == bundle.tokenizer.cls_id)
    # padding is [PAD]=0 exactly where the attention mask is 0
    assert torch.equal(t["input_ids"] == 0, t["attention_mask"] == 0)
    # the hypothesis carries token type 1, and every row has one
    assert torch.all(t["token_type_ids"].sum(1) > 0)
    assert torch.all(t["token_type_ids"][t["attention_mask"] == 0] == 0)
    # about one third each
    for split in (bundle.train, bundle.eval):
        counts = torch.bincount(split.tensors["labels"], minlength=3).double()
        shares = counts / counts.sum()
        assert torch.all((shares > 0.30) & (shares < 0.37)), shares
    ident = bundle.identity
    assert ident["files"][0]["sha256"] == file_sha256(SNLI_DEV)
    assert ident["files"][0]["bytes"] == SNLI_DEV.stat().st_size
    assert ident["num_examples"] == {"train": len(bundle.train), "eval": len(bundle.eval)}
    json.dumps(ident)


def test_snli_tokenizer_round_trip(snli_bundle, tmp_path):
    _, bundle = snli_bundle
    tok = bundle.tokenizer
    saved = tok.save(tmp_path / "tok")
    assert saved.name == "tokenizer.json"
    loaded = WordPieceTokenizer.load(tmp_path / "tok")
    premises = ["Two women are embracing while holding to go packages ."] * 2
    hypotheses = ["The sisters are hugging goodbye .", "Nobody is here ."]
    a = tok.encode_pairs(premises, hypotheses, seq_len=32)
    b = loaded.encode_pairs(premises, hypotheses, seq_len=32)
    for key in ("input_ids", "token_type_ids", "attention_mask"):
        assert torch.equal(a[key], b[key])
    assert loaded.sha256 == tok.sha256 and loaded.vocab_size == tok.vocab_size
    assert (loaded.pad_id, loaded.unk_id, loaded.cls_id, loaded.sep_id, loaded.mask_id) == (
        0,
        1,
        2,
        3,
        4,
    )
    assert loaded.decode(a["input_ids"][0]).startswith("two women are embracing")
    # truncation to a short length keeps [CLS] ... [SEP] ... [SEP]
    short = loaded.encode_pairs(premises, hypotheses, seq_len=8)["input_ids"]
    assert short.shape == (2, 8) and int((short[0] == loaded.sep_id).sum()) == 2


def test_snli_rebuild_with_saved_tokenizer_is_identical(snli_bundle):
    cfg, first = snli_bundle
    second = build_dataset(cfg)  # loads the tokenizer saved by the first build
    assert second.identity["notes"]["tokenizer_trained"] is False
    assert torch.equal(first.train.tensors["input_ids"], second.train.tensors["input_ids"])
    assert torch.equal(first.eval.tensors["labels"], second.eval.tensors["labels"])
    assert first.identity["fingerprint"] == second.identity["fingerprint"]  # same data
    assert first.identity["files"] == second.identity["files"]
    other_seed = build_dataset({**cfg, "seed": 1, "max_examples": 500, "max_eval_examples": 100})
    assert len(other_seed.train) == 500 and len(other_seed.eval) == 100
    assert other_seed.identity["fingerprint"] != first.identity["fingerprint"]


# --------------------------------------------------------------------------- code corpus


@pytest.fixture(scope="module")
def code_corpus():
    return cc.build_code_corpus(
        seq_len=64, seed=0, max_files=30, max_bytes=400_000, vocab_size=2000
    )


def test_stdlib_listing_skips_tests_and_site_packages():
    files = cc.list_stdlib_files()
    assert len(files) > 50
    root = cc.stdlib_root()
    for path in files:
        parts = path.relative_to(root).parts
        assert "site-packages" not in parts and "test" not in parts and path.suffix == ".py"


def test_code_corpus_split_by_file(code_corpus):
    train, evals = set(code_corpus.train_files), set(code_corpus.eval_files)
    assert train and evals and train.isdisjoint(evals)
    total = sum(p.stat().st_size for p in train | evals)
    assert total <= 400_000 and len(train | evals) <= 30
    again = cc.select_files(cc.list_stdlib_files(), seed=0, max_files=30, max_bytes=400_000)
    other = cc.select_files(cc.list_stdlib_files(), seed=1, max_files=30, max_bytes=400_000)
    assert set(again) == train | evals | set(code_corpus.skipped_files)
    assert set(other) != set(again)


def test_code_corpus_blocks(code_corpus):
    tok = code_corpus.tokenizer
    for split in (code_corpus.train, code_corpus.eval):
        ids, mask = split["input_ids"], split["attention_mask"]
        assert ids.shape[1] == 64 and ids.shape == mask.shape and ids.shape[0] > 0
        assert torch.all(ids[:, 0] == tok.cls_id)
        assert torch.equal(ids == tok.pad_id, mask == 0)
        assert int(ids.max()) < tok.vocab_size
        assert int(mask[:-1].sum()) == 64 * (ids.shape[0] - 1)  # only the last block is padded
    # case is kept for code
    assert tok.tokenize("return None") == ["return", "None"]


def _stdlib_texts(n: int) -> list[str]:
    files = cc.select_files(cc.list_stdlib_files(), seed=0, max_files=n)
    return [t for t in (cc.read_source(p) for p in files) if t]


def test_wordpiece_training_is_reproducible():
    """The same texts give the same vocabulary and ids, every time and in every process
    (``tokenizers``' own trainer numbers ``##`` pieces in hash order: measured, four
    trainings on these texts in one process gave four different vocabularies)."""
    texts = _stdlib_texts(8)
    toks = [WordPieceTokenizer.train(texts, vocab_size=400, lowercase=False) for _ in range(3)]
    assert len({t.sha256 for t in toks}) == 1
    assert all(t.encode_texts(texts[:2]) == toks[0].encode_texts(texts[:2]) for t in toks)
    code = ("import sys\nfrom tests.test_data import _stdlib_texts\n"
            "from comera_engine.data.tokenizer import WordPieceTokenizer\n"
            "print(WordPieceTokenizer.train(_stdlib_texts(8), vocab_size=400, "
            "lowercase=False).sha256)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == toks[0].sha256
    # the continuation pieces are ordinary vocabulary, not special tokens
    spec = json.loads(toks[0].backend.to_str())
    assert [t["content"] for t in spec["added_tokens"]] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]",
                                                           "[MASK]"]


def test_continuation_alphabet_matches_a_python_pass():
    """The ``##c`` pieces numbered up front are exactly those of a plain pass over the
    pre-tokenized words: every character that follows another in a word."""
    from comera_engine.data.tokenizer import continuation_alphabet

    texts = _stdlib_texts(6) + ["naïve café ÆON", "x"]
    tok = WordPieceTokenizer.train(texts, vocab_size=300, lowercase=True)
    backend = tok.backend
    inner = {c for t in texts
             for w, _ in backend.pre_tokenizer.pre_tokenize_str(backend.normalizer.normalize_str(t))
             for c in w[1:]}
    assert continuation_alphabet(backend, texts, 1000) == sorted(f"##{c}" for c in inner)
    vocab = backend.get_vocab()
    assert all(f"##{c}" in vocab for c in inner)


def test_chunk_blocks_layout():
    out = cc.chunk_blocks([[10, 11, 12], [13]], seq_len=4, cls_id=2, sep_id=3, pad_id=0)
    assert out["input_ids"].tolist() == [[2, 10, 11, 12], [2, 3, 13, 3]]
    out = cc.chunk_blocks([[10, 11, 12, 13]], seq_len=4, cls_id=2, sep_id=3, pad_id=0)
    assert out["input_ids"].tolist() == [[2, 10, 11, 12], [2, 13, 3, 0]]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]


def test_mlm_masking_rates_and_determinism(code_corpus):
    tok = code_corpus.tokenizer
    ids, mask = code_corpus.train["input_ids"], code_corpus.train["attention_mask"]
    g = torch.Generator().manual_seed(123)
    masked, labels = cc.mask_tokens(ids, mask, tok.vocab_size, tok.mask_id, tok.special_ids, g)
    special = torch.isin(ids, torch.tensor(tok.special_ids)) | (mask == 0)
    candidates = int((~special).sum())
    chosen = labels != -100
    assert candidates > 50_000
    assert not torch.any(chosen & special)
    assert abs(chosen.sum().item() / candidates - 0.15) < 0.01
    assert torch.equal(labels[chosen], ids[chosen])
    assert torch.equal(masked[~chosen], ids[~chosen])
    n = chosen.sum().item()
    to_mask = (masked[chosen] == tok.mask_id).sum().item() / n
    kept = (masked[chosen] == ids[chosen]).sum().item() / n
    replaced = 1 - to_mask - kept
    assert abs(to_mask - 0.8) < 0.02 and abs(kept - 0.1) < 0.02 and abs(replaced - 0.1) < 0.02
    assert int(masked[chosen].min()) >= 0 and int(masked.max()) < tok.vocab_size
    replaced_ids = masked[chosen & (masked != tok.mask_id) & (masked != ids)]
    assert int(replaced_ids.min()) > max(tok.special_ids)  # random ids are never special
    # same generator seed -> same masks; another seed -> different
    again = cc.mask_tokens(
        ids, mask, tok.vocab_size, tok.mask_id, tok.special_ids, torch.Generator().manual_seed(123)
    )
    other = cc.mask_tokens(
        ids, mask, tok.vocab_size, tok.mask_id, tok.special_ids, torch.Generator().manual_seed(124)
    )
    assert torch.equal(again[0], masked) and torch.equal(again[1], labels)
    assert not torch.equal(other[1], labels)


def test_code_mlm_bundle_and_collator(tmp_path):
    cfg = {
        "name": "code_mlm",
        "max_files": 12,
        "max_bytes": 200_000,
        "seq_len": 32,
        "vocab_size": 1000,
        "seed": 5,
        "tokenizer_path": str(tmp_path / "tok"),
    }
    bundle = build_dataset(cfg)
    assert (tmp_path / "tok" / "tokenizer.json").is_file()
    assert bundle.identity["notes"]["tokenizer_trained"] is True
    assert bundle.task == "mlm" and bundle.seq_len == 32 and bundle.num_classes is None
    train_files, eval_files = set(bundle.meta["train_files"]), set(bundle.meta["eval_files"])
    assert train_files and eval_files and train_files.isdisjoint(eval_files)
    manifest = bundle.identity.get("files_manifest") or {"count": len(bundle.identity["files"])}
    assert manifest["count"] == len(train_files) + len(eval_files)
    assert bundle.identity["extra"]["python_version"] == ".".join(map(str, sys.version_info[:3]))

    def batches(seed):
        bundle.collate_fn.reseed(seed)
        loader = torch.utils.data.DataLoader(
            bundle.train, batch_size=16, collate_fn=bundle.collate_fn
        )
        return [next(iter(loader)) for _ in range(2)]

    first, second = batches(0), batches(0)
    for a, b in zip(first, second):
        assert set(a) == {"input_ids", "attention_mask", "labels"}
        assert a["input_ids"].shape == (16, 32) and a["labels"].shape == (16, 32)
        assert torch.equal(a["labels"], b["labels"]) and torch.equal(a["input_ids"], b["input_ids"])
    assert not torch.equal(first[0]["labels"], first[1]["labels"])  # fresh masks each batch
    # eval is masked once and fixed: labels stored with the data
    ev = bundle.eval.tensors
    assert set(ev) == {"input_ids", "attention_mask", "labels"}
    rebuilt = build_dataset(cfg)  # reuses the saved tokenizer -> identical data and masks
    assert rebuilt.identity["notes"]["tokenizer_trained"] is False
    assert torch.equal(rebuilt.eval.tensors["labels"], ev["labels"])
    assert torch.equal(rebuilt.train.tensors["input_ids"], bundle.train.tensors["input_ids"])
    assert rebuilt.identity["fingerprint"] == bundle.identity["fingerprint"]
    share = (ev["labels"] != -100).sum() / (ev["attention_mask"].sum() - 2 * len(bundle.eval))
    assert 0.10 < float(share) < 0.20


# --------------------------------------------------------------------------- clicks


def _criteo_line(label, ints, cats) -> str:
    return "\t".join([str(label), *ints, *cats])


def test_criteo_tsv_parsing_with_missing_values(tmp_path):
    ints_a = ["3", "", "-1", "0", "10", "", "7", "1", "2", "", "5", "100", "0"]
    cats_a = ["68fd1e64", "", "0a519c5c"] + ["1a2b3c4d"] * 23
    ints_b = [""] * 13
    cats_b = [""] * 26
    lines = [
        _criteo_line(1, ints_a, cats_a),
        _criteo_line(0, ints_b, cats_b),
        "garbage line with no tabs",
        _criteo_line(2, ints_a, cats_a),  # bad label
        _criteo_line(0, ["x"] + ints_a[1:], cats_a),  # bad integer
        "",
    ]
    path = tmp_path / "day_0.tsv"
    path.write_text("\n".join(lines), encoding="utf-8")
    sizes = [1000, 50, 7] + [10] * 23
    data, stats = clk.read_criteo_tsv(path, sizes)
    assert len(data) == 2 and stats.rows == 2 and stats.malformed == 3
    assert stats.first_malformed_line == 3
    assert data.labels.tolist() == [1.0, 0.0] and data.labels.dtype == torch.float32
    assert data.dense.shape == (2, 13) and data.sparse.shape == (2, 26)
    expected = [math.log1p(max(float(v), 0.0)) if v else 0.0 for v in ints_a]
    assert torch.allclose(data.dense[0], torch.tensor(expected, dtype=torch.float32))
    assert torch.all(data.dense[1] == 0)
    assert int(data.sparse[0, 0]) == 1 + int("68fd1e64", 16) % 999
    assert int(data.sparse[0, 1]) == 0  # missing -> bucket 0
    assert int(data.sparse[0, 2]) == 1 + int("0a519c5c", 16) % 6
    assert torch.all(data.sparse[1] == 0)
    assert torch.all(data.sparse < torch.tensor(sizes))
    assert stats.missing_dense == pytest.approx((3 + 13) / 26)
    assert stats.missing_sparse == pytest.approx((1 + 26) / 52)
    assert clk.hash_category("not-hex!", 10) == clk.hash_category("not-hex!", 10) != 0


def test_synthetic_clicks_tsv_round_trip(tmp_path):
    synth = clk.generate_synthetic_clicks(500, bucket_sizes=40, seed=3, missing_rate=0.1)
    assert synth.dense_missing.any() and (synth.data.sparse == 0).any()
    path = synth.write_tsv(tmp_path / "synth.tsv")
    back, stats = clk.read_criteo_tsv(path, synth.bucket_sizes)
    assert stats.malformed == 0 and len(back) == 500
    assert torch.equal(back.sparse, synth.data.sparse)
    assert torch.equal(back.labels, synth.data.labels)
    assert torch.allclose(back.dense, synth.data.dense)
    assert 0.05 < stats.missing_dense < 0.15


def test_synthetic_clicks_deterministic_and_near_base_rate():
    a = clk.generate_synthetic_clicks(4000, seed=7)
    b = clk.generate_synthetic_clicks(4000, seed=7)
    c = clk.generate_synthetic_clicks(4000, seed=8)
    assert torch.equal(a.data.sparse, b.data.sparse) and torch.equal(a.data.labels, b.data.labels)
    assert not torch.equal(a.data.labels, c.data.labels)
    assert abs(float(a.data.labels.mean()) - 0.25) < 0.03
    assert abs(a.probability.mean() - 0.25) < 1e-3


def test_synthetic_planted_structure_is_learnable(one_thread):
    """A small factorisation machine beats the base rate clearly on held-out clicks."""
    torch.manual_seed(0)
    bundle = build_dataset({"name": "clicks_synthetic", "num_samples": 20000, "bucket_sizes": 30})
    train, evals = bundle.train.tensors, bundle.eval.tensors
    sizes = bundle.meta["bucket_sizes"]
    offsets = torch.tensor([0, *np.cumsum(sizes)[:-1].tolist()])
    emb = torch.nn.Embedding(sum(sizes), 4)
    lin = torch.nn.Embedding(sum(sizes), 1)
    dense = torch.nn.Linear(13, 1)
    torch.nn.init.normal_(emb.weight, std=0.1)
    torch.nn.init.zeros_(lin.weight)
    params = [*emb.parameters(), *lin.parameters(), *dense.parameters()]
    opt = torch.optim.Adam(params, lr=0.01)

    def forward(batch):
        e = emb(batch["sparse"] + offsets)  # [B, 26, 4]
        pairwise = 0.5 * (e.sum(1).pow(2) - e.pow(2).sum(1)).sum(1)
        linear = lin(batch["sparse"] + offsets).sum((1, 2)) + dense(batch["dense"])[:, 0]
        return pairwise + linear, e

    n = len(bundle.train)
    for _ in range(4):
        for idx in torch.randperm(n).split(512):
            batch = {k: v[idx] for k, v in train.items()}
            logits, e = forward(batch)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch["labels"])
            loss = loss + 3e-3 * e.pow(2).sum((1, 2)).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    with torch.no_grad():
        prob = torch.sigmoid(forward(evals)[0]).double().numpy()
    y = evals["labels"].double().numpy()
    rate = float(train["labels"].mean())
    base_ll = -np.mean(y * np.log(rate) + (1 - y) * np.log(1 - rate))
    model_ll = -np.mean(y * np.log(prob + 1e-12) + (1 - y) * np.log(1 - prob + 1e-12))
    assert _auc(bundle.meta["eval_probability"].numpy(), y) > 0.85  # the planted signal is strong
    assert _auc(prob, y) > 0.75
    assert model_ll < base_ll - 0.08, (model_ll, base_ll)


def test_clicks_bundle_from_tsv_files(tmp_path):
    clk.generate_synthetic_clicks(300, bucket_sizes=20, seed=1).write_tsv(tmp_path / "train.tsv")
    clk.generate_synthetic_clicks(100, bucket_sizes=20, seed=2).write_tsv(tmp_path / "test.tsv")
    bundle = build_dataset(
        {"name": "clicks", "path": "train.tsv", "eval_path": "test.tsv", "bucket_sizes": 20},
        base_dir=tmp_path,
    )
    assert bundle.task == "ctr" and bundle.num_classes == 2
    assert len(bundle.train) == 300 and len(bundle.eval) == 100
    assert bundle.meta["bucket_sizes"] == [20] * 26 and bundle.meta["num_dense"] == 13
    item = bundle.train[0]
    assert item["dense"].shape == (13,) and item["sparse"].shape == (26,)
    split = build_dataset({"name": "clicks", "path": str(tmp_path / "train.tsv"), "max_rows": 200})
    assert len(split.train) == 160 and len(split.eval) == 40


# --------------------------------------------------------------------------- identity


def test_identity_hash_changes_with_file_content(tmp_path):
    path = tmp_path / "d.jsonl"
    _write_jsonl(path, _nli_rows(9))
    ident1 = dataset_identity("nli", "files", {"train": 7, "eval": 2}, 0, files=[path])
    path.write_text(path.read_text() + '{"premise": "p", "hypothesis": "h", "label": 0}\n')
    ident2 = dataset_identity("nli", "files", {"train": 7, "eval": 2}, 0, files=[path])
    assert ident1["files"][0]["sha256"] != ident2["files"][0]["sha256"]
    assert ident1["files"][0]["bytes"] < ident2["files"][0]["bytes"]
    assert ident1["fingerprint"] != ident2["fingerprint"]
    # same bytes elsewhere -> same fingerprint; another seed -> another fingerprint
    copy = tmp_path / "sub"
    copy.mkdir()
    (copy / "d.jsonl").write_bytes(path.read_bytes())
    ident3 = dataset_identity("nli", "files", {"train": 7, "eval": 2}, 0, files=[copy / "d.jsonl"])
    assert ident3["fingerprint"] == ident2["fingerprint"]
    ident4 = dataset_identity("nli", "files", {"train": 7, "eval": 2}, 1, files=[path])
    assert ident4["fingerprint"] != ident2["fingerprint"]
    json.dumps(ident4)


def test_identity_manifest_for_many_files(tmp_path):
    paths = []
    for i in range(5):
        paths.append(tmp_path / f"f{i}.py")
        paths[-1].write_text(f"x = {i}\n")
    ident = dataset_identity(
        "code_mlm", "files", {"train": 1}, 0, files=paths, root=tmp_path, max_listed_files=3
    )
    assert "files" not in ident and ident["files_manifest"]["count"] == 5
    assert ident["files_manifest"]["total_bytes"] == sum(p.stat().st_size for p in paths)
    paths[0].write_text("x = 42\n")
    again = dataset_identity(
        "code_mlm", "files", {"train": 1}, 0, files=paths, root=tmp_path, max_listed_files=3
    )
    assert again["files_manifest"]["sha256"] != ident["files_manifest"]["sha256"]


def test_bundle_identity_follows_data_file(tmp_path):
    path = tmp_path / "c.tsv"
    clk.generate_synthetic_clicks(50, bucket_sizes=10, seed=0).write_tsv(path)
    first = build_dataset({"name": "clicks", "path": str(path), "bucket_sizes": 10})
    clk.generate_synthetic_clicks(50, bucket_sizes=10, seed=1).write_tsv(path)
    second = build_dataset({"name": "clicks", "path": str(path), "bucket_sizes": 10})
    assert first.identity["files"][0]["sha256"] != second.identity["files"][0]["sha256"]
    assert first.identity["fingerprint"] != second.identity["fingerprint"]


# --------------------------------------------------------------------------- config errors


def _error_cases(tmp_path: Path):
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"premise": "a", "hypothesis": "b", "label": 0}\n{not json\n')
    no_labels = tmp_path / "dash.jsonl"
    no_labels.write_text('{"premise": "a", "hypothesis": "b", "label": "-"}\n')
    no_cols = tmp_path / "cols.tsv"
    no_cols.write_text("a\tb\tc\n1\t2\t3\n")
    odd = tmp_path / "data.csv"
    odd.write_text("premise,hypothesis,label\n")
    garbage = tmp_path / "garbage.tsv"
    garbage.write_text("this is not criteo\n")
    return [
        ({}, "data.name", "choose one of"),
        ({"name": "imagenet"}, "data.name", "unknown dataset 'imagenet'"),
        (
            {"name": "snli", "path": "nope/x.jsonl"},
            "data.path",
            "file not found: nope/x.jsonl (give an existing GLUE TSV, jsonl or parquet file)",
        ),
        ({"name": "snli"}, "data.path", "data.hub = true"),
        ({"name": "nli", "path": str(bad_json)}, "data.path", "line 2 is not valid JSON"),
        ({"name": "nli", "path": str(no_labels)}, "data.path", "no examples with a known label"),
        ({"name": "nli", "path": str(no_cols)}, "data.path", "no column 'sentence1'"),
        ({"name": "nli", "path": str(odd)}, "data.path", "cannot tell the format"),
        ({"name": "nli", "path": str(odd), "format": "csv"}, "data.format", "unknown format"),
        ({"name": "nli", "hub": True}, "data.hub", "hub loading exists for"),
        ({"name": "mnli", "hub": True, "path": "x.tsv"}, "data.hub", "not both"),
        ({"name": "mnli", "hub": "yes"}, "data.hub", "true or false"),
        ({"name": "digits", "split_fraction": 1.5}, "data.split_fraction", "(0.0, 1.0)"),
        ({"name": "digits", "seed": "zero"}, "data.seed", "integer"),
        ({"name": "digits", "seqlen": 3}, "data.seqlen", "unknown key"),
        ({"name": "snli", "path": str(no_labels), "seq_len": 2}, "data.seq_len", ">= 4"),
        (
            {"name": "clicks", "path": str(garbage), "bucket_sizes": 10},
            "data.path",
            "no valid rows",
        ),
        (
            {"name": "clicks", "path": str(garbage), "bucket_sizes": [10, 10]},
            "data.bucket_sizes",
            "need 26 counts",
        ),
        ({"name": "clicks_synthetic", "bucket_sizes": 0}, "data.bucket_sizes", ">= 1"),
        (
            {"name": "clicks_synthetic", "planted_features": [3]},
            "data.planted_features",
            "at least 2 distinct",
        ),
        ({"name": "code_mlm", "max_files": 1}, "data.max_files", ">= 2"),
        ({"name": "code_mlm", "root": str(tmp_path / "missing")}, "data.root", "folder not found"),
    ]


def test_bad_inputs_raise_config_error_naming_the_field(tmp_path):
    for cfg, field, text in _error_cases(tmp_path):
        with pytest.raises(ConfigError) as info:
            build_dataset(cfg, base_dir=tmp_path)
        err = info.value
        assert isinstance(err, ValueError)
        assert err.field == field, (cfg, str(err))
        assert str(err).startswith(f"{field}: ") and text in str(err), (cfg, str(err))
    with pytest.raises(ConfigError, match=r"^data: must be a table"):
        build_dataset(["digits"])  # type: ignore[arg-type]


def test_bad_tokenizer_file_is_a_config_error(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text("{not a tokenizer")
    cfg = {"name": "nli", "path": "t.tsv", "tokenizer_path": str(path)}
    _write_glue_tsv(tmp_path / "t.tsv", _nli_rows(10))
    with pytest.raises(ConfigError, match=r"^data\.tokenizer_path: cannot load tokenizer"):
        build_dataset(cfg, base_dir=tmp_path)


# ---------------------------------------------------------------------- registry


def test_registry_is_torch_free_and_lists_a_dataset_for_every_model() -> None:
    code = (
        "import importlib.abc, sys\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'numpy'):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from comera_engine.data.registry import dataset_names\n"
        "print(','.join(dataset_names('tt_mlp')), ','.join(dataset_names('dlrm')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["digits", "clicks,clicks_synthetic,clicks_criteo,movielens,adult"]
    from comera_engine.config import TT_LAYER_KINDS
    from comera_engine.data.registry import dataset_names

    assert all(dataset_names(model) for model in TT_LAYER_KINDS)


@pytest.mark.parametrize("name", ["digits", "snli", "code_mlm", "clicks", "clicks_synthetic",
                                  "clicks_criteo"])
def test_registry_defaults_are_the_keys_each_builder_accepts(name: str) -> None:
    """A builder refuses a key that is not among its registered defaults, and names
    every registered key as a choice: the registry is the one list of keys."""
    from comera_engine.data.registry import dataset_info

    info = dataset_info(name)
    with pytest.raises(ConfigError, match=r"^data\.no_such_key") as exc:
        build_dataset({"name": name, "no_such_key": 1})
    assert all(key in str(exc.value) for key in info.defaults), str(exc.value)


def test_registry_refuses_unknown_names_and_takes_plugins() -> None:
    from comera_engine.data import registry

    with pytest.raises(ConfigError, match=r"^data\.name: unknown dataset 'nope'; choose one"):
        build_dataset({"name": "nope"})
    seen = []

    def build(cfg, base_dir):  # noqa: ANN001, ANN202
        seen.append((dict(cfg), base_dir))
        return "bundle"

    registry.register(registry.DatasetInfo("plugin_x", "classification", ("tt_mlp",),
                                           "a test plug-in", build, {"size": 3}))
    try:
        assert "plugin_x" in registry.dataset_names("tt_mlp")
        assert build_dataset({"name": "plugin_x", "size": 5}, "/tmp") == "bundle"
        assert seen == [({"name": "plugin_x", "size": 5}, "/tmp")]
    finally:
        registry._REGISTRY.pop("plugin_x")


def test_digits_read_from_the_wheel_equal_sklearns_loader() -> None:
    """The digits file read without importing scikit-learn gives exactly what
    ``sklearn.datasets.load_digits`` gives."""
    from sklearn.datasets import load_digits

    from comera_engine.data.digits import read_digits

    pixels, labels = read_digits()
    ref = load_digits()
    assert pixels.shape == (1797, 64) and labels.dtype == np.int64
    np.testing.assert_array_equal(pixels, ref.data)
    np.testing.assert_array_equal(labels, ref.target)


@pytest.mark.parametrize("suffix,text", [
    (".tsv", "root:x:0:0:SECRET-LINE:/root:/bin/bash\nbin:x:1:1::/bin:/usr/sbin/nologin\n"),
    (".jsonl", "SECRET-LINE is not json\n"),
    (".jsonl", '["SECRET-LINE"]\n'),
])
def test_a_data_format_error_names_the_file_and_line_never_its_contents(
        tmp_path: Path, suffix: str, text: str) -> None:
    """Pointed at any file (say a copy of /etc/passwd), the error says which file and
    line is wrong and how many columns it found, without quoting the file."""
    from comera_engine.data import build_dataset

    path = tmp_path / f"notes{suffix}"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        build_dataset({"name": "snli", "path": str(path)})
    message = str(info.value)
    assert message.startswith("data.path: ") and f"notes{suffix}" in message
    assert "SECRET" not in message and "root" not in message and "\n" not in message


def test_an_export_without_comera_metadata_does_not_echo_its_keys(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from comera_engine.export.container import read_comera_metadata, read_header

    path = tmp_path / "other.safetensors"
    save_file({"w": torch.zeros(2)}, str(path), metadata={"SECRET-KEY": "v", "b": "w"})
    with pytest.raises(ConfigError) as info:
        read_comera_metadata(read_header(path))
    assert "SECRET" not in str(info.value) and "2 other entries" in str(info.value)
