"""The specification checks on a GPU: clean runs of train.py under every recipe pass every check they run.

    python -m bench.gpu.spec_clean --out bench/out/gpu_spec.md --json bench/out/gpu_spec.json   # on the GPU
    python -m bench.gpu.spec_clean --dry-run                                                     # the CPU, 4 steps

The tolerances of spec/tolerance.py are derived from the precision recipe (the inputs' unit roundoff, FP32
accumulation of K terms), never fitted; on a CPU the suite holds them (tests/test_spec.py's clean runs). A GPU
is where that derivation meets other kernels: cuBLAS's split-K and its reduced-precision reductions for BF16
and FP16 (torch.backends.cuda.matmul.allow_*_reduced_precision_reduction, on by default), fused attention,
real FP8 GEMMs, Transformer Engine. Each configuration runs train.py as a user starts it (device=cuda, a child
process) with the reference checks every `--every` steps, and the table says, per configuration: the steps,
the reference steps, the steps with a failed check (the first failure's check, kind, place and err/tol), each
check's worst miss (err/tol; a check fails above 1: the headroom the derivation leaves on this device), and
the step's and the checks' host time.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import ROOT
from bench.report import Report

QUIET = ["logging.wandb=disabled", "logging.progress=false", "logging.plot=false", "checkpoint.every=0",
         "train.eval_every=1000"]
# name -> overrides: the recipes and paths tests/test_spec.py's clean runs cover on a CPU, here on CUDA
CONFIGS = {
    "fp32": [],
    "bf16": ["precision=bf16"],
    "fp16": ["precision=fp16"],
    "fp8_block": ["precision=fp8_block"],
    "te_fp8": ["precision=te_fp8"],
    "moe_bf16": ["model=moe_tiny", "precision=bf16"],
    "muon_bf16": ["optim=muon", "precision=bf16"],
    "act_ckpt_bf16": ["train.activation_checkpointing=full", "precision=bf16"],
    "compiled_bf16": ["train.compile=true", "precision=bf16"],
    # tests/test_spec.py's rollback: an LR spike the lr check fails before the update, a rollback, and the
    # replayed steps under anticipatory routing
    "rollback_anticipatory": ["model=moe_tiny", "precision=bf16", "fault=lr_spike", "fault.step=10",
                              "fault.lr_spike.steps=1", "guard=rollback", "guard.rollback.source=memory",
                              "guard.rollback.margin=0", "guard.rollback.snapshot_every=1"],
}
PLANTED = {"rollback_anticipatory": (10, "lr")}  # the one failure a configuration plants: (step, check)


def has_te() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def run(name: str, overrides: list[str], steps: int, every: int, device: str, workdir: Path) -> dict:
    d = workdir / name
    cmd = [sys.executable, "train.py", f"device={device}", f"train.steps={steps}", f"spec.every={every}",
           f"hydra.run.dir={d}", *QUIET, *overrides]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "WANDB_MODE": "disabled"})
    out = {"name": name, "overrides": overrides, "rc": p.returncode}
    recs = []
    if (d / "metrics.jsonl").exists():
        recs = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]
    if p.returncode != 0 or not recs:
        out["error"] = (p.stderr.strip().splitlines() or ["(no output)"])[-1][:300]
        return out
    miss: dict[str, float] = {}
    failed = []
    for r in recs:
        s = r.get("spec") or {}
        for k, v in (s.get("miss") or {}).items():
            if v is not None and PLANTED.get(name) != (r["step"], k):
                miss[k] = max(miss.get(k, 0.0), float(v))
        if s.get("fail") and PLANTED.get(name) != (r["step"], s["fail"][0]["check"]):
            failed.append((r["step"], s["fail"][0]))
    first = None
    if failed:
        step, f = failed[0]
        first = f"step {step}: {f.get('check')}/{f.get('kind')} at {f.get('where') or f.get('layer')}, " \
                f"err/tol {float(f['err']) / float(f['tol']):.3g}" if f.get("tol") else f"step {step}: {f}"
    timed = recs[2:] or recs
    out.update(steps=len(recs), ref_steps=sum("forward" in ((r.get("spec") or {}).get("miss") or {}) for r in recs),
               failed=len(failed), first=first, miss=miss,
               planted_seen=any(PLANTED.get(name) == (r["step"], f["check"]) for r in recs
                                for f in (r.get("spec") or {}).get("fail") or []) if name in PLANTED else None,
               routing_on=sum(bool((r.get("routing") or {}).get("on")) for r in recs),
               ms_step=1e3 * statistics.median(r["time_s"]["total"] for r in timed),
               ms_spec=1e3 * statistics.median(r["time_s"].get("spec", 0.0) for r in timed))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, help="steps a configuration (default 40; 4 under --dry-run)")
    ap.add_argument("--every", type=int, default=2, help="spec.every: the reference checks' cadence")
    ap.add_argument("--only", nargs="*", help="configurations to run (default: all)")
    ap.add_argument("--dry-run", action="store_true", help="on the CPU, 4 steps, fp32 and bf16 only")
    ap.add_argument("--json")
    ap.add_argument("--out")
    args = ap.parse_args()
    import torch
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench.gpu.spec_clean: no CUDA GPU here (--dry-run runs the code on the CPU)")
    names = args.only or (["fp32", "bf16"] if args.dry_run else list(CONFIGS))
    steps = args.steps or (4 if args.dry_run else 40)
    rep = Report("The specification checks on a GPU: clean runs", "python -m bench.gpu.spec_clean", sys.argv[1:])
    rep.add(f"train.py on {device}, {steps} steps a configuration, reference checks every {args.every} steps "
            f"(spec.every); miss = err/tol, worst over the run (a check fails above 1). "
            f"matmul reduced-precision reductions: bf16 {torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction}, "
            f"fp16 {torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction} (torch's defaults)")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            if name == "te_fp8" and not has_te():
                results.append({"name": name, "rc": None, "error": "transformer_engine is not installed"})
                continue
            r = run(name, CONFIGS[name], steps, args.every, device, Path(tmp))
            results.append(r)
            print(json.dumps(r), flush=True)
    checks = sorted({k for r in results for k in r.get("miss", {})})
    rep.add("rollback_anticipatory plants an LR spike at step 10 (its lr failure is not counted): "
            + ", ".join(f"planted failure seen {r.get('planted_seen')}, steps with anticipatory routing on "
                        f"{r.get('routing_on')}" for r in results if r["name"] in PLANTED))
    rep.table(["config", "steps", "ref steps", "failed", "first failure", "ms/step", "ms in checks"]
              + [f"miss {c}" for c in checks],
              [[r["name"], r.get("steps", "-"), r.get("ref_steps", "-"), r.get("failed", "-"),
                r.get("first") or r.get("error") or "-",
                f"{r['ms_step']:.1f}" if "ms_step" in r else "-", f"{r['ms_spec']:.1f}" if "ms_spec" in r else "-"]
               + [f"{r['miss'][c]:.2g}" if c in r.get("miss", {}) else "-" for c in checks] for r in results])
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))
    rep.write(args.out)
    bad = [r["name"] for r in results if r.get("rc") not in (0, None) or r.get("failed") or r.get("planted_seen") is False]
    if bad:
        print(f"bench.gpu.spec_clean: a failed check or run in {', '.join(bad)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
