"""Nesting bounds for documents read from users' files (TOML configs, JSON headers and
sidecars), checked before they are parsed. ``tomllib`` and ``json`` recurse once a level
of ``[``/``{``; a parse that runs into the interpreter's recursion limit can break
whatever else runs at that depth (a finalizer the garbage collector calls), so text
nested past :data:`PARSE_DEPTH` is refused without being parsed. Torch-free.
"""

from __future__ import annotations

import json
import re
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the tomli backport has the same API
    import tomli as tomllib  # type: ignore[no-redef]

#: The deepest ``[``/``{`` nesting handed to a parser (a config's values are held to
#: ``MAX_DEPTH`` after parsing; exports and sidecars nest a few levels).
PARSE_DEPTH = 64

# a string (TOML's multi-line and literal forms, JSON's and TOML's basic one), a TOML
# comment, or a bracket
_TOKENS = re.compile(r'"""[\s\S]*?"""|\'\'\'[\s\S]*?\'\'\'|"(?:[^"\\\n]|\\.)*"'
                     r"|'[^'\n]*'|#[^\n]*|[\[\]{}]")


def bracket_depth(text: str) -> int:
    """The deepest nesting of ``[``/``{`` in TOML or JSON ``text``, strings and comments
    skipped, counted in one pass without recursion (an unclosed bracket counts as open).
    For JSON it is an upper bound on what the parser enters: a quote or ``#`` outside a
    string, which this reads as TOML's, is an error where the parser meets it."""
    depth = deepest = 0
    for match in _TOKENS.finditer(text):
        token = match.group()
        if token in ("[", "{"):
            depth += 1
            deepest = max(deepest, depth)
        elif token in ("]", "}"):
            depth = max(depth - 1, 0)
    return deepest


def loads_json(text: str | bytes) -> Any:
    """``json.loads`` of ``text`` once its nesting is within :data:`PARSE_DEPTH`, else a
    ``ValueError`` saying how deep it goes (what ``json`` raises for other bad text)."""
    if isinstance(text, bytes | bytearray):
        text = text.decode("utf-8")
    depth = bracket_depth(text)
    if depth > PARSE_DEPTH:
        raise ValueError(f"nested {depth} levels deep; at most {PARSE_DEPTH}")
    return json.loads(text)


def loads_toml(text: str) -> dict[str, Any]:
    """``tomllib.loads`` of ``text`` once its nesting is within :data:`PARSE_DEPTH`, else
    the ``RecursionError`` the parser would end in, raised before it recurses."""
    if bracket_depth(text) > PARSE_DEPTH:
        raise RecursionError(f"nested more than {PARSE_DEPTH} levels deep")
    return tomllib.loads(text)
