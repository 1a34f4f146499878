"""Shared by the dashboard's AppTest tests (tests/test_app*.py, with the ``home`` fixture
of conftest.py): where the app is, and the no-exception check."""

from __future__ import annotations

from pathlib import Path

from streamlit.testing.v1 import AppTest

ROOT = Path(__file__).resolve().parents[1]
HOME = str(ROOT / "app" / "Home.py")
TIMEOUT = 120


def no_exception(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]
