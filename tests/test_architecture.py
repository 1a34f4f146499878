"""The import contract (pyproject.toml, [tool.importlinter]): layers only point down, the
dashboard reaches the engine through its public API, the config, the run store and the
dataset registry load without torch. `make lint` checks it too."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT), "--config", str(root / "pyproject.toml")], cwd=root,
                          capture_output=True, text=True, timeout=240)


def test_the_import_contract_is_kept() -> None:
    out = _lint(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    kept = [line for line in out.stdout.splitlines() if line.endswith(" KEPT")]
    assert len(kept) >= 4, out.stdout  # every contract was checked, none skipped


def test_the_contract_catches_a_dashboard_import_of_engine_internals(tmp_path: Path) -> None:
    """The same contracts on a copy of the tree where one dashboard module reaches into
    the tensor internals and the store imports torch: both are reported as broken."""
    for name in ("comera_engine", "app"):
        shutil.copytree(ROOT / name, tmp_path / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so", "build"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "app" / "lib" / "sneaky.py").write_text(
        "from comera_engine.tensor import tt_svd  # noqa: F401\n")
    (tmp_path / "comera_engine" / "store" / "heavy.py").write_text("import torch  # noqa\n")
    out = _lint(tmp_path)
    assert out.returncode != 0, out.stdout
    assert "the dashboard uses only the engine's public API BROKEN" in out.stdout
    assert "app.lib.sneaky -> comera_engine.tensor" in out.stdout
    assert "load without torch BROKEN" in out.stdout
    assert "comera_engine.store.heavy -> torch" in out.stdout
