"""Recipes: module conversion by type, the precision table against what actually runs, config errors,
the Transformer Engine import guard."""
from __future__ import annotations

import importlib.abc
import json
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from model import Transformer
from model.moe import GroupedExperts
from model.norm import RMSNorm
from helpers import model_config, precision_config
from precision import RECIPES, build_recipe
from precision.config import PrecisionConfig
from precision.fp8_linear import Fp8GroupedExperts, Fp8Linear
from precision.step import UPDATE_ORDER
from precision.table import QUANTITIES

ROOT = Path(__file__).resolve().parents[1]


def tiny(d_model=64, seed=0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(model_config({
        "vocab_size": 50, "seq_len": 16, "d_model": d_model, "n_layers": 2, "n_heads": 2, "swiglu_clamp": 10.0,
        "moe": {"n_experts": 4, "top_k": 2, "expert_hidden": 64, "shared_expert": True, "first_dense": 1,
                "every": 1}}))


def test_fp8_conversion_keeps_excluded_modules_by_type_and_shares_parameters():
    model = tiny()
    params = {n: p for n, p in model.named_parameters()}
    tokens = torch.randint(0, 50, (2, 16))
    ref = model(tokens, tokens).loss_sum
    recipe = build_recipe(precision_config({"name": "fp8_block"}))
    recipe.convert(model)
    moe = model.blocks[1].mlp
    assert type(model.tok_emb) is nn.Embedding and type(model.head) is nn.Linear
    assert type(moe.router) is nn.Linear
    assert all(type(m) is RMSNorm for n, m in model.named_modules() if n.endswith("norm"))
    for block in model.blocks:
        assert type(block.attn.qkv) is Fp8Linear and type(block.attn.proj_out) is Fp8Linear
    assert type(model.blocks[0].mlp.w_gate_up) is Fp8Linear and type(moe.shared.w_down) is Fp8Linear
    assert type(moe.experts) is Fp8GroupedExperts
    # no parameter copied, renamed or lost: optimizer groups and checkpoints see the same tensors
    assert {n: id(p) for n, p in model.named_parameters()} == {n: id(p) for n, p in params.items()}
    assert model.head.weight is model.tok_emb.weight
    out = model(tokens, tokens).loss_sum
    assert 0 < abs(out.item() - ref.item()) / ref.item() < 0.02
    # converting twice changes nothing
    types = [type(m) for m in model.modules()]
    recipe.convert(model)
    assert [type(m) for m in model.modules()] == types


def test_misaligned_linear_stays_high_precision_with_the_reason():
    model = tiny(d_model=40)  # qkv 40→120: 40 is not a multiple of 16
    recipe = build_recipe(precision_config({"name": "fp8_block"}))
    recipe.convert(model)
    assert type(model.blocks[0].attn.qkv) is nn.Linear
    why = {d.name: d for d in recipe.modules}["blocks.0.attn.qkv"]
    assert why.precision == "fp32" and "40" in why.reason and "16" in why.reason


@pytest.mark.parametrize("name", ["fp32", "bf16", "fp16", "fp8_block", "fp8_tensor"])
def test_precision_table_matches_the_converted_model(name, tmp_path):
    model = tiny()
    recipe = build_recipe(precision_config({"name": name}))
    recipe.convert(model)
    table = recipe.table()
    assert list(table.rows)[:len(QUANTITIES)] == list(QUANTITIES)
    for d in table.modules:  # every stated precision is the module's real type
        m = model.get_submodule(d.name)
        assert isinstance(m, (Fp8Linear, Fp8GroupedExperts)) == d.precision.startswith("fp8"), d
    listed = {d.name for d in table.modules}
    assert name == "fp32" or {"tok_emb", "head", "blocks.1.mlp.router", "norm"} <= listed
    fp8 = name.startswith("fp8")
    assert ("e4m3" in table.rows["matmul inputs"]) == fp8
    assert ("1×128" in table.rows["matmul inputs"]) == (name == "fp8_block")
    assert table.rows["master weights"].startswith("fp32") and table.rows["optimizer state"].startswith("fp32")
    assert ("dynamic" in table.rows["loss scaling"]) == (name == "fp16")
    table.save(tmp_path)
    assert json.loads((tmp_path / "precision.json").read_text()) == table.to_dict()
    assert "| master weights | fp32" in (tmp_path / "precision.md").read_text()


def test_fp16_table_states_the_configured_scaler():
    recipe = build_recipe(precision_config({"name": "fp16", "loss_scale": {"init": 1024.0, "growth_interval": 50}}))
    row = recipe.table().rows["loss scaling"]
    assert "S0=1024" in row and "after 50" in row and UPDATE_ORDER in row
    assert recipe.make_scaler().scale == 1024.0


def test_fp16_update_order_is_stated_the_same_everywhere():
    """Issue 13 #13: the README said "unscale → global norm → finite check → clip", the precision table
    "unscale → finite check → clip → step". One order: the table, docs/reference.md (the README's long form,
    where the update order is written out) and precision/step.py."""
    import precision.step

    root = Path(__file__).resolve().parents[1]
    assert UPDATE_ORDER in build_recipe(precision_config({"name": "fp16"})).table().rows["loss scaling"]
    assert UPDATE_ORDER in " ".join((root / "docs" / "reference.md").read_text().split())
    assert UPDATE_ORDER in precision.step.__doc__


def test_bf16_table_rows_are_what_autocast_does():
    """The table says: bf16 matmul inputs, fp32 router, fp32 norms, fp32 master weights and grads."""
    model = tiny(d_model=32)
    recipe = build_recipe(precision_config({"name": "bf16"}))
    recipe.convert(model)
    seen = {}
    for n, m in model.named_modules():
        if isinstance(m, (nn.Linear, nn.RMSNorm)):
            m.register_forward_hook(lambda mod, inp, out, n=n: seen.__setitem__(n, out.dtype))
    tokens = torch.randint(0, 50, (2, 16))
    with recipe.autocast():
        out = model(tokens, tokens)
        router = model.blocks[1].mlp.router_logits(torch.randn(4, 32))
    (out.loss_sum + out.aux_loss).backward()
    decided = {d.name: d.precision for d in recipe.modules}
    assert seen["blocks.0.attn.qkv"] == torch.bfloat16 and decided["blocks.0.attn.qkv"].startswith("bf16")
    assert seen["blocks.0.attn_norm"] == torch.float32 and decided["blocks.0.attn_norm"] == "fp32"
    assert router.dtype == torch.float32 and decided["blocks.1.mlp.router"] == "fp32"
    assert out.loss_sum.dtype == torch.float32
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    pol = recipe.fsdp_policy()
    assert (pol.param_dtype, pol.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert recipe.fsdp_dtypes() == {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    assert build_recipe(precision_config({"name": "fp32"})).fsdp_dtypes() == {"param_dtype": "float32", "reduce_dtype": "float32"}
    assert "bf16" in recipe.table().rows["communication"]


@pytest.mark.parametrize("cfg, key", [
    ({"name": "fp9"}, "precision.name"),
    ({"name": "fp8_block", "scaling": "row"}, "precision.scaling"),
    ({"name": "fp16", "loss_scale": {"growth_factor": 0.5}}, "precision.loss_scale.growth_factor"),
    ({"name": "bf16", "autocast_dtype": "bfloat16"}, "precision.autocast_dtype"),
    ({"name": "fp8_block", "autocast_dtype": "float8"}, "precision.autocast_dtype"),
    ({"name": "fp8_block", "fused_quant": "auto"}, "precision.fused_quant"),
    ({"name": "bf16", "fused_quant": True}, "precision.fused_quant"),
])
def test_bad_config_raises_one_line_naming_the_key(cfg, key):
    with pytest.raises(ValueError) as e:
        build_recipe(precision_config(cfg))
    assert key in str(e.value) and "\n" not in str(e.value)


def test_every_config_file_builds_and_te_fails_cleanly_without_cuda():
    names = sorted(p.stem for p in (ROOT / "conf" / "precision").glob("*.yaml"))
    assert set(names) == set(RECIPES)
    for name in names:
        cfg = PrecisionConfig(**OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "precision" / f"{name}.yaml")))
        assert cfg.name == name
        if name == "te_fp8" and not torch.cuda.is_available():
            with pytest.raises(ValueError) as e:
                build_recipe(cfg)
            msg = str(e.value)
            assert "pip install .[te]" in msg and "\n" not in msg
        else:
            assert build_recipe(cfg).name == name


class _Explode(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, exc):
        self.exc = exc

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "transformer_engine":
            return importlib.machinery.ModuleSpec(name, self)
        return None

    def create_module(self, spec):
        raise self.exc

    def exec_module(self, module):
        raise self.exc


@pytest.mark.parametrize("exc", [ImportError("No module named 'transformer_engine_torch'"),
                                 OSError("libcuda.so.1: cannot open shared object file\nsecond line"),
                                 RuntimeError("CUDA driver version is insufficient")])
def test_te_import_guard_catches_import_os_and_runtime_errors(monkeypatch, exc):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for mod in [m for m in sys.modules if m.startswith("transformer_engine")]:
        monkeypatch.delitem(sys.modules, mod)
    finder = _Explode(exc)
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    with pytest.raises(ValueError) as e:
        build_recipe(precision_config({"name": "te_fp8"}))
    msg = str(e.value)
    assert "pip install .[te]" in msg and type(exc).__name__ in msg and "\n" not in msg


@pytest.mark.gpu
def test_te_recipe_converts_and_trains_one_step():
    pytest.importorskip("transformer_engine.pytorch")
    model = tiny(d_model=128).cuda()
    recipe = build_recipe(precision_config({"name": "te_fp8", "recipe": "current"}), "cuda")
    recipe.convert(model)
    assert type(model.head) is nn.Linear and type(model.blocks[1].mlp.router) is nn.Linear
    assert type(model.blocks[1].mlp.experts) is GroupedExperts
    assert "te" in type(model.blocks[0].attn.qkv).__module__
    tokens = torch.randint(0, 50, (2, 16), device="cuda")  # 32 tokens: TE wants multiples of 16
    with recipe.autocast():
        out = model(tokens, tokens)
    out.loss_sum.backward()
    assert torch.isfinite(out.loss_sum) and model.blocks[0].attn.qkv.weight.grad is not None
