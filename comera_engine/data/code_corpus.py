"""Masked-LM corpus of Python code: the standard library's own ``.py`` files.

The files are always present (``sysconfig.get_paths()["stdlib"]``), so the corpus needs
no download. Test folders and installed packages (``site-packages``) are skipped.

Pipeline:
1. list the files (sorted), shuffle them with the seed, keep them while ``max_files`` /
   ``max_bytes`` allow;
2. split BY FILE into train and eval files (no file contributes to both);
3. train a WordPiece tokenizer on the train files (case kept), encode every file;
4. per split, join the files' ids with ``[SEP]`` between files and cut the stream into
   blocks ``[CLS] + (seq_len - 1) ids``; the last partial block is padded with ``[PAD]``
   (``attention_mask`` 0 there);
5. masking (BERT recipe): each real token is chosen with probability 0.15; a chosen token
   becomes ``[MASK]`` (80%), a random non-special token (10%) or stays (10%); ``labels``
   hold the original id at chosen positions and -100 elsewhere.
"""

from __future__ import annotations

import os
import platform
import sysconfig
from collections.abc import Mapping, Sequence
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
    get_float,
    get_int,
    get_optional_int,
    get_str,
    missing_package,
    resolve_path,
)
from comera_engine.data.identity import dataset_identity
from comera_engine.data.registry import dataset_info
from comera_engine.data.tokenizer import (
    WordPieceTokenizer,
    load_existing_tokenizer,
    tokenizer_path,
)
from comera_engine.errors import ConfigError

IGNORE_INDEX = -100
_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)


def stdlib_root() -> Path:
    """Folder of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def list_stdlib_files(root: str | Path | None = None) -> list[Path]:
    """All ``.py`` files under ``root`` (default: the stdlib), sorted, test dirs skipped."""
    base = Path(root) if root is not None else stdlib_root()
    found = []
    for folder, dirs, names in os.walk(base):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
        found.extend(Path(folder) / n for n in names if n.endswith(".py"))
    found = [p for p in found if p.is_file()]
    return sorted(found, key=lambda p: p.relative_to(base).as_posix())


def select_files(
    files: Sequence[Path],
    seed: int,
    max_files: int | None = None,
    max_bytes: int | None = None,
) -> list[Path]:
    """Shuffle ``files`` with ``seed`` and keep them in that order within the caps.

    A file that would push the total past ``max_bytes`` is skipped (smaller later files
    may still fit). Returns the kept files in shuffled order.
    """
    order = np.random.default_rng(seed).permutation(len(files))
    kept: list[Path] = []
    total = 0
    for i in order:
        if max_files is not None and len(kept) >= max_files:
            break
        size = files[i].stat().st_size
        if size == 0 or (max_bytes is not None and total + size > max_bytes):
            continue
        kept.append(files[i])
        total += size
    return kept


def split_files(
    files: Sequence[Path], eval_fraction: float, seed: int
) -> tuple[list[Path], list[Path]]:
    """Deterministic split by file: ``(train_files, eval_files)``, both non-empty, sorted."""
    if len(files) < 2:
        raise ValueError(f"files: need at least 2 files to split by file, got {len(files)}")
    ordered = sorted(files)
    order = np.random.default_rng(seed + 1).permutation(len(ordered))
    n_eval = min(max(int(round(len(ordered) * eval_fraction)), 1), len(ordered) - 1)
    eval_files = sorted(ordered[i] for i in order[:n_eval])
    train_files = sorted(ordered[i] for i in order[n_eval:])
    return train_files, eval_files


def read_source(path: Path) -> str | None:
    """Text of a source file, or ``None`` if it is not valid UTF-8."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None


def chunk_blocks(
    docs: Sequence[Sequence[int]], seq_len: int, cls_id: int, sep_id: int, pad_id: int
) -> dict[str, torch.Tensor]:
    """Cut documents' ids into fixed-length blocks.

    The stream is ``doc_0 [SEP] doc_1 [SEP] ...``; each block is ``[CLS]`` followed by the
    next ``seq_len - 1`` stream ids; the last block is padded.

    Returns:
        ``input_ids`` and ``attention_mask``: int64 [num_blocks, seq_len].
    """
    if seq_len < 2:
        raise ValueError(f"seq_len: must be >= 2, got {seq_len}")
    stream: list[int] = []
    for doc in docs:
        if doc:
            stream.extend(doc)
            stream.append(sep_id)
    body = seq_len - 1
    n_blocks = (len(stream) + body - 1) // body
    ids = np.full((n_blocks, seq_len), pad_id, dtype=np.int64)
    mask = np.zeros((n_blocks, seq_len), dtype=np.int64)
    flat = np.asarray(stream, dtype=np.int64)
    for b in range(n_blocks):
        piece = flat[b * body : (b + 1) * body]
        ids[b, 0] = cls_id
        ids[b, 1 : 1 + len(piece)] = piece
        mask[b, : 1 + len(piece)] = 1
    return {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask)}


def mask_tokens(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    vocab_size: int,
    mask_id: int,
    special_ids: Sequence[int],
    generator: torch.Generator | None = None,
    mlm_probability: float = 0.15,
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT masking of a batch.

    Args:
        input_ids, attention_mask: int64 [B, L].
        special_ids: ids never chosen (and never drawn as random replacements); the
            random replacement is drawn from ``max(special_ids) + 1 .. vocab_size - 1``.
        generator: makes the result deterministic (same generator state, same output);
            it may live on another device than the batch (e.g. a CPU generator for a
            CUDA batch); the draws are made on the generator's device.

    Returns:
        ``(masked_ids [B, L], labels [B, L])``; labels are the original ids at the chosen
        positions and -100 elsewhere.
    """
    device = input_ids.device
    gen_device = generator.device if generator is not None else device
    shape = input_ids.shape
    specials = torch.tensor(list(special_ids), dtype=input_ids.dtype, device=device)
    candidate = attention_mask.bool() & ~torch.isin(input_ids, specials)
    draws = torch.rand(shape, generator=generator, device=gen_device).to(device)
    chosen = candidate & (draws < mlm_probability)
    labels = torch.where(chosen, input_ids, torch.full_like(input_ids, IGNORE_INDEX))
    action = torch.rand(shape, generator=generator, device=gen_device).to(device)
    low = int(max(special_ids)) + 1
    random_ids = torch.randint(low, vocab_size, shape, generator=generator, device=gen_device)
    random_ids = random_ids.to(device)
    masked = input_ids.clone()
    masked[chosen & (action < 0.8)] = mask_id
    use_random = chosen & (action >= 0.8) & (action < 0.9)
    masked[use_random] = random_ids[use_random].to(masked.dtype)
    return masked, labels


class MLMCollator:
    """``DataLoader`` collate that stacks blocks and masks them freshly each batch.

    Deterministic for a given ``seed`` and batch sequence (it owns a ``torch.Generator``).
    Use it with ``num_workers=0``: worker processes would each copy the generator.
    """

    def __init__(
        self,
        vocab_size: int,
        mask_id: int,
        special_ids: Sequence[int],
        seed: int = 0,
        mlm_probability: float = 0.15,
    ) -> None:
        self.vocab_size = vocab_size
        self.mask_id = mask_id
        self.special_ids = tuple(special_ids)
        self.mlm_probability = mlm_probability
        self.generator = torch.Generator().manual_seed(seed)

    def reseed(self, seed: int) -> None:
        """Restart the masking stream (e.g. when resuming from a checkpoint)."""
        self.generator.manual_seed(seed)

    def mask_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Mask stacked ``input_ids``/``attention_mask`` [B, L]; adds ``labels`` [B, L]."""
        masked, labels = mask_tokens(
            batch["input_ids"],
            batch["attention_mask"],
            self.vocab_size,
            self.mask_id,
            self.special_ids,
            self.generator,
            self.mlm_probability,
        )
        return {"input_ids": masked, "attention_mask": batch["attention_mask"], "labels": labels}

    def __call__(self, items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Collate a list of ``{"input_ids", "attention_mask"}`` items [L] into a masked batch."""
        stacked = {
            "input_ids": torch.stack([it["input_ids"] for it in items]),
            "attention_mask": torch.stack([it["attention_mask"] for it in items]),
        }
        return self.mask_batch(stacked)


@dataclass
class CodeCorpus:
    """Blocks of the train and eval files, plus what produced them."""

    train: dict[str, torch.Tensor]
    eval: dict[str, torch.Tensor]
    tokenizer: WordPieceTokenizer
    root: Path
    train_files: list[Path]
    eval_files: list[Path]
    skipped_files: list[Path]


def build_code_corpus(
    seq_len: int = 128,
    seed: int = 0,
    max_files: int | None = 200,
    max_bytes: int | None = None,
    eval_fraction: float = 0.1,
    vocab_size: int = 8000,
    min_frequency: int = 2,
    tokenizer: WordPieceTokenizer | None = None,
    root: str | Path | None = None,
) -> CodeCorpus:
    """Select, split, tokenise and chunk the stdlib files (see the module docstring).

    ``tokenizer``: reuse this one instead of training on the train files.
    ``root``: another folder of ``.py`` files instead of the stdlib.

    Returns:
        ``CodeCorpus`` whose ``train`` / ``eval`` hold ``input_ids`` and ``attention_mask``
        int64 [num_blocks, seq_len] (unmasked).
    """
    base = Path(root).resolve() if root is not None else stdlib_root()
    chosen = select_files(list_stdlib_files(base), seed, max_files, max_bytes)
    texts: dict[Path, str] = {}
    skipped: list[Path] = []
    for path in chosen:
        text = read_source(path)
        if text is None or not text.strip():
            skipped.append(path)
        else:
            texts[path] = text
    train_files, eval_files = split_files(list(texts), eval_fraction, seed)
    if tokenizer is None:
        tokenizer = WordPieceTokenizer.train(
            (texts[p] for p in train_files),
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            lowercase=False,
        )

    def blocks(files: list[Path]) -> dict[str, torch.Tensor]:
        docs = tokenizer.encode_texts([texts[p] for p in files])
        return chunk_blocks(docs, seq_len, tokenizer.cls_id, tokenizer.sep_id, tokenizer.pad_id)

    return CodeCorpus(
        train=blocks(train_files),
        eval=blocks(eval_files),
        tokenizer=tokenizer,
        root=base,
        train_files=train_files,
        eval_files=eval_files,
        skipped_files=skipped,
    )


# --------------------------------------------------------------------------- code MLM


def build_code_mlm(cfg: Mapping[str, Any], base_dir: BaseDir = None) -> DataBundle:
    """Stdlib code masked-LM: train items ``input_ids``/``attention_mask`` [seq_len]
    (masked by ``collate_fn``); eval items also carry fixed ``labels`` [seq_len]."""
    defaults = dataset_info("code_mlm").defaults
    check_keys(cfg, defaults)
    seed = get_int(cfg, "seed", defaults["seed"])
    seq_len = get_int(cfg, "seq_len", defaults["seq_len"], minimum=8)
    max_files = get_optional_int(cfg, "max_files", minimum=2)
    max_files = defaults["max_files"] if "max_files" not in cfg else max_files
    max_bytes = get_optional_int(cfg, "max_bytes", minimum=1)
    fraction = get_float(cfg, "split_fraction", defaults["split_fraction"], 0.0, 1.0)
    vocab_size = get_int(cfg, "vocab_size", defaults["vocab_size"], minimum=64)
    min_frequency = get_int(cfg, "min_frequency", defaults["min_frequency"], minimum=1)
    mlm_probability = get_float(cfg, "mlm_probability", defaults["mlm_probability"], 0.0, 1.0)
    root = stdlib_root()
    if cfg.get("root") is not None:
        root = resolve_path(str(get_str(cfg, "root", None)), base_dir)
        if not root.is_dir():
            raise ConfigError(
                field_name("root"), f"folder not found: {cfg['root']} (give a folder of .py files)"
            )
    tok_path = tokenizer_path(cfg, base_dir)
    tokenizer = load_existing_tokenizer(tok_path)
    trained = tokenizer is None
    try:
        corpus = build_code_corpus(
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
        raise missing_package("vocab_size", "tokenizers", "the WordPiece tokenizer") from exc
    except ValueError as exc:
        raise ConfigError(
            field_name("max_files"),
            f"{exc}; raise data.max_files / data.max_bytes so that at least 2 files are used",
        ) from None
    if trained and tok_path is not None:
        corpus.tokenizer.save(tok_path)
    tok = corpus.tokenizer
    eval_gen = torch.Generator().manual_seed(seed + 1_000_003)
    eval_ids, eval_labels = mask_tokens(
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
        collate_fn=MLMCollator(
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
