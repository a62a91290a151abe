"""Anticipatory routing: Δt = 0 is normal routing bit-for-bit, Δt = 2 executes ids chosen two steps
earlier with older parameters, Loader.peek matches next(), and OFF never runs a routing forward."""
from __future__ import annotations

import copy

import pytest
import torch

from data import build_data
from data.config import DataConfig
from data.loader import Loader
from helpers import model_config
from model import MoE, Transformer
from optim.accumulate import count_valid_tokens, forward_backward
from stability.anticipatory import AnticipatoryRouting
from stability.config import AnticipatoryConfig

DATA = {"kind": "synthetic", "seq_len": 16, "min_doc_len": 8, "seed": 5,
        "sources": [{"name": "markov", "kind": "markov", "weight": 0.6, "alphabet": 16, "order": 1, "support": 3,
                     "concentration": 0.5},
                    {"name": "copy", "kind": "copy", "weight": 0.4, "alphabet": 16, "segment": 4}]}
BATCH, MICRO = 8, 2


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_moe(vocab: int, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(model_config({
        "vocab_size": vocab, "seq_len": 16, "d_model": 32, "n_layers": 3, "n_heads": 2, "swiglu_clamp": 10.0,
        "moe": {"n_experts": 6, "top_k": 2, "expert_hidden": 16, "first_dense": 1, "score": "sigmoid",
                "balance_coef": 0.01, "router_z_coef": 1e-3, "bias_update_speed": 1e-3}}))


def train(steps: int, delay: int | None, lr: float = 1e-3, before_forward=None):
    """train.py's step in miniature; delay=None never builds the object. Returns, per step, what it saw
    and the ids every MoE layer EXECUTED in the training forwards ([{layer: (N, k)} per micro-batch])."""
    ds = build_data(DataConfig.from_dict(DATA))
    model = tiny_moe(ds.vocab_size)
    loader = Loader(ds, BATCH)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    ar = None
    if delay is not None:
        ar = AnticipatoryRouting(model, loader, MICRO, AnticipatoryConfig(delay=delay), "cpu")
        ar.activate(1)
    ran: list | None = None  # set only around the training forwards: routing forwards fire hooks too

    def record(layer):
        def hook(module, args, out) -> None:  # returns None: the output stays untouched
            if ran is not None:
                ran.append((layer, out.route_ids_Nk))
        return hook

    for layer, moe in model.moe_layers():
        moe.register_forward_hook(record(layer))
    log = []
    for step in range(1, steps + 1):
        first_id = loader.samples_consumed
        micro = loader.next().micro_batches(MICRO)
        routes = ar.routes_for(step, first_id) if ar else None
        if before_forward is not None:
            before_forward(step, model, loader, micro)
        ran = []
        sums = forward_backward(model, micro, count_valid_tokens(micro, "cpu"), 1e-4, 1, 2, routes=routes)
        n_moe = len(model.moe_layers())
        executed = [dict(ran[i * n_moe:(i + 1) * n_moe]) for i in range(MICRO)]
        ran = None
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        for layer, moe in model.moe_layers():
            moe.update_bias(sums.moe_load[layer])
        log.append({"loss": sums.loss_sum.clone(), "grads": grads, "routes": routes, "executed": executed,
                    "info": ar.info(step) if ar else None})
    return model, log


def test_delay_zero_is_normal_routing_bit_for_bit():
    model_off, off = train(4, delay=None)
    model_on, on = train(4, delay=0)
    for a, b in zip(off, on):
        assert torch.equal(a["loss"], b["loss"])
        assert all(torch.equal(a["grads"][n], b["grads"][n]) for n in a["grads"])
        assert all(torch.equal(a["executed"][i][l], b["executed"][i][l]) for i in range(MICRO) for l in (1, 2))
    for pa, pb in zip(model_off.state_dict().values(), model_on.state_dict().values()):
        assert torch.equal(pa, pb)
    assert [s["info"] for s in on] == [{"on": True, "delay": 0, "feature_version": t, "route_version": t}
                                       for t in range(4)]


def test_delay_two_executes_ids_chosen_two_steps_earlier():
    delay, steps = 2, 7
    expected: dict[int, list] = {}  # step -> ids an independent frozen copy chose for it, 2 steps earlier
    current: dict[int, list] = {}   # step -> ids the current parameters' own top-k would pick

    def before_forward(step, model, loader, micro):
        frozen = copy.deepcopy(model)  # parameters (and bias) of version step−1
        ahead = loader.peek(delay - 1).micro_batches(MICRO)  # the batch trained at step + delay
        expected[step + delay] = [frozen.compute_routes(mb.tokens) for mb in ahead]
        current[step] = [model.compute_routes(mb.tokens) for mb in micro]

    model, log = train(steps, delay, lr=0.05, before_forward=before_forward)  # large lr: routes move
    differs = 0
    for step, rec in enumerate(log, start=1):
        want = min(step - 1, delay)  # activated at step 1: delays ramp 0, 1, then stay at 2
        assert rec["info"] == {"on": True, "delay": want, "feature_version": step - 1,
                               "route_version": step - 1 - want}
        for i, ran in enumerate(rec["executed"]):
            assert sorted(ran) == [1, 2]
            for layer, ids_Nk in ran.items():
                cached_BTk = rec["routes"][i][layer]
                assert torch.equal(ids_Nk, cached_BTk.reshape(ids_Nk.shape))
                if step > delay:
                    assert torch.equal(cached_BTk, expected[step][i][layer])
                    now_Nk = current[step][i][layer].reshape(ids_Nk.shape)
                    differs += int((ids_Nk.sort(-1).values != now_Nk.sort(-1).values).any(-1).sum())
    assert differs > 0  # stale ids really differ from the current router's choice on some tokens
    # Gates come from the CURRENT router scores at the stale ids: the router keeps learning.
    for layer, _ in model.moe_layers():
        assert log[-1]["grads"][f"blocks.{layer}.mlp.router.weight"].abs().sum() > 0


@pytest.mark.parametrize("world", [1, 2])
def test_peek_matches_next_and_does_not_move_the_cursor(world):
    ds = build_data(DataConfig.from_dict(DATA))
    for rank in range(world):
        loader = Loader(ds, BATCH, rank, world)
        loader.next()
        peeked = [loader.peek(k) for k in (-1, 0, 1, 2)]
        assert loader.samples_consumed == BATCH  # peek is pure
        replay = Loader(ds, BATCH, rank, world)
        got = [replay.next() for _ in range(4)]
        for p, g in zip(peeked, got):
            assert torch.equal(p.sample_ids, g.sample_ids) and torch.equal(p.tokens, g.tokens)
        assert len(peeked[1]) == BATCH // world
        assert peeked[1].sample_ids[0].item() == BATCH + rank * (BATCH // world)  # the rank's shard
    with pytest.raises(ValueError, match="peek k=-2"):
        loader.peek(-2)


def test_off_costs_nothing_and_on_routes_each_batch_once():
    ds = build_data(DataConfig.from_dict(DATA))
    model = tiny_moe(ds.vocab_size)
    loader = Loader(ds, BATCH)
    calls = {"routes": 0, "peek": 0}
    real_routes, real_peek = model.compute_routes, loader.peek
    model.compute_routes = lambda t: (calls.__setitem__("routes", calls["routes"] + 1), real_routes(t))[1]
    loader.peek = lambda k: (calls.__setitem__("peek", calls["peek"] + 1), real_peek(k))[1]
    ar = AnticipatoryRouting(model, loader, MICRO, AnticipatoryConfig(delay=3), "cpu")

    def step(t):
        first_id = loader.samples_consumed
        loader.next()
        return ar.routes_for(t, first_id)

    assert step(1) is None and step(2) is None
    assert calls == {"routes": 0, "peek": 0}
    assert ar.info(2) == {"on": False, "delay": 0, "feature_version": 1, "route_version": 1}
    ar.activate(3)
    assert len(step(3)) == MICRO
    assert calls == {"routes": 4 * MICRO, "peek": 4}  # batches 3..6 routed at activation
    step(4), step(5)
    assert calls == {"routes": 6 * MICRO, "peek": 6} and len(ar._cache) == 3  # Δt entries wait
    ar.deactivate(5)
    assert step(6) is None and calls["routes"] == 6 * MICRO and not ar._cache
    ar.activate(7)
    resumed = AnticipatoryRouting(model, loader, MICRO, AnticipatoryConfig(delay=3), "cpu")
    resumed.load_state_dict(ar.state_dict())  # on/off travels, the cache does not: route 7..10 afresh
    assert resumed.active and resumed.on_since == 7
    first_id = loader.samples_consumed
    loader.next()
    assert len(resumed.routes_for(7, first_id)) == MICRO and calls["routes"] == 10 * MICRO
    assert resumed.info(7) == {"on": True, "delay": 0, "feature_version": 6, "route_version": 6}
    assert resumed.info(8)["on"] is False  # no routes served for step 8 (yet): it routes normally


def test_bad_delay_and_dense_model_raise():
    ds = build_data(DataConfig.from_dict(DATA))
    model, loader = tiny_moe(ds.vocab_size), Loader(ds, BATCH)
    with pytest.raises(ValueError, match="guard.anticipatory.delay=-1"):
        AnticipatoryRouting(model, loader, MICRO, AnticipatoryConfig(delay=-1), "cpu")
    dense = Transformer(model_config({"vocab_size": ds.vocab_size, "seq_len": 16, "d_model": 16,
                                               "n_layers": 1, "n_heads": 2}))
    with pytest.raises(ValueError, match="no MoE layer"):
        AnticipatoryRouting(dense, loader, MICRO, AnticipatoryConfig(delay=1), "cpu")
    assert not any(isinstance(m, MoE) for m in dense.modules())
