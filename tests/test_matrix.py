"""The combination matrix of issue 13: {dense, MoE} × {1 process, DDP 2, FSDP2 2} × {fp32, bf16, fp8_block}
× {guard log, skip, rollback from memory, rollback from disk} × {a save + resume inside the incident, or
not}. Each cell is a short tiny run with a planted spike (a NaN in one sublayer's output at step F: the
pre-update detector fires on it at once, so every guard action has something to act on) and checks:

  - the run finishes, or stops with one line;
  - rollbacks per incident <= guard.rollback.max_rollbacks, step executions <= STEPS + max_rollbacks ·
    REWIND (the farthest a rollback can rewind here: ring keep · snapshot_every + margin, or
    checkpoint.every + margin from disk);
  - resumed from a save inside the incident, the run ends bit-identical to straight through (1 process;
    1e-6 relative on 2, the gloo reduction order);
  - the StepRecords' precision recipe is the configured one;
  - a vetoed step moves nothing: update ratio 0 on that step (parameters), Adam's step count +1 over
    the two steps around it (moments untouched), MoE bias exactly the next step's own update.
Invalid cells are refused at config time with one line. The full matrix is `-m sweep`; SAMPLE's one-process
cells run by default, its 2-process cells under `-m slow`. bf16 autocast is ~30× slower on a CPU: its cells are
as tiny as the rest.
"""
from __future__ import annotations

import itertools
import json

import pytest
import torch

from checkpoint import publish
from checkpoint.state import read_tensors
from checkpoint.verify import compare_final
from helpers import TINY, run_train
from stability.events import read_events

STEPS, F, A = 10, 6, 7  # steps, the fault step, the save before a resume (inside the incident: it opens at F)
MAX_RB, KEEP, SNAP, MARGIN, EVERY = 1, 2, 2, 1, 2
REWIND = max(KEEP * SNAP + MARGIN, EVERY + MARGIN) + 1
BASE = [*TINY, f"train.steps={STEPS}", "telemetry.every=1", "fault=nan_activation", f"fault.step={F}",
        "checkpoint.mode=sync", "checkpoint.keep_last=20", f"guard.rollback.max_rollbacks={MAX_RB}",
        f"guard.rollback.keep={KEEP}", f"guard.rollback.snapshot_every={SNAP}", f"guard.rollback.margin={MARGIN}",
        "guard.anticipatory.quiet_steps=4", "guard.anticipatory.window=6"]
MODELS = {"dense": ["model=dense_tiny"],
          "moe": ["model=moe_tiny", "model.moe.n_experts=4", "model.moe.expert_hidden=16",
                  "model.moe.bias_update_speed=0.01"]}
WORLDS = {"1proc": (1, []), "ddp2": (2, ["parallel.mode=ddp"]), "fsdp2": (2, ["parallel=fsdp"])}
PRECISIONS = ("fp32", "bf16", "fp8_block")
GUARDS = {"log": ["guard=log"], "skip": ["guard=skip"], "rb_memory": ["guard=rollback"],
          "rb_disk": ["guard=rollback", "guard.rollback.source=disk"]}
CELLS = list(itertools.product(MODELS, WORLDS, PRECISIONS, GUARDS, ("straight", "resume")))
# NOTE: the MoE resume cell runs FSDP2: a resumed run's first all-gather comes inside the routing-only
# forward, the combination that once broke (inference_mode buffers updated in place by the next step)
SAMPLE = [("dense", "1proc", "fp32", "skip", "straight"), ("moe", "fsdp2", "fp32", "rb_memory", "resume"),
          ("moe", "ddp2", "fp8_block", "rb_disk", "straight"), ("moe", "1proc", "bf16", "skip", "straight")]


def overrides(model, world, precision, guard) -> tuple[int, list[str]]:
    nproc, par = WORLDS[world]
    ck = [f"checkpoint.every={EVERY}"] if guard in ("rb_disk", "skip") else []
    return nproc, [*BASE, *MODELS[model], *par, f"precision={precision}", *GUARDS[guard], *ck]


def records(run) -> list[dict]:
    with open(run / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def check_cell(tmp_path, model, world, precision, guard, resume):
    nproc, args = overrides(model, world, precision, guard)
    run = tmp_path / "run"
    if resume == "resume":  # part A ends at the save, inside the incident; part B resumes in a fresh process
        r = run_train(run, *args, f"checkpoint.stop_after={A}", nproc=nproc)
        assert r.returncode == 0, r.stderr[-3000:]
        r = run_train(run, *args, f"checkpoint.every={EVERY}", "resume=latest", nproc=nproc)
    else:
        r = run_train(run, *args, nproc=nproc)
    assert "outlived destroy()" not in r.stderr, r.stderr[-3000:]  # the group died in parallel.dist.destroy
    if r.returncode != 0:  # a stop must be one line, never a traceback
        lines = r.stderr.strip().splitlines()
        assert r.returncode in (2, 3) and lines and lines[-1].startswith("ballast:"), r.stderr[-3000:]
        assert not any("Traceback" in x for x in lines), r.stderr[-3000:]
        return
    recs, events = records(run), read_events(run / "events.jsonl")
    assert json.loads((run / "precision.json").read_text())["recipe"] == precision
    # budget and bound
    kinds = [e["kind"] for e in events]
    assert kinds.count("fault") == 1 and any(e["kind"] == "trigger" and e["step"] == F for e in events)
    incidents = max(1, kinds.count("incident_closed"))
    assert kinds.count("rollback") <= MAX_RB * incidents
    assert all(e["rollbacks"] <= MAX_RB for e in events if e["kind"] == "incident_closed")
    executions = len(recs) + (len(records_of(run, "metrics.superseded.jsonl")))
    assert executions <= STEPS + MAX_RB * REWIND * incidents + (STEPS if resume == "resume" else 0)
    assert sorted({x["step"] for x in recs}) == list(range(1, STEPS + 1))
    if guard.startswith("rb"):
        assert "rollback" in kinds
    # skipped steps move nothing
    vetoed = [x for x in recs if x["guard"]["vetoed"] and not x["guard"]["rollback"]]
    if guard == "skip":
        assert [x["step"] for x in vetoed] == [F]
        assert vetoed[0]["update_ratio_max"] == 0.0  # parameters unchanged
        check_skip_moved_nothing(run, model, {x["step"]: x for x in recs})
    # resume inside the incident: bit-identical to straight through
    if resume == "resume":
        straight = tmp_path / "straight"
        r = run_train(straight, *args, f"checkpoint.every={EVERY}", nproc=nproc)
        assert r.returncode == 0, r.stderr[-3000:]
        final = publish.step_name(STEPS)
        assert compare_final(straight / "checkpoints" / final, run / "checkpoints" / final, 0.0 if nproc == 1 else 1e-6)
        assert [(e["step"], e["kind"]) for e in read_events(straight / "events.jsonl") if e["step"] > A] == \
               [(e["step"], e["kind"]) for e in events if e["step"] > A and e["kind"] != "checkpoint"]


def records_of(run, name) -> list[dict]:
    p = run / name
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else []


def check_skip_moved_nothing(run, model, by_step):
    """Checkpoints at F-... around the vetoed step F (every EVERY steps; F's own save is withheld): Adam's
    step count advanced once per applied update, and the MoE bias by exactly the applied steps' updates."""
    ck = run / "checkpoints"
    lo, hi = F - F % EVERY, F - F % EVERY + EVERY  # the saves around F
    if lo == F:
        lo, hi = F - EVERY, F + EVERY
    a, b = read_tensors(ck / publish.step_name(lo)), read_tensors(ck / publish.step_name(hi))
    steps_a = {k: v for k, v in a.items() if k.endswith(".step")}
    assert steps_a, "no Adam step counts in the checkpoint"
    for k, v in steps_a.items():
        assert b[k].item() - v.item() == hi - lo - 1, k  # F's update was never applied
    if model == "moe":
        gamma = 0.01
        for name in (k for k in a if k.endswith("bias_E")):
            bias = a[name].clone()
            layer = name.split(".")[2]
            for s in range(lo + 1, hi + 1):
                if s == F:
                    continue
                load = torch.tensor(by_step[s]["moe"][layer]["load"], dtype=torch.float32)
                bias += gamma * torch.sign(load.mean() - load)
            assert torch.equal(bias, b[name]), name


def cell_id(cell):
    return "-".join(cell)


@pytest.mark.parametrize("cell", [pytest.param(c, marks=pytest.mark.slow) if WORLDS[c[1]][0] > 1 else c
                                  for c in SAMPLE], ids=cell_id)
def test_matrix_sample(tmp_path, cell):
    check_cell(tmp_path, *cell)


@pytest.mark.sweep
@pytest.mark.parametrize("cell", [c for c in CELLS if c not in SAMPLE], ids=cell_id)
def test_matrix_full(tmp_path, cell):
    check_cell(tmp_path, *cell)


def test_an_invalid_cell_is_refused_at_config_time(tmp_path):
    """Rollback from disk with no checkpoints to roll back to: refused before the first step, in one line,
    leaving nothing behind (it used to fail only when the guard first fired)."""
    run = tmp_path / "run"
    r = run_train(run, *BASE, "guard=rollback", "guard.rollback.source=disk", "checkpoint.every=0")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "guard.rollback.source=disk" in lines[0] and "checkpoint.every" in lines[0]
    assert not run.exists()
