"""The fused FP8 quantiser (precision/quant_fused.py) against the eager one (precision/quant.py): ms a call.

    python -m bench.speed.quant_fused                                  # CUDA if there is one, else the CPU
    python -m bench.speed.quant_fused --threads 1 --out docs/results/quant_fused.md
    python -m bench.speed.quant_fused --quick                          # the quickstart's shapes, 3 rounds
    python -m bench.speed.quant_fused --json bench/out/quant_fused.json  # also the rows as JSON

The operands the FP8 Linear quantises at the shapes of the quickstart model (d_model 128, SwiGLU 352, a
micro-batch of 8×128 tokens) and of a ~125M one (d_model 768, MLP 3072, 4×1024 tokens): activations and
output gradients in 1×128 tiles (x^T, dy^T for the weight gradient: transposed views, as the backward
passes them), weights in 128×128 blocks, one per-tensor row. Each row: one fused call first (it compiles
a graph where the row's kind, layout or size class is new, and checks it against eager once: the "first
call" column), then --rounds rounds, each timing eager then fused or fused then eager (alternating), the
figure being the median over rounds of the mean time a call. "bits equal" compares the E4M3 bytes and the
scales of the two. The Inductor cache starts empty (a temporary directory) unless --warm-cache, so the first
calls are the cold compile a fresh machine pays. Exit status 1 when a row's bits differ.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.report import Report

# (model, operand, kind, rows, cols, transposed): transposed rows are (rows, cols) views of a cols×rows tensor
QUICKSTART = [("quickstart", "forward x", "tile", 1024, 128, False),
              ("quickstart", "forward x (MLP down)", "tile", 1024, 352, False),
              ("quickstart", "wgrad dy^T (qkv)", "tile", 384, 1024, True),
              ("quickstart", "forward W (MLP up)", "block", 352, 128, False)]
M125 = [("~125M", "forward x", "tile", 4096, 768, False),
        ("~125M", "forward x (MLP down)", "tile", 4096, 3072, False),
        ("~125M", "wgrad x^T", "tile", 768, 4096, True),
        ("~125M", "forward W (MLP up)", "block", 3072, 768, False),
        ("~125M", "forward W (MLP down)", "block", 768, 3072, False),
        ("~125M", "per-tensor x", "tensor", 4096, 768, False)]


def per_call(fn, x, calls: int, sync) -> float:
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(x)
    sync()
    return (time.perf_counter() - t0) / calls


def bench_row(row, device: str, rounds: int, sync) -> dict:
    import torch

    from precision.quant import quantize
    from precision.quant_fused import quantize_fused, same_bits

    model, operand, kind, r, c, transposed = row
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(c, r, generator=g, device=device).t() if transposed else torch.randn(r, c, generator=g,
                                                                                          device=device)
    sync()
    t0 = time.perf_counter()
    fused_q = quantize_fused(x, kind)
    sync()
    first = time.perf_counter() - t0
    equal = same_bits(fused_q, quantize(x, kind))
    eager, fused = (lambda t: quantize(t, kind)), (lambda t: quantize_fused(t, kind))
    calls = max(1, round(0.02 / max(per_call(eager, x, 1, sync), 1e-6)))  # a timed stretch of ~20 ms
    times = {"eager": [], "fused": []}
    for i in range(rounds):
        order = ("eager", "fused") if i % 2 == 0 else ("fused", "eager")
        for arm in order:
            times[arm].append(per_call(eager if arm == "eager" else fused, x, calls, sync))
    ms = {arm: statistics.median(v) * 1e3 for arm, v in times.items()}
    shape = f"{r}×{c}" + (" (x^T view)" if transposed else "")
    return {"model": model, "operand": operand, "kind": kind, "shape": shape,
            "eager": ms["eager"], "fused": ms["fused"], "equal": equal, "first": first}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.speed.quant_fused", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda if available, else cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the CPU's kernels)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--quick", action="store_true", help="the quickstart's shapes only, 3 rounds")
    ap.add_argument("--warm-cache", action="store_true", help="keep Inductor's on-disk cache (default: a fresh one)")
    ap.add_argument("--out", type=Path, help="also write the table as markdown here")
    ap.add_argument("--json", type=Path, help="also write the rows as JSON here (bench/gpu/table.py reads them)")
    a = ap.parse_args(argv)
    cache = None if a.warm_cache else tempfile.TemporaryDirectory(prefix="quant_fused_inductor_")
    if cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache.name  # NOTE: before torch reads it: the cold compile
    import torch

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench.speed.quant_fused: --device cuda, but torch.cuda.is_available() is false")
    torch.set_num_threads(a.threads)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rounds = 3 if a.quick else a.rounds
    rep = Report("The fused FP8 quantiser", "python -m bench.speed.quant_fused", argv)  # the load average from here
    rows = []
    for row in QUICKSTART + ([] if a.quick else M125):
        rows.append(bench_row(row, device, rounds, sync))
        x = rows[-1]
        print(f"{x['model']} | {x['operand']} | {x['shape']}: eager {x['eager']:.3f} ms, fused {x['fused']:.3f} ms, "
              f"first fused call {x['first']:.2f} s, bits {'equal' if x['equal'] else 'DIFFER'}", flush=True)

    from precision.quant_fused import fused_status

    rep.add(f"Device {device}, {a.threads} thread{'s' * (a.threads != 1)}; median of {rounds} alternating rounds, "
            f"each the mean of a ~20 ms stretch of calls; Inductor cache "
            f"{'as found' if a.warm_cache else 'empty at the start'}.", "")
    rep.table(["model", "operand", "kind", "shape", "eager (ms)", "fused (ms)", "eager / fused", "bits equal",
               "first fused call (s)"],
              [(x["model"], x["operand"], x["kind"], x["shape"], f"{x['eager']:.3f}", f"{x['fused']:.3f}",
                f"{x['eager'] / x['fused']:.2f}", "yes" if x["equal"] else "NO", f"{x['first']:.2f}") for x in rows])
    rep.add("How each compiled function ran (`precision.quant_fused.fused_status`):", "",
            *(f"- {k}: {v}" for k, v in fused_status().items()))
    rep.write(a.out)
    if a.json:
        a.json.write_text(json.dumps({"device": device, "rounds": rounds, "rows": rows}, indent=1) + "\n")
    if cache:
        cache.cleanup()
    return 0 if all(x["equal"] for x in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
