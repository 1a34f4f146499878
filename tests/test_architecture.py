"""The import contract (pyproject.toml, [tool.importlinter]): layers only point down, the
dashboard reaches the engine through its public API, the config, the run store and the
dataset registry load without torch, and no engine module imports itself back through
others. `make lint` checks the contract too."""

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


#: The import cycles of the package in the current folder, one a line: the modules that
#: reach each other through their imports (``a <-> b``), from grimp's graph
#: (import-linter's). Imports made only for type checking never run and are left out, and
#: so is a module's import of itself (``__main__`` reaching its module's own copy).
_CYCLES = """
import grimp
graph = grimp.build_graph("comera_engine", exclude_type_checking_imports=True,
                          cache_dir=None)
reach = {}
for module in graph.modules:
    seen, todo = set(), [module]
    while todo:
        importer = todo.pop()
        for imported in graph.find_modules_directly_imported_by(importer) - {importer}:
            if imported not in seen:
                seen.add(imported)
                todo.append(imported)
    reach[module] = seen
cycles = {tuple(sorted(m for m in reach[module] if module in reach[m]))
          for module in reach if module in reach[module]}
for cycle in sorted(cycles):
    print(" <-> ".join(cycle))
"""


def _import_cycles(root: Path) -> list[str]:
    out = subprocess.run([sys.executable, "-c", _CYCLES], cwd=root, capture_output=True,
                         text=True, timeout=240, env={"PYTHONPATH": str(root),
                                                      "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_no_module_of_the_engine_imports_itself_back() -> None:
    """No import cycle inside ``comera_engine``: a module never reaches itself through
    the modules it imports (function-level imports included)."""
    assert _import_cycles(ROOT) == []


def test_the_cycle_check_catches_a_cycle(tmp_path: Path) -> None:
    """The same check on a copy of the engine where two launcher modules import each
    other (one of them inside a function): the cycle is reported."""
    shutil.copytree(ROOT / "comera_engine", tmp_path / "comera_engine",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "build"))
    launch = tmp_path / "comera_engine" / "launch"
    (launch / "loop_a.py").write_text("from comera_engine.launch import loop_b  # noqa\n")
    (launch / "loop_b.py").write_text("def f():\n    import comera_engine.launch.loop_a\n")
    assert _import_cycles(tmp_path) == [
        "comera_engine.launch.loop_a <-> comera_engine.launch.loop_b"]


def _doc_layers() -> list[list[str]]:
    """The layers table of docs/ARCHITECTURE.md, top to bottom, as module names."""
    import re

    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    layers = []
    for row in rows:
        names = []
        for name in re.findall(r"`([^`]+)`", row.split(" | ")[0]):
            parts = [p for p in name.removesuffix(".py").split("/") if p]
            if parts[0] == "comera_engine":
                parts = parts[1:]
            names.append("app" if parts == ["app"] else f"comera_engine.{parts[0]}")
        layers.append(sorted(names))
    return layers


def test_the_architecture_page_states_the_contracts_layers() -> None:
    """docs/ARCHITECTURE.md's table has one row per layer of the contract, in its order,
    with the same modules (siblings on one row)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the tomli the project depends on there
        import tomli as tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    contract = next(c for c in config["tool"]["importlinter"]["contracts"]
                    if c["type"] == "layers")
    layers = [sorted(m.strip() for m in layer.split("|")) for layer in contract["layers"]]
    assert _doc_layers() == layers


def test_no_module_shadows_a_public_name_of_the_root() -> None:
    """A submodule named like one of the root's lazy public names (``plan``, ``load``, ...)
    would replace it on ``comera_engine`` once imported."""
    import comera_engine

    engine = ROOT / "comera_engine"
    for name in [*comera_engine._LAZY, "load"]:
        assert not (engine / name).is_dir() and not (engine / f"{name}.py").is_file(), name
