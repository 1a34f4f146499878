"""`import comera_engine` needs only torch, numpy and tensorly."""

from __future__ import annotations

import subprocess
import sys
import textwrap

BLOCKED = ["streamlit", "plotly", "datasets", "tokenizers", "sklearn", "pynvml", "onnx",
           "onnxruntime", "pandas", "pyarrow", "playwright", "psutil", "tqdm", "ray"]


def test_engine_core_imports_and_trains_without_optional_packages() -> None:
    code = textwrap.dedent(f"""
        import importlib.abc, sys
        blocked = {BLOCKED!r}
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] in blocked:
                    raise ImportError("blocked: " + name)
        sys.meta_path.insert(0, Block())
        import torch
        import comera_engine
        from comera_engine import TTLinear, TTEmbedding, tensorize, size_report, truncate
        from comera_engine.config import CoMERAConfig
        from comera_engine.rank.objective import CoMERAObjective
        from comera_engine.rank.optim import param_groups
        from comera_engine.tensor import explain, factorize
        m = torch.nn.Sequential(TTEmbedding(100, 16, rank=4), TTLinear(16, 8, rank=4))
        obj = CoMERAObjective(m, CoMERAConfig())
        loss, _ = obj(m(torch.tensor([[1, 2, 3]])).pow(2).mean())
        loss.backward()
        assert size_report(m)["model"]["compression"] > 1
        assert not any(b in sys.modules for b in blocked)
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


#: Prepended to a check run by :func:`_run_without_torch`: torch, numpy and tensorly
#: cannot be imported.
_NO_TORCH = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("torch", "numpy", "tensorly"):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
"""


def _run_without_torch(check: str) -> None:
    """Run ``check`` (code that prints ``ok``) in a fresh interpreter without torch."""
    code = _NO_TORCH + textwrap.dedent(check)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_config_module_is_torch_free() -> None:
    """The config model loads, validates and writes a shipped config with torch, numpy
    and every model module kept out of the process (the dashboard's form and the CLI's
    light commands use it)."""
    _run_without_torch("""
        from comera_engine.config import load_config, to_toml
        cfg = load_config("experiments/configs/digits_tt_mlp.toml", ["train.steps=5"])
        assert cfg.train.steps == 5 and "[comera]" in to_toml(cfg)
        assert not any(m.startswith(("comera_engine.models", "comera_engine.rank"))
                       for m in sys.modules)
        print("ok")
    """)


def test_schedule_module_is_torch_free() -> None:
    """What the schedules set and when the late stage starts (comera_engine.rank.schedule)
    load with torch and numpy kept out of the process: the rank package's ``__init__``
    imports nothing at import time (the preview and the dashboard use it)."""
    _run_without_torch("""
        from comera_engine.config import CoMERAConfig
        from comera_engine.rank.schedule import method_label, switch_plan
        assert switch_plan(CoMERAConfig(target_compression=10.0), 100).reach == 80
        assert method_label({"comera": {"schedule": "paper"}}) == "CoMERA, schedule paper"
        print("ok")
    """)
