"""Token-normalised gradient accumulation: the forward/backward half of one optimizer step.

The objective of a step is the mean loss per valid label token of the *global* batch:

    L = (Σ_mb Σ_tokens ce + z·Σ lse²) / N_valid  +  Σ_mb (n_mb / N_valid) · aux_mb

where N_valid is counted over every micro-batch on every rank *before* any forward. Averaging a mean
per micro-batch instead would give each token of a short micro-batch more weight than a token of a
long one (docs/course.md §7: accumulate the loss sum and the token count, divide once).

NOTE: DDP and FSDP *average* gradients over ranks (÷ world), so each rank back-propagates
world · L_rank; the average then equals the gradient of L exactly (world is a power of two here, so
the multiply is exact in floating point).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from data.batch import IGNORE_INDEX
from parallel.dist import all_reduce_max, all_reduce_sum
from parallel.host_scalars import HostScalars, Packed
from parallel.wrap import no_sync


@dataclass
class StepSums:
    """Detached per-rank sums of one step, ready to be all-reduced together for logging."""

    loss_sum: torch.Tensor
    z_sum: torch.Tensor
    aux_weighted: torch.Tensor  # Σ_mb n_mb · aux_mb (divide by N_valid for the step's aux)
    logit_max: torch.Tensor
    loss_by_source: torch.Tensor  # (S,) CE sums
    tokens_by_source: torch.Tensor  # (S,) valid-token counts
    samples_by_source: torch.Tensor  # (S,) documents
    moe_load: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (E,) summed over micro-batches
    # layer -> (E,) Σ over valid assignments of the expert output's mean square per row (before the gate)
    moe_out_sq: dict[int, torch.Tensor] = field(default_factory=dict)
    floor_by_source: torch.Tensor | None = None  # (S,) Σ of Batch.floor over valid labels; None: no floor


def count_valid_tokens(micro_batches, device) -> torch.Tensor:
    """Global number of valid label tokens of this step, agreed by all ranks before any forward: a (1,)
    float64 tensor, counted on the micro-batches' device (nothing is read back to the host)."""
    n = torch.stack([(mb.labels != IGNORE_INDEX).sum() for mb in micro_batches]).sum()
    return all_reduce_sum(n.to(device, torch.float64).reshape(1))


def forward_backward(wrapped, micro_batches, n_valid_global: torch.Tensor, z_coef: float,
                     world: int, n_sources: int, autocast=None, routes=None,
                     loss_scale: float | None = None) -> StepSums:
    """Run every micro-batch forward and backward; gradients accumulate in .grad.

    `wrapped` is what parallel.wrap_model returned (DDP all-reduces on the last micro-batch only).
    `autocast`, when given, is a callable returning the recipe's context for each forward.
    `routes`, when given, is one precomputed routing dict per micro-batch (anticipatory routing).
    `loss_scale` S, when given, back-propagates S·objective (FP16): the .grads come out S times too
    large and must be unscaled before anything reads them (precision/step.py). The sums are unscaled.
    """
    # NOTE: the scale stays on the device (reading N_valid would stall the host before the first forward). It
    # is world/N in float64 and meets each micro-batch's loss in that loss's dtype (never below it): an FP32
    # loss gets world/N rounded to FP32, exactly the multiplier a Python float would be, and an FP64 model (the
    # replay, gradchecks, labs) keeps the course's division exact: Σ over micro-batches and ranks equals the
    # one-pass gradient of (Σ CE + z·Σ lse²)/N to FP64 rounding (tests/test_accumulate.py)
    scale = (torch.full_like(n_valid_global, float(world)) / n_valid_global).reshape(()) \
        if torch.is_tensor(n_valid_global) else world / n_valid_global
    device = micro_batches[0].tokens.device
    sums = StepSums(
        loss_sum=torch.zeros((), device=device), z_sum=torch.zeros((), device=device),
        aux_weighted=torch.zeros((), device=device), logit_max=torch.zeros((), device=device),
        loss_by_source=torch.zeros(n_sources, device=device),
        tokens_by_source=torch.zeros(n_sources, device=device),
        samples_by_source=torch.zeros(n_sources, device=device),
    )
    # NOTE: every micro-batch or none: a floor known for only part of the batch is no floor of the batch
    if all(mb.floor is not None for mb in micro_batches):
        sums.floor_by_source = torch.zeros(n_sources, device=device)
    for i, mb in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with no_sync(wrapped, last):
            with autocast() if autocast is not None else contextlib.nullcontext():
                out = wrapped(mb.tokens, mb.labels, routes=None if routes is None else routes[i])
            dtype = out.loss_sum.dtype
            s_mb = scale.to(dtype) if torch.is_tensor(scale) else scale
            n_mb = out.n_valid.to(dtype)
            objective = (out.loss_sum + z_coef * out.z_sum) * s_mb + out.aux_loss * (n_mb * s_mb)
            if loss_scale is not None:
                objective = objective * loss_scale
            objective.backward()
        sums.loss_sum += out.loss_sum.detach()
        sums.z_sum += out.z_sum.detach()
        sums.aux_weighted += out.aux_loss.detach() * n_mb
        sums.logit_max = torch.maximum(sums.logit_max, out.logit_max)
        sums.loss_by_source.index_add_(0, mb.sources, out.loss_sum_B.float())
        sums.tokens_by_source.index_add_(0, mb.sources, out.n_valid_B.float())
        sums.samples_by_source.index_add_(0, mb.sources, torch.ones_like(mb.sources, dtype=torch.float32))
        for layer, load in out.moe_load.items():
            sums.moe_load[layer] = sums.moe_load.get(layer, 0) + load
        for layer, sq in out.moe_out_sq.items():
            sums.moe_out_sq[layer] = sums.moe_out_sq.get(layer, 0) + sq
        if sums.floor_by_source is not None:
            valid = mb.labels != IGNORE_INDEX
            floor_B = torch.where(valid, mb.floor, 0.0).sum(-1, dtype=torch.float32)
            sums.floor_by_source.index_add_(0, mb.sources, floor_B)
    return sums



@dataclass
class ReducedSums:
    """The step's sums all-reduced, still on the device: one flat FP32 vector laid out by name (parallel/
    host_scalars.py Packed: the loss, z and aux sums, the per-source sums, each MoE layer's loads, the floor, each
    layer's expert output squares), and the global logit max. tensors() names what the host needs (train.py reads
    it with the step's other numbers); stats() turns those numbers into the step's statistics."""

    layout: Packed
    flat_K: torch.Tensor
    logit_max: torch.Tensor
    experts: dict[int, int]  # MoE layer -> E
    out_layers: list[int]    # the layers whose expert output squares were summed

    def loads_E(self) -> dict[int, torch.Tensor]:
        """layer -> (E,) global assignment counts, on the device (the balancing-bias update reads them there)."""
        parts = self.layout.unpack(self.flat_K)
        return {layer: parts[f"load/{layer}"] for layer in self.experts}

    def tensors(self) -> dict[str, torch.Tensor]:
        loads = self.loads_E()
        # NOTE: each layer's load shares divided here, in FP32, as StepRecord.expert_load has them
        return {"sums_K": self.flat_K, "logit_max": self.logit_max,
                **{f"expert_share/{l}": load / load.sum() for l, load in loads.items()}}

    def stats(self, host, n_valid_global: float) -> dict:
        """The global step statistics from the host's copy of tensors() (a mapping name -> numbers)."""
        p = self.layout.unpack(host["sums_K"])
        loss, z, aux = p["sums"]
        return {
            "loss": loss / n_valid_global,
            "z_loss": z / n_valid_global,
            "aux_loss": aux / n_valid_global,
            "loss_sum_by_source": p["loss_by_source"],
            "tokens_by_source": p["tokens_by_source"],
            "samples_by_source": p["samples_by_source"],
            "logit_max": host["logit_max"],
            "moe_load": {layer: p[f"load/{layer}"] for layer in self.experts},
            "expert_load": {layer: host[f"expert_share/{layer}"] for layer in self.experts},
            "floor_sum_by_source": p["floor_by_source"] if p["floorless"] == [0.0] else None,
            "moe_out_sq": {layer: p[f"out_sq/{layer}"] for layer in self.out_layers},
        }


def reduce_sums(sums: StepSums) -> ReducedSums:
    """Every rank's sums -> global sums on the device, in one SUM all-reduce (+ one MAX when distributed).

    The MoE loads ride in the same collective because the balancing-bias update needs them global on
    every rank anyway (each rank must move its bias copy identically).
    """
    layers = sorted(sums.moe_load)
    S = sums.loss_by_source.numel()
    dev = sums.loss_by_source.device
    # NOTE: a rank without a floor (real text, a corrupted shard) adds 1 to `floorless`: the global floor
    # exists only when no rank lacks one, and every rank must enter the same collective either way
    has_floor = sums.floor_by_source is not None
    out_layers = [l for l in layers if l in sums.moe_out_sq]
    layout = Packed({"sums": torch.stack([sums.loss_sum, sums.z_sum, sums.aux_weighted]),
                     "loss_by_source": sums.loss_by_source, "tokens_by_source": sums.tokens_by_source,
                     "samples_by_source": sums.samples_by_source,
                     **{f"load/{l}": sums.moe_load[l] for l in layers},
                     "floor_by_source": sums.floor_by_source if has_floor else torch.zeros(S, device=dev),
                     "floorless": torch.full((1,), 0.0 if has_floor else 1.0, device=dev),
                     **{f"out_sq/{l}": sums.moe_out_sq[l] for l in out_layers}}, dev, torch.float32)
    return ReducedSums(layout, all_reduce_sum(layout.flat()), all_reduce_max(sums.logit_max.detach().clone().float()),
                       {l: sums.moe_load[l].numel() for l in layers}, out_layers)


def reduce_step_sums(sums: StepSums, n_valid_global: float) -> dict:
    """reduce_sums, read to the host at once (one caller's step, not train.py's: it reads with the rest of
    the step). "moe_load" holds (E,) host tensors here, for a caller that updates the balancing bias."""
    reduced, host = reduce_sums(sums), HostScalars()
    host.put(**reduced.tensors())
    host.read()
    stats = reduced.stats(host, n_valid_global)
    stats["moe_load"] = {layer: torch.tensor(v) for layer, v in stats["moe_load"].items()}
    return stats
