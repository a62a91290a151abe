"""The step's numbers on the host, as one value, from the copy train.py reads (parallel/host_scalars.py), and the
guard's pre-update verdict on them.

    host.read()
    s.numbers = nums = step_numbers(host, reduced, names)     # StepNumbers: every field a float, int, bool or dict
    s.vetoed = vetoed = ask_guard(guard, step, nums, names, spec=failed, scaled=..., fingerprint=...)

train.py reads them before the update when the guard can veto (guard=skip / rollback, a drill that reads the
verdict after the update: the step's first read), otherwise after the update, from the same device tensors
(guard=log never vetoes, and its detector sees the same values in the same order: the step's only read).
Nothing here writes to the StepState: the numbers are a return value, set where train.py sets them.
"""
from __future__ import annotations

from dataclasses import dataclass

from stability.inputs import input_fractions
from stability.record import loss_by_source
from stability.resume_fields import rank_values
from stability.telemetry import nonfinite_flags


@dataclass(frozen=True)
class StepNumbers:
    """What the step computed before its update, read to the host: the forward's (valid tokens, input
    statistics, global sums, per-rank inputs) and the update's measurement (norm, clip coefficient, overflow).
    Whether the update then applied is `overflow or vetoed` (train.py's `skipped`, a bool)."""
    n_valid: int                      # global valid label tokens
    inputs: dict                      # input-layer statistics of the global batch (stability/inputs.py)
    ranks: dict                       # per-rank first sample id, count, content hash, local loss
    stats: dict                       # reduced loss / source / MoE sums (optim/accumulate.py ReducedSums.stats)
    loss_by_source: dict[str, float]  # CE per valid token of each source in the batch
    tokens_by_source: dict[str, int]  # the tokens each per-source loss is the mean of
    flags: dict[str, bool]            # non-finite loss / logits / grads (stability/telemetry.py nonfinite_flags)
    grad_norm: float                  # global grad norm before clipping, of the unscaled gradient
    clip_coef: float                  # the clip coefficient the update applies (1 on overflow)
    overflow: bool                    # an inf/NaN gradient element on some rank (all ranks agree): no update


def step_numbers(host, reduced, names: list[str]) -> StepNumbers:
    """`host`: the step's HostScalars, read; `reduced`: its optim.accumulate.ReducedSums; `names`: the sources."""
    n_valid = int(host["n_valid"][0])
    stats = reduced.stats(host, float(n_valid))
    return StepNumbers(n_valid=n_valid, inputs=input_fractions(host), ranks=rank_values(host), stats=stats,
                       loss_by_source=loss_by_source(stats, names),
                       tokens_by_source=dict(zip(names, stats["tokens_by_source"])),
                       flags=nonfinite_flags(stats["loss"], stats["logit_max"], host["grad_norm"]),
                       grad_norm=host["grad_norm"], clip_coef=host["clip_coef"], overflow=bool(host["overflow"]))


def ask_guard(guard, step: int, nums: StepNumbers, *, spec: list[dict], scaled: bool,
              fingerprint: str | None) -> bool:
    """The guard's verdict on the step before its update (stability/guard.py Guard.before_update). `spec`: the
    specification checks' pre-update failures (spec/monitor.py Conformance.read), which the guard acts on.
    True: veto the update (a guard that cannot veto, guard=log, only scores and logs)."""
    # the rest of what the step knows before its update, for signals the config adds to the guard's watch
    extra = {"inputs": nums.inputs, "logit_max": nums.stats["logit_max"], "z_loss": nums.stats["z_loss"],
             "nonfinite": nums.flags, "tokens_by_source": nums.tokens_by_source,
             "loss_by_source": nums.loss_by_source, "ranks": nums.ranks} if guard.watches_more else None
    return guard.before_update(step, nums.stats["loss"], nums.grad_norm, nums.flags, scaled=scaled,
                               fingerprint=fingerprint, loss_by_source=nums.loss_by_source,
                               tokens_by_source=nums.tokens_by_source, extra=extra, spec=spec)
