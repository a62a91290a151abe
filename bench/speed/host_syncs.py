"""Device-to-host reads per optimizer step of train.py, counted, by configuration (prints a table).

    python -m bench.speed.host_syncs                            # every configuration, 12 steps each
    python -m bench.speed.host_syncs --only default --steps 12 --sites
    python -m bench.speed.host_syncs --out docs/results/host_syncs.md

On a GPU every `.item()`, `.tolist()`, `.cpu()`, `.numpy()` and every float(t) / int(t) / bool(t) of a
tensor waits for the kernels queued before it. Each run is train.py as a user starts it (one process, or
torchrun with 2 gloo processes), in a child process whose torch.Tensor has those methods wrapped: a call
made from this repository's code (not from torch's own, e.g. AdamW reading its host-side step counter)
is booked to the step in progress, by call site. A step runs from its `before_batch` callback point to
the next one, so the interrupt check at a step boundary belongs to the step before it. On a CPU nothing
waits, but the same calls are the ones that would: the count is the device-independent part of the
story (tests/test_host_syncs.py holds the default job to it; its GPU twin uses CUDA's sync debug mode).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import ROOT
from bench.report import Report

READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__")
QUIET = ["threads=1", "logging.progress=false", "logging.wandb=disabled", "logging.plot=false"]
# name: (overrides, processes). The default job is the quickstart as `python train.py` runs it (its guard
# logs); telemetry every step, the guard's other two actions and the two sharded modes each change one thing.
CONFIGS: dict[str, tuple[list[str], int]] = {
    "default": ([], 1),  # guard=log, telemetry every 10 steps, an evaluation at the last step
    "telemetry.every=1": (["telemetry.every=1"], 1),
    "guard=skip": (["guard=skip"], 1),
    "guard=rollback": (["guard=rollback"], 1),
    "ddp (2 gloo)": (["parallel.mode=ddp"], 2),
    "fsdp (2 gloo)": (["parallel.mode=fsdp"], 2),
}


def install(out: Path, sync_debug: bool = False) -> None:
    """Wrap the read methods of torch.Tensor; book each call made from this repository to the current step
    (stability.callbacks.Callbacks.before_batch marks a step's start); write the book to `out` at exit.
    sync_debug (CUDA): from step 2 on, also book each operation CUDA's sync debug mode warns of ("syncs")."""
    import atexit
    import warnings

    import torch

    from stability.callbacks import Callbacks

    book: list[dict] = [{"step": 0, "sites": [], "syncs": []}]  # step 0: building the run, before the first step
    here, skip = str(ROOT), (os.path.join("torch", "_tensor.py"), os.path.join("torch", "_tensor_str.py"))

    def site(depth: int = 2) -> str | None:
        """The first frame of this repository's code from `depth` up: who asked (None: torch itself did)."""
        f = sys._getframe(depth)
        while f is not None and f.f_code.co_filename.endswith(skip):  # Tensor.__format__ reads for its caller
            f = f.f_back
        if f is None or not f.f_code.co_filename.startswith(here) or "site-packages" in f.f_code.co_filename:
            return None
        return f"{os.path.relpath(f.f_code.co_filename, here)}:{f.f_lineno} {f.f_code.co_name}"

    def wrap(name: str, real):
        def read(self, *args, **kwargs):
            where = site()
            if where is not None:
                book[-1]["sites"].append(f"{where} .{name}")
            return real(self, *args, **kwargs)
        return read

    for name in READS:
        setattr(torch.Tensor, name, wrap(name, getattr(torch.Tensor, name)))
    real_before_batch = Callbacks.before_batch

    def before_batch(self, s):
        book.append({"step": s.step, "sites": [], "syncs": []})
        return real_before_batch(self, s)

    Callbacks.before_batch = before_batch
    if sync_debug:
        shown = warnings.showwarning

        def showwarning(message, category, filename, lineno, file=None, line=None):
            if "synchronizing" not in str(message):
                return shown(message, category, filename, lineno, file, line)
            f, where = sys._getframe(1), None
            while f is not None and where is None:  # the first frame of ours above the warning machinery
                name = f.f_code.co_filename
                if name.startswith(here) and "site-packages" not in name and not name.endswith("host_syncs.py"):
                    where = f"{os.path.relpath(name, here)}:{f.f_lineno} {f.f_code.co_name}"
                f = f.f_back
            book[-1]["syncs"].append(where or "torch")

        warnings.showwarning = showwarning
        warnings.simplefilter("always")

        def before_batch_debug(self, s, _inner=Callbacks.before_batch):
            if s.step == 2:
                torch.cuda.set_sync_debug_mode("warn")
            return _inner(self, s)

        Callbacks.before_batch = before_batch_debug
    rank = os.environ.get("RANK", "0")
    atexit.register(lambda: Path(f"{out}.{rank}").write_text(json.dumps(book)))


def measure(overrides: list[str], nproc: int = 1, steps: int = 12, sync_debug: bool = False) -> list[dict]:
    """[{"step", "sites", "syncs"}] of rank 0, one entry per step executed (a rollback repeats step numbers),
    from a run of the default job with `overrides`, stopped after `steps` by checkpoint.stop_after."""
    with tempfile.TemporaryDirectory(prefix="host-syncs-") as tmp:
        out, run = Path(tmp) / "book", Path(tmp) / "run"
        args = ["-m", "bench.speed.host_syncs", "--child" + ("-sync-debug" if sync_debug else ""), str(out),
                f"hydra.run.dir={run}", f"checkpoint.stop_after={steps}", *QUIET, *overrides]
        launch = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                      f"--nproc_per_node={nproc}"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "HF_DATASETS_OFFLINE": "1",
               "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
        r = subprocess.run([*launch, *args], cwd=ROOT, env=env, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"host_syncs: {' '.join(overrides) or 'default'} failed (exit {r.returncode}):\n"
                               f"{r.stderr[-3000:]}")
        return json.loads(Path(f"{out}.0").read_text())


def child(out: str, overrides: list[str], sync_debug: bool = False) -> None:
    import runpy

    install(Path(out), sync_debug)
    sys.argv = [str(ROOT / "train.py"), *overrides]
    runpy.run_path(str(ROOT / "train.py"), run_name="__main__")


def per_step(book: list[dict]) -> dict[int, int]:
    return {e["step"]: len(e["sites"]) for e in book if e["step"] > 0}


def kind(entry: dict) -> str:
    """Which kind of step an entry is, told by what it read: the first, a telemetry step, an evaluation, plain."""
    funcs = {s.rsplit(" ", 2)[1] for s in entry["sites"]}
    if entry["step"] == 1:
        return "step 1"
    both = ("finish" in funcs, "evaluate" in funcs)
    return {(True, True): "telemetry + evaluation", (True, False): "telemetry", (False, True): "evaluation"}.get(
        both, "plain")


def span(xs: list[int]) -> str:
    return "—" if not xs else str(xs[0]) if min(xs) == max(xs) else f"{min(xs)}–{max(xs)}"


def main(argv=None) -> int:
    if argv is None and sys.argv[1:2] in (["--child"], ["--child-sync-debug"]):
        child(sys.argv[2], sys.argv[3:], sync_debug=sys.argv[1] == "--child-sync-debug")
        return 0
    ap = argparse.ArgumentParser(prog="python -m bench.speed.host_syncs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12, help="steps a run (checkpoint.stop_after)")
    ap.add_argument("--only", nargs="*", help="configurations to run (default: all)")
    ap.add_argument("--sites", action="store_true", help="print each step's call sites")
    ap.add_argument("--out", type=Path, help="also write the tables as markdown here")
    a = ap.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    kinds = ("step 1", "plain", "telemetry", "evaluation", "telemetry + evaluation")
    rows, default_sites = [], {}
    for name in a.only or CONFIGS:
        overrides, nproc = CONFIGS[name]
        book = measure(overrides, nproc, a.steps)
        if a.sites:
            for e in book:
                print(f"{name} step {e['step']}: {len(e['sites'])}")
                for site, n in collections.Counter(e["sites"]).items():
                    print(f"    {n} × {site}")
        steps = [e for e in book if e["step"] > 0]
        rows.append((name, nproc, {k: [len(e["sites"]) for e in steps if kind(e) == k] for k in kinds}))
        if name == "default":
            for e in steps:
                default_sites.setdefault(kind(e), e["sites"])
        print(f"{name}: " + " ".join(f"{s}:{n}" for s, n in per_step(book).items()), flush=True)
    rep = Report("Device-to-host reads per step", "python -m bench.speed.host_syncs", argv)
    rep.add(f"Each configuration is the default job with one change, {a.steps} steps (checkpoint.stop_after: the "
            "last one evaluates); rank 0's count of the calls a GPU would wait at, by kind of step.", "")
    rep.table(["configuration", "processes", *kinds],
              [(name, nproc, *(span(got[k]) for k in kinds)) for name, nproc, got in rows])
    if default_sites:
        rep.add("The default job's reads by call site:", "")
        where = sorted({s for sites in default_sites.values() for s in sites})
        rep.table(["call site", *kinds],
                  [(f"`{s}`", *(default_sites.get(k, []).count(s) or "" for k in kinds)) for s in where])
    rep.write(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
