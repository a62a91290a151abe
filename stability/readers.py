"""The signal registry's readers (stability/signals.py declares each signal with one): where a quantity's values live
in a StepRecord, and when a reading counts. A reader takes (record, ReadContext) and returns its readings, (series
name, value, model layer or None, count or None); the `when` predicates say when a value is a reading at all.

NOTE: plain Python, no torch: the doctor reads records without the training stack.
"""
from __future__ import annotations

import math


def _num(v) -> bool:
    return v is not None and not isinstance(v, (dict, list, str, bool))


def field_(key: str, when=lambda r, c: True):
    """A top-level number of the record."""
    def read(r, c):
        v = r.get(key)
        return [(key, v, None, None)] if _num(v) and when(r, c) else []
    return read


def inputs_(key: str, when=lambda r, c: True):
    def read(r, c):
        v = (r.get("inputs") or {}).get(key)
        return [(f"input.{key}", v, None, None)] if _num(v) and when(r, c) else []
    return read


def per_layer(key: str, when=lambda r, c: True):
    """layers[<model layer>][key] on telemetry steps, in model order."""
    def read(r, c):
        if not when(r, c):
            return []
        return [(f"{key}/{name}", q[key], name, None) for name, q in (r.get("layers") or {}).items()
                if key in q and _num(q[key])]
    return read


def flag(key: str, when=lambda r, c: True):
    def read(r, c):
        return [(f"nonfinite.{key}", float(bool((r.get("nonfinite") or {}).get(key))), None, None)] if when(r, c) else []
    return read


def state_(prefixes: tuple):
    """state[<prefix>/<member>] in the record's order (after the update; a vetoed update moved nothing)."""
    def read(r, c):
        if r.get("skipped"):
            return []
        return [(f"state.{k}", v, None, None) for k, v in (r.get("state") or {}).items()
                if k.split("/", 1)[0] in prefixes and _num(v)]
    return read


def _typical(r, c):
    return c.typical


def _warm_typical(r, c):
    return c.warm and c.typical


def _warm(r, c):
    return c.warm


def _not_overflow(r, c):
    return not c.overflow


def _not_skipped(r, c):
    return not r.get("skipped")


SWITCH_TRIGGER = "input.data_fingerprint"  # the guard's trigger when the data manifest changes (stability/guard.py)


def _fingerprint_switch(r, c):
    return [("input.data_fingerprint_changed", float(SWITCH_TRIGGER in (r.get("guard") or {}).get("triggers", [])),
             None, None)]


def _rank_loss_spread(r, c):
    loss = (r.get("ranks") or {}).get("loss") or []
    if len(loss) > 1 and all(math.isfinite(v) for v in loss):
        return [("ranks.loss_spread", max(loss) - min(loss), None, None)]
    return []


def _by_source(key: str):
    def read(r, c):
        counts = r.get("tokens_by_source") or {}
        return [(f"{key}/{src}", v, None, counts.get(src)) for src, v in (r.get(key) or {}).items() if _num(v)]
    return read


# nats: a bound on the per-token loss's standard deviation at the floor. A token's loss lies in [0, log V] and a
# bounded variable's SD is at most half its range (Popoviciu): log(32)/2 ≈ 1.73 for the synthetic sources'
# 32-symbol alphabets; 2.0 covers any source of up to e⁴ ≈ 55 symbols
S_TOK = 2.0


def _deficit(loss: float, floor: float, n) -> float:
    """How far below its exact floor a mean loss over n tokens is, in standard errors of a model AT the
    floor (σ ≤ S_TOK per token): > 0 is better than possible; a few is batch noise."""
    return (floor - loss) * math.sqrt(max(float(n or 1), 1.0)) / S_TOK


def _floor_deficit(r, c):
    """Per source, the train batch's loss against its exact floor: the batch's own (record v4
    `floor_by_source`, the expected loss of those very labels) or else the data's stationary floor."""
    floors = r.get("floor_by_source") or c.floors or {}
    counts = r.get("tokens_by_source") or {}
    out = []
    for src, v in (r.get("loss_by_source") or {}).items():
        f = floors.get(src)
        if _num(v) and _num(f) and math.isfinite(v) and src in counts:
            out.append((f"below_floor/{src}", _deficit(v, f, counts[src]), None, None))
    return out


def _eval_deficit(r, c):
    """The evaluation's loss against its exact floor (overall; by source where the record has the floors)."""
    ev = r.get("eval") or {}
    out = []
    if _num(ev.get("loss")) and _num(ev.get("floor")):
        out.append(("eval_below_floor", _deficit(ev["loss"], ev["floor"], ev.get("tokens")), None, None))
    floors = ev.get("floor_by_source") or {}
    for src, v in (ev.get("by_source") or {}).items():
        f, n = floors.get(src), (ev.get("tokens_by_source") or {}).get(src)
        if _num(v) and _num(f) and n:
            out.append((f"eval_below_floor/{src}", _deficit(v, f, n), None, None))
    return out


def _lr_schedule(r, c):
    if c.lr_expected is None or not _num(r.get("lr")):
        return []
    return [("lr/schedule", r["lr"] / c.lr_expected if c.lr_expected else math.nan, None, None)]


def _moe(key: str, fn):
    """One number per MoE layer from record.moe[layer] (every step)."""
    def read(r, c):
        out = []
        for layer, m in (r.get("moe") or {}).items():
            v = fn(m)
            if v is not None:
                out.append((f"{key}/moe{layer}", v, f"moe{layer}", None))
        return out
    return read


def _load_entropy(m: dict):
    """exp(entropy) of the expert load: the effective number of experts in use (E when balanced)."""
    load = [x for x in (m.get("load") or []) if x is not None]
    tot = sum(load)
    if not load or tot <= 0:
        return None
    return math.exp(-sum(x / tot * math.log(x / tot) for x in load if x > 0))


def _out_rms_min(m: dict):
    """The smallest expert output RMS relative to the median of the layer's experts (record v4 out_rms):
    an expert whose output vanished keeps its load but goes to 0 here."""
    rms = [x for x in (m.get("out_rms") or []) if x is not None]
    if len(rms) < 2:
        return None
    med = sorted(rms)[len(rms) // 2]
    return min(rms) / med if med > 0 else None


def _replica(r, c):
    return [(f"replica.{k}", v, None, None) for k, v in (r.get("replica") or {}).items() if _num(v)]
