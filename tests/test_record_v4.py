"""StepRecord version 4 (stability/record.py): the batch's exact floor by source, ‖θ‖ per param group, the
per-expert output RMS, and the per-rank content hash a reader can recompute from the recorded sample ids.

Each against a reference that does not call the code under test: floors from the batch's own tensors,
norms in FP64 over the group's parameters, expert outputs from the expert weights by hand, the hash from
the formula it had before it moved into data/batch.py.
"""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
import yaml

from data import build_data, eval_batches
from data.batch import IGNORE_INDEX, Batch, content_hash
from data.config import DataConfig
from data.loader import Loader
from model import Transformer
from model.config import MoEConfig
from model.moe import MoE, grouped_mm_runs
from optim.accumulate import count_valid_tokens, forward_backward, reduce_step_sums
from optim.config import OptimConfig
from run.config import Config
from stability.record import RECORD_VERSION, V4_FIELDS, V5_FIELDS, batch_floor, floor_by_source
from stability.telemetry import moe_summary
from helpers import TINY, model_config, run_train

pytestmark = pytest.mark.usefixtures("one_thread")

DATA = {"kind": "synthetic", "seq_len": 16, "min_doc_len": 4, "seed": 5,
        "sources": [{"name": "markov", "kind": "markov", "weight": 0.5, "alphabet": 8, "order": 1, "support": 2},
                    {"name": "copy", "kind": "copy", "weight": 0.5, "alphabet": 8, "segment": 3}]}
MODEL = {"d_model": 16, "n_layers": 2, "n_heads": 2,
         "moe": {"n_experts": 4, "top_k": 2, "expert_hidden": 16, "first_dense": 1, "every": 1}}


def old_hash(tokens: torch.Tensor) -> int:
    """stability/resume_fields.py rank_inputs' hash as it was written there (record versions 2 and 3)."""
    tok = tokens.cpu().long().flatten()
    w = torch.arange(1, tok.numel() + 1, dtype=torch.int64) * 2 + 1
    return int(((tok + 1) * w % 2_147_483_629).sum() % 2_147_483_629)


def direct_floors(batch: Batch, names: list[str]) -> tuple[float, dict[str, float]]:
    """Mean Batch.floor over valid labels, overall and per source, in FP64 from the batch's tensors."""
    valid = batch.labels != IGNORE_INDEX
    f = batch.floor.double()
    by = {}
    for s, n in enumerate(names):
        m = valid & (batch.sources == s)[:, None]
        if m.any():
            by[n] = f[m].mean().item()
    return f[valid].mean().item(), by


# ---------------------------------------------------------------- content hash


def test_content_hash_is_the_formula_the_records_used():
    assert content_hash(torch.arange(12).view(3, 4)) == 1378  # Σ_j j·(2j + 1), j = 1..12: 2·650 + 78
    g = torch.Generator().manual_seed(0)
    for shape, vocab in (((8, 16), 40), ((3, 257), 50_000), ((1, 1), 2), ((0, 16), 5)):
        tok = torch.randint(0, vocab, shape, generator=g)
        assert content_hash(tok) == old_hash(tok), shape
    tok = torch.randint(0, 40, (4, 16), generator=g)
    assert content_hash(tok.int()) == old_hash(tok)  # the dtype does not enter
    swapped = tok.clone()
    swapped[0, :2] = tok[0, :2].flip(0)
    assert tok[0, 0] == tok[0, 1] or content_hash(swapped) != content_hash(tok)  # positions count


# ---------------------------------------------------------------- floor by source


def tiny(seed: int = 0):
    torch.manual_seed(seed)
    ds = build_data(DataConfig.from_dict(DATA))
    model = Transformer(model_config({**MODEL, "vocab_size": ds.vocab_size, "seq_len": ds.seq_len}))
    return ds, model


def step_stats(model, micro, n_sources: int = 2) -> dict:
    n = count_valid_tokens(micro, "cpu")
    return reduce_step_sums(forward_backward(model, micro, n, 1e-4, 1, n_sources), n.item())


def test_floor_by_source_is_the_batch_floor_over_valid_labels():
    ds, model = tiny()
    batch = Loader(ds, 8).next()
    stats = step_stats(model, batch.micro_batches(2))
    overall, by = direct_floors(batch, ds.source_names)
    assert len(by) == 2 and all(v > 0 for v in by.values())
    got = floor_by_source(stats, ds.source_names)
    assert got.keys() == by.keys()
    for k in by:
        assert got[k] == pytest.approx(by[k], rel=1e-6), k
    assert batch_floor(stats) == pytest.approx(overall, rel=1e-6)

    # a floor planted at ignored positions must not count (Batch.floor is 0 there by convention only)
    planted = Batch(**{**vars(batch), "floor": torch.where(batch.labels == IGNORE_INDEX, 99.0, batch.floor)})
    assert batch_floor(step_stats(model, planted.micro_batches(2))) == pytest.approx(overall, rel=1e-6)


def test_no_floor_when_any_micro_batch_lacks_one():
    ds, model = tiny()
    batch = Loader(ds, 8).next()
    a, b = batch.micro_batches(2)
    for micro in ([Batch(**{**vars(a), "floor": None}), b], [Batch(**{**vars(m), "floor": None}) for m in (a, b)]):
        stats = step_stats(model, micro)
        assert stats["floor_sum_by_source"] is None
        assert floor_by_source(stats, ds.source_names) == {} and batch_floor(stats) is None
        assert stats["loss"] == pytest.approx(step_stats(model, [a, b])["loss"], rel=1e-6)


def test_eval_floor_by_source_is_the_eval_batches_floor():
    from train import evaluate

    ds, model = tiny()
    batches = eval_batches(ds, 32, 16)
    got = evaluate(model, batches, ds.source_names, torch.device("cpu"))
    overall, by = direct_floors(Batch.concat(batches), ds.source_names)
    assert got["floor"] == pytest.approx(overall, rel=1e-9)
    assert got["floor_by_source"].keys() == by.keys() == got["by_source"].keys()
    for k in by:
        assert got["floor_by_source"][k] == pytest.approx(by[k], rel=1e-9), k


# ---------------------------------------------------------------- ‖θ‖ per param group


def test_weight_norms_per_group_equal_fp64_norms_of_the_parameters():
    from optim import build_optimizer
    from stability.resume_fields import state_summary

    ds, model = tiny()
    opt, _ = build_optimizer(model, OptimConfig.from_dict({"name": "adamw", "lr": 1e-2, "weight_decay": 0.1, "groups": [
        {"name": "no_decay", "kinds": ["bias", "norm", "embedding", "router"], "weight_decay": 0.0}]}))
    assert len(opt.param_groups) >= 2
    loader = Loader(ds, 8)
    for _ in range(2):
        step_stats(model, loader.next().micro_batches(2))
        opt.step()
        opt.zero_grad()
    model.blocks[0].attn.qkv.weight.data.view(-1)[0] = 1e25  # FP32's square overflows: redone in FP64
    got = state_summary(opt, model)
    for i, g in enumerate(opt.param_groups):
        name = g.get("name", f"group{i}")
        ref = torch.linalg.vector_norm(torch.cat([p.detach().double().flatten() for p in g["params"]])).item()
        assert got[f"w/{name}"] == pytest.approx(ref, rel=1e-6), name
    assert sum(1 for k in got if k.startswith("w/")) == len(opt.param_groups)


# ---------------------------------------------------------------- per-expert output RMS

D, H, E = 8, 8, 4
# forced routes of 6 tokens, k = 2; token 4 is padding and the only one sent to expert 3
ROUTES = torch.tensor([[0, 1], [0, 2], [1, 2], [0, 1], [2, 3], [1, 0]])
VALID = torch.tensor([True, True, True, True, False, True])


def tiny_moe(grouped: bool) -> MoE:
    torch.manual_seed(1)
    moe = MoE(MoEConfig(n_experts=E, top_k=2, expert_hidden=H, balance_coef=0.0), D, limit=None)
    moe.init_weights(0.5, 0.5)
    moe.experts.grouped = grouped
    return moe


def hand_out_rms(moe: MoE, x_ND: torch.Tensor, zeroed: int | None = None) -> list[float | None]:
    """RMS over the valid tokens routed to each expert of its output, from the expert weights, in FP64."""
    w_gu, w_dn = moe.experts.w_gate_up.detach().double(), moe.experts.w_down.detach().double()
    sq, n = [0.0] * E, [0] * E
    for t in range(x_ND.shape[0]):
        if not VALID[t]:
            continue
        for e in ROUTES[t].tolist():
            gate, up = (w_gu[e] @ x_ND[t].double()).chunk(2)
            y = w_dn[e] @ (F.silu(gate) * up)
            sq[e] += 0.0 if e == zeroed else y.square().sum().item()
            n[e] += D
    return [math.sqrt(s / c) if c else None for s, c in zip(sq, n)]


def moe_out_rms(moe: MoE, x_ND: torch.Tensor) -> tuple[list, list]:
    out = moe(x_ND, ROUTES, VALID)
    got = moe_summary({1: out.load_E}, {1: out.out_sq_E})["1"]
    return got["out_rms"], got["load"]


def expert_path(moe: MoE, monkeypatch) -> list[str]:
    taken = []
    for path in ("_grouped", "_loop"):
        plain = getattr(type(moe.experts), path)

        def spy(self, *a, plain=plain, path=path):
            taken.append(path)
            return plain(self, *a)
        monkeypatch.setattr(type(moe.experts), path, spy)
    return taken


@pytest.mark.parametrize("grouped", [True, False])
def test_out_rms_equals_a_hand_computation_on_forced_routes(grouped, monkeypatch):
    if grouped and not grouped_mm_runs(torch.zeros(1)):
        pytest.skip("no torch._grouped_mm on this CPU build")
    moe = tiny_moe(grouped)
    taken = expert_path(moe, monkeypatch)
    x = torch.randn(6, D, generator=torch.Generator().manual_seed(2))
    rms, load = moe_out_rms(moe, x)
    assert taken == ["_grouped" if grouped else "_loop"]
    assert load == [4, 4, 2, 0]  # expert 3 got only the padding token
    ref = hand_out_rms(moe, x)
    assert rms[3] is None and ref[3] is None
    for e in range(3):
        assert rms[e] == pytest.approx(ref[e], rel=1e-5) and rms[e] > 0, e


@pytest.mark.parametrize("grouped", [True, False])
def test_a_zeroed_expert_keeps_its_load_and_reads_zero(grouped, monkeypatch):
    if grouped and not grouped_mm_runs(torch.zeros(1)):
        pytest.skip("no torch._grouped_mm on this CPU build")
    moe = tiny_moe(grouped)
    x = torch.randn(6, D, generator=torch.Generator().manual_seed(2))
    before, load_before = moe_out_rms(moe, x)

    def zero_expert_1(module, args, out):  # rows are sorted by expert: expert 1's follow expert 0's
        counts = torch.as_tensor(args[1]).tolist()
        out = out.clone()
        out[counts[0]:counts[0] + counts[1]] = 0
        return out
    handle = moe.experts.register_forward_hook(zero_expert_1)
    after, load_after = moe_out_rms(moe, x)
    handle.remove()
    assert load_after == load_before and load_after[1] == 4
    assert before[1] > 0 and after[1] == 0.0
    assert after[0] == before[0] and after[2] == before[2] and after[3] is None
    assert after[:3] == pytest.approx(hand_out_rms(moe, x, zeroed=1)[:3], rel=1e-5)


def test_out_rms_accumulates_over_micro_batches():
    """The step's figure is over all its micro-batches: the same as one forward of the whole batch."""
    ds, model = tiny()
    batch = Loader(ds, 8).next()
    whole = moe_summary(*[step_stats(model, [batch])[k] for k in ("moe_load", "moe_out_sq")])
    split = moe_summary(*[step_stats(model, batch.micro_batches(4))[k] for k in ("moe_load", "moe_out_sq")])
    assert whole.keys() == split.keys() == {"1"}
    assert whole["1"]["load"] == split["1"]["load"]
    assert split["1"]["out_rms"] == pytest.approx(whole["1"]["out_rms"], rel=1e-5)
    assert len(whole["1"]["out_rms"]) == E


# ---------------------------------------------------------------- a real run


def test_a_run_records_v4_fields_and_its_hashes_rebuild_from_the_sample_ids(tmp_path):
    d = tmp_path / "run"
    r = run_train(d, *TINY, "train.steps=3", "train.eval_every=3")
    assert r.returncode == 0, r.stderr[-3000:]
    records = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]
    config = yaml.safe_load((d / "config.yaml").read_text())
    ds = build_data(Config.from_dict(config).data)
    assert len(records) == 3
    for rec in records:
        assert rec["version"] == RECORD_VERSION >= 4 and all(k in rec for k in (*V4_FIELDS, *V5_FIELDS))
        assert rec["schedule"] == {"lr": 2e-3, "name": "cosine", "steps": 3, "warmup": 2, "decay": 1,
                                   "min_lr_ratio": 0.1}  # version 5: the schedule of TINY's 3 steps
        first, n = rec["ranks"]["first"], rec["ranks"]["n"]
        assert first == [rec["batch"]["first"]] and n == [rec["batch"]["size"]]
        # the loader's next(): samples(range(start, start + b), "train"); micro-batches are contiguous
        # slices of it, and rank_inputs hashes the rank's whole batch before the split
        batch = ds.samples(range(first[0], first[0] + n[0]), "train")
        assert rec["ranks"]["hash"] == [content_hash(batch.tokens)]
        overall, by = direct_floors(batch, ds.source_names)
        assert rec["floor"] == pytest.approx(overall, rel=1e-6)
        assert rec["floor_by_source"].keys() == by.keys() == rec["loss_by_source"].keys()
        for k in by:
            assert rec["floor_by_source"][k] == pytest.approx(by[k], rel=1e-6)
        groups = {k[2:] for k in rec["state"] if k.startswith("m/")}
        assert groups and groups == {k[2:] for k in rec["state"] if k.startswith("w/")}
        assert all(rec["state"][f"w/{g}"] > 0 for g in groups)
        assert rec["moe"]
        for layer, m in rec["moe"].items():
            assert len(m["out_rms"]) == len(m["load"])
            assert all((v is None) == (c == 0) for v, c in zip(m["out_rms"], m["load"])), layer
            assert all(v > 0 for v in m["out_rms"] if v is not None)
    ev = records[-1]["eval"]
    assert ev["floor_by_source"].keys() == ev["by_source"].keys() and ev["floor"] is not None
