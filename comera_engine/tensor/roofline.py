"""The roofline: what a device can do at best, and how close a measured time comes to it.

A kernel that does ``F`` floating-point operations and moves ``Q`` bytes takes at least

    t_roof = max(F / P, Q / BW)

on a device of peak rate ``P`` (FLOP/s, for the dtype of its products) and memory
bandwidth ``BW`` (B/s). ``% of roofline`` is ``t_roof / t_measured``: 100 % is the device's
limit, what the benchmarks print next to their times (:func:`roofline_report`).

:data:`GPU_SPECS` holds the datasheet peaks of the GPUs this project meets (dense tensor-
core rates for bf16/fp16, the CUDA-core rate for fp32: torch's default matmul does not use
TF32), matched by the name CUDA reports (:func:`spec_for_name`). The planner's fallback
model for a GPU without a measured profile starts from these peaks
(:mod:`comera_engine.tensor.profile`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["GPU_SPECS", "DeviceSpec", "dtype_name", "geometric_mean", "linear_traffic",
           "lookup_traffic", "roofline_report", "roofline_seconds", "spec_for_name",
           "tt_linear_traffic"]


@dataclass(frozen=True)
class DeviceSpec:
    """Datasheet peaks of one device: FLOP/s per dtype name (``"float32"``,
    ``"bfloat16"``, ``"float16"``) and memory bandwidth (B/s)."""

    name: str
    flops: tuple[tuple[str, float], ...]
    bandwidth: float

    def peak_flops(self, dtype: str) -> float:
        """FLOP/s for products in ``dtype`` (fp16 as bf16 where only one is listed)."""
        table = dict(self.flops)
        if dtype in table:
            return table[dtype]
        if dtype in ("bfloat16", "float16"):
            return table.get("bfloat16", table.get("float16", table["float32"]))
        return table["float32"]

    def as_dict(self) -> dict:
        return {"name": self.name, "flops": dict(self.flops), "bandwidth": self.bandwidth}

    @staticmethod
    def from_dict(d: dict) -> DeviceSpec:
        """The inverse of :meth:`as_dict`; ValueError naming the field that is wrong."""
        try:
            flops = {str(k): float(v) for k, v in dict(d["flops"]).items()}
            spec = DeviceSpec(str(d["name"]), tuple(sorted(flops.items())),
                              float(d["bandwidth"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"device spec: needs name, flops {{dtype: FLOP/s}} and "
                             f"bandwidth (B/s); {type(exc).__name__}: {exc}") from None
        if "float32" not in flops or min(flops.values()) <= 0 or spec.bandwidth <= 0:
            raise ValueError("device spec: flops needs a positive float32 entry, and every "
                             "rate and the bandwidth must be positive")
        return spec


def _spec(name: str, fp32: float, bf16: float, bw: float) -> DeviceSpec:
    """A spec from TFLOP/s (fp32 CUDA cores, bf16/fp16 dense tensor cores) and TB/s."""
    return DeviceSpec(name, (("bfloat16", bf16 * 1e12), ("float16", bf16 * 1e12),
                             ("float32", fp32 * 1e12)), bw * 1e12)


#: Datasheet peaks by a pattern of the CUDA device name (first match wins: the more
#: specific patterns first). Dense (no sparsity) tensor-core rates.
GPU_SPECS: tuple[tuple[str, DeviceSpec], ...] = (
    (r"GH200", _spec("NVIDIA GH200", 66.9, 989.4, 4.0)),
    (r"H200", _spec("NVIDIA H200", 66.9, 989.4, 4.8)),
    (r"H100.*PCIe", _spec("NVIDIA H100 PCIe", 51.2, 756.0, 2.0)),
    (r"H100.*NVL", _spec("NVIDIA H100 NVL", 60.0, 835.0, 3.9)),
    (r"H100", _spec("NVIDIA H100 SXM", 66.9, 989.4, 3.35)),
    (r"A100.*80", _spec("NVIDIA A100 80GB", 19.5, 312.0, 2.04)),
    (r"A100", _spec("NVIDIA A100 40GB", 19.5, 312.0, 1.56)),
    (r"L40S", _spec("NVIDIA L40S", 91.6, 362.0, 0.864)),
    (r"L4\b", _spec("NVIDIA L4", 30.3, 121.0, 0.3)),
    (r"A10\b", _spec("NVIDIA A10", 31.2, 125.0, 0.6)),
    (r"4090", _spec("NVIDIA GeForce RTX 4090", 82.6, 165.2, 1.008)),
    (r"3090", _spec("NVIDIA GeForce RTX 3090", 35.6, 71.0, 0.936)),
    (r"V100", _spec("NVIDIA V100", 15.7, 125.0, 0.9)),
    (r"T4\b", _spec("NVIDIA T4", 8.1, 65.0, 0.32)),
)


def spec_for_name(name: str) -> DeviceSpec | None:
    """The datasheet spec of the GPU called ``name`` (as ``torch.cuda.get_device_name``
    says it), or None where :data:`GPU_SPECS` does not know it."""
    for pattern, spec in GPU_SPECS:
        if re.search(pattern, name):
            return spec
    return None


def dtype_name(dtype: object) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (strings pass through)."""
    return str(dtype).removeprefix("torch.")


def roofline_seconds(flops: float, nbytes: float, spec: DeviceSpec, dtype: str) -> float:
    """``max(F / P_dtype, Q / BW)``: the least time ``flops`` and ``nbytes`` can take."""
    return max(flops / spec.peak_flops(dtype), nbytes / spec.bandwidth)


def roofline_report(seconds: float, flops: float, nbytes: float, spec: DeviceSpec | None,
                    dtype: str) -> dict:
    """What a measured time achieved: ``tflops`` and ``gbps`` (achieved rates), and, with
    a ``spec``, ``roofline_ms`` and ``pct_roofline`` (``t_roof / t``, in percent), the
    ``bound`` (``"memory"`` or ``"compute"``) and the peaks used. Without a spec the
    percentages are None (the device's peak is not known)."""
    out = {"tflops": flops / seconds / 1e12, "gbps": nbytes / seconds / 1e9,
           "flops": flops, "bytes": nbytes, "roofline_ms": None, "pct_roofline": None,
           "bound": None}
    if spec is not None:
        t = roofline_seconds(flops, nbytes, spec, dtype)
        out.update(roofline_ms=t * 1e3, pct_roofline=100.0 * t / seconds,
                   bound="memory" if nbytes / spec.bandwidth >= flops / spec.peak_flops(dtype)
                   else "compute", peak_tflops=spec.peak_flops(dtype) / 1e12,
                   peak_gbps=spec.bandwidth / 1e9)
    return out


def tt_linear_traffic(tokens: int, n: int, m: int, rank: int, params: int, elt: int,
                      training: bool = True) -> tuple[float, float]:
    """``(FLOPs, bytes)`` a TT linear ``n -> m`` of middle rank ``rank`` cannot go below
    for ``tokens`` rows: the batch products of the halves path (``2·B·r·(N+M)`` FLOPs
    forward, twice that backward) and ``X``, ``Y`` read or written once (and ``dY``,
    ``dX`` backward) plus the cores and their gradients (``params`` elements).
    E.g. 768×3072, rank 30, 4096 tokens, bf16: about 2.8 GFLOP and 63 MB."""
    fwd = 2.0 * tokens * rank * (n + m)
    flops = fwd * (3 if training else 1)
    acts = tokens * (n + m) * (2 if training else 1)
    nbytes = (acts + params * (2 if training else 1)) * elt
    return flops, float(nbytes)


def linear_traffic(tokens: int, n: int, m: int, elt: int) -> tuple[float, float]:
    """``(FLOPs, bytes)`` of ``nn.Linear`` ``n -> m`` forward + backward on ``tokens``
    rows: ``6·B·N·M`` FLOPs; ``X``, ``Y``, ``dY``, ``dX``, ``W`` and ``dW`` once each."""
    return 6.0 * tokens * n * m, float((2 * tokens * (n + m) + 2 * n * m) * elt)


def lookup_traffic(tokens: int, dim: int, products: float, params: int, elt: int
                   ) -> tuple[float, float]:
    """``(FLOPs, bytes)`` of a TTM lookup of ``tokens`` ids, forward + backward: the
    rows' products (``products`` MACs forward, twice that backward), the rows written and
    their gradient read once, the cores and their gradients."""
    return 6.0 * products, float((2 * tokens * dim + 2 * params) * elt)


def geometric_mean(values: Sequence[float]) -> float:
    """``exp(mean(log v))`` of positive values (1.0 for none)."""
    vals = [v for v in values if v > 0]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else 1.0
