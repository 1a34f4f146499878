"""``export_run`` (a run folder or a run in the store -> an export) and ``comera export``.

A run folder holds ``checkpoints/step_XXXXXX.safetensors`` + ``.json`` sidecars written
by the trainer; the sidecar carries the run config and the final metrics. The model is
rebuilt from the config, brought to the checkpoint's (truncated) shapes and loaded, then
handed to :func:`~comera_engine.export.core.export_model`.

What the model builder needs to know about the dataset (task, classes, vocabulary, sequence
length, ``meta``) is read from the sidecar's ``data_spec`` (or ``<run>/data_spec.json``);
when neither exists, the dataset is rebuilt from the config's ``[data]`` table, which also
gives the dataset identity and tokenizer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from comera_engine.config import loads_json
from comera_engine.errors import ConfigError
from comera_engine.export.container import BadExportFile, read_header
from comera_engine.export.core import FORMATS, ExportResult, export_model
from comera_engine.export.spec import data_spec_from_bundle

__all__ = ["cmd_export", "export_run", "load_run_model", "resolve_checkpoint"]


def _open_store(store: Any) -> Any:
    from comera_engine.store import RunStore, StoreError

    if store is not None and hasattr(store, "run_dir") and hasattr(store, "resolve"):
        return store
    try:
        return RunStore(store, create=False)
    except StoreError as exc:
        raise ConfigError("--store", str(exc)) from None


def _resolve_run(run: str | os.PathLike[str], store: Any) -> tuple[Path, str | None, Any]:
    """``(run dir, run id or None, store or None)``."""
    p = Path(run)
    if not str(run).strip():
        raise ConfigError("run", "the run reference is empty; give a run folder or a run id")
    if p.is_dir() and not ((p / "config.toml").is_file() or (p / "checkpoints").is_dir()):
        raise ConfigError("run", f"{run} is not a run folder (no config.toml or checkpoints); "
                          "give a run folder or a run id")
    if p.is_dir():
        run_id, st = None, None
        if store is not None:
            st = _open_store(store)
            if st.get_run(p.name) is not None and st.run_dir(p.name).resolve() == p.resolve():
                run_id = p.name
        return p, run_id, st
    if store is None and (os.sep in str(run) or str(run).startswith(".")):
        raise ConfigError("run", f"run folder not found: {run}")
    if store is None:
        from comera_engine.store import resolve_store_path

        if not resolve_store_path(None).exists():
            raise ConfigError("run", f"no run {str(run)!r} (no run folder there, and no run "
                              f"store at {resolve_store_path(None)}); give a run folder or a "
                              "run id")
    st = _open_store(store)
    from comera_engine.store import StoreError

    try:
        rid = st.resolve(str(run))
    except StoreError as exc:
        text = str(exc).removeprefix("run: ")
        raise ConfigError("run", f"{text} (give a run folder or a run id)") from None
    d = st.run_dir(rid)
    if not d.is_dir():
        raise ConfigError("run", f"run {rid} has no folder ({d})")
    return d, rid, st


def resolve_checkpoint(run_dir: Path, checkpoint: str | int | os.PathLike[str] | None) -> Path:
    """The sidecar (``.json``) of a run's checkpoint: newest when ``checkpoint`` is None;
    else a step number, a ``step_XXXXXX`` name, or a path to the ``.json``/``.safetensors``."""
    from comera_engine.store.layout import list_checkpoints

    ckpt_dir = run_dir / "checkpoints"
    found = list_checkpoints(ckpt_dir)
    if checkpoint is None:  # the newest that reads back whole, as a resume takes it
        from comera_engine.store.layout import resume_point

        if not found:
            raise ConfigError("run", f"{run_dir.name} has no checkpoint yet (none in "
                              f"{ckpt_dir}); resume the run to make one, or set "
                              "train.ckpt_every")
        try:
            meta, note = resume_point(ckpt_dir)
        except ConfigError as e:
            raise ConfigError("--checkpoint", e.problem) from None
        if note:
            print("comera: " + note.replace("resume: ", "export: ", 1)
                  .replace("; resuming from ", "; exporting "), file=sys.stderr)
        assert meta is not None
        return meta
    text = str(checkpoint)
    if isinstance(checkpoint, int) or text.isdigit():
        step = int(text)
        for s, path in found:
            if s == step:
                return path
        have = ", ".join(str(s) for s, _ in found) or "none"
        raise ConfigError("--checkpoint", f"no checkpoint at step {step} (have: {have})")
    cand = Path(text)
    for c in (cand, ckpt_dir / cand, ckpt_dir / f"{text}.json"):
        if c.suffix == ".safetensors":
            c = c.with_suffix(".json")
        if c.suffix == ".json" and c.is_file():
            return c
    if cand.exists():
        raise ConfigError("--checkpoint", f"{text} is not a checkpoint; give a step number "
                          "or a run's checkpoints/step_N.json (or .safetensors)")
    raise ConfigError("--checkpoint", f"checkpoint not found: {text}")


def _read_sidecar(path: Path) -> dict[str, Any]:
    try:
        meta = loads_json(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        raise BadExportFile(path, "checkpoint sidecar is not valid JSON") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("config"), dict):
        raise BadExportFile(path, "checkpoint sidecar must be a JSON object with a 'config'")
    return meta


def _data(cfg: Any, meta: dict[str, Any], run_dir: Path) -> tuple[dict, Any]:
    """``(data spec, bundle or None)``; relative data paths are taken from
    ``cfg.base_dir`` (the run's working folder), else the current folder."""
    spec = meta.get("data_spec")
    if not isinstance(spec, dict):
        f = run_dir / "data_spec.json"
        if f.is_file():
            try:
                spec = json.loads(f.read_text(encoding="utf-8"))
            except ValueError:
                raise BadExportFile(f, "not valid JSON") from None
    if isinstance(spec, dict) and spec.get("task"):
        return spec, None
    from comera_engine.data import build_dataset
    from comera_engine.runplan import data_config

    base = cfg.base_dir or os.getcwd()
    try:
        bundle = build_dataset(data_config(cfg), base_dir=base)
    except ConfigError as exc:
        raise ConfigError(exc.field, f"{exc.problem} (the checkpoint has no data_spec, so the "
                          "dataset is rebuilt to learn its shape)") from None
    return data_spec_from_bundle(bundle), bundle


def _tokenizer(cfg: Any, run_dir: Path, bundle: Any) -> Any:
    for cand in (run_dir / "tokenizer.json",):
        if cand.is_file():
            return cand
    raw = (cfg.data or {}).get("tokenizer_path")
    if raw:
        p = Path(raw)
        if not p.is_absolute():
            p = Path(cfg.base_dir or os.getcwd()) / p
        if p.is_dir():
            p = p / "tokenizer.json"
        if p.is_file():
            return p
    if bundle is None or getattr(bundle, "tokenizer", None) is None:
        return None
    notes = (getattr(bundle, "identity", None) or {}).get("notes") or {}
    if notes.get("tokenizer_trained"):
        # Retrained just now to rebuild the dataset: the run kept no tokenizer.json, and
        # a run trained before WordPiece training was made reproducible (or with another
        # ``tokenizers`` version) may have used another vocabulary: export none.
        return None
    return bundle.tokenizer


def load_run_model(
    run_dir: str | os.PathLike[str], checkpoint: str | int | None = None,
    base_dir: str | os.PathLike[str] | None = None,
) -> tuple[nn.Module, dict[str, Any]]:
    """The trained model of a run's checkpoint and the export metadata that describes it
    (``config``, ``data_spec``, ``dataset``, ``metrics``, ``tokenizer``, ``run``).
    ``base_dir``: the folder the run's relative data paths are relative to (the run's
    working folder; default: the current folder)."""
    from comera_engine.config import config_from_dict
    from comera_engine.models import build_model
    from comera_engine.models import checkpoint as ckpt

    run_dir = Path(run_dir)
    sidecar = resolve_checkpoint(run_dir, checkpoint)
    meta = _read_sidecar(sidecar)
    tensor_file = sidecar.with_suffix(".safetensors")
    read_header(tensor_file)  # refuse a corrupt/hostile checkpoint before loading it
    try:
        cfg = config_from_dict(meta["config"])
    except ConfigError as exc:
        raise ConfigError(f"checkpoint config: {exc.field}", exc.problem) from None
    if base_dir is not None:
        cfg.base_dir = str(base_dir)
    spec, bundle = _data(cfg, meta, run_dir)
    from comera_engine.runplan import data_namespace

    model = build_model(cfg.model, data_namespace(spec))
    _, tensors = ckpt.load_checkpoint(sidecar)
    state = ckpt.model_state(tensors)
    try:
        ckpt.resize_to_shapes(model, {k: list(v.shape) for k, v in state.items()})
        model.load_state_dict(state, strict=True)
    except (AttributeError, RuntimeError) as exc:
        raise BadExportFile(tensor_file, f"does not fit the model of its config "
                                         f"({str(exc).splitlines()[0]})") from None
    model.eval()
    dataset = meta.get("dataset")
    if dataset is None and (run_dir / "dataset.json").is_file():
        try:
            dataset = json.loads((run_dir / "dataset.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            dataset = None
    if dataset is None and bundle is not None:
        dataset = {**bundle.identity, "rebuilt_for_export": True}
    step = meta.get("step")
    step = step if isinstance(step, int) and not isinstance(step, bool) else 0
    metrics = meta.get("metrics")
    metrics = {str(k): v for k, v in metrics.items() if isinstance(v, (int, float))} if (
        isinstance(metrics, dict)) else {}
    info = {
        "config": meta["config"],
        "data_spec": spec,
        "dataset": dataset,
        "metrics": metrics,
        "tokenizer": _tokenizer(cfg, run_dir, bundle),
        "run": {"name": meta["config"].get("name"), "dir": str(run_dir.resolve()),
                "checkpoint": tensor_file.name, "step": step},
        "name": meta["config"].get("name"),
    }
    return model, info


def export_run(
    run_dir_or_id: str | os.PathLike[str],
    checkpoint: str | int | None = None,
    format: str = "compressed",  # noqa: A002 - the CLI flag's name
    out: str | os.PathLike[str] | None = None,
    store: Any = None,
    *,
    verify: bool = True,
    dtype: str = "float32",
) -> ExportResult:
    """Export a run's checkpoint (newest by default).

    Args:
        run_dir_or_id: a run folder, or a run id / unique prefix / name in ``store``.
        checkpoint: step number, ``step_XXXXXX``, or a checkpoint path.
        format: ``compressed``, ``dense`` or ``onnx``.
        out: file or folder (default: ``<run dir>/exports/step_XXXXXX/``).
        store: a ``RunStore`` or its database path (default store when a run id is given);
            the export and its card are logged there as artifacts of the run.
        dtype: how the weights are stored: ``float32``, ``bf16`` or ``int8``.
    """
    from comera_engine.export.quant import parse_store_dtype

    dtype = parse_store_dtype(dtype)  # refused before anything is read or written
    if format not in FORMATS:
        raise ConfigError("--format", f"unknown format {format!r}; choose from "
                          f"{', '.join(FORMATS)}")
    run_dir, run_id, st = _resolve_run(run_dir_or_id, store)
    base_dir = None
    if st is not None and run_id is not None:
        cwd = (st.get_run(run_id) or {}).get("cwd")
        base_dir = cwd if cwd and os.path.isdir(cwd) else None
    model, info = load_run_model(run_dir, checkpoint, base_dir)
    if run_id is not None:
        info["run"]["id"] = run_id
    step = int(info["run"]["step"])
    target = out if out is not None else str(run_dir / "exports" / f"step_{step:06d}") + os.sep
    result = export_model(model, target, format, info, verify=verify, dtype=dtype)
    if st is not None and run_id is not None:
        st.log_artifact(run_id, f"export_{format}", str(result.path))
        st.log_artifact(run_id, "model_card", str(result.card))
        if result.tokenizer is not None:
            st.log_artifact(run_id, "tokenizer", str(result.tokenizer))
    return result


def cmd_export(args: argparse.Namespace) -> int:
    """Run ``comera export``; bad input prints one line on stderr and returns 2, as does
    an ``--out`` that cannot be written (checked before the export, and named if the
    write fails all the same: a full disk)."""
    try:
        _check_out(str(args.out))
        with torch.no_grad():
            res = export_run(args.run, args.checkpoint, args.format, args.out, args.store,
                             verify=not getattr(args, "no_verify", False),
                             dtype=getattr(args, "dtype", None) or "float32")
    except ValueError as exc:  # ConfigError, BadExportFile, StoreError: bad input
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        sys.stderr.write(f"comera: error: {msg}\n")
        return 2
    except Exception as exc:  # cannot write the output: a full disk, a lost folder
        if not isinstance(exc, OSError) and "I/O error" not in str(exc):
            raise  # safetensors says its write failed in its own exception type
        sys.stderr.write(f"comera: error: --out: {_write_failure(exc, Path(args.out))}\n")
        return 2
    if getattr(args, "json", False):
        print(json.dumps(res.to_dict()))
        return 0
    print(f"wrote {res.path} ({res.format}, {res.file_bytes:,} bytes)")
    print(f"model card {res.card}")
    if res.tokenizer:
        print(f"tokenizer {res.tokenizer}")
    from comera_engine.export.card import compression_line

    print(compression_line(res))
    if res.store_dtype != "float32":
        print(f"weights stored as {res.store_dtype}: {res.tensor_bytes:,} bytes of tensors")
    if res.onnx_max_abs_diff is not None:
        print(f"onnxruntime max abs diff vs PyTorch: {res.onnx_max_abs_diff:.3g}")
    return 0


def _out_folder(out: Path) -> Path:
    """The nearest folder of ``out`` that exists (what the export writes into, or makes
    its folder in)."""
    folder = out if out.is_dir() else out.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder


def _check_out(out: str) -> None:
    """Refuse (ConfigError ``--out``) an output whose folder is a file or cannot be
    written, before any work: a probe file is made there and removed (``access`` says
    yes to root on a read-only mount)."""
    import tempfile

    if not out:
        return  # export_run names an empty --out
    folder = _out_folder(Path(out))
    if not folder.is_dir():
        raise ConfigError("--out", f"cannot write {out}: {folder} is a file, not a folder; "
                          "choose a writable folder")
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".comera-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError("--out", f"cannot write {out} ({e.strerror or e}); choose a "
                          "writable folder") from None


def _write_failure(exc: BaseException, out: Path) -> str:
    """One line for an export whose write failed, naming where and the fix."""
    from comera_engine.store.layout import disk_full_text, is_disk_full

    folder = _out_folder(out)
    if is_disk_full(exc):
        return disk_full_text(folder) + " or choose another --out"
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else \
        " ".join(str(exc).split())
    return f"cannot write {out} ({reason}); choose a writable folder"
