"""The engine's version, in a module of its own: code below the package root reads it
here, never through ``comera_engine`` itself (the root is the public facade, above every
layer; ``pyproject.toml`` forbids importing it from below)."""

__version__ = "0.1.0"
