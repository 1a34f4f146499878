"""Running under ``torchrun``: process group setup, device choice, small collectives.

Under ``torchrun --nproc_per_node N`` every process gets ``RANK``, ``WORLD_SIZE`` and
``LOCAL_RANK``; we join a process group (NCCL on GPU, gloo on CPU) and wrap the model in
``DistributedDataParallel``. Only rank 0 writes metrics and checkpoints. Without those
variables everything here is a no-op for a single process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from comera_engine.errors import ConfigError


@dataclass
class DistInfo:
    """Where this process sits: ``rank`` of ``world_size``; ``enabled`` under torchrun."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    enabled: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """``auto`` -> ``cuda:<local_rank>`` when a GPU is there, else ``cpu``."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda:") and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("train.device", f"{name} would put every torchrun process on one "
                          "GPU; use 'cuda' or 'auto' (each process takes cuda:<LOCAL_RANK>)")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError("train.device", f"{name} asked for, but no CUDA device is available")
        if name == "cuda":
            return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device(name)


def init_distributed(device: torch.device) -> DistInfo:
    """Join the process group when launched by torchrun (``WORLD_SIZE`` > 1)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend=backend)
    return DistInfo(rank=rank, world_size=world, local_rank=local_rank, enabled=True)


def shutdown(info: DistInfo, barrier: bool = True) -> None:
    """Leave the process group (after a final barrier, unless this process failed)."""
    if info.enabled and dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()


def all_reduce_values(info: DistInfo, values: list[float], op: str = "sum") -> list[float]:
    """Sum (or max) a short list of floats over all processes (identity when alone)."""
    if not info.enabled:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return t.cpu().tolist()


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()
