"""CPU backend, GEMM ways: each batch-sized product of the halves step, one of two ways.

A TT-linear step on the halves path runs six products whose size grows with the batch,
named here by *role*: ``xl`` (``X·L``) and ``y`` (``XL·R``) forward, ``dxl``
(``dY·Rᵀ``), ``dr`` (``XLᵀ·dY``), ``dx`` (``dXL·Lᵀ``) and ``dl`` (``Xᵀ·dXL``) backward.
Each reaches the CPU's BLAS in two ways that compute the same product:

* ``a·b`` (kind ``nn``) and ``a·wᵀ`` (kind ``nt``): MKL (``torch.mm``, way 0) or oneDNN
  (PyTorch's own oneDNN linear op, :func:`onednn_linear`, way 1);
* ``aᵀ·b`` (kind ``tn``, a reduction over the batch): ``aᵀ·b`` (way 0) or ``(bᵀ·a)ᵀ``
  (way 1), both MKL.

Which is faster depends on the CPU as much as on the shape (``bench_gemm_backends.py``), so the
way per role is chosen once per install, by ``python -m comera_engine.backends.cpu
build`` timing both on representative operands (:mod:`.tune`), and stored in the
backend's folder (:class:`Ways`). A run only reads that choice: it never times anything,
and two runs of one seed on one install take the same ways and give the same numbers.
Without a choice, and for products below :data:`MIN_ROWS` rows, other dtypes or under
autocast, a fixed rule applies: MKL, and the caller's default form for ``aᵀ·b``.
The two steps (``halves-fwd``, ``halves-bwd``: the products one by one, way 0, or
row-blocked in C++, way 1) are chosen the same way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch
from torch import Tensor

__all__ = ["KINDS", "MIN_ROWS", "ROLES", "Ways", "large_cpu_fp32", "onednn_linear", "run"]

MIN_ROWS = 1024
"""Products with fewer rows (batch rows; for ``tn`` the reduced batch axis) take the
fixed rule: they take microseconds, and oneDNN's per-call cost made it 1.1-2.4× slower
than MKL at 128-512 rows on both machines measured."""

KINDS = {"nn": ("mkl", "onednn"), "nt": ("mkl", "onednn"), "tn": ("ab", "ba"),
         "step": ("gemms", "blocked")}
"""Per kind, the names of way 0 and way 1."""

ROLES = {"xl": "nn", "y": "nn", "dxl": "nt", "dx": "nt", "dr": "tn", "dl": "tn",
         "halves-fwd": "step", "halves-bwd": "step"}
"""Per role (a product of the halves step, or the whole step), its kind."""


@lru_cache(maxsize=1)
def onednn_linear():  # noqa: ANN201
    """oneDNN's fp32 matmul as PyTorch ships it (``a·wᵀ + b``), or None where this build
    lacks it or it fails a first exact check on small integers."""
    try:
        op = torch.ops.mkldnn._linear_pointwise
        a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
        w = torch.arange(12, dtype=torch.float32).reshape(4, 3)
        if torch.equal(op(a, w, None, "none", [], ""), a @ w.t()):
            return op
    except Exception:  # noqa: BLE001 (absent op, unsupported CPU: MKL only)
        pass
    return None


def run(kind: str, way: int, a: Tensor, b: Tensor) -> Tensor:
    """One product, one way. ``kind`` ``"nn"``: ``a·b`` (``a``: ``(m, k)``, ``b``:
    ``(k, n)``); ``"nt"``: ``a·bᵀ`` (``b``: ``(n, k)``); ``"tn"``: ``aᵀ·b`` (``a``:
    ``(r, m)``, ``b``: ``(r, n)``); returns ``(m, n)``. ``way`` 0: MKL / ``aᵀ·b``; 1:
    oneDNN / ``(bᵀ·a)ᵀ``."""
    if kind == "tn":
        return a.t() @ b if way == 0 else (b.t() @ a).t()
    if way == 0:
        return a @ b if kind == "nn" else a @ b.t()
    w = b.t().contiguous() if kind == "nn" else b.contiguous()  # oneDNN wants w = (n, k)
    return onednn_linear()(a, w, None, "none", [], "")


def large_cpu_fp32(a: Tensor) -> bool:
    """Whether ``a`` is a batch operand that takes the install's choice: from
    :data:`MIN_ROWS` rows, fp32 on the CPU, outside autocast."""
    return (a.shape[0] >= MIN_ROWS and a.device.type == "cpu"
            and a.dtype == torch.float32 and not torch.is_autocast_enabled("cpu"))


def _can_choose(kind: str, a: Tensor, b: Tensor) -> bool:
    """Whether both ways can run this product and it is large enough for the choice."""
    if not large_cpu_fp32(a) or b.dtype != torch.float32:
        return False
    return kind == "tn" or (a.is_contiguous() and onednn_linear() is not None)


@dataclass(frozen=True)
class Ways:
    """The install's way per role (``ROLES``; 0 or 1, absent: way 0), read from the
    backend folder's ``choices.json`` (written by the build, :mod:`.tune`)."""

    chosen: dict[str, int] = field(default_factory=dict)

    @staticmethod
    def read(path: Path) -> Ways:
        """The ways saved in ``path``; none (the fixed rule everywhere) when the file is
        absent or not this format."""
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return Ways()
        got = data.get("ways") if isinstance(data, dict) else None
        if not isinstance(got, dict):
            return Ways()
        return Ways({r: KINDS[ROLES[r]].index(w) for r, w in got.items()
                     if r in ROLES and w in KINDS[ROLES[r]]})

    def names(self) -> dict[str, str]:
        """Per role, the name of the way taken for large operands (for reports)."""
        return {r: KINDS[k][self.chosen.get(r, 0)] for r, k in ROLES.items()}

    def product(self, role: str, a: Tensor, b: Tensor, default: int = 0) -> Tensor:
        """The product of ``role`` (see :func:`run` for the shapes): the install's way for
        large fp32 operands, else the fixed rule (way 0; ``default`` for ``tn``)."""
        return run(ROLES[role], self.way(role, a, b, default), a, b)

    def way(self, role: str, a: Tensor, b: Tensor, default: int = 0) -> int:
        """The way :meth:`product` takes for these operands (0 or 1)."""
        kind = ROLES[role]
        if role in self.chosen and _can_choose(kind, a, b):
            return self.chosen[role]
        return default if kind == "tn" else 0

    def blocked(self, role: str, x: Tensor) -> bool:
        """Whether the step ``role`` (``"halves-fwd"``/``"halves-bwd"``) on batch input
        ``x`` runs row-blocked in C++: where the install chose it and ``x`` is a large
        contiguous fp32 CPU batch."""
        return bool(self.chosen.get(role, 0)) and large_cpu_fp32(x) and x.is_contiguous()
