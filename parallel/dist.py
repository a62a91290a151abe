"""Process-group setup and the few collectives the step needs.

One code path for 1 and N processes: with a world of one every collective is the identity, so the
training step never branches on "am I distributed?".
"""
from __future__ import annotations

import datetime
import gc
import os
import sys
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


def all_gather_object(obj) -> list:
    """Every rank's Python object, in rank order, on every rank."""
    if not (tdist.is_initialized() and tdist.get_world_size() > 1):
        return [obj]
    out = [None] * tdist.get_world_size()
    tdist.all_gather_object(out, obj)
    return out


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


def destroy() -> None:
    """Destroy the default group so that it dies here, with the interpreter whole.

    WARN: the group's destructor joins gloo's worker threads, and a worker still releasing a finished
    collective's Python state needs the GIL. When Python's last reference goes (destroy_process_group),
    torch runs that destructor with the GIL released: safe. Any other last owner is not. DDP's reducer
    dies with the GIL held (a deadlock: release above); an owner alive until interpreter finalization
    ends the worker as it asks for the GIL (pthread_exit through noexcept frames: "terminate called
    without an active exception", SIGABRT at exit; CI, the FSDP tests). Owners besides Python's: FSDP's
    mesh info on a live module, and every DeviceMesh (mesh._pg_registry), which DTensor's sharding,
    redistribution and topology caches keep alive after the last DTensor is gone. So callers drop their
    models, optimizers and DTensors first (a DDP module they cannot drop: release() it); here reference
    cycles (FSDP's module <-> state) are collected and the surviving meshes let go of their groups: a
    mesh outliving its group cannot be used anyway."""
    if not tdist.is_initialized():
        return
    gc.collect()
    _drop_mesh_groups()
    world = tdist.group.WORLD
    tdist.destroy_process_group()
    if sys.getrefcount(world) > 2:  # ours and the call's: an owner survives (a crash's traceback holds the run)
        print("ballast: WARN: the process group outlived destroy(); an owner still holds it "
              "(parallel.dist.destroy)", file=sys.stderr)
        # NOTE: a mitigation, not a guarantee: hand the GIL to a gloo worker releasing its last
        # collective before the interpreter begins to finalize.
        time.sleep(0.05)


def _drop_mesh_groups() -> None:
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # a torch built without distributed tensors holds no meshes
        return
    # NOTE: issubclass on the type, not isinstance: DeviceMesh's isinstance check reads an attribute of every
    # object it is asked about, and torch's deprecated `reduce_op` object warns when read (a FutureWarning per run)
    for obj in gc.get_objects():
        if issubclass(type(obj), DeviceMesh) and isinstance(getattr(obj, "_pg_registry", None), dict):
            obj._pg_registry.clear()


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    if tdist.is_initialized() and tdist.get_world_size() > 1:
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return t
