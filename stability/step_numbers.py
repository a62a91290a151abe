"""The step's numbers on the host, from the one copy train.py reads (parallel/host_scalars.py), and the guard's
pre-update checkpoint on them.

    vetoed = judge(s, host, reduced, guard, names, scaled=..., fingerprint=...)

fills the StepState's forward-phase numbers (valid tokens, input statistics, global sums, per-rank inputs,
loss by source, finite flags) and asks the guard whether to veto the update. train.py calls it before the
update when the guard can veto (guard=skip / rollback, a drill that reads the verdict after the update:
the step's first read), otherwise after the update, from the same numbers (guard=log never vetoes, and its
detector sees the same values in the same order: the step's only read).
"""
from __future__ import annotations

from stability.callbacks import StepState
from stability.inputs import input_fractions
from stability.record import loss_by_source
from stability.resume_fields import rank_values
from stability.telemetry import nonfinite_flags


def judge(s: StepState, host, reduced, guard, names: list[str], *, scaled: bool, fingerprint: str | None,
          spec=None) -> bool:
    """`host`: the step's HostScalars, read; `reduced`: its optim.accumulate.ReducedSums; `spec`: the run's
    specification checks (spec/monitor.py), whose pre-update failures the guard acts on. True: veto."""
    s.n_valid = int(host["n_valid"][0])
    s.inputs, s.ranks = input_fractions(host), rank_values(host)
    s.stats = reduced.stats(host, float(s.n_valid))
    s.loss_by_source = loss_by_source(s.stats, names)
    s.flags = nonfinite_flags(s.stats["loss"], s.stats["logit_max"], host["grad_norm"])
    by_src = dict(zip(names, s.stats["tokens_by_source"]))
    # the rest of what the step knows before its update, for signals the config adds to the guard's watch
    extra = {"inputs": s.inputs, "logit_max": s.stats["logit_max"], "z_loss": s.stats["z_loss"],
             "nonfinite": s.flags, "tokens_by_source": by_src, "loss_by_source": s.loss_by_source,
             "ranks": s.ranks} if guard.watches_more else None
    failed = spec.read(s, host, "before") if spec is not None else []
    return guard.before_update(s.step, s.stats["loss"], host["grad_norm"], s.flags, scaled=scaled,
                               fingerprint=fingerprint, loss_by_source=s.loss_by_source, tokens_by_source=by_src,
                               extra=extra, spec=failed)
