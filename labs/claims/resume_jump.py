"""A resume with the wrong data cursor, RNG, optimizer or scheduler state changes the run (docs/course.md §10: "a jump right
after a resume — check optimizer/scheduler state, RNG, data cursor").

One run trains N steps and saves a checkpoint at step A (checkpoint.Saver, sync, through the publish
protocol; the state is checkpoint.TrainState: model, AdamW, scheduler, loader cursor, RNG). Each resume
builds a fresh model from another seed, loads the checkpoint (TrainState.load) and trains to N:
  correct       everything restored                          → bit-identical losses
  cursor reset  the loader restarts at sample 0              → from step A+1 it replays early batches
  wrong RNG     RNG streams re-seeded instead of restored    → differs from A+1 only if a step draws
  optimizer reset  AdamW's moments and step count not loaded → the first update is ~lr on every element
  scheduler reset  the LR schedule restarts at step 0        → the LR re-warms from the warmup's start
The stock model draws no random numbers (samples are pure functions of their id, init is seeded), so
the RNG case also needs a component that draws: here dropout on the token embeddings (p = DROPOUT, a
forward hook using torch's global generator). The table reports the wrong-RNG resume both with and
without it, so it is plain which state mattered.

Different is not a jump. Each resume's deviation from the continuous run over its first J steps is
measured in units of σ, the run's own step-to-step loss noise (the std of loss_t − loss_{t−1} over the
continuous run's second half), and called a jump only past JUMP σ. At this toy scale the honest result
is that no wrong resume jumps: each one changes the state in a way the lab measures exactly (the batch
ids, the update size at A+1, the LR at A+1), but the loss moves by about the run's own noise. The
symptom table's advice still holds — these states are what to check first — and a larger LR or model
turns the same state errors into visible jumps.
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
VARIANTS = ("correct", "cursor_reset", "wrong_rng", "optimizer_reset", "scheduler_reset")
J, JUMP = 4, 3.0  # a jump: |Δloss| > JUMP σ on one of the first J resumed steps


def _state(seed: int, steps: int, dropout: float, init_seed: int | None = None) -> TrainState:
    dataset, model = build(seed, init_seed=init_seed)
    if dropout:
        # NOTE: draws from torch's global generator on every forward, as nn.Dropout would.
        model.tok_emb.register_forward_hook(lambda m, i, out: F.dropout(out, dropout, training=True))
    # NOTE: warmup then cosine, so a scheduler that restarts is visible in the LR (a constant one is not)
    schedule = {"name": "cosine", "warmup_steps": max(1, steps // 4), "min_lr_ratio": 0.1}
    optimizer, scheduler = make_optimizer(model, LR, steps, schedule)
    return TrainState(model, optimizer, scheduler, Loader(dataset, BATCH), {"lab": "resume_jump", "seed": seed})


def _steps(st: TrainState, n: int) -> list[dict]:
    """n train steps; each record also has the LR it ran at and its update size ‖Δθ‖."""
    out, params = [], list(st.model.parameters())
    for _ in range(n):
        lr, before = st.optimizer.param_groups[0]["lr"], [p.detach().clone() for p in params]
        rec = train_step(st.model, st.optimizer, st.scheduler, st.loader, max_grad_norm=1.0)
        rec["lr"] = lr
        rec["update"] = sum((p.detach() - b).pow(2).sum().item() for p, b in zip(params, before)) ** 0.5
        out.append(rec)
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
    fresh_sched, fresh_lrs = st.scheduler.state_dict(), [g["lr"] for g in st.optimizer.param_groups]
    st.load(path, saved_world=1)
    if variant == "cursor_reset":  # a loader whose position was not saved starts over
        st.loader.samples_consumed = 0
    elif variant == "wrong_rng":  # the RNG streams not restored: the new process's seed
        torch.manual_seed(seed + 1000)
    elif variant == "optimizer_reset":  # the optimizer state not loaded: fresh moments, step count 0
        st.optimizer.state.clear()
    elif variant == "scheduler_reset":  # the scheduler not loaded: its counter and LRs from step 0
        st.scheduler.load_state_dict(fresh_sched)
        for g, lr in zip(st.optimizer.param_groups, fresh_lrs):
            g["lr"] = lr
    return _steps(st, steps - st.step)


def run(seed: int, quick: bool = False, dropout: float = DROPOUT) -> dict:
    """dropout: p of the RNG-drawing component (0 leaves the step without any random draw)."""
    N = 16 if quick else 40
    A = N // 2
    with single_thread(), tempfile.TemporaryDirectory() as tmp:
        runs = {}
        for label, p in (("with_dropout", dropout), ("stock", 0.0)):
            root = Path(tmp) / label
            base = continuous(seed, N, A, root, p)
            path = root / publish.step_name(A)
            variants = VARIANTS if label == "with_dropout" else ("wrong_rng",)
            runs[label] = {"continuous": base, **{v: resumed(seed, N, path, p, v) for v in variants}}

    def noise(base) -> float:
        """σ: std of the continuous run's step-to-step loss change over its second half."""
        d = [b["loss"] - a["loss"] for a, b in zip(base[N // 2 - 1:], base[N // 2:])]
        m = sum(d) / len(d)
        return (sum((x - m) ** 2 for x in d) / len(d)) ** 0.5

    def summary(base, log) -> dict:
        ref = base[A:]
        diff = [abs(a["loss"] - b["loss"]) for a, b in zip(ref, log)]
        first = first_index(d != 0 for d in diff)
        sigma = noise(base)
        dev = max(diff[:J]) / sigma
        return {"loss": [x["loss"] for x in log], "first_sample": [x["first_sample"] for x in log],
                "first_diff_step": None if first is None else A + 1 + first, "max_abs_diff": max(diff),
                "sigma": sigma, "deviation_sigma": dev, "jump": dev > JUMP,
                "lr_first": log[0]["lr"], "update_first": log[0]["update"],
                "lr_continuous": ref[0]["lr"], "update_continuous": ref[0]["update"]}

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
        "optimizer reset: the update at A+1 is > 1.5× the continuous run's (Adam's moments start over)":
            d["optimizer_reset"]["update_first"] > 1.5 * d["optimizer_reset"]["update_continuous"],
        "scheduler reset: the LR at A+1 is the schedule's first, < half the continuous run's":
            d["scheduler_reset"]["lr_first"] < 0.5 * d["scheduler_reset"]["lr_continuous"],
        f"every resume's loss deviation is measured in σ (the run's own noise); the correct one is 0 σ":
            d["correct"]["deviation_sigma"] == 0.0 and all(d[v]["sigma"] > 0 for v in VARIANTS),
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
    lines += ["", f"against the run's own noise σ = {d['correct']['sigma']:.4f} (std of the continuous loss's "
              f"step-to-step change); a jump: > {JUMP:g} σ on one of the first {J} resumed steps",
              f"{'resume':<18}{'max |Δloss| / σ':>16}{'verdict':>24}{'lr @ A+1':>11}{'(continuous)':>13}"
              f"{'‖Δθ‖ @ A+1':>12}{'(continuous)':>13}"]
    for v in VARIANTS:
        x = d[v]
        verdict = "jump" if x["jump"] else ("identical" if x["first_diff_step"] is None else "differs, within noise")
        lines.append(f"{v:<18}{x['deviation_sigma']:>16.2f}{verdict:>24}{x['lr_first']:>11.2e}"
                     f"{x['lr_continuous']:>13.2e}{x['update_first']:>12.4f}{x['update_continuous']:>13.4f}")
    mattered = ("the data cursor always; the RNG only with dropout on"
                if not r["rng_matters_stock"] else "the data cursor and the RNG (the stock step draws random numbers)")
    lines += ["", f"which state mattered: {mattered}. (first id: the batch's first sample id)"]
    return "\n".join(lines + [""] + check_lines(r["checks"]))


def plot(r: dict, path) -> None:
    fig, (a,) = figure(1, width=8)
    A, d = r["saved_at"], r["runs"]["with_dropout"]
    a.plot(range(1, r["steps"] + 1), d["continuous"]["loss"], "k-", lw=2, label="continuous")
    sigma = d["correct"]["sigma"]
    a.fill_between(range(A + 1, r["steps"] + 1), [y - JUMP * sigma for y in d["continuous"]["loss"][A:]],
                   [y + JUMP * sigma for y in d["continuous"]["loss"][A:]], color="k", alpha=0.1,
                   label=f"continuous ± {JUMP:g}σ (run's own noise): inside is not a jump")
    for name, style in (("correct", "o"), ("cursor_reset", "s--"), ("wrong_rng", "^:"), ("optimizer_reset", "v-."),
                        ("scheduler_reset", "d:")):
        if name in d:
            a.plot(range(A + 1, r["steps"] + 1), d[name]["loss"], style,
                   label=f"resumed: {name} ({d[name]['deviation_sigma']:.1f}σ)")
    a.axvline(A + 0.5, color="k", ls=":", lw=1)
    a.set_xlabel(f"step (checkpoint after {A})")
    a.set_ylabel("train loss (nats/token)")
    a.set_title("resume: what the checkpoint must hand back")
    a.legend(fontsize=8)
    save(fig, path)
