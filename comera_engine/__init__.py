"""CoMERA engine: rank-adaptive tensor-train training (arXiv 2405.14377)."""

from __future__ import annotations

__version__ = "0.1.0"
