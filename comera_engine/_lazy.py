"""Lazy public names (PEP 562): a package lists ``name -> submodule`` and imports the
submodule (and torch with it) only when the name is first used."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(package: str, table: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``name`` in ``table`` is read from
    ``package.<table[name]>`` on first use and cached on the package."""

    def __getattr__(name: str) -> Any:
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{table[name]}"), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
