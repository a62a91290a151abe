"""labs.run as a user runs it, and the lowprec_gemm lab's measurements (quick sizes)."""
from __future__ import annotations

import json
import subprocess
import sys
import types

from helpers import HANG_S, ROOT, env
from labs import LABS
from labs import run as labs_run


def test_lowprec_gemm_quick_run_prints_saves_and_passes(tmp_path):
    r = subprocess.run([sys.executable, "-m", "labs.run", "--experiment", "lowprec_gemm", "--seed", "7", "--quick",
                        "--out", str(tmp_path)], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "fp8_block" in r.stdout and "relative loss gap" in r.stdout and "expected effect present" in r.stdout
    res = json.loads((tmp_path / "result.json").read_text())
    assert res["ok"] and all(res["checks"].values())
    f = res["formats"]
    # BF16 keeps 8 mantissa bits (≤ 2^-9 rounding), E4M3 3 (≤ 2^-4): an order of magnitude apart
    assert f["bf16"]["x_nonoutlier"] < 2 ** -9 < f["fp8_block"]["x_nonoutlier"] < 2 ** -4
    assert f["fp8_block"]["x_nonoutlier"] < f["fp8_tensor"]["x_nonoutlier"]
    assert f["fp8_block"]["wgrad_nonoutlier"] < f["fp8_tensor"]["wgrad_nonoutlier"]
    sweep = res["sweep"]
    # per-tensor error is flat while max/|x| fits E4M3's range, then climbs; the last point is far worse
    assert sweep["fp8_tensor"][-1] > 5 * sweep["fp8_tensor"][0]
    assert (tmp_path / "lowprec_gemm.png").stat().st_size > 5000


def test_dispatcher_lists_and_rejects_an_unknown_lab(capsys):
    assert labs_run.main(["--list"]) == 0
    assert "lowprec_gemm" in capsys.readouterr().out
    assert labs_run.main(["--experiment", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--experiment=nope" in err[0]


def test_dispatcher_exits_nonzero_when_the_effect_is_absent(tmp_path, monkeypatch):
    fake = types.ModuleType("labs._fake")
    fake.TITLE = "fake"
    fake.run = lambda seed, quick: {"ok": False, "checks": {"effect": False}, "table": "[FAIL] effect", "seed": seed}
    fake.plot = lambda result, path: path.write_bytes(b"png")
    monkeypatch.setitem(sys.modules, "labs._fake", fake)
    monkeypatch.setitem(LABS, "fake", "labs._fake")
    assert labs_run.main(["--experiment", "fake", "--seed", "3", "--out", str(tmp_path)]) == 1
    assert json.loads((tmp_path / "result.json").read_text()) == {"ok": False, "checks": {"effect": False},
                                                                 "table": "[FAIL] effect", "seed": 3}
