"""Process-group setup and the few collectives the step needs.

One code path for 1 and N processes: with a world of one every collective is the identity, so the
training step never branches on "am I distributed?".
"""
from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as tdist
from torch.nn.parallel import DistributedDataParallel


@dataclass(frozen=True)
class Dist:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    backend: str | None  # None when running as a single plain process

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _pick_device(device: str, local_rank: int) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device=cuda: CUDA is not available on this machine (use device=cpu or auto)")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if device == "cpu":
        return torch.device("cpu")
    raise ValueError(f"device={device}: expected one of auto, cpu, cuda")


def init_distributed(device: str = "auto", timeout_s: float = 600.0) -> Dist:
    """Join the process group torchrun describes in the environment, or run alone.

    NOTE: gloo on CPU, NCCL on CUDA. Both ranks must agree, so the backend follows the device.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = _pick_device(device, local_rank)
    backend = None
    if world > 1:
        backend = "nccl" if dev.type == "cuda" else "gloo"
        if not tdist.is_initialized():
            tdist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return Dist(rank=rank, world=world, local_rank=local_rank, device=dev, backend=backend)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """In-place SUM over all ranks; the identity in a single process."""
    if tdist.is_initialized() and tdist.get_world_size() > 1:
        tdist.all_reduce(t, op=tdist.ReduceOp.SUM)
    return t


def broadcast_object(obj, src: int = 0):
    """Rank `src`'s Python object on every rank (used for decisions only rank 0 may take)."""
    if not (tdist.is_initialized() and tdist.get_world_size() > 1):
        return obj
    box = [obj]
    tdist.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    if tdist.is_initialized() and tdist.get_world_size() > 1:
        tdist.barrier()


def release(*modules) -> None:
    """Free DDP's C++ reducer (and the logger that shares it) now, while Python still holds the group.

    WARN: the group's destructor joins gloo's worker threads, and a worker releasing a finished
    collective's Python state (a tensor, the thread-local state it was launched under) needs the GIL.
    torch destroys a group whose last owner is a Python reference with the GIL released; but when DDP's
    reducer is the last owner (destroy_process_group() ran, the DDP module died after it) the group dies
    inside the reducer's destructor, GIL held: a deadlock at exit (stack: Reducer dealloc ->
    ProcessGroupGloo dtor -> thread join; seen in the 2-process tests, 1 run in ~3 of one of them).
    Released first, the reducer never owns the group last."""
    for m in modules:
        m = getattr(m, "_orig_mod", m)  # a torch.compile'd wrapper holds the DDP module it compiled
        if isinstance(m, DistributedDataParallel):
            for name in ("logger", "reducer"):
                m.__dict__.pop(name, None)


def destroy(*modules) -> None:
    """Release `modules` (DDP wrappers: release above), then destroy the default group."""
    release(*modules)
    if tdist.is_initialized():
        # NOTE: the sleep hands the GIL to a gloo worker still releasing its last collective, for the
        # same deadlock through an owner release() does not know of. No barrier: on the config-error
        # path the other ranks may be inside another collective.
        time.sleep(0.05)
        tdist.destroy_process_group()


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    if tdist.is_initialized() and tdist.get_world_size() > 1:
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return t
