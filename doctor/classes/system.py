"""The system classes: the ranks, the collective, the step's components (and their fixes)."""
from __future__ import annotations

from doctor.classes import declare_class


def _rank_divergence(diag, run, ckpt, t, b, action, ck) -> dict:
    return {"variable": f"the gradient reduction of step {t}",
            "change": "audit the collective (DDP comm hook, buckets, shard ownership, a bad device); compare "
                      "per-rank grad norms", "override": None,
            "expect": "replica spreads exactly 0 at every step"}


def _slow_component(diag, run, ckpt, t, b, action, ck) -> dict:
    comp = diag.anomaly.layer_name if diag.anomaly else "?"
    return {"variable": f"the {comp} component of the step (from step {t})",
            "change": {"data": "profile the data path (loader, storage, decoding, workers) from that step",
                       "fwd_bwd": "profile forward/backward: shapes, routing load, recomputation, communication",
                       "optim": "profile the optimizer step and the guard / telemetry around it"}.get(comp, "profile it"),
            "override": None, "expect": f"{comp} time back to its share of the step"}


def _throughput(diag, run, ckpt, t, b, action, ck) -> dict:
    return {"variable": "shapes, routing load, communication of the slow steps",
            "change": "profile a slow step against a fast one (bench/tools/profile_step.py)", "override": None,
            "expect": "tokens/s of the last third back at the first third's"}


declare_class("system.rank_divergence", "the replicas stopped holding the same bits", _rank_divergence,
              ("only some ranks diverge (只有某些 rank 发散)", "the collective, shard ownership, a bad device",
               "ordinary random fluctuation"))
declare_class("system.throughput", "throughput dropped with a normal loss", _throughput,
              ("throughput drop with a normal loss (吞吐下降但 loss 正常)",
               "shapes, routing load, communication and recomputation", "optimizer degradation"))
declare_class("system.slow_component", "one component of the step slowed", _slow_component,
              ("throughput drop with a normal loss (吞吐下降但 loss 正常)",
               "the one component whose share of the step grew (data / fwd_bwd / optim)", "a machine-wide slowdown"))
