"""The state classes: a resume, the config, the state between steps, and an MoE layer's routing (and their fixes)."""
from __future__ import annotations

from doctor.classes import declare_class, spec_fix


def _resume_fault(diag, run, ckpt, t, b, action, ck) -> dict:
    from stability.signals import family
    d = diag.anomaly
    sig = family(d.quantity) if d is not None else None
    role = sig.role if sig is not None else None
    q = d.quantity if d is not None else "the loss"
    grp = d.quantity.split("/", 1)[1] if d is not None and d.cls == "state.config_change" else None
    part = (f"the {'data manifest' if grp == 'data' else f'config group {grp}'} (changed at the resume, not "
            f"declared in resume.allow_{'data' if grp == 'data' else 'config'}_change)" if grp else
            "the data cursor (loader samples_consumed)" if d is not None and d.cls in ("data.continuity", "rank.data") else
            "the LR scheduler state" if role == "schedule" else
            "the MoE balancing bias (a model buffer)" if d is not None and "moe_bias" in d.quantity else
            "the optimizer moments (exp_avg / exp_avg_sq)" if role in ("state", "update") else
            "the resumed state (optimizer / scheduler / RNG / data cursor)")
    if grp:
        return {"variable": f"{part} at the resume of step {t}",
                "change": "resume with the checkpoint's config; if the change is meant, list the changed key in "
                          f"resume.allow_{'data' if grp == 'data' else 'config'}_change (the resume check then "
                          "logs it) — and find what let the resume through without its check",
                "override": None, "expect": f"{q} equal before and after the resume, or a declared change"}
    return {"variable": f"{part}, as the resume at step {t} loaded it ({q} left its baseline)",
            "change": "prove the resume: python -m checkpoint.verify with the run's config, then audit what "
                      f"loads or rewrites {part} after the checkpoint is read",
            "override": None, "expect": f"straight and resumed runs agree step for step; {q} continuous at step {t}"}


def _config_change(diag, run, ckpt, t, b, action, ck) -> dict:
    grp = diag.anomaly.quantity.split("/", 1)[-1]
    return {"variable": f"the {grp} config group (its fingerprint changed at step {t})",
            "change": "find what rewrote it mid-run; a change meant to happen belongs at a resume with "
                      "resume.allow_config_change listing the key", "override": None,
            "expect": "one fingerprint per config group for the whole run"}


def _load_collapse(diag, run, ckpt, t, b, action, ck) -> dict:
    layer = diag.model_layer or "the MoE layer"
    return {"variable": f"the router of {layer}",
            "change": f"compare {layer}'s router logits and balancing bias at step {t} with {ck}: a forced route, a "
                      "router weight blow-up or a bias that stopped updating (model.moe balance settings)",
            "override": None, "expect": f"{layer}'s effective number of experts back at its baseline"}


def _dead_expert(diag, run, ckpt, t, b, action, ck) -> dict:
    layer = diag.model_layer or "the MoE layer"
    return {"variable": f"the expert of {layer} whose output vanished (record moe.{layer[3:]}.out_rms)",
            "change": f"compare that expert's weights at step {t} with {ck}: zeroed or detached weights, a mask or "
                      "a hook on its output", "override": None,
            "expect": f"every expert of {layer} with an output RMS near the layer's median"}


declare_class("state.resume_fault", "the resumed state is not the saved one", _resume_fault,
              ("jump right after resume (resume 后立即跳变)", "optimizer / scheduler state, RNG, data cursor",
               "a new data distribution"))
declare_class("state.config_change", "the run's config changed without a resume declaring it", _config_change)
declare_class("state.continuity", "a step started from another state than the previous step left", spec_fix)
declare_class("moe.routing", "an MoE layer's experts or gates are not its router's definition", spec_fix)
declare_class("moe.balancing", "an MoE layer's balancing bias or loss did not follow its rule", spec_fix)
declare_class("moe.load_collapse", "an MoE layer's routing collapsed onto a few experts", _load_collapse)
declare_class("moe.dead_expert", "an expert's output vanished while its routing stayed", _dead_expert)
