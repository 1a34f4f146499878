"""Suite-wide settings: the tests never write to the user's cache folder."""

from __future__ import annotations

import os
import shutil
import tempfile

_CACHE = tempfile.mkdtemp(prefix="comera-test-cache-")


def pytest_configure(config) -> None:  # noqa: ANN001
    # GEMM choices (comera_engine.tensor.gemm) go to a folder of this session's own;
    # subprocesses the tests start inherit it
    os.environ["COMERA_CACHE_DIR"] = _CACHE


def pytest_unconfigure(config) -> None:  # noqa: ANN001
    shutil.rmtree(_CACHE, ignore_errors=True)
