"""StepRecord: one JSON line per optimizer step, the spine every other tool reads.

Laid out as the course notes' four-layer timeline (input → forward → backward/update → system), all
keyed by the same `step`, cumulative `tokens` and `ckpt_id`, so the first quantity that deviated can be
found by reading one file (runs/<run>/metrics.jsonl).

Record versions (`version`; a record without one is version 1):
    2  inputs.{entropy, kl_running, rare_frac}; time_s.cpu (process CPU seconds of the step);
       resume (the first step after a resume and its checkpoint); state (‖m‖, ‖v‖ per param group,
       ‖bias‖ per MoE layer, after the update); ranks (per-rank first sample id, count, content hash,
       local loss). Computed by stability/inputs.py and stability/step_state.py.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any


RECORD_VERSION = 2
V2_FIELDS = ("resume", "state", "ranks")  # what a version-1 record lacks (beside inputs.entropy, time_s.cpu)


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
    # {act_rms, grad_rms, update_ratio ρ_ℓ, clamp_hit_rate (SwiGLU layers)}
    layers: dict[str, dict[str, float]] = field(default_factory=dict)
    moe: dict[str, dict[str, Any]] = field(default_factory=dict)  # MoE layer -> {load, max_violation, dead}
    nonfinite: dict[str, bool] = field(default_factory=dict)  # loss, logits, grads, optim_state
    update_ratio_max: float | None = None  # max_ℓ ρ_ℓ (telemetry steps)
    # backward / update layer
    lr: float = math.nan
    grad_norm: float = math.nan  # global, before clipping
    clip_coef: float = 1.0
    skipped: bool = False
    loss_scale: float | None = None  # FP16 dynamic loss scale this step's backward used (None: no scaling)
    # system layer
    time_s: dict[str, float] = field(default_factory=dict)  # data, fwd_bwd, optim, log, total
    tokens_per_s: float = 0.0  # positions processed (incl. padding) per second of step time
    memory_mb: float = 0.0
    world: int = 1
    replica: dict[str, float] = field(default_factory=dict)  # cross-rank consistency (spread of per-rank values)
    guard: dict[str, Any] = field(default_factory=dict)  # detector verdict + action this step
    routing: dict[str, Any] = field(default_factory=dict)  # anticipatory routing: on, delay, policy versions
    events: list[str] = field(default_factory=list)
    eval: dict[str, Any] | None = None  # present on steps that ran an evaluation
    # version 2 (stability/step_state.py)
    resume: dict[str, Any] | None = None  # {"from": checkpoint, "step": s} on the first step after a resume
    state: dict[str, float] = field(default_factory=dict)  # m/<group>, v/<group>, moe_bias/<layer> norms
    ranks: dict[str, list] = field(default_factory=dict)  # first, n, hash, loss: one entry per rank
    version: int = RECORD_VERSION

    def to_json(self) -> str:
        # NOTE: allow_nan keeps NaN/inf visible as JSON's non-standard tokens; a diverged run must
        # log its NaN, not crash the logger or silently write null. vars(), not asdict(): every field
        # holds plain JSON values, and asdict's recursive deep copy cost 5× the dump (0.24 vs 0.05 ms).
        return json.dumps(vars(self), separators=(",", ":"), allow_nan=True)


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
