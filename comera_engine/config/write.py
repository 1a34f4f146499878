"""Writing a config back as TOML text (``--print-config``, a run folder's
``config.toml``). Torch-free.
"""

from __future__ import annotations

import json
import math
from typing import Any

from .schema import Config


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML text (what ``--print-config`` shows)."""
    d = cfg.to_dict()
    lines = [f"name = {toml_value(d['name'])}"]
    if "task" in d:
        lines.append(f"task = {toml_value(d['task'])}")
    for section in ("model", "data", "comera", "train"):
        lines += ["", f"[{section}]"]
        lines += [f"{k} = {toml_value(v)}" for k, v in d[section].items()]
    return "\n".join(lines) + "\n"


def _toml_key(key: str) -> str:
    """A table key: bare when it may be, else quoted."""
    return key if key and all(ch.isascii() and (ch.isalnum() or ch in "_-") for ch in key) \
        else toml_string(key)


def toml_string(text: str) -> str:
    """A TOML basic string, in UTF-8 as typed ("10× · seed 2", not ``\\u00d7``): JSON's
    escapes of the quote, the backslash and the control characters are TOML's too; DEL,
    which TOML escapes and JSON does not, is escaped as well."""
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def toml_value(value: Any) -> str:
    """One value as TOML text: a string, number, boolean, list or inline table."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
        return repr(value)
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_toml_key(k)} = {toml_value(v)}"
                                for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {value!r} as TOML")
