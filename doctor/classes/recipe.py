"""The recipe's own instability (doctor/outcome.py), and the healthy verdict."""
from __future__ import annotations

from doctor.classes import declare_class, no_fix


def _instability(diag, run, ckpt, t, b, action, ck) -> dict:
    lv = diag.lever or {}
    over = lv.get("override")
    where = "from step 0 (a resume cannot apply it: doctor/levers.py)" if lv.get("from_start") else f"from {ck}"
    return {"variable": f"the recipe's lever: {lv.get('means', '?')} ({lv.get('key', '?')})",
            "change": (f"{over}: {lv.get('why', '')}; rerun {where} — every step did what the recipe told it, so the "
                       f"recipe is what to change, not the code" if over else lv.get("why", "")),
            "override": over,
            "expect": "no lasting damage: each source's loss back on its trajectory towards its floor, the spikes gone"}


declare_class("recipe.instability", "every step conformed to its specification, and the run took lasting damage, "
              "diverged, spiked again and again or stalled where its recipe's default learns: the recipe's own "
              "instability, fixed with a recipe lever", _instability,
              ("loss spikes that recur or leave lasting damage (loss 反复尖峰或留下持久损伤)",
               "LR, warm-up, clip threshold, z-loss, QK-norm / QK-clip, precision",
               "a fault in the data or the code (the specification checks rule that out)"))
declare_class("healthy", "no incident was judged a fault or a recipe instability", no_fix)
