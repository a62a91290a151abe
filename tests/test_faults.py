"""Fault injection (stability/faults.py, stability/drills/): each fault has the stated effect at step s and only there;
data faults recur on a replay of the same batch ID, one-shot faults never refire; missing_reduce on
2 gloo processes makes rank 1 keep its local gradient at step s only."""
from __future__ import annotations

import copy
from collections import Counter
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from data import IGNORE_INDEX, PAD_ID, build_data
from data.config import DataConfig
from data.loader import Loader
from model import Transformer
from optim import build_optimizer
from optim.accumulate import count_valid_tokens, forward_backward
from optim.config import OptimConfig
from parallel.config import ParallelConfig
from parallel import Dist, wrap_model
from stability.drills import registry
from stability.config import FaultConfig
from stability.faults import FaultInjector
from helpers import data_config, in_group, model_config, spawn

ROOT = Path(__file__).resolve().parents[1]
DATA = {"kind": "synthetic", "seq_len": 16, "min_doc_len": 4, "seed": 5,
        "sources": [{"name": "markov", "kind": "markov", "weight": 0.5, "alphabet": 8, "order": 1, "support": 2},
                    {"name": "copy", "kind": "copy", "weight": 0.5, "alphabet": 8, "segment": 3}]}
# layer 0 dense, layer 1 MoE
MODEL = {"d_model": 16, "n_layers": 2, "n_heads": 2,
         "moe": {"n_experts": 4, "top_k": 2, "expert_hidden": 16, "first_dense": 1, "every": 1}}


def build(fault: dict, batch_size: int = 8, rank: int = 0, world: int = 1, data=DATA, model_cfg=MODEL):
    torch.manual_seed(0)
    ds = build_data(DataConfig.from_dict(data))
    model = Transformer(model_config({**model_cfg, "vocab_size": ds.vocab_size, "seq_len": ds.seq_len}))
    opt, _ = build_optimizer(model, OptimConfig(lr=1e-2))
    loader = Loader(ds, batch_size, rank, world)
    inj = FaultInjector(FaultConfig(**fault), model=model, optimizer=opt, loader=loader, data_cfg=data_config(data),
                        dist=Dist(rank, world, rank, torch.device("cpu"), None))
    return inj, model, opt, loader


def next_batch(loader):
    first = loader.samples_consumed
    return first, loader.next()


# ---- nan_activation -------------------------------------------------------------------------------------
@pytest.mark.parametrize("layer, sublayer, value", [(0, "attn", "nan"), (1, "mlp", "nan"), (0, "mlp", "inf")])
def test_nan_activation_hits_that_sublayer_at_step_s_only(layer, sublayer, value):
    inj, model, _, loader = build({"kind": "nan_activation", "step": 3, "nan_activation": {
        "layer": layer, "sublayer": sublayer, "value": value, "positions": 3}})
    seen = []  # ((layer, sublayer), output) in forward order
    for i, block in enumerate(model.blocks):
        for name in ("attn", "mlp"):
            getattr(block, name).register_forward_hook(
                lambda m, a, out, key=(i, name): seen.append((key, getattr(out, "y", out).detach())))
    _, batch = next_batch(loader)
    for step in (2, 3, 4):
        seen.clear()
        inj.before_forward(step)
        with torch.no_grad():  # an eval / routing-only forward must not consume the armed hook
            assert torch.isfinite(model(batch.tokens, batch.labels).loss_sum)
        seen.clear()
        out = model(batch.tokens, batch.labels)
        bad = [key for key, y in seen if not torch.isfinite(y).all()]
        if step != 3:
            assert bad == [] and torch.isfinite(out.loss_sum)
            continue
        assert bad and bad[0] == (layer, sublayer)  # the first non-finite output is the chosen one
        y_BTD = dict(seen)[(layer, sublayer)]
        expected = torch.zeros_like(y_BTD, dtype=torch.bool)
        expected[0, :3] = True
        assert torch.equal(~torch.isfinite(y_BTD), expected)
        assert (torch.isnan(y_BTD) if value == "nan" else torch.isposinf(y_BTD)).sum() == expected.sum()
        assert not torch.isfinite(out.loss_sum)
    assert [e["step"] for e in inj.pop_events()] == [3]
    inj.before_forward(3)  # a rollback replays step 3: the one-shot fault does not refire
    assert torch.isfinite(model(batch.tokens, batch.labels).loss_sum)


# ---- data faults --------------------------------------------------------------------------------------
def test_labels_shuffle_keeps_labels_and_mask_but_changes_the_order():
    inj, _, _, loader = build({"kind": "labels_shuffle", "step": 2})
    first, b1 = next_batch(loader)
    assert inj.corrupt(1, first, b1) is b1
    first, b2 = next_batch(loader)
    c = inj.corrupt(2, first, b2)
    valid = b2.labels != IGNORE_INDEX
    assert torch.equal(c.labels != IGNORE_INDEX, valid) and torch.equal(c.tokens, b2.tokens)
    for i in range(len(b2)):
        assert sorted(c.labels[i][valid[i]].tolist()) == sorted(b2.labels[i][valid[i]].tolist())
    assert (c.labels != b2.labels).sum() > valid.sum() // 2  # most labels moved
    assert c.floor is None  # the Bayes floor no longer describes these labels


def test_repeat_token_uses_the_global_batch_top_label_on_every_rank():
    inj, _, _, loader = build({"kind": "repeat_token", "step": 2}, batch_size=8)
    next_batch(loader)
    first, batch = next_batch(loader)
    c = inj.corrupt(2, first, batch)
    top = Counter(batch.labels[batch.labels != IGNORE_INDEX].tolist()).most_common(1)[0][0]
    assert (c.labels != IGNORE_INDEX).all() and (c.tokens == top).all() and (c.labels == top).all()
    inj1, _, _, loader1 = build({"kind": "repeat_token", "step": 2}, rank=1, world=2)  # rank 1's shard
    loader1.samples_consumed = first
    assert (inj1.corrupt(2, first, loader1.next()).tokens == top).all()


def test_overlong_doc_is_one_valid_document_across_rows_and_ranks():
    inj, _, _, loader = build({"kind": "overlong_doc", "step": 1, "overlong_doc": {"seed": 3}})
    first, batch = next_batch(loader)
    c = inj.corrupt(1, first, batch)
    assert (c.labels != IGNORE_INDEX).all()
    assert torch.equal(c.tokens[:, 1:], c.labels[:, :-1])  # one document inside each row ...
    assert torch.equal(c.labels[:-1, -1], c.tokens[1:, 0])  # ... continuing across the rows
    ds = loader.dataset
    assert not torch.isin(c.tokens, torch.tensor([PAD_ID, *ds.bos_ids])).any()  # no padding, no BOS
    shards = []
    for rank in (0, 1):  # each rank corrupts its own shard into the same global batch
        inj_r, _, _, ld = build({"kind": "overlong_doc", "step": 1, "overlong_doc": {"seed": 3}}, rank=rank, world=2)
        shards.append(inj_r.corrupt(1, first, ld.next()).tokens)
    assert torch.equal(torch.cat(shards), c.tokens)


@pytest.mark.parametrize("kind", ["labels_shuffle", "repeat_token", "overlong_doc"])
def test_bad_batch_recurs_on_replay_and_not_when_skipped(kind):
    inj, _, _, loader = build({"kind": kind, "step": 3})
    batches = [next_batch(loader) for _ in range(5)]  # steps 1..5: batch ids 0, 8, 16, 24, 32
    out = [inj.corrupt(s, first, b) for s, (first, b) in enumerate(batches, 1)]
    assert [o is b for o, (_, b) in zip(out, batches)] == [True, True, False, True, True]
    # rollback to step 1 with data replay: step 3 again trains batch 16 -> the same bad data
    again = inj.corrupt(3, 16, batches[2][1])
    assert torch.equal(again.tokens, out[2].tokens) and torch.equal(again.labels, out[2].labels)
    # a replay at another step number is still the same batch ID -> still bad
    assert inj.corrupt(6, 16, batches[2][1]) is not batches[2][1]
    # rollback that skips the window: step 3 now trains batch 40 -> clean
    _, clean = next_batch(loader)
    assert inj.corrupt(3, 40, clean) is clean
    assert [(e["step"], e["batch_first"], e["replay"]) for e in inj.pop_events()] == \
        [(3, 16, False), (3, 16, True), (6, 16, True)]


# ---- lr_spike / optim_state -----------------------------------------------------------------------------
def test_lr_spike_is_k_on_its_window_once_in_wall_clock_time():
    inj, *_ = build({"kind": "lr_spike", "step": 3, "lr_spike": {"factor": 7.0, "steps": 2}})
    assert [inj.drill.factor(t) for t in range(1, 7)] == [1, 1, 7.0, 7.0, 1, 1]
    assert [inj.drill.factor(t) for t in range(2, 6)] == [1, 1, 1, 1]  # rollback to step 1: not again
    cut, *_ = build({"kind": "lr_spike", "step": 3, "lr_spike": {"factor": 7.0, "steps": 3}})
    assert [cut.drill.factor(t) for t in (1, 2, 3, 4)] == [1, 1, 7.0, 7.0]
    assert [cut.drill.factor(t) for t in (3, 4, 5, 6)] == [1, 1, 1, 1]  # a rollback cut the spike short
    assert [e["step"] for e in cut.pop_events()] == [3, 4]


def _adam_steps(model, opt, loader, inj, steps):
    for t in steps:
        mb = loader.next()
        out = model(mb.tokens, mb.labels)
        (out.loss_sum / out.n_valid).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        inj.after_update(t)


@pytest.mark.parametrize("mode, param", [("zero", None), ("zero", "blocks.1.attn"), ("scale", None)])
def test_optim_state_corrupts_exp_avg_sq_after_step_s(mode, param):
    inj, model, opt, loader = build({"kind": "optim_state", "step": 2,
                                     "optim_state": {"mode": mode, "scale": 1e-4, "param": param}})
    ref, ref_model, ref_opt, ref_loader = build({"kind": "none"})  # the same run without the fault
    v = {}
    for i, o, m in ((inj, opt, model), (ref, ref_opt, ref_model)):
        _adam_steps(m, o, loader if i is inj else ref_loader, i, [1])
        v[i, 1] = {n: o.state[p]["exp_avg_sq"].clone() for n, p in m.named_parameters()}
        _adam_steps(m, o, loader if i is inj else ref_loader, i, [2])
        v[i, 2] = {n: o.state[p]["exp_avg_sq"].clone() for n, p in m.named_parameters()}
    assert all(torch.equal(v[inj, 1][n], v[ref, 1][n]) for n in v[ref, 1])  # untouched before s
    hit = [n for n in v[ref, 2] if param is None or param in n]
    assert 0 < len(hit) < len(v[ref, 2]) if param else len(hit) == len(v[ref, 2])
    for n, clean in v[ref, 2].items():
        got = v[inj, 2][n]
        if n not in hit:
            assert torch.equal(got, clean)
        elif mode == "zero":
            assert (got == 0).all() and (clean > 0).any()
        else:
            assert torch.equal(got, clean * 1e-4)
    [ev] = inj.pop_events()
    assert ev["step"] == 2 and ev["tensors"] == len(hit)
    inj.after_update(2)  # a replayed step 2 after a rollback: the one-shot does not refire
    assert all(torch.equal(opt.state[p]["exp_avg_sq"], v[inj, 2][n]) for n, p in model.named_parameters())


# ---- mixture_switch -------------------------------------------------------------------------------------
def test_mixture_switch_changes_the_source_mix_from_step_s_and_stays():
    inj, _, _, loader = build({"kind": "mixture_switch", "step": 4, "mixture_switch": {"weights": [0.9, 0.1]}},
                              batch_size=64)

    def share_of_source0(steps) -> float:
        n = 0
        for t in steps:
            inj.before_batch(t)
            n += int((loader.next().sources == 0).sum())
        return n / (64 * len(steps))

    assert share_of_source0(range(1, 4)) == pytest.approx(0.5, abs=0.08)  # 192 samples, sd 0.036
    assert share_of_source0(range(4, 11)) == pytest.approx(0.9, abs=0.04)  # 448 samples, sd 0.014
    loader.samples_consumed = 0  # rollback past step 4: the mixture stays switched (persistent)
    assert share_of_source0(range(1, 4)) == pytest.approx(0.9, abs=0.06)
    [ev] = inj.pop_events()
    assert ev["step"] == 4 and ev["weights_to"] == pytest.approx([0.9, 0.1])


# ---- state_dict / config ---------------------------------------------------------------------------------
def test_state_dict_round_trip_keeps_fired_flags_and_the_bad_batch():
    inj, _, _, loader = build({"kind": "repeat_token", "step": 2})
    next_batch(loader)
    first, batch = next_batch(loader)
    bad = inj.corrupt(2, first, batch)
    resumed, *_ = build({"kind": "repeat_token", "step": 2})
    resumed.load_state_dict(inj.state_dict())
    assert torch.equal(resumed.corrupt(9, first, batch).tokens, bad.tokens)  # still knows the bad batch
    assert resumed.corrupt(2, first + 8, batch) is batch  # and the fault does not fire anew at step 2
    nan, model, _, loader = build({"kind": "nan_activation", "step": 1})
    nan.before_forward(1)
    fresh, model2, _, _ = build({"kind": "nan_activation", "step": 1})
    fresh.load_state_dict(nan.state_dict())
    fresh.before_forward(1)
    b = loader.next()
    assert torch.isfinite(model2(b.tokens, b.labels).loss_sum)  # resumed: the one-shot already fired
    other, *_ = build({"kind": "nan_activation", "step": 1})
    other.load_state_dict(build({"kind": "none"})[0].state_dict())  # a clean run resumed into a drill
    assert other.state_dict()["fired"] is False
    sw, _, _, ld = build({"kind": "mixture_switch", "step": 1, "mixture_switch": {"weights": [1, 0]}})
    sw.before_batch(1)
    back, _, _, ld2 = build({"kind": "mixture_switch", "step": 1, "mixture_switch": {"weights": [1, 0]}})
    back.load_state_dict(sw.state_dict())
    assert ld2.dataset.fingerprint == ld.dataset.fingerprint != build_data(DataConfig.from_dict(DATA)).fingerprint


@pytest.mark.parametrize("fault, key", [
    ({"kind": "bitflip", "step": 1}, "fault.kind=bitflip"),
    ({"kind": "lr_spike"}, "fault.step: missing"),
    ({"kind": "lr_spike", "step": 0}, "fault.step=0"),
    ({"kind": "mixture_switch", "step": 2, "mixture_switch": {"weights": [1.0, 0.0, 0.0]}},
     r"^fault.mixture_switch.weights=\[1.0, 0.0, 0.0\]: expected 2"),
    ({"kind": "mixture_switch", "step": 2, "mixture_switch": {"weights": [0, 0]}}, "^fault.mixture_switch.weights"),
    ({"kind": "nan_activation", "step": 2, "nan_activation": {"layer": 5}}, "^fault.nan_activation.layer=5"),
    ({"kind": "nan_activation", "step": 2, "nan_activation": {"value": "huge"}}, "^fault.nan_activation.value='huge'"),
    ({"kind": "optim_state", "step": 2, "optim_state": {"param": "nope"}}, "^fault.optim_state.param=nope"),
    ({"kind": "repeat_token", "step": 2, "repeat_token": {"token": 10**6}}, "^fault.repeat_token.token=1000000"),
    ({"kind": "missing_reduce", "step": 2}, "fault.kind=missing_reduce: needs 2"),
])
def test_config_errors_are_one_line_and_name_the_key(fault, key):
    with pytest.raises(ValueError, match=key) as e:
        build(fault)
    assert "\n" not in str(e.value)


def test_every_fault_yaml_builds_against_the_default_data():
    data = OmegaConf.to_container(OmegaConf.load(ROOT / "conf/data/synthetic.yaml"))
    data.update(seq_len=16, min_doc_len=4)
    for kind, drill in registry().items():  # tests/test_drill_registry.py: one yaml per drill, and no other
        cfg = OmegaConf.load(ROOT / f"conf/fault/{kind}.yaml")
        if drill.min_world > 1:
            with pytest.raises(ValueError, match="world=1"):
                build(cfg, data=data)
        else:
            assert build(cfg, data=data)[0].kind == kind


# ---- missing_reduce on 2 gloo processes ------------------------------------------------------------------
def _flat_grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()]).clone()


def _ddp_worker(rank, world, store, out):
    torch.save(in_group(rank, world, store, _missing_reduce_steps), f"{out}.{rank}")


def _missing_reduce_steps(dist: Dist) -> dict:
    rank, world = dist.rank, dist.world
    torch.manual_seed(0)
    ds = build_data(DataConfig.from_dict(DATA))
    model = Transformer(model_config({**MODEL, "vocab_size": ds.vocab_size, "seq_len": ds.seq_len}))
    bare = copy.deepcopy(model)  # the same weights, never reduced: this rank's local gradient
    wrapped = wrap_model(model, ParallelConfig(mode="ddp"), dist)
    loader = Loader(ds, 8, rank, world)
    inj = FaultInjector(FaultConfig(kind="missing_reduce", step=2, missing_reduce={"rank": 1}), model=model,
                        loader=loader, dist=dist)
    res = {"grads": [], "local": [], "events": []}
    try:
        inj.wrap(model)
    except ValueError as e:
        res["not_ddp"] = str(e)
    inj.wrap(wrapped)
    for step in (1, 2, 3):  # no optimizer step: every step sees the same weights on both ranks
        mbs = loader.next().micro_batches(2)
        n_valid = count_valid_tokens(mbs, "cpu")
        forward_backward(bare, mbs, n_valid, 1e-4, world, 2)
        res["local"].append(_flat_grads(bare))
        bare.zero_grad(set_to_none=True)
        inj.before_forward(step)
        forward_backward(wrapped, mbs, n_valid, 1e-4, world, 2)
        res["grads"].append(_flat_grads(model))
        model.zero_grad(set_to_none=True)
        inj.after_update(step)
        res["events"].append(inj.pop_events())
    return res


@pytest.mark.distributed
def test_missing_reduce_rank1_keeps_its_local_gradient_at_step_s_only(tmp_path):
    spawn(_ddp_worker, args=(2, str(tmp_path / "store"), str(tmp_path / "out")))
    r0, r1 = (torch.load(tmp_path / f"out.{r}") for r in (0, 1))
    assert "DistributedDataParallel" in r0["not_ddp"]
    for i, step in enumerate((1, 2, 3)):
        mean = (r0["local"][i] + r1["local"][i]) / 2
        torch.testing.assert_close(r0["grads"][i], mean)  # rank 0 always gets the average
        assert not torch.equal(r0["local"][i], r1["local"][i])  # the shards differ, so the fault shows
        if step == 2:
            torch.testing.assert_close(r1["grads"][i], r1["local"][i], rtol=0, atol=0)
            assert (r0["grads"][i] - r1["grads"][i]).abs().max() > 1e-3
        else:
            assert torch.equal(r0["grads"][i], r1["grads"][i])
    for r in (r0, r1):
        assert r["events"] == [[], [{"step": 2, "kind": "fault", "fault": "missing_reduce", "rank": 1}], []]
