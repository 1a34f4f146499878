"""Export and import of trained models: the small model you ship.

>>> res = export_model(model, "out/", "compressed", {"config": cfg.to_dict(),
...                    "data_spec": data_spec_from_bundle(bundle)})
>>> model2 = load(res.path)          # same outputs, no pickle

Formats (``FORMATS``):

* ``compressed``: safetensors with the physically truncated TT cores (gates absorbed) and
  the dense parameters; its tensor bytes equal ``size_report``'s effective size.
* ``dense``: the dense baseline of the same architecture with the TT weights multiplied
  out: a plain ``nn.Linear``/``nn.Embedding`` state dict.
* ``onnx``: TT layers as MatMuls over their cores (no dense weight in the file), checked
  against PyTorch with onnxruntime when it is installed.

Every export gets a markdown model card beside it (``<file>.md``) and, for text models,
the tokenizer (``<file>.tokenizer.json``, padding and truncating to the model's length).
Exports carry their input pipeline (:mod:`comera_engine.export.pipeline`): the loaded
model and the ONNX graph take raw data (digits pixels 0..16, Criteo counts and hashes)
and prepare it as the run did; the card says what to feed. ``load`` refuses bad,
truncated or hostile files with a :class:`BadExportFile` (a ``ConfigError``, hence
``ValueError``) naming the file; nothing in a file is executed. ``export_run`` exports a
run's checkpoint and ``add_subparsers`` registers ``comera export``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from comera_engine._lazy import lazy_getattr
from comera_engine.export.cli import add_subparsers
from comera_engine.export.container import FORMATS, BadExportFile

if TYPE_CHECKING:  # pragma: no cover
    from comera_engine.export.core import ExportResult, export_model, load, read_metadata
    from comera_engine.export.run import cmd_export, export_run, load_run_model
    from comera_engine.export.spec import data_spec_from_bundle

# torch loads with these, on first use (``comera --help`` and the light commands stay fast)
_LAZY = {"ExportResult": "core", "export_model": "core", "load": "core",
         "read_metadata": "core", "cmd_export": "run", "export_run": "run",
         "load_run_model": "run", "data_spec_from_bundle": "spec"}
__getattr__ = lazy_getattr(__name__, _LAZY)

__all__ = [
    "FORMATS",
    "BadExportFile",
    "ExportResult",
    "add_subparsers",
    "cmd_export",
    "data_spec_from_bundle",
    "export_model",
    "export_run",
    "load",
    "load_run_model",
    "read_metadata",
]
