"""Models: the paper's transformer (classifier and masked LM), DLRM, a TT MLP, and user
models by entry point (``model.factory``, :mod:`comera_engine.models.custom`).

:func:`build_model` turns a ``[model]`` config plus the dataset's shape information
into a network; ``dense=True`` (or ``model.dense = true``) gives the dense baseline of
the very same architecture, which is what "N x smaller" and "N x faster" are measured
against. :class:`TaskModel` adds the task loss on top.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from comera_engine.errors import ConfigError
from comera_engine.models import dlrm, mlp, transformer
from comera_engine.models.common import DEFAULT_TT_LAYERS, LayerFactory
from comera_engine.models.dlrm import DLRM
from comera_engine.models.mlp import TTMLP
from comera_engine.models.tasks import TaskModel, roc_auc, run_task
from comera_engine.models.transformer import TransformerClassifier, TransformerMLM

if TYPE_CHECKING:
    from comera_engine.config import ModelConfig

__all__ = [
    "DLRM",
    "TTMLP",
    "LayerFactory",
    "TaskModel",
    "TransformerClassifier",
    "TransformerMLM",
    "build_model",
    "roc_auc",
    "run_task",
    "MODEL_TASKS",
]

#: The dataset task each model trains on.
MODEL_TASKS: dict[str, tuple[str, ...]] = {
    "transformer_cls": ("nli", "text"),
    "transformer_mlm": ("mlm",),
    "dlrm": ("ctr",),
    "tt_mlp": ("classification",),
}


def _fitting(task: Any) -> str:
    """The built-in models that train on ``task``, for a message (``"tt_mlp"``)."""
    names = [f'"{n}"' for n, tasks in MODEL_TASKS.items() if task in tasks]
    return " or ".join(names) if names else "a model for it (model.factory)"


def build_model(cfg: ModelConfig, data: Any, dense: bool | None = None) -> nn.Module:
    """Build the network of ``cfg`` for a dataset.

    Args:
        cfg: the ``[model]`` config.
        data: a ``DataBundle`` (or anything with ``task``, ``num_classes``,
            ``vocab_size``, ``seq_len`` and ``meta``: ``input_dim`` for images,
            ``pad_id`` for text, ``num_dense``/``bucket_sizes`` for clicks).
        dense: override ``cfg.dense`` (``True``: the dense baseline).

    Raises:
        ConfigError: the model does not fit the dataset's task, or a size field is bad.
    """
    if cfg.name == "custom":  # a user model by entry point (models/custom.py)
        from comera_engine.models.custom import build_custom

        return build_custom(cfg, data, cfg.dense if dense is None else dense)
    task = getattr(data, "task", None)
    if task not in MODEL_TASKS[cfg.name]:
        raise ConfigError(
            "model.name",
            f"{cfg.name} trains on {'/'.join(MODEL_TASKS[cfg.name])} data, but the dataset "
            f"'{getattr(data, 'name', '?')}' is a {task} task; set model.name to "
            f"{_fitting(task)} (transformer_cls is the default when model.name is not set)",
        )
    dense = cfg.dense if dense is None else dense
    kinds = cfg.tt_layers if cfg.tt_layers is not None else DEFAULT_TT_LAYERS[cfg.name]
    impl = getattr(cfg, "tt_impl", None) or "comera"  # model.tt_impl (docs/METHODS.md)
    layout = getattr(cfg, "linear_layout", None) or "tt"  # model.linear_layout
    meta = dict(getattr(data, "meta", {}) or {})

    if cfg.name in ("transformer_cls", "transformer_mlm"):
        size = transformer.resolve_size(
            cfg.preset,
            d_model=cfg.d_model,
            n_layers=cfg.n_layers,
            n_heads=cfg.n_heads,
            d_ff=cfg.d_ff,
            dropout=cfg.dropout,
            rank=cfg.rank,
            embedding_rank=cfg.embedding_rank,
        )
        factory = LayerFactory(kinds, size.rank, size.embedding_rank, dense=dense, impl=impl,
                                linear_layout=layout)
        vocab, max_len = int(data.vocab_size), int(data.seq_len)
        pad_id = meta.get("pad_id", 0)
        if cfg.name == "transformer_cls":
            return TransformerClassifier(
                size, factory, vocab, max_len, int(data.num_classes), pad_id
            )
        return TransformerMLM(size, factory, vocab, max_len, pad_id)

    if cfg.name == "dlrm":
        base = dlrm.PRESETS[cfg.preset]
        size = dlrm.DLRMSize(
            embedding_dim=cfg.embedding_dim or base.embedding_dim,
            bottom_mlp=tuple(cfg.bottom_mlp) if cfg.bottom_mlp is not None else base.bottom_mlp,
            top_mlp=tuple(cfg.top_mlp) if cfg.top_mlp is not None else base.top_mlp,
            rank=cfg.rank or base.rank,
            embedding_rank=cfg.embedding_rank or base.embedding_rank,
            tt_min_rows=cfg.tt_min_rows if cfg.tt_min_rows is not None else base.tt_min_rows,
        )
        factory = LayerFactory(kinds, size.rank, size.embedding_rank, dense=dense, impl=impl,
                                linear_layout=layout)
        return DLRM(size, factory, int(meta["num_dense"]), list(meta["bucket_sizes"]))

    base = mlp.PRESETS[cfg.preset]
    size = mlp.MLPSize(
        hidden=tuple(cfg.hidden) if cfg.hidden is not None else base.hidden,
        rank=cfg.rank or base.rank,
        dropout=cfg.dropout if cfg.dropout is not None else base.dropout,
    )
    factory = LayerFactory(kinds, size.rank, size.rank, dense=dense, impl=impl,
                           linear_layout=layout)
    return TTMLP(size, factory, int(meta["input_dim"]), int(data.num_classes))
