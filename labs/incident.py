"""Blind incidents: a run with a hidden fault, and the grading of a student's diagnosis.

    python -m labs.incident new --seed 12 --out runs/incident-12
    python -m labs.incident check runs/incident-12 --answer "forward: block2.mlp" --step 96

`new` draws a fault from CATALOGUE with the seed (kind, step, and for an activation fault the layer),
trains the quickstart model with it (train.py, one thread, guard=log), then scrubs every trace of the
injection from the run directory: the fault node of config.yaml, the fault overrides in
environment.json's argv, the injector's events (events.jsonl and each StepRecord's `events`), and the
log lines that announce it. What is left is what a real incident leaves: the records of its effects.
The answer is sealed in `answer.json` as salted scrypt hashes of the class, the layer and each
accepted step (the true step ± STEP_TOL), so reading the directory does not reveal it.
WARN: the answer spaces are small (a few classes, ~40 steps): a student who brute-forces the hashes
learns the answer. The seal keeps an honest reader blind; it is not cryptographic secrecy.

`check` grades the three parts separately: class, layer ("-" when the fault has none) and step. The
reference answer is the doctor's (`python -m doctor RUN`): a diagnosis it can make from the same files.
Classes: input (the batch itself was wrong), forward (a layer's activations went non-finite), update
(the LR left its schedule), optimizer_state (Adam's moments were corrupted).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import secrets
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
N_LAYERS = 4  # the quickstart model (conf/model/mixed_tiny.yaml)
STEP_RANGE, STEP_TOL, AFTER = (110, 150), 1, 40  # the doctor scores from step 100
# kind -> (class, the fault's extra overrides)
CATALOGUE = {
    "nan_activation": ("forward", {}),
    "labels_shuffle": ("input", {}),
    "lr_spike": ("update", {"fault.lr_spike.factor": 50.0, "fault.lr_spike.steps": 3}),
    "optim_state": ("optimizer_state", {"fault.optim_state.mode": "zero"}),
}
CLASSES = sorted({c for c, _ in CATALOGUE.values()})
# words a scrubbed directory must not contain (the kinds themselves, and the injector's vocabulary)
TELLTALES = [*CATALOGUE, "fault", "inject", "drill"]


def draw(seed: int) -> dict:
    rng = random.Random(seed)
    kind = rng.choice(sorted(CATALOGUE))
    cls, extra = CATALOGUE[kind]
    step = rng.randint(*STEP_RANGE)
    over = {"fault": kind, "fault.step": step, **extra}
    layer = "-"
    if kind == "nan_activation":
        i, sub = rng.randrange(N_LAYERS), rng.choice(["attn", "mlp"])
        over.update({"fault.nan_activation.layer": i, "fault.nan_activation.sublayer": sub})
        layer = f"block{i}.{sub}"
    return {"kind": kind, "class": cls, "layer": layer, "step": step, "overrides": over}


def _h(salt: str, part: str, value: str) -> str:
    return hashlib.scrypt(f"{part}:{value.strip().lower()}".encode(), salt=bytes.fromhex(salt), n=2 ** 12, r=8,
                          p=1).hex()


def seal(answer: dict) -> dict:
    salt = secrets.token_hex(16)
    steps = range(answer["step"] - STEP_TOL, answer["step"] + STEP_TOL + 1)
    return {"salt": salt, "class": _h(salt, "class", answer["class"]), "layer": _h(salt, "layer", answer["layer"]),
            "step": sorted(_h(salt, "step", str(s)) for s in steps),
            "format": "CLASS: LAYER (layer '-' when none); classes: " + ", ".join(CLASSES)}


def grade(sealed: dict, answer: str, step: int) -> dict:
    cls, _, layer = answer.partition(":")
    salt = sealed["salt"]
    return {"class": _h(salt, "class", cls) == sealed["class"],
            "layer": _h(salt, "layer", layer.strip() or "-") == sealed["layer"],
            "step": _h(salt, "step", str(step)) in sealed["step"]}


def scrub(run_dir: Path) -> None:
    """Remove every trace of the injection (see the module docstring); raise if any telltale is left."""
    cfg_path = run_dir / "config.yaml"
    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["fault"] = {"kind": "none"}  # what a run without a drill records
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    env_path = run_dir / "environment.json"
    if env_path.exists():
        env = json.loads(env_path.read_text())
        env["argv"] = [a for a in env.get("argv", []) if not a.startswith(("fault", "+fault"))]
        env_path.write_text(json.dumps(env, indent=1) + "\n")
    ev = run_dir / "events.jsonl"
    if ev.exists():
        rows = [x for x in ev.read_text().splitlines() if x.strip() and json.loads(x).get("kind") != "fault"]
        ev.write_text("".join(r + "\n" for r in rows))
        if not rows:
            ev.unlink()
    mj = run_dir / "metrics.jsonl"
    out = []
    for line in mj.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("events"):
            rec["events"] = [e for e in rec["events"] if not str(e).startswith("fault")]
        out.append(json.dumps(rec, allow_nan=True))
    mj.write_text("".join(x + "\n" for x in out))
    for log in run_dir.glob("*.log"):
        log.write_text("".join(x for x in log.read_text().splitlines(keepends=True) if not telltale(x)))
    left = [f"{p.name}: {m}" for p in run_dir.rglob("*") if p.is_file() and p.name != "answer.json"
            for m in [telltale(CLEAN_NODE.sub("", p.read_text(errors="replace")))] if m]
    if left:
        raise RuntimeError(f"incident: scrub left a trace: {left[0]}")


CLEAN_NODE = re.compile(r"^fault:\n  kind: none\n", re.M)  # config.yaml's node of every drill-free run


def telltale(text: str) -> str | None:
    # NOTE: "optim_state" is also a key of every StepRecord's `nonfinite` (a flag, false in a clean run):
    # a JSON key is a field name, not a mention of the fault
    m = re.search(r"\b(" + "|".join(TELLTALES) + r")\w*(?!\w*\":)", text, re.IGNORECASE)
    return m[0] if m else None


def new(seed: int, out: Path) -> dict:
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"incident: --out {out} exists and is not empty")
    ans = draw(seed)
    cmd = [sys.executable, "train.py", f"train.steps={ans['step'] + AFTER}", "threads=1", f"hydra.run.dir={out}",
           "logging.wandb=disabled", "logging.progress=false", "guard=log", "telemetry.every=1",
           # NOTE: no checkpoints: one holds the drill's state, i.e. the answer (doctor --verify rebuilds the
           # steps before the incident from the run's config instead)
           "checkpoint.every=0",
           "run_name=incident", *[f"{k}={v}" for k, v in ans["overrides"].items()]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_OFFLINE": "1"}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"incident: train.py failed ({r.returncode}): {r.stderr.strip().splitlines()[-1:]}")
    scrub(out)
    (out / "answer.json").write_text(json.dumps(seal(ans), indent=1) + "\n")
    return ans


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m labs.incident", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    n = sub.add_parser("new", help="generate a run with a hidden fault")
    n.add_argument("--seed", type=int, required=True)
    n.add_argument("--out", type=Path, required=True)
    c = sub.add_parser("check", help="grade a diagnosis of an incident")
    c.add_argument("run_dir", type=Path)
    c.add_argument("--answer", required=True, help='"CLASS: LAYER", e.g. "forward: block2.mlp" or "input: -"')
    c.add_argument("--step", type=int, required=True, help="the step the fault hit")
    args = p.parse_args(argv)
    try:
        if args.cmd == "new":
            new(args.seed, args.out)
            print(f"incident {args.out}: a run with a hidden fault. Diagnose it (python -m doctor {args.out} "
                  f"is one way), then: python -m labs.incident check {args.out} --answer 'CLASS: LAYER' --step S\n"
                  f"classes: {', '.join(CLASSES)}; layer '-' when the fault has none")
            return 0
        sealed = json.loads((args.run_dir / "answer.json").read_text())
    except (OSError, RuntimeError, ValueError) as e:
        print(f"labs.incident: {e}", file=sys.stderr)
        return 2
    g = grade(sealed, args.answer, args.step)
    for part, ok in g.items():
        print(f"{part:<6}{'right' if ok else 'wrong'}")
    return 0 if all(g.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
