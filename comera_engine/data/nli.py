"""Natural language inference data (MNLI, SNLI): premise/hypothesis pairs, 3 labels.

Labels: ``entailment -> 0, neutral -> 1, contradiction -> 2`` (the GLUE/SNLI order on the
Hugging Face hub). Examples whose label is unknown (``-``, empty, ``-1``, anything else)
are dropped and counted.

Sources:
* local files: GLUE TSV (MNLI/SNLI layout, header with ``sentence1``, ``sentence2`` and
  ``gold_label``), jsonl (``{"premise", "hypothesis", "label"}``, label a string or an
  int) or parquet (same columns as jsonl, or the TSV names);
* the Hugging Face hub by name (needs a network; ``datasets`` is imported lazily).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from comera_engine.data.base import (
    BaseDir,
    DataBundle,
    TensorDictDataset,
    check_keys,
    field_name,
    get_bool,
    get_existing_file,
    get_str,
    missing_package,
    seeded_subset,
    split_indices,
)
from comera_engine.data.identity import dataset_identity
from comera_engine.data.registry import dataset_info
from comera_engine.data.tokenizer import (
    TextSettings,
    full_fraction,
    load_or_train_tokenizer,
    token_meta,
)
from comera_engine.errors import ConfigError

LABEL_NAMES: tuple[str, ...] = ("entailment", "neutral", "contradiction")
LABEL_TO_ID: dict[str, int] = {name: i for i, name in enumerate(LABEL_NAMES)}
FILE_FORMATS = ("tsv", "jsonl", "parquet")
FILE_HELP = "an existing GLUE TSV, jsonl or parquet file"

#: Column names accepted for (premise, hypothesis, label), in order of preference.
_PREMISE_KEYS = ("premise", "sentence1")
_HYPOTHESIS_KEYS = ("hypothesis", "sentence2")
_LABEL_KEYS = ("label", "gold_label")

#: Hub datasets by task name: (hub id, config name, train split, eval split).
HUB_DEFAULTS: dict[str, tuple[str, str | None, str, str]] = {
    "mnli": ("nyu-mll/glue", "mnli", "train", "validation_matched"),
    "snli": ("stanfordnlp/snli", None, "train", "validation"),
}


class NLIFormatError(ValueError):
    """A data file does not have the expected layout (message says what is wrong)."""


@dataclass
class NLIExamples:
    """Parallel lists of premise, hypothesis and label id (0/1/2)."""

    premises: list[str]
    hypotheses: list[str]
    labels: list[int]
    dropped: int = 0

    def __len__(self) -> int:
        return len(self.labels)

    def subset(self, indices: Iterable[int]) -> NLIExamples:
        """Examples at ``indices`` (in that order); ``dropped`` is not carried over."""
        idx = list(indices)
        return NLIExamples(
            [self.premises[i] for i in idx],
            [self.hypotheses[i] for i in idx],
            [self.labels[i] for i in idx],
        )

    def label_counts(self) -> dict[str, int]:
        """Examples per label name."""
        counts = np.bincount(np.asarray(self.labels, dtype=np.int64), minlength=3)
        return {name: int(c) for name, c in zip(LABEL_NAMES, counts)}


def label_to_id(value: Any) -> int | None:
    """Map a raw label (``"entailment"``, ``"1"``, ``2``, ``"-"``, ``-1``) to 0/1/2 or ``None``."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, (int, np.integer)):
        return int(value) if 0 <= int(value) <= 2 else None
    if isinstance(value, (float, np.floating)):
        return int(value) if float(value).is_integer() and 0 <= value <= 2 else None
    if isinstance(value, str):
        text = value.strip().lower()
        if text in LABEL_TO_ID:
            return LABEL_TO_ID[text]
        if text in ("0", "1", "2"):
            return int(text)
    return None


def _collect(rows: Iterable[tuple[Any, Any, Any]]) -> NLIExamples:
    """Build ``NLIExamples`` from (premise, hypothesis, raw label) rows, dropping bad labels."""
    premises, hypotheses, labels, dropped = [], [], [], 0
    for premise, hypothesis, raw in rows:
        label = label_to_id(raw)
        if label is None or premise is None or hypothesis is None:
            dropped += 1
            continue
        premises.append(str(premise))
        hypotheses.append(str(hypothesis))
        labels.append(label)
    return NLIExamples(premises, hypotheses, labels, dropped)


def _pick(columns: Sequence[str], choices: Sequence[str], path: Path) -> str:
    """First of ``choices`` present in ``columns``, else a format error naming them."""
    for choice in choices:
        if choice in columns:
            return choice
    raise NLIFormatError(  # the header is not echoed: it may be any line of any file
        f"{path.name} has no column {' or '.join(repr(c) for c in choices)} "
        f"(line 1 has {len(columns)} column{'s' if len(columns) != 1 else ''})"
    )


def read_glue_tsv(path: str | Path) -> NLIExamples:
    """Read a GLUE MNLI/SNLI TSV (header row; columns sentence1, sentence2, gold_label).

    Fields are split on tabs only (no quoting: MNLI text contains bare quotes). Rows too
    short to hold the needed columns count as dropped.
    """
    path = Path(path)
    with open(path, encoding="utf-8", newline="") as handle:
        header = handle.readline().rstrip("\r\n").split("\t")
        cols = [_pick(header, keys, path) for keys in (("sentence1",), ("sentence2",))]
        label_col = _pick(header, ("gold_label", "label"), path)
        i_p, i_h, i_l = header.index(cols[0]), header.index(cols[1]), header.index(label_col)
        need = max(i_p, i_h, i_l)

        def rows() -> Iterable[tuple[Any, Any, Any]]:
            for line in handle:
                fields = line.rstrip("\r\n").split("\t")
                if len(fields) <= need:
                    if line.strip():
                        yield None, None, None
                    continue
                yield fields[i_p], fields[i_h], fields[i_l]

        return _collect(rows())


def read_jsonl(path: str | Path) -> NLIExamples:
    """Read jsonl with ``premise``/``hypothesis``/``label`` (or sentence1/sentence2/gold_label)."""
    path = Path(path)

    def rows() -> Iterable[tuple[Any, Any, Any]]:
        with open(path, encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise NLIFormatError(
                        f"{path.name} line {number} is not valid JSON ({exc.msg})"
                    ) from None
                if not isinstance(obj, Mapping):
                    raise NLIFormatError(f"{path.name} line {number} is not a JSON object")
                yield (
                    _first_present(obj, _PREMISE_KEYS),
                    _first_present(obj, _HYPOTHESIS_KEYS),
                    _first_present(obj, _LABEL_KEYS),
                )

    return _collect(rows())


def _first_present(obj: Mapping[str, Any], keys: Sequence[str]) -> Any:
    """Value of the first key of ``keys`` present in ``obj`` (else ``None``)."""
    for key in keys:
        if key in obj:
            return obj[key]
    return None


def read_parquet(path: str | Path) -> NLIExamples:
    """Read a parquet file with premise/hypothesis/label (or the TSV column names)."""
    import pyarrow.parquet as pq

    path = Path(path)
    names = pq.read_schema(path).names
    cols = [_pick(names, keys, path) for keys in (_PREMISE_KEYS, _HYPOTHESIS_KEYS, _LABEL_KEYS)]
    table = pq.read_table(path, columns=cols)
    data = [table.column(c).to_pylist() for c in cols]
    return _collect(zip(*data))


def detect_format(path: str | Path) -> str | None:
    """``"tsv"``, ``"jsonl"`` or ``"parquet"`` from the file suffix, else ``None``."""
    suffix = Path(path).suffix.lower()
    return {
        ".tsv": "tsv",
        ".txt": "tsv",
        ".jsonl": "jsonl",
        ".json": "jsonl",
        ".parquet": "parquet",
        ".pq": "parquet",
    }.get(suffix)


def read_nli_file(path: str | Path, fmt: str | None = None) -> NLIExamples:
    """Read an NLI file in ``fmt`` (detected from the suffix when ``None``)."""
    fmt = fmt or detect_format(path)
    if fmt == "tsv":
        return read_glue_tsv(path)
    if fmt == "jsonl":
        return read_jsonl(path)
    if fmt == "parquet":
        return read_parquet(path)
    raise NLIFormatError(
        f"cannot tell the format of {Path(path).name}; use a .tsv, .jsonl or .parquet "
        "suffix or set format"
    )


def examples_from_hub_split(split: Any) -> NLIExamples:
    """Convert one ``datasets.Dataset`` split (premise, hypothesis, label int; -1 = none)."""
    columns = list(split.column_names)
    where = Path("hub split")
    cols = [_pick(columns, keys, where) for keys in (_PREMISE_KEYS, _HYPOTHESIS_KEYS, _LABEL_KEYS)]
    return _collect(zip(*(split[c] for c in cols)))


def load_nli_hub(
    task: str,
    hub_name: str | None = None,
    train_split: str | None = None,
    eval_split: str | None = None,
    cache_dir: str | None = None,
) -> tuple[NLIExamples, NLIExamples, dict[str, Any]]:
    """Download (or read from the HF cache) MNLI/SNLI with ``datasets.load_dataset``.

    Args:
        task: ``"mnli"`` or ``"snli"``.
        hub_name: hub id; default ``nyu-mll/glue`` (config ``mnli``) / ``stanfordnlp/snli``.
        train_split, eval_split: split names; default ``train`` and
            ``validation_matched`` (MNLI) / ``validation`` (SNLI).

    Returns:
        ``(train, eval, info)`` where ``info`` holds the hub id, config, splits and the
        ``datasets`` fingerprints of the two splits (for the identity dict).
    """
    import datasets

    default_hub, config, default_train, default_eval = HUB_DEFAULTS[task]
    hub = hub_name or default_hub
    train_name = train_split or default_train
    eval_name = eval_split or default_eval
    args = (hub, config) if config is not None else (hub,)
    train_ds = datasets.load_dataset(*args, split=train_name, cache_dir=cache_dir)
    eval_ds = datasets.load_dataset(*args, split=eval_name, cache_dir=cache_dir)
    info = {
        "hub": hub,
        "config": config,
        "train_split": train_name,
        "eval_split": eval_name,
        "train_fingerprint": getattr(train_ds, "_fingerprint", None),
        "eval_fingerprint": getattr(eval_ds, "_fingerprint", None),
        "datasets_version": datasets.__version__,
    }
    return examples_from_hub_split(train_ds), examples_from_hub_split(eval_ds), info


def pair_texts(examples: NLIExamples) -> Iterable[str]:
    """Premises then hypotheses, one string each (the tokenizer's training text)."""
    yield from examples.premises
    yield from examples.hypotheses


# --------------------------------------------------------------------------- NLI


def _read_nli(cfg: Mapping[str, Any], key: str, base_dir: BaseDir) -> tuple[Any, Path]:
    """Read the NLI file named by ``cfg[key]``; errors become ``ConfigError(data.<key>)``."""
    help_text = FILE_HELP
    path = get_existing_file(cfg, key, base_dir, help_text)
    fmt = get_str(cfg, "format", None)
    if fmt is not None and fmt not in FILE_FORMATS:
        raise ConfigError(
            field_name("format"),
            f"unknown format '{fmt}' (use one of {', '.join(FILE_FORMATS)})",
        )
    fmt = fmt or detect_format(path)
    if fmt is None:
        raise ConfigError(
            field_name(key),
            f"cannot tell the format of {path.name} (use a .tsv, .jsonl or .parquet suffix "
            "or set data.format)",
        )
    try:
        examples = read_nli_file(path, fmt)
    except ImportError as exc:
        raise missing_package(key, "pyarrow", "reading parquet") from exc
    except (NLIFormatError, UnicodeDecodeError) as exc:
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
    name = str(cfg["name"])
    defaults = dataset_info(str(cfg.get("name") or "nli")).defaults
    check_keys(cfg, defaults)
    text = TextSettings.read(cfg, defaults)
    seed, seq_len, fraction = text.seed, text.seq_len, text.split_fraction
    use_hub = get_bool(cfg, "hub", defaults["hub"])

    if use_hub:
        train_ex, eval_ex, info = _load_hub(cfg, name)
        source = f"hub:{info['hub']}" + (f"/{info['config']}" if info["config"] else "")
        files: list[Path] = []
    else:
        train_ex, eval_ex, files, info = _nli_from_files(cfg, name, base_dir, fraction, seed)
        source = "files"
    train_ex = train_ex.subset(seeded_subset(len(train_ex), text.max_examples, seed))
    eval_ex = eval_ex.subset(seeded_subset(len(eval_ex), text.max_eval_examples, seed + 1))

    tokenizer, trained, tok_path = load_or_train_tokenizer(
        cfg, base_dir, text, lambda: pair_texts(train_ex))

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
            "vocab_size": text.vocab_size,
            "min_frequency": text.min_frequency,
            "lowercase": text.lowercase,
            "split_fraction": None if (use_hub or cfg.get("eval_path")) else fraction,
            "max_examples": text.max_examples,
            "max_eval_examples": text.max_eval_examples,
        },
        extra={
            **info,
            "label_counts": {"train": train_ex.label_counts(), "eval": eval_ex.label_counts()},
            "tokenizer_sha256": tokenizer.sha256,
            "tokenizer_vocab_size": tokenizer.vocab_size,
            "truncated_fraction": full_fraction(train.tensors["attention_mask"]),
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
        meta=token_meta(tokenizer, LABEL_NAMES),
    )


def _nli_from_files(
    cfg: Mapping[str, Any], name: str, base_dir: BaseDir, fraction: float, seed: int
) -> tuple[Any, Any, list[Path], dict[str, Any]]:
    """``(train, eval, files, info)`` from ``data.path`` (split by seed) or + ``eval_path``."""
    if cfg.get("path") is None:
        hint = f", or set data.hub = true to download {name}" if name in HUB_DEFAULTS else ""
        raise ConfigError(field_name("path"), f"missing; give {FILE_HELP}{hint}")
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


def _load_hub(cfg: Mapping[str, Any], name: str) -> tuple[Any, Any, dict[str, Any]]:
    """Hub download with config-level errors (missing package, network, unknown split)."""
    if cfg.get("path") is not None:
        raise ConfigError(field_name("hub"), "give either data.path or data.hub = true, not both")
    if name not in HUB_DEFAULTS:
        raise ConfigError(
            field_name("hub"),
            f"hub loading exists for {', '.join(HUB_DEFAULTS)}, not '{name}'; "
            "set data.name to one of those or give data.path",
        )
    try:
        train_ex, eval_ex, info = load_nli_hub(
            name,
            hub_name=get_str(cfg, "hub_name", None),
            train_split=get_str(cfg, "train_split", None),
            eval_split=get_str(cfg, "eval_split", None),
            cache_dir=get_str(cfg, "cache_dir", None),
        )
    except ImportError as exc:
        raise missing_package("hub", "datasets", "hub loading") from exc
    except Exception as exc:  # network, unknown dataset or split: report as a config problem
        raise ConfigError(
            field_name("hub"),
            f"could not load {name} from the Hugging Face hub ({type(exc).__name__}: {exc}); "
            "check the network / data.hub_name / split names, or give data.path",
        ) from exc
    if len(train_ex) == 0 or len(eval_ex) == 0:
        raise ConfigError(field_name("hub"), f"{name}: a split has no labelled examples")
    return train_ex, eval_ex, info


def _encode_nli(tokenizer: Any, examples: Any, seq_len: int) -> TensorDictDataset:
    """Encode pairs to [n, seq_len] tensors plus ``labels`` [n]."""
    enc = tokenizer.encode_pairs(examples.premises, examples.hypotheses, seq_len)
    enc["labels"] = torch.tensor(examples.labels, dtype=torch.long)
    return TensorDictDataset(enc)

