"""One builder per dataset name: validate the config dict, load, split, wrap in a DataBundle.

Every builder takes ``(cfg, base_dir)`` and raises ``ConfigError("data.<field>", ...)`` on
bad input. Optional libraries (``datasets``, ``tokenizers``, ``sklearn``, ``pyarrow``) are
imported only inside the functions that use them.
"""

from __future__ import annotations

import platform
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from comera_engine.data.base import (
    DataBundle,
    TensorDictDataset,
    check_keys,
    field_name,
    get_bool,
    get_existing_file,
    get_float,
    get_int,
    get_optional_int,
    get_str,
    resolve_path,
    seeded_subset,
    split_indices,
)
from comera_engine.data.identity import content_sha256, dataset_identity
from comera_engine.errors import ConfigError

BaseDir = str | Path | None


def _missing_package(key: str, package: str, what: str) -> ConfigError:
    """ConfigError for an optional dependency that is not installed."""
    return ConfigError(
        field_name(key), f"{what} needs the '{package}' package (pip install {package})"
    )


# --------------------------------------------------------------------------- digits


def build_digits(cfg: Mapping[str, Any], base_dir: BaseDir = None) -> DataBundle:
    """sklearn 8x8 digits: items ``{"x": float32 [64], "labels": int64}``, 10 classes."""
    check_keys(cfg, ("seed", "split_fraction"))
    seed = get_int(cfg, "seed", 0)
    fraction = get_float(cfg, "split_fraction", 0.8, 0.0, 1.0)
    try:
        import sklearn

        from comera_engine.data.digits import load_digits_split

        split = load_digits_split(test_fraction=1.0 - fraction, seed=seed)
    except ImportError as exc:
        raise _missing_package("name", "scikit-learn", "digits") from exc
    train = TensorDictDataset({"x": split.x_train, "labels": split.y_train})
    test = TensorDictDataset({"x": split.x_test, "labels": split.y_test})
    identity = dataset_identity(
        "digits",
        "sklearn:load_digits",
        {"train": len(train), "eval": len(test)},
        seed,
        params={"split_fraction": fraction, "normalisation": "x/16 then train z-score"},
        extra={
            "sklearn_version": sklearn.__version__,
            "content_sha256": content_sha256(
                split.x_train, split.y_train, split.x_test, split.y_test
            ),
        },
    )
    return DataBundle(
        name="digits",
        task="classification",
        train=train,
        eval=test,
        identity=identity,
        num_classes=10,
        meta={"input_dim": 64, "image_shape": (8, 8), "mean": split.mean, "std": split.std},
    )


# --------------------------------------------------------------------------- NLI

_NLI_KEYS = (
    "path",
    "eval_path",
    "format",
    "hub",
    "hub_name",
    "train_split",
    "eval_split",
    "cache_dir",
    "seq_len",
    "vocab_size",
    "min_frequency",
    "lowercase",
    "split_fraction",
    "seed",
    "max_examples",
    "max_eval_examples",
    "tokenizer_path",
)


def _read_nli(cfg: Mapping[str, Any], key: str, base_dir: BaseDir) -> tuple[Any, Path]:
    """Read the NLI file named by ``cfg[key]``; errors become ``ConfigError(data.<key>)``."""
    from comera_engine.data import nli

    help_text = nli.FILE_HELP
    path = get_existing_file(cfg, key, base_dir, help_text)
    fmt = get_str(cfg, "format", None)
    if fmt is not None and fmt not in nli.FILE_FORMATS:
        raise ConfigError(
            field_name("format"),
            f"unknown format '{fmt}' (use one of {', '.join(nli.FILE_FORMATS)})",
        )
    fmt = fmt or nli.detect_format(path)
    if fmt is None:
        raise ConfigError(
            field_name(key),
            f"cannot tell the format of {path.name} (use a .tsv, .jsonl or .parquet suffix "
            "or set data.format)",
        )
    try:
        examples = nli.read_nli_file(path, fmt)
    except ImportError as exc:
        raise _missing_package(key, "pyarrow", "reading parquet") from exc
    except (nli.NLIFormatError, UnicodeDecodeError) as exc:
        raise ConfigError(field_name(key), f"{exc} (give {help_text})") from None
    if len(examples) == 0:
        raise ConfigError(
            field_name(key),
            f"no examples with a known label (entailment/neutral/contradiction) in {path.name} "
            f"({examples.dropped} rows dropped); give {help_text}",
        )
    return examples, path


def build_nli(cfg: Mapping[str, Any], base_dir: BaseDir = None) -> DataBundle:
    """MNLI / SNLI / any NLI file: items ``input_ids``, ``token_type_ids``,
    ``attention_mask`` int64 [seq_len] and ``labels`` int64 (0/1/2)."""
    from comera_engine.data import nli

    name = str(cfg["name"])
    check_keys(cfg, _NLI_KEYS)
    seed = get_int(cfg, "seed", 0)
    seq_len = get_int(cfg, "seq_len", 128, minimum=4)
    vocab_size = get_int(cfg, "vocab_size", 8000, minimum=64)
    min_frequency = get_int(cfg, "min_frequency", 2, minimum=1)
    lowercase = get_bool(cfg, "lowercase", True)
    fraction = get_float(cfg, "split_fraction", 0.8, 0.0, 1.0)
    max_train = get_optional_int(cfg, "max_examples")
    max_eval = get_optional_int(cfg, "max_eval_examples")
    use_hub = get_bool(cfg, "hub", False)

    if use_hub:
        train_ex, eval_ex, info = _load_hub(cfg, name)
        source = f"hub:{info['hub']}" + (f"/{info['config']}" if info["config"] else "")
        files: list[Path] = []
    else:
        train_ex, eval_ex, files, info = _nli_from_files(cfg, name, base_dir, fraction, seed)
        source = "files"
    train_ex = train_ex.subset(seeded_subset(len(train_ex), max_train, seed))
    eval_ex = eval_ex.subset(seeded_subset(len(eval_ex), max_eval, seed + 1))

    tok_path = _tokenizer_path(cfg, base_dir)
    tokenizer = _load_existing_tokenizer(tok_path)
    trained = tokenizer is None
    if tokenizer is None:
        tokenizer = _train_tokenizer(nli.pair_texts(train_ex), vocab_size, min_frequency, lowercase)
        if tok_path is not None:
            tokenizer.save(tok_path)

    train = _encode_nli(tokenizer, train_ex, seq_len)
    evals = _encode_nli(tokenizer, eval_ex, seq_len)
    identity = dataset_identity(
        name,
        source,
        {"train": len(train), "eval": len(evals)},
        seed,
        files=files,
        params={
            "seq_len": seq_len,
            "vocab_size": vocab_size,
            "min_frequency": min_frequency,
            "lowercase": lowercase,
            "split_fraction": None if (use_hub or cfg.get("eval_path")) else fraction,
            "max_examples": max_train,
            "max_eval_examples": max_eval,
        },
        extra={
            **info,
            "label_counts": {"train": train_ex.label_counts(), "eval": eval_ex.label_counts()},
            "tokenizer_sha256": tokenizer.sha256,
            "tokenizer_vocab_size": tokenizer.vocab_size,
            "truncated_fraction": _full_fraction(train.tensors["attention_mask"]),
        },
        notes={
            "tokenizer_trained": trained,
            "tokenizer_path": str(tok_path) if tok_path else None,
        },
    )
    return DataBundle(
        name=name,
        task="nli",
        train=train,
        eval=evals,
        identity=identity,
        num_classes=3,
        vocab_size=tokenizer.vocab_size,
        seq_len=seq_len,
        tokenizer=tokenizer,
        meta={
            "label_names": list(nli.LABEL_NAMES),
            "pad_id": tokenizer.pad_id,
            "cls_id": tokenizer.cls_id,
            "sep_id": tokenizer.sep_id,
            "mask_id": tokenizer.mask_id,
            "type_vocab_size": 2,
        },
    )


def _nli_from_files(
    cfg: Mapping[str, Any], name: str, base_dir: BaseDir, fraction: float, seed: int
) -> tuple[Any, Any, list[Path], dict[str, Any]]:
    """``(train, eval, files, info)`` from ``data.path`` (split by seed) or + ``eval_path``."""
    from comera_engine.data import nli

    if cfg.get("path") is None:
        hint = f", or set data.hub = true to download {name}" if name in nli.HUB_DEFAULTS else ""
        raise ConfigError(field_name("path"), f"missing; give {nli.FILE_HELP}{hint}")
    examples, path = _read_nli(cfg, "path", base_dir)
    info: dict[str, Any] = {"dropped": examples.dropped}
    if cfg.get("eval_path") is not None:
        eval_ex, eval_path = _read_nli(cfg, "eval_path", base_dir)
        info["eval_dropped"] = eval_ex.dropped
        return examples, eval_ex, [path, eval_path], info
    if len(examples) < 2:
        raise ConfigError(field_name("path"), "need at least 2 labelled examples to split")
    train_idx, eval_idx = split_indices(len(examples), fraction, seed)
    return examples.subset(train_idx), examples.subset(eval_idx), [path], info


def _train_tokenizer(texts: Any, vocab_size: int, min_frequency: int, lowercase: bool) -> Any:
    """Train a ``WordPieceTokenizer`` (ConfigError if ``tokenizers`` is missing)."""
    try:
        from comera_engine.data.tokenizer import WordPieceTokenizer

        return WordPieceTokenizer.train(texts, vocab_size, min_frequency, lowercase)
    except ImportError as exc:
        raise _missing_package("vocab_size", "tokenizers", "the WordPiece tokenizer") from exc


def _load_hub(cfg: Mapping[str, Any], name: str) -> tuple[Any, Any, dict[str, Any]]:
    """Hub download with config-level errors (missing package, network, unknown split)."""
    from comera_engine.data import nli

    if cfg.get("path") is not None:
        raise ConfigError(field_name("hub"), "give either data.path or data.hub = true, not both")
    if name not in nli.HUB_DEFAULTS:
        raise ConfigError(
            field_name("hub"),
            f"hub loading exists for {', '.join(nli.HUB_DEFAULTS)}, not '{name}'; "
            "set data.name to one of those or give data.path",
        )
    try:
        train_ex, eval_ex, info = nli.load_nli_hub(
            name,
            hub_name=get_str(cfg, "hub_name", None),
            train_split=get_str(cfg, "train_split", None),
            eval_split=get_str(cfg, "eval_split", None),
            cache_dir=get_str(cfg, "cache_dir", None),
        )
    except ImportError as exc:
        raise _missing_package("hub", "datasets", "hub loading") from exc
    except Exception as exc:  # network, unknown dataset or split: report as a config problem
        raise ConfigError(
            field_name("hub"),
            f"could not load {name} from the Hugging Face hub ({type(exc).__name__}: {exc}); "
            "check the network / data.hub_name / split names, or give data.path",
        ) from exc
    if len(train_ex) == 0 or len(eval_ex) == 0:
        raise ConfigError(field_name("hub"), f"{name}: a split has no labelled examples")
    return train_ex, eval_ex, info


def _tokenizer_path(cfg: Mapping[str, Any], base_dir: BaseDir) -> Path | None:
    """Resolved ``data.tokenizer_path`` or ``None``."""
    raw = get_str(cfg, "tokenizer_path", None)
    return resolve_path(raw, base_dir) if raw is not None else None


def _load_existing_tokenizer(path: Path | None) -> Any:
    """The tokenizer saved at ``path`` (file or folder), or ``None`` if there is none yet."""
    if path is None:
        return None
    try:
        from comera_engine.data.tokenizer import TOKENIZER_FILE, WordPieceTokenizer

        if path.is_file() or (path / TOKENIZER_FILE).is_file():
            return WordPieceTokenizer.load(path)
    except ImportError as exc:
        raise _missing_package("tokenizer_path", "tokenizers", "the WordPiece tokenizer") from exc
    except Exception as exc:  # corrupt json, wrong special tokens
        raise ConfigError(
            field_name("tokenizer_path"),
            f"cannot load tokenizer {path} ({exc}); delete it or point elsewhere to retrain",
        ) from None
    return None


def _encode_nli(tokenizer: Any, examples: Any, seq_len: int) -> TensorDictDataset:
    """Encode pairs to [n, seq_len] tensors plus ``labels`` [n]."""
    enc = tokenizer.encode_pairs(examples.premises, examples.hypotheses, seq_len)
    enc["labels"] = torch.tensor(examples.labels, dtype=torch.long)
    return TensorDictDataset(enc)


def _full_fraction(attention_mask: torch.Tensor) -> float:
    """Fraction of rows that fill every position (likely truncated)."""
    if attention_mask.shape[0] == 0:
        return 0.0
    return float(attention_mask.bool().all(dim=1).float().mean())


# --------------------------------------------------------------------------- code MLM

_CODE_KEYS = (
    "seq_len",
    "seed",
    "max_files",
    "max_bytes",
    "split_fraction",
    "vocab_size",
    "min_frequency",
    "mlm_probability",
    "tokenizer_path",
    "root",
)


def build_code_mlm(cfg: Mapping[str, Any], base_dir: BaseDir = None) -> DataBundle:
    """Stdlib code masked-LM: train items ``input_ids``/``attention_mask`` [seq_len]
    (masked by ``collate_fn``); eval items also carry fixed ``labels`` [seq_len]."""
    from comera_engine.data import code_corpus as cc

    check_keys(cfg, _CODE_KEYS)
    seed = get_int(cfg, "seed", 0)
    seq_len = get_int(cfg, "seq_len", 128, minimum=8)
    max_files = get_optional_int(cfg, "max_files", minimum=2)
    max_files = 200 if "max_files" not in cfg else max_files
    max_bytes = get_optional_int(cfg, "max_bytes", minimum=1)
    fraction = get_float(cfg, "split_fraction", 0.9, 0.0, 1.0)
    vocab_size = get_int(cfg, "vocab_size", 8000, minimum=64)
    min_frequency = get_int(cfg, "min_frequency", 2, minimum=1)
    mlm_probability = get_float(cfg, "mlm_probability", 0.15, 0.0, 1.0)
    root = cc.stdlib_root()
    if cfg.get("root") is not None:
        root = resolve_path(str(get_str(cfg, "root", None)), base_dir)
        if not root.is_dir():
            raise ConfigError(
                field_name("root"), f"folder not found: {cfg['root']} (give a folder of .py files)"
            )
    tok_path = _tokenizer_path(cfg, base_dir)
    tokenizer = _load_existing_tokenizer(tok_path)
    trained = tokenizer is None
    try:
        corpus = cc.build_code_corpus(
            seq_len=seq_len,
            seed=seed,
            max_files=max_files,
            max_bytes=max_bytes,
            eval_fraction=1.0 - fraction,
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            tokenizer=tokenizer,
            root=root,
        )
    except ImportError as exc:
        raise _missing_package("vocab_size", "tokenizers", "the WordPiece tokenizer") from exc
    except ValueError as exc:
        raise ConfigError(
            field_name("max_files"),
            f"{exc}; raise data.max_files / data.max_bytes so that at least 2 files are used",
        ) from None
    if trained and tok_path is not None:
        corpus.tokenizer.save(tok_path)
    tok = corpus.tokenizer
    eval_gen = torch.Generator().manual_seed(seed + 1_000_003)
    eval_ids, eval_labels = cc.mask_tokens(
        corpus.eval["input_ids"],
        corpus.eval["attention_mask"],
        tok.vocab_size,
        tok.mask_id,
        tok.special_ids,
        eval_gen,
        mlm_probability,
    )
    train = TensorDictDataset(corpus.train)
    evals = TensorDictDataset(
        {
            "input_ids": eval_ids,
            "attention_mask": corpus.eval["attention_mask"],
            "labels": eval_labels,
        }
    )
    rel = lambda paths: [p.relative_to(corpus.root).as_posix() for p in paths]
    identity = dataset_identity(
        "code_mlm",
        "stdlib" if cfg.get("root") is None else "files",
        {"train": len(train), "eval": len(evals)},
        seed,
        files=corpus.train_files + corpus.eval_files,
        root=corpus.root,
        params={
            "seq_len": seq_len,
            "max_files": max_files,
            "max_bytes": max_bytes,
            "split_fraction": fraction,
            "vocab_size": vocab_size,
            "min_frequency": min_frequency,
            "mlm_probability": mlm_probability,
        },
        extra={
            "python_version": platform.python_version(),
            "num_files": {"train": len(corpus.train_files), "eval": len(corpus.eval_files)},
            "skipped_files": rel(corpus.skipped_files),
            "train_tokens": int(corpus.train["attention_mask"].sum()),
            "tokenizer_sha256": tok.sha256,
            "tokenizer_vocab_size": tok.vocab_size,
            "eval_mask_seed": seed + 1_000_003,
        },
        notes={
            "tokenizer_trained": trained,
            "tokenizer_path": str(tok_path) if tok_path else None,
        },
    )
    return DataBundle(
        name="code_mlm",
        task="mlm",
        train=train,
        eval=evals,
        identity=identity,
        num_classes=None,
        vocab_size=tok.vocab_size,
        seq_len=seq_len,
        tokenizer=tok,
        collate_fn=cc.MLMCollator(
            tok.vocab_size, tok.mask_id, tok.special_ids, seed, mlm_probability
        ),
        meta={
            "pad_id": tok.pad_id,
            "cls_id": tok.cls_id,
            "sep_id": tok.sep_id,
            "mask_id": tok.mask_id,
            "special_ids": list(tok.special_ids),
            "mlm_probability": mlm_probability,
            "train_files": rel(corpus.train_files),
            "eval_files": rel(corpus.eval_files),
        },
    )


# --------------------------------------------------------------------------- clicks

_CLICK_FILE_HELP = "an existing Criteo TSV (label, 13 integer and 26 categorical fields per line)"


def _bucket_sizes(cfg: Mapping[str, Any], default: int) -> list[int]:
    """``data.bucket_sizes`` (an int or 26 ints) as a list of 26 counts."""
    from comera_engine.data.clicks import NUM_SPARSE, normalise_bucket_sizes

    raw = cfg.get("bucket_sizes", default)
    ok_int = isinstance(raw, int) and not isinstance(raw, bool)
    ok_list = isinstance(raw, (list, tuple)) and all(
        isinstance(b, int) and not isinstance(b, bool) for b in raw
    )
    if not (ok_int or ok_list):
        raise ConfigError(
            field_name("bucket_sizes"),
            f"must be an integer or a list of {NUM_SPARSE} integers, got {raw!r}",
        )
    try:
        return normalise_bucket_sizes(raw)
    except ValueError as exc:
        raise ConfigError(field_name("bucket_sizes"), str(exc).split(": ", 1)[1]) from None


def _click_meta(sizes: list[int], train_labels: torch.Tensor) -> dict[str, Any]:
    """Model-facing facts about click data."""
    from comera_engine.data.clicks import NUM_DENSE, NUM_SPARSE

    return {
        "num_dense": NUM_DENSE,
        "num_sparse": NUM_SPARSE,
        "bucket_sizes": sizes,
        "click_rate": float(train_labels.mean()) if len(train_labels) else 0.0,
    }


def build_clicks(cfg: Mapping[str, Any], base_dir: BaseDir = None) -> DataBundle:
    """Criteo TSV: items ``dense`` float32 [13], ``sparse`` int64 [26], ``labels`` float32."""
    from comera_engine.data.clicks import read_criteo_tsv

    check_keys(cfg, ("path", "eval_path", "bucket_sizes", "max_rows", "split_fraction", "seed"))
    seed = get_int(cfg, "seed", 0)
    fraction = get_float(cfg, "split_fraction", 0.8, 0.0, 1.0)
    max_rows = get_optional_int(cfg, "max_rows")
    sizes = _bucket_sizes(cfg, 1000)

    def read(key: str) -> tuple[Any, Any, Path]:
        path = get_existing_file(cfg, key, base_dir, _CLICK_FILE_HELP)
        try:
            data, stats = read_criteo_tsv(path, sizes, max_rows)
        except UnicodeDecodeError as exc:
            raise ConfigError(field_name(key), f"{path.name}: {exc}") from None
        if len(data) == 0:
            raise ConfigError(
                field_name(key),
                f"no valid rows in {path.name} ({stats.malformed} malformed, first at line "
                f"{stats.first_malformed_line}); give {_CLICK_FILE_HELP}",
            )
        return data, stats, path

    data, stats, path = read("path")
    files = [path]
    extra: dict[str, Any] = {"read": vars(stats)}
    if cfg.get("eval_path") is not None:
        eval_data, eval_stats, eval_path = read("eval_path")
        files.append(eval_path)
        extra["eval_read"] = vars(eval_stats)
        train_data = data
    else:
        if len(data) < 2:
            raise ConfigError(field_name("path"), "need at least 2 valid rows to split")
        train_idx, eval_idx = split_indices(len(data), fraction, seed)
        train_data, eval_data = data.subset(train_idx), data.subset(eval_idx)
    identity = dataset_identity(
        "clicks",
        "files",
        {"train": len(train_data), "eval": len(eval_data)},
        seed,
        files=files,
        params={
            "bucket_sizes": sizes,
            "max_rows": max_rows,
            "split_fraction": None if cfg.get("eval_path") else fraction,
            "dense_transform": "log1p(max(x, 0)), missing -> 0",
        },
        extra=extra,
    )
    return DataBundle(
        name="clicks",
        task="ctr",
        train=TensorDictDataset(train_data.tensors()),
        eval=TensorDictDataset(eval_data.tensors()),
        identity=identity,
        num_classes=2,
        meta=_click_meta(sizes, train_data.labels),
    )


def build_clicks_synthetic(cfg: Mapping[str, Any], base_dir: BaseDir = None) -> DataBundle:
    """Synthetic clicks with a planted low-rank interaction (same items as ``clicks``)."""
    from comera_engine.data.clicks import NUM_SPARSE, generate_synthetic_clicks

    check_keys(
        cfg,
        (
            "num_samples",
            "bucket_sizes",
            "seed",
            "split_fraction",
            "planted_features",
            "rank",
            "signal",
            "dense_signal",
            "base_rate",
            "missing_rate",
        ),
    )
    seed = get_int(cfg, "seed", 0)
    num_samples = get_int(cfg, "num_samples", 20000, minimum=2)
    fraction = get_float(cfg, "split_fraction", 0.8, 0.0, 1.0)
    sizes = _bucket_sizes(cfg, 50)
    planted = cfg.get("planted_features", [0, 1, 2])
    if (
        not isinstance(planted, (list, tuple))
        or len(planted) < 2
        or len(set(planted)) != len(planted)
        or not all(isinstance(f, int) and 0 <= f < NUM_SPARSE for f in planted)
    ):
        raise ConfigError(
            field_name("planted_features"),
            f"must be a list of at least 2 distinct feature indices in 0..{NUM_SPARSE - 1}, "
            f"got {planted!r}",
        )
    if any(sizes[f] < 2 for f in planted):
        raise ConfigError(field_name("bucket_sizes"), "planted features need at least 2 buckets")
    settings = {
        "rank": get_int(cfg, "rank", 4, minimum=1),
        "signal": get_float(cfg, "signal", 1.5, 0.0, 100.0, open_interval=False),
        "dense_signal": get_float(cfg, "dense_signal", 0.3, 0.0, 100.0, open_interval=False),
        "base_rate": get_float(cfg, "base_rate", 0.25, 0.0, 1.0),
        "missing_rate": get_float(cfg, "missing_rate", 0.0, 0.0, 0.99, open_interval=False),
    }
    synth = generate_synthetic_clicks(
        num_samples, sizes, seed=seed, planted_features=planted, **settings
    )
    train_idx, eval_idx = split_indices(num_samples, fraction, seed)
    train_data, eval_data = synth.data.subset(train_idx), synth.data.subset(eval_idx)
    identity = dataset_identity(
        "clicks_synthetic",
        "synthetic",
        {"train": len(train_data), "eval": len(eval_data)},
        seed,
        params={**synth.params, "bucket_sizes": sizes, "split_fraction": fraction},
        extra={
            "content_sha256": content_sha256(
                synth.data.dense, synth.data.sparse, synth.data.labels
            ),
            "bayes_log_loss_eval": _log_loss(synth.probability[eval_idx], eval_data.labels.numpy()),
        },
    )
    meta = _click_meta(sizes, train_data.labels)
    meta["planted_features"] = list(synth.planted_features)
    meta["eval_probability"] = torch.from_numpy(synth.probability[eval_idx])
    return DataBundle(
        name="clicks_synthetic",
        task="ctr",
        train=TensorDictDataset(train_data.tensors()),
        eval=TensorDictDataset(eval_data.tensors()),
        identity=identity,
        num_classes=2,
        meta=meta,
    )


def _log_loss(probability: np.ndarray, labels: np.ndarray) -> float:
    """Mean binary cross-entropy of ``probability`` [n] against ``labels`` [n]."""
    p = np.clip(probability, 1e-12, 1 - 1e-12)
    return float(-np.mean(labels * np.log(p) + (1 - labels) * np.log(1 - p)))
