"""The small claim labs (labs/claims/): each shows its effect with seed 7 (quick sizes), and reports
it absent (ok false) when the repository piece it demonstrates is broken or the effect is switched off."""
from __future__ import annotations

import dataclasses
import json
import math
import sys

import pytest
import torch
import torch.nn.functional as F

from labs import LABS
from labs import run as labs_run
from labs.claims import (clip_always, clip_unscale, microbatch_mean, resume_jump, rho_early, shard_norm,
                         swiglu_clamp, zloss)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
CLAIMS = ("microbatch_mean", "shard_norm", "clip_unscale", "swiglu_clamp", "resume_jump", "zloss", "clip_always",
          "rho_early")


def passes(lab, tmp_path, **kw) -> dict:
    """run(7, quick) shows the effect; the result is JSON as labs.run saves it; plot writes a PNG."""
    r = lab.run(7, quick=True, **kw)
    assert r["ok"] and all(r["checks"].values()), r["table"]
    assert "[ok]" in r["table"] and "FAIL" not in r["table"]
    json.loads(json.dumps(r, default=float))
    lab.plot(r, tmp_path / "lab.png")
    assert (tmp_path / "lab.png").stat().st_size > 5000
    return r


def fails(lab, *failing: str, **kw) -> dict:
    """run(7, quick) reports the effect absent, and the named checks (by key prefix) are the ones that fail."""
    r = lab.run(7, quick=True, **kw)
    assert not r["ok"], r["table"]
    failed = [k for k, v in r["checks"].items() if not v]
    for prefix in failing:
        assert any(k.startswith(prefix) for k in failed), (prefix, failed)
    return r


def test_every_claim_lab_is_registered_with_a_title():
    for name in CLAIMS:
        assert LABS[name] == f"labs.claims.{name}"
        mod = sys.modules[LABS[name]]
        assert mod.TITLE.startswith(f"{name}: ")




# ---- 1. microbatch_mean --------------------------------------------------------------------------

def test_microbatch_mean_token_normalisation_matches_full_batch(tmp_path):
    r = passes(microbatch_mean, tmp_path)
    assert r["rel_err_token_norm"] <= 1e-6 < 1e-3 < r["rel_err_mean_of_means"]
    n_mb, M, N = r["valid_tokens_by_micro_batch"], r["micro_batches"], r["total_valid_tokens"]
    assert sum(n_mb) == N == sum(r["valid_tokens_by_sample"])
    for w in r["token_weights"].values():  # the weights are the two normalisers, per token
        assert w["token_norm"] == pytest.approx(1 / N)
        assert w["mean_of_means"] == pytest.approx(1 / (M * n_mb[w["micro_batch"]]))


def test_microbatch_mean_fails_on_equal_lengths_and_on_a_padded_count(monkeypatch):
    fails(microbatch_mean, "micro-batches hold unequal", "mean of micro-batch means differs", equal_lengths=True)
    # a count that includes padding positions: the "token-normalised" gradient is then scaled wrong
    monkeypatch.setattr(microbatch_mean, "count_valid_tokens", lambda mbs, device: torch.tensor(
        [float(sum(mb.tokens.numel() for mb in mbs))], dtype=torch.float64))
    fails(microbatch_mean, "token-normalised accumulated grad")


# ---- 2. shard_norm -------------------------------------------------------------------------------

def test_shard_norm_local_differs_and_the_clip_rule_is_global(tmp_path):
    r = passes(shard_norm, tmp_path)
    g = r["global_norm"]
    for p in r["partitions"].values():
        assert math.hypot(*p["local_norm"]) == pytest.approx(g, rel=1e-6)  # squares add, norms do not
        assert p["sum_of_norms"] > g * 1.01
    assert r["replicated_allreduce_norm"] == pytest.approx(math.sqrt(2) * g, rel=1e-6)
    assert r["global_coef"] == pytest.approx(shard_norm.C_FRACTION, rel=1e-5)


def test_shard_norm_fails_with_one_rank_and_with_norms_all_reduced(monkeypatch):
    fails(shard_norm, "every rank's local norm differs", "some rank's local clip", world=1)
    from optim import clip
    # the classic bug: reduce each rank's *norm* instead of its sum of squares
    monkeypatch.setattr(clip, "_sum_of_squares", lambda ts, device: torch.stack(
        [t.float().norm() for t in ts]).sum() if ts else torch.zeros((), device=device))
    fails(shard_norm, "clip.py rule")


# ---- 3. clip_unscale -----------------------------------------------------------------------------

def test_clip_unscale_step_order_gives_the_true_coefficient(tmp_path):
    r = passes(clip_unscale, tmp_path)
    assert r["expected_coef"] == pytest.approx(0.5, rel=1e-5)
    big = r["rows"][-1]
    assert big["scale"] == 2.0**16 and big["clip_first_coef"] == pytest.approx(0.5 / 2**16, rel=1e-3)


def test_clip_unscale_fails_without_scaling_and_when_unscale_is_lost(monkeypatch):
    fails(clip_unscale, "clip-first coefficient", scales=(1.0,))
    from optim.scaler import DynamicLossScaler
    monkeypatch.setattr(DynamicLossScaler, "unscale_", lambda self, params: None)
    fails(clip_unscale, "precision/step.py order: coefficient")


# ---- 4. swiglu_clamp -----------------------------------------------------------------------------

def test_swiglu_clamp_through_labs_run_zero_gradient_past_the_bound(tmp_path, capsys):
    assert labs_run.main(["--experiment", "swiglu_clamp", "--seed", "7", "--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "clamp hit rate" in out and "expected effect present" in out and "FAIL" not in out
    assert (tmp_path / "swiglu_clamp.png").stat().st_size > 5000
    r = json.loads((tmp_path / "result.json").read_text())
    assert r["ok"] and all(r["checks"].values())
    by_point = {(p["gate"], p["up"]): p for p in r["points"]}
    assert by_point[(15.0, 5.0)]["dgate"] == 0 != by_point[(15.0, 5.0)]["dgate_free"]
    assert by_point[(5.0, -15.0)]["dup"] == 0 != by_point[(5.0, -15.0)]["dup_free"]
    assert by_point[(5.0, 5.0)]["y"] == by_point[(5.0, 5.0)]["y_free"]
    rates = [s["hit_rate"] for s in r["module_sweep"]]
    assert rates[0] == 0 and rates[-1] > 0.5 and rates == sorted(rates)


def test_swiglu_clamp_fails_with_a_straight_through_clamp(monkeypatch):
    import model.swiglu as sw

    def straight_through(gate, up, limit):  # clamped forward, unclamped gradient
        free = F.silu(gate) * up
        return free if limit is None else free + (F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit) - free).detach()

    monkeypatch.setattr(sw, "swiglu", straight_through)
    r = fails(swiglu_clamp, "∂/∂gate = 0", "∂/∂up = 0", "SwiGLU module: clamp hits")
    assert r["checks"]["forward identical inside the bound (gate <= L, |up| <= L)"]


# ---- 5. resume_jump ------------------------------------------------------------------------------

def test_resume_jump_correct_resume_is_identical_and_wrong_ones_jump(tmp_path):
    r = passes(resume_jump, tmp_path)
    d, A = r["runs"]["with_dropout"], r["saved_at"]
    assert d["correct"]["loss"] == d["continuous"]["loss"][A:]  # bit-identical
    assert d["cursor_reset"]["first_sample"] == [i * 8 for i in range(r["steps"] - A)]  # replays from id 0
    assert not r["rng_matters_stock"]  # honest: the stock step draws no random numbers


def test_resume_jump_fails_when_the_checkpoint_loses_the_rng(monkeypatch):
    from checkpoint import rng
    monkeypatch.setattr(rng, "restore", lambda state: None)
    fails(resume_jump, "correct resume")


def test_resume_jump_optimizer_and_scheduler_arms_fail_when_their_reset_is_removed(monkeypatch):
    """The two arms measure their own state: with the reset taken out (each resumes correctly), exactly
    their checks fail, so the lab cannot pass on an effect it does not produce."""
    real = resume_jump.resumed

    def without_reset(seed, steps, path, dropout, variant):
        return real(seed, steps, path, dropout, "correct" if variant.endswith("_reset") and
                    variant != "cursor_reset" else variant)

    monkeypatch.setattr(resume_jump, "resumed", without_reset)
    r = fails(resume_jump, "optimizer reset", "scheduler reset")
    failed = {k.split(":")[0] for k, v in r["checks"].items() if not v}
    assert failed == {"optimizer reset", "scheduler reset"}, failed


@pytest.mark.sweep
def test_resume_jump_fails_without_a_random_draw_in_the_step():
    fails(resume_jump, "RNG not restored", dropout=0.0)


# ---- 6. zloss ------------------------------------------------------------------------------------

def test_zloss_bounds_log_z_and_keeps_the_ce(tmp_path):
    r = passes(zloss, tmp_path)
    base, top = r["runs"][0], r["runs"][-1]
    assert base["z_coef"] == 0 < top["z_coef"]
    assert base["eval"]["lse_rms"] > math.log(35)  # it drifted above its init (log vocab) without z-loss


@pytest.mark.sweep
def test_zloss_fails_when_the_z_term_carries_no_gradient(monkeypatch):
    import model.transformer as tr
    orig = tr.token_losses
    monkeypatch.setattr(tr, "token_losses", lambda logits, labels: dataclasses.replace(
        orig(logits, labels), z_sum=orig(logits, labels).z_sum.detach()))
    fails(zloss, "z = 0.01: eval RMS")


# ---- 7. clip_always ------------------------------------------------------------------------------

def test_clip_always_flags_the_too_high_lr(tmp_path):
    r = passes(clip_always, tmp_path)
    t, h = r["runs"]["too_high"], r["runs"]["healthy"]
    assert t["clipped_fraction"] > 0.9 > h["clipped_fraction"] and t["median_coef"] < h["median_coef"]
    assert clip_always.clipped_always([0.5] * 10) and not clip_always.clipped_always([0.5] * 9 + [1.0])


def test_clip_always_fails_when_both_runs_are_healthy():
    fails(clip_always, "too-high LR run flagged", high_lr=clip_always.HEALTHY_LR)


# ---- 8. rho_early --------------------------------------------------------------------------------

def test_rho_early_alarm_precedes_the_blow_up(tmp_path):
    r = passes(rho_early, tmp_path)
    p = r["pushed"]
    assert p["alarm_step"] + rho_early.LEAD_MIN <= p["blowup_step"]
    assert set(p["rho_layers"]) >= {"emb", "block0.attn", "block0.mlp", "norm"}
    assert rho_early.alarm_step([1.0] * 5 + [4.9, 5.1]) == 7 and rho_early.alarm_step([1.0] * 5 + [math.nan]) == 6
    assert rho_early.blowup_step([2.0, 19.0, 21.0]) == 3 and rho_early.blowup_step([2.0, math.inf]) == 2


def test_rho_early_fails_when_nothing_is_pushed():
    fails(rho_early, "pushed run blows up", ramp=1.0)
