"""How much of a step is matrix multiply, and how close to this machine's GEMM speed it runs.

    python -m bench.speed.gemm_floor [--steps 20] [overrides...]      # default: shakespeare_char
    python -m bench.speed.gemm_floor --out docs/results/gemm_floor.md threads=1 +experiment=shakespeare_char data.path=$TINYSHAKESPEARE

Profiles ballast's step (bench/config.py; compiled when the experiment is) with shapes recorded, then
times every GEMM shape of the step again in isolation (same shapes, contiguous operands, warm caches,
a fresh output each call as in the step), the shapes taking turns. The GEMM FLOPs are fixed by the
model's configuration, so the isolated sum is a floor no change to the code around the matmuls removes.
"""
from __future__ import annotations

import argparse
import os
import math
import statistics
import time
from collections import defaultdict

import torch

from bench.config import build_train_step, compose_config
from bench.report import Report

DTYPES = {"float": torch.float32, "c10::BFloat16": torch.bfloat16, "BFloat16": torch.bfloat16}
DEFAULT = ["+experiment=shakespeare_char", f"data.path={os.environ.get('TINYSHAKESPEARE', 'tinyshakespeare.txt')}"]


def operands(name: str, shapes: list[list[int]]) -> tuple[list[int], list[int]]:
    """(A, B) of C = A @ B: (b)addbmm's are its 2nd and 3rd inputs (the 1st is the added bias/accumulator)."""
    return (shapes[1], shapes[2]) if name in ("aten::addmm", "aten::baddbmm") else (shapes[0], shapes[1])


def isolated_us(shapes: list[tuple[tuple[int, ...], tuple[int, ...], str]], reps: int = 200) -> list[float]:
    """Median µs of each C = A @ B alone (in the step's dtype: Muon's NS5 may run in bfloat16); the shapes
    take turns, so a drift of the machine's speed during the measurement spreads over all of them instead
    of landing on one."""
    pairs = [(torch.randn(a).to(DTYPES[dt]), torch.randn(b).to(DTYPES[dt])) for a, b, dt in shapes]
    times: list[list[float]] = [[] for _ in pairs]
    for rep in range(reps + 20):
        for i, (a, b) in enumerate(pairs):
            t0 = time.perf_counter()
            torch.matmul(a, b)
            if rep >= 20:  # the first rounds warm caches and MKL's buffers
                times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) * 1e6 for t in times]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", help="also write the table (markdown) to this file")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    rep = Report("The step's GEMMs: in the step and alone", "python -m bench.speed.gemm_floor")
    step, _ = build_train_step(compose_config(args.overrides or DEFAULT))
    for _ in range(15):  # warm-up, and the compile when on
        step()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(args.steps):
        step()
    plain_ms = (time.perf_counter() - t0) / args.steps * 1e3
    # NOTE: process CPU time too: with threads=1 it is the step's compute, which a busy shared machine
    # inflates far less than wall time (the isolated GEMM medians below are short enough to dodge it)
    cpu_ms = (time.process_time() - c0) / args.steps * 1e3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        step_ms = (time.perf_counter() - t0) / args.steps * 1e3
    in_step = defaultdict(list)
    for e in prof.events():
        # bmm: Muon's batched Newton-Schulz (attention is SDPA, not bmm)
        if e.name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm") and e.input_shapes:
            a, b = operands(e.name, e.input_shapes)
            dt = (getattr(e, "input_dtypes", None) or ["float"] * 3)[1 if e.name in ("aten::addmm", "aten::baddbmm") else 0]
            in_step[(tuple(a), tuple(b), dt)].append(e.cpu_time_total)
    rep.add(f"Step {step_ms:.1f} ms under the profiler; per GEMM shape (M×K @ K×N), per step:", "")
    rep.columns("shape", "calls", "in step µs", "GF/s", "isolated µs", "GF/s")
    tot_step = tot_iso = tot_flop = 0.0
    rows = sorted(in_step.items(), key=lambda kv: -sum(kv[1]))
    for ((a, b, dt), us), iso in zip(rows, isolated_us([shape for shape, _ in rows])):
        calls = len(us) / args.steps
        flop = 2 * math.prod(a) * b[-1]  # (…, M, K) @ (…, K, N)
        med = statistics.median(us)
        tot_step += med * calls
        tot_iso += iso * calls
        tot_flop += flop * calls
        lead = f"{a[0]}×" if len(a) == 3 else ""
        rep.row(f"{lead}{a[-2]}×{a[-1]} @ {b[-2]}×{b[-1]}", f"{calls:.1f}", f"{med:.0f}", f"{flop / med / 1e3:.1f}",
                f"{iso:.0f}", f"{flop / iso / 1e3:.1f}")
    rep.add("", f"- GEMMs per step: {tot_flop / 1e9:.2f} GFLOP; {tot_step / 1e3:.1f} ms in the step "
            f"({tot_flop / tot_step / 1e3:.0f} GF/s), {tot_iso / 1e3:.1f} ms in isolation "
            f"({tot_flop / tot_iso / 1e3:.0f} GF/s); {torch.get_num_threads()} threads")
    rep.add(f"- step {plain_ms:.1f} ms unprofiled ({cpu_ms:.1f} ms of CPU) = {plain_ms / (tot_iso / 1e3):.2f}x "
            f"({cpu_ms / (tot_iso / 1e3):.2f}x in CPU time) its GEMM floor ({tot_iso / 1e3:.1f} ms)")
    rep.write(args.out)


if __name__ == "__main__":
    main()
