"""precision=... through train.py, as a user runs it (active once train.py and conf/config.yaml use
precision/; until then these tests skip and say why)."""
from __future__ import annotations

import json
import math

import pytest

from helpers import ROOT, TINY, run_train
from stability.record import read_records

WIRED = "- precision:" in (ROOT / "conf" / "config.yaml").read_text() and "build_recipe" in (ROOT / "train.py").read_text()
pytestmark = pytest.mark.skipif(not WIRED, reason="train.py / conf/config.yaml not yet wired to precision/ (issue 4)")


@pytest.mark.parametrize("name", ["fp8_block", "fp16"])
def test_run_prints_and_saves_its_precision_table(tmp_path, name):
    r = run_train(tmp_path / "run", *TINY, f"precision={name}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"precision recipe: {name}" in r.stdout
    table = json.loads((tmp_path / "run" / "precision.json").read_text())
    assert table["recipe"] == name and "master weights" in table["rows"]
    assert (tmp_path / "run" / "precision.md").read_text().startswith(f"precision recipe: {name}")
    recs = read_records(tmp_path / "run" / "metrics.jsonl")
    assert all(math.isfinite(x["loss"]) for x in recs)
    if name == "fp16":
        scales = [x["loss_scale"] for x in recs]
        assert scales[0] == 65536.0 and all(math.log2(s).is_integer() and s <= 65536.0 for s in scales)


def test_te_fp8_without_cuda_exits_at_start_with_one_line(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    r = run_train(tmp_path / "run", *TINY, "precision=te_fp8")
    err = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode != 0 and len(err) == 1 and "pip install .[te]" in err[0], r.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
