"""What the attention-logit telemetry and QK-clip cost, against a plain training step.

    python -m bench.speed.attn_logit_probe [--steps 30] [--batch 16] [--seq 256] [--d 128] [--layers 4] [--heads 4]
    python -m bench.speed.attn_logit_probe --out docs/results/attn_logit_probe.md

Interleaved, step by step on the same batches (this machine's speed drifts): a forward + backward of a
dense model (1) plain, (2) with the telemetry probe on (per head max of QKᵀ/√d of the FIRST sequence of
each forward, from the q and k the forward computed: model/attention.py), and (3) QK-clip's re-measure
(optim/qk_clip.py: one no-grad trunk forward with the per-head max over the whole batch, chunked) timed
on its own. Prints the medians and the overheads relative to the plain step.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.report import Report
from model import ModelConfig, Transformer
from optim.config import QKClipConfig
from optim.qk_clip import QKClip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", help="also write the table (markdown) to this file")
    a = p.parse_args()
    rep = Report("The attention-logit probe and QK-clip against a plain step", "python -m bench.speed.attn_logit_probe")
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=256, seq_len=a.seq, d_model=a.d, n_layers=a.layers, n_heads=a.heads))
    clip = QKClip(model, QKClipConfig(tau=1e9))  # τ never reached: measures, never scales
    x = torch.randint(256, (a.batch, a.seq))
    times = {"plain": [], "probe": [], "qk_clip": []}

    def fwd_bwd(probe: bool) -> float:
        for b in model.blocks:
            b.attn.probe_logits, b.attn.logit_max_H = probe, None
        t0 = time.perf_counter()
        model(x, x).loss_sum.backward()
        dt = time.perf_counter() - t0
        model.zero_grad(set_to_none=True)
        return dt

    for i in range(a.steps + 3):
        tp, tq = fwd_bwd(False), fwd_bwd(True)
        t0 = time.perf_counter()
        clip.after_update([x])
        tc = time.perf_counter() - t0
        if i >= 3:  # warm-up
            times["plain"].append(tp)
            times["probe"].append(tq)
            times["qk_clip"].append(tc)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    rep.add(f"Dense {a.layers} layers × {a.heads} heads, d {a.d}, batch {a.batch} × seq {a.seq}, "
            f"{a.threads} thread(s), {a.steps} interleaved steps.", "")
    rep.table(["what", "median ms", "against the plain step"], [
        ("fwd+bwd plain", f"{med['plain']:.1f}", ""),
        ("fwd+bwd + logit probe (telemetry steps only)", f"{med['probe']:.1f}", f"{med['probe'] / med['plain'] - 1:+.1%}"),
        ("QK-clip re-measure alone (every step when optim.qk_clip.tau is set)", f"{med['qk_clip']:.1f}",
         f"{med['qk_clip'] / med['plain']:.1%} of a step")])
    rep.write(a.out)


if __name__ == "__main__":
    main()
