"""One markdown table of every GPU check (part, figure, goal, met?) from the JSON that bench/gpu/all.sh's parts wrote.

    python -m bench.gpu.table bench/out --out bench/out/gpu_table.md  # reads DIR/gpu_*.json, quant_fused.json, ...
    python -m bench.gpu.table --versions                              # the device and versions line, alone

Reads what each part left in DIR (a missing file is a row that says so): gpu_mfu.json (bench.gpu.mfu, the
bare step), gpu_train.json (bench.gpu.train, train.py itself), gpu_precision.json (bench.gpu.precision),
gpu_moe.json (bench.speed.moe_speed --json), quant_fused.json (bench.speed.quant_fused --json), gpu_spec.json
(bench.gpu.spec_clean) and gpu_parts.tsv (each part's exit status, seconds and cap, from bench/gpu/all.sh). The
goals are read from the scripts that declare them.
Prints the table under the device, torch, CUDA and Transformer Engine versions; --out writes it (markdown)
under bench/report.py's header (machine, date, commit, load average, command), as docs/results/ keeps it.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from bench import ROOT
from bench.gpu.mfu import MFU_GOAL
from bench.gpu.precision import LOSS_GAP_GOAL, SPEEDUP_GOAL
from bench.gpu.train import SYNC_GOAL, VS_BARE_GOAL
from bench.report import Report


def versions() -> str:
    import torch

    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA"
    try:
        import transformer_engine as te
        te_v = te.__version__
    except Exception as e:  # noqa: BLE001 - any import failure means: not usable here
        te_v = f"not importable ({type(e).__name__})"
    return f"device {dev} | torch {torch.__version__} | CUDA {torch.version.cuda} | Transformer Engine {te_v}"


def load(d: Path, name: str):
    p = d / name
    return json.loads(p.read_text()) if p.is_file() else None


def met(ok: bool | None) -> str:
    return "—" if ok is None else ("yes" if ok else "**no**")


def pct(x: float) -> str:
    return f"{100 * x:.1f} %"


MISSING = "not run: no {}"
Row = tuple[str, str, str, str]  # part, figure, goal, met?


def bare_row(arms: list[dict] | None) -> Row:
    goal = f"MFU ≥ {MFU_GOAL:.0%}"
    best = max(arms or [], key=lambda a: a["mfu"], default=None)
    if not best:
        return "BF16 step, bare (bench.gpu.mfu)", MISSING.format("gpu_mfu.json"), goal, met(None)
    return (f"BF16 step, bare ({best['arm']}; bench.gpu.mfu), {best['matmul_params'] / 1e6:.3g}M, "
            f"batch {best['batch']}×{best['seq_len']}",
            f"{best['tokens_per_s']:,.0f} tok/s, {best['tflops']:.0f} TFLOPS, MFU {pct(best['mfu'])}",
            goal, met(best["mfu"] >= MFU_GOAL))


def train_rows(t: dict | None, arms: list[dict] | None) -> list[Row]:
    goal = f"MFU ≥ {MFU_GOAL:.0%} and ≥ {VS_BARE_GOAL:.0%} of the bare step's tok/s"
    if not t:
        return [("train.py (bench.gpu.train)", MISSING.format("gpu_train.json"), goal, met(None))]
    mode = "compiled" if t["compile"] else "eager"
    ref = next((a for a in arms or [] if a["arm"] == mode), None)  # the bare step run the same way
    vs = t["loop_tokens_per_s"] / ref["tokens_per_s"] if ref else None
    d = t["defaults"]
    part = (f"train.py ({mode}; guard={d['guard']}, telemetry every {d['telemetry_every']}, checkpointing "
            f"{d['checkpoint']}; bench.gpu.train), same model and batch")
    figure = (f"{t['loop_tokens_per_s']:,.0f} tok/s, MFU {pct(t['loop_mfu'])}"
              + (f", {vs:.2f}× the bare {mode} step" if vs else ", no bare step to compare")
              + f" (StepRecord time_s: {t['tokens_per_s']:,.0f} tok/s, MFU {pct(t['mfu'])})")
    s = t["syncs"]
    how = "CUDA sync debug mode" if t["device"] != "cpu" else "CPU: read calls counted, not syncs"
    return [(part, figure, goal, met(t["loop_mfu"] >= MFU_GOAL and vs >= VS_BARE_GOAL if vs else None)),
            ("host syncs a step, train.py at its defaults (bench.gpu.train)",
             f"{s['plain_step']} a step, {s['telemetry_step']} on a telemetry step ({how})",
             f"{SYNC_GOAL} a step (issue 28 part 1)", met(s["plain_step"] <= SYNC_GOAL))]


def precision_rows(runs: list[dict] | None) -> list[Row]:
    goal = f"≥ {SPEEDUP_GOAL}× bf16 at eval loss ±{LOSS_GAP_GOAL:.0%}"
    by = {r["run"].split("(")[0]: r for r in runs or []}  # te_fp8(current): the fallback recipe
    base, out = by.get("bf16"), []
    for name in ("te_fp8", "fp8_block"):
        r = by.get(name)
        if not (r and base):
            why = ("no bf16 run to compare" if r else
                   MISSING.format(f"{name} run in gpu_precision.json (the log says why)"))
            out.append((f"{name} vs bf16 (bench.gpu.precision)", why, goal, met(None)))
            continue
        speed, gap = r["tokens_per_s"] / base["tokens_per_s"], r["gap_vs_bf16"]
        out.append((f"{r['run']} vs bf16, {r['params'] / 1e6:.3g}M, {len(r['losses'])} steps (bench.gpu.precision)",
                    f"{speed:.2f}× bf16's tok/s, eval loss {gap:+.2%}", goal,
                    met(speed >= SPEEDUP_GOAL and abs(gap) <= LOSS_GAP_GOAL)))
    return out


def moe_row(m: dict | None) -> Row:
    goal = "grouped faster than the loop"
    if not m:
        return "MoE grouped GEMM vs loop (bench.speed.moe_speed)", MISSING.format("gpu_moe.json"), goal, met(None)
    g, lp = m["vs_dense"]["moe_grouped"], m["vs_dense"]["moe_loop"]
    return (f"MoE grouped GEMM vs per-expert loop, d {m['d']}, {m['experts']} experts top-{m['top_k']} "
            "(bench.speed.moe_speed)",
            f"grouped {g:.2f}×, loop {lp:.2f}× the dense twin's step: grouped/loop {g / lp:.2f}",
            goal, met(g < lp))


def quant_row(q: dict | None) -> Row:
    goal = "bits equal on every row (issue 28 part 2)"
    if not q:
        return "fused FP8 quantiser (bench.speed.quant_fused)", MISSING.format("quant_fused.json"), goal, met(None)
    rs = q["rows"]
    speed = [r["eager"] / r["fused"] for r in rs]
    return (f"fused FP8 quantiser vs eager, {len(rs)} operand shapes (bench.speed.quant_fused)",
            f"bits equal on {sum(r['equal'] for r in rs)}/{len(rs)}; eager/fused median "
            f"{statistics.median(speed):.2f}× ({min(speed):.2f}–{max(speed):.2f})", goal,
            met(all(r["equal"] for r in rs)))


def spec_row(runs: list[dict] | None) -> Row:
    goal = "no check fails on a clean run (issue 35)"
    if not runs:
        return "specification checks, clean runs (bench.gpu.spec_clean)", MISSING.format("gpu_spec.json"), goal, met(None)
    ran = [r for r in runs if r.get("rc") == 0]
    worst = max((v for r in ran for v in r["miss"].values()), default=0.0)
    bad = [r["name"] for r in runs if r.get("rc") not in (0, None) or r.get("failed")]
    return (f"specification checks, {len(ran)} clean configuration{'s' * (len(ran) != 1)} (bench.gpu.spec_clean)",
            f"failed in {len(bad)}{': ' + ', '.join(bad) if bad else ''}; worst err/tol {worst:.2g}", goal,
            met(not bad and bool(ran)))


def rows(d: Path) -> list[Row]:
    arms = load(d, "gpu_mfu.json")
    out = [bare_row(arms), *train_rows(load(d, "gpu_train.json"), arms),
           *precision_rows(load(d, "gpu_precision.json")), moe_row(load(d, "gpu_moe.json")),
           quant_row(load(d, "quant_fused.json")), spec_row(load(d, "gpu_spec.json"))]
    tests = parts_run(d).get("gpu_tests")
    if tests:
        out.append(("`-m gpu` tests", f"exit {tests[0]}", "pass", met(tests[0] == 0)))
    return out


def parts_run(d: Path) -> dict[str, tuple[int, int, int]]:
    """{part: (exit status, seconds, cap)} from bench/gpu/all.sh's gpu_parts.tsv."""
    p = d / "gpu_parts.tsv"
    lines = p.read_text().splitlines() if p.is_file() else []
    return {name: (int(rc), int(s), int(cap)) for name, rc, s, cap in (x.split("\t") for x in lines if x)}


def table(d: Path, dry: bool, argv=None) -> Report:
    rep = Report(f"GPU checks (`bash bench/gpu/all.sh{' --dry-run' if dry else ''}`)", "python -m bench.gpu.table",
                 argv)
    rep.add(versions(), "")
    if dry:
        rep.add("Dry run on a CPU: every piece ran on a tiny problem; the figures check the code path and mean "
                "nothing.", "")
    rep.columns("part", "figure", "goal", "met?")
    for r in rows(d):
        rep.row(*r)
    parts = parts_run(d)
    if parts:
        rep.add("", "Parts (exit status, seconds / cap): " + ", ".join(
            f"{n} {rc} ({s} / {cap} s)" for n, (rc, s, cap) in parts.items())
            + f"; {sum(s for _, s, _ in parts.values())} s in all.")
    return rep


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu.table", description=__doc__.splitlines()[0])
    p.add_argument("dir", type=Path, nargs="?", default=ROOT / "bench" / "out", help="where the parts wrote")
    p.add_argument("--versions", action="store_true", help="print the device and versions line only")
    p.add_argument("--dry-run", action="store_true", help="the parts ran tiny on a CPU: the header says so")
    p.add_argument("--out", help="also write the table (markdown) to this file (bench/gpu/all.sh: DIR/gpu_table.md)")
    a = p.parse_args(argv)
    if a.versions:
        print(versions())
        return 0
    if not a.dir.is_dir():
        sys.exit(f"bench.gpu.table: {a.dir} is not a directory")
    table(a.dir, a.dry_run, argv).write(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
