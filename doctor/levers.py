"""The recipe's levers: what a recipe instability is fixed with (docs/course.md §5–6), each declared once with the
config key it sets and how it is pulled, chosen from the evidence of the incident.

A conforming run that takes lasting damage, diverges, spikes again and again or stalls did what its recipe told
it: the fix is a recipe setting, never code. Which one follows from the evidence, in this order:
  1. a mechanism the incident itself shows: a quantity that moved with it is a block's attention logits
     (QK-norm / QK-clip bound them), the output logits or their normaliser (z-loss), the FP16 loss scale (precision);
  2. a lever the run moved to its unstable side of the recipe's own default (a higher LR, a shorter warm-up, a
     looser clip, less z-loss): the default is the recipe that learns this data, which the fix's rerun proves;
  3. a mechanism whose level grew from before the incident to the run's end past the budget's threshold (weaker:
     a model that learns sharpens its logits too);
  4. the lever of the quantity that moved first (a gradient: the clip threshold; anything else: the LR).

    pick(ctx, diag) -> {"lever", "key", "override", "why", "from_start"}

A signal names its lever (stability/signals.py `lever`); a lever a resume cannot apply is proved by a rerun from
step 0 (`from_start`): one that changes the model's state (QK-norm adds weights, a precision recipe another
dtype) or one the checkpoint itself restores (the LR and its warm-up live in the scheduler's state, which a
resume loads as it was saved). The others are proved from the state before the incident.
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from typing import Callable

from doctor.budget import ALPHA, threshold
from doctor.scores import MIN_HISTORY, MIN_MEDIAN
from doctor.timeline import MAD_SIGMA


@dataclass(frozen=True)
class Lever:
    name: str
    key: str              # the config key it sets
    means: str
    unstable: Callable[[dict, dict], bool]     # (run config, recipe default) -> the run sits on its unstable side
    pull: Callable[[dict, dict, dict], tuple[str, str] | None]  # (config, default, evidence) -> (override, why)
    specific: bool = False  # its signals show one mechanism (the attention logits, the output logits, the scale)
    from_start: bool = False  # a resume cannot apply it (a rerun from step 0 proves it)


LEVERS: dict[str, Lever] = {}


def declare_lever(lever: Lever) -> Lever:
    if lever.name in LEVERS:
        raise ValueError(f"lever {lever.name!r} declared twice")
    LEVERS[lever.name] = lever
    return lever


def get(cfg: dict, key: str):
    for k in key.split("."):
        cfg = (cfg or {}).get(k) if isinstance(cfg, dict) else None
    return cfg


def _num(x) -> float | None:
    try:
        return None if x is None else float(x)
    except (TypeError, ValueError):
        return None


# NOTE: a lever pulled towards the recipe's default goes all the way there (the recipe known to learn this data);
# one already at its default moves one octave (×2 or ÷2): LR and warm-up sweeps are log-spaced by factors of 2–3,
# and one octave is the smallest step such a sweep resolves
OCTAVE = 2.0


def _lr(cfg, dflt, ev):
    lr, d = _num(get(cfg, "optim.lr")), _num(get(dflt, "optim.lr"))
    if lr is None:
        return None
    if d is not None and lr > d:
        return f"optim.lr={d:g}", f"the LR {lr:g} is {lr / d:.3g}× the recipe's default {d:g}"
    return f"optim.lr={lr / OCTAVE:g}", f"the LR {lr:g}, one octave down"


def _warmup(cfg, dflt, ev):
    w, d = _num(get(cfg, "optim.schedule.warmup_steps")), _num(get(dflt, "optim.schedule.warmup_steps"))
    if w is None:
        return None
    if d is not None and w < d:
        return (f"optim.schedule.warmup_steps={int(d)}", f"the warm-up of {int(w)} steps is shorter than the recipe's "
                f"default {int(d)}")
    if ev.get("in_warmup"):
        return (f"optim.schedule.warmup_steps={int(max(w, 1) * OCTAVE)}",
                f"the incident came in the warm-up's end or just after it (step {ev['step']}, warm-up {int(w)})")
    return None


def _clip(cfg, dflt, ev):
    c, d = _num(get(cfg, "train.max_grad_norm")), _num(get(dflt, "train.max_grad_norm"))
    g = ev.get("grad_norm_before")
    if (c is None or c == 0) and d:
        return f"train.max_grad_norm={d:g}", f"no clip (train.max_grad_norm={c}); the recipe's default clips at {d:g}"
    if c is not None and d is not None and c > d:
        return f"train.max_grad_norm={d:g}", f"the clip threshold {c:g} is looser than the recipe's default {d:g}"
    if c and g and g < c:  # clip at the gradient's own scale before the incident: its bursts are then bounded
        return (f"train.max_grad_norm={g:.3g}", f"the clip threshold {c:g} is above the gradient norm's median {g:.3g} "
                f"before the incident: it never bounded the burst")
    return None


def _z_loss(cfg, dflt, ev):
    z, d = _num(get(cfg, "train.z_loss")), _num(get(dflt, "train.z_loss"))
    if z is None:
        return None
    if d and z < d:
        return f"train.z_loss={d:g}", f"z-loss {z:g} is below the recipe's default {d:g}"
    if not z and not d:
        return None  # no z-loss and no default to go to: nothing to pull by an octave
    return (f"train.z_loss={(z or d) * OCTAVE:g}",
            "the output logits grew" + (f" (z-loss {z:g})" if z else " without z-loss"))


def _qk(cfg, dflt, ev):
    if get(cfg, "model.qk_norm"):
        return None  # bounded already: the logits' growth is not q·k's scale
    tau = ev.get("attn_before")
    if get(cfg, "optim.qk_clip.tau") is None and tau:
        # NOTE: clip at the largest logit the block held while healthy: the growth past it is the instability
        return (f"optim.qk_clip.tau={tau:.3g}", f"the attention logits of {ev.get('attn_layer')} grew past the "
                f"{tau:.3g} they held before the incident; QK-clip bounds them from the state before it "
                f"(QK-norm, model.qk_norm=true, bounds them by construction, from step 0)")
    return "model.qk_norm=true", f"the attention logits of {ev.get('attn_layer')} grew with QK-clip at its bound"


def _precision(cfg, dflt, ev):
    name = get(cfg, "precision.name")
    if name == "fp16":
        return "precision=bf16", "the FP16 loss scale kept backing off: bf16 has FP32's exponent range"
    return None


declare_lever(Lever("qk", "optim.qk_clip.tau", "bound the attention logits (QK-clip, or QK-norm)",
                    lambda c, d: bool(get(d, "model.qk_norm")) and not get(c, "model.qk_norm"), _qk, specific=True))
declare_lever(Lever("z_loss", "train.z_loss", "bound the output logits' normaliser (z-loss)",
                    lambda c, d: (_num(get(c, "train.z_loss")) or 0) < (_num(get(d, "train.z_loss")) or 0), _z_loss,
                    specific=True))
declare_lever(Lever("precision", "precision", "keep the loss scale's headroom (a wider-exponent recipe)",
                    lambda c, d: get(c, "precision.name") == "fp16" and get(d, "precision.name") != "fp16", _precision,
                    specific=True))
declare_lever(Lever("lr", "optim.lr", "the learning rate", lambda c, d: (_num(get(c, "optim.lr")) or 0) >
                    (_num(get(d, "optim.lr")) or math.inf), _lr, from_start=True))
declare_lever(Lever("warmup", "optim.schedule.warmup_steps", "the LR warm-up",
                    lambda c, d: (_num(get(c, "optim.schedule.warmup_steps")) or 0) <
                    (_num(get(d, "optim.schedule.warmup_steps")) or 0), _warmup, from_start=True))
declare_lever(Lever("clip", "train.max_grad_norm", "the gradient clip threshold",
                    lambda c, d: (_num(get(c, "train.max_grad_norm")) or math.inf) >
                    (_num(get(d, "train.max_grad_norm")) or math.inf), _clip))


def recipe_default(run) -> dict | None:
    """The run's recipe without its command line's lever overrides: its own experiment composed again (Hydra,
    conf/), with every override of a lever's key dropped. None when the run has no command line or the config
    cannot be composed here."""
    env = run.dir / "environment.json"
    if not env.is_file():
        return None
    try:
        argv = json.loads(env.read_text()).get("argv")
        if argv is None:
            return None
        from pathlib import Path

        from omegaconf import OmegaConf

        from run.argv import normalise, without
        from run.config import register
        from hydra import compose, initialize_config_dir
        keys = [lv.key for lv in LEVERS.values()] + ["model.qk_norm", "precision"]
        keep = without(normalise(argv), ("hydra", "resume", "checkpoint", "logging", *keys))
        register()
        conf = Path(__file__).resolve().parents[1] / "conf"
        with initialize_config_dir(config_dir=str(conf), version_base=None):
            return OmegaConf.to_container(compose(config_name="config", overrides=keep), resolve=True)
    except Exception:  # NOTE: a config this checkout cannot compose (an older run): levers read evidence only
        return None


def _median(s, lo: int, hi: int) -> float | None:
    v = [x for t, x in s.values.items() if lo <= t < hi and math.isfinite(x)]
    return statistics.median(v) if v else None


def evidence(ctx, diag) -> dict:
    """What the records show around the incident for the levers to read: the growth of each lever's signals
    (post-incident level against the window before, in its own noise: a robust z), the gradient norm and the
    attention logits before it, and whether it came at the warm-up's end."""
    t0, w = diag.step, ctx.window
    last = ctx.seg[-1]["step"]
    ev: dict = {"step": t0, "grew": {}}
    warm = get(ctx.run.config, "optim.schedule.warmup_steps") or 0
    from doctor.timeline import memory
    ev["in_warmup"] = bool(warm) and t0 <= int(warm) + memory(ctx.run.config.get("optim") or {})
    for q, s in ctx.tl.items():
        lever = s.spec.lever
        if lever is None:
            continue
        pre = [(math.log(max(x, 1e-300)) if s.spec.log else x) for t, x in sorted(s.values.items())
               if t0 - w <= t < t0 and math.isfinite(x)]
        post = [(math.log(max(x, 1e-300)) if s.spec.log else x) for t, x in sorted(s.values.items())
                if t0 < t <= last and math.isfinite(x)]
        if len(pre) < MIN_HISTORY or len(post) < MIN_MEDIAN:
            continue
        m = statistics.median(pre)
        mad = statistics.median(abs(x - m) for x in pre) * MAD_SIGMA
        scale = max(mad, s.spec.rel_floor if s.spec.log else s.spec.rel_floor * abs(m), s.spec.abs_floor)
        z = (statistics.median(post) - m) / scale
        lim = threshold(len(ctx.tl), len(pre), 0.0, 1, ALPHA / 2)
        if z > lim and z > ev["grew"].get(lever, (0, None))[0]:
            ev["grew"][lever] = (z, q, s.layer_name)
    g = ctx.tl.get(next((q for q, s in ctx.tl.items() if s.spec.role == "gradient" and s.layer_name is None), ""))
    ev["grad_norm_before"] = _median(g, t0 - w, t0) if g else None
    grew = ev["grew"].get("qk")
    if grew:
        s = ctx.tl[grew[1]]
        pre = [x for t, x in s.values.items() if t0 - w <= t < t0 and math.isfinite(x)]
        ev["attn_before"], ev["attn_layer"] = (max(pre) if pre else None), grew[2]
    return ev


def pick(ctx, diag, default: dict | None) -> dict:
    """The lever for a recipe instability (the order above), with the override its proof runs and why."""
    from stability.signals import family
    from doctor.checks import NEAR
    cfg = ctx.run.config
    ev = evidence(ctx, diag)
    dflt = default or {}
    moved = {sig.lever for q, d in diag.devs.items() if diag.step <= d.step <= diag.step + NEAR
             and (sig := family(q)) is not None and sig.lever}
    order = [lv for lv in LEVERS.values() if lv.specific and lv.name in moved]
    order += [lv for lv in LEVERS.values() if default is not None and lv.unstable(cfg, dflt)]
    order += [lv for lv in LEVERS.values() if lv.specific and lv.name in ev["grew"]]
    first = family(diag.anomaly.quantity) if diag.anomaly else None
    if first is not None and first.lever in LEVERS:
        order.append(LEVERS[first.lever])
    order += [LEVERS["warmup"], LEVERS["lr"]]
    for lv in order:
        got = lv.pull(cfg, dflt, ev)
        if got:
            over, why = got
            # NOTE: a change of the model's architecture or of its precision recipe changes the state itself (new
            # weights, another dtype): its proof reruns from step 0
            from_start = lv.from_start or over.startswith(("model.", "precision="))
            return {"lever": lv.name, "key": lv.key, "override": over, "why": why, "from_start": from_start,
                    "means": lv.means, "grew": {k: [round(v[0], 1), v[1]] for k, v in ev["grew"].items()},
                    "moved": sorted(moved)}
    return {"lever": "lr", "key": "optim.lr", "override": None, "why": "no lever can be pulled from the config",
            "from_start": False, "means": LEVERS["lr"].means, "grew": {}, "moved": sorted(moved)}
