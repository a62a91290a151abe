"""The console log: a progress bar on a terminal only; elsewhere one plain line per logging.log_every steps."""
from __future__ import annotations

import io
import re

from stability.record import StepRecord, read_records
from stability.sinks import ConsoleSink
from helpers import TINY, run_train


class _Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def _feed(monkeypatch, capsys, tty: bool, steps: int = 12, every: int = 4) -> tuple[str, str]:
    err = _Stream(tty)
    monkeypatch.setattr("sys.stderr", err)
    sink = ConsoleSink(steps, every, None, progress=True)
    for s in range(1, steps + 1):
        sink.write(StepRecord(step=s, tokens=s, loss=2.0, lr=1e-3, grad_norm=0.5, time_s={"total": 0.01},
                              tokens_per_s=1e4))
    sink.close()
    return capsys.readouterr().out, err.getvalue()


def test_bar_on_a_terminal_only(monkeypatch, capsys):
    out, err = _feed(monkeypatch, capsys, tty=True)
    assert "\r" in err and "12/12" in err  # the bar redraws in place on the terminal
    assert len(re.findall(r"^step +\d+ \|", out, re.M)) == 3
    out, err = _feed(monkeypatch, capsys, tty=False)
    assert err == "" and "\r" not in out
    assert [int(m) for m in re.findall(r"^step +(\d+) \|", out, re.M)] == [4, 8, 12]


def test_piped_run_logs_plain_lines(tmp_path):
    """train.py with stdout/stderr to pipes (CI, `> log`): no carriage returns, a line per log_every steps."""
    r = run_train(tmp_path / "run", *TINY, "logging.progress=true", "logging.log_every=2", "checkpoint.every=3")
    assert r.returncode == 0, r.stderr[-3000:]
    # issue 38: each checkpoint was printed twice (its own line, then again on the step line), in two messages
    for name in ("step_000003", "step_000006"):
        assert sum(f"checkpoint {name}" in line for line in r.stdout.splitlines()) == 1, r.stdout
    assert "\r" not in r.stdout + r.stderr
    logged = [int(m) for m in re.findall(r"^step +(\d+) \|", r.stdout, re.M)]
    # every log_every-th step, plus any step that carried an event (those are logged as they happen)
    with_events = {r["step"] for r in read_records(tmp_path / "run" / "metrics.jsonl") if r["events"]}
    assert logged == sorted({2, 4, 6} | with_events)
    assert len(re.findall(r"^eval  step", r.stdout, re.M)) == 2  # eval_every=3 over 6 steps


def test_what_the_start_said_is_not_repeated_on_the_first_step_line(monkeypatch, capsys):
    """A resume's lines are printed as it happens and recorded in the first step's events: said once."""
    monkeypatch.setattr("sys.stderr", _Stream(False))
    sink = ConsoleSink(2, 1, None, progress=False)
    sink.say("resumed from x (step 4, 10 tokens)")
    for s, events in ((5, ["resumed from x (step 4, 10 tokens)"]), (6, ["checkpoint step_000006 published"])):
        sink.write(StepRecord(step=s, tokens=s, loss=2.0, lr=1e-3, grad_norm=0.5, time_s={"total": 0.01},
                              tokens_per_s=1e4, events=events))
    out = capsys.readouterr().out
    assert out.count("resumed from x") == 1 and out.count("checkpoint step_000006 published") == 1, out
