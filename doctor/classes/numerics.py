"""The forward and numerics classes: activations, logits, the loss, non-finite values, a layer that computes or
rounds otherwise than its specification (and their fixes)."""
from __future__ import annotations

from doctor.classes import batch_ids, declare_class, spec_fix
from doctor.levers import OCTAVE


def localised_fix(diag, run, ckpt, t, b, action, ck) -> dict:
    """The fix follows from the named model layer and the quantity's role: a module upstream of the fault is never
    named (an embedding row's blow-up cannot be reached by the SwiGLU clamp)."""
    from stability.signals import family
    if diag.anomaly.kind == "spec":
        return spec_fix(diag, run, ckpt, t, b, action, ck)
    sig = family(diag.anomaly.quantity)
    role, layer = (sig.role if sig else None), diag.model_layer or "?"
    model = run.config.get("model") or {}
    if role == "activation" and layer.endswith(".mlp") and "swiglu_clamp" in model:
        cur = model.get("swiglu_clamp")
        return {"variable": f"the SwiGLU clamp bound of {layer} (model.swiglu_clamp, now {cur})",
                "change": f"lower it and rerun from {ck}; if the outlier persists, the input to {layer} grew: look "
                          "upstream", "override": f"model.swiglu_clamp={cur / OCTAVE:g}" if cur else None,
                "expect": f"the activation RMS of {layer} within its baseline"}
    if role == "activation" and layer == "emb":
        return {"variable": "the token-embedding rows the batch used",
                "change": f"find the rows whose norm grew (compare tok_emb.weight row norms in {ck} and after); "
                          "audit what writes them (a wrong update, weight tying, a load)", "override": None,
                "expect": "the activation RMS of emb within its baseline; no single row far above the others"}
    if role in ("activation", "logits"):
        return {"variable": f"the output of {layer}",
                "change": f"replay the step (python -m doctor.replay) and compare {layer}'s output and weights "
                          f"with {ck}: the first module whose output grew is the one to fix", "override": None,
                "expect": f"the activation RMS of {layer} within its baseline"}
    if role in ("gradient", "update") and diag.model_layer:
        return {"variable": f"the gradient of {layer}",
                "change": f"replay the step and compare {layer}'s gradient with its neighbours': a backward "
                          "hook, a loss term or a reduction that touches only that layer", "override": None,
                "expect": f"the gradient RMS of {layer} within its baseline"}
    clip = (run.config.get("train") or {}).get("max_grad_norm")
    return {"variable": f"the global-norm clip threshold (train.max_grad_norm, now {clip})",
            "change": f"lower it and rerun from {ck}", "override": f"train.max_grad_norm={clip / OCTAVE:g}" if clip else None,
            "expect": "the earliest anomaly gone, nothing else moved"}


def _nonfinite(diag, run, ckpt, t, b, action, ck) -> dict:
    return {"variable": f"the update of step {t} (non-finite in {diag.model_layer})",
            "change": "veto the non-finite update and keep the state; if the float64 replay is finite too, the "
                      "fault was transient (a kernel / device / injected event), not the state or the batch",
            "override": None if action in ("skip", "rollback") else "guard.action=skip",
            "expect": "no non-finite parameter or optimizer state after the step; the loss continues its "
                      "trajectory"}


def _attention_logits(diag, run, ckpt, t, b, action, ck) -> dict:
    layer = diag.model_layer or "the attention block"
    model = run.config.get("model") or {}
    return {"variable": f"the attention logits of {layer}",
            "change": f"bound them (QK-norm or QK-clip) and rerun from {ck}; then find what grew q·k",
            "override": None if model.get("qk_norm") else "model.qk_norm=true",
            "expect": f"the attention logit max of {layer} within its baseline"}


def _loss_spike(diag, run, ckpt, t, b, action, ck) -> dict:
    ids = batch_ids(b)
    return {"variable": f"the batch of step {t} ({ids}) against the state that met it",
            "change": f"replay step {t} (python -m doctor.replay) with its batch and with a neighbouring one: the batch "
                      "if only it spikes, the state if both do", "override": None,
            "expect": f"loss at step {t} within its baseline"}


def _below_floor(diag, run, ckpt, t, b, action, ck) -> dict:
    return {"variable": "what the model can see of its targets (the causal mask, the labels' shift, eval/train "
                        "overlap)",
            "change": f"replay step {t} and check that no output depends on a later input position (perturb a "
                      "future token: an earlier logit must not move); check labels[t] = tokens[t+1] and that no "
                      "target reaches the input", "override": None,
            "expect": "train and eval loss by source at or above their exact floors"}


declare_class("numerics.nonfinite", "a non-finite value", _nonfinite, ("one-step NaN (单步突然 NaN)",
              "the current batch, loss scale, reductions and kernels", "an LR that is too large in general"))
# NOTE: the spike classes are what a clean run also shows as it learns: each is judged by what the run did after it
# (doctor/judge.py: natural, a recipe instability, or — without a check to say the step was right — a fault)
declare_class("numerics.activation_outlier", "an activation moved first", localised_fix, dynamics=True)
declare_class("numerics.attention_logits", "an attention block's logits grew first", _attention_logits, dynamics=True)
declare_class("forward.loss_spike", "the loss rose first with normal inputs and settings", _loss_spike, dynamics=True)
declare_class("forward.below_floor", "the loss fell below the exact floor: the model sees what it predicts",
              _below_floor)
declare_class("numerics.mismatch", "a layer computes another function than its specification (a kernel, a hook, "
              "a module)", spec_fix)
declare_class("numerics.precision", "a layer rounds coarser than its precision recipe says (a cast, a kernel)",
              spec_fix)
