"""The one single-variable fix of each fault class (docs/course.md §5: never "lower the LR until it stops"),
registered per class (doctor/classes.py names them; tests/test_signals.py checks every fault class has one).

    fix_for(diag, run, ckpt) -> {"variable", "change", "override", "expect"}

`override`: the config overrides (space-separated) that make the change on a rerun, or None when the fix is
not a config change; `python -m doctor RUN --verify` runs it from the state before the incident
(doctor/verify.py), and the regression command repeats the run's own command line with it.

A class without a fix of its own gets the hint its first quantity's Signal declares (stability/signals.py).
"""
from __future__ import annotations

from typing import Callable

from doctor.rules import Diagnosis
from doctor.timeline import Run
from stability.signals import family

FIXES: dict[str, Callable] = {}


def fix(*classes: str):
    def register(fn):
        for c in classes:
            if c in FIXES:
                raise ValueError(f"fix for {c!r} registered twice")
            FIXES[c] = fn
        return fn
    return register


def fix_for(diag: Diagnosis, run: Run, ckpt) -> dict:
    """One single-variable change that tests the diagnosis."""
    t, b, action = diag.step, diag.batch, (run.config.get("guard") or {}).get("action")
    ck = str(ckpt[1]) if ckpt else "<a checkpoint before the incident>"
    fn = FIXES.get(diag.fault_class)
    if fn is not None:
        return fn(diag, run, ckpt, t, b, action, ck)
    sig = family(diag.anomaly.quantity) if diag.anomaly else None
    return {"variable": sig.fix if sig else "the quantity that deviated first",
            "change": f"change only that and rerun from {ck}", "override": None,
            "expect": "the earliest anomaly gone, nothing else moved"}


@fix('data.corrupted_batch')
def _data_corrupted_batch(diag: Diagnosis, run: Run, ckpt, t, b, action, ck) -> dict:
    ids = f"samples [{b['first']}, {b['first'] + b['size']})"
    return {"variable": f"the batch of step {t} ({ids})",
            "change": f"quarantine it (the loader never serves it), then repair the data stage that produced it (the "
                      f"replay rebuilds {ids} from their ids: compare its input stats with the logged ones)",
            "override": f"train.skip_batches=[{b['first']}]",
            "expect": f"no second spike when the run reaches {ids} again; loss by source back on its trajectory"}


@fix('numerics.nonfinite')
def _numerics_nonfinite(diag: Diagnosis, run: Run, ckpt, t, b, action, ck) -> dict:
    return {"variable": f"the update of step {t} (non-finite in {diag.model_layer})",
            "change": "veto the non-finite update and keep the state; if the float64 replay is finite too, the "
                      "fault was transient (a kernel / device / injected event), not the state or the batch",
            "override": None if action in ("skip", "rollback") else "guard.action=skip",
            "expect": "no non-finite parameter or optimizer state after the step; the loss continues its "
                      "trajectory"}


@fix('optim.lr_switch')
def _optim_lr_switch(diag: Diagnosis, run: Run, ckpt, t, b, action, ck) -> dict:
    return {"variable": f"the LR of steps {t}.. (off its schedule)",
            "change": "keep the LR on optim.schedule: find what replaced it (a resume with another schedule, a "
                      "manual change, a scheduler that was not restored)",
            "override": f"intervene.kind=lr intervene.step={t}",
            "expect": f"record lr / schedule = 1 at step {t}; no update-ratio jump"}


@fix('optim.state')
def _optim_state(diag: Diagnosis, run: Run, ckpt, t, b, action, ck) -> dict:
    return {"variable": f"the optimizer state entering step {t}",
            "change": f"keep the moments the optimizer's own update wrote (undo what rewrote them after it; or restart "
                      f"from {ck}); audit what writes optimizer state between steps",
            "override": f"intervene.kind=moments intervene.step={t if diag.anomaly.quantity.startswith('state.') else t - 1}",
            "expect": f"update ratio at step {t} within its baseline"}


@fix('system.rank_divergence')
def _system_rank_divergence(diag: Diagnosis, run: Run, ckpt, t, b, action, ck) -> dict:
    return {"variable": f"the gradient reduction of step {t}",
            "change": "audit the collective (DDP comm hook, buckets, shard ownership, a bad device); compare "
                      "per-rank grad norms", "override": None,
            "expect": "replica spreads exactly 0 at every step"}


@fix('objective.mixture', 'data.switch')
def _objective_mixture(diag: Diagnosis, run: Run, ckpt, t, b, action, ck) -> dict:
    return {"variable": "the data mixture weights (data.sources[*].weight)",
            "change": "an objective change, not an optimisation fault: restore the old weights if the switch was "
                      "unintended, else re-baseline the guard and compare per-source losses with their floors",
            "override": None,
            "expect": "per-source losses on their trajectories; total loss at the new mixture floor"}


@fix('state.resume_fault')
def _state_resume_fault(diag: Diagnosis, run: Run, ckpt, t, b, action, ck) -> dict:
    q = diag.anomaly.quantity if diag.anomaly else "the loss"
    grp = q.split("/", 1)[1] if q.startswith("fingerprint/") else None
    part = (f"the {'data manifest' if grp == 'data' else f'config group {grp}'} (changed at the resume, not "
            f"declared in resume.allow_{'data' if grp == 'data' else 'config'}_change)" if grp else
            "the data cursor (loader samples_consumed)" if q.startswith(("continuity.", "ranks.")) else
            "the LR scheduler state" if q.startswith("lr/") else
            "the MoE balancing bias (a model buffer)" if "moe_bias" in q else
            "the optimizer moments (exp_avg / exp_avg_sq)" if q.startswith(("state.", "update_ratio")) else
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


@fix('data.distribution_shift')
def _data_distribution_shift(diag: Diagnosis, run: Run, ckpt, t, b, action, ck) -> dict:
    src = diag.source
    return {"variable": f"the data of source {src} from step {t}",
            "change": f"compare {src}'s documents before and after step {t} (generator / shard / preprocessing "
                      "version); restore the old ones or declare the change (a new data fingerprint)",
            "override": None, "expect": f"loss_by_source/{src} back on its trajectory"}


@fix('state.config_change')
def _state_config_change(diag: Diagnosis, run: Run, ckpt, t, b, action, ck) -> dict:
    grp = diag.anomaly.quantity.split("/", 1)[1]
    return {"variable": f"the {grp} config group (its fingerprint changed at step {t})",
            "change": "find what rewrote it mid-run; a change meant to happen belongs at a resume with "
                      "resume.allow_config_change listing the key", "override": None,
            "expect": "one fingerprint per config group for the whole run"}


@fix('data.continuity')
def _data_continuity(diag: Diagnosis, run: Run, ckpt, t, b, action, ck) -> dict:
    return {"variable": "the data cursor (sample ids per step)",
            "change": f"find what moved the loader's samples_consumed at step {t} (a repeated, skipped or "
                      "reset window); every id must be read once, in order", "override": None,
            "expect": f"batch.first of step {t} = batch.first + size of step {t - 1}"}


@fix('rank.data')
def _rank_data(diag: Diagnosis, run: Run, ckpt, t, b, action, ck) -> dict:
    return {"variable": f"the inputs of rank {diag.rank}",
            "change": f"compare rank {diag.rank}'s sample ids and local loss at step {t} with the sharding "
                      "(rank r reads ids [first + r·b, first + (r+1)·b)); fix its sampler / data path",
            "override": None, "expect": "per-rank first ids on the sharding; per-rank losses within their spread"}


@fix('system.slow_component')
def _system_slow_component(diag: Diagnosis, run: Run, ckpt, t, b, action, ck) -> dict:
    comp = diag.anomaly.quantity.split("/")[-1] if diag.anomaly else "?"
    return {"variable": f"the {comp} component of the step (from step {t})",
            "change": {"data": "profile the data path (loader, storage, decoding, workers) from that step",
                       "fwd_bwd": "profile forward/backward: shapes, routing load, recomputation, communication",
                       "optim": "profile the optimizer step and the guard / telemetry around it"}.get(comp, "profile it"),
            "override": None, "expect": f"{comp} time back to its share of the step"}


@fix('numerics.activation_outlier', 'optim.gradient_spike')
def _numerics_activation_outlier(diag: Diagnosis, run: Run, ckpt, t, b, action, ck) -> dict:
    return localised_fix(diag, run, ck)


@fix("numerics.mismatch", "numerics.precision", "optim.gradient_mismatch", "moe.routing", "moe.balancing",
     "state.continuity")
def spec_fix(diag: Diagnosis, run: Run, ckpt, t, b, action, ck) -> dict:
    """A failed specification check: the code that broke it is the fix, not a setting (its check names where)."""
    ev = (diag.judgement.evidence if diag.judgement else {}) or {}
    check, where = ev.get("check", "the check"), diag.model_layer or "the named place"
    return {"variable": f"the code behind {where} (check {check} failed at step {t})",
            "change": f"{diag.summary.split('. ', 1)[-1] if '. ' in diag.summary else diag.summary} Find what computes "
                      f"{where} other than its specification (a hook, a patched function, a kernel, a cast) and "
                      f"remove it; rerun from {ck}",
            "override": None, "expect": f"check {check} within its tolerance at step {t} and after"}


def localised_fix(diag: Diagnosis, run: Run, ck: str) -> dict:
    """The fix follows from the named model layer and quantity: a module upstream of the fault is never
    named (an embedding row's blow-up cannot be reached by the SwiGLU clamp)."""
    q, layer = diag.anomaly.quantity, diag.model_layer or "?"
    if diag.anomaly.kind == "spec":
        return spec_fix(diag, run, None, diag.step, diag.batch, None, ck)
    model = run.config.get("model") or {}
    if q.startswith(("act_rms", "clamp_hit_rate")) and layer.endswith(".mlp") and "swiglu_clamp" in model:
        cur = model.get("swiglu_clamp")
        return {"variable": f"the SwiGLU clamp bound of {layer} (model.swiglu_clamp, now {cur})",
                "change": f"lower it and rerun from {ck}; if the outlier persists, the input to {layer} grew: look "
                          "upstream", "override": f"model.swiglu_clamp={(cur or 100) / 2:g}" if cur else None,
                "expect": f"act_rms of {layer} within its baseline"}
    if q.startswith("act_rms") and layer == "emb":
        return {"variable": "the token-embedding rows the batch used",
                "change": f"find the rows whose norm grew (compare tok_emb.weight row norms in {ck} and after); "
                          "audit what writes them (a wrong update, weight tying, a load)", "override": None,
                "expect": "act_rms of emb within its baseline; no single row far above the others"}
    if q.startswith(("act_rms", "logit_max", "z_loss")):
        return {"variable": f"the output of {layer}",
                "change": f"replay the step (python -m doctor.replay) and compare {layer}'s output and weights "
                          f"with {ck}: the first module whose output grew is the one to fix", "override": None,
                "expect": f"act_rms of {layer} within its baseline"}
    if q.startswith(("grad_rms", "update_ratio")):
        return {"variable": f"the gradient of {layer}",
                "change": f"replay the step and compare {layer}'s gradient with its neighbours': a backward "
                          "hook, a loss term or a reduction that touches only that layer", "override": None,
                "expect": f"grad_rms of {layer} within its baseline"}
    clip = (run.config.get("train") or {}).get("max_grad_norm")
    return {"variable": f"the global-norm clip threshold (train.max_grad_norm, now {clip})",
            "change": f"lower it and rerun from {ck}", "override": f"train.max_grad_norm={clip / 2:g}" if clip else None,
            "expect": "the earliest anomaly gone, nothing else moved"}


@fix("data.slow_worsening")
def _data_slow_worsening(diag, run, ckpt, t, b, action, ck) -> dict:
    return {"variable": "the data mixture / duplication / mask of the recent data",
            "change": f"compare the recent batches' sources, duplicates and masks with the early ones; change only "
                      f"that and rerun from {ck}", "override": None,
            "expect": "the loss of the last third at or below the first third's"}


@fix("system.throughput")
def _system_throughput(diag, run, ckpt, t, b, action, ck) -> dict:
    return {"variable": "shapes, routing load, communication of the slow steps",
            "change": "profile a slow step against a fast one (bench/tools/profile_step.py)", "override": None,
            "expect": "tokens/s of the last third back at the first third's"}


@fix("data.repeated_batch")
def _data_repeated_batch(diag, run, ckpt, t, b, action, ck) -> dict:
    return {"variable": f"the data path after the loader from step {t} (it serves content already read)",
            "change": f"rebuild the batch of step {t} from its sample ids (python -m doctor.replay) and diff it with the "
                      "content the run trained on; find the cache, buffer or worker that returns a stale batch",
            "override": None, "expect": "every step's content hash new; train and eval loss falling together"}


@fix("forward.below_floor")
def _forward_below_floor(diag, run, ckpt, t, b, action, ck) -> dict:
    return {"variable": "what the model can see of its targets (the causal mask, the labels' shift, eval/train "
                        "overlap)",
            "change": f"replay step {t} and check that no output depends on a later input position (perturb a "
                      "future token: an earlier logit must not move); check labels[t] = tokens[t+1] and that no "
                      "target reaches the input", "override": None,
            "expect": "train and eval loss by source at or above their exact floors"}


@fix("moe.load_collapse")
def _moe_load_collapse(diag, run, ckpt, t, b, action, ck) -> dict:
    layer = diag.model_layer or "the MoE layer"
    return {"variable": f"the router of {layer}",
            "change": f"compare {layer}'s router logits and balancing bias at step {t} with {ck}: a forced route, a "
                      "router weight blow-up or a bias that stopped updating (model.moe balance settings)",
            "override": None, "expect": f"{layer}'s effective number of experts back at its baseline"}


@fix("moe.dead_expert")
def _moe_dead_expert(diag, run, ckpt, t, b, action, ck) -> dict:
    layer = diag.model_layer or "the MoE layer"
    return {"variable": f"the expert of {layer} whose output vanished (record moe.{layer[3:]}.out_rms)",
            "change": f"compare that expert's weights at step {t} with {ck}: zeroed or detached weights, a mask or "
                      "a hook on its output", "override": None,
            "expect": f"every expert of {layer} with an output RMS near the layer's median"}


@fix("optim.settings")
def _optim_settings(diag, run, ckpt, t, b, action, ck) -> dict:
    return {"variable": f"the optimizer's settings as the run used them from step {t} (param_groups: lr multiplier, "
                        "weight_decay, betas, eps)",
            "change": "print optimizer.param_groups at that step against config.yaml's optim; find what rewrote them "
                      "(a callback, a resume, a scheduler acting on the wrong key)", "override": None,
            "expect": "update ratios and ‖θ‖ per group on their trajectories"}


@fix("optim.heavy_clipping")
def _optim_heavy_clipping(diag, run, ckpt, t, b, action, ck) -> dict:
    clip = (run.config.get("train") or {}).get("max_grad_norm")
    return {"variable": f"the clip threshold against the gradient's scale (train.max_grad_norm, {clip} in the config)",
            "change": "compare the threshold the step applied with the config, and the gradient norm with its "
                      "baseline: clipping on every step hides a recipe problem (LR, loss or gradient scale)",
            "override": None, "expect": "clip coefficient back at 1 on most steps"}


@fix("numerics.attention_logits")
def _numerics_attention_logits(diag, run, ckpt, t, b, action, ck) -> dict:
    layer = diag.model_layer or "the attention block"
    model = run.config.get("model") or {}
    return {"variable": f"the attention logits of {layer}",
            "change": f"bound them (QK-norm or QK-clip) and rerun from {ck}; then find what grew q·k",
            "override": None if model.get("qk_norm") else "model.qk_norm=true",
            "expect": f"attn_logit_max of {layer} within its baseline"}


@fix("forward.loss_spike")
def _forward_loss_spike(diag, run, ckpt, t, b, action, ck) -> dict:
    ids = f"samples [{b['first']}, {b['first'] + b['size']})"
    return {"variable": f"the batch of step {t} ({ids}) against the state that met it",
            "change": f"replay step {t} (python -m doctor.replay) with its batch and with a neighbouring one: the batch "
                      "if only it spikes, the state if both do", "override": None,
            "expect": f"loss at step {t} within its baseline"}
