"""Reading a config: a TOML file (bounded in size and depth) with ``--set`` overrides,
each table's values coerced to its dataclass's field types, unknown keys refused with a
"did you mean", then :func:`~comera_engine.config.validate.validate`. Torch-free.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import stat
import typing
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .nesting import loads_toml, tomllib
from .schema import (
    BOUNDS,
    MAX_CONFIG_BYTES,
    MAX_DEPTH,
    MAX_LIST,
    MAX_OVERRIDE_CHARS,
    SECTIONS,
    Config,
)
from .validate import (
    check_data_numbers,
    check_number,
    check_run_name,
    check_task,
    coerce_value,
    refuse_unknown,
    validate,
)


def load_config(
    path: str | Path, overrides: list[str] | None = None, base_dir: str | Path | None = None
) -> Config:
    """Read a TOML config, apply ``--set`` overrides, validate everything but the data.

    Relative data paths are resolved from ``base_dir`` (default: the current folder).
    """
    path = Path(path)
    size = _config_file_size(path)
    if size > MAX_CONFIG_BYTES:
        raise ConfigError("config", f"{path.name} is {size:,} bytes; a run "
                          f"config is at most {MAX_CONFIG_BYTES // 1024} KB")
    try:
        raw = loads_toml(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("config", f"{path.name} is not valid TOML ({exc})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError("config", f"{path.name} is not UTF-8 text (byte {exc.start}); "
                                    "save it as UTF-8") from None
    except RecursionError:
        raise ConfigError("config", f"{path.name} nests values too deeply (at most "
                          f"{MAX_DEPTH} levels)") from None
    except OSError as exc:  # no permission, an I/O error
        raise ConfigError("config", f"{path} cannot be read ({exc.strerror or exc})") from None
    except ValueError as exc:  # an integer literal of thousands of digits
        raise ConfigError("config", f"{path.name} is not valid TOML ({exc})") from None
    for item in overrides or []:
        apply_override(raw, item)
    cfg = config_from_dict(raw)
    cfg.base_dir = str(Path(base_dir).resolve()) if base_dir else str(Path.cwd())
    return cfg


def _config_file_size(path: Path) -> int:
    """The size of the regular file at ``path``; else a ConfigError saying what the path
    is: missing, a symlink to a missing file, a symlink loop, a folder, a FIFO, a device
    or a socket (nothing is opened: a FIFO would block the reader)."""
    try:
        info = path.stat()
    except FileNotFoundError:
        if path.is_symlink():
            raise ConfigError("config", f"{path} is a symlink to {os.readlink(path)}, which "
                                        "does not exist") from None
        raise ConfigError("config", f"file not found: {path}") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ConfigError("config", f"{path} is a symlink loop (it points back at "
                                        "itself); name the config file itself") from None
        raise ConfigError("config", f"{path} cannot be read ({exc.strerror or exc})") from None
    if stat.S_ISREG(info.st_mode):
        return info.st_size
    if stat.S_ISDIR(info.st_mode):
        raise ConfigError("config", f"{path} is a folder, not a config file; name the "
                                    ".toml file in it")
    kind = ("a FIFO (named pipe)" if stat.S_ISFIFO(info.st_mode) else
            "a socket" if stat.S_ISSOCK(info.st_mode) else "a device")
    raise ConfigError("config", f"{path} is {kind}, not a regular file; name a .toml file")


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply one ``section.key=value`` override to the raw dict (value read as TOML)."""
    if len(item) > MAX_OVERRIDE_CHARS:
        raise ConfigError("--set", f"a value of {len(item):,} characters; at most "
                          f"{MAX_OVERRIDE_CHARS:,} (put long settings in the config file)")
    if "=" not in item:
        raise ConfigError("--set", f"expected section.key=value, got {item!r}")
    key, text = item.split("=", 1)
    key = key.strip()
    parts = key.split(".")
    if not all(parts) or len(parts) > 2:
        raise ConfigError("--set", f"expected section.key=value, got {item!r}")
    value = parse_value(text.strip())
    if len(parts) == 1:
        if isinstance(value, dict) and isinstance(raw.get(parts[0]), dict):
            raw[parts[0]].update(value)  # the table's other keys keep the file's values
        else:
            raw[parts[0]] = value
        return
    section = raw.setdefault(parts[0], {})
    if not isinstance(section, dict):
        raise ConfigError(parts[0], "is a value, not a table; cannot set a key inside it")
    section[parts[1]] = value


def parse_value(text: str) -> Any:
    """A TOML literal (``64``, ``1e-3``, ``true``, ``"x"``, ``[1, 2]``); bare words are strings."""
    try:
        return loads_toml(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
    except RecursionError:
        raise ConfigError("--set", f"the value nests too deeply (at most {MAX_DEPTH} "
                          "levels)") from None


def check_bounds(raw: Any, where: str = "", depth: int = 1) -> None:
    """Refuse a raw config (nested tables and lists) nested deeper than
    :data:`MAX_DEPTH` or with a list longer than :data:`MAX_LIST`, naming the field
    (the walk stops at that depth, so it never recurses far)."""
    if depth > MAX_DEPTH:
        raise ConfigError(where or "config", f"nested more than {MAX_DEPTH} levels deep")
    if isinstance(raw, dict):
        for key, value in raw.items():
            check_bounds(value, f"{where}.{key}" if where else str(key), depth + 1)
    elif isinstance(raw, list):
        if len(raw) > MAX_LIST:
            raise ConfigError(where or "config", f"a list of {len(raw):,} entries; at most "
                              f"{MAX_LIST}")
        for value in raw:
            check_bounds(value, where, depth + 1)


def config_from_dict(raw: dict[str, Any]) -> Config:
    """Build and validate a :class:`Config` from nested plain values (TOML tables)."""
    check_bounds(raw)
    allowed_top = {"name", "task", "model", "data", "comera", "train"}
    for key in raw:
        if key not in allowed_top:
            refuse_unknown(key, sorted(allowed_top) + _all_field_names())
    name = check_run_name(raw.get("name", "run"))
    data = raw.get("data", {})
    if not isinstance(data, dict):
        raise ConfigError("data", "must be a table ([data])")
    if "factory" in data and "name" not in data:  # data.factory alone: user datasets
        data = {"name": "factory", **data}
    if "name" not in data:
        raise ConfigError("data.name", "missing; name a dataset (e.g. digits, snli, code_mlm, "
                                       "files)")
    check_data_numbers(data)
    sections = {}
    for section, cls in SECTIONS.items():
        values = raw.get(section, {})
        if not isinstance(values, dict):
            raise ConfigError(section, f"must be a table ([{section}])")
        if section == "model" and "factory" in values and "name" not in values:
            values = {"name": "custom", **values}  # model.factory alone: a user model
        sections[section] = _build_section(section, cls, values)
    cfg = Config(name=name.strip(), data=dict(data), task=check_task(raw.get("task")),
                 **sections)
    validate(cfg)
    m = cfg.model
    for key in ("rank", "embedding_rank"):  # a fixed [model.tensorize] rank is the model's
        value = (m.tensorize or {}).get(key)
        if isinstance(value, int) and getattr(m, key) is None:
            setattr(m, key, value)
    return cfg


def _all_field_names() -> list[str]:
    return [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


def _build_section(section: str, cls: type, values: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        full = f"{section}.{key}"
        if key not in names:
            refuse_unknown(full, [f"{section}.{n}" for n in names] + _all_field_names())
        kwargs[key] = coerce_value(full, value, hints[key])
        if full in BOUNDS:  # the value as written: a huge integer is not turned into inf
            check_number(full, value, BOUNDS[full])
    return cls(**kwargs)


