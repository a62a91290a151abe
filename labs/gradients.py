"""Autograd vs central finite differences, float64, for every component of the model; then the lesson
of docs/course.md §2: "backward ran" is not "the objective is right".

Each component is a scalar objective f = <component(inputs), w> (w a fixed random projection) or a loss,
checked on sampled coordinates of its inputs and parameters (labs/gradcheck.py). Piecewise-smooth parts
are checked inside one piece: the SwiGLU clamp (DeepSeek-V4, silu(min(g, L))·clamp(u, −L, L)) away
from its kinks |x| = L — outside the bound the true derivative is 0 and autograd must say exactly 0 —
and MoE top-k routing where θ±h leaves the chosen experts unchanged.

The lesson: padding labels left as PAD instead of IGNORE_INDEX. Training runs, backward runs, and the
gradient passes the finite-difference check — it is the exact gradient of the *wrong* objective, one
that rewards predicting PAD after PAD. Its loss even falls below the exact Bayes floor of the data, which
no correct objective can do. The decisive number is measured held out, not read off the noisy training
curve: on HELDOUT validation samples, the per-sample excess of each objective's loss over the exact
floor of that sample's real tokens, with its standard error — the buggy objective sits more than
SE_MIN standard errors below the floor, the correct objective on the same model well above it.
"""
from __future__ import annotations

import copy
import dataclasses
import math

import torch
from torch import nn

import model.attention as attention_mod
import model.loss as loss_mod
import model.rope as rope_mod
import model.swiglu as swiglu_mod
from data import IGNORE_INDEX, PAD_ID, DataConfig, build_data
from data.loader import eval_batches
from labs.common import single_thread, train_small
from labs.gradcheck import autograd_grads, fd_check, rel_err
from model import ModelConfig, MoE, MoEConfig
from precision.config import PrecisionConfig

TITLE = "gradients: autograd vs finite differences (float64), and a correct gradient of a wrong objective"
TOL = 1e-6
L = 10.0           # SwiGLU clamp bound (the model default)
Z_COEF = 1e-4      # z-loss coefficient, as labs/common.train_small trains with
LOSS_CHANGE = 0.05  # the mask bug must move the loss by > 5 % to count as "changes the loss"
LESSON_STEPS = 120  # NOTE: the same in quick mode: at 40-80 steps the buggy model is not yet below the floor
HELDOUT, SE_MIN = 512, 3.0
F64 = torch.float64
# A tiny mixed dense + MoE model (layer 0 dense, layer 1 MoE) on documents short enough that a third
# of the label positions are padding.
MODEL = ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, swiglu_clamp=L,
                    moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=32, shared_expert=True, first_dense=1,
                                  balance_coef=0.01, router_z_coef=1e-3, bias_update_speed=1e-3))
DATA = {"kind": "synthetic", "seq_len": 32, "min_doc_len": 4,
        "sources": [{"name": "markov", "kind": "markov", "weight": 0.5, "alphabet": 32, "order": 1,
                     "support": 4, "concentration": 0.5},
                    {"name": "copy", "kind": "copy", "weight": 0.5, "alphabet": 32, "segment": 12}]}


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.to(F64).detach().requires_grad_()


# ---- components: each returns (objective, {name: float64 leaf}) ---------------------------------
def attention(T: int):
    cfg = ModelConfig(vocab_size=2, seq_len=T, d_model=32, n_heads=4, n_kv_heads=2)
    attn = attention_mod.Attention(cfg).to(F64)
    attn.init_weights(0.3, 0.3)  # NOTE: large enough that the softmax is far from uniform
    cos, sin = (t.to(F64) for t in rope_mod.rope_tables(T, cfg.head_dim, cfg.rope_theta))
    x, w = _leaf(torch.randn(2, T, 32)), torch.randn(2, T, 32, dtype=F64)
    return (lambda: ((attn(x, cos, sin) * w).sum(), None)), {
        "x": x, "qkv.weight": attn.qkv.weight, "proj_out.weight": attn.proj_out.weight}


def attention_qk_norm(T: int):
    cfg = ModelConfig(vocab_size=2, seq_len=T, d_model=32, n_heads=4, n_kv_heads=2, qk_norm=True)
    attn = attention_mod.Attention(cfg).to(F64)
    attn.init_weights(0.3, 0.3)
    with torch.no_grad():  # gains away from 1: a gain missing from the backward would show
        for norm in (attn.q_norm, attn.k_norm):
            norm.weight.add_(0.3 * torch.randn(cfg.head_dim, dtype=F64))
    cos, sin = (t.to(F64) for t in rope_mod.rope_tables(T, cfg.head_dim, cfg.rope_theta))
    x, w = _leaf(torch.randn(2, T, 32)), torch.randn(2, T, 32, dtype=F64)
    return (lambda: ((attn(x, cos, sin) * w).sum(), None)), {
        "x": x, "qkv.weight": attn.qkv.weight, "q_norm.weight": attn.q_norm.weight,
        "k_norm.weight": attn.k_norm.weight, "proj_out.weight": attn.proj_out.weight}


def rope(T: int):
    cos, sin = (t.to(F64) for t in rope_mod.rope_tables(T, 8, 10000.0))
    x, w = _leaf(torch.randn(2, T, 4, 8)), torch.randn(2, T, 4, 8, dtype=F64)
    return (lambda: ((rope_mod.apply_rope(x, cos, sin) * w).sum(), None)), {"x": x}


def rmsnorm(T: int):
    norm = nn.RMSNorm(32, eps=1e-5).to(F64)
    with torch.no_grad():
        norm.weight.add_(0.3 * torch.randn(32, dtype=F64))
    x, w = _leaf(3 * torch.randn(2, T, 32)), torch.randn(2, T, 32, dtype=F64)
    return (lambda: ((norm(x) * w).sum(), None)), {"x": x, "weight": norm.weight}


def _swiglu_objective(gate, up, w):
    # region = the clamp masks: a coordinate whose ±h crosses |x| = L changes them and is re-drawn
    return lambda: ((swiglu_mod.swiglu(gate, up, L) * w).sum(), (gate > L, up.abs() > L))


def swiglu_inside(T: int):
    gate, up = (_leaf((2 * torch.rand(T, 16) - 1) * (L - 1)) for _ in range(2))
    return _swiglu_objective(gate, up, torch.randn(T, 16, dtype=F64)), {"gate": gate, "up": up}


def swiglu_outside(T: int):
    """Every element has gate > L, |up| > L, or both (at least 0.5 past the kink, 5e4 FD steps)."""
    kind = torch.randint(3, (T, 16))  # 0: gate clamped, 1: up clamped, 2: both
    inside = (2 * torch.rand(2, T, 16) - 1) * (L - 1)
    past = L + 0.5 + 4.5 * torch.rand(2, T, 16)
    sign = torch.where(torch.rand(T, 16) < 0.5, -1.0, 1.0)
    gate = _leaf(torch.where(kind != 1, past[0], inside[0]))
    up = _leaf(torch.where(kind != 0, sign * past[1], inside[1]))
    return _swiglu_objective(gate, up, torch.randn(T, 16, dtype=F64)), {"gate": gate, "up": up}


def moe(T: int):
    cfg = MoEConfig(n_experts=4, top_k=2, expert_hidden=16, shared_expert=True, balance_coef=0.01,
                    router_z_coef=1e-3)
    layer = MoE(cfg, 16, L).to(F64)
    layer.init_weights(0.3, 0.3)
    layer.bias_E.copy_(0.05 * torch.randn(4))  # the aux-loss-free bias moves selection, never the gates
    x, w = _leaf(torch.randn(2 * T, 16)), torch.randn(2 * T, 16, dtype=F64)

    def objective():
        out = layer(x)
        return (out.y * w).sum() + out.aux_loss, out.route_ids_Nk  # region: the chosen expert ids

    return objective, {"x": x, "router.weight": layer.router.weight,
                       "experts.w_gate_up": layer.experts.w_gate_up, "experts.w_down": layer.experts.w_down}


def ce_zloss(T: int):
    logits = _leaf(2 * torch.randn(2, T, 11))
    labels = torch.where(torch.rand(2, T) < 0.25, IGNORE_INDEX, torch.randint(11, (2, T)))

    def objective():
        tl = loss_mod.token_losses(logits, labels)
        return tl.loss_sum + 0.1 * tl.z_sum, None

    return objective, {"logits": logits}


def capture_routes(model) -> dict:
    """A dict that every forward fills with {MoE layer: chosen expert ids} (forward hooks)."""
    routes = {}
    for i, m in model.moe_layers():
        m.register_forward_hook(lambda mod, args, out, i=i: routes.__setitem__(i, out.route_ids_Nk))
    return routes


def model_objective(model, routes: dict, tokens, labels):
    """optim/accumulate.py's objective for one micro-batch on one rank: (CE + z·lse²)/n_valid + aux.
    Region: every MoE layer's chosen expert ids (routes from capture_routes)."""
    def objective():
        routes.clear()
        out = model(tokens, labels)
        return (out.loss_sum + Z_COEF * out.z_sum) / out.n_valid + out.aux_loss, dict(routes)

    return objective


# ---- the lesson: PAD targets --------------------------------------------------------------------
def pad_targets(labels: torch.Tensor) -> torch.Tensor:
    """The bug: padding positions keep PAD as their target instead of IGNORE_INDEX."""
    return torch.where(labels == IGNORE_INDEX, PAD_ID, labels)


class PadTargets:
    """A dataset whose batches carry the bug; everything else is the wrapped dataset's."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __getattr__(self, name):
        return getattr(self.dataset, name)

    def samples(self, ids, split: str = "train"):
        b = self.dataset.samples(ids, split)
        return dataclasses.replace(b, labels=pad_targets(b.labels))


BUILDERS = {"attention (GQA + RoPE)": attention, "attention + QK-norm": attention_qk_norm, "RoPE": rope, "RMSNorm": rmsnorm,
            "SwiGLU inside clamp": swiglu_inside, "SwiGLU outside clamp": swiglu_outside,
            "MoE router gates + experts": moe, "cross-entropy + z-loss": ce_zloss}


def run(seed: int, quick: bool = False) -> dict:
    with single_thread():
        return _run(seed, quick)


def _run(seed: int, quick: bool) -> dict:
    torch.manual_seed(seed)
    T, n = (16, 20) if quick else (32, 48)
    gen = torch.Generator().manual_seed(seed)
    components, clamp = check_components(T, n, gen)
    whole, lesson = mask_bug_lesson(seed, LESSON_STEPS, n, gen, HELDOUT // 2 if quick else HELDOUT)
    components["whole model (dense + MoE)"] = whole
    checks = {f"{name}: rel err <= {TOL:g}": c["rel_err"] <= TOL for name, c in components.items()}
    checks["autograd gradient is exactly 0 where the SwiGLU clamp bites"] = (
        clamp["clamped"] > 0 and clamp["exact_zero"] == clamp["clamped"])
    checks["mask bug passes gradcheck AND changes the loss"] = (
        lesson["bug_rel_err"] <= TOL
        and abs(lesson["loss_bug"] - lesson["loss_correct"]) > LOSS_CHANGE * lesson["loss_correct"])
    h = lesson["heldout"]
    checks[f"held out ({h['samples']} samples): the buggy objective's loss is > {SE_MIN:g} SE below the exact "
           "floor, the correct objective's is not below it"] = (
        h["bug_excess"] + SE_MIN * h["bug_se"] < 0 and h["correct_excess"] + SE_MIN * h["correct_se"] > 0)
    result = {"seed": seed, "quick": quick, "tol": TOL, "components": components, "clamp": clamp,
              "lesson": lesson, "checks": checks, "ok": all(checks.values())}
    result["table"] = table(result)
    return result


def check_components(T: int, n: int, gen: torch.Generator) -> tuple[dict, dict]:
    """fd_check of every component; and, outside the clamp, autograd's gradient at *every* clamped element."""
    components, clamp = {}, None
    for name, build in BUILDERS.items():
        objective, tensors = build(T)
        components[name] = fd_check(objective, tensors, n, gen)
        if build is swiglu_outside:
            grads, (gate_hit, up_hit) = autograd_grads(objective, tensors)
            clamped = torch.cat([grads["gate"][gate_hit], grads["up"][up_hit]])
            clamp = {"clamped": clamped.numel(), "exact_zero": int((clamped == 0).sum())}
    return components, clamp


@torch.no_grad()
def heldout_excess(model, dataset, samples: int) -> dict:
    """Mean over held-out samples of (objective's loss per label − exact floor per real token), for the
    buggy and the correct objective, with the standard error of each mean."""
    ex = {"bug": [], "correct": []}
    for b in eval_batches(dataset, samples, 64):
        valid_BT = b.labels != IGNORE_INDEX
        floor_B = (b.floor * valid_BT).sum(1) / valid_BT.sum(1)
        for key, labels in (("correct", b.labels), ("bug", pad_targets(b.labels))):
            out = model(b.tokens, labels)
            ex[key] += (out.loss_sum_B / out.n_valid_B - floor_B).tolist()
    res = {"samples": samples}
    for key, xs in ex.items():
        m = sum(xs) / len(xs)
        res[f"{key}_excess"] = m
        res[f"{key}_se"] = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))
    return res


def mask_bug_lesson(seed: int, steps: int, n: int, gen: torch.Generator, heldout: int = HELDOUT) -> tuple[dict, dict]:
    """Train the tiny mixed model with PAD targets; on a held-out batch, gradcheck the whole model on the
    correct objective and on the buggy one, and compare their losses and gradients."""
    dataset = build_data(DataConfig.from_dict({**DATA, "seed": seed}))
    trained = {}
    curve = train_small(MODEL, {}, PrecisionConfig(), steps, 16, seed, eval_samples=16,
                        dataset=PadTargets(dataset), on_step=lambda s, m, o, l: trained.setdefault("m", m))
    held = heldout_excess(trained["m"], dataset, heldout)
    model = copy.deepcopy(trained["m"]).to(F64)
    batch = eval_batches(dataset, 16, 16)[0]
    params, routes = dict(model.named_parameters()), capture_routes(model)
    correct = model_objective(model, routes, batch.tokens, batch.labels)
    buggy = model_objective(model, routes, batch.tokens, pad_targets(batch.labels))
    whole, bug = fd_check(correct, params, n, gen), fd_check(buggy, params, n, gen)
    g_ok, g_bug = (torch.cat([g.flatten() for g in autograd_grads(f, params)[0].values()]) for f in (correct, buggy))
    with torch.no_grad():
        loss_ok, loss_bug = correct()[0].item(), buggy()[0].item()
    return whole, {"steps": steps, "reported_train_loss": sum(curve["train_loss"][-10:]) / 10,
                   "floor": dataset.expected_floor(), "batch_floor": (batch.floor.sum() / batch.n_valid).item(),
                   "loss_correct": loss_ok, "loss_bug": loss_bug, "labels_correct": batch.n_valid,
                   "labels_bug": int((pad_targets(batch.labels) != IGNORE_INDEX).sum()),
                   "bug_rel_err": bug["rel_err"], "bug_coords": bug["coords"],
                   "grad_difference": rel_err(g_bug, g_ok), "train_loss": curve["train_loss"], "heldout": held}


def table(r: dict) -> str:
    lines = [f"{'component':<28}{'coords':>7}{'re-drawn':>9}{'rel err':>10}{'max |Δg|':>10}{'|g_ad|':>9}  pass"]
    for name, c in r["components"].items():
        ok = c["rel_err"] <= r["tol"]
        lines.append(f"{name:<28}{c['coords']:>7}{c['skipped']:>9}{c['rel_err']:>10.1e}{c['max_abs_err']:>10.1e}"
                     f"{c['grad_norm']:>9.2e}  {'ok' if ok else 'FAIL'}")
    worst = max(r["components"], key=lambda k: r["components"][k]["rel_err"])
    lines += [f"worst rel err {r['components'][worst]['rel_err']:.1e} ({worst}); tolerance {r['tol']:g}; "
              "re-drawn = coordinates whose ±h crossed a clamp kink or changed the top-k experts",
              f"SwiGLU clamp: autograd gives exactly 0 at {r['clamp']['exact_zero']}/{r['clamp']['clamped']} "
              "clamped elements (the true derivative there is 0)"]
    s = r["lesson"]
    lines += ["", "lesson: backward ran ≠ the objective is right (padding labels left as PAD, not ignore_index)",
              f"  trained {s['steps']} steps with the bug: reported train loss {s['reported_train_loss']:.4f} "
              f"vs exact floor {s['floor']:.4f} nats/token"
              + ("  ← below the floor: impossible for the true objective" if s["reported_train_loss"] < s["floor"] else ""),
              f"  held-out batch, same model: buggy objective {s['loss_bug']:.4f} over {s['labels_bug']} labels | "
              f"correct objective {s['loss_correct']:.4f} over {s['labels_correct']} labels | "
              f"floor {s['batch_floor']:.4f}",
              f"  gradcheck of the buggy objective: rel err {s['bug_rel_err']:.1e} on {s['bug_coords']} coords "
              f"({'passes' if s['bug_rel_err'] <= r['tol'] else 'FAILS'}); its gradient differs from the correct "
              f"objective's by {s['grad_difference']:.0%}"]
    h = s.get("heldout")
    if h:
        lines += [f"  held out, {h['samples']} samples, loss − exact floor (± SE): buggy objective "
                  f"{h['bug_excess']:+.3f} ± {h['bug_se']:.3f} ({h['bug_excess'] / h['bug_se']:+.1f} SE) | "
                  f"correct objective {h['correct_excess']:+.3f} ± {h['correct_se']:.3f}   ← the decisive number "
                  "(the train-loss line above is a 10-step mean of a noisy curve)"]
    lines += [""] + [f"[{'ok' if v else 'FAIL'}] {k}" for k, v in r["checks"].items()]
    return "\n".join(lines)


def plot(r: dict, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, c, b) = plt.subplots(1, 3, figsize=(17, 4.2))
    names = list(r["components"])
    errs = [max(r["components"][n]["rel_err"], 1e-17) for n in names]
    a.barh(names, errs, color=["C0" if e <= r["tol"] else "C3" for e in errs])
    a.axvline(r["tol"], color="k", ls=":", label=f"tolerance {r['tol']:g}")
    a.set_xscale("log")
    a.invert_yaxis()
    a.set_xlabel("‖g_ad − g_fd‖ / max(‖g_ad‖, ‖g_fd‖)")
    a.set_title("autograd vs central differences (float64)")
    a.legend(fontsize=8)
    s = r["lesson"]
    h = s["heldout"]
    c.bar(["buggy objective\n(PAD targets)", "correct objective\n(same model)"],
          [h["bug_excess"], h["correct_excess"]], yerr=[3 * h["bug_se"], 3 * h["correct_se"]], capsize=6,
          color=["C3", "C0"])
    c.axhline(0, color="k", lw=1, label="exact floor of the held-out tokens")
    c.set_ylabel("held-out loss − exact floor (nats/token, ±3 SE)")
    c.set_title(f"held out ({h['samples']} samples): buggy {h['bug_excess']:+.2f} = "
                f"{h['bug_excess'] / h['bug_se']:+.1f} SE below the floor", fontsize=9)
    c.legend(fontsize=8)
    c.grid(alpha=0.3, axis="y")
    ys = s["train_loss"]
    b.plot(range(1, len(ys) + 1), ys, label="reported train loss (PAD targets counted)")
    b.axhline(s["floor"], color="k", lw=1, label=f"exact floor of the data {s['floor']:.3f}")
    b.scatter([len(ys)], [s["loss_correct"]], color="C3", zorder=3,
              label=f"correct objective, same model, held-out batch {s['loss_correct']:.3f}")
    b.scatter([len(ys)], [s["batch_floor"]], color="k", marker="x", zorder=3,
              label=f"exact floor of that batch {s['batch_floor']:.3f}")
    b.set_xlabel("step")
    b.set_ylabel("nats/token")
    b.set_title(f"buggy objective passes gradcheck (rel err {s['bug_rel_err']:.0e})")
    b.legend(fontsize=8)
    b.grid(alpha=0.3)
    if not math.isfinite(min(ys)):
        b.set_ylim(0, 5)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
