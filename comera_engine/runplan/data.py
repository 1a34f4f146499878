"""A run's data as a model builder sees it, before and after the data is read.

* :func:`data_config`: the ``[data]`` table as ``build_dataset`` takes it;
* :func:`data_shape`: what ``build_model`` needs to know about a dataset, from the
  ``[data]`` table and the dataset registry alone (nothing downloaded or built);
* :func:`data_spec_from_bundle` / :func:`data_spec`: the same facts of a built
  ``DataBundle`` (or of a shape) as plain JSON, the *data spec* a run folder keeps
  (``data_spec.json``, ``plan.json``) and an export rebuilds its model from;
  :func:`data_namespace` turns a spec back into what ``build_model`` reads.

The trainer, ``comera train``, the preview and the export read them from here.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

__all__ = ["data_config", "data_namespace", "data_shape", "data_spec", "data_spec_from_bundle",
           "plain", "same_facts"]

#: the facts of a spec a model is built from (``meta`` is compared key by key)
SPEC_KEYS = ("name", "task", "num_classes", "vocab_size", "seq_len")
_META_LIST_MAX = 256  # meta lists/tensors longer than this are left out of a data spec
_META_STR_MAX = 64  # ... and lists of strings longer than this


def data_config(cfg: Any) -> dict[str, Any]:
    """The ``[data]`` table as ``build_dataset`` takes it (``seed`` defaults to
    ``train.seed``; the run's ``task`` applied)."""
    from comera_engine.data.registry import with_run_task

    data = dict(cfg.data)
    data.setdefault("seed", cfg.train.seed)
    return with_run_task(data, cfg.task)


def data_shape(data: dict[str, Any], task: Any = None) -> types.SimpleNamespace:
    """What ``build_model`` needs to know about a dataset, from its ``[data]`` table and
    the dataset registry only (no file is read, nothing is downloaded; user files are
    read for their columns): task, classes, vocabulary, sequence length. ``task``: the
    run's ``task`` (user data reads it).

    Raises:
        ValueError: the dataset's task has no shape facts.
    """
    from comera_engine.data.registry import dataset_info, resolve_shape, with_run_task

    data = with_run_task(data, task)
    info = dataset_info(str(data.get("name", "")))
    get = {**info.defaults, **data}.get
    shape = resolve_shape(info)
    if shape is not None:  # the dataset tells its own shapes (e.g. its tables' sizes)
        return types.SimpleNamespace(name=info.name, **shape({**info.defaults, **data}))
    if info.task == "classification":
        return types.SimpleNamespace(
            name=info.name, task="classification", num_classes=10, vocab_size=None,
            seq_len=None, meta={"input_dim": 64},
        )
    if info.task in ("nli", "mlm"):
        return types.SimpleNamespace(
            name=info.name, task=info.task, num_classes=3 if info.task == "nli" else None,
            vocab_size=int(get("vocab_size")), seq_len=int(get("seq_len")), meta={"pad_id": 0},
        )
    if info.task == "ctr":
        from comera_engine.data.clicks import NUM_DENSE, normalise_bucket_sizes

        sizes = normalise_bucket_sizes(get("bucket_sizes"))
        return types.SimpleNamespace(
            name=info.name, task="ctr", num_classes=2, vocab_size=None, seq_len=None,
            meta={"num_dense": NUM_DENSE, "bucket_sizes": sizes},
        )
    raise ValueError(f"data.name: no preview for the {info.task!r} task of {info.name!r}")


def plain(value: Any) -> Any:
    """JSON-able copy of a meta value, or ``...`` (Ellipsis) when it should be left out
    (a long list or tensor, a long list of strings: not model-facing)."""
    if hasattr(value, "detach") and hasattr(value, "numel"):  # a torch tensor
        if value.numel() > _META_LIST_MAX:
            return ...
        return value.detach().cpu().tolist()
    if isinstance(value, bool) or value is None or isinstance(value, (int, float, str)):
        return value
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:  # numpy scalar
        return value.item()
    if isinstance(value, (list, tuple)):
        if len(value) > _META_LIST_MAX or (
            len(value) > _META_STR_MAX and any(isinstance(v, str) for v in value)
        ):
            return ...  # e.g. the list of source files: not model-facing
        items = [plain(v) for v in value]
        return ... if any(v is ... for v in items) else items
    if isinstance(value, Mapping):
        out = {str(k): plain(v) for k, v in value.items()}
        return ... if any(v is ... for v in out.values()) else out
    return ...


def data_spec_from_bundle(bundle: Any) -> dict[str, Any]:
    """The part of a ``DataBundle`` (or of a :func:`data_shape`) a model builder needs,
    as plain JSON.

    ``{"name", "task", "num_classes", "vocab_size", "seq_len", "meta"}``; ``meta`` keeps
    the small JSON-able entries (``pad_id``, ``input_dim``, ``bucket_sizes``, the digits
    ``mean``/``std``, ...) and lists the ones left out under ``meta_omitted``.
    """
    meta, omitted = {}, []
    for key, value in dict(getattr(bundle, "meta", {}) or {}).items():
        v = plain(value)
        if v is ...:
            omitted.append(str(key))
        else:
            meta[str(key)] = v
    spec: dict[str, Any] = {key: getattr(bundle, key, None) for key in SPEC_KEYS}
    spec["meta"] = meta
    if omitted:
        spec["meta_omitted"] = sorted(omitted)
    return spec


#: a shape and a bundle give their spec the same way
data_spec = data_spec_from_bundle


def data_namespace(spec: Mapping[str, Any]) -> types.SimpleNamespace:
    """A data spec as the namespace ``build_model`` reads (a bundle's attributes)."""
    return types.SimpleNamespace(
        name=spec.get("name") or "export", task=spec.get("task"),
        num_classes=spec.get("num_classes"), vocab_size=spec.get("vocab_size"),
        seq_len=spec.get("seq_len"), meta=dict(spec.get("meta") or {}),
    )


def same_facts(planned: Mapping[str, Any], built: Mapping[str, Any]) -> bool:
    """Whether a built dataset's spec has the facts a plan was made from: the same task,
    classes, vocabulary and sequence length, and every ``meta`` entry the plan read with
    the same value (a bundle's ``meta`` has more)."""
    if any(planned.get(k) != built.get(k) for k in SPEC_KEYS if k != "name"):
        return False
    have = built.get("meta") or {}
    return all(k in have and have[k] == v for k, v in (planned.get("meta") or {}).items())
