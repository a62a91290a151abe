"""StepRecord: one JSON line per optimizer step, the spine every other tool reads.

Laid out as the four-layer timeline of docs/course.md §1 (input → forward → backward/update → system), all
keyed by the same `step`, cumulative `tokens` and `ckpt_id`, so the first quantity that deviated can be
found by reading one file (runs/<run>/metrics.jsonl).

Record versions (`version`; a record without one is version 1):
    2  inputs.{entropy, kl_running, rare_frac}; time_s.cpu (process CPU seconds of the step);
       resume (the first step after a resume and its checkpoint); state (‖m‖, ‖v‖ per param group,
       ‖bias‖ per MoE layer, after the update); ranks (per-rank first sample id, count, content hash,
       local loss). Computed by stability/inputs.py and stability/resume_fields.py.
    3  fingerprint: a short hash per group of the trajectory-defining config keys (those a resume
       must match: checkpoint/resume.py MUST_MATCH) and of the data manifest, so a reader sees a
       config or data change across a resume without the first process's config.yaml (a resume
       rewrites it); a declared change is named in that step's events (resume.allow_*_change).
    4  floor, floor_by_source: the exact loss floor (Batch.floor) per valid label of the global batch,
       overall and by source (None / {} where the batch has none: real text, a corrupted batch), so a
       loss can be read as its gap to the floor; state "w/<group>": ‖θ‖ per param group after the update;
       moe[layer]["out_rms"]: per expert, the RMS of its output (before the gate) over its valid tokens
       this step (null for an expert with none), so an expert that keeps its load but outputs nothing shows.
    5  schedule: the LR schedule the step trained under, {lr (peak), name, steps (its horizon), warmup,
       decay, min_lr_ratio} (optim/schedule.py Schedule.describe), so each segment of a resumed run is
       judged against its own schedule (a declared train.steps keeps the horizon: optim/schedule.py).
       spec: the step's specification checks (spec/monitor.py): "miss" {check: worst err/tol} of every check that
       ran (above 1: it failed), "fail" [{check, kind, class, layer, where, rank, err, tol, miss, fix, series}],
       "ref_err" {layer: relative error of the training path against the FP64 reference} on reference steps,
       "out_rms" {layer: RMS of its output over the step's batch} every step (the series that dates a failure of a
       check that runs on reference steps only: its "series"), "prefix_err" {layer: ref_err's figure on the first
       and last positions of the prefix check's row} on the steps between reference steps (the exact check's series);
       time_s["spec.<check>"]: each check's host seconds this step, the monitor's own as "spec.monitor"
       (Σ = time_s["spec"]).
"""
from __future__ import annotations

import json
import math
import re
import resource
from dataclasses import dataclass, field
from typing import Any

from stability.callbacks import StepState


RECORD_VERSION = 5
V2_FIELDS = ("resume", "state", "ranks")  # what a version-1 record lacks (beside inputs.entropy, time_s.cpu)
V3_FIELDS = ("fingerprint",)              # what a version-2 record lacks
V4_FIELDS = ("floor", "floor_by_source")  # what a version-3 record lacks (beside V4_SUBFIELDS)
V4_SUBFIELDS = ("state.w/<group>", "moe.<layer>.out_rms")  # keys inside older fields, new in version 4
V5_FIELDS = ("schedule", "spec")         # what a version-4 record lacks


@dataclass
class StepRecord:
    # keys
    step: int
    tokens: int  # cumulative valid label tokens, all ranks
    ckpt_id: str | None = None
    # input layer
    batch: dict[str, int] = field(default_factory=dict)  # global sample ids [first, first + size)
    source_mix: dict[str, int] = field(default_factory=dict)  # documents per source
    valid_tokens: int = 0
    tokens_by_source: dict[str, int] = field(default_factory=dict)
    inputs: dict[str, float] = field(default_factory=dict)  # valid_frac, label_alignment, top_token_frac, ...
    # forward layer
    loss: float = math.nan  # CE per valid token of the global batch
    loss_by_source: dict[str, float] = field(default_factory=dict)
    z_loss: float = math.nan  # mean logsumexp² per valid token (before its coefficient)
    aux_loss: float = 0.0  # MoE balancing + router z, token-weighted over micro-batches
    logit_max: float = math.nan
    expert_load: dict[str, list[float]] = field(default_factory=dict)  # layer -> share of assignments
    # per-layer telemetry (stability/telemetry.py), on telemetry steps only: layer name ->
    # {act_rms, grad_rms, update_ratio ρ_ℓ, clamp_hit_rate (SwiGLU layers), attn_logit_max (block{i}.attn)}
    layers: dict[str, dict[str, float]] = field(default_factory=dict)
    moe: dict[str, dict[str, Any]] = field(default_factory=dict)  # MoE layer -> {load, max_violation, dead}
    nonfinite: dict[str, bool] = field(default_factory=dict)  # loss, logits, grads, optim_state
    update_ratio_max: float | None = None  # max_ℓ ρ_ℓ (telemetry steps)
    # backward / update layer
    lr: float = math.nan
    grad_norm: float = math.nan  # global, before clipping
    clip_coef: float = 1.0
    clip: dict[str, Any] = field(default_factory=dict)  # train.clip=zscore: z, threshold, mean, std, fixed_coef
    qk_clip: dict[str, Any] = field(default_factory=dict)  # heads_clipped, factors {block.h: γ}, logit_max
    skipped: bool = False
    loss_scale: float | None = None  # FP16 dynamic loss scale this step's backward used (None: no scaling)
    # system layer
    # data, route, fwd_bwd, optim, log_eval, ckpt, total, cpu; eval, eval_cpu: the evaluation's own share of log_eval
    # and cpu, on a step that evaluated; spec: the checks
    time_s: dict[str, float] = field(default_factory=dict)
    tokens_per_s: float = 0.0  # positions processed (incl. padding) per second of step time
    memory_mb: float = 0.0
    world: int = 1
    replica: dict[str, float] = field(default_factory=dict)  # cross-rank consistency (spread of per-rank values)
    guard: dict[str, Any] = field(default_factory=dict)  # detector verdict + action this step
    routing: dict[str, Any] = field(default_factory=dict)  # anticipatory routing: on, delay, policy versions
    events: list[str] = field(default_factory=list)
    eval: dict[str, Any] | None = None  # present on steps that ran an evaluation
    # version 2 (stability/resume_fields.py)
    resume: dict[str, Any] | None = None  # {"from": checkpoint, "step": s} on the first step after a resume
    state: dict[str, float] = field(default_factory=dict)  # m/<group>, v/<group>, moe_bias/<layer> norms
    ranks: dict[str, list] = field(default_factory=dict)  # first, n, hash, loss: one entry per rank
    # version 3
    fingerprint: dict[str, str] = field(default_factory=dict)  # config group -> 8 hex; "data" -> manifest (12 hex)
    # version 4
    floor: float | None = None  # mean Batch.floor per valid label of the global batch (None: no floor)
    floor_by_source: dict[str, float] = field(default_factory=dict)  # the same per source present
    # version 5
    schedule: dict[str, Any] = field(default_factory=dict)  # the LR schedule of this step ({}: unknown)
    spec: dict[str, Any] = field(default_factory=dict)  # the specification checks: miss, fail, ref_err
    version: int = RECORD_VERSION

    def to_json(self) -> str:
        # NOTE: allow_nan keeps NaN/inf visible as JSON's non-standard tokens; a diverged run must
        # log its NaN, not crash the logger or silently write null. vars(), not asdict(): every field
        # holds plain JSON values, and asdict's recursive deep copy would cost more than the dump itself.
        return json.dumps(vars(self), separators=(",", ":"), allow_nan=True)


def step_record(s: StepState, *, tokens: int, world: int, batch_size: int, seq_len: int, names: list[str],
                guard: dict, ckpt_id: str | None, device, fingerprint: dict | None = None,
                schedule: dict | None = None) -> StepRecord:
    """The StepRecord of one finished step, from the step's state (stability/callbacks.py), its numbers
    already on the host: s.numbers (stability/step_numbers.py StepNumbers, train.py's read) and s.skipped."""
    nums, post = s.numbers, s.post
    st = nums.stats
    return StepRecord(
        step=s.step, tokens=tokens, world=world,
        batch={"first": s.first_id, "size": batch_size},
        source_mix={n: int(c) for n, c in zip(names, st["samples_by_source"])},
        valid_tokens=nums.n_valid,
        tokens_by_source={n: int(c) for n, c in zip(names, st["tokens_by_source"])}, inputs=nums.inputs,
        loss=st["loss"], z_loss=st["z_loss"], aux_loss=st["aux_loss"], logit_max=st["logit_max"],
        loss_by_source=nums.loss_by_source,
        expert_load={str(l): share for l, share in st["expert_load"].items()},
        lr=s.lr, grad_norm=float(nums.grad_norm), clip_coef=float(nums.clip_coef), clip=s.clip, qk_clip=s.qk_clip,
        skipped=s.skipped, loss_scale=s.result.loss_scale,
        layers=post.get("layers", {}), moe=s.moe, update_ratio_max=post.get("update_ratio_max"),
        nonfinite={**nums.flags, **post.get("nonfinite", {})}, replica=post.get("replica", {}), guard=guard,
        routing=s.routing, time_s=s.time_s, tokens_per_s=batch_size * seq_len / s.time_s["total"],
        memory_mb=peak_memory_mb(device), events=s.events, eval=s.eval, ckpt_id=ckpt_id,
        resume=resume_marker(s.events), state=s.opt_state, ranks=nums.ranks, fingerprint=fingerprint or {},
        floor=batch_floor(st), floor_by_source=floor_by_source(st, names), schedule=schedule or {},
        spec=s.spec,
    )


def config_fingerprint(config) -> dict[str, str]:
    """{group: 8 hex digits} over the keys a resume must match (checkpoint/resume.py MUST_MATCH), one hash
    per top-level group, so a reader can name which group changed (model, optim, precision, train, seed)."""
    import hashlib

    from omegaconf import OmegaConf

    from checkpoint.resume import MUST_MATCH, _under, flatten
    if not isinstance(config, dict):
        config = OmegaConf.to_container(config, resolve=True)
    flat = {k: v for k, v in flatten(config).items() if _under(k, MUST_MATCH)}
    out: dict[str, list] = {}
    for k in sorted(flat):
        out.setdefault(k.split(".")[0], []).append(f"{k}={flat[k]!r}")
    return {g: hashlib.sha256("\n".join(v).encode()).hexdigest()[:8] for g, v in out.items()}


def loss_by_source(stats: dict, names: list[str]) -> dict[str, float]:
    """CE per valid token of each source present in the global batch."""
    return {n: s / c for n, s, c in zip(names, stats["loss_sum_by_source"], stats["tokens_by_source"]) if c}


def floor_by_source(stats: dict, names: list[str]) -> dict[str, float]:
    """Mean exact floor per valid token of each source present in the global batch ({} without a floor)."""
    sums = stats.get("floor_sum_by_source")
    if sums is None:
        return {}
    return {n: f / c for n, f, c in zip(names, sums, stats["tokens_by_source"]) if c}


def batch_floor(stats: dict) -> float | None:
    """Mean exact floor per valid token of the global batch (None without a floor or without a token)."""
    sums, n = stats.get("floor_sum_by_source"), sum(stats["tokens_by_source"])
    return sum(sums) / n if sums is not None and n else None


def peak_memory_mb(device) -> float:
    if device.type == "cuda":
        import torch  # NOTE: here, not at the top: the doctor reads records without loading torch

        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


_RESUMED = re.compile(r"resumed from (\S+) \(step (\d+)")


def resume_marker(events: list[str]) -> dict | None:
    """{"from": the checkpoint directory, "step": its step} when this step is a resume's first."""
    for e in events:
        m = _RESUMED.match(str(e))
        if m:
            return {"from": m.group(1), "step": int(m.group(2))}
    return None


def read_records(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_records_partial(path) -> tuple[list[dict], str | None]:
    """(every complete record, a note naming what was dropped or None): a run killed mid-write leaves
    a truncated last line; the records before it are whole and still tell the run's story."""
    import gc
    with open(path) as f:
        lines = [x for x in f.read().split("\n") if x.strip()]
    out = []
    # NOTE: the cyclic GC rescans every live dict as the list grows (quadratic in records); JSON records
    # hold no cycles, so it is paused while they load
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _parse(lines, out, path)
    finally:
        if enabled:
            gc.enable()


def _parse(lines: list[str], out: list[dict], path) -> tuple[list[dict], str | None]:
    for i, line in enumerate(lines):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            last = out[-1]["step"] if out else None
            return out, (f"{path}: line {i + 1} of {len(lines)} is not a complete record (truncated write?); "
                         f"diagnosed up to step {last}")
    return out, None
