"""The StepRecord fields that show a resume or a rank going wrong: optimizer-state norms, per-rank inputs,
CPU time (record version 2; stability/record.py). Each is cheap enough for every step.

    state = state_summary(optimizer, model)     # ‖m‖, ‖v‖, ‖θ‖ per param group; ‖bias‖ per MoE layer
    ranks = rank_inputs(local_batch, sums, world, rank, device)   # per-rank sample ids, content hash, local loss
    resume = resume_marker(events_now)          # stability/record.py: {"from": checkpoint, "step": s} on a resume's first step
    cpu = cpu_clock()                           # process CPU seconds (all threads)

A resume that lost or altered optimizer state shows at its first step as a jump of ‖m‖ / ‖v‖ that no
gradient explains; a rank reading other data shows as sample ids off the sharding, or a local loss far
from the other ranks'; a machine-wide slowdown shows as wall time up with CPU time per step unchanged.
"""
from __future__ import annotations

import math
import time

import torch

from data.batch import content_hash_t
from parallel.dist import all_reduce_max, all_reduce_sum
from parallel.host_scalars import HostScalars
from stability.telemetry_layers import is_sharded, local, norms, norms_fp32, to_redo


def state_summary(optimizer: torch.optim.Optimizer, model) -> dict[str, float]:
    """{"m/<group>": ‖exp_avg‖, "v/<group>": ‖exp_avg_sq‖, "w/<group>": ‖θ‖, "moe_bias/<layer>": ‖bias_E‖}.
    Global norms (one SUM all-reduce of squares: FSDP shards add up; DDP replicas are divided by the world)."""
    keys, vals = _summary(optimizer, model, exact=True)
    return {k: math.sqrt(v) for k, v in zip(keys, vals.tolist())} if keys else {}


def state_tensors(optimizer: torch.optim.Optimizer, model) -> dict[str, torch.Tensor]:
    """state_summary's squares on the device, nothing read: {"state/<key>": Σ‖t‖², "state/redo": n}, where n
    counts the tensors, on every rank, whose FP32 norm came out 0 or non-finite (state_values then takes
    the exact pass: rare, and the only case in which this half differs from state_summary's)."""
    keys, vals = _summary(optimizer, model, exact=False)
    return {**{f"state/{k}": v for k, v in zip(keys, vals[:-1])}, "state/redo": vals[-1]} if keys else {}


def state_values(host, optimizer: torch.optim.Optimizer, model) -> dict[str, float]:
    """state_summary from the host's copy of state_tensors() (a mapping name -> numbers)."""
    if "state/redo" not in host:
        return {}
    if host["state/redo"]:  # every rank sees the same global count, so all enter the exact pass's collective
        return state_summary(optimizer, model)
    return {k.removeprefix("state/"): math.sqrt(v) for k, v in _items(host) if k != "state/redo"}


def _items(host):
    return [(k, host[k]) for k in host.names() if k.startswith("state/")]


def _summary(optimizer: torch.optim.Optimizer, model, exact: bool) -> tuple[list[str], torch.Tensor]:
    """keys and their global Σ‖t‖² (K,) in FP64; not exact: one more entry, the count of tensors whose FP32
    norm norms() would compute again in FP64 (summed over ranks with the squares)."""
    keys, parts = [], []  # per key, its tensors
    for i, g in enumerate(optimizer.param_groups):
        name = str(g.get("name", f"group{i}"))
        for slot, short in (("exp_avg", "m"), ("exp_avg_sq", "v")):
            keys.append(f"{short}/{name}")
            parts.append([local(optimizer.state[p][slot]) for p in g["params"]
                          if p in optimizer.state and slot in optimizer.state[p]])
        # the weights the moments belong to, read the same way (a parameter's storage, never its .grad)
        keys.append(f"w/{name}")
        parts.append([local(p.detach()) for p in g["params"]])
    parts = [[t for t in ts if t.numel()] for ts in parts]
    flat = [t for ts in parts for t in ts]
    dev = flat[0].device if flat else torch.device("cpu")
    # NOTE: one fused FP32 norm per tensor, every key's in one call (FP64 again only where it came out
    # non-finite: a finite 1e30 overflows FP32's square), squared and summed in FP64 per key: no FP64 copy of
    # every moment, so cheap enough for every step, and every step it must be: the doctor's trailing baseline
    # for a resume's first step needs the steps before it. It reads them on a log scale with a 15 % floor
    # (doctor/timeline.py FLOOR_STATE): FP32's ~1e-7 is nothing. A finite norm proves every element finite:
    # state_nonfinite() reads the flag from these same norms.
    each = (norms if exact else norms_fp32)(flat, dev) if flat else torch.zeros(0, dtype=torch.float64, device=dev)
    sq = [n.square().sum() for n in each.split([len(ts) for ts in parts])]
    n_param = len(keys)  # entries of parameters and their moments; the MoE biases after them are buffers
    moe = model.moe_layers() if hasattr(model, "moe_layers") else []
    for layer, m in moe:
        keys.append(f"moe_bias/{layer}")
        sq.append(m.bias_E.detach().double().square().sum().to(dev))
    if not keys:
        return [], torch.zeros(0, dtype=torch.float64)
    if not exact:
        sq.append(to_redo(each).sum().double())
    vals = torch.stack(sq)
    world, sharded = _world_and_sharding(model)
    if world > 1:
        vals = all_reduce_sum(vals)
        # replicas hold the same state: the sum counted it `world` times. FSDP shards the parameters (and so
        # their moments) but no buffer: the MoE biases are whole on every rank under FSDP too
        vals[n_param if sharded else 0:len(keys)] /= world
    return keys, vals


def state_nonfinite(optimizer: torch.optim.Optimizer, summary: dict[str, float], others: bool = True) -> bool:
    """Does any rank's optimizer state hold an inf/NaN? The moments' norms are state_summary's (global:
    a NaN on any rank reaches every rank through its all-reduce): free, every step. Other floating state
    (Muon's momentum buffer) costs a pass and one MAX all-reduce: only when `others` (train.py: on
    telemetry steps, as before; every rank passes the same)."""
    if any(not math.isfinite(v) for k, v in summary.items() if k.startswith(("m/", "v/"))):
        return True
    if not others:
        return False
    # NOTE: whether there is other state depends on the optimizer, the same on every rank (the collective
    # below is entered by all or none); an FSDP shard of it can be empty on one rank
    other = [local(t) for st in optimizer.state.values() for k, t in st.items()
             if k not in ("exp_avg", "exp_avg_sq", "step") and torch.is_tensor(t) and t.is_floating_point()]
    if not other:
        return False
    live = [t for t in other if t.numel()]
    bad = torch.zeros(1, dtype=torch.float64, device=other[0].device)
    if live:
        bad += (~torch.isfinite(norms(live, bad.device)).all()).double()
    return bool(all_reduce_max(bad).item())


def _world_and_sharding(model) -> tuple[int, bool]:
    import torch.distributed as tdist
    world = tdist.get_world_size() if tdist.is_initialized() else 1
    # NOTE: only asked with several ranks: a walk over every parameter cost as much as the norms
    sharded = world > 1 and any(is_sharded(p) for p in model.parameters())
    return world, sharded


def rank_inputs(local_batch, sums, world: int, rank: int, device) -> dict[str, list]:
    """Per rank: first sample id, sample count, a content hash of its tokens, its local loss per valid
    token. One SUM all-reduce of a (4, world) table in which each rank fills its own column. `local_batch`:
    this rank's Batch, or its micro-batches in order."""
    host = HostScalars()
    host.put(**rank_tensors(local_batch, sums, world, rank, device))
    host.read()
    return rank_values(host)


def rank_tensors(local_batch, sums, world: int, rank: int, device) -> dict[str, torch.Tensor]:
    """rank_inputs' table on the device, nothing read: {"ranks_4W": (4, world) float64}."""
    micro_batches = [local_batch] if hasattr(local_batch, "sample_ids") else list(local_batch)
    ids = torch.cat([mb.sample_ids for mb in micro_batches])
    h = content_hash_t(torch.cat([mb.tokens for mb in micro_batches]))  # this rank's batch, row-major
    n_valid = sums.tokens_by_source.sum().double()
    loss = torch.where(n_valid > 0, sums.loss_sum.double() / n_valid, math.nan)
    first = ids.min().double() if len(ids) else torch.full((), -1.0, dtype=torch.float64, device=ids.device)
    col = torch.stack([first.to(device), torch.full((), float(len(ids)), dtype=torch.float64, device=device),
                       h.to(device, torch.float64), loss.to(device)])
    table = torch.zeros(4, world, dtype=torch.float64, device=device)
    table[:, rank] = col
    return {"ranks_4W": all_reduce_sum(table) if world > 1 else table}


def rank_values(host) -> dict[str, list]:
    """rank_inputs from the host's copy of rank_tensors() (a mapping name -> numbers)."""
    first, n, hsh, lo = host["ranks_4W"]
    return {"first": [int(x) for x in first], "n": [int(x) for x in n], "hash": [int(x) for x in hsh], "loss": lo}


def cpu_clock() -> float:
    """Process CPU seconds, every thread: unchanged per step when only the machine got busier."""
    return time.process_time()
