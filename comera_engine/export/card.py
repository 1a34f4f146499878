"""The model card: a markdown file beside every export (``<file>.md``).

A safetensors export's header holds only what ``comera_engine.load`` needs; what
describes the export (:data:`PROVENANCE`: run, config, data set, metrics, sizes, library,
time) is in its card, readable, and once more as a JSON block at its end, which
:func:`read_card_metadata` reads back (``comera_engine.export.read_metadata`` adds it).
"""

from __future__ import annotations

import json
import math
import os
import re
import string
from pathlib import Path
from typing import Any

from comera_engine.config import loads_json
from comera_engine.export.quant import INT8_SCALES
from comera_engine.metrics import SCOPE_LABELS, compression_scope, format_metric
from comera_engine.rank.schedule import method_label

__all__ = ["BYTES_RATIO_LABEL", "PROVENANCE", "compression_line", "model_card",
           "read_card_metadata"]

#: How the bytes ratio of an export is named wherever it is shown (the CLI, the card,
#: the Export page): another quantity than the compression, which counts parameters.
BYTES_RATIO_LABEL = "file bytes vs dense model bytes"

#: The metadata a safetensors export keeps in its card rather than in its header.
PROVENANCE = ("name", "created", "library", "config", "dataset", "metrics", "run", "sizes")
_BLOCK = "## Metadata"
_MAX_CARD_BYTES = 16 * 1024 * 1024


def _text(value: Any) -> str:
    """``value`` as Markdown text that reads as typed (a run's or a config's name): every
    ASCII punctuation mark backslash-escaped (CommonMark lets any be), line breaks as
    spaces, so ``**a**`` or ``[x](http://…)`` in a name is not drawn bold or as a link."""
    text = " ".join(str(value).splitlines())
    return "".join("\\" + c if c in string.punctuation else c for c in text)


def _code(value: Any) -> str:
    """``value`` as a Markdown code span that holds it whole: fenced by one backtick more
    than its longest run of them, padded by a space where it starts or ends with one."""
    text = " ".join(str(value).splitlines())
    fence = "`" * (max((len(r) for r in re.findall("`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _bytes(n: float | int | None) -> str:
    if n is None:
        return "?"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"  # pragma: no cover


def _ratio(x: Any) -> str:
    if x is None:
        return "?"
    if isinstance(x, str) or not math.isfinite(float(x)):
        return "∞ (all ranks pruned)"
    return f"{float(x):,.1f}×"


def _num(x: Any) -> str:
    return f"{int(x):,}" if isinstance(x, (int, float)) else str(x)


def _metric(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


#: What the two texts of a pair are, per text data set (the order the model was trained
#: on); a data set not named here encodes single texts.
PAIRS = {"reviews": ("titles", "review texts"), "snli": ("premises", "hypotheses"),
         "mnli": ("premises", "hypotheses"), "nli": ("premises", "hypotheses")}


def _encode_code(tokenizer: str, data_name: str | None) -> list[str]:
    """The exact encoding of raw text for a ``tokens`` pipeline: a function ``encode``
    that gives the model's three inputs as int64 arrays (the tests run this code)."""
    first, second = PAIRS.get(str(data_name), ("texts", None))
    sig = f"{first.replace(' ', '_')}, {second.replace(' ', '_')}" if second else \
        first.replace(" ", "_")
    zipped = (f"list(zip({sig}))" if second else f"list({sig})")
    return ["```python", "import numpy as np", "from tokenizers import Tokenizer", "",
            f'tok = Tokenizer.from_file("{tokenizer}")  # pads and truncates by itself', "",
            "", f"def encode({sig}):",
            f'    """{first}{f" and their {second}" if second else ""} (lists of str) -> '
            'the model\'s inputs."""',
            f"    enc = tok.encode_batch({zipped})",
            '    return {"input_ids": np.array([e.ids for e in enc], dtype=np.int64),',
            '            "token_type_ids": np.array([e.type_ids for e in enc], '
            'dtype=np.int64),',
            '            "attention_mask": np.array([e.attention_mask for e in enc], '
            'dtype=np.int64)}',
            "```", ""]


def _rows_source(doc: dict[str, Any]) -> tuple[str, str]:
    """(the file whose rows a ``files`` model's card reads, which rows give the run's
    figure): the eval file, else the training file's seeded split."""
    data = (doc.get("config") or {}).get("data") or {}
    if data.get("eval"):
        name = Path(str(data["eval"])).name
        return name, (f"{_code(name)} is the run's eval split: its rows give the run's eval "
                      "figures (the card's metrics below).")
    name = Path(str(data.get("train") or "train.csv")).name
    return name, (f"The run's eval figures are on a seeded split of {_code(name)} "
                  f"(`data.split_fraction` {data.get('split_fraction', 0.8)}, `data.seed` "
                  f"{data.get('seed', 0)}), not on all its rows.")


def _files_encode_code() -> list[str]:
    """The encoding of rows for an ONNX ``files`` model, from the graph's own metadata
    (numpy only; the tests run this code)."""
    return ["```python", "import json", "import numpy as np", "import onnx", "",
            "meta = {p.key: p.value for p in onnx.load(ONNX_FILE).metadata_props}",
            'pipe = json.loads(meta["comera"])["input_pipeline"]', "", "",
            "def cell(v):", '    """A categorical value as text ("3" and 3 alike)."""',
            "    if isinstance(v, float) and v.is_integer():", "        v = int(v)",
            '    return "" if v is None else str(v).strip()', "", "",
            "def number(v):", "    try:", "        return float(v)",
            "    except (TypeError, ValueError):",
            "        return np.nan  # missing or empty: the model fills it", "", "",
            "def encode(rows):",
            '    """Rows of the file (dicts, as csv.DictReader gives them) -> the inputs."""',
            "    inputs = {}",
            '    if pipe["features"]:',
            '        inputs["x"] = np.array([[number(r.get(f)) for f in pipe["features"]]',
            "                                for r in rows], dtype=np.float32)",
            '    if pipe["categories"]:',
            '        ids = [{cell(v): i + 1 for i, v in enumerate(values)}',
            '               for values in pipe["categories"].values()]',
            '        inputs["categorical"] = np.array(',
            '            [[m.get(cell(r.get(c)), 0) for c, m in zip(pipe["categories"], ids)]',
            "             for r in rows], dtype=np.int64)",
            "    return inputs", "```", ""]


def _inputs(result: Any, doc: dict[str, Any]) -> list[str]:
    """What the model takes: the raw inputs of its pipeline, and how to prepare them."""
    pipe = doc.get("input_pipeline")
    onnx = result.format == "onnx"
    lines = ["## Inputs", ""]
    if pipe is None:
        fam = (doc.get("model") or {}).get("family")
        if fam is None:
            return lines + ["The model takes what the exported module took.", ""]
        ds = ((doc.get("model") or {}).get("data_spec") or {}).get("name")
        return lines + [f"The model takes the prepared features of the `{ds}` data set "
                        f"(`comera_engine.data.build_dataset({{\"name\": \"{ds}\", ...}})` "
                        "builds them from the raw files, with the training split's "
                        "statistics); raw values give wrong answers.", ""]
    lines += [f"Raw inputs: {pipe.get('raw')}."]
    if pipe["kind"] == "pixels":
        lines += ["The model standardises them itself (`x/16`, then the training split's "
                  "per-pixel mean and standard deviation, stored in the file).", "",
                  "```python", "from sklearn.datasets import load_digits", "",
                  "x = load_digits().data  # float64 [1797, 64], values 0..16", "```", ""]
    elif pipe["kind"] == "criteo":
        lines += ["The model applies `log(1 + max(x, 0))` to the counts and hashes the "
                  "categorical values into its tables itself. One Criteo TSV line:", "",
                  "```python", 'fields = line.rstrip("\\n").split("\\t")  '
                  "# label, I1..I13, C1..C26",
                  "dense = [float(v) if v else 0.0 for v in fields[1:14]]",
                  "sparse = [int(v, 16) if v else -1 for v in fields[14:40]]", "```", ""]
    elif pipe["kind"] == "files":
        source, split = _rows_source(doc)
        lines += ["The model fills a missing number with the training split's mean and "
                  "standardises with its mean and standard deviation itself; "
                  "`model.predict_rows(rows)` and `model.encode_rows(rows)` also map each "
                  "categorical value to its id (all stored in the file). Give it your "
                  "file's rows as a CSV reader gives them (the label column may stay "
                  f"in). {split}", "", "```python", "import csv", "",
                  f'with open("{source}", newline="") as f:',
                  "    rows = list(csv.DictReader(f))  # list of dicts of str", "```", ""]
        if onnx:
            lines += ["Encode them for the graph (what `model.encode_rows(rows)` does in "
                      "PyTorch):", ""]
            lines += [x.replace("ONNX_FILE", f'"{result.path.name}"')
                      for x in _files_encode_code()]
    elif result.tokenizer is not None:
        ds = ((doc.get("model") or {}).get("data_spec") or {}).get("name")
        lines += [f"Encode text with the tokenizer shipped beside the model "
                  f"(`{result.tokenizer.name}`, the `tokenizers` library; "
                  f"{pipe.get('seq_len')} tokens):", ""]
        lines += _encode_code(result.tokenizer.name, ds)
    else:
        lines += ["No tokenizer was exported with this model (the run kept none): the "
                  "token ids must come from the run's own tokenizer.", ""]
    if not onnx and pipe["kind"] != "tokens":
        lines += ["`model.network` is the bare network (it takes prepared features; "
                  "`model.prepare(*raw)` gives them).", ""]
    return lines


def _usage(result: Any, doc: dict[str, Any]) -> list[str]:
    name = result.path.name
    fam = (doc.get("model") or {}).get("family")
    onnx = doc.get("onnx") or {}
    pipe = doc.get("input_pipeline") or {}
    kind = pipe.get("kind")
    lines = _inputs(result, doc) + ["## How to load it", ""]
    if result.format == "onnx":
        shapes, dtypes = onnx.get("input_shapes", {}), onnx.get("input_dtypes", {})
        lines += ["Run it with onnxruntime (no PyTorch needed):", "", "```python",
                  "import numpy as np", "import onnxruntime as ort", "",
                  f'session = ort.InferenceSession("{name}")']
        outs = ", ".join(onnx.get("outputs", ["out"]))
        if kind == "tokens" and result.tokenizer is not None:
            lines += [f"({outs},) = session.run(None, encode(...))  # encode: above"]
        elif kind == "files":
            lines += [f"({outs},) = session.run(None, encode(rows))  # rows, encode: above"]
            if pipe.get("task") != "regress" and pipe.get("label_names"):
                lines += [f"labels = [{pipe['label_names']!r}[i] for i in "
                          f"{outs.split(',')[0]}.argmax(-1)]"]
        else:
            lines += ["inputs = {"]
            for n in onnx.get("inputs", []):
                shp = shapes.get(n, [])
                dt = "np.int64" if "int" in str(dtypes.get(n, "")) else "np.float32"
                what = {"x": "x", "dense": "np.array([dense])",
                        "sparse": "np.array([sparse])"}.get(n) if kind else None
                if what:
                    lines.append(f'    "{n}": np.asarray({what}, dtype={dt}),')
                else:
                    fill = "ones" if n == "attention_mask" else "zeros"
                    lines.append(f'    "{n}": np.{fill}({tuple(shp)}, dtype={dt}),')
            lines += ["}", f"({outs},) = session.run(None, inputs)"]
        lines += ["```", ""]
        axes = onnx.get("dynamic_axes") or {}
        if axes:
            dyn = ", ".join(f"{k}: {sorted(v.values())}" for k, v in axes.items())
            lines += [f"Dynamic axes: {dyn}.", ""]
        return lines
    lines += ["```python", "import torch", "import comera_engine", "",
              f'model = comera_engine.load("{name}")  # safetensors only: no pickle',
              "model.eval()"]
    if kind == "tokens" and result.tokenizer is not None:
        lines += ["inputs = encode(...)  # encode: above",
                  "logits = model(*(torch.from_numpy(v) for v in inputs.values()))"]
    elif kind == "pixels":
        lines += ["logits = model(torch.as_tensor(x, dtype=torch.float32))  # raw pixels"]
    elif kind == "criteo":
        lines += ["logit = model(torch.tensor([dense]), torch.tensor([sparse]))  # raw row"]
    elif kind == "files":
        lines += ["labels = model.predict_rows(rows)  # rows: above; label names "
                  "(a regression: numbers)" if pipe.get("task") != "regress" else
                  "y = model.predict_rows(rows)  # rows: above",
                  "logits = model(*model.encode_rows(rows))  # the outputs themselves"]
    elif fam in ("transformer_cls", "transformer_mlm"):
        lines += ["logits = model(input_ids, token_type_ids, attention_mask)  # int64 [B, L]"]
    elif fam == "dlrm":
        lines += ["logit = model(dense, sparse)  # float [B, num_dense], int64 [B, num_sparse]"]
    elif fam == "tt_mlp":
        lines += ["logits = model(x)  # float [B, input_dim]"]
    else:
        lines += ["y = model(x)"]
    lines += ["```", ""]
    if result.format == "dense":
        lines += ["The file is a plain `state_dict` (`nn.Linear`/`nn.Embedding` with the "
                  "reconstructed TT weights) of the dense baseline of the same architecture; "
                  "`safetensors.torch.load_file` reads it directly, and the JSON metadata "
                  "(`safetensors.safe_open(...).metadata()['comera']`) holds the recipe "
                  "that rebuilds it (the input statistics are the tensors `meta:<key>`).",
                  ""]
    else:
        lines += ["TT layers come back as `TTLinear`/`TTEmbedding` at the exported ranks "
                  "(gates absorbed, set to 1). `comera_engine.export.read_metadata(path)` "
                  "returns the file's metadata and this card's JSON block without loading "
                  "the weights.", ""]
    return lines


def _provenance(doc: dict[str, Any]) -> list[str]:
    """The JSON block that ends a safetensors export's card."""
    block = {k: doc[k] for k in PROVENANCE if doc.get(k) is not None}
    return [_BLOCK, "", "What this export records besides its weights (the file itself "
            "holds only what `comera_engine.load` needs):", "", "```json",
            json.dumps(block, indent=1, allow_nan=False), "```", ""]


def read_card_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON block of a model card (``{}`` when the card is missing, too large, or has
    no readable block)."""
    p = Path(path)
    try:
        if not p.is_file() or p.stat().st_size > _MAX_CARD_BYTES:
            return {}
        text = p.read_text(encoding="utf-8")
        start = text.index("```json\n", text.rindex(f"\n{_BLOCK}\n")) + len("```json\n")
        doc = loads_json(text[start: text.index("\n```", start)])
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _target_line(doc: dict[str, Any]) -> str | None:
    """The run's requested compression against what this file holds, in the target's
    scope, counted as ``size_report`` counts it (the trainer's ``compression/*``):
    "target 10x · reached 10.2x (+2 %)" or "... missed by X %" (``None``: no target). A
    run's checkpoint from before its last step gets no verdict: where it stood then."""
    from comera_engine.metrics import format_ratio, target_outcome

    comera = (doc.get("config") or {}).get("comera") or {}
    target = comera.get("target_compression")
    if target is None:
        target = (doc.get("metrics") or {}).get("compression/target")
    if target is None or comera.get("enabled") is False:
        return None
    scope = comera.get("target_scope", "tensorized")
    reached = ((doc.get("sizes") or {}).get(scope) or {}).get("compression")
    if not isinstance(reached, (int, float)) or not math.isfinite(reached):
        return None
    step = (doc.get("run") or {}).get("step")
    steps = ((doc.get("config") or {}).get("train") or {}).get("steps")
    if isinstance(step, int) and isinstance(steps, int) and 0 <= step < steps:
        return (f"target {float(target):g}x · {format_ratio(float(reached), 'x')} in this "
                f"checkpoint, at step {step:,} of the run's {steps:,} (the target is judged "
                "at the run's last step)")
    return target_outcome(float(target), float(reached))


def _figures(result: Any) -> tuple[str, str, str]:
    """The export's compression in the run's scope, in the other scope, and its bytes
    ratio, each with its name: ``("60.6× (TT layers)", "21.6× (whole model)",
    "file bytes vs dense model bytes 20.0×")``."""
    doc = result.metadata or {}
    sizes = result.sizes or doc.get("sizes") or {}
    scope = compression_scope(doc.get("config"))
    other = "model" if scope == "tensorized" else "tensorized"
    mine, theirs = ((sizes.get(s) or {}).get("compression") for s in (scope, other))
    dense_b = (sizes.get("model") or {}).get("dense_bytes")
    ratio = _ratio(dense_b / result.file_bytes) if dense_b and result.file_bytes else "?"
    return (f"{_ratio(mine)} ({SCOPE_LABELS[scope]})", f"{_ratio(theirs)} ({SCOPE_LABELS[other]})",
            f"{BYTES_RATIO_LABEL} {ratio}")


def compression_line(result: Any) -> str:
    """What ``comera export`` prints of the sizes: the run's one compression with its
    scope, the other scope's, and the bytes ratio, each named."""
    mine, theirs, by_bytes = _figures(result)
    return f"compression {mine}, {theirs}; {by_bytes}"


def _stored_words(doc: dict[str, Any]) -> str:
    dtype = (doc.get("storage") or {}).get("dtype", "float32")
    return f"int8 with {INT8_SCALES}" if dtype == "int8" else str(dtype)


def _rest(result: Any) -> str:
    """What the file holds besides the model's tensors."""
    stats = (f"{result.input_bytes:,} bytes of input statistics and " if getattr(
        result, "input_bytes", 0) else "")
    return f"plus {stats}a {result.header_bytes:,}-byte header"


def model_card(result: Any, sha256: str) -> str:
    """Markdown for an :class:`~comera_engine.export.core.ExportResult`."""
    doc = result.metadata
    sizes = doc.get("sizes") or {}
    m = sizes.get("model") or {}
    recipe = doc.get("model") or {}
    cfg = recipe.get("model_config") or {}
    title = doc.get("name") or recipe.get("family") or "model"
    lines = [f"# Model card: {_text(title)}", ""]
    what = recipe.get("family") or "module tree (nn.Sequential)"
    preset = f" (preset `{cfg['preset']}`)" if cfg.get("preset") else ""
    if what == "custom":  # a user model: rebuilt by its factory (COMERA_MODELS lists it)
        kwargs = json.dumps(cfg.get("kwargs") or {}, sort_keys=True)
        preset = (f" (factory `{cfg.get('factory')}`, kwargs `{kwargs}`, tensorize "
                  f"`{json.dumps(cfg.get('tensorize') or {}, sort_keys=True)}`; "
                  "`comera_engine.load` imports that module: keep it on the path)")
    elif recipe.get("builder") == "graph":  # a network of the user's own class, as traced
        what = recipe.get("class", "model")
        preset = " (your own class, traced: the ONNX graph is the whole model)"
    lines += [
        f"- **Model**: `{what}`{preset}",
        f"- **Task**: {(recipe.get('data_spec') or {}).get('task', '?')}",
        f"- **Trained by**: {method_label(doc.get('config'))} (docs/METHODS.md)",
        f"- **Format**: `{result.format}` ({doc.get('format')} v{doc.get('format_version')})",
        f"- **File**: {_code(result.path.name)}, {_bytes(result.file_bytes)} "
        f"({result.file_bytes:,} bytes), sha256 `{sha256}`",
        f"- **Created**: {doc.get('created')} with comera-studio "
        f"{(doc.get('library') or {}).get('version')} (torch "
        f"{(doc.get('library') or {}).get('torch')})",
        f"- **dtype**: {doc.get('dtype')} (computes in); weights stored as "
        f"{_stored_words(doc)}",
        "",
    ]
    run = doc.get("run") or {}
    if run:
        bits = [f"{k} {_code(run[k])}" for k in ("id", "name", "step", "checkpoint")
                if run.get(k) is not None]
        lines += [f"- **Run**: {', '.join(bits)}", ""]

    lines += ["## Size", "",
              "| | parameters | bytes |", "|---|---:|---:|",
              f"| dense model | {_num(m.get('dense_params'))} | {_bytes(m.get('dense_bytes'))} |",
              f"| compressed model (effective ranks) | {_num(m.get('effective_params'))} | "
              f"{_bytes(m.get('effective_bytes'))} |",
              f"| this file ({result.format}) | | {_bytes(result.file_bytes)} |", ""]
    scope = compression_scope(doc.get("config"))
    other = "model" if scope == "tensorized" else "tensorized"
    mine, theirs = sizes.get(scope) or {}, sizes.get(other) or {}
    shown, other_shown, by_bytes = _figures(result)
    if result.format == "dense":  # the file holds every weight: the model's figure is not it
        lines += [f"**This file is dense**: every weight stored, {by_bytes}. The model's "
                  "compression below is what its compressed export (`--format "
                  "compressed`, or ONNX) keeps.", ""]
    lines += [f"**Compression: {shown}**, "
              f"dense / effective parameters of the {SCOPE_LABELS[scope]} "
              f"({_num(mine.get('dense_params'))} → {_num(mine.get('effective_params'))}): "
              "the scope the run's target is asked in (`comera.target_scope`), the figure "
              f"the studio and `comera runs` show. Other scope: {other_shown} "
              f"({_num(theirs.get('dense_params'))} → {_num(theirs.get('effective_params'))}"
              f"). Bytes, another quantity: {by_bytes}.", ""]
    outcome = _target_line(doc)
    if outcome:
        lines += [f"**Target** ({SCOPE_LABELS[scope]}): {outcome}.", ""]
    stored = (doc.get("storage") or {}).get("dtype", "float32")
    if result.format == "compressed" and stored != "float32":
        lines += [f"The file holds {result.tensor_bytes:,} bytes of tensors: the weights in "
                  f"{_stored_words(doc)}, against `size_report`'s "
                  f"{_bytes(m.get('effective_bytes'))} in float32, {_rest(result)}. "
                  "`comera_engine.load` gives the weights back in float32 (q · scale).", ""]
    elif result.format == "compressed":
        lines += [f"The file holds {result.tensor_bytes:,} bytes of tensors, equal to "
                  f"`size_report`'s effective size ({result.expected_bytes:,} bytes), "
                  f"{_rest(result)}.", ""]
    elif result.format == "onnx":
        onnx = doc.get("onnx") or {}
        diff = onnx.get("max_abs_diff")
        check = (f"onnxruntime reproduces the PyTorch outputs to {diff:.2g} (max abs)"
                 if diff is not None else "not checked with onnxruntime (not installed)")
        lines += [f"TT layers are exported as their contractions (MatMuls over the cores); "
                  f"initializers: {onnx.get('initializers')} tensors, "
                  f"{_bytes(onnx.get('initializer_bytes'))} "
                  f"({result.tensor_bytes:,} bytes, weights in {stored}). {check}.", ""]
        if onnx.get("max_rel_diff_vs_float32") is not None:
            lines += [f"Outputs differ from the float32 model's by at most "
                      f"{onnx['max_rel_diff_vs_float32']:.2g} (max abs, relative to "
                      "max(1, max |output|)) on the traced example.", ""]

    layers = getattr(result, "layers", None) or doc.get("tt_layers") or []
    if layers:
        lines += ["## Ranks per TT layer", "",
                  "| layer | kind | shape | factors | allocated ranks | effective ranks | "
                  "dense params | TT params | compression |",
                  "|---|---|---|---|---|---|---:|---:|---:|"]
        for r in layers:
            f = r.get("factors") or [[], []]
            lines.append(
                f"| `{r.get('name')}` | {r.get('kind')} | {'×'.join(map(str, r.get('shape')))} "
                f"| {f[0]} \\| {f[1]} | {r.get('allocated_ranks')} | {r.get('ranks')} "
                f"| {_num(r.get('dense_params'))} | {_num(r.get('effective_params'))} "
                f"| {_ratio(r.get('compression'))} |")
        lines.append("")
    else:
        lines += ["No TT layers (a dense model).", ""]

    metrics = doc.get("metrics") or {}
    lines += ["## Accuracy and final metrics", ""]
    if metrics:
        keys = sorted(metrics, key=lambda k: (not k.startswith("eval/"), k))
        shown = [k for k in keys if k.startswith(("eval/", "acc/", "loss/"))] or keys
        lines += ["| metric | value |", "|---|---:|"]
        lines += [f"| {k} | {format_metric(k, metrics[k]) or _metric(metrics[k])} |"
                  for k in shown[:24]]
    else:
        lines += ["No metrics were recorded with this export."]
    lines.append("")

    ds = doc.get("dataset") or {}
    spec = recipe.get("data_spec") or {}
    if ds or spec:
        lines += ["## Data", ""]
        if ds:
            lines += [f"- dataset `{ds.get('name')}` from {ds.get('source')}, examples "
                      f"{ds.get('num_examples')}, seed {ds.get('seed')}",
                      f"- fingerprint `{ds.get('fingerprint')}`"]
        if spec:
            shape = {k: spec.get(k) for k in ("task", "num_classes", "vocab_size", "seq_len")
                     if spec.get(k) is not None}
            lines.append(f"- model inputs: {shape}")
        tok = doc.get("tokenizer")
        if tok:
            lines.append(f"- tokenizer `{tok.get('file')}` (sha256 `{tok.get('sha256')}`)")
        lines.append("")
    lines += _usage(result, doc)
    if result.format != "onnx":  # an ONNX file keeps all of its metadata itself
        lines += _provenance(doc)
    return "\n".join(lines).rstrip() + "\n"
