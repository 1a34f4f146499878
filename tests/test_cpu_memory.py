"""keep_freed_memory: a CPU training step reuses freed pages instead of faulting in new
ones (glibc's mallopt thresholds); train applies it to CPU runs."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from comera_engine.backends.cpu import heap as cpu_memory
from comera_engine.backends.cpu.heap import keep_freed_memory

# Allocates and frees a 40 MB tensor (above glibc's largest dynamic mmap threshold, so
# each one is a fresh mapping by default) ten times after thirty warm-up rounds (with few
# modules imported, the small allocations between the tensors settle in only after some
# rounds: three left one or two tensors' worth of new pages, and ten, on a machine busy
# with the other test worker, one); prints
# the mmap threshold set and the minor page faults of the ten.
_FAULTS = textwrap.dedent(
    """
    import resource, sys
    import torch
    from comera_engine.backends.cpu.heap import keep_freed_memory

    kept = keep_freed_memory() if sys.argv[1] == "keep" else 0
    for _ in range(30):  # the heap grows to its working size: faults either way
        torch.ones(10_000_000).sum()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        torch.ones(10_000_000).sum()
    print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)


def _faults(mode: str) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()
    return int(out[0]), int(out[1])


def test_freed_memory_is_reused_instead_of_faulted_in_again() -> None:
    """Without the setting every 40 MB tensor is a new mapping: ~9800 page faults each
    (4 KiB pages). With it, the freed block is reused: almost none."""
    if cpu_memory._glibc_mallopt() is None:
        pytest.skip("not Linux with glibc: keep_freed_memory changes nothing here")
    _, default = _faults("default")
    kept, faults = _faults("keep")
    if kept < 40_000_000:
        pytest.skip(f"this glibc caps the mmap threshold at {kept} bytes, below the test's "
                    "40 MB tensor")
    assert default > 10 * 5000  # each tensor faulted in anew
    assert faults < default / 20


def test_switched_off_by_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("COMERA_KEEP_FREED_MEMORY", "0")
    assert keep_freed_memory() == 0


@pytest.mark.parametrize("kwargs", [{"mmap_threshold": 0}, {"trim_threshold": 2**31}])
def test_bad_thresholds_name_the_argument(kwargs) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        keep_freed_memory(**kwargs)
