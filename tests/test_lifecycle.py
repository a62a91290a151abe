"""The run's life around the loop, as a user meets it: one writer per run directory, an interrupt that saves
and resumes bit for bit, a failed start that leaves nothing, declared changes in the short form.

Every wait is a handshake on the child's own output (a step line), never a sleep: a loaded machine changes
when things happen, not what the test sees. The tests on a 200-step run (the second writer, the interrupt and its
resume, the declared changes) and the torchrun launch run under `-m slow`; the signal handler, the start errors
and a Ctrl-C while importing stay in the default suite.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import HANG_S, ROOT, TINY, env, run_train
from run.lifecycle import Exit
from stability.events import read_events
from stability.record import read_records

# long enough to be caught alive, a checkpoint every 5 steps, a console line every step (the handshake)
LIVE = [*TINY, "train.steps=200", "train.eval_every=1000", "checkpoint.every=25", "logging.log_every=1",
        "logging.plot=false"]
STEP_LINE = re.compile(r"^step\s+(\d+) \|")
SAME = ("step", "batch", "lr", "loss", "grad_norm", "loss_by_source", "expert_load")  # what makes it the same run


def launch(run_dir: Path, *overrides: str, nproc: int = 1) -> subprocess.Popen:
    lead = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                f"--nproc_per_node={nproc}"]
    return subprocess.Popen([*lead, "train.py", f"hydra.run.dir={run_dir}", *overrides], cwd=ROOT, env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_for_step(child: subprocess.Popen, step: int) -> None:
    for line in child.stdout:
        m = STEP_LINE.match(line)
        if m and int(m.group(1)) >= step:
            return
    raise AssertionError(f"the child exited ({child.wait()}) before step {step}: {child.stderr.read()[-2000:]}")


def signal_tree(pid: int, sig: int) -> None:
    """The process and every descendant (torchrun starts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    todo = [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def snapshot(run_dir: Path) -> dict:
    """Every file under the run directory, bytes and all (the lock file aside: it is the holder's)."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and p.name != "run.lock"}


def same_run(a: list[dict], b: list[dict]) -> None:
    assert [r["step"] for r in b] == [r["step"] for r in a]
    for x, y in zip(a, b):
        assert {k: x.get(k) for k in SAME} == {k: y.get(k) for k in SAME}, f"step {x['step']} differs"


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("straight") / "run"
    r = run_train(d, *LIVE)
    assert r.returncode == 0, r.stderr[-3000:]
    return d


@pytest.fixture(scope="module")
def straight(straight_run) -> list[dict]:
    return read_records(straight_run / "metrics.jsonl")


@pytest.mark.slow  # a 200-step run and its resume (straight_run)
def test_second_writer_is_refused_and_a_dead_holders_lock_is_free(tmp_path, straight):
    d = tmp_path / "run"
    first = launch(d, *LIVE, "resume=auto")
    try:
        wait_for_step(first, 7)
        signal_tree(first.pid, signal.SIGSTOP)  # alive, holding the lock, writing nothing while we look
        holder = json.loads((d / "run.lock").read_text())
        assert holder["pid"] == first.pid
        before = snapshot(d)
        second = run_train(d, *LIVE, "resume=auto")
        assert second.returncode == Exit.BUSY
        err = [line for line in second.stderr.splitlines() if line.strip()]
        assert len(err) == 1 and f"in use by pid {first.pid}" in err[0], second.stderr
        assert snapshot(d) == before  # metrics.jsonl, checkpoints/, everything: untouched
        reader = subprocess.run([sys.executable, "-m", "doctor", str(d), "--no-plots"], cwd=ROOT, env=env(),
                                capture_output=True, text=True, timeout=HANG_S)
        assert reader.returncode == 0, reader.stderr[-2000:]  # readers take no lock: they work on a live run
    finally:
        signal_tree(first.pid, signal.SIGKILL)
        first.wait()
    again = run_train(d, *LIVE, "resume=auto")  # the kernel released the dead holder's lock
    assert again.returncode == 0, again.stderr[-3000:]
    assert "was released when it exited; taking it over" in again.stdout
    same_run(straight, read_records(d / "metrics.jsonl"))  # one stream, the straight run's, bit for bit
    assert not (d / "run.lock").exists()  # a clean exit hands the directory back


@pytest.mark.slow  # a 200-step run and its resume (straight_run)
def test_sigint_saves_at_the_step_boundary_and_resume_auto_is_bit_identical(tmp_path, straight):
    d = tmp_path / "run"
    child = launch(d, *LIVE, "checkpoint.every=0")  # the interrupt saves even when nothing else does
    wait_for_step(child, 7)
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=HANG_S)
    assert child.returncode == Exit.INTERRUPTED, err[-3000:]
    last = err.strip().splitlines()[-1]
    m = re.match(r"ballast: SIGINT after step (\d+): saved (\S+); continue with: python train\.py (.*)$", last)
    assert m, err[-3000:]
    step, saved, args = int(m.group(1)), Path(m.group(2)), m.group(3).split()
    assert step >= 7 and saved.name == f"step_{step:06d}" and (saved / "marker.json").exists()
    assert "Traceback" not in err
    assert [r["step"] for r in read_records(d / "metrics.jsonl")] == list(range(1, step + 1))
    assert [(e["step"], e["signal"], e["checkpoint"]) for e in read_events(d / "events.jsonl")
            if e["kind"] == "interrupted"] == [(step, "SIGINT", saved.name)]
    resumed = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, env=env(), capture_output=True,
                             text=True, timeout=HANG_S)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    same_run(straight, read_records(d / "metrics.jsonl"))


# each case in a fork of one interpreter (torch imported once): the signals sent, then what the handler left
SIGNALS = """
import json, os, signal, sys
from parallel.dist import Dist
from run.lifecycle import Interrupts
import torch
for case in json.loads(sys.argv[1]):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        with Interrupts(Dist(0, 1, 0, torch.device("cpu"), None)) as stop:
            for name in case:
                os.kill(os.getpid(), getattr(signal, name))  # the handler runs before the next line
                os.write(w, f"{name}>{stop.name}>{stop.agreed()} ".encode())
        os._exit(0)
    os.close(w)
    seen = b""
    while chunk := os.read(r, 4096):  # NOTE: to EOF (the child's exit): one read may return the first write only
        seen += chunk
    seen = seen.decode().split()
    print(json.dumps([case, os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), seen]), flush=True)
"""
CASES = {  # signals sent: (exit status, what the loop sees after each)
    ("SIGINT",): (0, ["SIGINT>SIGINT>True"]),
    ("SIGTERM",): (0, ["SIGTERM>SIGTERM>True"]),
    ("SIGINT", "SIGTERM"): (0, ["SIGINT>SIGINT>True", "SIGTERM>SIGINT>True"]),  # torchrun forwarding a Ctrl-C
    ("SIGINT", "SIGINT"): (Exit.ABORTED, ["SIGINT>SIGINT>True"]),  # a second Ctrl-C: out at once
    ("SIGTERM", "SIGINT"): (Exit.ABORTED, ["SIGTERM>SIGTERM>True"]),
}


def test_the_first_signal_asks_and_a_second_exits_at_once():
    r = subprocess.run([sys.executable, "-c", SIGNALS, json.dumps([list(c) for c in CASES])], cwd=ROOT, env=env(),
                       capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 0, r.stderr[-2000:]
    got = {tuple(case): (code, seen) for case, code, seen in map(json.loads, r.stdout.splitlines())}
    assert got == CASES
    assert r.stderr.count("again: exiting now") == 2 and r.stderr.count("stopping at the end of this step") == 5


def test_a_launch_agrees_on_the_signal_its_last_step_read():
    """Under a launch the interrupt's max-reduce rides in the step's one read (Interrupts.tensors / heard): the
    boundary answers what the last step agreed; a signal that came after that step's reduction is kept and
    agreed at the next one; the first boundary, before any step, reduces on its own. (No process group
    here: the reductions are the identity, the bookkeeping is what is tested.)"""
    import torch

    from parallel import Dist, HostScalars
    from run.lifecycle import Interrupts

    stop = Interrupts(Dist(0, 2, 0, torch.device("cpu"), None))

    def step() -> None:
        host = HostScalars()
        host.put(**stop.tensors())
        host.read()
        stop.heard(host)

    assert stop.agreed() is False  # the first boundary: its own reduction
    step()
    stop.signum = signal.SIGINT  # arrives after the step's reduction
    assert stop.agreed() is False and stop.signum == signal.SIGINT  # not agreed yet, and not forgotten
    step()
    assert stop.agreed() is True and stop.name == "SIGINT"


# NOTE: resume=latest in a new directory is tests/test_hardpaths.py's test_a_failed_resume_leaves_the_directory_usable
@pytest.mark.parametrize("case", ["empty directory", "run dir under a file"])
def test_a_start_that_cannot_run_says_one_line_and_creates_nothing(tmp_path, case):
    (tmp_path / "empty").mkdir()
    (tmp_path / "a_file").write_text("x")
    run_dir = tmp_path / "new" / "runs" / "run"
    over = {"empty directory": ["+experiment=shakespeare_char", f"data.path={tmp_path / 'empty'}"],
            "run dir under a file": []}[case]
    if case == "run dir under a file":
        run_dir = tmp_path / "a_file" / "run"
    r = run_train(run_dir, *TINY, *over)
    assert r.returncode == Exit.START
    err = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("ballast: config error: "), r.stderr
    assert not (tmp_path / "new").exists()  # not even the parents Hydra made for it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "empty"]


@pytest.mark.parametrize("case", ["resume=latest on an existing empty directory", "run dir on a virtual filesystem",
                                  "device=cuda without CUDA"])
def test_the_remaining_start_errors_are_one_line_and_leave_the_directory_as_it_was(tmp_path, case):
    """Issue 38: an unwritable /proc path was a 15-line Hydra traceback (root passes os.access there), device=cuda
    on a CPU machine 13 lines and an empty run directory; resume=latest deleted an empty directory it found."""
    existing = tmp_path / "existing"
    existing.mkdir()
    run_dir, over = {"resume=latest on an existing empty directory": (existing, ["resume=latest"]),
                     "run dir on a virtual filesystem": (Path("/proc/ballast-no-such-dir/run"), []),
                     "device=cuda without CUDA": (tmp_path / "new" / "run", ["device=cuda"])}[case]
    if case == "run dir on a virtual filesystem" and not Path("/proc/self").is_dir():
        pytest.skip("no /proc on this machine")
    if case == "device=cuda without CUDA":
        import torch
        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
    r = run_train(run_dir, *TINY, *over)
    err = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == Exit.START and len(err) == 1 and err[0].startswith("ballast: config error: "), r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing"] and not any(existing.iterdir())


def test_ctrl_c_while_importing_is_one_line_and_leaves_nothing(tmp_path):
    """SIGINT arrives as train.py imports torch (delivered by an import hook, not a timer): one line, status
    130, no traceback, no run directory."""
    run_dir = tmp_path / "new" / "run"
    hook = ("import builtins, os, runpy, signal, sys\n"
            "real = builtins.__import__\n"
            "def imp(name, *a, **k):\n"
            "    if name == 'torch':\n"
            "        builtins.__import__ = real\n"
            "        os.kill(os.getpid(), signal.SIGINT)\n"
            "    return real(name, *a, **k)\n"
            "builtins.__import__ = imp\n"
            "sys.argv = ['train.py', *sys.argv[1:]]\n"
            "runpy.run_path('train.py', run_name='__main__')\n")
    r = subprocess.run([sys.executable, "-c", hook, f"hydra.run.dir={run_dir}", *TINY], cwd=ROOT, env=env(),
                       capture_output=True, text=True, timeout=HANG_S)
    err = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 130 and len(err) == 1 and err[0].startswith("ballast: SIGINT"), r.stderr[-3000:]
    assert not (tmp_path / "new").exists()


@pytest.mark.slow  # a torchrun launch; the one-process error path is tests/test_train.py's
@pytest.mark.distributed
def test_a_config_error_under_torchrun_is_said_once(tmp_path):
    """Every rank checks the command line; rank 0 alone says what is wrong (torchrun adds its own report)."""
    r = run_train(tmp_path / "new" / "run", *TINY, "train.stpes=100", nproc=2)
    assert r.returncode != 0 and r.stderr.count("ballast: config error: train.stpes") == 1, r.stderr[-3000:]
    assert not (tmp_path / "new").exists()


@pytest.mark.slow  # a 200-step run and its resume (straight_run)
def test_declared_changes_take_the_short_form_and_a_refusal_names_what_differs(tmp_path, straight_run):
    d = tmp_path / "run"
    shutil.copytree(straight_run, d)
    more = ["train.steps=202", "resume.allow_config_change=[train.steps]"]
    refused = run_train(d, *LIVE, "resume=latest", "data.seed=7", *more)
    assert refused.returncode == Exit.START and "(data.seed 1234 -> 7)" in refused.stderr, refused.stderr
    ok = run_train(d, *LIVE, "resume=latest", "resume.allow_data_change=true", "data.seed=7", *more)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "data changed (resume.allow_data_change=true)" in ok.stdout
    assert [r["step"] for r in read_records(d / "metrics.jsonl")] == list(range(1, 203))


@pytest.mark.slow  # a 200-step run and its resume (straight_run)
def test_more_steps_continue_the_lr_and_the_doctor_reads_the_extension_as_declared(tmp_path, straight_run):
    """Issue 38: `resume=latest resume.allow_config_change=[train.steps] train.steps=N` re-stretched the cosine
    (the LR jumped up at the resume) and the doctor then crashed or called it a fault. The added steps train at
    the schedule's final LR, the resume says so in one line, every record names the schedule it trained under,
    and the doctor finds neither an LR switch nor a resume fault."""
    from doctor.cli import doctor

    d = tmp_path / "run"
    shutil.copytree(straight_run, d)
    r = run_train(d, *LIVE, "resume=latest", "resume.allow_config_change=[train.steps]", "train.steps=230")
    assert r.returncode == 0, r.stderr[-2000:]
    said = [ln for ln in r.stdout.splitlines() if ln.startswith("resume: train.steps 200 -> 230")]
    assert len(said) == 1 and "keeps its 200-step horizon" in said[0] and "steps 201-230" in said[0], r.stdout
    recs = read_records(d / "metrics.jsonl")
    assert [x["step"] for x in recs] == list(range(1, 231))
    last = recs[199]["lr"]
    assert last == pytest.approx(recs[199]["schedule"]["lr"] * 0.1) and recs[198]["lr"] > last
    assert all(x["lr"] == last and x["schedule"] == recs[0]["schedule"] for x in recs[200:])  # no jump, one schedule
    rep = doctor(d, plots=False)
    classes = {rep["class"], *(i["class"] for i in rep["incidents"])}
    assert not classes & {"optim.lr_switch", "state.resume_fault", "state.config_change"}, rep["summary"]
    assert any("train.steps 200 -> 230" in c for c in rep["declared"]), rep["declared"]


@pytest.mark.sweep
@pytest.mark.distributed
def test_two_processes_one_writer_and_one_line_errors(tmp_path):
    d = tmp_path / "run"
    first = launch(d, *LIVE, nproc=2)
    try:
        wait_for_step(first, 7)
        signal_tree(first.pid, signal.SIGSTOP)
        before = snapshot(d)
        second = run_train(d, *LIVE, "resume=auto", nproc=2)
        assert second.returncode != 0 and second.stderr.count(" is in use by pid ") == 1, second.stderr[-3000:]
        assert snapshot(d) == before
    finally:
        signal_tree(first.pid, signal.SIGKILL)
        first.wait()
    again = run_train(d, *LIVE, "resume=auto", nproc=2)
    assert again.returncode == 0, again.stderr[-3000:]
    assert [r["step"] for r in read_records(d / "metrics.jsonl")] == list(range(1, 201))
    bad = run_train(tmp_path / "bad" / "run", *LIVE, "train.batch_size=6", "train.micro_batches=2", nproc=2)
    assert bad.returncode != 0 and bad.stderr.count("ballast: config error: train.batch_size=6 ") == 1
    assert not (tmp_path / "bad").exists()
