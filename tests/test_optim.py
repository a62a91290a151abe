"""optim/: parameter-group contract, AdamW decoupled decay, lr schedules, global-norm clipping (also
sharded across 2 gloo processes)."""

import math
import os
import tempfile

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.nn.parallel import DistributedDataParallel

from optim import build_optimizer, build_param_groups, clip_grad_norm, format_table
from optim.config import OptimConfig
from parallel import release
from helpers import in_group, spawn

NO_DECAY = {"name": "no_decay", "kinds": ["bias", "norm", "embedding", "router", "expert_bias"],
            "weight_decay": 0.0}


def optim_cfg(*rules, lr=3e-3, weight_decay=0.1) -> OptimConfig:
    return OptimConfig.from_dict({"lr": lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": weight_decay,
                                  "groups": list(rules)})


# ---------------------------------------------------------------------------------------------------------
# parameter groups

class TopKRouter(nn.Module):
    def __init__(self, d, n_experts):
        super().__init__()
        self.gate = nn.Parameter(torch.randn(n_experts, d))
        self.proj = nn.Linear(d, d, bias=False)  # router by its ancestor's class, not by its own name


class Attn(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=True)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.RMSNorm(d)
        self.attn = Attn(d)
        self.mlp = nn.Linear(d, d, bias=False)
        self.moe_router = TopKRouter(d, 4)


class Toy(nn.Module):
    """Embedding tied to the head, two blocks, a final LayerNorm, and a frozen probe."""

    def __init__(self, d=8, vocab=16, head_first=False):
        super().__init__()
        if head_first:  # the head registers before the embedding it is tied to
            self.head = nn.Linear(d, vocab, bias=False)
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d), Block(d)])
        self.norm_f = nn.LayerNorm(d)
        if not head_first:
            self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.probe = nn.Linear(d, 2)
        self.probe.requires_grad_(False)


# Written out by hand from the rules in the brief, not from the implementation.
DECAYING = {f"blocks.{i}.{n}" for i in (0, 1) for n in ("attn.qkv.weight", "attn.proj.weight", "mlp.weight")}
NOT_DECAYING = {"emb.weight", "norm_f.weight", "norm_f.bias"} | {
    f"blocks.{i}.{n}" for i in (0, 1)
    for n in ("norm.weight", "attn.proj.bias", "moe_router.gate", "moe_router.proj.weight")}


def group_names(model, groups):
    by_id = {id(p): n for n, p in model.named_parameters()}
    return {g["name"]: {by_id[id(p)] for p in g["params"]} for g in groups}


@pytest.mark.parametrize("head_first", [False, True])
def test_exactly_intended_tensors_decay(head_first):
    model = Toy(head_first=head_first)
    groups, table = build_param_groups(model, optim_cfg(NO_DECAY))
    names = group_names(model, groups)
    tied = "head.weight" if head_first else "emb.weight"  # named_parameters keeps the first name
    assert names["default"] == DECAYING
    assert names["no_decay"] == (NOT_DECAYING - {"emb.weight"}) | {tied}
    by_name = {g["name"]: g for g in groups}
    assert by_name["default"]["weight_decay"] == 0.1 and by_name["no_decay"]["weight_decay"] == 0.0
    # tied tensor once; frozen probe nowhere
    all_ids = [id(p) for g in groups for p in g["params"]]
    assert len(all_ids) == len(set(all_ids)) == len(DECAYING) + len(NOT_DECAYING)
    assert id(model.probe.weight) not in all_ids and id(model.probe.bias) not in all_ids
    expected_numel = {"default": sum(model.get_parameter(n).numel() for n in DECAYING),
                      "no_decay": sum(model.get_parameter(n).numel() for n in NOT_DECAYING)}
    assert {r["group"]: r["parameters"] for r in table} == expected_numel
    assert {r["group"]: r["tensors"] for r in table} == {"default": len(DECAYING),
                                                         "no_decay": len(NOT_DECAYING)}
    text = format_table(table)
    assert "no_decay" in text and f"{expected_numel['default']:,}" in text
    widths = {len(line) for line in text.splitlines()[:-1]}  # header, rule, rows: one width
    assert len(widths) == 1


def test_router_by_qualified_name():
    class MoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.router = nn.Linear(8, 4, bias=False)
            self.w_in = nn.Linear(8, 8, bias=False)

    model = nn.ModuleDict({"moe": MoE()})
    rule = {"name": "router", "kinds": ["router"], "weight_decay": 0.0}
    groups, _ = build_param_groups(model, optim_cfg(rule))
    assert group_names(model, groups) == {"router": {"moe.router.weight"}, "default": {"moe.w_in.weight"}}


def test_names_rule_and_lr_scale_first_match_wins():
    model = Toy()
    attn = {"name": "attn", "names": ["*.attn.*"], "lr_scale": 0.5}
    groups, table = build_param_groups(model, optim_cfg(NO_DECAY, attn, lr=2e-3))
    names = group_names(model, groups)
    # proj.bias is no_decay (first rule), the attention weights fall through to the names rule
    assert names["attn"] == {f"blocks.{i}.attn.{n}.weight" for i in (0, 1) for n in ("qkv", "proj")}
    assert names["default"] == {"blocks.0.mlp.weight", "blocks.1.mlp.weight"}
    by_name = {g["name"]: g for g in groups}
    assert by_name["attn"]["lr"] == pytest.approx(1e-3) and by_name["attn"]["weight_decay"] == 0.1
    assert by_name["default"]["lr"] == pytest.approx(2e-3)
    opt, _ = build_optimizer(model, optim_cfg(NO_DECAY, attn, lr=2e-3))
    assert {g["name"]: g["lr"] for g in opt.param_groups} == pytest.approx(
        {"no_decay": 2e-3, "attn": 1e-3, "default": 2e-3})
    assert [r["group"] for r in table] == ["no_decay", "attn", "default"]


@pytest.mark.parametrize("builder", [build_optimizer, build_param_groups])
def test_builders_take_the_typed_config_only(builder):
    with pytest.raises(TypeError) as e:
        builder(Toy(), {"lr": 1e-3})
    assert str(e.value).startswith(f"{builder.__name__} takes an OptimConfig") and "\n" not in str(e.value)


def test_rule_matching_nothing_and_bad_config_raise():
    model = nn.Sequential(nn.Linear(4, 4, bias=False))
    with pytest.raises(ValueError, match=r"optim.groups\[0\] \(no_decay\) matches no parameter"):
        build_param_groups(model, optim_cfg(NO_DECAY))
    with pytest.raises(ValueError, match=r"optim.groups\[0\].kinds"):
        build_param_groups(model, optim_cfg({"name": "x", "kinds": ["gain"]}))
    with pytest.raises(ValueError, match=r"optim.groups\[1\].name"):
        build_param_groups(Toy(), optim_cfg(NO_DECAY, {"name": "no_decay", "names": ["*"]}))
    with pytest.raises(ValueError, match=r"optim.groups\[0\]\.wd: unknown key \(known: .*weight_decay"):
        build_param_groups(Toy(), optim_cfg({"name": "x", "kinds": ["bias"], "wd": 0.0}))
    with pytest.raises(ValueError, match=r"optim.lr"):
        build_param_groups(Toy(), optim_cfg(NO_DECAY, lr=0.0))


# ---------------------------------------------------------------------------------------------------------
# AdamW

def test_adamw_decoupled_weight_decay():
    model = Toy()
    lr, wd = 3e-3, 0.1
    opt, _ = build_optimizer(model, optim_cfg(NO_DECAY, lr=lr, weight_decay=wd))
    assert opt.defaults["fused"] is True  # CPU has a fused AdamW kernel in this torch
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for n in DECAYING:  # m = v = 0, so only the decay term moves θ: θ ← (1 − ηλ)θ
        assert torch.equal(model.get_parameter(n).detach(), before[n] * (1 - lr * wd)), n
    for n in NOT_DECAYING | {"probe.weight"}:
        assert torch.equal(model.get_parameter(n).detach(), before[n]), n
    assert all(s["exp_avg"].dtype == torch.float32 for s in opt.state.values())


def test_adamw_first_step_closed_form():
    # step 1: m̂ = g, v̂ = g², so θ₁ = (1 − ηλ)θ₀ − η·g/(|g| + ε); λ never meets the denominator
    lr, wd, eps = 1e-2, 0.5, 1e-8
    model = nn.Sequential(nn.Linear(6, 5, bias=False))
    opt, _ = build_optimizer(model, optim_cfg(lr=lr, weight_decay=wd))
    w = model[0].weight
    w0, g = w.detach().clone(), torch.randn_like(w)
    w.grad = g.clone()
    opt.step()
    torch.testing.assert_close(w.detach(), (1 - lr * wd) * w0 - lr * g / (g.abs() + eps))


def test_adamw_rejects_low_precision_params():
    model = nn.Sequential(nn.Linear(4, 4)).to(torch.bfloat16)
    with pytest.raises(ValueError, match="FP32 master"):
        build_optimizer(model, optim_cfg())


# ---------------------------------------------------------------------------------------------------------
# schedules

def params_with_grads(seed=0):
    g = torch.Generator().manual_seed(seed)
    ps = [nn.Parameter(torch.zeros(shape)) for shape in [(7, 3), (5,), (2, 4, 3)]]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g)
    return ps + [nn.Parameter(torch.zeros(3))]  # one without a grad: ignored


def full_norm(ps):
    return torch.linalg.vector_norm(torch.cat([p.grad.double().flatten() for p in ps if p.grad is not None]))


def test_clip_scales_by_coef():
    ps = params_with_grads()
    ref, before = full_norm(ps), [p.grad.clone() for p in ps[:3]]
    max_norm, eps = 0.3 * ref.item(), 1e-6
    norm, coef = clip_grad_norm(ps, max_norm, eps=eps)
    assert isinstance(norm, torch.Tensor) and norm.dtype == torch.float32
    torch.testing.assert_close(norm.double(), ref)  # pre-clip norm
    assert coef.item() == pytest.approx(max_norm / (ref.item() + eps), rel=1e-6)
    for p, g in zip(ps, before):
        torch.testing.assert_close(p.grad, g * coef)
    assert full_norm(ps).item() == pytest.approx(max_norm, rel=1e-5)


@pytest.mark.parametrize("max_norm", [None, 0.0, 1e6])
def test_clip_no_clip_paths_leave_grads(max_norm):
    ps = params_with_grads(1)
    before = [p.grad.clone() for p in ps[:3]]
    norm, coef = clip_grad_norm(ps, max_norm)
    torch.testing.assert_close(norm.double(), full_norm(ps))
    assert coef.item() == 1.0
    assert all(torch.equal(p.grad, g) for p, g in zip(ps, before))


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_clip_non_finite_norm_leaves_grads(bad):
    ps = params_with_grads(2)
    ps[1].grad[2] = bad
    before = [p.grad.clone() for p in ps[:3]]
    norm, _ = clip_grad_norm(ps, 1.0)
    assert not torch.isfinite(norm)
    assert all(torch.allclose(p.grad, g, rtol=0, atol=0, equal_nan=True) for p, g in zip(ps, before))


def test_clip_norm_accumulates_in_fp32():
    p = nn.Parameter(torch.zeros(100_000, dtype=torch.bfloat16))
    p.grad = torch.ones_like(p)  # Σg² = 1e5; a BF16 result would round √1e5 to 316.0
    norm, _ = clip_grad_norm([p], None)
    assert norm.dtype == torch.float32 and norm.item() == pytest.approx(math.sqrt(1e5), rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clip_a_finite_gradient_whose_norm_overflows_fp32(dtype):
    """Issue 13 #10: ‖g‖ = 4e19 > √(FP32 max): an FP32 Σg² is inf, so the old clip left coef = 1 and the
    step ran on the raw gradient. The norm must be finite and exact, the gradient clipped to max_norm,
    and optimizer_step must step (not skip) on the clipped gradient."""
    from precision import optimizer_step

    p = nn.Parameter(torch.zeros(4, dtype=dtype))
    p.grad = torch.full((4,), 2e19, dtype=dtype)  # finite: 2e19 < 3.4e38; ‖g‖ = 4e19
    ref = full_norm([p]).item()
    norm, coef = clip_grad_norm([p], 1.0)
    assert math.isfinite(norm.item()) and norm.item() == pytest.approx(ref, rel=1e-6)
    assert coef.item() == pytest.approx(1.0 / ref, rel=1e-5)
    assert full_norm([p]).item() == pytest.approx(1.0, rel=1e-2)
    q = nn.Parameter(torch.zeros(4))
    q.grad = torch.full((4,), 2e19)
    opt = torch.optim.SGD([q], lr=1.0)
    res = optimizer_step([q], opt, None, 1.0)
    assert not res.skipped and math.isfinite(res.norm.item())
    assert torch.linalg.vector_norm(q.detach()).item() == pytest.approx(1.0, rel=1e-5)  # one clipped SGD step


# ---------------------------------------------------------------------------------------------------------
# global-norm clipping, 2 gloo processes: FSDP2 shards, DDP replicas, and a mix

def mlp():
    torch.manual_seed(0)  # same weights on every rank
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 5))


def full_norm_dt(module):
    return math.sqrt(sum(p.grad.full_tensor().double().square().sum().item() for p in module.parameters()))


def _dist_worker(rank, world, init_file):
    in_group(rank, world, init_file, _dist_checks)


def _dist_checks(dist) -> None:
    rank = dist.rank
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 5, generator=gen)
    mine = slice(rank * 4, rank * 4 + 4)

    ref = mlp()  # single-process reference: full model, full batch
    nn.functional.mse_loss(ref(x), y).backward()
    ref_norm = full_norm(list(ref.parameters())).item()
    max_norm = ref_norm / 3

    # FSDP2: every parameter sharded on dim 0 (16 and 5 rows: even and uneven shards)
    sharded = mlp()
    for layer in sharded:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(sharded)
    nn.functional.mse_loss(sharded(x[mine]), y[mine]).backward()  # FSDP averages the halves' grads
    grads = [p.grad for p in sharded.parameters()]
    assert all(isinstance(g, DTensor) and isinstance(g.placements[0], Shard) for g in grads)
    local_only = math.sqrt(sum(g.to_local().double().square().sum().item() for g in grads))
    assert abs(local_only - ref_norm) > 1e-2 * ref_norm, "a rank-local norm must not pass for global"
    norm, coef = clip_grad_norm(sharded.parameters(), max_norm)
    assert norm.item() == pytest.approx(ref_norm, rel=1e-5)
    assert coef.item() == pytest.approx(max_norm / (ref_norm + 1e-6), rel=1e-5)
    for p_s, p_r in zip(sharded.parameters(), ref.parameters()):
        torch.testing.assert_close(p_s.grad.full_tensor(), p_r.grad * coef, rtol=1e-5, atol=1e-6)

    # mix: the sharded grads plus a replicated plain tensor, identical on both ranks
    extra = nn.Parameter(torch.zeros(3))
    extra.grad = torch.tensor([1.0, 2.0, 2.0])
    norm_mix, _ = clip_grad_norm([*sharded.parameters(), extra], None)
    assert norm_mix.item() == pytest.approx(math.sqrt((ref_norm * coef.item()) ** 2 + 9.0), rel=1e-5)

    # a finite sharded gradient whose norm overflows FP32 (issue 13 #10): still clipped to max_norm
    kept = [p.grad.to_local().clone() for p in sharded.parameters()]
    for p in sharded.parameters():
        p.grad.to_local().mul_(1e20)
    big = full_norm_dt(sharded)
    assert math.isfinite(big) and big > 1.8e19
    norm_big, coef_big = clip_grad_norm(sharded.parameters(), 1.0)
    assert norm_big.item() == pytest.approx(big, rel=1e-5) and coef_big.item() == pytest.approx(1 / big, rel=1e-4)
    assert full_norm_dt(sharded) == pytest.approx(1.0, rel=1e-4)
    for p, g in zip(sharded.parameters(), kept):  # back to the grads clipped above
        p.grad.to_local().copy_(g)

    # DDP: grads are plain full tensors on every rank; an all-reduce would give √2 · the norm
    ddp = DistributedDataParallel(mlp())
    nn.functional.mse_loss(ddp(x[mine]), y[mine]).backward()
    norm_ddp, _ = clip_grad_norm(ddp.parameters(), None)
    assert norm_ddp.item() == pytest.approx(ref_norm, rel=1e-5)
    release(ddp)  # the reducer must not outlive the group's Python owners (parallel.dist.release)

    # the fused AdamW from build_optimizer steps DTensor params like the reference steps full ones
    opt_s, _ = build_optimizer(sharded, optim_cfg())
    opt_r, _ = build_optimizer(ref, optim_cfg())
    for p in ref.parameters():
        p.grad.mul_(coef)
    opt_s.step()
    opt_r.step()
    for p_s, p_r in zip(sharded.parameters(), ref.parameters()):
        torch.testing.assert_close(p_s.full_tensor(), p_r.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.distributed
def test_clip_grad_norm_sharded_and_replicated_two_ranks():
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        spawn(_dist_worker, args=(2, init_file))
