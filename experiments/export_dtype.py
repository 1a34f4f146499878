"""What `comera export --dtype bf16|int8` gives on the digits TT MLP: file, tensor,
input-statistics and header bytes of the compressed export and the ONNX file's bytes,
each against the float32 export's (`ratio_vs_float32`: file bytes over the float32
file's), and eval accuracy on the raw eval split through `comera_engine.load` and
onnxruntime; at the shipped config's 60x (3,930 weights: header and statistics weigh
most) and at 2x (where the cores are most of the file).

    python experiments/export_dtype.py        # -> experiments/results/export_dtype.json
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import machine  # noqa: E402

import comera_engine  # noqa: E402
from comera_engine.cli import main as cli  # noqa: E402
from comera_engine.data.digits import read_digits, stratified_split  # noqa: E402
from comera_engine.export import export_run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "experiments" / "results" / "export_dtype.json"
RUNS = {"60x (shipped config)": [], "2x": ["comera.target_compression=2"]}


def main() -> int:
    import onnxruntime as ort

    pixels, labels = read_digits()
    _, test = stratified_split(labels, 0.2, 0)
    x, y = pixels[test].astype(np.float32), labels[test]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, sets in RUNS.items():
            run = Path(tmp) / name.split()[0]
            argv = ["train", str(ROOT / "experiments/configs/digits_tt_mlp.toml"),
                    "--no-store", "--no-progress", "--run-dir", str(run)]
            for s in sets:
                argv += ["--set", s]
            assert cli(argv) == 0
            for dtype in ("float32", "bf16", "int8"):
                st = export_run(run, format="compressed", out=run / f"{dtype}.safetensors",
                                dtype=dtype)
                ox = export_run(run, format="onnx", out=run / f"{dtype}.onnx", dtype=dtype)
                with torch.no_grad():
                    acc = float((comera_engine.load(st.path)(torch.from_numpy(x)).argmax(1)
                                 .numpy() == y).mean())
                sess = ort.InferenceSession(str(ox.path), providers=["CPUExecutionProvider"])
                acc_onnx = float((sess.run(None, {sess.get_inputs()[0].name: x})[0]
                                  .argmax(1) == y).mean())
                ref = next((r for r in rows if r["run"] == name and r["dtype"] == "float32"),
                           None)
                rows.append({"run": name, "dtype": dtype, "file_bytes": st.file_bytes,
                             "tensor_bytes": st.tensor_bytes, "input_bytes": st.input_bytes,
                             "header_bytes": st.header_bytes,
                             "ratio_vs_float32": round(st.file_bytes / ref["file_bytes"], 4)
                             if ref else 1.0,
                             "onnx_file_bytes": ox.file_bytes, "acc_load": acc,
                             "acc_onnx": acc_onnx,
                             "onnx_max_rel_diff_vs_float32":
                                 ox.metadata["onnx"].get("max_rel_diff_vs_float32")})
                print(rows[-1], file=sys.stderr)
    OUT.write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1))
    print(f"wrote {OUT}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
