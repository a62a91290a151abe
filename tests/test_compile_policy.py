"""train.compile's default (null): compile only a run long enough to repay the cold start (run/compile.py), and
say so while compiling."""
from __future__ import annotations

import pytest
import torch

from bench.config import compose_config
from run.compile import MIN_STEPS, compile_model, decide


def test_a_short_cpu_run_stays_eager():
    """nanoGPT's shape (2000 steps) and the speedrun: far too short on a CPU to repay a cold compile."""
    for exp in ("shakespeare_char", "speedrun"):
        cfg = compose_config([f"+experiment={exp}", "data.path=x.txt"])
        assert cfg.train.compile is None  # the experiments leave it to the policy
        d = decide(cfg.train.compile, "cpu", cfg.train.steps)
        assert not d.on and "too few" in d.line(), d.line()
    assert not decide(None, "cpu", 400).on  # the default job


def test_a_long_run_compiles():
    assert decide(None, "cpu", MIN_STEPS["cpu"]).on
    assert not decide(None, "cpu", MIN_STEPS["cpu"] - 1).on
    assert decide(None, torch.device("cpu"), 10 * MIN_STEPS["cpu"]).on


def test_a_gpu_run_compiles_from_its_own_break_even():
    """On a GPU the cold start is repaid sooner: a run of nanoGPT's length compiles there, a smoke run does not."""
    assert MIN_STEPS["cuda"] < MIN_STEPS["cpu"]
    assert decide(None, "cuda", 2000).on and decide(None, torch.device("cuda", 0), 5000).on
    assert not decide(None, "cuda", 20).on
    assert not decide(None, "mps", 10**6).on  # no break-even known: eager


def test_an_explicit_setting_wins():
    assert decide(True, "cpu", 1).on and not decide(False, "cuda", 10**6).on
    assert decide(True, "cpu", 1).line() == "train.compile: on (train.compile=true)"


def test_each_compile_says_so_in_one_line(capsys):
    torch._dynamo.reset()
    model = compile_model(torch.nn.Linear(4, 4), backend="aot_eager")
    model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("torch.compile:")]
    assert [ln.split(" (")[0] for ln in lines] == ["torch.compile: compiling the forward",
                                                  "torch.compile: compiling the backward"], lines
    assert all(ln.endswith(" s") for ln in lines)


@pytest.mark.parametrize("value", ["true", "false", "null"])
def test_the_key_takes_true_false_or_null(value):
    cfg = compose_config(["+experiment=speedrun", "data.path=x.txt", f"train.compile={value}"])
    assert cfg.train.compile == {"true": True, "false": False, "null": None}[value]
