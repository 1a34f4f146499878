"""CoMERA engine: rank-adaptive tensor-train training (arXiv 2405.14377).

The method for your own model and training loop (README, "Your own model and training
loop")::

    config = ce.CoMERAConfig(target_compression=20)
    model = ce.tensorize(MyNet(), config, exclude=["head"])
    comera = ce.CoMERA(model, config, total_steps=1500)
    opt = torch.optim.AdamW(comera.param_groups(), lr=2e-3)   # your optimizer, your lr
    comera.attach(opt)                                        # its step after opt.step()
    sched = ce.lr_scheduler(opt, "cosine", comera=comera)     # optional: decays once sized
    ...  # loss = comera.loss(task_loss); opt.zero_grad(); loss.backward(); opt.step(); sched.step()
    ce.save(model, "small.safetensors"); ce.load_into(MyNet(), "small.safetensors")

``import comera_engine`` is cheap: ``CoMERAConfig`` is torch-free, and the layers (and
torch) load on first use of ``CoMERA``, ``TTLinear``, ``TTEmbedding``, ``tensorize``,
``truncate``, ``size_report``, ``save`` / ``load_into``, ``load`` (what ``comera export``
wrote, no pickle) or the TT math (``tt_svd``, ``max_tt_ranks``, ``plan``, ``estimate``,
``explain``), so the run store, the launcher and the CLI's light commands start fast;
nothing below it imports it (``docs/ARCHITECTURE.md``). It needs only torch, numpy and
tensorly; datasets, tokenizers, streamlit, pynvml and onnx are imported where used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_getattr
from ._version import __version__

__all__ = ["CoMERA", "CoMERAConfig", "TTEmbedding", "TTEmbeddingBag", "TTLinear",
           "TrainingDiverged", "__version__", "estimate", "explain", "load", "load_into",
           "lr_scheduler", "max_tt_ranks", "plan", "save", "size_report", "tensorize", "truncate",
           "tt_svd"]

#: Public names loaded on first use (torch with all but the config), and their modules.
_LAZY = {"CoMERA": "rank", "CoMERAConfig": "config", "TTEmbedding": "layers",
         "TTEmbeddingBag": "layers",
         "TTLinear": "layers", "TrainingDiverged": "errors", "size_report": "layers",
         "tensorize": "rank", "truncate": "layers",
         "save": "export.weights", "load_into": "export.weights", "load": "export",
         "tt_svd": "tensor",
         "max_tt_ranks": "tensor", "explain": "tensor", "plan": "tensor",
         "estimate": "tensor", "lr_scheduler": "train.lr_schedule"}

if TYPE_CHECKING:  # pragma: no cover
    from .config import CoMERAConfig
    from .errors import TrainingDiverged
    from .export import load
    from .export.weights import load_into, save
    from .layers import TTEmbedding, TTEmbeddingBag, TTLinear, size_report, truncate
    from .rank import CoMERA, tensorize
    from .tensor import estimate, explain, max_tt_ranks, plan, tt_svd
    from .train.lr_schedule import lr_scheduler


__getattr__ = lazy_getattr(__name__, _LAZY)

