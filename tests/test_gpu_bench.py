"""bench/gpu/train.py and bench/gpu/table.py on the CPU (--dry-run): the code path bench/gpu/all.sh takes on a GPU."""
from __future__ import annotations

import json
import subprocess
import sys

from bench.gpu import mfu as gpu_mfu, table as gpu_table
from bench.report import HEADER, header_fields
from tests.helpers import HANG_S, ROOT, env


def test_gpu_train_dry_run_measures_train_py_and_the_table_reads_it(tmp_path, monkeypatch):
    out = tmp_path / "gpu_train.json"
    # NOTE: wandb and the plot off: they cost seconds at the start and the end of the run, none inside a step
    r = subprocess.run([sys.executable, "-m", "bench.gpu.train", "--dry-run", "--json", str(out),
                        "--out", str(tmp_path / "gpu_train.md"), "logging.wandb=disabled", "logging.plot=false"],
                       cwd=ROOT, env=env(), capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 0, r.stderr[-3000:]
    t = json.loads(out.read_text())
    every = t["defaults"]["telemetry_every"]
    assert t["steps"] == {"warmup": 2, "timed": every, "sync": every, "total": 3 + 2 * every}
    assert len(t["step_ms"]) == t["steps"]["total"]  # train.py ran every step and recorded it
    assert t["flops_per_token"] > 6 * t["matmul_params"]  # 6·N plus attention
    # the loop's wall time holds the StepRecord's step time and what follows it (the record, the sinks)
    assert 0 < t["loop_tokens_per_s"] <= 1.01 * t["tokens_per_s"]
    s = t["syncs"]
    assert s["method"].startswith("CPU") and len(s["per_step"]) == every
    assert s["telemetry_step"] > s["plain_step"] > 0  # a telemetry step reads its per-layer numbers too
    md = (tmp_path / "gpu_train.md").read_text()  # --out: the markdown under bench/report.py's header
    assert set(header_fields(md)) == set(HEADER) and "| the loop runs" in md

    monkeypatch.setattr(sys, "argv", ["gpu_mfu", "--dry-run", "--json", str(tmp_path / "gpu_mfu.json")])
    gpu_mfu.main()
    assert gpu_table.main([str(tmp_path), "--dry-run", "--out", str(tmp_path / "gpu_table.md")]) == 0
    text = (tmp_path / "gpu_table.md").read_text()
    assert "Dry run on a CPU" in text and set(header_fields(text)) == set(HEADER)
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}
    train = next(v for k, v in rows.items() if k.startswith("train.py"))
    assert "× the bare eager step" in train
    assert next(k for k in rows if k.startswith("host syncs"))
    # a part that left no JSON is a row that says so, not a row left out
    assert "not run: no fp8_block run in gpu_precision.json" in rows["fp8_block vs bf16 (bench.gpu.precision)"]
    assert "not run: no gpu_moe.json" in text and "not run: no quant_fused.json" in text


def test_spec_clean_dry_run_reports_every_check_and_the_table_reads_it(tmp_path):
    """bench/gpu/spec_clean.py's code path on the CPU: train.py runs clean, the JSON holds each check's worst
    err/tol (the reference checks among them at spec.every=2), and the table's row says no check failed."""
    out = tmp_path / "gpu_spec.json"
    r = subprocess.run([sys.executable, "-m", "bench.gpu.spec_clean", "--dry-run", "--only", "fp32", "--json", str(out)],
                       cwd=ROOT, env=env(), capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 0, r.stderr[-3000:]
    (run,) = json.loads(out.read_text())
    assert run["rc"] == 0 and run["steps"] == 4 and run["failed"] == 0 and run["ref_steps"] >= 2, run
    assert {"continuity", "data", "forward", "gradient", "optimizer"} <= set(run["miss"])
    assert 0 < max(run["miss"].values()) <= 1
    name, figure, _, ok = gpu_table.spec_row(json.loads(out.read_text()))
    assert figure.startswith("failed in 0") and ok == gpu_table.met(True), (name, figure, ok)
