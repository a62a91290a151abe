"""Issue 13 #9: the bf16 precision table against the dtypes a forward actually uses, observed by hooks, on
1 process, DDP 2 and FSDP2 2 (gloo). Under FSDP2 with param_dtype=bf16 every gathered parameter is bf16 —
embedding, norms and router included — and the table must say so instead of "fp32"."""
from __future__ import annotations

import torch
from torch import nn

from model import ModelConfig, MoEConfig, Transformer
from model.moe import MoE
from parallel.dist import Dist
from parallel.config import ParallelConfig
from parallel.wrap import is_sharded, wrap_model
from precision import build_recipe
from helpers import in_group, precision_config, spawn

SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def observe(mode: str, dist: Dist) -> tuple[dict, dict]:
    """(table: module -> param precision it states, observed: module -> dtype of its weight in the forward)."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=17, seq_len=8, d_model=16, n_layers=2, n_heads=2,
                                    moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=8, first_dense=1)))
    recipe = build_recipe(precision_config({"name": "bf16"}))
    recipe.convert(model)
    wrapped = wrap_model(model, ParallelConfig(mode=mode, **recipe.fsdp_dtypes()), dist)
    seen = {}

    def hook(name, get_w):
        return lambda mod, args: seen.__setitem__(name, SHORT[get_w(mod).dtype])

    for name, m in model.named_modules():
        if isinstance(m, (nn.Embedding, nn.RMSNorm)):
            m.register_forward_pre_hook(hook(name, lambda mod: mod.weight))
        elif isinstance(m, MoE):  # the router's weight is read inside MoE.forward (F.linear, autocast off)
            m.register_forward_pre_hook(hook(f"{name}.router", lambda mod: mod.router.weight))
    tokens = torch.randint(0, 17, (2, 8), generator=torch.Generator().manual_seed(dist.rank))
    with recipe.autocast():
        wrapped(tokens, tokens)
    table = recipe.table(sharded=is_sharded(model))
    stated = {m.name: "bf16" if "bf16 params" in m.precision else "fp32"
              for m in table.modules if m.name in seen}
    return stated, seen, table.rows["activations"]


def _worker(rank, world, store, out):
    torch.save(in_group(rank, world, store, lambda dist: {mode: observe(mode, dist) for mode in ("ddp", "fsdp")}),
               f"{out}.{rank}")


def test_bf16_table_equals_the_observed_dtypes(tmp_path):
    single = observe("none", Dist(0, 1, 0, torch.device("cpu"), None))
    spawn(_worker, args=(2, str(tmp_path / "store"), str(tmp_path / "out")))
    runs = {"1proc": single, **torch.load(tmp_path / "out.0")}
    for where, (stated, seen, activations) in runs.items():
        assert set(seen) == set(stated) and len(seen) >= 6, (where, seen, stated)  # emb, 4 block norms + final, router
        assert stated == seen, where
    assert set(runs["1proc"][1].values()) == {"fp32"} and set(runs["ddp"][1].values()) == {"fp32"}
    assert set(runs["fsdp"][1].values()) == {"bf16"} and "residual stream is bf16" in runs["fsdp"][2]
    assert "residual stream fp32" in runs["ddp"][2]
