"""Shared test utilities: run train.py as a user would, in a subprocess, into a temporary run dir."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A hang guard for subprocesses, never a speed limit: ~10x what the slowest child needs on an idle
# 2-core machine, so a loaded machine (the suite under bench/tools/stress_suite.sh) never trips it.
HANG_S = 1800

# Small enough for a few seconds of CPU per run.
TINY = ["train.steps=6", "train.eval_every=3", "train.eval_samples=32", "train.eval_batch_size=16",
        "train.batch_size=8", "train.micro_batches=2", "logging.wandb=disabled", "logging.progress=false",
        "logging.plot=true", "data.seq_len=32", "data.min_doc_len=4", "model.d_model=32", "model.n_heads=2",
        "model.n_layers=2", "threads=1", "optim.schedule.warmup_steps=2"]


def spawn(fn, args: tuple, nprocs: int = 2, timeout: float = HANG_S) -> None:
    """torch.multiprocessing.spawn(fn, args, nprocs), except that a hang fails the test instead of the suite.

    NOTE: join=True has no timeout, and a worker stuck in a collective or at exit (a deadlocked
    process-group destructor) would stall the whole run; the guard is HANG_S, never a speed limit."""
    import pytest
    import torch.multiprocessing as mp

    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1.0):  # re-raises a worker's exception with its traceback
        if time.monotonic() > deadline:
            alive = [i for i, p in enumerate(ctx.processes) if p.is_alive()]
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"{fn.__name__}: ranks {alive} of {nprocs} still running after {timeout:.0f} s (a hang)")


def in_group(rank: int, world: int, store: str, body):
    """body(Dist) in a gloo group of `world` processes, then the group destroyed as train.py destroys
    it (parallel.destroy, once body's models are gone); body's result.

    Checks that the group died inside destroy(): a group that outlives it dies at interpreter exit,
    where a gloo worker asking for the GIL aborts the process (SIGABRT, parallel.dist.destroy). Told
    by OS threads: gloo's workers start at init and must be gone after destroy()."""
    import torch
    import torch.distributed as tdist

    from parallel import Dist, destroy

    torch.set_num_threads(1)
    tdist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    with_group = _os_threads()
    try:
        result = body(Dist(rank, world, rank, torch.device("cpu"), "gloo"))
    finally:
        destroy()
    if with_group is not None:
        assert _os_threads() < with_group, "gloo's threads outlived destroy(): something still owns the group"
    return result


def _os_threads() -> int | None:
    task = Path("/proc/self/task")  # Linux; elsewhere the check is skipped
    return len(list(task.iterdir())) if task.is_dir() else None


def env() -> dict:
    e = dict(os.environ)
    e.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", WANDB_MODE="disabled", PYTHONUNBUFFERED="1",
             OMP_NUM_THREADS="1")
    return e


def run_train(run_dir: Path, *overrides: str, nproc: int = 1, timeout: float = HANG_S) -> subprocess.CompletedProcess:
    args = [f"hydra.run.dir={run_dir}", *overrides]
    if nproc == 1:
        cmd = [sys.executable, "train.py", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "train.py", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)


# Fault drills, shrunk: a tiny mixed model; the schedule spans 400 steps (so rho and the loss are
# near-stationary around the fault step S), and checkpoint.stop_after ends the run a few steps after it.
S = 80
SMALL = ["train.eval_every=1000", "train.eval_samples=32", "train.eval_batch_size=16", "train.batch_size=8",
         "logging.wandb=disabled", "logging.progress=false", "logging.plot=false", "data.seq_len=32",
         "data.min_doc_len=4", "model.d_model=32", "model.n_heads=2", "model.n_layers=2", "threads=1",
         "optim.schedule.warmup_steps=10", "guard.detector.warmup=40",
         # NOTE: equal weights, not the quickstart's 0.75 copy: with 3 copy documents in 4 this tiny model is
         # still near-uniform at step S (the markov source barely learned), so shuffled labels move no loss.
         "data.sources.0.weight=0.5", "data.sources.1.weight=0.5"]
# NOTE: lr 3e-3 (the quickstart's): the full-size drills run at 1e-3 to stay quiet before their fault, but
# this tiny model is quiet at 3e-3 (its healthy twin has no trigger) and at 1e-3 its copy head's first
# spike lands at step ~52, before S.
DRILL = [f"fault.step={S}", "train.steps=400", f"checkpoint.stop_after={S + 4}", "optim.lr=3e-3", *SMALL]


def drill_nproc(kind: str) -> int:
    """The processes a drill needs (its module declares it: stability/drills/)."""
    from stability.drills import registry
    return registry()[kind].min_world


# the drills a user runs as `+experiment=drill_<kind>`
EXPERIMENT_DRILLS = sorted(p.stem.removeprefix("drill_") for p in (ROOT / "conf/experiment").glob("drill_*.yaml"))
SINGLE_PROCESS_DRILLS = [k for k in EXPERIMENT_DRILLS if drill_nproc(k) == 1]


class DrillRuns:
    """Each drill (and one healthy twin) trains once per test session, shared by test_drills.py and
    test_doctor.py; the first request trains every single-process drill, two at a time (2 cores)."""

    def __init__(self, root: Path):
        self.root, self.done = root, {}

    def _train(self, name: str) -> Path:
        d = self.root / name
        if name == "healthy":
            r = run_train(d, "train.steps=400", f"checkpoint.stop_after={S + 4}", "guard=rollback",
                          "telemetry.every=1", *SMALL)
        else:
            r = run_train(d, f"+experiment=drill_{name}", *DRILL, nproc=drill_nproc(name))
        assert r.returncode == 0, f"{name}: {r.stderr[-3000:]}"
        return d

    def get(self, name: str) -> Path:
        if not self.done and name in ["healthy", *SINGLE_PROCESS_DRILLS]:
            from concurrent.futures import ThreadPoolExecutor

            names = ["healthy", *SINGLE_PROCESS_DRILLS]
            with ThreadPoolExecutor(max_workers=2) as pool:
                self.done.update(zip(names, pool.map(self._train, names)))
        if name not in self.done:
            self.done[name] = self._train(name)
        return self.done[name]



def guard_config(d: dict):
    """A GuardConfig from a test's nested dict, through the dataclasses (each checks its own keys)."""
    from stability.config import AnticipatoryConfig, DetectorConfig, GuardConfig, RollbackConfig

    parts = {"detector": DetectorConfig, "rollback": RollbackConfig, "anticipatory": AnticipatoryConfig}
    return GuardConfig(**{k: parts[k](**v) if k in parts else v for k, v in d.items()})


def data_config(d: dict):
    """A DataConfig from a test's dict (its sources as SourceConfigs), through the dataclasses' checks."""
    from data.config import DataConfig, SourceConfig

    return DataConfig(**{**d, **({"sources": [SourceConfig(**s) for s in d["sources"]]} if "sources" in d else {})})


def precision_config(d: dict):
    """A PrecisionConfig from a test's dict (loss_scale as a LossScaleConfig), through the dataclasses' checks."""
    from optim.config import LossScaleConfig
    from precision.config import PrecisionConfig

    return PrecisionConfig(**{**d, **({"loss_scale": LossScaleConfig(**d["loss_scale"])} if "loss_scale" in d else {})})


def model_config(d: dict):
    """A ModelConfig from a test's dict (moe as a MoEConfig), through the dataclasses' checks."""
    from model.config import ModelConfig, MoEConfig

    return ModelConfig(**{**d, **({"moe": MoEConfig(**d["moe"])} if d.get("moe") is not None else {})})
