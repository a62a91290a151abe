"""Telemetry on 2 processes: DDP and FSDP2 give the one-process layers, and the replica spread catches a lost
gradient reduction (the helpers and references are tests/test_telemetry.py's)."""
from __future__ import annotations

import pytest
import torch

from data.loader import Loader
from optim import build_optimizer
from optim.config import OptimConfig
from parallel import Dist, wrap_model
from parallel.config import ParallelConfig
from stability.config import TelemetryConfig
from stability.telemetry import Telemetry
from helpers import in_group, spawn
from stability.resume_fields import state_summary
from test_telemetry import BATCH, build, close, step


STEPS = 2


def run_steps(dist: Dist, mode: str, micro: int, perturb_rank: int | None = None) -> dict:
    """STEPS telemetry steps; with perturb_rank, one more whose gradient on that rank is nudged after
    the all-reduce (as if its reduction had been lost)."""
    ds, model = build()
    wrapped = wrap_model(model, ParallelConfig(mode=mode), dist)
    opt, _ = build_optimizer(model, OptimConfig(lr=1e-2, weight_decay=0.1))  # after sharding: DTensor params
    loader, tel = Loader(ds, BATCH, dist.rank, dist.world), Telemetry(model, TelemetryConfig(every=1))
    outs, records = [], []
    for n in range(1, STEPS + 1):
        records.append({})
        outs.append(step(model, wrapped, opt, tel, loader.next().micro_batches(micro), n, world=dist.world,
                         record=records[-1])[0])
    if perturb_rank is not None:
        def nudge(m):
            if dist.rank == perturb_rank:
                m.blocks[0].attn.qkv.weight.grad.view(-1)[0] += 1e-3
        outs.append(step(model, wrapped, opt, tel, loader.next().micro_batches(micro), STEPS + 1,
                         world=dist.world, before=nudge)[0])
    with torch.no_grad():  # a bias as the balancing update leaves it: the same on every rank
        for i, m in model.moe_layers():
            m.bias_E.copy_(torch.linspace(-1.0, 0.5 * i, m.n_experts))
    return {"outs": outs, "records": records, "biased": state_summary(opt, model)}


def _worker(rank, world, store, out):
    got = in_group(rank, world, store, lambda dist: {"ddp": run_steps(dist, "ddp", micro=2, perturb_rank=1),
                                                     "fsdp": run_steps(dist, "fsdp", micro=2)})
    torch.save(got, f"{out}.{rank}")


@pytest.mark.distributed
def test_ddp_and_fsdp_match_one_process_and_replica_spread_catches_a_lost_reduction(tmp_path):
    # 4 micro-batches of 2 samples = the 2 ranks × 2 micro-batches of the same global batch
    one = run_steps(Dist(0, 1, 0, torch.device("cpu"), None), "none", micro=4)
    single = one["outs"]
    spawn(_worker, args=(2, str(tmp_path / "store"), str(tmp_path / "out")))
    ranks = [torch.load(tmp_path / f"out.{rank}") for rank in range(2)]
    for rank, got in enumerate(ranks):
        for mode in ("ddp", "fsdp"):
            # record v4: ‖θ‖ per group (FSDP shards summed, DDP replicas once), the global batch's floor by
            # source, per-expert output RMS: the 1-process figures, and the same on both ranks
            for ref, rec, other in zip(one["records"], got[mode]["records"], ranks[1 - rank][mode]["records"]):
                assert rec == other, (mode, rank)
                assert rec["floor_by_source"].keys() == ref["floor_by_source"].keys() == {"markov", "copy"}
                for k, v in ref["floor_by_source"].items():
                    assert close(rec["floor_by_source"][k], v, rel=1e-6), (mode, k)
                w = [k for k in ref["state"] if k.startswith("w/")]
                assert w and rec["state"].keys() == ref["state"].keys()
                for k in w:
                    assert close(rec["state"][k], ref["state"][k]), (mode, k)
                assert rec["moe"].keys() == ref["moe"].keys() == {"1", "2"}
                for layer, m in ref["moe"].items():
                    assert rec["moe"][layer]["load"] == m["load"]
                    got_rms = rec["moe"][layer]["out_rms"]
                    assert [v is None for v in got_rms] == [v is None for v in m["out_rms"]], (mode, layer)
                    assert all(close(a, b, rel=1e-4) for a, b in zip(got_rms, m["out_rms"]) if b is not None)
            bias = {k: v for k, v in got[mode]["biased"].items() if k.startswith("moe_bias/")}
            assert len(bias) == 2 and all(close(v, one["biased"][k], rel=1e-12) for k, v in bias.items()), (mode, bias)
            for ref, out in zip(single, got[mode]["outs"][:STEPS]):
                assert list(out["layers"]) == list(ref["layers"])
                for k, v in ref["layers"].items():
                    for metric in ("act_rms", "grad_rms", "update_ratio", "clamp_hit_rate"):
                        if metric in v:
                            assert close(out["layers"][k][metric], v[metric]), (mode, k, metric)
                assert close(out["update_ratio_max"], ref["update_ratio_max"])
                assert out["nonfinite"] == {"grads": False}
        ddp = got["ddp"]["outs"]
        assert all(o["replica"] == {"param_sum_spread": 0.0, "grad_norm_spread": 0.0} for o in ddp[:STEPS])
        assert ddp[STEPS]["replica"]["grad_norm_spread"] > 0 and ddp[STEPS]["replica"]["param_sum_spread"] > 0
        assert all(o["replica"] == {} for o in got["fsdp"]["outs"])  # shards differ by design: no spread
