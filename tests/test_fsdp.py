"""FSDP2 on 2 gloo processes vs one process on the same global batches, micro-batch accumulation on.

Every parameter and gradient is a Shard(0) DTensor; the clipped global norm and the parameters after
a few steps equal the single-process ones (only the reduction order differs).
"""
from __future__ import annotations

import pytest
import torch

from data import build_data
from data.config import DataConfig
from data.loader import Loader
from model import Transformer
from optim import build_optimizer, clip_grad_norm
from optim.accumulate import count_valid_tokens, forward_backward
from optim.config import OptimConfig
from parallel.config import ParallelConfig
from parallel import Dist, wrap_model
from helpers import in_group, model_config, spawn

DATA = {"kind": "synthetic", "seq_len": 16, "min_doc_len": 4, "seed": 5,
        "sources": [{"name": "markov", "kind": "markov", "weight": 0.5, "alphabet": 8, "order": 1, "support": 2},
                    {"name": "copy", "kind": "copy", "weight": 0.5, "alphabet": 8, "segment": 3}]}
# NOTE: bias balancing only: the Switch loss and router z are means per micro-batch (split-dependent).
MODEL = {"d_model": 16, "n_layers": 2, "n_heads": 2, "swiglu_clamp": 10.0,
         "moe": {"n_experts": 4, "top_k": 2, "expert_hidden": 16, "first_dense": 1, "every": 1,
                 "balance_coef": 0.0, "router_z_coef": 0.0}}
STEPS, BATCH = 3, 8


def run(dist: Dist, micro: int) -> dict:
    from torch.distributed.tensor import DTensor, Shard

    torch.manual_seed(0)
    ds = build_data(DataConfig.from_dict(DATA))
    model = Transformer(model_config({**MODEL, "vocab_size": ds.vocab_size, "seq_len": ds.seq_len}))
    wrapped = wrap_model(model, ParallelConfig(mode="fsdp"), dist)
    opt, _ = build_optimizer(model, OptimConfig(lr=1e-2, weight_decay=0.1))  # after sharding: DTensor params
    loader = Loader(ds, BATCH, dist.rank, dist.world)
    norms, sharded = [], []
    for _ in range(STEPS):
        mbs = loader.next().micro_batches(micro)
        forward_backward(wrapped, mbs, count_valid_tokens(mbs, "cpu"), 1e-4, dist.world, 2)
        sharded.append(all(isinstance(p.grad, DTensor) and p.grad.placements == (Shard(0),)
                           for p in model.parameters()))
        norm, _ = clip_grad_norm(model.parameters(), 0.05)  # small threshold: the clip bites
        norms.append(norm.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()}
    return {"norms": norms, "params": full, "sharded": sharded}


def _worker(rank, world, store, out):
    torch.save(in_group(rank, world, store, lambda dist: run(dist, micro=2)), f"{out}.{rank}")


@pytest.mark.parametrize("options, key", [({"param_dtype": "fp8"}, "parallel.param_dtype"),
                                          ({"reduce_dtype": "float64"}, "parallel.reduce_dtype")])
def test_bad_fsdp_options_name_the_key(options, key):
    with pytest.raises(ValueError, match=key):
        ParallelConfig(mode="fsdp", **options)


@pytest.mark.distributed
def test_fsdp_two_processes_match_one_process_with_accumulation(tmp_path):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = run(Dist(0, 1, 0, torch.device("cpu"), None), micro=4)  # same 2 samples per micro-batch
    finally:
        torch.set_num_threads(n)
    spawn(_worker, args=(2, str(tmp_path / "store"), str(tmp_path / "out")))
    for rank in range(2):
        got = torch.load(tmp_path / f"out.{rank}")
        assert all(got["sharded"]), "every gradient must be a Shard(0) DTensor"
        assert single["norms"][0] > 0.05  # the clip was active
        assert got["norms"][0] == pytest.approx(single["norms"][0], rel=1e-6)
        assert got["norms"] == pytest.approx(single["norms"], rel=1e-5)
        for k, v in single["params"].items():
            torch.testing.assert_close(got["params"][k], v, rtol=1e-5, atol=1e-6, msg=k)
