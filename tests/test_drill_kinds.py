"""The drills for the fault classes the doctor is learning to see: each acts as its module declares, from
step s on, and emits its fault event once, at s.

Direct checks (milliseconds) where the effect is a tensor (causal_leak, dead_expert, expert_collapse,
update_scale, weight_decay); short train.py runs where it is a record (repeat_batch, clip_threshold;
rank_content on 2 processes): the tiny model of tests/helpers.py, fault at step S_RUN.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from data import build_data
from data.config import DataConfig
from data.loader import Loader
from helpers import TINY, data_config, model_config, run_train
from model import Transformer
from optim import build_optimizer
from optim.config import OptimConfig
from parallel import Dist
from stability.callbacks import StepState
from stability.events import read_events
from stability.config import FaultConfig
from stability.faults import FaultDrill, FaultInjector
from stability.record import read_records

pytestmark = pytest.mark.usefixtures("one_thread")

DATA = {"kind": "synthetic", "seq_len": 16, "min_doc_len": 4, "seed": 5,
        "sources": [{"name": "markov", "kind": "markov", "weight": 0.5, "alphabet": 8, "order": 1, "support": 2},
                    {"name": "copy", "kind": "copy", "weight": 0.5, "alphabet": 8, "segment": 3}]}
MODEL = {"d_model": 16, "n_layers": 2, "n_heads": 2,  # layer 0 dense, layer 1 MoE
         "moe": {"n_experts": 4, "top_k": 2, "expert_hidden": 16, "first_dense": 1, "every": 1}}


def build(fault: dict, model_cfg=MODEL, opt_cfg=None):
    torch.manual_seed(0)
    ds = build_data(DataConfig.from_dict(DATA))
    model = Transformer(model_config({**model_cfg, "vocab_size": ds.vocab_size, "seq_len": ds.seq_len}))
    opt, _ = build_optimizer(model, OptimConfig.from_dict(opt_cfg or {"lr": 1e-2}))
    loader = Loader(ds, 8)
    inj = FaultInjector(FaultConfig(**fault), model=model, optimizer=opt, loader=loader, data_cfg=data_config(DATA),
                        dist=Dist(0, 1, 0, torch.device("cpu"), None))
    return inj, model, opt, loader


def fault_steps(inj) -> list[int]:
    return [e["step"] for e in inj.pop_events()]


# ---- direct checks --------------------------------------------------------------------------------------
def test_causal_leak_lets_a_future_token_change_an_earlier_position_from_step_s():
    inj, model, _, loader = build({"kind": "causal_leak", "step": 3})
    tok = loader.next().tokens
    later = tok.clone()
    later[:, 10] = (later[:, 10] + 1) % 8 + 1  # another token at position 10 only

    def moved(step: int) -> float:
        inj.before_forward(step)
        with torch.no_grad():
            a, b = model(tok).logits, model(later).logits
        return float((a[:, :10] - b[:, :10]).abs().max())

    assert moved(1) == moved(2) == 0.0  # causal: positions 0..9 never see position 10
    assert moved(3) > 1e-4 and moved(4) > 1e-4  # from s on, they do (eval forwards included)
    assert fault_steps(inj) == [3]


def test_dead_expert_output_is_exactly_zero_from_step_s():
    inj, model, _, loader = build({"kind": "dead_expert", "step": 2, "dead_expert": {"expert": 1}})
    [(_, moe)] = model.moe_layers()
    seen = []
    batch = loader.next()
    for step in (1, 2, 3):
        seen.clear()
        inj.before_forward(step)
        # after the drill's hook: what the MoE layer gets back from its experts
        h = moe.experts.register_forward_hook(lambda m, args, out: seen.append((torch.as_tensor(args[1]).tolist(), out)))
        model(batch.tokens, batch.labels)
        h.remove()
        [(counts, out_MD)] = seen
        lo = counts[0]
        rows = out_MD[lo:lo + counts[1]]  # expert 1's rows (GroupedExperts sorts by expert)
        assert counts[1] > 0  # routing unchanged: tokens still reach it
        assert (rows == 0).all() == (step >= 2), step
        assert (out_MD[:lo] != 0).any()  # the other experts answer as before
    assert fault_steps(inj) == [2]


def test_expert_collapse_leaves_experts_2_and_up_without_load_from_step_s():
    inj, model, _, loader = build({"kind": "expert_collapse", "step": 2})
    [(i, moe)] = model.moe_layers()
    batch = loader.next()
    for step in (1, 2, 3):
        inj.before_forward(step)
        load_E = model(batch.tokens, batch.labels).moe_load[i]  # the record's expert_load, unnormalised
        assert (load_E[2:].sum() == 0) == (step >= 2) and load_E[:2].sum() > 0, (step, load_E)
        routes = model(batch.tokens, routes_only=True)[i]  # anticipatory routing's route ids: collapsed too
        assert (routes.max() <= 1) == (step >= 2)
    assert fault_steps(inj) == [2]


def _train_steps(inj, model, opt, loader, steps):
    """Δθ (flat) of each optimizer step, with the drill called at its points as FaultDrill calls it."""
    deltas = []
    for t in steps:
        b = loader.next()
        out = model(b.tokens, b.labels)
        (out.loss_sum / out.n_valid).backward()
        before = torch.cat([p.detach().flatten() for p in model.parameters()]).clone()
        inj.before_update(t)
        opt.step()
        inj.after_update(t)
        opt.zero_grad(set_to_none=True)
        deltas.append(torch.cat([p.detach().flatten() for p in model.parameters()]) - before)
    return deltas


def test_update_scale_multiplies_the_applied_update_not_the_lr():
    drill = build({"kind": "update_scale", "step": 2, "update_scale": {"factor": 10.0}})
    twin = build({"kind": "none"})  # the same seed, the same batches: fault.kind=none
    d, t = _train_steps(*drill, [1, 2]), _train_steps(*twin, [1, 2])
    assert torch.equal(d[0], t[0])  # before s: untouched
    torch.testing.assert_close(d[1], 10.0 * t[1], rtol=1e-4, atol=1e-7)  # at s: ×10 of the twin's update
    assert t[1].norm() > 0
    assert [g["lr"] for g in drill[2].param_groups] == [g["lr"] for g in twin[2].param_groups]
    assert fault_steps(drill[0]) == [2]


def test_weight_decay_scales_every_group_for_each_update_from_step_s():
    inj, model, opt, loader = build({"kind": "weight_decay", "step": 2, "weight_decay": {"factor": 100.0}},
                                    opt_cfg={"lr": 1e-2, "weight_decay": 0.1, "groups": [
                                        {"name": "no_decay", "kinds": ["norm", "embedding"], "weight_decay": 0.0}]})
    planned = [g["weight_decay"] for g in opt.param_groups]
    assert 0.0 in planned and 0.1 in planned  # the no-decay group (norms, biases) and the rest
    used = []
    opt.register_step_pre_hook(lambda o, a, k: used.append([g["weight_decay"] for g in o.param_groups]))
    drill = FaultDrill(inj, opt, SimpleNamespace(emit=lambda *a, **k: None))
    for t in (1, 2, 3):
        s = StepState(t)
        b = loader.next()
        out = model(b.tokens, b.labels)
        (out.loss_sum / out.n_valid).backward()
        drill.before_update(s)
        opt.step()
        drill.after_update(s)
        opt.zero_grad(set_to_none=True)
        assert [g["weight_decay"] for g in opt.param_groups] == planned  # the record and checkpoints see these
    assert used == [planned, [w * 100 for w in planned], [w * 100 for w in planned]]
    assert [g["lr"] for g in opt.param_groups] == [1e-2, 1e-2]  # the LRs as configured


def test_expert_collapse_and_dead_expert_refuse_a_dense_model():
    dense = {**MODEL, "moe": None}
    for kind in ("expert_collapse", "dead_expert"):
        with pytest.raises(ValueError, match=f"^fault.kind={kind}: needs an MoE model") as e:
            build({"kind": kind, "step": 2}, model_cfg=dense)
        assert "\n" not in str(e.value)


def test_a_persistent_drill_stays_on_after_a_rollback_and_a_resume():
    inj, _, _, loader = build({"kind": "repeat_batch", "step": 2})
    b = [loader.next() for _ in range(3)]  # steps 1-3: batch ids 0, 8, 16
    out = [inj.corrupt(t, 8 * (t - 1), b[t - 1]) for t in (1, 2, 3)]
    assert out[0] is b[0] and torch.equal(out[2].tokens, b[1].tokens) and torch.equal(out[2].sample_ids, b[2].sample_ids)
    assert torch.equal(inj.corrupt(1, 0, b[0]).tokens, b[1].tokens)  # a rollback to before s: still on
    resumed, *_ = build({"kind": "repeat_batch", "step": 2})
    resumed.load_state_dict(inj.state_dict())  # the step-2 content rebuilt from its batch ID
    assert torch.equal(resumed.corrupt(7, 48, b[0]).labels, b[1].labels)
    assert fault_steps(inj) == [2] and fault_steps(resumed) == []
    leak, model, _, _ = build({"kind": "causal_leak", "step": 2})
    leak.load_state_dict({"kind": "causal_leak", "fired": True})
    assert not any(blk.attn.causal for blk in model.blocks)


# ---- through train.py --------------------------------------------------------------------------------
S_RUN, STEPS = 5, 9
RUN = [*TINY, f"train.steps={STEPS}", f"train.eval_every={STEPS}", "logging.plot=false", "guard=log",
       f"fault.step={S_RUN}"]
RUNS = {"repeat_batch": [], "clip_threshold": []}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("drill_kinds")

    def train(kind):
        r = run_train(root / kind, f"fault={kind}", *RUN, *RUNS[kind])
        assert r.returncode == 0, f"{kind}: {r.stderr[-3000:]}"
        return kind, (read_records(root / kind / "metrics.jsonl"), read_events(root / kind / "events.jsonl"))
    with ThreadPoolExecutor(max_workers=2) as pool:
        return {**dict(pool.map(train, RUNS)), "_root": str(root)}


def the_fault_fired_once_at_s(events, kind):
    faults = [e for e in events if e["kind"] == "fault"]
    assert [(e["fault"], e["step"]) for e in faults] == [(kind, S_RUN)], faults


def test_repeat_batch_repeats_the_content_while_the_ids_advance(runs):
    recs, events = runs["repeat_batch"]
    the_fault_fired_once_at_s(events, "repeat_batch")
    firsts = [r["batch"]["first"] for r in recs]
    assert firsts == [8 * i for i in range(STEPS)]  # the loader's ids advance as ever
    hashes = [r["ranks"]["hash"][0] for r in recs]
    assert len(set(hashes[:S_RUN])) == S_RUN  # before s: a new batch every step
    assert set(hashes[S_RUN - 1:]) == {hashes[S_RUN - 1]}  # from s: the step-s content, every step


def test_the_doctor_names_a_repeated_batch_at_its_step(runs, tmp_path):
    """From the records alone: the first step whose content was read before under other ids (s + 1)."""
    from doctor.cli import doctor
    d = Path(runs["_root"]) / "repeat_batch"
    rep = doctor(d, plots=False)
    assert rep["class"] == "data.repeated_batch" and rep["earliest"]["step"] == S_RUN + 1, rep["summary"]


def test_clip_threshold_clips_at_factor_times_max_grad_norm(runs):
    recs, events = runs["clip_threshold"]
    the_fault_fired_once_at_s(events, "clip_threshold")
    for r in recs:  # optim/clip.py: coef = min(1, c / (‖g‖ + 1e-6)), c the threshold this step used
        c = 1.0 * (0.003 if r["step"] >= S_RUN else 1.0)
        assert r["clip_coef"] == pytest.approx(min(1.0, c / (r["grad_norm"] + 1e-6)), rel=1e-5), r["step"]
    assert max(r["clip_coef"] for r in recs if r["step"] >= S_RUN) < 0.01
    assert [r["lr"] for r in recs] == [r["lr"] for r in runs["repeat_batch"][0]]  # the schedule as ever


@pytest.mark.distributed
def test_rank_content_moves_rank_1_content_not_its_ids(tmp_path):
    r = run_train(tmp_path / "run", "fault=rank_content", *RUN, nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    recs, events = read_records(tmp_path / "run" / "metrics.jsonl"), read_events(tmp_path / "run" / "events.jsonl")
    the_fault_fired_once_at_s(events, "rank_content")
    from stability.resume_fields import rank_inputs  # the record's own content hash

    from run.config import Config

    saved = OmegaConf.to_container(OmegaConf.load(tmp_path / "run" / "config.yaml"))
    ds = build_data(Config.from_dict(saved).data)
    none = SimpleNamespace(tokens_by_source=torch.ones(1), loss_sum=torch.zeros(()))

    def content_hash(first: int) -> int:
        return rank_inputs(ds.samples(range(first, first + 4)), none, 1, 0, "cpu")["hash"][0]
    # the doctor, from the records alone: rank 1's content is not what its ids name, from step s
    from doctor.cli import doctor
    rep = doctor(tmp_path / "run", plots=False)
    assert rep["class"] == "rank.data" and rep["earliest"]["step"] == S_RUN, rep["summary"]
    assert rep["earliest"]["model_layer"] == "rank 1" or "rank 1" in rep["summary"], rep["earliest"]
    for rec in recs:
        first = rec["batch"]["first"]
        assert rec["ranks"]["first"] == [first, first + 4]  # both ranks' ids are their own shards
        assert rec["ranks"]["hash"][0] == content_hash(first)
        moved = content_hash(first + 4 + 7919 * 8)
        assert rec["ranks"]["hash"][1] == (moved if rec["step"] >= S_RUN else content_hash(first + 4)), rec["step"]

