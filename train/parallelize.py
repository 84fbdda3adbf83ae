"""Process-group setup and DDP wrapping for `torchrun`, kept out of the model code.

`torchrun --nproc-per-node N dflash-train ...` sets RANK/WORLD_SIZE/LOCAL_RANK; a plain launch is a
world of one and never touches torch.distributed. Backend: nccl on CUDA, gloo on CPU.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


@dataclass(frozen=True, slots=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def pick_device(requested: str, local_rank: int = 0) -> torch.device:
    """`auto` takes CUDA when present; asking for CUDA without one is a settings error."""
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch sees no CUDA device: pass --device cpu or auto")
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def init_distributed(requested_device: str, timeout_s: float = 1800.0) -> DistInfo:
    """Join the torchrun process group when there is one; otherwise a single-process world."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(requested_device, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def mixed_precision(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA (fp32 master weights stay fp32); plain fp32 elsewhere."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def wrap_model(model: torch.nn.Module, info: DistInfo) -> torch.nn.Module:
    """DDP over the drafter when the world has more than one process (frozen parts are not parameters)."""
    if not info.distributed:
        return model
    device_ids = [info.device.index] if info.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, broadcast_buffers=False)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model


@contextlib.contextmanager
def no_sync_unless(model: torch.nn.Module, sync: bool) -> Iterator[None]:
    """Skip the gradient all-reduce on accumulation micro-steps; only the last one syncs."""
    if sync or not isinstance(model, DistributedDataParallel):
        yield
    else:
        with model.no_sync():
            yield


def all_reduce_sum(values: list[float], info: DistInfo) -> list[float]:
    """Sum a few floats over ranks (one small collective); identity in a world of one."""
    if not info.distributed:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=info.device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def barrier(info: DistInfo) -> None:
    if info.distributed:
        if info.device.type == "cuda":
            dist.barrier(device_ids=[info.device.index])
        else:
            dist.barrier()


def shutdown(info: DistInfo) -> None:
    if info.distributed and dist.is_initialized():
        dist.destroy_process_group()
