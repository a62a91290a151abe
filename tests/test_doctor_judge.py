"""The doctor judges what it finds (issues 26, 36): an incident is an execution fault, the run's own behaviour
(natural: it recovered, nothing lasting) or the recipe's instability (a conforming run that took lasting damage),
the headline is the first fault else the first instability, and the classes it could not see before — each on
synthetic records (tests/test_doctor.py fake_run), where the answer is known and the opposite case is one edit away.
"""
from __future__ import annotations

import json
import random

import pytest

from test_doctor import fake_run
from doctor.cli import doctor

T0 = 70


def learning_onset(t, r, at=T0):
    """Source a sits on a plateau (3.4) until `at`, then falls towards 2.0 (an induction head forming)."""
    if t >= at:
        drop = min(1.4, 0.05 * (t - at))
        r["loss_by_source"]["a"] += 1.4 - drop
    else:
        r["loss_by_source"]["a"] += 1.4
    r["loss"] = sum(r["loss_by_source"].values()) / 2


def spike(t, r, at=T0):
    if t == at:
        r["grad_norm"] *= 12
        r["loss"] += 1.0
        r["loss_by_source"] = {k: v + 1.0 for k, v in r["loss_by_source"].items()}


def conforming(r):
    """The record of a step whose specification checks all ran and passed (record v5 `spec`)."""
    r["spec"] = {"miss": {"data": 0.1, "optimizer": 0.2}, "fail": [], "ref_err": {}}


LEVER_KEYS = ("optim.lr", "optim.schedule.warmup_steps", "train.max_grad_norm", "train.z_loss", "optim.qk_clip.tau",
              "model.qk_norm", "precision")


@pytest.mark.parametrize("learning", [False, True])
@pytest.mark.parametrize("damage", [False, True])
def test_a_conforming_spike_is_natural_unless_damage_lasts(tmp_path, damage, learning):
    """The same gradient + loss spike under steps that pass their specification checks: natural when everything
    returns — at a learning transition or not, coincidence decides nothing — and a recipe instability, fixed with a
    recipe lever, when source b's loss holds +0.5 above where it was for the rest of the run (lasting damage)."""
    def tweak(t, r):
        conforming(r)
        if learning:
            learning_onset(t, r)
        spike(t, r)
        if damage and t > T0:
            r["loss_by_source"]["b"] += 0.5
            r["loss"] = sum(r["loss_by_source"].values()) / 2
    rep = doctor(fake_run(tmp_path, n=140, tweak=tweak), plots=False)
    inc = [i for i in rep["incidents"] if i["step"] == T0]
    assert inc, rep["incidents"]
    if damage:
        assert inc[0]["judgement"] == "instability", inc[0]
        assert rep["class"] == "recipe.instability" and rep["earliest"]["step"] == T0, rep["summary"]
        assert "lasting damage" in inc[0]["reason"] and "loss_by_source/b" in inc[0]["reason"], inc[0]["reason"]
        assert rep["fix"]["override"] and rep["fix"]["override"].split("=")[0] in LEVER_KEYS, rep["fix"]
    else:
        assert inc[0]["judgement"] == "natural", inc[0]
        assert "every step conformed" in inc[0]["reason"], inc[0]["reason"]
        assert rep["class"] == "healthy" and rep["earliest"] is None and rep["fix"] is None, rep["summary"]
        md = (tmp_path / "report.md").read_text()
        assert "Natural incidents" in md and "Verdict: healthy" in md


@pytest.mark.parametrize("flagged", [False, True])
def test_a_natural_spike_says_which_checks_did_not_look_at_its_step(tmp_path, flagged):
    """A reference check (here: forward) runs every 10 steps, and on a step the guard flagged: a spike it did not
    look at is natural on the checks that ran, and the reason names the one that did not; looked at, every step
    conformed."""
    def tweak(t, r):
        conforming(r)
        if t % 10 == 0 or (flagged and t == T0 + 3):
            r["spec"]["miss"]["forward"] = 0.03
        spike(t, r, at=T0 + 3)
    rep = doctor(fake_run(tmp_path, n=140, tweak=tweak), plots=False)
    inc = [i for i in rep["incidents"] if i["step"] == T0 + 3]
    assert inc and inc[0]["judgement"] == "natural", rep["incidents"]
    named = f"forward did not run at step {T0 + 3}" in inc[0]["reason"]
    assert named != flagged and ("every step conformed" in inc[0]["reason"]) == flagged, inc[0]["reason"]


@pytest.mark.parametrize("recurring", [False, True, "after a fault"])
def test_a_loss_that_spikes_again_and_again_is_a_recipe_instability(tmp_path, recurring):
    """Conforming steps, two sources: one loss spike that returns is natural; four of them (more than the run's
    sources can each spike once as its circuit forms) are the recipe spiking again and again — unless the three
    after the first come after a check failed (one rank's LR off from step 90 on): those are the fault's, and the
    first spike stays natural beside the fault's headline."""
    at = (70, 100, 130, 160) if recurring else (70,)

    def tweak(t, r):
        conforming(r)
        if recurring == "after a fault" and t >= 90:
            r["spec"]["fail"] = [{"check": "lr", "kind": "rank", "class": "system.rank_divergence", "layer": "system",
                                  "where": "no_decay", "rank": 1, "err": 2e-3, "tol": 2e-15, "miss": 1e12,
                                  "fix": "every rank's optimizer on the schedule", "series": None}]
        for a in at:
            spike(t, r, at=a)
    rep = doctor(fake_run(tmp_path, n=200, tweak=tweak), plots=False)
    got = [(i["step"], i["judgement"]) for i in rep["incidents"]]
    if recurring == "after a fault":
        assert rep["class"] == "system.rank_divergence" and rep["earliest"]["step"] == 90, (rep["summary"], got)
        assert (70, "natural") in got and "instability" not in {j for _, j in got}, got
    elif recurring:
        assert rep["class"] == "recipe.instability" and rep["earliest"]["step"] == 70, (rep["summary"], got)
        assert "again and again" in rep["summary"]
    else:
        assert rep["class"] == "healthy" and got == [(70, "natural")], got


def test_a_check_that_fails_again_at_its_place_after_steps_that_held_is_one_incident(tmp_path):
    """The prefix check fails at block0.mlp (scaled) on some steps from 90 on and holds on the others (a fault that
    spares some rows: the check's row takes them in turn): one fault, at 90, not one a stretch; a failure at another
    place (block1.attn from 120) is an incident of its own."""
    def fail(where, kind="scaled"):
        return {"check": "prefix", "kind": kind, "class": "numerics.activation_outlier", "layer": "forward",
                "where": where, "rank": 0, "err": 1.0, "tol": 1e-4, "miss": 1e4, "fix": "", "series": None,
                "family": "forward"}

    def tweak(t, r):
        conforming(r)
        if t >= 90 and t % 4 != 3:
            r["spec"]["fail"] = [fail("block0.mlp")]
        if t == 120:
            r["spec"]["fail"] = [fail("block1.attn")]
    rep = doctor(fake_run(tmp_path, n=140, tweak=tweak), plots=False)
    faults = [(i["step"], i["model_layer"]) for i in rep["incidents"] if i["judgement"] == "fault"]
    assert rep["earliest"]["step"] == 90 and faults == [(90, "block0.mlp"), (120, "block1.attn")], (rep["summary"],
                                                                                                   faults)


def test_a_fault_behind_a_natural_incident_is_the_headline(tmp_path):
    """A natural spike at the transition (70), then one layer's activation ×6 from step 85 on: the headline
    is the fault at 85, not the first incident; the natural one is listed with its reason."""
    def tweak(t, r):
        learning_onset(t, r)
        spike(t, r)
        if t >= 85:
            r["layers"]["emb"]["act_rms"] *= 6
    rep = doctor(fake_run(tmp_path, n=140, tweak=tweak), plots=False)
    assert rep["earliest"] and rep["earliest"]["step"] == 85, (rep["summary"], rep["incidents"])
    assert rep["class"] == "numerics.activation_outlier"
    assert [i["judgement"] for i in rep["incidents"]][:2] == ["natural", "fault"], rep["incidents"]


@pytest.mark.parametrize("leak", [False, True])
def test_a_loss_below_the_exact_floor_is_found_at_its_step(tmp_path, leak):
    """Records carrying each batch's exact floor by source: a loss at the floor with batch noise is healthy;
    from step 80 the loss of source a sits 1.5 nats below its floor (a leak): forward.below_floor at 80."""
    def tweak(t, r):
        r["floor_by_source"] = {"a": 2.0, "b": 3.0}
        if leak and t >= 80:
            r["loss_by_source"]["a"] = 0.5 + 0.02 * ((t * 7919) % 5)
            r["loss"] = sum(r["loss_by_source"].values()) / 2
    rep = doctor(fake_run(tmp_path, n=120, tweak=tweak), plots=False)
    if not leak:
        assert rep["class"] == "healthy", rep["summary"]
        return
    assert rep["class"] == "forward.below_floor" and rep["earliest"]["step"] == 80, rep["summary"]
    assert rep["earliest"]["quantity"] == "below_floor/a"


@pytest.mark.parametrize("repeat", [False, True])
def test_a_batch_that_repeats_under_advancing_ids_is_found_at_its_step(tmp_path, repeat):
    """Each step's content hash differs (ids advance); from step 75 the same content every step: the stream
    stopped varying — data.repeated_batch at 76, the first step whose content was read before."""
    def tweak(t, r):
        h = 1_000_003 * t % 2_147_483_629
        if repeat and t >= 75:
            h = 1_000_003 * 75 % 2_147_483_629
        r["ranks"] = {"first": [r["batch"]["first"]], "n": [8], "hash": [h], "loss": [r["loss"]]}
    rep = doctor(fake_run(tmp_path, n=100, tweak=tweak), plots=False)
    if not repeat:
        assert rep["class"] == "healthy", rep["summary"]
        return
    assert rep["class"] == "data.repeated_batch" and rep["earliest"]["step"] == 76, rep["summary"]


def test_routing_collapse_and_a_dead_expert_are_named(tmp_path):
    """record.moe every step: loads over 8 experts (balanced with noise) and per-expert output RMS. From
    step 80 layer 1 routes onto experts 0 and 1 only: moe.load_collapse at 80."""
    rng = random.Random(3)

    def tweak(t, r):
        load = [100 + rng.randint(-20, 20) for _ in range(8)]
        if t >= 80:
            load = [400, 400, 0, 0, 0, 0, 0, 0]
        r["moe"] = {"1": {"load": load, "max_violation": 1.0, "dead": load.count(0),
                          "out_rms": [0.5 + 0.05 * rng.random() for _ in range(8)]}}
    rep = doctor(fake_run(tmp_path / "collapse", n=110, tweak=tweak), plots=False)
    assert rep["class"] == "moe.load_collapse" and rep["earliest"]["step"] == 80, rep["summary"]

    def dead(t, r):
        out = [0.5 + 0.05 * rng.random() for _ in range(8)]
        if t >= 80:
            out[3] = 0.0
        r["moe"] = {"1": {"load": [100 + rng.randint(-20, 20) for _ in range(8)], "max_violation": 1.0, "dead": 0,
                          "out_rms": out}}
    rep = doctor(fake_run(tmp_path / "dead", n=110, tweak=dead), plots=False)
    assert rep["class"] == "moe.dead_expert" and rep["earliest"]["step"] == 80, rep["summary"]


def test_every_layer_update_x10_with_a_normal_gradient_is_an_optimizer_setting(tmp_path):
    """Four layers' update ratios ×10 from step 80 with the gradient, LR and inputs normal: optim.settings
    (not a gradient spike: the next step's gradient, computed after the bad update, does not explain it)."""
    layers = ("emb", "block0.attn", "block0.mlp", "head")

    def tweak(t, r):
        rng = random.Random(t)
        r["layers"] = {k: {"act_rms": 0.1 * (1 + 0.05 * rng.uniform(-1, 1)), "grad_rms": 0.01,
                           "update_ratio": 0.01 * (1 + 0.1 * rng.uniform(-1, 1))} for k in layers}
        if t >= 80:
            for k in layers:
                r["layers"][k]["update_ratio"] *= 10
            if t == 81:
                r["grad_norm"] *= 6  # the bad update's consequence, one step later
        r["update_ratio_max"] = max(q["update_ratio"] for q in r["layers"].values())
    rep = doctor(fake_run(tmp_path, n=110, tweak=tweak), plots=False)
    assert rep["class"] == "optim.settings" and rep["earliest"]["step"] == 80, rep["summary"]


def test_the_clip_coefficient_falling_and_staying_is_heavy_clipping(tmp_path):
    """The gradient norm normal, the clip coefficient 1 → 0.003 from step 80 (a silent threshold)."""
    def tweak(t, r):
        if t >= 80:
            r["clip_coef"] = 0.003 * (1 + 0.05 * ((t * 31) % 7 - 3) / 3)
    rep = doctor(fake_run(tmp_path, n=110, tweak=tweak), plots=False)
    assert rep["class"] == "optim.heavy_clipping" and rep["earliest"]["step"] == 80, rep["summary"]


def test_the_layer_that_moved_most_is_named(tmp_path):
    """Three layers' activations deviate at step 80 (and the loss with them); block1's by far the most: it is
    named, not emb."""
    def tweak(t, r):
        rng = random.Random(t)
        r["layers"] = {k: {"act_rms": 0.1 * (1 + 0.05 * rng.uniform(-1, 1))} for k in ("emb", "block0", "block1")}
        if t == 80:
            spike(t, r, at=80)
            r["layers"]["emb"]["act_rms"] *= 2
            r["layers"]["block0"]["act_rms"] *= 2
            r["layers"]["block1"]["act_rms"] *= 20
    rep = doctor(fake_run(tmp_path, n=110, tweak=tweak), plots=False)
    inc = rep["incidents"][0]
    assert inc["step"] == 80 and inc["model_layer"] == "block1", inc


def test_a_second_incident_soon_after_the_first_is_not_hidden(tmp_path):
    """A loss spike at 70, then one layer's activation ×6 from step 78 on — inside the 30 steps the search used
    to wait after an incident. Both are reported, in order. (The backward/update layer still waits a window:
    the optimizer's moments carry a gradient burst into every update for ~1/(1−β₂) steps.)"""
    def tweak(t, r):
        spike(t, r)
        if t >= 78:
            r["layers"]["emb"]["act_rms"] *= 6
    rep = doctor(fake_run(tmp_path, n=120, tweak=tweak), plots=False)
    got = [(i["step"], i["class"]) for i in rep["incidents"]]
    assert got[:2] == [(70, "forward.loss_spike"), (78, "numerics.activation_outlier")], got


STUDENT = """
from doctor.classes import declare_class
from stability.signals import FORWARD, declare, per_layer


def fix(diag, run, ckpt, t, batch, action, ck):
    return {"variable": f"the probe of {diag.model_layer}", "change": "reset the probe", "override": "probe.reset=true",
            "expect": "the probe back in its band"}


declare_class("numerics.probe_growth", "the student's probe grew", fix)
# NOTE: named like the gradient's own signals on purpose: the doctor reads the declaration, never the name
declare("grad_probe", FORWARD, per_layer("grad_probe"), cls="numerics.probe_growth", log=True, per_layer=True,
        recover=False, fix="the probe's module")
"""


def test_a_new_signal_is_one_declaration(tmp_path, monkeypatch):
    """A student's signal and its class with its fix, in one module of their own: the doctor names the class when
    the signal moves first and prescribes the class's fix — whatever the signal's name (this one starts like the
    gradient's signals), no list elsewhere is edited."""
    import importlib
    import sys

    from doctor.classes import CLASSES
    from stability.signals import SIGNALS
    (tmp_path / "student_probe.py").write_text(STUDENT)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        importlib.import_module("student_probe")

        def tweak(t, r):
            rng = random.Random(t)
            r["layers"]["block0.attn"] = {"grad_probe": 3.0 * (1 + 0.05 * rng.uniform(-1, 1))}
            if t >= 80:
                r["layers"]["block0.attn"]["grad_probe"] *= 8
        d = fake_run(tmp_path / "run", n=110, tweak=tweak)
        rep = doctor(d, plots=False)
    finally:
        SIGNALS.pop("grad_probe", None)
        CLASSES.pop("numerics.probe_growth", None)
        sys.modules.pop("student_probe", None)
    assert rep["class"] == "numerics.probe_growth" and rep["earliest"]["step"] == 80, rep["summary"]
    assert rep["earliest"]["model_layer"] == "block0.attn"
    assert rep["fix"]["override"] == "probe.reset=true" and "block0.attn" in rep["fix"]["variable"], rep["fix"]
    assert json.loads((d / "report.json").read_text())["class"] == "numerics.probe_growth"


@pytest.mark.parametrize("norm_follows", [False, True])
def test_a_layer_level_counts_only_beside_the_run_gradient(tmp_path, norm_follows):
    """A spike at a learning transition after which one layer's gradient RMS holds ×5: alone it is that layer's
    heavy tail (its Signal needs the run's gradient norm) and the incident stays natural; with the run's gradient
    norm holding ×5 too, a level persists after a step change: a fault."""
    def tweak(t, r):
        learning_onset(t, r)
        spike(t, r)
        r["layers"]["block0.attn"] = {"grad_rms": 0.02 * (1 + 0.05 * random.Random(7919 * t).uniform(-1, 1))}
        if t == T0:
            r["layers"]["block0.attn"]["grad_rms"] *= 20
        elif t > T0:
            r["layers"]["block0.attn"]["grad_rms"] *= 5
            if norm_follows:
                r["grad_norm"] *= 5
    rep = doctor(fake_run(tmp_path, n=140, tweak=tweak), plots=False)
    inc = next(i for i in rep["incidents"] if i["step"] == T0)
    assert inc["judgement"] == ("fault" if norm_follows else "natural"), inc


@pytest.mark.parametrize("attention", [False, True])
def test_the_lever_follows_the_evidence(tmp_path, attention):
    """A conforming spike after which source b holds +0.5 (lasting damage). When block 0's attention logits jump
    with it (×8) the lever bounds them (QK-clip at the largest logit the block held before); when nothing names a
    mechanism, the lever of the quantity that moved first, then the LR, one octave down."""
    def tweak(t, r):
        conforming(r)
        rng = random.Random(t)
        r["layers"]["block0.attn"] = {"attn_logit_max": 4.0 * (1 + 0.05 * rng.uniform(-1, 1))}
        spike(t, r)
        if t >= T0 and attention:
            r["layers"]["block0.attn"]["attn_logit_max"] *= 8
        if t > T0:
            r["loss_by_source"]["b"] += 0.5
            r["loss"] = sum(r["loss_by_source"].values()) / 2
    rep = doctor(fake_run(tmp_path, n=140, tweak=tweak), plots=False)
    assert rep["class"] == "recipe.instability" and rep["earliest"]["step"] == T0, rep["summary"]
    lever = rep["lever"]
    if attention:
        key, tau = lever["override"].split("=")
        assert lever["lever"] == "qk" and key == "optim.qk_clip.tau" and 4.0 < float(tau) <= 4.2, lever
    else:
        assert lever["lever"] == "lr" and rep["fix"]["override"] == "optim.lr=0.0005", (lever, rep["fix"])


def test_the_recipe_default_is_the_run_without_its_lever_overrides(tmp_path):
    """doctor/levers.py composes the run's own experiment again without the command line's lever overrides: a run
    at ten times the default LR sits on the LR's unstable side, and the LR lever pulls it back to the default."""
    from types import SimpleNamespace

    from doctor.levers import LEVERS, recipe_default
    (tmp_path / "environment.json").write_text(json.dumps({"argv": ["optim.lr=2e-2", "seed=3", "+experiment=dense_tiny"]}))
    default = recipe_default(SimpleNamespace(dir=tmp_path))
    assert default["optim"]["lr"] == 2e-3 and default["seed"] == 3 and default["model"]["moe"] is None, default["optim"]
    cfg = {**default, "optim": {**default["optim"], "lr": 2e-2}}
    assert [lv.name for lv in LEVERS.values() if lv.unstable(cfg, default)] == ["lr"]
    assert LEVERS["lr"].pull(cfg, default, {})[0] == "optim.lr=0.002"


@pytest.mark.parametrize("fixed", [False, True])
def test_a_levers_rerun_must_remove_the_damage(fixed):
    """doctor/verify.py's comparison of the fix's window with the run's: the damaged source (copy, 1.2 nats above
    its floor without the fix) counts as repaired only when the fix's window ends nearer its floor beyond the
    noise; an undamaged source may end anywhere nearer."""
    from doctor.verify_records import compare_gaps
    after = {"copy": (0.02 if fixed else 1.19, 30), "markov": (0.3, 30)}
    without = {"copy": (1.2, 30), "markov": (0.05, 30)}
    before = {"copy": (1.6, 30), "markov": (0.1, 30)}
    worse, better, missing = compare_gaps(after, before, without, {"copy": 0.05, "markov": 0.05}, 30, {"copy"})
    assert worse == {} and (set(better), missing) == (({"copy"}, []) if fixed else (set(), ["copy"]))
    # a fault's fix (nothing damaged): a source left above where it was before the incident counts against it
    worse, _, _ = compare_gaps(after, before, without, {"copy": 0.05, "markov": 0.05}, 30, set())
    assert set(worse) == {"markov"}


def moved_run(tmp_path, n: int, head: int, spike_at: int | None):
    """Conforming records at ten times dense_tiny's default LR (its warm-up, then constant), source a sitting 1.4
    nats above its exact floor until its head forms at `head`; a spike at `spike_at`."""
    def tweak(t, r):
        conforming(r)
        r["floor_by_source"] = {"a": 2.0, "b": 3.0}
        rng = random.Random(t)  # Gaussian batch noise, as a loss's is (doctor/judge.py MEDIAN_EFF assumes it)
        r["loss_by_source"] = {"a": 2.0 + rng.gauss(0, 0.05), "b": 3.0 + rng.gauss(0, 0.05)}
        learning_onset(t, r, at=head)
        if spike_at is not None:
            spike(t, r, at=spike_at)
        r["lr"] = 2e-2 * min(1.0, t / 50)  # the schedule's linear warm-up (optim/schedule.py), then constant
    d = fake_run(tmp_path, n=n, tweak=tweak)
    (d / "config.yaml").write_text(json.dumps({"optim": {"lr": 2e-2, "schedule": {"name": "constant", "warmup_steps": 50}},
                                               "train": {"steps": n, "max_grad_norm": 1.0, "z_loss": 1e-4}}))
    (d / "environment.json").write_text(json.dumps({"argv": ["optim.lr=2e-2", "+experiment=dense_tiny"]}))
    return d


@pytest.mark.parametrize("late", [False, True])
def test_a_source_held_on_its_plateau_after_a_spike_on_a_moved_recipe_is_a_stall(tmp_path, late):
    """At ten times the recipe's default LR, a spike at 70 while source a sits 1.4 nats above its exact floor. A
    head that forms soon after the spike (90) is the run's own pace: healthy. One that forms only at 200 — source a
    held above half its gap for longer than the run had trained before the spike — is a stall, fixed with the LR
    back at its default (a run on its own default never is: doctor/levers.py `unstable`)."""
    rep = doctor(moved_run(tmp_path, 300, 200 if late else 90, T0), plots=False)
    if late:
        assert rep["class"] == "recipe.instability" and rep["earliest"]["step"] == T0, rep["summary"]
        assert "a stall the default recipe does not have" in rep["summary"] and "loss_by_source/a" in rep["summary"]
        assert "(lr)" in rep["summary"] and rep["fix"]["override"] == "optim.lr=0.002", rep["fix"]
    else:
        assert rep["class"] == "healthy", rep["summary"]


@pytest.mark.parametrize("learns", [False, True])
def test_a_source_that_never_learns_on_a_moved_recipe_is_a_stall_without_an_incident(tmp_path, learns):
    """No spike at all (a recipe that breaks the model before the detectors have a baseline): over a run as long
    as its default's (400 steps), source a never getting halfway to its floor is a stall, an incident of its own
    after the first window; the same run with a head at 150 is healthy."""
    rep = doctor(moved_run(tmp_path, 400, 150 if learns else 10**6, None), plots=False)
    if learns:
        assert rep["class"] == "healthy", rep["summary"]
    else:
        assert rep["class"] == "recipe.instability", rep["summary"]
        assert "never got down to half" in rep["summary"] and "loss_by_source/a" in rep["summary"], rep["summary"]
        assert "began as" not in rep["summary"], rep["summary"]  # no incident began it: no first read to name
        assert rep["fix"]["override"] == "optim.lr=0.002", rep["fix"]
