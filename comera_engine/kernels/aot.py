"""Compile the Triton kernels ahead of time for a GPU that is not here, and read what the
compiled code needs: registers per thread, spills, shared memory.

``triton.compile(..., target=GPUTarget("cuda", 90, 32))`` runs the whole pipeline to PTX
and a cubin without a GPU; ``cuobjdump --dump-resource-usage`` (shipped inside the Triton
wheel) reads the cubin's registers and local memory (spills go to local memory), and the
compile metadata holds the dynamic shared memory. Used by ``tests/test_kernels.py`` and
``experiments/kernels_aot.py``.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["ARCHS", "CompileReport", "compile_kernel", "paper_cases"]

#: Compute capability -> (name, shared memory a block may use, bytes: the opt-in maximum).
ARCHS: dict[int, tuple[str, int]] = {80: ("A100 (sm_80)", 163 * 1024),
                                     90: ("H100 (sm_90)", 227 * 1024)}

_DTYPES = {"fp32": "*fp32", "bf16": "*bf16", "fp16": "*fp16"}


@dataclass
class CompileReport:
    kernel: str
    arch: int
    dtype: str
    constexprs: dict[str, Any]
    registers: int
    spill_bytes: int  # local memory per thread (spilled registers)
    shared_bytes: int  # dynamic + static shared memory per block
    shared_limit: int
    ptx_lines: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _signature(fn: Any, pointers: tuple[str, ...], dtype: str, constexprs: dict[str, Any]
               ) -> dict[str, str]:
    sig = {}
    index = {p.split(":")[0] for p in pointers if p.endswith(":i64")}  # id/offset arrays
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in index:
            sig[name] = "*i64"
        elif name in pointers:
            sig[name] = _DTYPES[dtype]
        else:
            sig[name] = "i32"
    return sig


def compile_kernel(fn: Any, pointers: tuple[str, ...], dtype: str, arch: int,
                   constexprs: dict[str, Any]) -> CompileReport:
    """Compile the ``@triton.jit`` function ``fn`` for ``sm_<arch>`` with ``pointers``
    of ``dtype`` (``"NAME:i64"``: an int64 array) and every other non-constexpr argument
    an ``i32``; report its needs."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if "PRECISION" in constexprs:  # as the launchers choose (tt_linear.precision)
        constexprs = {**constexprs, "PRECISION": "ieee" if dtype == "fp32" else "tf32",
                      "UPCAST": False}
    src = ASTSource(fn=fn, signature=_signature(fn, pointers, dtype, constexprs),
                    constexprs=constexprs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32))
    usage = _resource_usage(compiled.asm["cubin"])
    return CompileReport(
        kernel=fn.__name__, arch=arch, dtype=dtype, constexprs=dict(constexprs),
        registers=usage["REG"], spill_bytes=usage["LOCAL"],
        shared_bytes=int(compiled.metadata.shared) + usage["SHARED"],
        shared_limit=ARCHS[arch][1], ptx_lines=compiled.asm["ptx"].count("\n"))


def _resource_usage(cubin: bytes) -> dict[str, int]:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        text = subprocess.run([str(tool), "--dump-resource-usage", str(path)],
                              capture_output=True, text=True, check=True, timeout=60).stdout
    line = next(ln for ln in text.splitlines() if "REG:" in ln)
    return {k: int(v) for k, v in re.findall(r"(REG|SHARED|LOCAL):(\d+)", line)}


def paper_cases() -> list[tuple[Any, tuple[str, ...], dict[str, Any]]]:
    """The kernels at the paper's shapes: the TT-linear chain at rank 30 (rank tile 32),
    64 and the largest tile, 128; the fused TTM lookup at the word embedding's shapes:
    ``(kernel, pointer args, constexprs)`` each."""
    from . import tt_linear as K

    chain = (K.chain_kernel, ("A", "P", "Q", "BIAS", "OUT", "MID"))
    cases = []
    for block_r in (32, 64, K.MAX_RANK):
        cases.append((*chain, dict(HAS_BIAS=True, SAVE_MID=True, PRECISION="tf32", UPCAST=False,
                                   BLOCK_B=K.BLOCK_B, BLOCK_K=K.BLOCK_K, BLOCK_R=block_r,
                                   BLOCK_M=K.BLOCK_M)))
    cases.append((K.matmul_tn_kernel, ("A", "G", "C"),
                  dict(PRECISION="tf32", UPCAST=False, BLOCK_I=K.BLOCK_I, BLOCK_J=K.BLOCK_J,
                       BLOCK_ROWS=K.BLOCK_ROWS)))
    cases.append((K.colsum_kernel, ("G", "OUT"),
                  dict(BLOCK_ROWS=K.BLOCK_ROWS, BLOCK_M=K.BLOCK_M)))
    # the fused TTM lookup at the paper's word embedding: rows 16·20 | 10·10, columns
    # 4·4 | 8·6 (E_a 16, E_b 48 -> a 64 tile), rank 32; and at rank 64
    from . import ttm_lookup as T

    for block_r in (32, 64):
        blocks = dict(PRECISION="tf32", UPCAST=False, BLOCK_EA=16, BLOCK_R=block_r,
                      BLOCK_EB=64)
        cases.append((T.lookup_kernel, ("IDS:i64", "A", "BT", "OUT"), blocks))
        grads = ("ORDER:i64", "START:i64", "COUNT:i64", "OTHER:i64", "G", "H", "D")
        for m, n in ((16, 64), (64, 16)):  # dA (tiles E_a x E_b), dBt transposed (E_b x E_a)
            cases.append((T.segment_grad_kernel, grads,
                          dict(PRECISION="tf32", UPCAST=False, BLOCK_M=m, BLOCK_N=n,
                               BLOCK_R=block_r)))
    return cases
