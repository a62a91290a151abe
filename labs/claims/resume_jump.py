"""A resume with the wrong data cursor or RNG makes the loss jump (docs/course.md §10: "a jump right
after a resume — check optimizer/scheduler state, RNG, data cursor").

One run trains N steps and saves a checkpoint at step A (checkpoint.Saver, sync, through the publish
protocol; the state is checkpoint.TrainState: model, AdamW, scheduler, loader cursor, RNG). Each resume
builds a fresh model from another seed, loads the checkpoint (TrainState.load) and trains to N:
  correct       everything restored                          → bit-identical losses
  cursor reset  the loader restarts at sample 0              → from step A+1 it replays early batches
  wrong RNG     RNG streams re-seeded instead of restored    → differs from A+1 only if a step draws
The stock model draws no random numbers (samples are pure functions of their id, init is seeded), so
the RNG case also needs a component that draws: here dropout on the token embeddings (p = DROPOUT, a
forward hook using torch's global generator). The table reports the wrong-RNG resume both with and
without it, so it is plain which state mattered.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from checkpoint import Saver, TrainState, publish
from data.loader import Loader
from labs.claims.tiny import BATCH, build, check_lines, figure, first_index, make_optimizer, save, train_step
from labs.common import single_thread

TITLE = "resume_jump: resume correctly (identical) vs with the data cursor reset or the RNG not restored"
LR = 3e-3
DROPOUT = 0.1
VARIANTS = ("correct", "cursor_reset", "wrong_rng")


def _state(seed: int, steps: int, dropout: float, init_seed: int | None = None) -> TrainState:
    dataset, model = build(seed, init_seed=init_seed)
    if dropout:
        # NOTE: draws from torch's global generator on every forward, as nn.Dropout would.
        model.tok_emb.register_forward_hook(lambda m, i, out: F.dropout(out, dropout, training=True))
    optimizer, scheduler = make_optimizer(model, LR, steps)
    return TrainState(model, optimizer, scheduler, Loader(dataset, BATCH), {"lab": "resume_jump", "seed": seed})


def _steps(st: TrainState, n: int) -> list[dict]:
    out = []
    for _ in range(n):
        out.append(train_step(st.model, st.optimizer, st.scheduler, st.loader, max_grad_norm=1.0))
        st.step += 1
    return out


def continuous(seed: int, steps: int, save_at: int, root: Path, dropout: float) -> list[dict]:
    """N steps in one go, publishing a checkpoint after step `save_at` on the way."""
    st = _state(seed, steps, dropout)
    torch.manual_seed(seed)  # the run's RNG stream (dropout draws from it)
    log = _steps(st, save_at)
    saver = Saver(root, "sync")
    saver.save(publish.step_name(st.step), st.state_dict(), {"step": st.step})
    saver.close()
    return log + _steps(st, steps - save_at)


def resumed(seed: int, steps: int, path: Path, dropout: float, variant: str) -> list[dict]:
    st = _state(seed, steps, dropout, init_seed=seed + 1)  # other init: whatever matches must come from the checkpoint
    torch.manual_seed(seed + 1000)  # a fresh process's stream
    st.load(path, saved_world=1)
    if variant == "cursor_reset":  # a loader whose position was not saved starts over
        st.loader.samples_consumed = 0
    elif variant == "wrong_rng":  # the RNG streams not restored: the new process's seed
        torch.manual_seed(seed + 1000)
    return _steps(st, steps - st.step)


def run(seed: int, quick: bool = False, dropout: float = DROPOUT) -> dict:
    """dropout: p of the RNG-drawing component (0 leaves the step without any random draw)."""
    N = 8 if quick else 24
    A = N // 2
    with single_thread(), tempfile.TemporaryDirectory() as tmp:
        runs = {}
        for label, p in (("with_dropout", dropout), ("stock", 0.0)):
            root = Path(tmp) / label
            base = continuous(seed, N, A, root, p)
            path = root / publish.step_name(A)
            variants = VARIANTS if label == "with_dropout" else ("wrong_rng",)
            runs[label] = {"continuous": base, **{v: resumed(seed, N, path, p, v) for v in variants}}

    def summary(base, log) -> dict:
        ref = base[A:]
        diff = [abs(a["loss"] - b["loss"]) for a, b in zip(ref, log)]
        first = first_index(d != 0 for d in diff)
        return {"loss": [x["loss"] for x in log], "first_sample": [x["first_sample"] for x in log],
                "first_diff_step": None if first is None else A + 1 + first, "max_abs_diff": max(diff)}

    res = {label: {"continuous": {"loss": [x["loss"] for x in r["continuous"]],
                                  "first_sample": [x["first_sample"] for x in r["continuous"]]},
                   **{v: summary(r["continuous"], r[v]) for v in r if v != "continuous"}}
           for label, r in runs.items()}
    d, stock = res["with_dropout"], res["stock"]
    checks = {
        "correct resume: losses bit-identical to the continuous run": d["correct"]["first_diff_step"] is None,
        f"cursor reset: loss differs from step A+1 = {A + 1} (replays sample 0 on)":
            d["cursor_reset"]["first_diff_step"] == A + 1 and d["cursor_reset"]["first_sample"][0] == 0,
        f"RNG not restored, step draws random numbers: loss differs from step A+1 = {A + 1}":
            d["wrong_rng"]["first_diff_step"] == A + 1,
    }
    r = {"seed": seed, "quick": quick, "steps": N, "saved_at": A, "dropout": dropout, "runs": res,
         "rng_matters_stock": stock["wrong_rng"]["first_diff_step"] is not None,
         "checks": checks, "ok": all(checks.values())}
    r["table"] = table(r)
    return r


def table(r: dict) -> str:
    A, N, d, stock = r["saved_at"], r["steps"], r["runs"]["with_dropout"], r["runs"]["stock"]
    cols = [("continuous", None), ("correct", d["correct"]), ("cursor reset", d["cursor_reset"]),
            ("wrong RNG", d["wrong_rng"]), ("stock: continuous", stock["continuous"]),
            ("stock: wrong RNG", stock["wrong_rng"])]
    lines = [f"train {N} steps, checkpoint after step {A}, resume into a model built from another seed; "
             f"embedding dropout p = {r['dropout']:g} (stock model: none)", "",
             f"{'step':>5}{'first id':>9}" + "".join(f"{name:>18}" for name, _ in cols) + f"{'reset: first id':>17}"]
    base = d["continuous"]["loss"]
    for s in range(max(1, A - 1), N + 1):
        row = f"{s:>5}{d['continuous']['first_sample'][s - 1]:>9}{base[s - 1]:>18.6f}"
        for name, c in cols[1:]:
            if name == "stock: continuous":
                row += f"{c['loss'][s - 1]:>18.6f}"
            else:
                row += f"{c['loss'][s - A - 1]:>18.6f}" if s > A else f"{'':>18}"
        row += f"{d['cursor_reset']['first_sample'][s - A - 1]:>17}" if s > A else ""
        lines.append(row)
    resumes = cols[1:]
    blank = f"{'':>18}"
    lines.append(f"{'first step that differs':<32}" + "".join(
        blank if "first_diff_step" not in c else f"{c['first_diff_step'] or '—':>18}" for _, c in resumes))
    lines.append(f"{'max |Δloss| vs its continuous':<32}" + "".join(
        blank if "max_abs_diff" not in c else f"{c['max_abs_diff']:>18.2e}" for _, c in resumes))
    mattered = ("the data cursor always; the RNG only with dropout on"
                if not r["rng_matters_stock"] else "the data cursor and the RNG (the stock step draws random numbers)")
    lines += ["", f"which state mattered: {mattered}. (first id: the batch's first sample id)"]
    return "\n".join(lines + [""] + check_lines(r["checks"]))


def plot(r: dict, path) -> None:
    fig, (a,) = figure(1, width=8)
    A, d = r["saved_at"], r["runs"]["with_dropout"]
    a.plot(range(1, r["steps"] + 1), d["continuous"]["loss"], "k-", lw=2, label="continuous")
    for name, style in (("correct", "o"), ("cursor_reset", "s--"), ("wrong_rng", "^:")):
        a.plot(range(A + 1, r["steps"] + 1), d[name]["loss"], style, label=f"resumed: {name}")
    a.axvline(A + 0.5, color="k", ls=":", lw=1)
    a.set_xlabel(f"step (checkpoint after {A})")
    a.set_ylabel("train loss (nats/token)")
    a.set_title("resume: what the checkpoint must hand back")
    a.legend(fontsize=8)
    save(fig, path)
