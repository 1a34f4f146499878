"""User code named by an entry point, ``"package.module:function"``: a model factory
(``model.factory``), a dataset factory (``data.factory``), a task (``task.factory``).

Only the user names these, in their own config or on the command line (``comera app
--models``); the dashboard offers only what was registered that way. Every failure is a
:class:`~comera_engine.errors.ConfigError` of one line naming the config key and the fix.
Torch-free: what the function returns is checked by its caller.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from comera_engine.errors import ConfigError

__all__ = ["call_entry", "import_module", "resolve_entry"]


def import_module(module: str, field: str, search: Iterable[str | Path] = ()) -> Any:
    """Import ``module``. When it is not importable as is, the folders ``search`` (the
    folder a run was started from) are appended to ``sys.path`` and it is tried again.
    A module that is not found says which module to put on the path; one that fails
    while importing says how, in one line."""
    found = _find(module)
    if found is None:
        for folder in search:
            path = str(Path(folder).resolve())
            if folder and path not in sys.path:
                sys.path.append(path)
        found = _find(module)
    if found is None:
        raise ConfigError(field, f"module {module!r} is not importable; put the folder that "
                                 "holds it on PYTHONPATH (or start from that folder), or pip "
                                 "install its package")
    try:
        return importlib.import_module(module)
    except Exception as exc:  # the user's module raised while importing
        raise ConfigError(field, f"importing {module!r} failed ({type(exc).__name__}: "
                                 f"{_first_line(exc)}); fix the module") from None


def _find(module: str) -> Any:
    try:
        return importlib.util.find_spec(module)
    except (ImportError, ValueError):  # a parent package that is missing or does not import
        return None


def resolve_entry(spec: str, field: str, search: Iterable[str | Path] = ()) -> Callable[..., Any]:
    """The callable ``spec`` names (``"package.module:function"``; the function part may
    be dotted, ``Class.method``)."""
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise ConfigError(field, f'must be "package.module:function", got {spec!r}')
    module_name, attr = spec.split(":")
    module = import_module(module_name, field, search)
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            public = sorted(n for n in dir(module) if not n.startswith("_")
                            and callable(getattr(module, n)))[:8]
            raise ConfigError(field, f"{module_name} has no {attr!r}"
                              + (f" (it has {', '.join(public)})" if public else "")
                              + "; fix the name after the colon")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(field, f"{spec} is a {type(target).__name__}, not callable; name a "
                                 "function")
    return target


def call_entry(fn: Callable[..., Any], spec: str, field: str, kwargs: dict[str, Any]) -> Any:
    """``fn(**kwargs)``; an exception inside it becomes one line naming ``field``."""
    try:
        return fn(**kwargs)
    except ConfigError as exc:
        raise ConfigError(field, f"{spec} refused its arguments ({exc})") from None
    except Exception as exc:
        raise ConfigError(field, f"{spec}(...) raised {type(exc).__name__}: "
                                 f"{_first_line(exc)}; fix the function or its kwargs") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "no message"
