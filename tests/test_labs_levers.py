"""The levers lab (labs/lever_headroom.py): with its seed (quick) a lever moves the largest stable LR and the
logit levers bound the attention logit; with the levers switched off the effect is reported absent.
Slow: ~30 s of CPU per quick sweep (more on a loaded machine)."""
from __future__ import annotations

import json

import pytest

from labs import LABS, lever_headroom as levers
from labs import run as labs_run

pytestmark = [pytest.mark.sweep, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def test_quick_lab_passes_with_its_seed(tmp_path, capsys):
    code = labs_run.main(["--experiment", "levers", "--seed", "7", "--quick", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0 and "expected effect present" in out, out[-3000:]
    r = json.loads((tmp_path / "result.json").read_text())
    assert LABS["levers"] == "labs.lever_headroom" and r["ok"] and all(r["checks"].values())
    base = r["sweeps"]["baseline"]["largest_stable_lr"]
    assert r["moved"] and all(lr > (base or 0) for lr in r["moved"].values())
    assert set(r["sweeps"]) == set(levers.LEVERS)
    for s in r["sweeps"].values():  # every point reports the four quantities the issue asks for
        for x in s["runs"]:
            assert {"diverged", "triggers", "gap", "logit_max"} <= set(x)
    # QK-clip's clip acted (heads were scaled) and Muon's row shows its owner table was used
    assert sum(x["heads_clipped"] for x in r["sweeps"]["QK-clip"]["runs"]) > 0
    assert (tmp_path / "levers.png").stat().st_size > 5000


def test_lab_reports_the_effect_absent_when_the_levers_are_off():
    off = {"baseline": {}, "QK-norm": {}, "QK-clip": {}, "Muon+QK-clip": {}}  # names kept, levers removed
    r = levers.run(7, quick=True, levers=off)
    assert not r["ok"]
    failed = {k for k, v in r["checks"].items() if not v}
    assert "at least one lever moves the largest stable LR above the baseline's" in failed
    assert any(k.startswith("QK-norm: largest attention logit") for k in failed)
    assert not r["moved"]
