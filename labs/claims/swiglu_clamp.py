"""The SwiGLU clamp bounds the activation and zeroes the gradient past the bound (DeepSeek-V4; docs/design.md §6).

    clamped:  silu(min(gate, L)) · clamp(up, −L, L)        free:  silu(gate) · up

Inside the box (gate ≤ L, |up| ≤ L) both are the same function: same value, same gradient. Past the
bound the clamp is flat, so ∂/∂gate = 0 for gate > L and ∂/∂up = 0 for |up| > L: that element stops
learning through that path until it comes back inside. (The gate is only clamped from above: silu is
bounded below.) Part 1 evaluates model/swiglu.swiglu on a (gate, up) grid; part 2 feeds the real
SwiGLU module (its own clamp telemetry on) inputs of growing scale and compares its weight gradient
with the unclamped module's.
"""
from __future__ import annotations

import copy

import torch

import model.swiglu as sw  # NOTE: the module, so a patched sw.swiglu is what both parts run
from labs.claims.tiny import MODEL, check_lines, figure, save
from labs.common import single_thread

TITLE = "swiglu_clamp: same forward inside the bound, zero gradient past it (gate > L, |up| > L)"
L = 10.0
POINTS = ((5.0, 5.0), (15.0, 5.0), (5.0, 15.0), (5.0, -15.0), (15.0, 15.0), (-15.0, 5.0))
INPUT_RMS = (1.0, 10.0, 30.0, 100.0, 300.0, 1000.0)


def _value_and_grads(gate: torch.Tensor, up: torch.Tensor, limit: float | None):
    gate, up = gate.clone().requires_grad_(), up.clone().requires_grad_()
    y = sw.swiglu(gate, up, limit)
    y.sum().backward()  # elementwise: each element's own ∂y/∂gate, ∂y/∂up
    return y.detach(), gate.grad, up.grad


def grid(n: int) -> dict:
    """The clamped and free SwiGLU on a gate × up grid spanning [−2L, 2L]²."""
    v = torch.linspace(-2 * L, 2 * L, n, dtype=torch.float64)
    gate_GU, up_GU = torch.meshgrid(v, v, indexing="ij")
    yc, dgc, duc = _value_and_grads(gate_GU, up_GU, L)
    yf, dgf, duf = _value_and_grads(gate_GU, up_GU, None)
    inside = (gate_GU <= L) & (up_GU.abs() <= L)
    gate_out, up_out = gate_GU > L, up_GU.abs() > L
    return {
        "n_points": gate_GU.numel(), "inside": int(inside.sum()),
        "forward_equal_inside": bool((yc[inside] == yf[inside]).all()),
        "grads_equal_inside": bool((dgc[inside] == dgf[inside]).all() and (duc[inside] == duf[inside]).all()),
        "dgate_zero_above_L": bool((dgc[gate_out] == 0).all()),
        "dgate_free_nonzero_above_L": bool((dgf[gate_out & (up_GU != 0)] != 0).all()),
        "dup_zero_outside": bool((duc[up_out] == 0).all()),
        "dup_free_nonzero_outside": bool((duf[up_out & (gate_GU != 0)] != 0).all()),  # silu(0) = 0
        "forward_bounded": float(yc.abs().max()), "forward_free_max": float(yf.abs().max()),
    }


def points() -> list[dict]:
    g = torch.tensor([p[0] for p in POINTS], dtype=torch.float64)
    u = torch.tensor([p[1] for p in POINTS], dtype=torch.float64)
    (yc, dgc, duc), (yf, dgf, duf) = _value_and_grads(g, u, L), _value_and_grads(g, u, None)
    return [{"gate": p[0], "up": p[1], "y": yc[i].item(), "y_free": yf[i].item(), "dgate": dgc[i].item(),
             "dgate_free": dgf[i].item(), "dup": duc[i].item(), "dup_free": duf[i].item()} for i, p in enumerate(POINTS)]


def module_sweep(seed: int, n_tokens: int) -> list[dict]:
    """The real SwiGLU module: clamp hit rate (its telemetry) and how much of ∇W_gate_up the clamp
    changes, by input RMS."""
    d = MODEL["d_model"]
    torch.manual_seed(seed)
    clamped = sw.SwiGLU(d, 4 * d, L)
    clamped.init_weights(0.02, 0.02)
    free = copy.deepcopy(clamped)
    free.limit = None
    clamped.record_stats = True
    x_ND = torch.randn(n_tokens, d)
    dy_ND = torch.randn(n_tokens, d)
    rows = []
    for rms in INPUT_RMS:
        grads = []
        for m in (clamped, free):
            m.zero_grad(set_to_none=True)
            m(x_ND * rms).backward(dy_ND)
            # NOTE: W_gate_up only: its gradient flows through ∂y/∂gate and ∂y/∂up, the clamp's zeros;
            # W_down's differs anyway, because the clamped activation it multiplies is smaller.
            grads.append(m.w_gate_up.weight.grad.flatten().double())
        rows.append({"input_rms": rms, "hit_rate": (clamped.clamp_hits / clamped.clamp_total).item(),
                     "grad_rel_change": ((grads[0] - grads[1]).norm() / grads[1].norm()).item()})
    return rows


def run(seed: int, quick: bool = False) -> dict:
    with single_thread():
        g = grid(41 if quick else 401)
        pts = points()
        sweep = module_sweep(seed, 256 if quick else 4096)
    no_hits = [s for s in sweep if s["hit_rate"] == 0]
    hits = [s for s in sweep if s["hit_rate"] > 0]
    checks = {
        "forward identical inside the bound (gate <= L, |up| <= L)": g["forward_equal_inside"],
        "gradients identical inside the bound": g["grads_equal_inside"],
        "∂/∂gate = 0 for gate > L (free SwiGLU: nonzero)": g["dgate_zero_above_L"] and g["dgate_free_nonzero_above_L"],
        "∂/∂up = 0 for |up| > L (free SwiGLU: nonzero)": g["dup_zero_outside"] and g["dup_free_nonzero_outside"],
        "SwiGLU module: no clamp hits → ∇W_gate_up identical to the free module's":
            bool(no_hits) and all(s["grad_rel_change"] == 0 for s in no_hits),
        "SwiGLU module: clamp hits → ∇W_gate_up differs from the free module's":
            bool(hits) and all(s["grad_rel_change"] > 0 for s in hits),
    }
    r = {"seed": seed, "quick": quick, "limit": L, "grid": g, "points": pts, "module_sweep": sweep,
         "checks": checks, "ok": all(checks.values())}
    r["table"] = table(r)
    return r


def table(r: dict) -> str:
    lines = [f"L = {r['limit']:g}: clamped silu(min(gate, L))·clamp(up, −L, L) vs free silu(gate)·up", "",
             f"{'gate':>7}{'up':>7}{'y':>10}{'y free':>10}{'∂y/∂gate':>11}{'free':>9}{'∂y/∂up':>10}{'free':>9}"]
    for p in r["points"]:
        lines.append(f"{p['gate']:>7g}{p['up']:>7g}{p['y']:>10.3f}{p['y_free']:>10.3f}{p['dgate']:>11.3f}"
                     f"{p['dgate_free']:>9.3f}{p['dup']:>10.3f}{p['dup_free']:>9.3f}")
    g = r["grid"]
    lines += [f"grid: {g['n_points']} points over [−2L, 2L]², {g['inside']} inside the bound; |y| ≤ "
              f"{g['forward_bounded']:.1f} clamped vs {g['forward_free_max']:.1f} free", "",
              "real SwiGLU module (d → 4d → d), clamp telemetry on, random upstream gradient",
              f"{'input RMS':>10}{'clamp hit rate':>16}{'‖∇W clamped − ∇W free‖ / ‖∇W free‖':>38}"]
    for s in r["module_sweep"]:
        lines.append(f"{s['input_rms']:>10g}{s['hit_rate']:>16.2%}{s['grad_rel_change']:>38.3e}")
    return "\n".join(lines + [""] + check_lines(r["checks"]))


def plot(r: dict, path) -> None:
    fig, (a, b) = figure(2)
    v = torch.linspace(-2 * L, 2 * L, 401, dtype=torch.float64)
    for up, color in ((5.0, "C0"), (15.0, "C3")):
        u = torch.full_like(v, up)
        _, dgc, _ = _value_and_grads(v, u, L)
        _, dgf, _ = _value_and_grads(v, u, None)
        a.plot(v, dgf, color=color, ls="--", lw=1, label=f"free, up={up:g}")
        a.plot(v, dgc, color=color, label=f"clamped, up={up:g}")
    a.axvline(L, color="k", ls=":", lw=1)
    a.set_xlabel("gate")
    a.set_ylabel("∂y/∂gate")
    a.set_title("gate gradient: zero past L")
    a.legend(fontsize=8)
    s = r["module_sweep"]
    b.loglog([x["input_rms"] for x in s], [max(x["hit_rate"], 1e-6) for x in s], "o-", label="clamp hit rate")
    b.loglog([x["input_rms"] for x in s], [max(x["grad_rel_change"], 1e-12) for x in s], "s--",
             label="rel. change of ∇W_gate_up")
    b.set_xlabel("SwiGLU input RMS")
    b.set_title("real SwiGLU module")
    b.legend(fontsize=8)
    b.grid(alpha=0.3, which="both")
    save(fig, path)
