"""Sharded text corpora (data/shards.py): tokenisation throughput, loader throughput, resident memory.

    python -m bench.speed.shards                         # generated corpora of 50 and 200 MB, byte tokenizer
    python -m bench.speed.shards --sizes 20 --num-proc 2 --tokenizer char
    python -m bench.speed.shards --sizes 20 80 --out docs/results/shards.md

For each size: a corpus of 10 MB text files is generated (random words, deterministic), tokenised once
into a fresh cache (wall time → MB/s and tokens/s), then a fresh process opens the cache and reads
--batches loader batches (batch 64, seq_len 256): samples/s and its resident memory (VmRSS) after opening
and after reading. Flat memory = the RSS does not grow with the corpus: windows are read from memory
maps, and only the pages touched are resident.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import ROOT
from bench.report import Report

FILE_MB = 10


def generate(d: Path, mb: int, seed: int = 0) -> None:
    import numpy as np

    rng = np.random.default_rng(seed)
    words = np.array(["the", "of", "and", "king", "crown", "night", "sword", "my", "lord", "love", "death", "fair",
                      "speak", "hath", "thou", "doth", "upon", "ROMEO:", "JULIET:", "heaven", "grace", "sweet"])
    d.mkdir(parents=True, exist_ok=True)
    for i in range(-(-mb // FILE_MB)):
        n_words = (min(FILE_MB, mb - i * FILE_MB) << 20) // 5  # ~5 bytes a word with its separator
        seps = np.where(rng.random(n_words) < 0.1, "\n", " ")
        text = "".join(np.char.add(words[rng.integers(0, len(words), n_words)], seps).tolist())
        (d / f"part_{i:04d}.txt").write_text(text)


def rss_mb() -> tuple[float, float]:
    """(anonymous, file-backed) resident MB: the process's own memory, and mapped page cache."""
    f = {l.split(":")[0]: int(l.split()[1]) / 1024 for l in Path("/proc/self/status").read_text().splitlines()
         if l.startswith(("RssAnon:", "RssFile:"))}
    return f.get("RssAnon", float("nan")), f.get("RssFile", float("nan"))


def measure(cfg: dict, batches: int) -> dict:
    """In a fresh process: open the (already built) cache, read batches, report RSS and throughput."""
    from data import DataConfig, Loader, build_data

    base = rss_mb()
    t0 = time.perf_counter()
    ds = build_data(DataConfig.from_dict(cfg))
    t_open = time.perf_counter() - t0
    opened = rss_mb()
    loader = Loader(ds, 64)
    t0 = time.perf_counter()
    for _ in range(batches):
        loader.next()
    dt = time.perf_counter() - t0
    return {"open_s": t_open, "samples_per_s": 64 * batches / dt, "tokens_per_s": 64 * batches * ds.seq_len / dt,
            "rss_import_mb": base, "rss_open_mb": opened, "rss_read_mb": rss_mb(),
            "train_tokens": ds.n_tokens("train")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", type=int, nargs="+", default=[50, 200], help="corpus sizes in MB")
    p.add_argument("--tokenizer", default="byte", choices=["byte", "char", "bpe"])
    p.add_argument("--num-proc", type=int, default=2)
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--dir", default=None, help="work directory (default: a temporary one, removed after)")
    p.add_argument("--measure", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", help="also write the table (markdown) to this file")
    args = p.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(json.loads(args.measure), args.batches)))
        return 0
    rep = Report("Sharded text corpora: tokenise, load, memory", "python -m bench.speed.shards", argv)
    work = Path(args.dir or tempfile.mkdtemp(prefix="bench_shards_"))
    rows = []
    try:
        for mb in args.sizes:
            corpus, cache = work / f"corpus_{mb}", work / f"cache_{mb}"
            shutil.rmtree(cache, ignore_errors=True)
            t0 = time.perf_counter()
            generate(corpus, mb)
            gen_s = time.perf_counter() - t0
            cfg = {"kind": "text", "path": str(corpus), "cache": str(cache), "seq_len": 256, "seed": 0,
                   "tokenizer": args.tokenizer, "bpe_vocab_size": 4096, "num_proc": args.num_proc}
            import os
            env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(work / "hf")}
            t0 = time.perf_counter()
            build = subprocess.run([sys.executable, "-c", "import json,sys; from data import DataConfig, build_data; "
                                    "build_data(DataConfig.from_dict(json.loads(sys.argv[1])))", json.dumps(cfg)],
                                   cwd=ROOT, env=env, capture_output=True, text=True)
            tok_s = time.perf_counter() - t0
            if build.returncode:
                print(build.stderr[-3000:], file=sys.stderr)
                return 1
            m = subprocess.run([sys.executable, "-m", "bench.speed.shards", "--measure", json.dumps(cfg),
                                "--batches", str(args.batches)], cwd=ROOT, env=env, capture_output=True, text=True)
            if m.returncode:
                print(m.stderr[-3000:], file=sys.stderr)
                return 1
            r = json.loads(m.stdout.strip().splitlines()[-1])
            size = sum(f.stat().st_size for f in corpus.iterdir())
            shard_mb = sum(f.stat().st_size for f in next(cache.glob("*/manifest.json")).parent.glob("*.bin")) / 2**20
            rows.append((mb, size / 2**20, gen_s, tok_s, size / 2**20 / tok_s, r["train_tokens"] / 0.9 / tok_s, shard_mb,
                         r["open_s"], r["samples_per_s"], r["tokens_per_s"], r["rss_import_mb"], r["rss_open_mb"],
                         r["rss_read_mb"]))
            shutil.rmtree(corpus, ignore_errors=True)
            shutil.rmtree(cache, ignore_errors=True)
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    rep.add(f"Generated corpora, tokenizer {args.tokenizer}, num_proc {args.num_proc}, loader batch 64 × seq_len 256, "
            f"{args.batches} batches. RSS = anonymous + file-backed (mapped shard pages, reclaimable page cache), "
            "in MB.", "")
    rep.table(["corpus MB", "tokenise s (incl. start)", "MB/s", "tokens/s", "shards MB", "open s (sha256)",
               "loader samples/s", "loader tokens/s", "RSS after import", "RSS opened", "RSS after reading"],
              [(f"{r[1]:.0f}", f"{r[3]:.1f}", f"{r[4]:.1f}", f"{r[5] / 1e6:.2f}M", f"{r[6]:.0f}", f"{r[7]:.2f}",
                f"{r[8]:.0f}", f"{r[9] / 1e6:.2f}M", *(f"{a:.0f} + {f:.0f}" for a, f in r[10:13])) for r in rows])
    rep.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
