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
        return str(self.raw.get("model", {}).get("name", "?"))

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
        return f"{p.title} · your model"
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
