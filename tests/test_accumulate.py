"""Token-normalised accumulation and data-parallel equivalence of the step's gradient half."""
from __future__ import annotations

import os

import pytest
import torch

from data import build_data
from data.batch import IGNORE_INDEX, Batch
from data.config import DataConfig
from data.loader import Loader
from model import Transformer
from optim import build_optimizer, clip_grad_norm
from optim.accumulate import count_valid_tokens, forward_backward
from optim.config import OptimConfig
from helpers import in_group, model_config, spawn

DATA = {"kind": "synthetic", "seq_len": 32, "min_doc_len": 16, "seed": 3,
        "sources": [{"name": "markov", "kind": "markov", "weight": 0.6, "alphabet": 16, "order": 2, "support": 3,
                     "concentration": 0.5},
                    {"name": "copy", "kind": "copy", "weight": 0.4, "alphabet": 16, "segment": 5}]}


def tiny_model(vocab, seq_len, moe=False, seed=0):
    torch.manual_seed(seed)
    cfg = {"vocab_size": vocab, "seq_len": seq_len, "d_model": 32, "n_layers": 2, "n_heads": 2,
           "swiglu_clamp": 10.0}
    if moe:  # balancing bias only: the Switch loss is a per-micro-batch mean and not split-invariant
        cfg["moe"] = {"n_experts": 4, "top_k": 2, "expert_hidden": 32, "first_dense": 1, "every": 1,
                      "balance_coef": 0.0, "router_z_coef": 0.0}
    return Transformer(model_config(cfg))


def grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def unequal_batch(ds):
    """A batch whose micro-batches carry very different numbers of valid labels."""
    b = ds.samples(range(8))
    labels = b.labels.clone()
    labels[:4, 3:] = IGNORE_INDEX  # first half: 3 labels each; second half: >= 15 each
    return Batch(tokens=b.tokens, labels=labels, sources=b.sources, sample_ids=b.sample_ids, floor=None)


@pytest.mark.parametrize("moe", [False, True])
def test_accumulated_gradient_equals_full_batch_gradient(moe):
    ds = build_data(DataConfig.from_dict(DATA))
    batch = unequal_batch(ds)
    counts = [mb.n_valid for mb in batch.micro_batches(2)]
    assert counts[0] * 3 < counts[1]  # the test means something only if the counts differ

    full = tiny_model(ds.vocab_size, 32, moe)
    n = count_valid_tokens([batch], "cpu")
    forward_backward(full, [batch], n, z_coef=1e-3, world=1, n_sources=2)
    g_full = grads(full)

    acc = tiny_model(ds.vocab_size, 32, moe)
    micro = batch.micro_batches(2)
    forward_backward(acc, micro, count_valid_tokens(micro, "cpu"), z_coef=1e-3, world=1, n_sources=2)
    g_acc = grads(acc)
    assert (g_acc - g_full).norm() / g_full.norm() < 1e-6

    # The bug the course warns about: mean per micro-batch, then average the means.
    naive = tiny_model(ds.vocab_size, 32, moe)
    for mb in micro:
        out = naive(mb.tokens, mb.labels)
        ((out.loss_sum + 1e-3 * out.z_sum) / out.n_valid / len(micro) + out.aux_loss / len(micro)).backward()
    assert (grads(naive) - g_full).norm() / g_full.norm() > 1e-2


def _ddp_worker(rank, world, path, steps, store):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.save(in_group(rank, world, store, lambda dist: run_steps(dist, steps, micro=2 // world)), f"{path}.{rank}")


def run_steps(dist, steps, micro):
    from parallel import wrap_model
    from parallel.config import ParallelConfig

    ds = build_data(DataConfig.from_dict(DATA))
    model = tiny_model(ds.vocab_size, 32, moe=True)
    opt, _ = build_optimizer(model, OptimConfig.from_dict({
        "lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
        "groups": [{"name": "no_decay", "kinds": ["norm", "embedding", "router"], "weight_decay": 0.0}]}))
    wrapped = wrap_model(model, ParallelConfig(mode="auto"), dist)
    loader = Loader(ds, 8, dist.rank, dist.world)
    norms = []
    for _ in range(steps):
        mbs = loader.next().micro_batches(micro)
        forward_backward(wrapped, mbs, count_valid_tokens(mbs, "cpu"), 1e-4, dist.world, 2)
        norm, _ = clip_grad_norm(model.parameters(), 0.5)
        norms.append(norm.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"params": {k: v.detach().clone() for k, v in model.state_dict().items()}, "norms": norms}


@pytest.mark.distributed
def test_ddp_parameters_match_single_process(tmp_path):
    from parallel import Dist

    single = run_steps(Dist(0, 1, 0, torch.device("cpu"), None), steps=4, micro=2)
    spawn(_ddp_worker, args=(2, str(tmp_path / "out"), 4, str(tmp_path / "store")))
    for rank in range(2):
        got = torch.load(tmp_path / f"out.{rank}")
        assert got["norms"] == pytest.approx(single["norms"], rel=1e-5)
        for k, v in single["params"].items():
            torch.testing.assert_close(got["params"][k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_token_normalisation_is_exact_in_float64_across_micro_batches_and_ranks():
    """The course's division, as train.py drives it (N the global count as the step's float64 device tensor): on
    a float64 model, 2 micro-batches and 2 ranks (each back-propagating world·L_rank, then averaged as DDP does)
    give the one-pass gradient of (Σ CE + z·Σ lse²)/N to FP64 rounding. A scale rounded to FP32 on the way
    (world/N with N = 121 is off by 4e-8) fails this."""
    ds = build_data(DataConfig.from_dict(DATA))
    batch = unequal_batch(ds)
    z = 1e-3

    def model64():
        return tiny_model(ds.vocab_size, 32).double()

    one = model64()
    out = one(batch.tokens, batch.labels)
    ((out.loss_sum + z * out.z_sum) / out.n_valid.double()).backward()
    g_one = grads(one)

    acc = model64()
    micro = batch.micro_batches(2)
    forward_backward(acc, micro, count_valid_tokens(micro, "cpu"), z_coef=z, world=1, n_sources=2)
    assert ((grads(acc) - g_one).norm() / g_one.norm()).item() < 1e-12

    ranks = [model64() for _ in range(2)]
    shards = batch.micro_batches(2)  # rank r holds shard r; N is the count over both (the all-reduce's)
    n_global = count_valid_tokens(shards, "cpu")
    assert n_global.dtype == torch.float64
    assert float(torch.tensor(2 / float(n_global), dtype=torch.float32)) != 2 / float(n_global)  # FP32 rounds it
    for model, shard in zip(ranks, shards):
        forward_backward(model, shard.micro_batches(2), n_global, z_coef=z, world=2, n_sources=2)
    g_avg = (grads(ranks[0]) + grads(ranks[1])) / 2
    assert ((g_avg - g_one).norm() / g_one.norm()).item() < 1e-12
