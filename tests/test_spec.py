"""The step's specification checks (spec/): a bug planted from outside each check's code (tests/plant.py) fails
that check at its step, naming the place; the steps before it pass."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, TINY, env

sys.path.insert(0, str(Path(__file__).parent))
from plant import FAULTS  # noqa: E402

S = 3
PLANTED = [*TINY, f"train.steps={S + 1}", "spec.every=1", "checkpoint.every=0", "logging.plot=false"]


def plant(tmp_path: Path, fault: str, *overrides: str, nproc: int = 1) -> list[dict]:
    d = tmp_path / fault
    script = [str(ROOT / "tests/plant.py"), fault, str(S), str(d), *PLANTED, *overrides]
    cmd = ([sys.executable, *script] if nproc == 1 else
           [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *script])
    r = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]


def first_failure(rec: dict) -> dict | None:
    fails = rec["spec"].get("fail") or []
    return fails[0] if fails else None


@pytest.mark.parametrize("fault", [f for f in FAULTS if f != "reduce_rank1"])
def test_a_planted_bug_fails_its_check_at_its_step(tmp_path, fault):
    check, where, kind = FAULTS[fault]
    recs = plant(tmp_path, fault)
    for rec in recs[:S - 1]:
        assert not rec["spec"].get("fail"), (rec["step"], rec["spec"]["fail"])
    got = first_failure(recs[S - 1])
    assert got is not None, f"step {S}: no check failed; misses {recs[S - 1]['spec']['miss']}"
    assert (got["check"], got["kind"]) == (check, kind), got
    if where is not None:
        assert got["where"] == where, got
    assert got["miss"] > 1 and got["class"]
