"""Data-parallel wrapping chosen by config (`parallel.mode`): replicate (DDP) or shard (FSDP2)."""
from __future__ import annotations

import contextlib
import inspect
import warnings

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from parallel.config import ParallelConfig
from parallel.dist import Dist

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def wrap_model(model: nn.Module, cfg: ParallelConfig, dist: Dist) -> nn.Module:
    """Return the module the step calls. `auto` = DDP when there is more than one process.

    cfg: parallel.*, checked by the schema (mode=fsdp reads param_dtype, reduce_dtype, reshard_after_forward;
    a precision recipe's dtypes replace the first two: dataclasses.replace(cfg, **recipe.fsdp_dtypes())).

    NOTE: ddp and fsdp over one process return the model itself: a 1-way replica or shard is the
    module, and one command line then works for any world size (resume 2 -> 1 included).
    """
    mode = cfg.mode
    if dist.world == 1:
        return model
    if mode == "none":
        raise ValueError(f"parallel.mode=none with {dist.world} processes: gradients would never be reduced")
    if mode == "fsdp":
        return shard_model(model, dist, cfg.param_dtype, cfg.reduce_dtype, cfg.reshard_after_forward)
    # NOTE: no buffer sync in the forward. Every buffer is either a constant (RoPE tables) or updated from
    # all-reduced statistics (MoE balancing bias), so ranks never disagree and the per-forward
    # broadcast would be pure overhead. find_unused_parameters stays off: the MoE layer runs every
    # expert, even on zero tokens, so every parameter is in every graph.
    device_ids = [dist.device.index] if dist.device.type == "cuda" else None
    return DDP(model, device_ids=device_ids, gradient_as_bucket_view=True, **NO_FORWARD_BUFFER_SYNC)


# NOTE: torch 2.13 renamed broadcast_buffers (now a FutureWarning) to forward_sync_buffers, which still syncs the
# buffers once at init: harmless, every rank builds them from the same seed. Older torch knows only the old name.
NO_FORWARD_BUFFER_SYNC = ({"forward_sync_buffers": False}
                          if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
                          else {"broadcast_buffers": False})


def shard_model(model: nn.Module, dist: Dist, param_dtype: str = "float32", reduce_dtype: str = "float32",
                reshard_after_forward: bool = True) -> nn.Module:
    """FSDP2: `fully_shard` every element of the model's ModuleLists (the blocks), then the root.

    Each parameter becomes a DTensor sharded on dim 0 over all ranks; the forward all-gathers one
    block at a time, the backward reduce-scatters averaged gradients in `reduce_dtype`. The module is
    converted in place, so build the optimizer after this call.
    WARN: every parameter must end up sharded. A plain tensor beside DTensors breaks torch's
    clip_grad_norm_ (mixed types) and would be counted once per rank by a global norm.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[reduce_dtype])
    mesh = init_device_mesh(dist.device.type, (dist.world,))
    opts = dict(mesh=mesh, mp_policy=mp, reshard_after_forward=bool(reshard_after_forward))
    # NOTE: FSDP2 warns when a sharded block returns a view; the MoE output tuple carries views
    # (routing ids, the reshaped output) that the step only reads, never modifies in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    for child in model.children():
        if isinstance(child, nn.ModuleList):
            for block in child:
                fully_shard(block, **opts)
    fully_shard(model, **opts)
    plain = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    if plain:
        raise RuntimeError(f"fsdp: parameter {plain[0]} was left unsharded")
    return model


def is_sharded(model: nn.Module) -> bool:
    """FSDP2 sharded the model (parallel=fsdp on several processes): its parameters are DTensors."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def no_sync(wrapped: nn.Module, last: bool):
    """Reduce gradients on the last micro-batch only: one all-reduce (DDP) or reduce-scatter (FSDP2)
    per optimizer step instead of one per micro-batch."""
    if isinstance(wrapped, DDP) and not last:
        return wrapped.no_sync()
    if hasattr(wrapped, "set_requires_gradient_sync") and not last:
        return _fsdp_no_sync(wrapped)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_no_sync(module):
    # FSDP2 keeps the unsharded gradient and accumulates into it until sync is turned back on.
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)
