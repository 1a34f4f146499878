"""WordPiece tokenizer trained offline with the ``tokenizers`` library.

BERT-style pipeline: ``BertNormalizer`` (clean text, CJK spacing, optional lower-casing
and accent stripping), ``BertPreTokenizer`` (split on whitespace and punctuation), a
WordPiece model with ``##`` continuation pieces, and the template
``[CLS] A [SEP] B [SEP]`` (type ids 0 for A and its separators, 1 for B). Special tokens
have fixed ids: ``[PAD]=0, [UNK]=1, [CLS]=2, [SEP]=3, [MASK]=4``. The whole tokenizer is
one ``tokenizer.json`` file.

``tokenizers`` is imported inside functions, so this module imports without it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from comera_engine.data.base import (
    BaseDir,
    field_name,
    get_bool,
    get_float,
    get_int,
    get_optional_int,
    get_str,
    missing_package,
    resolve_path,
)
from comera_engine.data.phases import phase
from comera_engine.errors import ConfigError

SPECIAL_TOKENS: tuple[str, ...] = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
PAD, UNK, CLS, SEP, MASK = SPECIAL_TOKENS
TOKENIZER_FILE = "tokenizer.json"


def continuation_alphabet(backend: Any, texts: Sequence[str], limit_alphabet: int) -> list[str]:
    """The ``##c`` pieces a WordPiece trainer creates for ``texts``, sorted: one for
    each alphabet character that follows another in a word (after ``backend``'s
    normalizer and pre-tokenizer).

    Found by a trainer that stops before its first merge (``vocab_size=1``): it counts
    the words and builds the alphabet and these pieces, nothing else (a fraction of a
    full training; a Python pass over the words was 3x slower than the training)."""
    from tokenizers import Tokenizer, trainers

    probe = Tokenizer.from_str(backend.to_str())  # the same pipeline, trained apart
    trainer = trainers.WordPieceTrainer(
        vocab_size=1, show_progress=False, special_tokens=list(SPECIAL_TOKENS),
        limit_alphabet=limit_alphabet, continuing_subword_prefix="##")
    probe.train_from_iterator(texts, trainer=trainer)
    return sorted(t for t in probe.get_vocab(with_added_tokens=False) if t.startswith("##"))


class WordPieceTokenizer:
    """A trained WordPiece tokenizer with fixed-length pair encoding to torch tensors."""

    def __init__(self, backend: Any) -> None:
        """Wrap a ``tokenizers.Tokenizer`` whose vocabulary holds the special tokens."""
        self._tok = backend
        ids = [backend.token_to_id(t) for t in SPECIAL_TOKENS]
        if ids != list(range(len(SPECIAL_TOKENS))):
            raise ValueError(
                f"tokenizer: special tokens must have ids 0..4 in the order {SPECIAL_TOKENS}, "
                f"got {dict(zip(SPECIAL_TOKENS, ids))}"
            )
        self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = ids

    # ------------------------------------------------------------------ build / persist

    @classmethod
    def train(
        cls,
        texts: Iterable[str],
        vocab_size: int = 8000,
        min_frequency: int = 2,
        lowercase: bool = True,
        limit_alphabet: int = 1000,
    ) -> WordPieceTokenizer:
        """Train a new tokenizer on ``texts`` (any iterable of strings).

        Deterministic: the same texts and settings give the same vocabulary and ids in
        every process. ``tokenizers``' trainer on its own is not (it numbers the ``##``
        continuation characters in hash-map order, and those ids break ties between
        equally frequent merges); here every continuation character of the alphabet is
        numbered up front, in sorted order (:func:`continuation_alphabet`), so nothing is
        left to that order. A dataset build that listens for phases hears
        ``"training tokenizer"`` meanwhile (:mod:`comera_engine.data.phases`).
        """
        with phase("training tokenizer"):
            return cls._train(texts, vocab_size, min_frequency, lowercase, limit_alphabet)

    @classmethod
    def _train(cls, texts: Iterable[str], vocab_size: int, min_frequency: int,
               lowercase: bool, limit_alphabet: int) -> WordPieceTokenizer:
        """:meth:`train` without the phase report."""
        import json

        from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

        texts = list(texts)  # read twice: the alphabet pass, then training
        backend = Tokenizer(models.WordPiece(unk_token=UNK, continuing_subword_prefix="##"))
        backend.normalizer = normalizers.BertNormalizer(
            clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=lowercase
        )
        backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        backend.decoder = decoders.WordPiece(prefix="##")
        pieces = continuation_alphabet(backend, texts, limit_alphabet)
        trainer = trainers.WordPieceTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            show_progress=False,
            # numbered in this order before training starts; only the first five stay
            # special tokens (below)
            special_tokens=[*SPECIAL_TOKENS, *pieces],
            limit_alphabet=limit_alphabet,
            continuing_subword_prefix="##",
        )
        backend.train_from_iterator(texts, trainer=trainer)
        # the continuation pieces are ordinary vocabulary entries: drop them from the added
        # (never split, skipped on decode) tokens, keeping their ids in the model
        spec = json.loads(backend.to_str())
        spec["added_tokens"] = [t for t in spec["added_tokens"]
                                if t["content"] in SPECIAL_TOKENS]
        backend = Tokenizer.from_str(json.dumps(spec))
        cls._set_template(backend)
        return cls(backend)

    @staticmethod
    def _set_template(backend: Any) -> None:
        """Install the ``[CLS] A [SEP] B [SEP]`` post-processor."""
        from tokenizers import processors

        backend.post_processor = processors.TemplateProcessing(
            single=f"{CLS}:0 $A:0 {SEP}:0",
            pair=f"{CLS}:0 $A:0 {SEP}:0 $B:1 {SEP}:1",
            special_tokens=[(CLS, backend.token_to_id(CLS)), (SEP, backend.token_to_id(SEP))],
        )

    def save(self, path: str | Path) -> Path:
        """Write ``tokenizer.json``; ``path`` is the file, or a folder to write it into."""
        target = Path(path)
        if target.is_dir() or target.suffix != ".json":
            target = target / TOKENIZER_FILE
        target.parent.mkdir(parents=True, exist_ok=True)
        self._tok.no_padding()
        self._tok.no_truncation()
        self._tok.save(str(target))
        return target

    @classmethod
    def load(cls, path: str | Path) -> WordPieceTokenizer:
        """Load from a ``tokenizer.json`` file or a folder that holds one."""
        from tokenizers import Tokenizer

        source = Path(path)
        if source.is_dir():
            source = source / TOKENIZER_FILE
        if not source.is_file():
            raise FileNotFoundError(f"path: no tokenizer file at {source}")
        return cls(Tokenizer.from_file(str(source)))

    # ------------------------------------------------------------------ properties

    @property
    def vocab_size(self) -> int:
        """Number of ids (special tokens included)."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def special_ids(self) -> tuple[int, ...]:
        """Ids of ``[PAD] [UNK] [CLS] [SEP] [MASK]`` (always ``0..4``)."""
        return tuple(range(len(SPECIAL_TOKENS)))

    @property
    def backend(self) -> Any:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tok

    @property
    def sha256(self) -> str:
        """SHA-256 of the serialised tokenizer (vocabulary and pipeline settings).

        :meth:`train` gives the same digest for the same texts and settings in any
        process; tokenizers trained by other code, or with another ``tokenizers``
        version, may differ: record this digest (and reuse a saved ``tokenizer.json``)
        to know which vocabulary a run used.
        """
        import hashlib

        self._tok.no_padding()
        self._tok.no_truncation()
        return hashlib.sha256(self._tok.to_str().encode()).hexdigest()

    def token_to_id(self, token: str) -> int | None:
        """Id of ``token`` or ``None`` if it is not in the vocabulary."""
        return self._tok.token_to_id(token)

    # ------------------------------------------------------------------ encoding

    def tokenize(self, text: str) -> list[str]:
        """WordPiece tokens of ``text`` without special tokens."""
        return list(self._tok.encode(text, add_special_tokens=False).tokens)

    def encode_texts(self, texts: Sequence[str]) -> list[list[int]]:
        """Variable-length ids of each text, no special tokens, no padding or truncation."""
        self._tok.no_padding()
        self._tok.no_truncation()
        encodings = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [list(e.ids) for e in encodings]

    def encode_pairs(
        self,
        first: Sequence[str],
        second: Sequence[str] | None = None,
        seq_len: int = 128,
    ) -> dict[str, torch.Tensor]:
        """Encode texts (or text pairs) to a fixed length.

        ``[CLS] a [SEP] b [SEP]`` padded with ``[PAD]`` / truncated (longest first) to
        ``seq_len``.

        Returns:
            ``input_ids``, ``token_type_ids``, ``attention_mask``: int64 tensors [n, seq_len].
        """
        if seq_len < 4:
            raise ValueError(f"seq_len: must be >= 4 to hold [CLS] a [SEP] b [SEP], got {seq_len}")
        if second is not None and len(second) != len(first):
            raise ValueError(
                f"second: length {len(second)} differs from first's length {len(first)}"
            )
        inputs: list[Any] = list(first) if second is None else list(zip(first, second))
        self._tok.enable_truncation(max_length=seq_len, strategy="longest_first")
        self._tok.enable_padding(length=seq_len, pad_id=self.pad_id, pad_token=PAD)
        try:
            encodings = self._tok.encode_batch(inputs) if inputs else []
        finally:
            self._tok.no_padding()
            self._tok.no_truncation()
        n = len(encodings)
        ids = np.zeros((n, seq_len), dtype=np.int64)
        types = np.zeros((n, seq_len), dtype=np.int64)
        mask = np.zeros((n, seq_len), dtype=np.int64)
        for row, enc in enumerate(encodings):
            ids[row] = enc.ids
            types[row] = enc.type_ids
            mask[row] = enc.attention_mask
        return {
            "input_ids": torch.from_numpy(ids),
            "token_type_ids": torch.from_numpy(types),
            "attention_mask": torch.from_numpy(mask),
        }

    def decode(self, ids: Sequence[int] | torch.Tensor, skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (WordPiece pieces joined back into words)."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def train_tokenizer(texts: Any, vocab_size: int, min_frequency: int, lowercase: bool) -> Any:
    """Train a ``WordPieceTokenizer`` (ConfigError if ``tokenizers`` is missing)."""
    try:
        from comera_engine.data.tokenizer import WordPieceTokenizer

        return WordPieceTokenizer.train(texts, vocab_size, min_frequency, lowercase)
    except ImportError as exc:
        raise missing_package("vocab_size", "tokenizers", "the WordPiece tokenizer") from exc


def tokenizer_path(cfg: Mapping[str, Any], base_dir: BaseDir) -> Path | None:
    """Resolved ``data.tokenizer_path`` or ``None``."""
    raw = get_str(cfg, "tokenizer_path", None)
    return resolve_path(raw, base_dir) if raw is not None else None


def load_existing_tokenizer(path: Path | None) -> Any:
    """The tokenizer saved at ``path`` (file or folder), or ``None`` if there is none yet."""
    if path is None:
        return None
    try:
        from comera_engine.data.tokenizer import TOKENIZER_FILE, WordPieceTokenizer

        if path.is_file() or (path / TOKENIZER_FILE).is_file():
            return WordPieceTokenizer.load(path)
    except ImportError as exc:
        raise missing_package("tokenizer_path", "tokenizers", "the WordPiece tokenizer") from exc
    except Exception as exc:  # corrupt json, wrong special tokens
        raise ConfigError(
            field_name("tokenizer_path"),
            f"cannot load tokenizer {path} ({exc}); delete it or point elsewhere to retrain",
        ) from None
    return None


@dataclass(frozen=True)
class TextSettings:
    """The ``[data]`` keys every tokenised text data set reads (NLI, reviews)."""

    seed: int
    seq_len: int
    vocab_size: int
    min_frequency: int
    lowercase: bool
    split_fraction: float
    max_examples: int | None
    max_eval_examples: int | None

    @classmethod
    def read(cls, cfg: Mapping[str, Any], defaults: Mapping[str, Any]) -> TextSettings:
        """From a ``[data]`` table, with the data set's registry ``defaults``."""
        return cls(
            seed=get_int(cfg, "seed", defaults["seed"]),
            seq_len=get_int(cfg, "seq_len", defaults["seq_len"], minimum=4),
            vocab_size=get_int(cfg, "vocab_size", defaults["vocab_size"], minimum=64),
            min_frequency=get_int(cfg, "min_frequency", defaults["min_frequency"], minimum=1),
            lowercase=get_bool(cfg, "lowercase", defaults["lowercase"]),
            split_fraction=get_float(cfg, "split_fraction", defaults["split_fraction"], 0.0,
                                     1.0),
            max_examples=get_optional_int(cfg, "max_examples"),
            max_eval_examples=get_optional_int(cfg, "max_eval_examples"),
        )


def load_or_train_tokenizer(cfg: Mapping[str, Any], base_dir: BaseDir, text: TextSettings,
                            corpus: Callable[[], Iterable[str]]) -> tuple[Any, bool, Path | None]:
    """``(tokenizer, trained, path)``: the one saved at ``data.tokenizer_path`` (a resumed
    run keeps its vocabulary), else one trained on ``corpus()`` (the training split's
    texts) and saved there when the path is given."""
    path = tokenizer_path(cfg, base_dir)
    tokenizer = load_existing_tokenizer(path)
    if tokenizer is not None:
        return tokenizer, False, path
    tokenizer = train_tokenizer(corpus(), text.vocab_size, text.min_frequency, text.lowercase)
    if path is not None:
        tokenizer.save(path)
    return tokenizer, True, path


def full_fraction(attention_mask: torch.Tensor) -> float:
    """Fraction of rows that fill every position (likely truncated)."""
    if attention_mask.shape[0] == 0:
        return 0.0
    return float(attention_mask.bool().all(dim=1).float().mean())


def token_meta(tokenizer: Any, label_names: Sequence[str]) -> dict[str, Any]:
    """A text bundle's ``meta``: its label names and the tokenizer's special ids."""
    return {"label_names": list(label_names), "pad_id": tokenizer.pad_id,
            "cls_id": tokenizer.cls_id, "sep_id": tokenizer.sep_id,
            "mask_id": tokenizer.mask_id, "type_vocab_size": 2}
