"""The input pipeline an export carries: what the exported model takes, and how that
becomes what the network was trained on.

A network of :mod:`comera_engine.models` is trained on *prepared* features (digits
standardised with the training split's statistics, click counts log-transformed and
categorical tokens hashed into table rows). A user has raw data. So an export records
the preparation as JSON (``input_pipeline`` in its metadata) and the loaded model, and
the ONNX graph, apply it first: ``model(raw)`` gives the run's answers.

Kinds (:func:`pipeline_for` picks one from the run's data spec):

``pixels`` (digits)
    ``x``: float [B, 64], the raw 8×8 pixel intensities 0..16 (what
    ``sklearn.datasets.load_digits().data`` holds); the model computes
    ``(x · scale − mean) / std`` with the training split's ``mean``/``std``.
``criteo`` (clicks, clicks_synthetic)
    ``dense``: float [B, 13], the raw integer counts (missing: 0); the model takes
    ``log(1 + max(x, 0))``. ``sparse``: int64 [B, 26], each categorical field's 8 hex
    digits read as an integer (``int(token, 16)``; an empty field: −1); the model maps it
    to table row ``1 + value mod (buckets − 1)`` (0 for −1), as
    :func:`comera_engine.data.clicks.hash_category` does.
``files`` (your CSV / JSON lines / Parquet files, numeric and categorical columns)
    ``x``: float [B, F], the raw numeric columns in ``features`` order (missing: NaN);
    the model fills a missing value with the training split's mean and standardises
    with its mean and std. ``categorical``: int64 [B, C], each categorical column's
    value as its id in ``categories`` (its position there + 1; 0 for a value not seen
    in training or missing). ``encode_rows(rows)`` builds both from rows as a CSV reader
    gives them (dicts of strings), and ``predict_rows(rows)`` answers with the label
    names (classify) or numbers (regress).
``tokens`` (text data sets)
    Token ids from the tokenizer shipped beside the export (``<file>.tokenizer.json``),
    which pads and truncates to the model's sequence length itself: nothing is done in
    the model; the model card shows the exact encoding call.

Other data sets (MovieLens, Adult: features computed from the training split's tables)
have no pipeline: the model takes the prepared features, and the card says so.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from comera_engine.errors import ConfigError

__all__ = ["KINDS", "RawInputs", "bake_tokenizer", "pipeline_for", "raw_example",
           "validate_pipeline", "wrap"]

KINDS = ("pixels", "criteo", "files", "tokens")
#: Data sets whose examples are Criteo rows (``comera_engine.data.clicks``).
CRITEO_DATA = ("clicks", "clicks_synthetic")
TEXT_TASKS = ("nli", "text", "mlm")
DIGITS_SCALE = 1.0 / 16.0  # pixels 0..16 -> [0, 1] (comera_engine.data.digits)
_MAX_FEATURES = 4096


def pipeline_for(data_spec: Mapping[str, Any] | None, family: str | None = None
                 ) -> dict[str, Any] | None:
    """The input pipeline of a model trained on ``data_spec`` (its export's JSON entry),
    or ``None`` when the model takes prepared features."""
    if not isinstance(data_spec, Mapping):
        return None
    name, task = data_spec.get("name"), data_spec.get("task")
    meta = data_spec.get("meta") or {}
    if name == "digits" and family in (None, "tt_mlp") and isinstance(
            meta.get("mean"), list) and isinstance(meta.get("std"), list):
        return {"kind": "pixels", "inputs": ["x"], "scale": DIGITS_SCALE,
                "mean": [float(v) for v in meta["mean"]],
                "std": [float(v) for v in meta["std"]],
                "raw": "x: float [B, 64], the 8x8 pixel intensities 0..16 as "
                       "sklearn.datasets.load_digits().data holds them (no scaling)"}
    if name in CRITEO_DATA and family in (None, "dlrm") and isinstance(
            meta.get("bucket_sizes"), list):
        return {"kind": "criteo", "inputs": ["dense", "sparse"],
                "num_dense": int(meta.get("num_dense", 13)),
                "bucket_sizes": [int(b) for b in meta["bucket_sizes"]],
                "raw": "dense: float [B, 13], the raw integer counts I1..I13 (missing: 0); "
                       "sparse: int64 [B, 26], each categorical field C1..C26 read as "
                       "int(token, 16) (missing: -1)"}
    if name == "files" and not data_spec.get("seq_len") and (
            isinstance(meta.get("mean"), list) or isinstance(meta.get("categories"), dict)):
        features = [str(f) for f in meta.get("feature_names") or []]
        categories = {str(c): list(v) for c, v in (meta.get("categories") or {}).items()}
        return {"kind": "files",
                "inputs": (["x"] if features else []) + (["categorical"] if categories else []),
                "features": features, "mean": [float(v) for v in meta.get("mean") or []],
                "std": [float(v) for v in meta.get("std") or []], "categories": categories,
                "label_names": [str(v) for v in meta.get("label_names") or []],
                "task": task,
                "raw": "rows of your file as a CSV reader gives them: model.predict_rows(rows) "
                       "(label names), or model(*model.encode_rows(rows)); x: float [B, F], "
                       "the raw numeric columns (missing: NaN); categorical: int64 [B, C], "
                       "each value's id in categories (0: unseen or missing)"}
    if task in TEXT_TASKS and data_spec.get("seq_len"):
        return {"kind": "tokens", "inputs": ["input_ids", "token_type_ids", "attention_mask"],
                "seq_len": int(data_spec["seq_len"]), "pad_id": int(meta.get("pad_id", 0)),
                "raw": "text encoded by the tokenizer shipped beside the model (it pads and "
                       "truncates to the model's sequence length)"}
    return None


def _floats(doc: Mapping[str, Any], key: str, where: str, positive: bool = False
            ) -> list[float]:
    v = doc.get(key)
    if not isinstance(v, list) or not 0 < len(v) <= _MAX_FEATURES or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
            and (x > 0 or not positive) for x in v):
        need = "positive" if positive else "finite"
        raise ConfigError(f"{where}.{key}", f"must be a list of {need} numbers")
    return [float(x) for x in v]


def validate_pipeline(doc: Any, where: str = "metadata.input_pipeline",
                      data_spec: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Check a pipeline read from a file (ConfigError naming the field); with the
    recipe's ``data_spec``, also that its widths are the network's."""
    if not isinstance(doc, Mapping) or doc.get("kind") not in KINDS:
        raise ConfigError(f"{where}.kind", f"must be one of {', '.join(KINDS)}")
    kind = doc["kind"]
    if kind == "pixels":
        mean, std = _floats(doc, "mean", where), _floats(doc, "std", where, positive=True)
        if len(mean) != len(std):
            raise ConfigError(f"{where}.std", f"has {len(std)} entries, mean {len(mean)}")
        scale = doc.get("scale")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (
                math.isfinite(scale) and scale > 0):
            raise ConfigError(f"{where}.scale", f"must be a positive number, got {scale!r}")
    elif kind == "criteo":
        sizes = doc.get("bucket_sizes")
        if not isinstance(sizes, list) or not 0 < len(sizes) <= _MAX_FEATURES or not all(
                isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in sizes):
            raise ConfigError(f"{where}.bucket_sizes", "must be a list of integers >= 1")
        n = doc.get("num_dense")
        if isinstance(n, bool) or not isinstance(n, int) or not 0 < n <= _MAX_FEATURES:
            raise ConfigError(f"{where}.num_dense", f"must be a positive integer, got {n!r}")
    elif kind == "files":
        features = doc.get("features")
        if not isinstance(features, list) or len(features) > _MAX_FEATURES or not all(
                isinstance(f, str) for f in features):
            raise ConfigError(f"{where}.features", "must be a list of column names")
        if features:
            mean = _floats(doc, "mean", where)
            std = _floats(doc, "std", where, positive=True)
            if not len(mean) == len(std) == len(features):
                raise ConfigError(f"{where}.std", f"{len(features)} features, {len(mean)} "
                                                  f"means, {len(std)} stds")
        cats = doc.get("categories")
        if not isinstance(cats, Mapping) or len(cats) > _MAX_FEATURES or not all(
                isinstance(v, list) and len(v) <= 1_000_000 for v in cats.values()):
            raise ConfigError(f"{where}.categories", "must map column names to value lists")
        if not isinstance(doc.get("label_names"), list):
            raise ConfigError(f"{where}.label_names", "must be a list")
    meta = (data_spec or {}).get("meta") or {}
    if kind == "files" and data_spec is not None and doc["features"] and len(
            doc["features"]) != meta.get("input_dim"):
        raise ConfigError(f"{where}.features", f"has {len(doc['features'])} entries, the "
                                               f"network takes {meta.get('input_dim')}")
    width = {"pixels": ("mean", "input_dim"), "criteo": ("bucket_sizes", "bucket_sizes")}
    if kind in width and data_spec is not None:
        mine, theirs = width[kind]
        want = meta.get(theirs)
        want = len(want) if isinstance(want, list) else want
        if len(doc[mine]) != want:
            raise ConfigError(f"{where}.{mine}", f"has {len(doc[mine])} entries, the "
                                                 f"network takes {want}")
    return dict(doc)


class RawInputs(nn.Module):
    """An exported network behind its input pipeline: ``forward`` takes raw inputs
    (module docstring), ``prepare`` gives what the network itself takes, and
    ``network`` is the bare network."""

    def __init__(self, network: nn.Module, pipeline: Mapping[str, Any]) -> None:
        super().__init__()
        pipeline = validate_pipeline(pipeline)
        self.network = network
        self.kind = pipeline["kind"]
        self.pipeline = dict(pipeline)
        if self.kind == "pixels":  # buffers, not in the file: they come from its metadata
            std = torch.tensor(pipeline["std"], dtype=torch.float32)
            self.register_buffer("mean", torch.tensor(pipeline["mean"], dtype=torch.float32),
                                 persistent=False)
            self.register_buffer("inv_std", 1.0 / std, persistent=False)
            self.scale = float(pipeline["scale"])
        elif self.kind == "files":
            n = len(pipeline["features"])
            self.register_buffer("mean", torch.tensor(pipeline["mean"] or [0.0] * n,
                                                      dtype=torch.float32), persistent=False)
            self.register_buffer("inv_std", 1.0 / torch.tensor(
                pipeline["std"] or [1.0] * n, dtype=torch.float32), persistent=False)
            # a value's id: looked up as text, as a CSV reader gives it
            self._ids = [{_cell(v): i + 1 for i, v in enumerate(values)}
                         for values in pipeline["categories"].values()]
        elif self.kind == "criteo":
            sizes = torch.tensor(pipeline["bucket_sizes"], dtype=torch.long)
            self.register_buffer("modulus", (sizes - 1).clamp_min(1), persistent=False)
            self.register_buffer("hashed", (sizes > 1).long(), persistent=False)

    def prepare(self, *raw: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Raw inputs -> the network's inputs."""
        if self.kind == "pixels":
            (x,) = raw
            return ((x.float() * self.scale - self.mean) * self.inv_std,)
        if self.kind == "criteo":
            dense, sparse = raw
            sparse = sparse.long()
            rows = (1 + torch.remainder(sparse, self.modulus)) * (sparse >= 0).long()
            return torch.log1p(torch.clamp(dense.float(), min=0.0)), rows * self.hashed
        if self.kind == "files":
            out = list(raw)
            if self.pipeline["features"]:
                x = out[0].float()
                x = torch.where(torch.isnan(x), self.mean.expand_as(x), x)
                out[0] = (x - self.mean) * self.inv_std
            return tuple(out)
        return raw

    def encode_rows(self, rows: Any) -> tuple[torch.Tensor, ...]:
        """A ``files`` model's raw inputs from rows of its file (dicts, as
        ``csv.DictReader`` or ``json.loads`` give them): the numeric columns as floats
        (an empty or missing value: NaN, filled by the model), each categorical value as
        its id (0: not seen in training, or missing)."""
        if self.kind != "files":
            raise TypeError(f"encode_rows is for models of your own files, not {self.kind}")
        rows = list(rows)
        columns = [*self.pipeline["features"], *self.pipeline.get("categories", [])]
        for i, r in enumerate(rows):
            if not hasattr(r, "get") or (columns and not any(c in r for c in columns)):
                shown = ", ".join(columns[:4]) + (", …" if len(columns) > 4 else "")
                raise ValueError(f"row {i}: none of the model's columns ({shown}); give each "
                                 "row as a dict keyed by the training file's column names")
        out: list[torch.Tensor] = []
        if self.pipeline["features"]:
            out.append(torch.tensor([[_number(r.get(f), i, f) for f in self.pipeline["features"]]
                                     for i, r in enumerate(rows)],
                                    dtype=torch.float32).reshape(len(rows), -1))
        if self._ids:
            cols = list(self.pipeline["categories"])
            out.append(torch.tensor([[ids.get(_cell(r.get(c)), 0) for c, ids in
                                      zip(cols, self._ids)] for r in rows],
                                    dtype=torch.long).reshape(len(rows), -1))
        return tuple(out)

    @torch.no_grad()
    def predict_rows(self, rows: Any) -> list[Any]:
        """The model's answer per row (see :meth:`encode_rows`): a classifier's label
        names (the training file's values, as text), a regression's numbers; ``[]`` for
        no rows.

        Raises:
            ValueError: a row with none of the model's columns, or a numeric cell that is
                text or not finite (row and column named)."""
        rows = list(rows)
        if not rows:
            return []
        out = self(*self.encode_rows(rows))
        names = self.pipeline.get("label_names") or []
        if self.pipeline.get("task") == "regress" or not names:
            return out.reshape(len(out), -1)[:, 0].tolist()
        return [names[i] for i in out.argmax(-1).tolist()]

    def forward(self, *raw: torch.Tensor) -> torch.Tensor:
        return self.network(*self.prepare(*raw))


def _cell(value: Any) -> str:
    """A categorical value as text (``3`` and ``"3"`` alike; a whole float as its int)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return "" if value is None else str(value).strip()


def _number(value: Any, row: int = 0, column: str = "") -> float:
    """A numeric cell: a number, or text that reads as one; NaN when missing or empty
    (the model fills it). Text that is not a number, or a value that is not finite
    (``inf``, ``1e400``), is refused naming ``row`` and ``column``: the model would
    answer NaN for it."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return math.nan
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"row {row}, column {column!r}: {value!r} is not a number (leave "
                         "the cell empty for a missing value)") from None
    if math.isnan(number):
        return number  # "nan": missing, as empty
    if not math.isfinite(number):
        raise ValueError(f"row {row}, column {column!r}: {value!r} is not a finite number")
    return number


def bake_tokenizer(path: Any, seq_len: int, pad_id: int = 0) -> None:
    """Make the ``tokenizer.json`` at ``path`` pad and truncate (longest part first) to
    ``seq_len`` by itself, as the training data was encoded
    (:meth:`comera_engine.data.tokenizer.WordPieceTokenizer.encode_pairs`)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    pad = tok.id_to_token(pad_id) or "[PAD]"
    tok.enable_truncation(max_length=seq_len, strategy="longest_first")
    tok.enable_padding(length=seq_len, pad_id=pad_id, pad_token=pad)
    tok.save(str(path))


def wrap(network: nn.Module, pipeline: Mapping[str, Any] | None) -> nn.Module:
    """``network`` behind ``pipeline`` (itself when there is none, or for ``tokens``:
    the tokenizer does that preparation)."""
    if pipeline is None or pipeline.get("kind") == "tokens":
        return network
    return RawInputs(network, pipeline).to(next(network.parameters()).device).eval()


def raw_example(pipeline: Mapping[str, Any], args: tuple[torch.Tensor, ...], seed: int = 0
                ) -> tuple[torch.Tensor, ...]:
    """Raw inputs shaped like the network's example ``args`` (for tracing and checking
    the ONNX graph): pixels 0..16 spread as the training images', counts, hash values
    with some missing."""
    g = torch.Generator().manual_seed(seed)
    if pipeline["kind"] == "pixels":  # like the training images: mean ± std per pixel
        mean = torch.tensor(pipeline["mean"])
        std = torch.tensor(pipeline["std"])
        z = torch.randn(args[0].shape, generator=g)
        x = ((mean + std * z) / float(pipeline["scale"])).round()
        return (x.clamp(0, round(1 / float(pipeline["scale"]))),)
    if pipeline["kind"] == "files":  # numbers like the training split's, a few missing
        out = list(args)
        if pipeline["features"]:
            mean, std = torch.tensor(pipeline["mean"]), torch.tensor(pipeline["std"])
            x = mean + std * torch.randn(args[0].shape, generator=g)
            x[torch.rand(x.shape, generator=g) < 0.1] = math.nan
            out[0] = x
        return tuple(out)
    if pipeline["kind"] == "criteo":
        dense, sparse = args
        counts = torch.randint(0, 1000, dense.shape, generator=g).float()
        hashes = torch.randint(-1, 2**31 - 1, sparse.shape, generator=g)
        return counts, hashes
    return args
