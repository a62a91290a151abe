"""Nothing lost, nothing silent (issue 38): a write that fails, as a disk that fills fails it, at each phase of a
run (the start, a checkpoint's files, its marker, the records) stops the run with one line and a distinct exit
status; no partial .tmp-* directory and no run.lock is left; the last good checkpoint is intact, named, and a
resume=auto from it finishes the run. A checkpoint write that raises what DCP raises (a BaseException) is a
failure too, never exit 0.

The faults are injected where the writes happen (tests/inject_train.py): train.py runs otherwise unchanged. Each
case is a run and its resume: a checkpoint's files and the records in the default suite, the other phases and
the 2-process save under `-m slow`.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from checkpoint import publish
from helpers import HANG_S, ROOT, TINY, env, run_train
from run.lifecycle import Exit
from stability.record import read_records

RUN = [*TINY, "checkpoint.every=2", "logging.plot=false"]  # 6 steps, saves at 2, 4, 6


def injected(run_dir: Path, phase: str, at: int, *overrides: str, nproc: int = 1,
             ranks: str | None = None) -> subprocess.CompletedProcess:
    lead = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                f"--nproc_per_node={nproc}"]
    return subprocess.run([*lead, str(ROOT / "tests" / "inject_train.py"), phase, str(at), f"hydra.run.dir={run_dir}",
                           *RUN, *overrides], cwd=ROOT, env={**env(), **({"INJECT_RANKS": ranks} if ranks else {})},
                          capture_output=True, text=True, timeout=HANG_S)


def one_line(r: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("ballast: "), r.stderr[-3000:]
    return lines[0]


def nothing_left(run_dir: Path) -> None:
    """No partial temp directory or file, no lock: the next start finds the directory as a finished one."""
    left = [p.name for p in run_dir.rglob(".*tmp*")] + [p.name for p in run_dir.rglob("run.lock")]
    assert not left, left


def resumes(run_dir: Path, good: str) -> None:
    """The named checkpoint is complete (every file against its marker), and resume=auto finishes from it."""
    assert publish.check(run_dir / "checkpoints" / good) is None
    r = run_train(run_dir, *RUN, "resume=auto")
    assert r.returncode == 0 and f"resumed from {run_dir / 'checkpoints' / good}" in r.stdout, r.stderr[-3000:]
    assert [x["step"] for x in read_records(run_dir / "metrics.jsonl")] == list(range(1, 7))


@pytest.mark.parametrize("phase, code, cause", [
    ("save", Exit.NO_SPACE, "disk full"),  # inside DCP, which raises its CheckpointException: a BaseException
    # a BaseException subclass raised by the save itself
    pytest.param("save_base", Exit.IO, "OSError: [Errno 5]", marks=pytest.mark.slow),
    pytest.param("save_io", Exit.IO, "OSError: [Errno 5]", marks=pytest.mark.slow),
    pytest.param("marker", Exit.NO_SPACE, "disk full", marks=pytest.mark.slow),
])
def test_a_checkpoint_that_cannot_be_written_stops_the_run_in_one_line(tmp_path, phase, code, cause):
    """The save of step 4 fails in the background: the run stops non-zero at the next step boundary, naming
    step_000004, its cause and step_000002 as the last good checkpoint, checked against its marker."""
    run = tmp_path / "run"
    r = injected(run, phase, 2)
    line = one_line(r)
    assert r.returncode == code, (r.returncode, line)
    assert "checkpoint step_000004 was not saved" in line and cause in line, line
    assert "step_000002 is intact" in line and "resume=auto" in line, line
    nothing_left(run)
    assert publish.read_latest(run / "checkpoints") == "step_000002"
    resumes(run, "step_000002")


@pytest.mark.slow
def test_the_final_save_failing_is_not_exit_0(tmp_path):
    """The last checkpoint (train.steps) fails after the last step: the run's final lines are not its success."""
    run = tmp_path / "run"
    r = injected(run, "save", 3)
    line = one_line(r)
    assert r.returncode == Exit.NO_SPACE and "checkpoint step_000006 was not saved" in line, line
    assert "step_000004 is intact" in line and "final eval loss" not in r.stdout, r.stdout[-2000:]
    nothing_left(run)
    resumes(run, "step_000004")


def test_a_full_disk_while_writing_the_records_is_one_line(tmp_path):
    """metrics.jsonl's line of step 5 does not fit: one line naming the file, exit 5; the torn line is set
    aside by the resume (metrics.jsonl stays the run's story)."""
    run = tmp_path / "run"
    r = injected(run, "records", 5)
    line = one_line(r)
    assert r.returncode == Exit.NO_SPACE and "disk full after step 5" in line and "metrics.jsonl" in line, line
    assert "step_000004 is intact" in line, line
    nothing_left(run)
    resumes(run, "step_000004")


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["lock", "header"])
def test_a_resume_on_a_full_disk_is_one_line_and_leaves_no_lock(tmp_path, phase):
    """The disk is still full when the scheduler restarts the job: one line, exit 5, no run.lock, and the
    header files a resume rewrites are intact (written beside, then renamed)."""
    run = tmp_path / "run"
    assert run_train(run, *RUN, "checkpoint.stop_after=4").returncode == 0
    config = (run / "config.yaml").read_bytes()
    r = injected(run, phase, 1, "resume=auto")
    line = one_line(r)
    assert r.returncode == Exit.NO_SPACE and "disk full" in line, line
    assert (run / "config.yaml").read_bytes() == config
    nothing_left(run)
    resumes(run, "step_000004")


@pytest.mark.slow  # a 2-process launch and its resume
@pytest.mark.distributed
def test_one_rank_failing_a_save_stops_every_rank_at_the_next_save(tmp_path):
    """Two processes, rank 1's shard of step 4 cannot be written (EIO): the ranks agree that step_000004 did not
    publish, train on in step until the next save (step 6: the saves are collectives, so every rank stops at
    the same one), and stop there non-zero; rank 0 says it once; a resume=auto on 2 processes finishes."""
    run = tmp_path / "run"
    r = injected(run, "save_io", 2, "train.batch_size=8", "train.micro_batches=1", nproc=2, ranks="1")
    said = [ln for ln in r.stderr.splitlines() if ln.startswith("ballast: ")]
    assert r.returncode != 0 and len(said) == 1, r.stderr[-3000:]
    assert "checkpoint step_000004 was not saved" in said[0] and "step_000002 is intact" in said[0], said[0]
    assert "final eval loss" not in r.stdout, r.stdout[-3000:]
    nothing_left(run)
    assert publish.read_latest(run / "checkpoints") == "step_000002"
    again = run_train(run, *RUN, "train.batch_size=8", "train.micro_batches=1", "resume=auto", nproc=2)
    assert again.returncode == 0, again.stderr[-3000:]
    assert [x["step"] for x in read_records(run / "metrics.jsonl")] == list(range(1, 7))
