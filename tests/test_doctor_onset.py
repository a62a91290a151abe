"""doctor/conformance.py onset(): a failure of a check that runs every few steps is dated within the gap since it
last held by its place's per-step series — where the series shifted, and only when the shift clears the bound."""
from __future__ import annotations

import math

import numpy as np

from doctor.budget import ALPHA
from doctor.conformance import onset

EVERY, FOUND = 10, 40  # the check runs at 10, 20, 30, 40 and fails at 40


def records(shift_at: int | None, size: float = math.log(2.0), noise: float = 0.02, seed: int = 0) -> list[dict]:
    """A layer's output RMS on a slow trend with Gaussian noise in log, × e^size from `shift_at` on; the forward check
    runs every EVERY steps and fails at FOUND."""
    rng = np.random.default_rng(seed)
    out = []
    for t in range(1, FOUND + 1):
        y = -3.0 + 0.01 * t + noise * rng.standard_normal() + (size if shift_at is not None and t >= shift_at else 0.0)
        spec = {"miss": {"loss_grad": 0.1}, "fail": [], "out_rms": {"block0.mlp": math.exp(y), "block1.mlp": 0.05}}
        if t % EVERY == 0:
            spec["miss"]["forward"] = 5.0 if t == FOUND else 0.2
        out.append({"step": t, "spec": spec})
    f = {"check": "forward", "where": "block0.mlp", "series": "out_rms", "kind": "scaled"}
    out[-1]["spec"]["fail"] = [f]
    return out


def test_a_shift_in_the_gap_is_dated_at_its_step():
    for s in range(31, FOUND + 1):
        for seed in range(3):
            recs = records(s, seed=seed)
            got = onset(recs, len(recs) - 1, recs[-1]["spec"]["fail"][0])
            if s == FOUND:  # it began where the check found it: nothing to date
                assert got is None, (seed, got)
            else:
                assert got is not None and (got[0]["step"], got[1]) == (s, 30), (s, seed, got)


def test_no_shift_in_the_series_leaves_the_failure_at_its_step():
    """A fault the series does not show (a rounding, another function of the same size): an onset is claimed on pure
    noise at most at the budget's rate (Bonferroni over the gap's steps makes it at most ALPHA)."""
    n = 200
    dated = sum(onset(r, len(r) - 1, r[-1]["spec"]["fail"][0]) is not None for r in (records(None, seed=k)
                                                                                  for k in range(n)))
    assert dated <= ALPHA * n, dated


def test_only_a_check_that_held_before_a_gap_is_dated():
    recs = records(34)
    f = recs[-1]["spec"]["fail"][0]
    recs[29]["spec"]["miss"]["forward"] = 3.0  # it failed at 30 too: the fault is older than this gap
    assert onset(recs, len(recs) - 1, f) is None
    every = records(34)
    for r in every:  # a check that runs every step has no gap to date within
        r["spec"]["miss"]["forward"] = r["spec"]["miss"].get("forward", 0.2)
    assert onset(every, len(every) - 1, f) is None
    assert onset(records(34), FOUND - 1, {**f, "series": None}) is None  # a check that declares no series


def test_a_record_number_that_drops_to_zero_dates_its_failure():
    """A series may be a number of the record itself (the aux check's, the step's aux_loss): an auxiliary loss left
    out from step 34 on reads 0 there, a change without bound, dated at 34."""
    recs = records(None)
    for r in recs:
        r["aux_loss"] = 0.0 if r["step"] >= 34 else 0.02 * (1 + 0.01 * math.sin(r["step"]))
        r["spec"]["miss"]["aux"] = r["spec"]["miss"].pop("forward", None) or None
        r["spec"]["miss"] = {k: v for k, v in r["spec"]["miss"].items() if v is not None}
    f = {"check": "aux", "where": "aux_loss", "series": "aux_loss", "kind": "balancing"}
    recs[-1]["spec"]["fail"] = [f]
    got = onset(recs, len(recs) - 1, f)
    assert got is not None and (got[0]["step"], got[1]) == (34, 30), got


def test_a_check_failing_beside_it_that_held_in_the_gap_bounds_the_onset():
    """The series shifts at 34, but a check that fails beside the forward check at 40 and runs every step held up to
    38: the fault began after 38, so 34 is a natural move of the series, not the onset. Where that check held only up
    to 33, the onset at 34 stands; a check that held beside it but did not fail at 40 bounds nothing."""
    def beside(held_until: int, fails: bool = True) -> list[dict]:
        recs = records(34)
        for r in recs:
            r["spec"]["miss"]["route"] = 0.0 if r["step"] <= held_until else 7.0
        if fails:
            recs[-1]["spec"]["fail"].append({"check": "route", "where": "moe1", "kind": "topk"})
        return recs
    f = records(34)[-1]["spec"]["fail"][0]
    late = beside(38)
    assert onset(late, len(late) - 1, f) is None  # the onset is 39 or 40; the series shows no shift there
    early = beside(33)
    got = onset(early, len(early) - 1, f)
    assert got is not None and (got[0]["step"], got[1]) == (34, 30), got
    unrelated = beside(38, fails=False)
    got = onset(unrelated, len(unrelated) - 1, f)
    assert got is not None and got[0]["step"] == 34, got


def test_a_shift_of_three_times_the_noise_is_dated_near_its_step():
    """A level shift of 3σ lasting to the failure: the mean of its n_R steps stands 3σ·√n_R off the line, past the
    Bonferroni bound (about 3.2σ for a gap of 10) from two steps on, while any one step-to-step change (√2σ of noise
    beside it) rarely clears it. Dated within ±1 of its step in at least 2/3 of the cases (shifts at 31..39, ten
    seeds; the estimator's own spread at 3σ leaves the rest to a noise spike beside the shift)."""
    near = [(got := onset(r, len(r) - 1, r[-1]["spec"]["fail"][0])) is not None and abs(got[0]["step"] - s) <= 1
            for s in range(31, FOUND) for r in (records(s, size=0.15, noise=0.05, seed=k) for k in range(10))]
    assert sum(near) >= 2 / 3 * len(near), sum(near)


def test_a_failure_beside_the_first_at_its_place_dates_it_when_the_first_series_cannot():
    """A rounding inside block0.mlp from 34: the forward check fails at 40 first, but its series (the output RMS)
    keeps its course; the exact check fails beside it at the same place, and its series (the prefix check's miss on
    the steps between) leaves FP32's level at 34: the incident is dated at 34, by the exact check. A failure at
    another place beside it dates nothing."""
    from doctor.conformance import earliest_onset

    def with_exact(where: str) -> list[dict]:
        recs = records(None)
        for r in recs:
            t = r["step"]
            if t % EVERY:
                r["spec"]["prefix_err"] = {where: 3e-4 if t >= 34 else 2e-7 * (1 + 0.1 * math.sin(t))}
            else:
                r["spec"]["miss"]["exact"] = 5e8 if t == FOUND else 0.01
        recs[-1]["spec"]["fail"].append({"check": "exact", "where": where, "series": "prefix_err",
                                         "kind": "precision"})
        return recs
    recs = with_exact("block0.mlp")
    fails = recs[-1]["spec"]["fail"]
    assert onset(recs, len(recs) - 1, fails[0]) is None  # the forward check's own series: no date
    got = earliest_onset(recs, len(recs) - 1, fails)
    assert got is not None and (got[0]["step"], got[1], got[2]["check"]) == (34, 30, "exact"), got
    other = with_exact("block1.mlp")
    assert earliest_onset(other, len(other) - 1, other[-1]["spec"]["fail"]) is None
