"""The gradient and optimizer classes: the gradient, the clip, the LR, the optimizer's state and settings (and
their fixes)."""
from __future__ import annotations

from doctor.classes import declare_class, spec_fix
from doctor.classes.numerics import localised_fix


def _lr_switch(diag, run, ckpt, t, b, action, ck) -> dict:
    return {"variable": f"the LR of steps {t}.. (off its schedule)",
            "change": "keep the LR on optim.schedule: find what replaced it (a resume with another schedule, a "
                      "manual change, a scheduler that was not restored)",
            "override": f"intervene.kind=lr intervene.step={t}",
            "expect": f"record lr / schedule = 1 at step {t}; no update-ratio jump"}


def _state(diag, run, ckpt, t, b, action, ck) -> dict:
    from stability.signals import family
    spec = diag.anomaly is not None and diag.anomaly.kind == "spec"
    sig = family(diag.anomaly.quantity) if diag.anomaly and not spec else None
    # the moments the update of step T wrote: T = t when what deviated is the state after t's update (a recorded
    # state signal, or the optimizer check, which measures the state the update left)
    at = t if spec or (sig is not None and sig.role == "state") else t - 1
    override = f"intervene.kind=moments intervene.step={at}"
    if spec:  # the code that rewrote them is the fix; the intervention tests it as a config change
        return {**spec_fix(diag, run, ckpt, t, b, action, ck), "override": override}
    return {"variable": f"the optimizer state entering step {t}",
            "change": f"keep the moments the optimizer's own update wrote (undo what rewrote them after it; or restart "
                      f"from {ck}); audit what writes optimizer state between steps",
            "override": override, "expect": f"update ratio at step {t} within its baseline"}


def _settings(diag, run, ckpt, t, b, action, ck) -> dict:
    return {"variable": f"the optimizer's settings as the run used them from step {t} (param_groups: lr multiplier, "
                        "weight_decay, betas, eps)",
            "change": "print optimizer.param_groups at that step against config.yaml's optim; find what rewrote them "
                      "(a callback, a resume, a scheduler acting on the wrong key)", "override": None,
            "expect": "update ratios and ‖θ‖ per group on their trajectories"}


def _heavy_clipping(diag, run, ckpt, t, b, action, ck) -> dict:
    clip = (run.config.get("train") or {}).get("max_grad_norm")
    return {"variable": f"the clip threshold against the gradient's scale (train.max_grad_norm, {clip} in the config)",
            "change": "compare the threshold the step applied with the config, and the gradient norm with its "
                      "baseline: clipping on every step hides a recipe problem (LR, loss or gradient scale)",
            "override": None, "expect": "clip coefficient back at 1 on most steps"}


declare_class("optim.gradient_spike", "the gradient (and with it the update) moved first", localised_fix, dynamics=True)
declare_class("optim.lr_switch", "the LR left its schedule", _lr_switch)
declare_class("optim.state", "the update or the optimizer state jumped with a normal gradient and LR", _state,
              dynamics=True)
declare_class("optim.settings", "an optimizer setting changed without the config saying so (every layer's "
              "update, or the weights' decay)", _settings)
declare_class("optim.heavy_clipping", "the clip coefficient fell and stayed low: clipping hides a recipe problem",
              _heavy_clipping, dynamics=True)
declare_class("optim.gradient_mismatch", "the gradient is not the gradient of the step's own loss (its backward, a "
              "hook, the token normalisation)", spec_fix)
