"""The lr schedules against their closed forms: warmup, cosine / linear / wsd / constant, a warmup longer
than the run clamped to it, an exact LambdaLR resume, and what a resume that declares more steps does."""
from __future__ import annotations

import copy
import math

import pytest

from optim import build_optimizer, build_scheduler, lr_factor
from optim.schedule import Schedule, continued, schedule_of
from test_optim import NO_DECAY, Toy, optim_cfg
from optim.config import ScheduleConfig


def sched(name, warmup=10, ratio=0.1, **kw):
    return {"name": name, "warmup_steps": warmup, "min_lr_ratio": ratio, "decay_steps": None, **kw}


@pytest.mark.parametrize("name", ["cosine", "linear", "wsd", "constant"])
def test_warmup_is_linear_from_one_over_w(name):
    f = [lr_factor(s, 100, sched(name)) for s in range(10)]
    assert f[0] == pytest.approx(0.1) and f[0] > 0
    assert f[9] == pytest.approx(1.0)
    assert all(b - a == pytest.approx(0.1) for a, b in zip(f, f[1:]))


def test_cosine_and_linear_against_closed_form():
    T, W, r = 110, 10, 0.1  # decay over D = 100 steps, step s at p = (s − 9)/100
    cos = lambda s: lr_factor(s, T, sched("cosine"))  # noqa: E731
    lin = lambda s: lr_factor(s, T, sched("linear"))  # noqa: E731
    assert cos(W - 1) == pytest.approx(1.0)
    assert cos(T - 1) == pytest.approx(r) and cos(T + 50) == pytest.approx(r)
    assert cos(59) == pytest.approx(r + (1 - r) * 0.5)  # p = 1/2: cos(π/2) = 0
    assert cos(34) == pytest.approx(r + (1 - r) * 0.5 * (1 + math.cos(math.pi / 4)))  # p = 1/4
    assert lin(59) == pytest.approx(1 - (1 - r) * 0.5) and lin(T - 1) == pytest.approx(r)
    decay = [cos(s) for s in range(W - 1, T)]
    assert all(b <= a for a, b in zip(decay, decay[1:]))
    # decay_steps caps the horizon: min reached after W + 50 steps, then held
    short = [lr_factor(s, 200, sched("cosine", decay_steps=50)) for s in (59, 60, 199)]
    assert short == pytest.approx([r, r, r]) and lr_factor(58, 200, sched("cosine", decay_steps=50)) > r


def test_wsd_flat_then_linear_decay():
    T, r = 100, 0.1  # decay_fraction 0.2: the last 20 steps (80..99) decay
    f = [lr_factor(s, T, sched("wsd", decay_fraction=0.2)) for s in range(T)]
    assert f[9:80] == [1.0] * 71
    assert f[80] == pytest.approx(1 - (1 - r) / 20) and f[89] == pytest.approx(1 - (1 - r) * 0.5)
    assert f[99] == pytest.approx(r)
    steps = [a - b for a, b in zip(f[79:], f[80:])]
    assert steps == pytest.approx([(1 - r) / 20] * 20)
    assert lr_factor(150, T, sched("wsd")) == pytest.approx(r)
    assert [lr_factor(s, T, sched("constant")) for s in (9, 50, 99, 150)] == [1.0] * 4


def test_schedule_config_errors():
    expected = "^optim.schedule.name=foo: expected one of cosine, linear, wsd, constant$"
    with pytest.raises(ValueError, match=expected):
        lr_factor(0, 100, sched("foo"))
    with pytest.raises(ValueError, match="optim.schedule.warmup_steps=-1"):
        lr_factor(0, 100, sched("cosine", warmup=-1))
    with pytest.raises(ValueError, match="optim.schedule.min_lr_ratio=1.5"):
        lr_factor(0, 100, sched("cosine", ratio=1.5))
    with pytest.raises(ValueError, match="train.steps=0"):
        lr_factor(0, 0, sched("cosine"))


@pytest.mark.parametrize("name", ["cosine", "linear", "constant"])
def test_a_warmup_longer_than_the_run_is_clamped_to_it(name):
    """T = 20 under W = 50: the warmup spans the run, (s + 1)/20, peak at the last step, as W = T does."""
    T = 20
    clamped = [lr_factor(s, T, sched(name, warmup=50)) for s in range(T)]
    assert clamped == pytest.approx([(s + 1) / T for s in range(T)])
    assert clamped == [lr_factor(s, T, sched(name, warmup=T)) for s in range(T)]
    assert ScheduleConfig(name=name, warmup_steps=50).clamp_note(T) == \
        "optim.schedule clamped to train.steps=20: warmup_steps 50 → 20"


def test_wsd_keeps_its_decay_and_the_warmup_takes_the_rest():
    T, r = 100, 0.1  # the last 20 steps decay, so a 90-step warmup gets 80
    f = [lr_factor(s, T, sched("wsd", warmup=90, decay_fraction=0.2)) for s in range(T)]
    assert f[:80] == pytest.approx([(s + 1) / 80 for s in range(80)])
    assert f[80:] == pytest.approx([1 - (1 - r) * (s + 1) / 20 for s in range(20)])
    assert ScheduleConfig(name="wsd", warmup_steps=90).clamp_note(T) == \
        "optim.schedule clamped to train.steps=100: warmup_steps 90 → 80"
    # a decay longer than the run: the whole run decays, no warmup left
    g = [lr_factor(s, 10, sched("wsd", warmup=5, decay_steps=30)) for s in range(10)]
    assert g == pytest.approx([1 - (1 - r) * (s + 1) / 10 for s in range(10)])
    assert ScheduleConfig(name="wsd", warmup_steps=5, decay_steps=30).clamp_note(10) == \
        "optim.schedule clamped to train.steps=10: warmup_steps 5 → 0, decay steps 30 → 10"


@pytest.mark.parametrize("cfg", [sched("cosine", warmup=100), sched("linear", warmup=0), sched("constant"),
                                 sched("wsd", warmup=80, decay_fraction=0.2), sched("cosine", decay_steps=500)])
def test_a_schedule_that_fits_is_not_clamped(cfg):
    assert ScheduleConfig.from_dict(cfg).clamp_note(100) is None


def test_build_scheduler_takes_the_typed_config_only():
    opt, _ = build_optimizer(Toy(), optim_cfg())
    with pytest.raises(TypeError) as e:
        build_scheduler(opt, sched("cosine"), 10)
    assert str(e.value).startswith("build_scheduler takes a ScheduleConfig") and "\n" not in str(e.value)


def test_lambdalr_resume_is_exact():
    cfg = optim_cfg(NO_DECAY, {"name": "attn", "names": ["*.attn.*"], "lr_scale": 0.5})
    s_cfg, T = sched("cosine"), 40

    def make():
        opt, _ = build_optimizer(Toy(), cfg)
        return opt, build_scheduler(opt, ScheduleConfig.from_dict(s_cfg), T)

    def run(opt, sch, n):
        lrs = []
        for _ in range(n):
            lrs.append([g["lr"] for g in opt.param_groups])
            opt.step()  # no grads: moves nothing, keeps LambdaLR's order check quiet
            sch.step()
        return lrs

    opt, sch = make()
    straight = run(opt, sch, T)
    opt, sch = make()
    first = run(opt, sch, 17)
    saved = copy.deepcopy((opt.state_dict(), sch.state_dict()))
    opt, sch = make()
    opt.load_state_dict(saved[0])
    sch.load_state_dict(saved[1])
    assert first + run(opt, sch, T - 17) == straight
    # every group follows lr · lr_scale · factor(step)
    for s in (0, 9, 25, T - 1):
        assert straight[s] == pytest.approx([3e-3 * k * lr_factor(s, T, s_cfg) for k in (1.0, 0.5, 1.0)])


# ---------------------------------------------------------------------------------------------------------
# global-norm clipping, one process


def test_the_schedule_travels_with_the_scheduler_state():
    """A checkpoint holds the schedule it trained under, horizon included: a scheduler built for another
    train.steps continues the saved one once it loads that state (optim/schedule.py)."""
    s_cfg = ScheduleConfig.from_dict(sched("cosine"))
    opt, sch = (lambda o: (o, build_scheduler(o, s_cfg, 40)))(build_optimizer(Toy(), optim_cfg())[0])
    for _ in range(40):
        opt.step()
        sch.step()
    saved = copy.deepcopy((opt.state_dict(), sch.state_dict()))
    opt2, _ = build_optimizer(Toy(), optim_cfg())
    sch2 = build_scheduler(opt2, s_cfg, 60)
    opt2.load_state_dict(saved[0])
    sch2.load_state_dict(saved[1])
    assert schedule_of(sch2) == Schedule(sched("cosine"), 40) != Schedule(sched("cosine"), 60)
    assert Schedule.from_record(schedule_of(sch2).describe(3e-3)) == Schedule(sched("cosine"), 40)


@pytest.mark.parametrize("name, at", [("cosine", 400), ("cosine", 250), ("linear", 400), ("wsd", 350)])
def test_more_steps_keep_the_horizon_when_a_longer_one_would_move_the_lr(name, at):
    """train.steps 400 -> 600 declared on a resume at step `at`: over 600 steps the schedule would give steps
    already trained another LR (a re-stretched cosine jumps back up), so the 400-step horizon stays and the
    added steps train at its final LR, r · peak: the LR never jumps."""
    saved, longer = Schedule(sched(name), 400), Schedule(sched(name), 600)
    kept, line = continued(saved, longer, at, declared=False, peak=1e-3)
    assert kept == saved and "keeps its 400-step horizon" in line and "steps 401-600" in line and "1.00e-04" in line
    f = [kept(i) for i in range(600)]
    assert f[at - 1:] == sorted(f[at - 1:], reverse=True) and f[599] == f[399] == pytest.approx(0.1)
    assert longer(at) > saved(at - 1)  # what the re-stretch would have done: up again


def test_wsd_in_its_stable_phase_moves_its_decay_to_the_new_end():
    """WSD's point: a run still at its peak LR can be extended; every trained step has the same LR over 600
    steps, so the longer schedule is taken and the decay runs over the last 20 % of the new run."""
    saved, longer = Schedule(sched("wsd"), 400), Schedule(sched("wsd"), 600)
    took, line = continued(saved, longer, 300, declared=False)
    assert took == longer and "its decay moves to steps 481-600" in line
    assert [took(i) for i in range(300)] == [saved(i) for i in range(300)] and took(479) == 1.0
    assert continued(saved, saved, 300, declared=False) == (saved, None)  # nothing changed: nothing said


def test_a_declared_schedule_change_is_taken_as_written():
    saved, new = Schedule(sched("cosine"), 400), Schedule(sched("wsd", decay_steps=200), 600)
    took, line = continued(saved, new, 400, declared=True)
    assert took == new and line.startswith("resume: the LR schedule changes at step 401 (declared)")
