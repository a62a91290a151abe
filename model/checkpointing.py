"""Activation checkpointing (`train.activation_checkpointing`): trade a second forward for activation memory.

    none       every activation of every block is kept for the backward (the default)
    full       each block keeps only its input; its forward runs again inside the backward
               (torch.utils.checkpoint, non-reentrant): activation memory ~ n_layers · B·T·D instead of
               n_layers · (everything a block computes), for ~1 extra forward (+~33% of step FLOPs)
    selective  op-level: the outputs of matmuls and attention are kept, the cheap elementwise ops between
               them (norms, RoPE, SwiGLU, residual adds, routing softmax) are recomputed; saves less memory
               than full but costs almost no extra FLOPs (torchtitan's "selective op" policy)

The checkpoint sits inside Block.forward, so it composes with DDP (the wrapper is outside), FSDP2 (the
block is all-gathered by fully_shard's hooks before its forward and before its backward, hence before the
recompute) and torch.compile (dynamo traces the checkpoint as one region and the partitioner recomputes).
Recomputation is exact: same inputs, same ops, no randomness in a block, so gradients are unchanged.

Telemetry: forward hooks fire again on a recompute (the sub-modules' __call__ runs again). `recomputing()`
is true exactly then (eager mode), and stability/telemetry.py skips its hooks, so each activation is counted
once, from the original forward. Under torch.compile the recompute is inside the compiled graph and runs no
Python hooks at all.
"""
from __future__ import annotations

from functools import partial

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

MODES = ("none", "full", "selective")
_depth = 0  # > 0 while a checkpointed region re-runs its forward during the backward


def recomputing() -> bool:
    return _depth > 0


def check_mode(mode) -> str:
    if mode not in MODES:
        raise ValueError(f"train.activation_checkpointing={mode!r}: expected one of {', '.join(MODES)}")
    return mode


_aten = torch.ops.aten
# matmuls and attention: the expensive outputs worth their memory under `selective`
_SAVE = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default,
         _aten._scaled_dot_product_flash_attention.default, _aten._scaled_dot_product_efficient_attention.default,
         _aten._scaled_dot_product_cudnn_attention.default, _aten._scaled_dot_product_flash_attention_for_cpu.default}


def _policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def run(fn, mode: str, *args):
    """fn(*args), checkpointed according to `mode` when gradients are being recorded."""
    if mode == "none" or not torch.is_grad_enabled():
        return fn(*args)
    kw = {"context_fn": partial(create_selective_checkpoint_contexts, _policy)} if mode == "selective" else {}
    if torch.compiler.is_compiling():  # the compiled graph recomputes: no Python runs twice
        return checkpoint(fn, *args, use_reentrant=False, **kw)
    first = [True]

    def once_then_flag(*a):
        global _depth
        if first[0]:
            first[0] = False
            return fn(*a)
        _depth += 1
        try:
            return fn(*a)
        finally:
            _depth -= 1

    return checkpoint(once_then_flag, *args, use_reentrant=False, **kw)


def set_activation_checkpointing(model, mode: str) -> None:
    """Checkpoint every block of `model` (a Transformer) in `mode`; call after the precision recipe's
    convert (it refuses Transformer Engine modules) and before wrapping or compiling."""
    mode = check_mode(mode)
    te = [n for n, m in model.named_modules() if type(m).__module__.startswith("transformer_engine")]
    if mode != "none" and te:
        # WARN: TE's delayed scaling updates its amax history in every forward; a torch recompute would
        # record each step twice (TE ships its own checkpoint for this; not wired here).
        raise ValueError(f"train.activation_checkpointing={mode} with Transformer Engine modules ({te[0]}): "
                         "not supported; use none")
    for block in model.blocks:
        block.checkpointing = mode
