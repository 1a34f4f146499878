"""What ``comera app`` registers for the dashboard: user model factories (``--models
package.module``, repeatable) and local data files (``--data NAME=PATH[,eval=PATH]
[,label=COLUMN][,task=classify|regress]``, repeatable).

Everything is checked here, on the server, before the dashboard starts: a module that
does not import or exposes nothing, a file that is missing or unreadable, a label that is
not a column are one line naming the flag (exit 2). The result, the *registry*, is plain
JSON:

``{"models": {NAME: {"factory": "module:function", "module": ..., "summary": ...}},
"data": {NAME: {"train": ABS, "eval": ABS | None, "label": COL | None, "task": TASK,
"columns": [...], "rows": N}}, "configs": {NAME: {"factory": "module:function",
"source": FILE, "config": {TOML tables, data paths absolute}}}, "paths": [folders the
model modules import from]}``

A config is a ``*.toml`` beside a ``--models`` module (in the module's own folder) whose
``model.factory`` is one of the module's factories: the settings its author trains the
model with (``experiments/own/breast_cancer.toml`` beside ``experiments/own/model.py``).
Its relative data paths are resolved from the folder ``comera app`` starts in, as
``comera train`` resolves them from the folder it starts in.

It reaches the Streamlit process as the script arguments ``--registry JSON`` (so it is
neither inherited by trainers nor recorded in their launch environment), and the New
experiment page offers those names only: the browser never sends a module or a path, it
picks a registered name, and a launched run's config carries the factory and the file
paths resolved here.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from comera_engine.errors import ConfigError

__all__ = ["DATA_PATH_KEYS", "REGISTRY_ARG", "build_registry", "data_paths",
           "parse_data_spec", "read_registry", "registry_args"]

REGISTRY_ARG = "--registry"
DATA_KEYS = ("eval", "label", "task")
TASKS = ("classify", "regress")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,39}$")
_DATA_FORM = "NAME=PATH[,eval=PATH][,label=COLUMN][,task=classify|regress]"
#: ``[data]`` keys whose values are files or folders on the server (every dataset's).
DATA_PATH_KEYS = ("train", "eval", "path", "eval_path", "tokenizer_path", "root")


def data_paths(data: Mapping[str, Any], base: str | os.PathLike[str]) -> dict[str, str]:
    """``{key: absolute path}`` of the file and folder values of a ``[data]`` table
    (:data:`DATA_PATH_KEYS`), relative ones resolved from ``base``."""
    out: dict[str, str] = {}
    for key in DATA_PATH_KEYS:
        value = data.get(key)
        if isinstance(value, str) and value:
            path = Path(value).expanduser()
            out[key] = str((path if path.is_absolute() else Path(base) / path).resolve())
    return out


def parse_data_spec(text: str) -> tuple[str, dict[str, str]]:
    """``"NAME=PATH[,eval=PATH][,label=COLUMN][,task=classify|regress]"`` ->
    ``(NAME, {"train": PATH, ...})``; nothing is read. ConfigError names ``--data``."""
    name, sep, rest = str(text).partition("=")
    name = name.strip()
    if not sep or not _NAME.match(name):
        raise ConfigError("--data", f"give {_DATA_FORM} (NAME: letters, digits, _ . -), "
                                    f"got {text!r}")
    parts = rest.split(",")
    out = {"train": parts[0].strip()}
    if not out["train"]:
        raise ConfigError("--data", f"{name}: no file after '='; give {_DATA_FORM}")
    for part in parts[1:]:
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if key not in DATA_KEYS or not sep or not value:
            raise ConfigError("--data", f"{name}: {part.strip()!r} is not one of eval=PATH, "
                                        f"label=COLUMN, task=classify|regress")
        if key in out:
            raise ConfigError("--data", f"{name}: {key} is given twice")
        out[key] = value
    if out.get("task", "classify") not in TASKS:
        raise ConfigError("--data", f"{name}: task must be classify or regress, got "
                                    f"{out['task']!r}")
    return name, out


def _module_root(module: Any) -> str | None:
    """The folder ``module`` imports from (its file less its dotted name)."""
    path = getattr(module, "__file__", None)
    if not path:
        return None
    depth = module.__name__.count(".") + (Path(path).name == "__init__.py")
    return str(Path(path).resolve().parents[depth])


def _summary(fn: Any, limit: int = 200) -> str:
    """The first paragraph of ``fn``'s docstring on one line (at most ``limit`` chars)."""
    doc = (getattr(fn, "__doc__", None) or "").strip().split("\n\n")[0]
    text = " ".join(doc.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _models(modules: Sequence[str], cwd: str) -> tuple[dict[str, Any], list[str]]:
    from comera_engine.models.custom import exposed_factories

    models: dict[str, Any] = {}
    paths: list[str] = []
    for module_name in modules:
        module_name = str(module_name).strip()
        if not all(p.isidentifier() for p in module_name.split(".")):
            raise ConfigError("--models", f"give a module as package.module (Python names), "
                                          f"got {module_name!r}")
        before = list(sys.path)
        found = exposed_factories(module_name, "--models", (cwd,))
        if not found:
            raise ConfigError("--models", f"{module_name} exposes no factory; list them in "
                                          "its COMERA_MODELS (or define public functions)")
        module = sys.modules[module_name]
        root = _module_root(module)
        if root and root not in (str(Path(p or ".").resolve()) for p in before) \
                and root not in paths:
            paths.append(root)  # found through the folder it was started from
        for name, spec in found.items():
            if name in models:
                raise ConfigError("--models", f"{name!r} is exposed by both "
                                  f"{models[name]['module']} and {module_name}; rename one "
                                  "in its COMERA_MODELS")
            fn = getattr(module, spec.partition(":")[2])
            models[name] = {"factory": spec, "module": module_name, "summary": _summary(fn)}
    return models, paths


def _configs(models: Mapping[str, Any], cwd: str) -> dict[str, Any]:
    """The configs beside the registered models' modules (module docstring): those that
    parse and name one of the registered factories; others are left alone."""
    from comera_engine.config import MAX_CONFIG_BYTES, loads_toml
    from comera_engine.config.nesting import tomllib

    factories = {m["factory"] for m in models.values()}
    folders = []
    for m in models.values():
        path = getattr(sys.modules.get(m["module"]), "__file__", None)
        if path and Path(path).parent not in folders:
            folders.append(Path(path).parent)
    configs: dict[str, Any] = {}
    for folder in folders:
        for path in sorted(folder.glob("*.toml")):
            try:
                if path.stat().st_size > MAX_CONFIG_BYTES:
                    continue
                raw = loads_toml(path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError):
                continue
            model, data = raw.get("model"), raw.get("data")
            if not isinstance(model, dict) or model.get("factory") not in factories \
                    or not isinstance(data, dict):
                continue
            raw["data"] = {**data, **data_paths(data, cwd)}
            name = str(raw.get("name") or path.stem)
            while name in configs:
                name += "+"
            try:
                source = str(path.resolve().relative_to(cwd))
            except ValueError:
                source = str(path.resolve())
            configs[name] = {"factory": model["factory"], "source": source, "config": raw}
    return configs


def _data(specs: Sequence[str], cwd: str) -> dict[str, Any]:
    from comera_engine.data.files import file_columns, shape

    data: dict[str, Any] = {}
    for text in specs:
        name, spec = parse_data_spec(text)
        if name in data:
            raise ConfigError("--data", f"{name!r} is registered twice; give each file its "
                                        "own name")
        table: dict[str, Any] = {"name": "files", "task": spec.get("task", "classify")}
        for key in ("train", "eval"):
            if key in spec:
                path = Path(spec[key]).expanduser()
                table[key] = str(path if path.is_absolute() else Path(cwd) / path)
        if "label" in spec:
            table["label"] = spec["label"]
        try:
            if "label" in spec:  # every check a run makes of its files and columns
                shape(table)
            columns = file_columns(table, "train", cwd)
            if "eval" in table:
                file_columns(table, "eval", cwd)
        except ConfigError as exc:
            key = exc.field.removeprefix("data.")
            raise ConfigError("--data", f"{name} ({key}): {exc.problem}") from None
        rows = len(next(iter(columns.values())))
        data[name] = {"train": str(Path(table["train"]).resolve()),
                      "eval": str(Path(table["eval"]).resolve()) if "eval" in table else None,
                      "label": spec.get("label"), "task": table["task"],
                      "columns": list(columns), "rows": rows}
    return data


def build_registry(models: Sequence[str] = (), data: Sequence[str] = (),
                   cwd: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """The registry (module docstring) of ``--models`` modules and ``--data`` specs,
    resolved from ``cwd`` (default: the current folder). Imports the modules and reads
    the files.

    Raises:
        ConfigError: naming ``--models`` or ``--data``, in one line.
    """
    where = str(Path(cwd or os.getcwd()).resolve())
    found, paths = _models(list(models), where) if models else ({}, [])
    return {"models": found, "data": _data(list(data), where) if data else {},
            "configs": _configs(found, where), "paths": paths}


def registry_args(registry: Mapping[str, Any] | None) -> list[str]:
    """The Streamlit script arguments that hand ``registry`` to the dashboard."""
    if not registry or not (registry.get("models") or registry.get("data")
                            or registry.get("configs")):
        return []
    return [REGISTRY_ARG, json.dumps(dict(registry), sort_keys=True)]


def read_registry(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """The registry the dashboard was started with (its script arguments, default
    ``sys.argv``); empty when none or unreadable."""
    argv = list(sys.argv if argv is None else argv)
    empty: dict[str, Any] = {"models": {}, "data": {}, "configs": {}, "paths": []}
    if REGISTRY_ARG not in argv[:-1]:
        return empty
    try:
        raw = json.loads(argv[argv.index(REGISTRY_ARG) + 1])
    except ValueError:
        return empty
    if not isinstance(raw, dict):
        return empty
    return {"models": dict(raw.get("models") or {}), "data": dict(raw.get("data") or {}),
            "configs": dict(raw.get("configs") or {}),
            "paths": list(raw.get("paths") or [])}
