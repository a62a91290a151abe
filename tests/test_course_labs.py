"""The course corrections' arms (issue 19): each shows its effect with seed 7, and loses it when the
mechanism it demonstrates is removed. (The labs' full quick runs are in tests/test_labs_claims.py.)"""
from __future__ import annotations

import statistics

import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR

from labs.claims import clip_always, rho_early
from labs.common import single_thread

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_clip_always_adam_update_size_ignores_the_clip_and_sgd_does_not(monkeypatch):
    with single_thread():
        on, off = (clip_always.train(7, clip_always.HIGH_LR, 20, m) for m in (clip_always.MAX_NORM, None))
    assert on["median_coef"] < 0.5 and off["clipped_fraction"] == 0.0
    assert 0.7 <= on["median_update"] / off["median_update"] <= 1.4  # Adam: ~lr whatever the clip
    # remove Adam's normalisation: under SGD the update shrinks with the clip coefficient
    sgd = lambda model, lr, steps=1: (lambda o: (o, LambdaLR(o, lambda s: 1.0)))(torch.optim.SGD(model.parameters(), lr=1e-2))
    monkeypatch.setattr(clip_always, "make_optimizer", sgd)
    with single_thread():
        on, off = (clip_always.train(7, clip_always.HIGH_LR, 20, m) for m in (0.1, None))
    assert on["median_update"] / off["median_update"] < 0.7


def test_rho_early_names_the_one_faulty_layer_and_only_while_it_is_faulty():
    with single_thread():
        bad = rho_early.train_layer_fault(7, "block1.attn", rho_early.FAULT, rho_early.FAULT_START, 16)
        none = rho_early.train_layer_fault(7, "block1.attn", 1.0, rho_early.FAULT_START, 16)
    alarms = {k: rho_early.alarm_step(v) for k, v in bad["rho_layers"].items()}
    assert {k for k, s in alarms.items() if s} == {"block1.attn"} and alarms["block1.attn"] == rho_early.FAULT_START
    assert rho_early.alarm_step(bad["rho_whole"]) is None and len(set(bad["lr"])) == 1
    assert all(rho_early.alarm_step(v) is None for v in none["rho_layers"].values())
    # the faulty layer's ρ is FAULT× its own early level; the whole model's rises far less
    rise = bad["rho_layers"]["block1.attn"][rho_early.FAULT_START - 1] / statistics.median(bad["rho_layers"]["block1.attn"][:5])
    assert rise > 5 and max(bad["rho_whole"]) / statistics.median(bad["rho_whole"][:5]) < rise / 2
    with pytest.raises(ValueError, match="fault_layer='block9.mlp'"):
        rho_early.train_layer_fault(7, "block9.mlp", 2.0, 1, 1)


@pytest.mark.slow  # the held-out check itself runs in tests/test_labs_gradients.py's quick lab run
def test_gradients_headline_is_held_out_and_vanishes_without_the_mask_bug(monkeypatch):
    from labs import gradients

    gen = torch.Generator().manual_seed(7)
    with single_thread():
        _, s = gradients.mask_bug_lesson(7, gradients.LESSON_STEPS, 4, gen, 256)
    h = s["heldout"]
    assert h["samples"] == 256 and h["bug_excess"] + 3 * h["bug_se"] < 0 < h["correct_excess"] - 3 * h["correct_se"]
    # without the bug both objectives are the same, and neither goes below the floor
    monkeypatch.setattr(gradients, "pad_targets", lambda labels: labels)
    with single_thread():
        _, s = gradients.mask_bug_lesson(7, gradients.LESSON_STEPS, 4, gen, 256)
    h = s["heldout"]
    assert h["bug_excess"] == h["correct_excess"] > 0


@pytest.mark.sweep
def test_anticipatory_lab_compares_on_and_off_and_fails_without_the_mechanism(tmp_path):
    from labs import anticipatory_ablation as anticipatory

    r = anticipatory.run(7, quick=True)
    assert r["ok"], r["table"]
    on, off = r["arms"]["on"], r["arms"]["off"]
    assert on["delays_served"] and max(on["delays_served"]) == r["delay"] and off["on_steps"] == 0
    assert "V4's claimed recovery benefit at this scale" in r["table"]
    anticipatory.plot(r, tmp_path / "a.png")
    assert (tmp_path / "a.png").stat().st_size > 5000
    r = anticipatory.run(7, quick=True, enabled=False)  # both arms off: nothing stale was served
    assert not r["ok"] and not r["checks"][f"on-arm: anticipatory routing ran after its rollback and served "
                                           f"Δt = {r['delay']} stale routes"]
