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


def destroy() -> None:
    if tdist.is_initialized():
        # WARN: a gloo worker thread releases each finished collective's tensors itself, and freeing
        # a tensor Python has already dropped takes the GIL. A group destroyed from Python (GIL held)
        # joins its workers: if one is still releasing, the process hangs at exit (seen in 2 of 3 DDP
        # runs). Sleeping hands the GIL over so the release finishes. No barrier: on the config-error
        # path the other ranks may be inside another collective.
        time.sleep(0.05)
        tdist.destroy_process_group()


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    if tdist.is_initialized() and tdist.get_world_size() > 1:
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return t
