"""Export: pick a run and a checkpoint, a format, and download the model."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import streamlit as st

from app.lib import fmt, runs, ui
from comera_engine.export.card import BYTES_RATIO_LABEL
from comera_engine.metrics import SCOPE_LABELS, compression_scope

FORMAT_HELP = {
    "compressed": "Truncated TT cores + dense parameters (safetensors). The small model: "
                  "load it with `comera_engine.load()`.",
    "dense": "The same network with the TT weights multiplied out: a plain nn.Linear / "
             "nn.Embedding state dict (safetensors) for tools that know no TT.",
    "onnx": "ONNX graph with the TT layers as MatMuls over their cores (no dense weight "
            "stored), checked against PyTorch with onnxruntime.",
}

store = ui.store_page(
    "Export",
    "Turn a checkpoint into the file you ship: compressed TT, dense, or ONNX, with a model "
    "card. Files are written inside the run store and downloaded through the browser.",
    ":material/download:",
)
all_runs = ui.runs_or_stop(store, "Exports are made from run checkpoints.", "export")

with_ckpt = [(r, runs.checkpoints(store, r["id"])) for r in all_runs]
with_ckpt = [(r, c) for r, c in with_ckpt if c]
if not with_ckpt:
    st.info(
        "No checkpoints yet. A run writes one every `ckpt_every` steps, at the stage switch, "
        "when it is stopped and when it finishes. Watch a run on **Live run** and come back.",
        icon=":material/hourglass_empty:",
    )
    if st.button("Open Live run", icon=":material/monitoring:"):
        st.switch_page(ui.LIVE_PAGE)
    st.stop()

ckpts_of = {r["id"]: c for r, c in with_ckpt}
run = ui.pick_run(store, "Run", "exp-run", [r for r, _ in with_ckpt],
                  offered="runs with a checkpoint")
assert run is not None
rid = run["id"]
ckpts = ckpts_of[rid]

try:
    from comera_engine.export import FORMATS, export_run
    from comera_engine.export.quant import STORE_DTYPES
except ImportError as e:  # pragma: no cover - the export package is part of the engine
    st.error(f"The export module is not available: {e}")
    st.stop()

c1, c2 = st.columns([1, 2])
ck = c1.selectbox("Checkpoint", range(len(ckpts)), format_func=lambda i: (
    f"{ckpts[i]['label']} · {fmt.nbytes(ckpts[i]['size'])}"), key="exp-ckpt",
    help="Newest first.")
fmt_name = c2.radio("Format", list(FORMATS), horizontal=True, key="exp-format",
                    format_func=lambda f: {"compressed": "Compressed TT", "dense": "Dense",
                                           "onnx": "ONNX"}.get(f, f))
st.caption(FORMAT_HELP.get(fmt_name, ""))
store_dtype = "float32"
if fmt_name != "dense":  # a dense export is the plain float32 state dict
    store_dtype = st.radio(
        "Weights stored as", list(STORE_DTYPES), horizontal=True, key="exp-dtype",
        format_func=lambda d: {"float32": "float32", "bf16": "bf16 (half the bytes)",
                               "int8": "int8 (a quarter, per-row scales)"}.get(d, d),
        help="`comera export --dtype`: the file stores the weights in this type and the "
             "loaded model computes in float32 (int8: q · scale). The card says what it "
             "costs in accuracy's terms: how far the outputs move from float32.")
checkpoint = ckpts[ck]
key = f"{rid}:{checkpoint['path']}:{fmt_name}:{store_dtype}"
results: dict[str, Any] = st.session_state.setdefault("exports", {})


def download_name(run: dict[str, Any], path: str | Path) -> str:
    """``<run name>-<run id>-step<N>[.dense].<ext>`` for an export at
    ``exports/step_XXXXXX/<file>``: one name per run, checkpoint and format, so downloads
    do not all arrive as ``model.safetensors``."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", str(run.get("name") or "run")).strip("-.") or "run"
    p = Path(path)
    digits = p.parent.name.removeprefix("step_")
    step = f"-step{int(digits)}" if digits.isdigit() else ""
    return f"{name}-{run['id']}{step}{p.name.removeprefix('model')}"


def _inside_store(path: str | Path) -> bool:
    try:
        return Path(path).resolve().is_relative_to(store.root.resolve())
    except (OSError, ValueError):
        return False


if st.button("Prepare export", type="primary", icon=":material/build:", key="exp-go"):
    with st.status(f"Exporting {fmt_name}…", expanded=True) as status:
        status.write(f"Loading checkpoint {checkpoint['label']} of `{rid}`")
        try:
            out = None  # the default file; another stored type gets its own, beside it
            if store_dtype != "float32" and checkpoint["step"] is not None:
                out = (store.run_dir(rid) / "exports" / f"step_{checkpoint['step']:06d}" /
                       f"model.{store_dtype}{'.onnx' if fmt_name == 'onnx' else '.safetensors'}")
            res = export_run(rid, checkpoint=checkpoint["step"] if checkpoint["step"] is not None
                             else checkpoint["path"], format=fmt_name, store=store,
                             dtype=store_dtype, out=out)
        except (ValueError, OSError, RuntimeError) as e:
            status.update(label="Export failed", state="error")
            st.error(str(e))
            st.stop()
        status.write(f"Wrote {Path(res.path).name} ({fmt.nbytes(res.file_bytes)})")
        if res.onnx_max_abs_diff is not None:
            status.write(f"onnxruntime matches PyTorch (max |Δ| = {res.onnx_max_abs_diff:.2e})")
        status.update(label="Export ready", state="complete")
    results[key] = res

res = results.get(key)
if res is not None and _inside_store(res.path) and Path(res.path).is_file():
    with st.container(border=True):
        # named as it is downloaded (the file in the store is exports/step_N/model.…)
        st.markdown(f"#### :material/check_circle: `{download_name(run, res.path)}`")
        sizes = res.sizes if isinstance(res.sizes, dict) else {}
        dense_b = (sizes.get("model") or {}).get("dense_bytes")
        baseline = runs.is_baseline(run)  # no TT layers: the whole model's figure, 1x
        scope = "model" if baseline else compression_scope(run.get("config"))
        comp = (sizes.get(scope) or {}).get("compression")
        shown = f"{fmt.ratio(comp)} ({SCOPE_LABELS[scope]})"
        k = st.columns(4)
        if res.format == "dense":  # the file: every weight multiplied out, 1x of dense
            k[0].metric("Compression (this dense file)", fmt.ratio(1.0),
                        delta=None if baseline else f"compressed TT: {shown}",
                        delta_color="off", delta_arrow="off",
                        help="This file holds the dense network, as many parameters as "
                             "the dense model: 1× against dense. " + (
                                 runs.DENSE_HELP if baseline else
                                 f"The run's compression, {shown}, is that of the "
                                 "Compressed TT format (and ONNX), not of this file."))
        else:
            k[0].metric(f"Compression ({SCOPE_LABELS[scope]})", fmt.ratio(comp),
                        help=runs.DENSE_HELP if baseline else
                        "Dense / effective parameters of the exported model in the run's "
                        "scope (the one its target is asked in): the figure every page "
                        "shows for this run at this checkpoint.")
        k[1].metric("File size", fmt.nbytes(res.file_bytes),
                    delta=f"dense model {fmt.nbytes(dense_b)}", delta_color="off",
                    delta_arrow="off")
        k[2].metric("Tensor bytes", fmt.nbytes(res.tensor_bytes),
                    delta=f"expected {fmt.nbytes(res.expected_bytes)}", delta_color="off",
                    delta_arrow="off")
        k[3].metric(BYTES_RATIO_LABEL.capitalize(),
                    fmt.ratio(dense_b / res.file_bytes) if dense_b and res.file_bytes else "–",
                    help="Bytes of the dense model over this file's bytes (header, ONNX "
                         "graph and, for a whole-model view, every dense layer included): "
                         "another scope than the compression beside it.")
        if res.format == "dense" and not baseline:
            st.caption(f":material/info: This file is dense (the TT weights multiplied out): "
                       f"{fmt.nbytes(res.file_bytes)}, 1× against the dense model. The "
                       f"run's compression, {shown}, applies to the **Compressed TT** "
                       "format (and ONNX).")
        d1, d2, _ = st.columns([1, 1, 2])
        d1.download_button("Download model", data=Path(res.path).read_bytes,
                           file_name=download_name(run, res.path), type="primary",
                           icon=":material/download:", key="dl-model",
                           mime="application/octet-stream", on_click="ignore")
        if res.card and Path(res.card).is_file() and _inside_store(res.card):
            card = fmt.server_paths_hidden(  # the data's folders are the server's
                Path(res.card).read_text(encoding="utf-8", errors="replace"), store.root)
            # the card names the file, and its code loads it, as it is downloaded
            for quote in '"`':
                card = card.replace(f"{quote}{Path(res.path).name}{quote}",
                                    f"{quote}{download_name(run, res.path)}{quote}")
            d2.download_button("Download model card", data=card,
                               file_name=download_name(run, res.path) + ".md",
                               icon=":material/description:", key="dl-card",
                               mime="text/markdown", on_click="ignore")
            with st.expander("Model card"):
                st.markdown(card)

# one row per file, as it was last written (an export made again rewrites its file)
newest = {a["path"]: a for a in store.artifacts(rid) if str(a["kind"]).startswith("export_")
          and a.get("exists") and _inside_store(a["path"])}
previous = sorted(newest.values(), key=lambda a: a["time"])
if previous:
    st.subheader("Earlier exports of this run", anchor=False)
    for i, a in enumerate(reversed(previous[-10:])):
        p = Path(a["path"])
        c1, c2, c3 = st.columns([3, 1, 1])
        c1.markdown(f"`{download_name(run, p)}` · {a['kind'].removeprefix('export_')} · "
                    f"{fmt.when(a['time'])}")
        c2.caption(fmt.nbytes(a.get("size")))
        if p.is_file():
            c3.download_button("Download", data=p.read_bytes, file_name=download_name(run, p),
                               key=f"dl-prev-{i}", icon=":material/download:",
                               on_click="ignore")
