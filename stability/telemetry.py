"""Per-layer telemetry: activation RMS, gradient RMS, update-to-weight ratio, SwiGLU clamp hit-rate,
non-finite flags and cross-replica checks, every `telemetry.every` optimizer steps.

docs/course.md §8: loss alone cannot tell "the global learning rate is too large" from "a few layers
misbehave"; per layer,

    act_rms_ℓ  = sqrt(Σ x² / n)          over every micro-batch of the step, every rank
    grad_rms_ℓ = sqrt(Σ g² / n)          of the TRUE gradient: unscaled (FP16) and before clipping
    ρ_ℓ        = ‖Δθ_ℓ‖ / (‖θ_ℓ‖ + ε)     Δθ = θ after optimizer.step − θ before; θ before the step

A ρ_ℓ that keeps rising while the loss looks normal exposes precision, init or data problems earlier
than waiting for a NaN. Layer names: stability/telemetry_layers.py (a norm's gain is a layer of its own, so a
matrix's ‖θ_ℓ‖ is the matrix's).

Each per-layer quantity is one declaration below, `quantity(name, needs, value)`, beside its signal (stability/
signals.py): `needs` names the per-layer sums telemetry measures (MEASURED), `value` computes the number on the
host. finish() packs the measured sums by name (parallel/host_scalars.py Packed) into one SUM all-reduce, one MAX
all-reduce and one transfer, and unpacks them by name: no offset is computed by hand.

Attached to the step by StepTelemetry (below) at train.py's callback points (every call is a no-op
returning {} on a step that telemetry skips; all ranks call them):

    cb.before_forward(s)      → telemetry.start(step)            # hooks on, before the first forward
    sums = forward_backward(...); reduced = reduce_sums(sums)    # on the device, read with the step's numbers
    cb.before_update(s)       → telemetry.before_update()        # snapshot θ (one foreach copy, reused buffers)
    s.result = apply_update(...)                                 # unscale → finite check → clip → [veto] → step
    cb.after_update(s)        → s.post = telemetry.finish(s.result.coef)   # before zero_grad: grads read here
    s.moe = moe_summary(nums.stats["moe_load"], nums.stats["moe_out_sq"])   # every step, on the host
    rec = step_record(s, ...)   # stability/record.py: layers, replica from s.post; nonfinite = flags | s.post's

The flags are nonfinite_flags(loss, logit_max, ‖g‖), in the step's numbers (stability/step_numbers.py).
telemetry.finish reads its own numbers in one transfer of its own (on its steps only).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as tdist
from torch import Tensor, nn

from model.checkpointing import recomputing
from parallel.dist import all_reduce_max, all_reduce_sum
from parallel.host_scalars import Packed
from stability.callbacks import Callback, StepState
from stability.config import TelemetryConfig
from stability.signals import SIGNALS
from stability.telemetry_layers import ParamLayout, layer_order, swiglu_layer

# ---------------------------------------------------------------------------------------------- declarations
# What telemetry measures per layer, on the device, summed over every micro-batch and every rank in ONE
# all-reduce (logit_max: the largest, in one MAX all-reduce), then read in one transfer. Telemetry.finish
# puts exactly these; a quantity is computed from them. "The layer's parameters" never mix a norm's gain into a
# matrix layer: each gain is a layer of its own (stability/telemetry_layers.py GAINS).
MEASURED = {
    "act_sq": "Σ x² of the layer's output, training forwards only",
    "act_n": "the number of elements in act_sq",
    "grad_sq": "Σ g² of the layer's parameters, as the update left them: g·coef, unscaled under FP16",
    "delta_sq": "Σ Δθ² of the layer's parameters (θ after the step − θ before it)",
    "theta_sq": "Σ θ² of the layer's parameters before the step",
    "clamp_hits": "SwiGLU clamp hits of the layer (model/swiglu.py)",
    "clamp_total": "the elements the clamp saw",
    "logit_max": "the largest probed attention logit of the block's attention (MAX over ranks)",
}


@dataclass(frozen=True)
class At:
    """What a quantity knows of its layer besides the sums: the parameters' global element count (0 for a layer
    that owns none), the clip coefficient the update applied, telemetry's ε."""
    numel: int
    coef: float
    eps: float


@dataclass(frozen=True)
class Quantity:
    """One per-layer number of StepRecord.layers[<layer>][name], read by the signal of the same name
    (stability/signals.py, per_layer=True): computed on the host from the MEASURED sums it `needs`, for every
    layer that has them all; `value` returns None to leave the entry out."""
    name: str
    needs: tuple[str, ...]
    value: Callable[[dict[str, float], At], float | None]


QUANTITIES: dict[str, Quantity] = {}


def quantity(name: str, needs: tuple[str, ...], value: Callable[[dict[str, float], At], float | None]) -> Quantity:
    """Declare a per-layer telemetry quantity: its signal must be declared first (per_layer=True)."""
    if name in QUANTITIES:
        raise ValueError(f"telemetry quantity {name!r} declared twice")
    unknown = [n for n in needs if n not in MEASURED]
    if unknown:
        raise ValueError(f"telemetry quantity {name!r} needs {unknown}, which telemetry does not measure "
                         f"(MEASURED: {', '.join(MEASURED)})")
    sig = SIGNALS.get(name)
    if sig is None or not sig.per_layer:
        raise ValueError(f"telemetry quantity {name!r}: declare its signal first, per_layer=True "
                         f"(stability/signals.py declare)")
    q = QUANTITIES[name] = Quantity(name, tuple(needs), value)
    return q


# In this order in each layer's entry (a record's key order).
quantity("act_rms", ("act_sq", "act_n"), lambda x, at: math.sqrt(x["act_sq"] / x["act_n"]))
# of the TRUE gradient: the measured one is g·coef, clipped
quantity("grad_rms", ("grad_sq",), lambda x, at: math.sqrt(x["grad_sq"] / at.numel) / at.coef)
quantity("update_ratio", ("delta_sq", "theta_sq"),
         lambda x, at: math.sqrt(x["delta_sq"]) / (math.sqrt(x["theta_sq"]) + at.eps))
quantity("clamp_hit_rate", ("clamp_hits", "clamp_total"),
         lambda x, at: x["clamp_hits"] / x["clamp_total"] if x["clamp_total"] else 0.0)
# NOTE: the probe's max over the first sequence of each micro-batch, all ranks; -inf where none was probed
quantity("attn_logit_max", ("logit_max",), lambda x, at: None if x["logit_max"] == -math.inf else x["logit_max"])


class Telemetry:
    def __init__(self, model: nn.Module, cfg: TelemetryConfig, eps: float = 1e-8):
        """model: the bare Transformer (not the DDP / compile wrapper), after parallel.wrap_model; cfg:
        telemetry.*, checked by the schema."""
        every = cfg.every
        if not eps > 0:
            raise ValueError(f"telemetry.eps={eps!r} must be > 0")
        self.model, self.every, self.eps = model, every, float(eps)
        self.active = False
        if every == 0:  # off: no layout, no buffers, no hooks
            return
        self.order = layer_order(model)
        self.layout = ParamLayout(model, self.order)
        self.swiglus = [(swiglu_layer(n), m) for n, m in model.swiglus()]
        self._snap: list[Tensor] | None = None  # θ before the step, reused between steps
        self._hooks: list = []

    def wants(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    # ------------------------------------------------------------------ the step

    def start(self, step: int) -> bool:
        """Hooks on, clamp counting on, if this step records telemetry. Returns whether it does."""
        if not self.wants(step):
            return False
        if self.active:
            raise RuntimeError(f"telemetry.start({step}): the previous telemetry step was never finished")
        self.active, self._snapped = True, False
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        if len(trainable) != len(self.layout.params) or any(a is not b for a, b in zip(trainable, self.layout.params)):
            # NOTE: the parameters were replaced (a wrap after construction, an assign-style load):
            # stale references would report ρ = 0 forever, so re-read them.
            self.layout, self._snap = ParamLayout(self.model, self.order), None
        self._act: dict[str, list[Tensor]] = {k: [] for k in self.order}
        self._act_n = dict.fromkeys(self.order, 0)
        self._clamp: dict[str, list[Tensor]] = {k: [] for k, _ in self.swiglus}
        m = self.model
        watch: list[tuple[str, nn.Module, Callable]] = [("emb", m.tok_emb, _same)]
        for i, block in enumerate(m.blocks):
            watch += [(f"block{i}.attn", block.attn, _same), (f"block{i}.mlp", block.mlp, _mlp_out),
                      (f"block{i}", block, _first)]  # a Block returns (x, moe)
        watch.append(("norm", m.norm, _same))
        if "head" in self.order:
            watch.append(("head", m.head, _same))
        self._hooks = [mod.register_forward_hook(self._act_hook(k, pick)) for k, mod, pick in watch]
        for key, mod in self.swiglus:
            mod.record_stats = True
            self._hooks.append(mod.register_forward_hook(self._clamp_hook(key)))
        for block in m.blocks:  # the attention-logit probe: one sequence per forward (model/attention.py)
            block.attn.probe_logits, block.attn.logit_max_H = True, None
        return True

    @torch.no_grad()
    def before_update(self) -> None:
        """After backward, before the optimizer step: θ_before ← θ, one foreach copy, no allocation
        after the first telemetry step."""
        if not self.active:
            return
        params = self.layout.local_params()
        if self._snap is None or any(s.shape != p.shape for s, p in zip(self._snap, params)):
            self._snap = [torch.empty_like(p) for p in params]
        torch._foreach_copy_(self._snap, params)
        self._snapped = True

    @torch.no_grad()
    def finish(self, coef: float | Tensor) -> dict:
        """After optimizer_step, before zero_grad. `coef` is the clip coefficient optimizer_step applied
        (the grads hold g·coef, already unscaled under FP16). Collective: every rank must call it.

        Returns {"layers", "update_ratio_max", "nonfinite": {grads}, "replica"} ({} when this step records
        no telemetry). The optimizer state's non-finite flag is stability/resume_fields.py state_nonfinite's,
        every step, from the moments' norms the StepRecord computes anyway.
        """
        if not self.active:
            return {}
        self._stop()
        if not self._snapped:
            raise RuntimeError("telemetry.finish: before_update() was not called this step")
        lay, dev = self.layout, self.layout.device
        grad_sq_P = lay.squares(lay.local_grads())
        theta_sq_P = lay.squares(self._snap)
        # NOTE: in place into the snapshot: Δθ needs no second buffer. A skipped step gives exactly 0.
        torch._foreach_sub_(self._snap, lay.local_params())
        delta_sq_P = lay.squares(self._snap)
        by_param = ("grad_sq", "delta_sq", "theta_sq")
        sharded_XL, replicated_XL = lay.per_layer(torch.stack([grad_sq_P, delta_sq_P, theta_sq_P]))
        # Activations and clamp counts differ per rank (different data) under DDP and FSDP alike.
        act_keys = [k for k in self.order if self._act_n[k]]
        clamp_keys = [k for k in self._clamp if self._clamp[k]]
        clamp_2C = (torch.stack([torch.stack(self._clamp[k]).to(dev, torch.float64).sum(0) for k in clamp_keys], 1)
                    if clamp_keys else torch.zeros(2, 0, dtype=torch.float64, device=dev))
        # every MEASURED sum: name -> (its layers, its values per layer on this rank)
        measured = {**{n: (lay.keys, sq_L) for n, sq_L in zip(by_param, sharded_XL)},
                    "act_sq": (act_keys, _stack([torch.stack(self._act[k]).to(dev, torch.float64).sum()
                                                 for k in act_keys], dev)),
                    "act_n": (act_keys, torch.tensor([float(self._act_n[k]) for k in act_keys], dtype=torch.float64,
                                                     device=dev)),
                    "clamp_hits": (clamp_keys, clamp_2C[0]), "clamp_total": (clamp_keys, clamp_2C[1])}
        # ONE all-reduce for all of them (the parameters' sharded part; their replicated part is already global)
        summed = Packed({n: v for n, (_, v) in measured.items()}, dev)
        sums = summed.unpack(all_reduce_sum(summed.flat()))
        for n, replicated_L in zip(by_param, replicated_XL):
            sums[n] = sums[n] + replicated_L
        coef_t = torch.as_tensor(coef, dtype=torch.float64, device=dev).reshape(())  # FP32 → FP64: exact
        logit_keys = [f"block{i}.attn" for i in range(len(self.model.blocks))]
        maxed, replicated = self._collective_max(grad_sq_P, coef_t, [b.attn.logit_max_H for b in self.model.blocks])
        measured["logit_max"] = (logit_keys, maxed["logit_max"])
        if set(measured) != set(MEASURED):
            raise RuntimeError(f"telemetry.finish measured {sorted(measured)}, MEASURED declares {sorted(MEASURED)}")
        # one host sync for all of it
        out = Packed({**sums, **maxed, "coef": coef_t}, dev)
        host = out.unpack(out.flat().tolist())

        by_layer: dict[str, dict[str, float]] = {k: {} for k in self.order}
        for name, (keys, _) in measured.items():
            for k, v in zip(keys, host[name]):
                by_layer[k][name] = v
        numel = dict(zip(lay.keys, lay.numel))
        layers: dict[str, dict[str, float]] = {k: {} for k in self.order}
        for q in QUANTITIES.values():
            for k, x in by_layer.items():
                if all(n in x for n in q.needs):
                    v = q.value(x, At(numel.get(k, 0), host["coef"], self.eps))
                    if v is not None:
                        layers[k][q.name] = v
        ratios = [layers[k]["update_ratio"] for k in lay.keys if "update_ratio" in layers[k]]
        # NOTE: a NaN ratio must surface, and Python's max() drops or keeps NaN depending on order.
        ratio_max = math.nan if any(math.isnan(r) for r in ratios) else max(ratios)
        grads_bad = not all(math.isfinite(s) for s in host["grad_sq"])
        spread = {n: host[n][0] + host[n][1] for n in ("param_sum", "grad_norm") if replicated}  # max(x) + max(−x)
        replica = {f"{n}_spread": v for n, v in spread.items()}
        return {"layers": {k: v for k, v in layers.items() if v}, "update_ratio_max": ratio_max,
                "nonfinite": {"grads": grads_bad}, "replica": replica}

    # ------------------------------------------------------------------ internals

    def _act_hook(self, key: str, pick: Callable):
        def hook(module, args, out):
            # NOTE: training forwards only: eval and the routing-only forward (compute_routes) run under
            # no_grad and must not leak into the step's statistics; an activation-checkpointing recompute
            # (model/checkpointing.py) repeats a forward already counted.
            if not torch.is_grad_enabled() or recomputing():
                return
            x = pick(out).detach()
            # NOTE: an FP32 norm: |x| ≳ 1e19 reads as inf. FP64 costs 4× on a CPU, and such a layer
            # has blown up either way; only parameters, grads and optimizer state get the exact test.
            self._act[key].append(torch.linalg.vector_norm(x, dtype=torch.float32).square())
            self._act_n[key] += x.numel()
        return hook

    def _clamp_hook(self, key: str):
        def hook(module, args, out):
            # The module overwrites clamp_hits/clamp_total on every call: keep each micro-batch's pair.
            if torch.is_grad_enabled() and not recomputing():
                self._clamp[key].append(torch.stack([module.clamp_hits, module.clamp_total]))
        return hook

    def _stop(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for _, mod in self.swiglus:
            mod.record_stats = False
        for block in self.model.blocks:
            block.attn.probe_logits = False
        self.active = False

    def _collective_max(self, grad_sq_P: Tensor, coef: Tensor,
                        attn_logits: list[Tensor | None]) -> tuple[dict[str, Tensor], bool]:
        """One MAX all-reduce, still on the device: each block's largest probed attention logit (logit_max;
        -inf where no forward was probed), and under DDP (the bool) the spread (max − min over ranks, as
        max(x) + max(−x)) of a float64 parameter checksum Σθ (param_sum) and of the local pre-clip grad norm
        (grad_norm). Both are exactly 0 on healthy DDP: every rank holds the same bits."""
        dev = self.layout.device
        named = {"logit_max": _stack([torch.full((), -math.inf, dtype=torch.float64, device=dev) if m is None
                                      else m.max().to(dev, torch.float64) for m in attn_logits], dev)}
        world = tdist.get_world_size() if tdist.is_initialized() else 1
        # NOTE: under FSDP each rank holds a different shard, so a spread means nothing there.
        replicated = world > 1 and not self.layout.any_sharded
        if replicated:
            params = self.layout.local_params()
            psum = torch.stack([p.sum(dtype=torch.float64) for p in params]).sum()
            gnorm = grad_sq_P.sum().sqrt() / coef
            named |= {"param_sum": torch.stack([psum, -psum]), "grad_norm": torch.stack([gnorm, -gnorm])}
        packed = Packed(named, dev)
        return packed.unpack(all_reduce_max(packed.flat())), replicated


class StepTelemetry(Callback):
    """Telemetry attached to the step: hooks on before the forward, θ snapshot before the update, the
    per-layer numbers into s.post after it (on telemetry steps; every call is a no-op otherwise)."""
    # after a drill armed its hooks (the NaN drill's output shows in the activations); after the update,
    # after QK-clip (the measured Δθ is the whole update) and before an optimizer-state drill
    order = {"before_forward": 20, "before_update": 20, "after_update": 20}

    def __init__(self, telemetry: Telemetry):
        self.tel = telemetry

    def before_forward(self, s: StepState) -> None:
        self.tel.start(s.step)

    def before_update(self, s: StepState) -> None:
        self.tel.before_update()

    def after_update(self, s: StepState) -> None:
        s.post = self.tel.finish(s.result.coef)


def _stack(xs: list[Tensor], device) -> Tensor:
    return torch.stack(xs) if xs else torch.zeros(0, dtype=torch.float64, device=device)


def _same(out):
    return out


def _first(out):
    return out[0]


def _mlp_out(out):
    return out if isinstance(out, Tensor) else out.y  # an MoE returns MoEOutput


def moe_summary(loads: dict[int, Tensor | list[float]],
                out_sq: dict[int, Tensor | list[float]] | None = None) -> dict[str, dict]:
    """{layer: {"load": tokens per expert, "max_violation": max_e load_e/mean(load) − 1, "dead": #zero,
    "out_rms": per expert the RMS of its output before the gate (None for an expert with no token)}} from
    the global (all-reduced) assignment counts and output squares, as (E,) tensors or the host's lists of
    them (train.py: plain Python then, nothing read); cheap enough for every step.

    out_rms tells an expert that still receives tokens but outputs nothing (a zeroed or collapsed expert:
    load unchanged, out_rms → 0) from one that receives none (dead)."""
    out = {}
    for layer in sorted(loads):
        load_E = _floats(loads[layer], layer)
        # NOTE: the loads are counts (integers below 2^53): their float64 sum is exact in any order, so this
        # mean is torch's to the bit
        mean = sum(load_E) / len(load_E)
        # NOTE: no assignment at all has no balance to violate: 0, and every expert counts as dead.
        violation = max(load_E) / mean - 1.0 if mean > 0 else 0.0
        out[str(layer)] = {"load": [round(v) for v in load_E], "max_violation": violation,
                           "dead": sum(v == 0 for v in load_E)}
        if out_sq and layer in out_sq:
            sq_E = _floats(out_sq[layer], layer)
            out[str(layer)]["out_rms"] = [math.sqrt(sq / n) if n > 0 else None for sq, n in zip(sq_E, load_E)]
    return out


def _floats(x: Tensor | list[float], layer) -> list[float]:
    if torch.is_tensor(x):
        if x.ndim != 1 or not x.numel():
            raise ValueError(f"moe_summary: layer {layer} load has shape {tuple(x.shape)}, expected (E,)")
        return x.detach().to("cpu", torch.float64).tolist()
    if not x or not all(isinstance(v, (int, float)) for v in x):
        raise ValueError(f"moe_summary: layer {layer} load is {x!r}, expected (E,) numbers")
    return [float(v) for v in x]


def nonfinite_flags(loss: float, logit_max: float, grad_norm: float) -> dict[str, bool]:
    """From floats the step has anyway: no extra work, usable every step."""
    return {"loss": not math.isfinite(loss), "logits": not math.isfinite(logit_max),
            "grads": not math.isfinite(grad_norm)}


def first_nonfinite(layers: dict[str, dict[str, float]]) -> str | None:
    """The earliest layer (forward order) whose activation RMS is inf/NaN: where a NaN was born."""
    return next((k for k, v in layers.items() if "act_rms" in v and not math.isfinite(v["act_rms"])), None)
