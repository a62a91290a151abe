"""Muon (optim/muon.py): Newton–Schulz band, a step against a hand-written reference, ownership table,
bad input, bit-identical resume through torch.distributed.checkpoint, and DDP 2 processes = 1 process."""
from __future__ import annotations

import math
import os
import tempfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from model import ModelConfig, MoEConfig, Transformer
from optim import build_optimizer, format_table
from optim.config import OptimConfig
from optim.muon import newton_schulz5
from parallel import release
from helpers import in_group, spawn

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]
LO, HI = 0.6, 1.25  # the stated band: 5 quintic steps leave σ in [0.68, 1.14] measured (aspect ≤ 1/2 or ≥ 2)


def muon_dict(lr=1e-2, wd=0.1, **muon) -> dict:
    return {"name": "muon", "lr": lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": wd,
            "groups": [{"name": "no_decay", "kinds": ["bias", "norm", "embedding", "router"], "weight_decay": 0.0}],
            "muon": muon}


def muon_cfg(lr=1e-2, wd=0.1, **muon) -> OptimConfig:
    return OptimConfig.from_dict(muon_dict(lr, wd, **muon))


def tiny_moe(seed=0, **kw):
    torch.manual_seed(seed)
    return Transformer(ModelConfig(vocab_size=23, seq_len=8, d_model=16, n_layers=2, n_heads=2, tie_embeddings=False,
                                   moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=8, shared_expert=True), **kw))


def ns_by_hand(G, steps=5):
    """The quintic, written out: X ← 3.4445·X − 4.7750·(XXᵀ)X + 2.0315·(XXᵀ)²X from X = G/‖G‖_F (wide side)."""
    X = G.double()
    tr = X.shape[0] > X.shape[1]
    X = X.T if tr else X
    X = X / X.norm()
    for _ in range(steps):
        A = X @ X.T
        X = 3.4445 * X - 4.7750 * A @ X + 2.0315 * A @ A @ X
    return X.T if tr else X


@pytest.mark.parametrize("shape", [(64, 128), (128, 64), (96, 32), (4, 48, 16)])
def test_newton_schulz_singular_values_in_band(shape):
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    O = newton_schulz5(G)
    s = torch.linalg.svdvals(O)
    assert s.min() >= LO and s.max() <= HI, (s.min().item(), s.max().item())
    # and the same singular vectors as G: O ≈ U·Vᵀ within the band's width (the polar factor)
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    assert torch.linalg.matrix_norm(O - U @ Vh, ord=2).max() <= max(1 - LO, HI - 1) + 1e-5
    if len(shape) == 2:
        torch.testing.assert_close(O.double(), ns_by_hand(G), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape", [(64, 128), (128, 64), (3, 40, 24), (3, 24, 40)])
def test_spec_oracle_is_the_iteration(shape):
    """The specification check's oracle (spec/muon_ref.py orthogonalised) evaluates NS5 on the Gram matrix's
    eigenvalues: it equals the FP64 iteration itself, also for a rank-deficient matrix (λ = 0, where ρ stays defined)."""
    from spec.muon_ref import newton_schulz, orthogonalised
    g = torch.Generator().manual_seed(3)
    for U in (torch.randn(*shape, generator=g),
              torch.randn(*shape[:-1], 3, generator=g) @ torch.randn(3, shape[-1], generator=g)):  # rank 3
        torch.testing.assert_close(orthogonalised(U, 5), newton_schulz(U, 5), rtol=0, atol=1e-12)


class Quad(nn.Module):
    """f = ½‖W − A‖² + ½‖b − c‖²: W (8 × 4) is Muon's, the bias b AdamW's."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(2)
        self.lin = nn.Linear(4, 8)
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(8, 4, generator=g))
            self.lin.bias.copy_(torch.randn(8, generator=g))
        self.A, self.c = torch.randn(8, 4, generator=g), torch.randn(8, generator=g)

    def loss(self):
        return 0.5 * (self.lin.weight - self.A).square().sum() + 0.5 * (self.lin.bias - self.c).square().sum()


def test_muon_steps_on_a_quadratic_match_a_hand_reference():
    lr, wd, mu = 0.05, 0.1, 0.95
    q = Quad()
    opt, table = build_optimizer(q, muon_cfg(lr=lr, wd=wd, momentum=mu))
    assert {r["group"]: r["optimizer"] for r in table} == {"no_decay/adamw": "adamw", "default/muon": "muon"}
    ref_b = nn.Parameter(q.lin.bias.detach().clone())
    ref_adam = torch.optim.AdamW([ref_b], lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    W, M = q.lin.weight.detach().double().clone(), torch.zeros(8, 4, dtype=torch.float64)
    for _ in range(3):
        opt.zero_grad()
        q.loss().backward()
        opt.step()
        ref_adam.zero_grad()
        (0.5 * (ref_b - q.c).square().sum()).backward()
        ref_adam.step()
        G = W - q.A.double()
        M = mu * M + G
        W = (1 - lr * wd) * W - lr * 0.2 * math.sqrt(8) * ns_by_hand(G + mu * M)
        torch.testing.assert_close(q.lin.weight.detach().double(), W, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(q.lin.bias, ref_b, rtol=1e-6, atol=1e-7)
    # update RMS matched to AdamW's: 0.2·√max(m,n)·O has RMS ≈ 0.2 (σ ≈ 1 → ‖O‖_F ≈ √min(m,n))
    rms = (0.2 * math.sqrt(8) * ns_by_hand(torch.randn(8, 4))).square().mean().sqrt().item()
    assert 0.2 * LO <= rms <= 0.2 * HI


def test_ownership_table_fused_parts_and_experts():
    model = tiny_moe(qk_norm=True)
    opt, table = build_optimizer(model, muon_cfg())
    owner = {id(p): g["optimizer"] for g in opt.param_groups for p in g["params"]}
    by_name = {n: owner[id(p)] for n, p in model.named_parameters()}
    muon = {n for n, o in by_name.items() if o == "muon"}
    assert muon == {f"blocks.{i}.{n}" for i, ns in enumerate([
        ("attn.qkv.weight", "attn.proj_out.weight", "mlp.w_gate_up.weight", "mlp.w_down.weight"),
        ("attn.qkv.weight", "attn.proj_out.weight", "mlp.experts.w_gate_up", "mlp.experts.w_down",
         "mlp.shared.w_gate_up.weight", "mlp.shared.w_down.weight")]) for n in ns}
    assert by_name["head.weight"] == by_name["tok_emb.weight"] == by_name["blocks.1.mlp.router.weight"] == "adamw"
    text = format_table(table)
    assert "default/muon" in text and "muon" in text.split("\n")[2] + text and "no_decay/adamw" in text

    # one step: each fused part and each expert is orthogonalised on its own
    x = torch.randint(23, (2, 8))
    model(x, x).loss_sum.backward()
    qkv, experts = model.blocks[0].attn.qkv.weight, model.blocks[1].mlp.experts.w_gate_up
    before = {n: p.detach().clone() for n, p in (("qkv", qkv), ("experts", experts))}
    grads = {"qkv": qkv.grad.clone(), "experts": experts.grad.clone()}
    opt.step()
    for n, splits in (("qkv", [16, 16, 16]), ("experts", [8, 8])):
        W = before[n].double()
        G = grads[n].double()
        U = G + 0.95 * G  # first step: M = G
        parts = U.split(splits, dim=-2)
        O = torch.cat([torch.stack([ns_by_hand(P[e]) for e in range(P.shape[0])]) if P.ndim == 3 else ns_by_hand(P)
                       for P in parts], dim=-2)
        scale = 0.2 * math.sqrt(16)  # every part here is 16 wide, at most 16 tall
        want = (1 - 1e-2 * 0.1) * W - 1e-2 * scale * O
        got = dict(qkv=qkv, experts=experts)[n].detach().double()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.gain = nn.Parameter(torch.ones(4))  # a 1-D parameter of no known kind


@pytest.mark.parametrize("cfg, key", [
    (muon_dict(), "optim.muon.adamw"),
    (muon_dict(momentum=1.0), "optim.muon.momentum"),
    (muon_dict(ns_steps=0), "optim.muon.ns_steps"),
    (muon_dict(rms_scale=0), "optim.muon.rms_scale"),
    (muon_dict(bogus=1), "optim.muon.bogus"),
    (muon_dict(adamw=["gain", "nothing.*"]), "optim.muon.adamw[1]"),
    ({**muon_dict(), "name": "sgd"}, "optim.name"),
])
def test_bad_muon_config_names_the_key(cfg, key):
    with pytest.raises(ValueError) as e:  # from the schema (OptimConfig) or from the build (the model's parameters)
        build_optimizer(Scaled(), OptimConfig.from_dict(cfg))
    assert str(e.value).startswith(key) and "\n" not in str(e.value)


def test_unowned_parameter_placed_on_purpose():
    opt, _ = build_optimizer(Scaled(), muon_cfg(adamw=["gain"]))
    assert [(g["name"], len(g["params"])) for g in opt.param_groups] == [
        ("no_decay/adamw", 1), ("default/muon", 1), ("default/adamw", 1)]


def _batches(n, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(23, (4, 8), generator=g) for _ in range(n)]


def _train(model, opt, batches):
    for x in batches:
        opt.zero_grad(set_to_none=True)
        model(x, x).loss_sum.backward()
        opt.step()


def test_resume_through_dcp_is_bit_identical(tmp_path):
    batches = _batches(6)
    model = tiny_moe()
    opt, _ = build_optimizer(model, muon_cfg())
    _train(model, opt, batches[:3])
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "ck"))
    _train(model, opt, batches[3:])

    fresh = tiny_moe(seed=9)  # different init: everything must come from the checkpoint
    opt2, _ = build_optimizer(fresh, muon_cfg())
    msd2, osd2 = get_state_dict(fresh, opt2)
    sd = {"model": msd2, "optim": osd2}
    dcp.load(sd, checkpoint_id=str(tmp_path / "ck"))
    set_state_dict(fresh, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    assert any("momentum_buffer" in s for s in opt2.state.values()) and any("exp_avg" in s for s in opt2.state.values())
    _train(fresh, opt2, batches[3:])
    for (n, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), n
    for p, q in zip(model.parameters(), fresh.parameters()):
        for k, v in opt.state[p].items():
            assert torch.equal(v, opt2.state[q][k])


def _ddp_worker(rank, world, init_file, out):
    got = in_group(rank, world, init_file, _ddp_and_fsdp_steps)
    if rank == 0:
        torch.save(got, out)


def _ddp_and_fsdp_steps(dist) -> dict:
    rank = dist.rank
    model = tiny_moe()
    ddp = DistributedDataParallel(model)
    opt, _ = build_optimizer(model, muon_cfg())
    for x in _batches(3):
        mine = x[rank * 2: rank * 2 + 2]
        opt.zero_grad(set_to_none=True)
        out_ = ddp(mine, mine)
        (out_.loss_sum / 16).backward()  # DDP averages: ÷ world · (global tokens / world) = mean over 32
        opt.step()
    release(ddp)  # the reducer must not outlive the group's Python owners (parallel.dist.release)
    # FSDP2: every block and the root sharded on dim 0; Muon gathers each matrix for NS5
    sharded = tiny_moe()
    for block in sharded.blocks:
        fully_shard(block)
    fully_shard(sharded)
    opt_s, _ = build_optimizer(sharded, muon_cfg())
    for x in _batches(3):
        mine = x[rank * 2: rank * 2 + 2]
        opt_s.zero_grad(set_to_none=True)
        (sharded(mine, mine).loss_sum / 16).backward()  # FSDP averages over ranks, like DDP
        opt_s.step()
    full = {n: p.full_tensor().detach() for n, p in sharded.named_parameters()}
    return {"ddp": {n: p.detach() for n, p in model.named_parameters()}, "fsdp": full}


@pytest.mark.distributed
def test_ddp_and_fsdp2_two_processes_equal_one(tmp_path):
    with tempfile.TemporaryDirectory() as tmp:
        spawn(_ddp_worker, args=(2, os.path.join(tmp, "init"), tmp_path / "ddp.pt"))
    got = torch.load(tmp_path / "ddp.pt")
    model = tiny_moe()
    opt, _ = build_optimizer(model, muon_cfg())
    for x in _batches(3):
        opt.zero_grad(set_to_none=True)
        (model(x, x).loss_sum / 32).backward()
        opt.step()
    for n, p in model.named_parameters():
        torch.testing.assert_close(got["ddp"][n], p.detach(), rtol=1e-5, atol=1e-6, msg=n)
        torch.testing.assert_close(got["fsdp"][n], p.detach(), rtol=1e-5, atol=1e-6, msg=n)
