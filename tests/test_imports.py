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


def test_config_module_is_torch_free() -> None:
    """The config model loads, validates and writes a shipped config with torch, numpy
    and every model module kept out of the process (the dashboard's form and the CLI's
    light commands use it)."""
    code = textwrap.dedent("""
        import importlib.abc, sys
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] in ("torch", "numpy", "tensorly"):
                    raise ImportError("blocked: " + name)
        sys.meta_path.insert(0, Block())
        from comera_engine.config import load_config, to_toml
        cfg = load_config("experiments/configs/digits_tt_mlp.toml", ["train.steps=5"])
        assert cfg.train.steps == 5 and "[comera]" in to_toml(cfg)
        assert not any(m.startswith(("comera_engine.models", "comera_engine.rank"))
                       for m in sys.modules)
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
