"""Experiment presets: the embedded default plus every ``experiments/configs/*.toml``.

Presets are read from the server's own folders only (the repository's
``experiments/configs/``, the working directory's ``experiments/configs/`` and the
package's ``comera_engine/configs/``); the browser picks one by name and never names a
file. User models and data files come from what ``comera app --models/--data``
registered (:func:`user_presets`, :func:`user_data`): the browser picks a registered
name, and the config carries the factory and the file paths resolved on the server.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.lib.defaults import DEFAULT_CONFIG_TOML, DEFAULT_PRESET, default_config

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

_REPO_ROOT = Path(__file__).resolve().parents[2]

MODEL_LABELS: dict[str, str] = {
    "tt_mlp": "TT MLP (image classification)",
    "transformer_cls": "Transformer classifier (NLI)",
    "transformer_mlm": "Transformer masked LM (code)",
    "dlrm": "DLRM (click-through rate)",
    "custom": "Your model (comera app --models)",
}
#: Key prefix of the presets of registered user models (a preset file's stem has no ':').
USER_PREFIX = "user:"
#: Key prefix of the configs found beside a registered model's module (studio.py).
CONFIG_PREFIX = "cfg:"
#: Key prefix of the configs uploaded from the browser into the run store's folder.
UPLOAD_PREFIX = "upload:"
#: The run store's folder for uploaded configs (``$COMERA_HOME/configs``).
UPLOAD_DIR = "configs"
#: Where a user model's preset starts: a short CPU run toward a 5x target.
USER_COMERA = {"target_compression": 5.0}
USER_TRAIN = {"steps": 300, "batch_size": 32, "eval_every": 50, "ckpt_every": 100,
              "device": "cpu"}


@dataclass
class Preset:
    """One launchable experiment template."""

    key: str  # file stem, e.g. "digits_tt_mlp"
    title: str  # the config's ``name``
    description: str  # the comment lines at the top of the file
    raw: dict[str, Any] = field(repr=False)
    source: str = "built-in"  # "built-in" or the file name

    @property
    def model(self) -> str:
        m = self.raw.get("model", {})
        if "name" not in m and "factory" in m:  # model.factory alone: a user model
            return "custom"
        return str(m.get("name", "?"))

    def config(self) -> dict[str, Any]:
        """A fresh, mutable copy of the preset's config."""
        return copy.deepcopy(self.raw)


def _header(text: str) -> str:
    lines = []
    for line in text.splitlines():
        s = line.strip()
        if not s.startswith("#"):
            break
        lines.append(s.lstrip("#").strip())
    return " ".join(x for x in lines if x)


def config_dirs() -> list[Path]:
    """Folders searched for ``*.toml`` presets, in order (existing ones only)."""
    dirs = [
        _REPO_ROOT / "experiments" / "configs",
        Path.cwd() / "experiments" / "configs",
        _REPO_ROOT / "comera_engine" / "configs",
    ]
    out: list[Path] = []
    for d in dirs:
        try:
            r = d.resolve()
        except OSError:
            continue
        if r.is_dir() and r not in out:
            out.append(r)
    return out


def load_presets() -> dict[str, Preset]:
    """``{key: Preset}``: the default first, then the config files sorted by name.

    A file that does not parse is skipped (the New-experiment page validates the rest).
    """
    presets: dict[str, Preset] = {
        DEFAULT_PRESET: Preset(
            DEFAULT_PRESET,
            str(default_config().get("name", DEFAULT_PRESET)),
            _header(DEFAULT_CONFIG_TOML),
            default_config(),
        )
    }
    for d in config_dirs():
        for path in sorted(d.glob("*.toml")):
            if path.stem in presets and path.stem != DEFAULT_PRESET:
                continue
            try:
                text = path.read_text(encoding="utf-8")
                raw = tomllib.loads(text)
            except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
                continue
            if not isinstance(raw.get("model"), dict) or not isinstance(raw.get("data"), dict):
                continue
            if path.stem == DEFAULT_PRESET:
                # the repository copy of the default wins (it may have been tuned), but it
                # keeps its place at the top of the list
                presets[DEFAULT_PRESET] = Preset(
                    DEFAULT_PRESET, str(raw.get("name", path.stem)), _header(text), raw, path.name
                )
                continue
            presets[path.stem] = Preset(
                path.stem, str(raw.get("name", path.stem)), _header(text), raw, path.name
            )
    return presets


def preset_label(p: Preset) -> str:
    """What the preset selectbox shows."""
    if p.key.startswith(USER_PREFIX):
        return f"{p.title} · your model, its function's defaults"
    if p.key.startswith(CONFIG_PREFIX):
        return f"{p.title} · your config {p.source}"
    if p.key.startswith(UPLOAD_PREFIX):
        return f"{p.title} · uploaded {p.source}"
    tag = " · default" if p.key == DEFAULT_PRESET else ""
    return f"{p.title}{tag}"


def user_data(registry: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``{name: [data] table}`` of the registered data files (``data.name = "files"``,
    absolute paths; ``label`` as registered, else the file's last column)."""
    out: dict[str, dict[str, Any]] = {}
    for name, d in sorted((registry.get("data") or {}).items()):
        table = {"name": "files", "train": d["train"]}
        if d.get("eval"):
            table["eval"] = d["eval"]
        columns = list(d.get("columns") or [])
        label = d.get("label") or (columns[-1] if columns else None)
        if label:
            table["label"] = label
        out[name] = table
    return out


def user_presets(registry: Mapping[str, Any]) -> dict[str, Preset]:
    """A preset per registered user model (``user:NAME``): its factory with the function's
    own defaults, on the first registered data file."""
    data = user_data(registry)
    first = next(iter(data), None)
    tasks = {n: (registry.get("data") or {})[n].get("task", "classify") for n in data}
    out: dict[str, Preset] = {}
    for name, m in sorted((registry.get("models") or {}).items()):
        raw = {"name": name, "task": tasks.get(first, "classify") if first else "classify",
               "model": {"name": "custom", "factory": m["factory"]},
               "data": dict(data[first]) if first else {"name": "files"},
               "comera": dict(USER_COMERA), "train": dict(USER_TRAIN)}
        out[USER_PREFIX + name] = Preset(USER_PREFIX + name, name, m.get("summary") or "", raw,
                                         m["factory"])
    return out


def registered_configs(registry: Mapping[str, Any]) -> dict[str, Preset]:
    """A preset per config found beside a registered model's module (``cfg:NAME``): the
    settings its author trains it with, data paths resolved on the server."""
    out: dict[str, Preset] = {}
    for name, c in sorted((registry.get("configs") or {}).items()):
        raw = copy.deepcopy(c["config"])
        out[CONFIG_PREFIX + name] = Preset(CONFIG_PREFIX + name, str(raw.get("name", name)),
                                           f"for {c['factory']}", raw,
                                           Path(c["source"]).name)  # no server folder
    return out


def upload_dir(store_folder: Path) -> Path:
    """Where uploaded configs are kept: a folder of the run store's, never elsewhere."""
    return Path(store_folder) / UPLOAD_DIR


def uploaded_configs(store_folder: Path) -> dict[str, Preset]:
    """A preset per config uploaded into the run store's folder (``upload:STEM``); files
    that no longer parse are skipped."""
    out: dict[str, Preset] = {}
    folder = upload_dir(store_folder)
    if not folder.is_dir():
        return out
    for path in sorted(folder.glob("*.toml")):
        try:
            text = path.read_text(encoding="utf-8")
            raw = tomllib.loads(text)
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError):
            continue
        if not isinstance(raw.get("model"), dict) or not isinstance(raw.get("data"), dict):
            continue
        out[UPLOAD_PREFIX + path.stem] = Preset(
            UPLOAD_PREFIX + path.stem, str(raw.get("name", path.stem)), _header(text), raw,
            path.name)
    return out


def save_upload(store_folder: Path, filename: str, content: bytes) -> str:
    """Keep an uploaded config in the run store's folder: returns its preset key.

    The file name is reduced to letters, digits, ``_`` and ``-`` (no folders); the text
    must be UTF-8 TOML of at most :data:`~comera_engine.config.MAX_CONFIG_BYTES` with
    ``[model]`` and ``[data]`` tables. What it may name (files, factories) is checked
    when it is launched (:func:`browser_config_problem`).

    Raises:
        ValueError: what is wrong with the file, a line per problem (both tables when
            both are missing).
    """
    from comera_engine.config import MAX_CONFIG_BYTES

    if len(content) > MAX_CONFIG_BYTES:
        raise ValueError(f"config: {len(content):,} bytes; a run config is at most "
                         f"{MAX_CONFIG_BYTES // 1024} KB")
    try:
        raw = tomllib.loads(content.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"config: not UTF-8 text (byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"config: not valid TOML ({exc})") from None
    except RecursionError:
        raise ValueError("config: nests values too deeply") from None
    missing = [f"{table}: missing; a run config has [model] and [data] tables"
               for table in ("model", "data") if not isinstance(raw.get(table), dict)]
    if missing:
        raise ValueError("\n".join(missing))
    stem = _upload_stem(Path(filename).stem)
    folder = upload_dir(store_folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{stem}.toml").write_bytes(content)
    return UPLOAD_PREFIX + stem


def _upload_stem(text: str) -> str:
    """The file name an uploaded config is kept under: ``text`` reduced to ASCII letters,
    digits, ``_`` and ``-`` (anything else ``_``; no folders), at most 60 characters."""
    return "".join(ch if ch.isascii() and (ch.isalnum() or ch in "_-") else "_"
                   for ch in text)[:60].strip("_") or "config"


def remove_upload(store_folder: Path, key: str) -> bool:
    """Delete the uploaded config of preset ``key`` (``upload:STEM``) from the run store's
    folder; ``False`` when ``key`` names no uploaded file (nothing else is touched)."""
    if not key.startswith(UPLOAD_PREFIX):
        return False
    stem = key.removeprefix(UPLOAD_PREFIX)
    if not stem or _upload_stem(stem) != stem:  # a name save_upload could have given
        return False
    path = upload_dir(store_folder) / f"{stem}.toml"
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def browser_config_problems(raw: Mapping[str, Any], start: Mapping[str, Any],
                            registry: Mapping[str, Any], store_folder: Path,
                            base: Path) -> list[tuple[str, str]]:
    """``(field, problem)`` for each thing a config the browser wrote (uploaded, or
    edited as TOML) names that the server does not offer; ``[]`` when none.

    Allowed: the code (``model.factory``, ``task.factory``, ``data.factory``) of the
    config it started from and of the registered models; files (the ``[data]`` paths,
    ``model.init_from``) of the config it started from, of the registered data files and
    of the shipped presets, or inside the run store's folder. Relative paths resolve from
    ``base`` (the folder runs start in), as the run would resolve them.
    """
    from comera_engine.studio import data_paths

    store = Path(store_folder).resolve()
    code = {m["factory"] for m in (registry.get("models") or {}).values()}
    files: set[str] = set()
    tables = [start, *(p.raw for p in load_presets().values())]
    tables += [c["config"] for c in (registry.get("configs") or {}).values()]
    for table in tables:
        files.update(data_paths(table.get("data") or {}, base).values())
    for spec in (start.get("model") or {}, start.get("task"), start.get("data") or {}):
        if isinstance(spec, Mapping) and spec.get("factory"):
            code.add(spec["factory"])
    for d in (registry.get("data") or {}).values():
        files.update(str(Path(p).resolve()) for p in (d.get("train"), d.get("eval")) if p)
    problems: list[tuple[str, str]] = []
    for where, spec in (("model.factory", raw.get("model")), ("task.factory", raw.get("task")),
                        ("data.factory", raw.get("data"))):
        value = spec.get("factory") if isinstance(spec, Mapping) else None
        if value is not None and value not in code:
            problems.append((where, f"{value!r} is not a model this dashboard offers; "
                                    "register its module with `comera app --models MODULE`"))

    def allowed(path: str) -> bool:
        p = Path(path)
        return str(p) in files or p == store or store in p.parents

    named = data_paths(raw.get("data") or {}, base) if isinstance(raw.get("data"),
                                                                   Mapping) else {}
    init = (raw.get("model") or {}).get("init_from") if isinstance(raw.get("model"),
                                                                    Mapping) else None
    if isinstance(init, str) and init:
        named["model.init_from"] = data_paths({"path": init}, base)["path"]
    for key, path in named.items():
        if not allowed(path):
            where = key if key.startswith("model.") else f"data.{key}"
            problems.append((where, "names a file this dashboard does not offer; use a "
                                    "registered data file (`comera app --data NAME=PATH`), "
                                    "a shipped config's, or one inside the run store's "
                                    "folder"))
    return problems
