"""Muon's step with its Newton–Schulz matmuls in float32 and in bfloat16, on the speedrun's model, and what
`optim.muon.ns_dtype=auto` picks on this machine (optim/muon.py ns_dtype_for).

    python -m bench.speed.muon_ns_dtype [--steps 20] [--threads 1] [--out docs/results/muon_ns_dtype.md]

One model (+experiment=speedrun's, char vocabulary), the same gradients, two optimizers built by build_optimizer
that differ only in ns_dtype; their steps alternate, the order flipping every round, so the drift of a shared
machine hits both alike. Prints each one's median ms per optimizer step (AdamW's share on the embeddings, head and
norms included) and their ratio.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from bench.config import compose_config
from bench.report import Report
from model import Transformer
from optim import build_optimizer
from optim.muon import ns_dtype_for

DTYPES = ("float32", "bfloat16")


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.speed.muon_ns_dtype", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", help="also write the table (markdown) to this file")
    a = p.parse_args()
    cfg = compose_config(["+experiment=speedrun", "data.path=unused.txt", f"threads={a.threads}"])
    rep = Report("Muon's Newton–Schulz dtype on this machine", "python -m bench.speed.muon_ns_dtype")
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(cfg.model, vocab_size=65, seq_len=cfg.data.seq_len))
    opts = {d: build_optimizer(model, dataclasses.replace(cfg.optim, muon=dataclasses.replace(cfg.optim.muon,
                                                                                               ns_dtype=d)))[0]
            for d in DTYPES}
    for p_ in model.parameters():
        p_.grad = torch.randn_like(p_) * 1e-3
    times: dict[str, list[float]] = {d: [] for d in DTYPES}
    for i in range(a.steps + 2):
        for d in (DTYPES if i % 2 == 0 else DTYPES[::-1]):
            t0 = time.perf_counter()
            opts[d].step()
            if i >= 2:  # the first two: each optimizer's state allocated, the kernels warmed up
                times[d].append(time.perf_counter() - t0)
    med = {d: statistics.median(v) * 1e3 for d, v in times.items()}
    auto, why = ns_dtype_for("auto", "cpu")
    rep.add(f"+experiment=speedrun's model ({sum(p_.numel() for p_ in model.parameters()):,} parameters), "
            f"{a.threads} thread(s), {a.steps} steps of each optimizer, alternating.", "")
    rep.table(["optim.muon.ns_dtype", "median ms per optimizer step", "against float32"],
              [(d, f"{med[d]:.1f}", f"{med[d] / med['float32']:.2f}x") for d in DTYPES])
    rep.add("", f"auto here: {auto} ({why})")
    rep.write(a.out)


if __name__ == "__main__":
    main()
