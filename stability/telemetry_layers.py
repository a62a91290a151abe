"""Layer names for per-layer telemetry, and per-layer sums of squares over (possibly sharded) tensors.

Layer names, in forward order (the order of StepRecord.layers, so the earliest deviating layer is the
first one read):

    emb                  token embedding (a tied head is counted here only)
    block{i}.attn_norm   the gain of attention's pre-norm (parameters only)
    block{i}.attn        attention of block i: its matrices
    block{i}.attn.q_norm, block{i}.attn.k_norm    QK-norm's gains (model.qk_norm; parameters only)
    block{i}.mlp_norm    the gain of the MLP's pre-norm (parameters only)
    block{i}.mlp         dense SwiGLU or MoE (router, experts, shared expert) of block i: its matrices
    block{i}             the residual stream after block i (activations only: it owns no parameters)
    norm                 the final RMSNorm (its gain, and its output)
    head                 the output projection, only when untied (its activation is the logits)

Norm gains (GAINS: every RMSNorm / LayerNorm weight) are layer entries of their own, named after their module:
a gain is ≈ 1 where a matrix entry is ~init std, so counted inside attention or the MLP it would swamp the
layer's Σθ² (ρ_ℓ's denominator) and any per-layer max or RMS of the weights would read the gain.

Sharded vs replicated (the rule of optim/clip.py): a DTensor with a Shard placement (FSDP2) holds a
piece of the tensor on each rank, so its squares are summed over ranks; a plain tensor (DDP) is the
whole tensor on every rank and must not be summed again.
"""
from __future__ import annotations

import re

import torch
import torch.distributed as tdist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard

GAINS = (nn.RMSNorm, nn.LayerNorm)  # a norm's gain: a layer entry of its own (above)
_BLOCK_PARAM = re.compile(r"blocks\.(\d+)\.(attn|mlp)(\.|$)")
_BLOCK_MLP = re.compile(r"blocks\.(\d+)\.mlp(\.|$)")
_TOP = {"tok_emb": "emb", "head": "head"}


def param_layers(model: nn.Module) -> dict[str, str]:
    """{parameter name: its layer}: 'blocks.1.attn.qkv.weight' -> 'block1.attn', 'blocks.1.attn_norm.weight' ->
    'block1.attn_norm' (a gain), 'norm.weight' -> 'norm', 'tok_emb.weight' -> 'emb'."""
    gain = {f"{m}.{n}" if m else n: gain_layer(m) for m, mod in model.named_modules() if isinstance(mod, GAINS)
            for n, _ in mod.named_parameters(recurse=False)}
    return {n: gain.get(n) or param_layer(n) for n, _ in model.named_parameters()}


def gain_layer(module: str) -> str:
    """A norm module's name -> its gain's layer: 'blocks.1.attn_norm' -> 'block1.attn_norm', 'norm' -> 'norm'."""
    return re.sub(r"^blocks\.(\d+)\.", r"block\1.", module)


def param_layer(name: str) -> str:
    """A parameter that is no norm gain -> its layer: 'blocks.1.mlp.w_down' -> 'block1.mlp', 'tok_emb.weight' -> 'emb'."""
    m = _BLOCK_PARAM.match(name)
    if m:
        return f"block{m[1]}.{m[2]}"
    top = name.split(".", 1)[0]
    if top in _TOP:
        return _TOP[top]
    raise ValueError(f"telemetry: parameter {name!r} belongs to no known layer "
                     f"(expected tok_emb.*, blocks.<i>.(attn|mlp).*, head.*, or a norm's gain)")


def swiglu_layer(name: str) -> str:
    """'blocks.1.mlp', 'blocks.1.mlp.experts', 'blocks.1.mlp.shared' -> 'block1.mlp'."""
    m = _BLOCK_MLP.match(name)
    if not m:
        raise ValueError(f"telemetry: SwiGLU module {name!r} is not under blocks.<i>.mlp")
    return f"block{m[1]}.mlp"


def layer_order(model: nn.Module) -> list[str]:
    """The layers in forward order: a block's pre-norm gain before its sublayer, a gain inside it after it."""
    gains = [gain_layer(m) for m, mod in model.named_modules() if isinstance(mod, GAINS)]
    names = ["emb"]
    for i in range(len(model.blocks)):
        for part in ("attn", "mlp"):
            sub = f"block{i}.{part}"
            names += [g for g in gains if g == f"{sub}_norm"] + [sub] + [g for g in gains if g.startswith(f"{sub}.")]
        names += [g for g in gains if g.startswith(f"block{i}.") and g not in names] + [f"block{i}"]
    names.append("norm")
    # NOTE: named_parameters() lists a tied tensor once, under its first owner (tok_emb).
    if any(n.startswith("head.") for n, _ in model.named_parameters()):
        names.append("head")
    return names


def local(t: Tensor) -> Tensor:
    """This rank's storage of t (under no_grad, a DTensor's to_local() aliases it: in-place ops reach it)."""
    return t.to_local() if isinstance(t, DTensor) else t


def is_sharded(t: Tensor) -> bool:
    return isinstance(t, DTensor) and any(isinstance(pl, Shard) for pl in t.placements)


def norms(tensors: list[Tensor], device: torch.device) -> Tensor:
    """(N,) float64 ‖t‖₂ of each tensor: inf/NaN exactly when the tensor holds an inf/NaN.

    One foreach norm in FP32, then the few that came out non-finite again in FP64: an FP32 sum of
    squares overflows for large *finite* values (|t| ≳ 1e19), which must not read as a non-finite
    tensor; FP64 everywhere costs 4× on a CPU. A finite norm proves every element finite, so this is
    also the cheap non-finite test (an inf-norm is ~6× slower than the 2-norm on a CPU).
    NOTE: one host sync, to pick the tensors to redo (norms_fp32 and to_redo are the sync-free half).
    """
    out = norms_fp32(tensors, device)
    redo = to_redo(out).nonzero().flatten().tolist()
    if redo:
        again = torch._foreach_norm([tensors[i] for i in redo], 2, dtype=torch.float64)
        out[redo] = torch.stack([n.to(device) for n in again])
    return out


def norms_fp32(tensors: list[Tensor], device: torch.device) -> Tensor:
    """(N,) float64 of each tensor's FP32 ‖t‖₂: norms() where to_redo() is all False."""
    return torch.stack([n.to(device) for n in torch._foreach_norm(tensors, 2, dtype=torch.float32)]).double()


def to_redo(norms_N: Tensor) -> Tensor:
    """(N,) bool: the FP32 norms norms() computes again in FP64."""
    # NOTE: 0 is redone too: after an extreme clip (coef ~1e-25, a gradient past 1e19 elsewhere) the clipped
    # g·coef of a normal layer squares below FP32's smallest value, and telemetry divides by coef again.
    return (~torch.isfinite(norms_N)) | (norms_N == 0)


class ParamLayout:
    """The trainable parameters grouped by layer: per-tensor layer index, sharded flag, global sizes.

    WARN: build it after parallel.wrap_model: FSDP2 replaces the parameters with DTensors.
    """

    def __init__(self, model: nn.Module, order: list[str]):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("telemetry: the model has no trainable parameters")
        self.params = [p for _, p in named]
        layer = param_layers(model)
        layer_of = [layer[n] for n, _ in named]
        lost = sorted(set(layer_of) - set(order))
        if lost:
            raise ValueError(f"telemetry: layers {lost} own parameters but have no place in the layer order")
        self.keys = [k for k in order if k in set(layer_of)]  # layers that own parameters, forward order
        self.device = local(self.params[0]).device
        world = tdist.get_world_size() if tdist.is_initialized() else 1
        for n, p in named:
            # WARN: the packed all-reduce runs over the default group: a shard group smaller than the
            # world (HSDP: replicate × shard) would add each replica's shard once per replica.
            if is_sharded(p) and (p.device_mesh.ndim != 1 or p.device_mesh.size() != world):
                raise ValueError(f"telemetry: parameter {n} is sharded over mesh {p.device_mesh}; "
                                 f"only a 1-D mesh over all {world} ranks is supported (parallel.mode=fsdp)")
        self.layer_P = torch.tensor([self.keys.index(k) for k in layer_of], device=self.device)
        self.sharded_P = torch.tensor([is_sharded(p) for p in self.params], device=self.device)
        self.any_sharded = bool(self.sharded_P.any())
        self.numel = [0] * len(self.keys)  # global element counts (a DTensor's numel is the global one)
        for k, p in zip(layer_of, self.params):
            self.numel[self.keys.index(k)] += p.numel()

    def local_params(self) -> list[Tensor]:
        return [local(p) for p in self.params]

    def local_grads(self) -> list[Tensor | None]:
        return [None if p.grad is None else local(p.grad) for p in self.params]

    def squares(self, tensors: list[Tensor | None]) -> Tensor:
        """(P,) float64: Σ t² of each local tensor (0 for None / empty)."""
        out = torch.zeros(len(tensors), dtype=torch.float64, device=self.device)
        idx = [i for i, t in enumerate(tensors) if t is not None and t.numel()]
        if idx:
            out[torch.tensor(idx, device=self.device)] = norms([tensors[i] for i in idx], self.device).square()
        return out

    def per_layer(self, sq_XP: Tensor) -> tuple[Tensor, Tensor]:
        """(X, P) per-tensor squares -> (sharded, replicated) per-layer sums, each (X, L).

        Only the sharded part may be all-reduced (SUM); the replicated part is already global.
        """
        X, L = sq_XP.shape[0], len(self.keys)
        sharded = torch.zeros(X, L, dtype=torch.float64, device=self.device)
        replicated = torch.zeros_like(sharded)
        # NOTE: where(), not a multiply by a 0/1 mask: inf · 0 = NaN would turn an inf into a NaN.
        sharded.index_add_(1, self.layer_P, torch.where(self.sharded_P, sq_XP, 0.0))
        replicated.index_add_(1, self.layer_P, torch.where(self.sharded_P, 0.0, sq_XP))
        return sharded, replicated
