"""``comera export``'s arguments, torch-free: the command's work (and torch) loads only
when it runs (:func:`comera_engine.export.run.cmd_export`)."""

from __future__ import annotations

import argparse
from typing import Any

from comera_engine.export.container import FORMATS


def add_subparsers(subparsers: Any) -> None:
    """Register ``comera export RUN [--checkpoint C] --format F --out PATH [--store DB]``."""
    p = subparsers.add_parser(
        "export", help="export a trained run: compressed / dense safetensors or ONNX",
        description="Export a run's checkpoint. compressed: truncated TT cores + dense "
        "parameters (load with comera_engine.load); dense: plain nn.Linear/nn.Embedding "
        "state dict; onnx: TT layers as core contractions. A model card (<file>.md) is "
        "written beside the export.")
    p.add_argument("run", help="run folder, or a run id / name in the store")
    p.add_argument("--checkpoint", default=None,
                   help="step number, step_XXXXXX or a checkpoint path (default: newest)")
    p.add_argument("--format", choices=FORMATS, default="compressed",
                   help="compressed (default), dense or onnx")
    p.add_argument("--out", required=True,
                   help="output file (.safetensors / .onnx) or folder")
    p.add_argument("--store", default=None, help="run store database (for run ids)")
    # checked by the command itself: a bad value is one line and exit 2, like the others
    p.add_argument("--dtype", default="float32", metavar="{float32,bf16,int8}",
                   help="how the weights are stored: float32 (default), bf16, or int8 with "
                   "a scale per TT core / per row / per vector")
    p.add_argument("--no-verify", action="store_true",
                   help="onnx: skip the onnxruntime comparison")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_cmd_export)




def _cmd_export(args: argparse.Namespace) -> int:
    from comera_engine.export.run import cmd_export

    return cmd_export(args)
