"""Spike detector: robust rolling statistics per metric; non-finite values trigger at once.

For each watched metric x (loss, grad norm, max update ratio ...) the detector keeps the last `window`
*accepted* values and scores a new one by its robust z-score

    z = (x − median) / (1.4826 · MAD + rel_floor · |median| + 1e-12)        on x
    z = (y − median) / max(1.4826 · MAD, log_floor)                          on y = log x (a `log` metric)

(1.4826 · MAD estimates σ for Gaussian noise, and unlike a mean/std it is not dragged by the spike it
is meant to catch). A value with z > threshold ("up") or |z| > threshold ("both") is a spike. Metrics
marked `log` are scored on log(x): grad norms and update ratios are scale-free, a ×10 jump matters
the same at 0.1 as at 10, and their floor is in log units: rel_floor · |median of log x| would depend on
the unit (a median near 1 has log 0, so no floor at all), and a calm stretch then made a ×2.5 blip a spike.

  - a value that is a mean over n tokens (a per-source loss: `counts`) has noise ∝ 1/√n, and the MAD
    measured the noise at the history's typical n̄ (the median count): its z is scaled by √(n / n̄) when
    n < n̄ (never up: documents, not only tokens, vary). A source
    with a few tokens in a batch moves its loss by a large factor on clean runs: the noise of a few tokens,
    not a spike, which the scaling keeps under the threshold;
  - no z-score until `min_history` values were accepted (a detector with 3 points cries wolf), nor
    before step `warmup`: the first steps of training are a transient (loss, grad norm and ρ fall by
    an order of magnitude), not a baseline; their values still fill the history;
  - a spike is NOT added to the history, so it cannot raise the baseline that should catch the next;
  - after a spike the metric is in cooldown for `cooldown` steps: further z-spikes are reported as
    suppressed (one incident, one action). Non-finite values ignore cooldown and minimum history;
  - the state (histories, cooldowns, counts) is plain Python and rides in the TrainState, so a resumed
    run does not start blind.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from stability.config import DetectorConfig
from stability.signals import family


@dataclass
class Trigger:
    metric: str
    value: float
    threshold: float  # the z threshold (inf for a non-finite value)
    median: float | None
    z: float | None
    cooldown: int  # steps the metric is now quiet for
    suppressed: bool = False  # inside an earlier trigger's cooldown: reported, not acted on
    note: str | None = None   # a trigger that is not a number (an input switch): what changed

    @property
    def nonfinite(self) -> bool:
        return not math.isfinite(self.value)

    def describe(self) -> str:
        if self.note is not None:
            return f"{self.metric}: {self.note}"
        if self.nonfinite:
            return f"{self.metric} is {self.value}"
        return (f"{self.metric} {self.value:.4g} vs median {self.median:.4g}: robust z {self.z:.1f} > "
                f"{self.threshold:g}" + (" (in cooldown)" if self.suppressed else ""))


def _family(series: str) -> str:
    """The watched metric a series belongs to (`loss_by_source/copy` -> loss_by_source, `state.v/default` ->
    state): its signal's name in the registry."""
    sig = family(series)
    return sig.name if sig is not None else series.split("/")[0]


# NOTE: the spread assumed at least for a linear metric, relative to its median: a metric flat to the last
# digit (MAD 0) would otherwise turn any change into an infinite z
REL_FLOOR = 1e-3


class SpikeDetector:
    def __init__(self, cfg: DetectorConfig):
        """cfg: guard.detector, checked by the schema when it was built (stability/config.py)."""
        self.metrics = {n: {"direction": m.direction, "log": m.log} for n, m in cfg.metrics.items()}
        self.window, self.threshold, self.min_history = cfg.window, cfg.threshold, cfg.min_history
        self.cooldown, self.warmup, self.rel_floor, self.log_floor = cfg.cooldown, cfg.warmup, REL_FLOOR, cfg.log_floor
        self.history: dict[str, deque] = {m: deque(maxlen=self.window) for m in self.metrics}
        self.counts: dict[str, deque] = {}  # metric -> the sample sizes of its accepted values (when given)
        self.quiet_until: dict[str, int] = {m: 0 for m in self.metrics}  # cooldown ends before this step
        self.fired = 0  # triggers acted on, over the whole run
        self.last_trigger_step: int | None = None

    def _score(self, name: str, x: float, n: float | None = None) -> tuple[float, float] | None:
        hist = self.history[name]
        if len(hist) < self.min_history:
            return None
        med = statistics.median(hist)
        mad = statistics.median(abs(h - med) for h in hist)
        if self.metrics[_family(name)]["log"]:
            return med, (x - med) / max(1.4826 * mad, self.log_floor, 1e-12)
        z = (x - med) / (1.4826 * mad + self.rel_floor * abs(med) + 1e-12)
        seen = self.counts.get(name)
        if n and seen:  # a mean over n samples: its noise is ∝ 1/√n, the MAD's is that of the median count
            # NOTE: only ever down: a source's loss also varies by document, which more tokens of the same few
            # documents do not average away; the window's MAD is the noise claimed at n̄ and above
            z *= min(1.0, math.sqrt(n / statistics.median(seen)))
        return med, z

    def observe(self, step: int, values: dict[str, float], counts: dict[str, float] | None = None) -> list[Trigger]:
        """Score this step's values; accept the healthy ones into the history; return the triggers.

        Metrics absent from `values` (or None: e.g. telemetry not measured this step) are skipped. A
        key "family/member" (loss_by_source/markov) is scored with the spec of `family`, on a history
        of its own: one source's loss can jump while the mixture's total hides it in batch noise.
        `counts`: the number of tokens a value is the mean of (per-source losses), scaling its z by √(n/n̄).
        """
        triggers = []
        for name, x in values.items():
            spec = self.metrics.get(_family(name))
            if spec is None or x is None:
                continue
            if name not in self.history:
                self.history[name], self.quiet_until[name] = deque(maxlen=self.window), 0
            x = float(x)
            if not math.isfinite(x):
                triggers.append(Trigger(name, x, math.inf, None, None, self.cooldown))
                self.quiet_until[name] = step + self.cooldown + 1
                continue
            if spec["log"]:
                if x <= 0:  # log scale: a zero grad norm / update (a skipped step) says nothing
                    continue
                x_t = math.log(x)
            else:
                x_t = x
            n = (counts or {}).get(name)
            scored = self._score(name, x_t, n) if step >= self.warmup else None
            if scored is not None:
                med, z = scored
                spike = z > self.threshold if spec["direction"] == "up" else abs(z) > self.threshold
                if spike:
                    suppressed = step < self.quiet_until[name]
                    shown_med = math.exp(med) if spec["log"] else med
                    triggers.append(Trigger(name, x, self.threshold, shown_med, z, self.cooldown, suppressed))
                    if not suppressed:
                        self.quiet_until[name] = step + self.cooldown + 1
                    continue  # NOTE: a spike never joins the baseline
            self.history[name].append(x_t)
            if n:
                self.counts.setdefault(name, deque(maxlen=self.window)).append(float(n))
        if any(not t.suppressed for t in triggers):
            self.fired += 1
            self.last_trigger_step = step
        return triggers

    def state_dict(self) -> dict:
        return {"history": {m: list(h) for m, h in self.history.items()}, "quiet_until": dict(self.quiet_until),
                "counts": {m: list(c) for m, c in self.counts.items()},
                "fired": self.fired, "last_trigger_step": self.last_trigger_step}

    def load_state_dict(self, sd: dict) -> None:
        self.history = {m: deque(h, maxlen=self.window) for m, h in sd["history"].items()
                        if _family(m) in self.metrics}  # a metric dropped since the save is forgotten
        self.quiet_until = {m: sd["quiet_until"].get(m, 0) for m in self.history}
        # NOTE: a checkpoint from before counts were kept has none: those metrics score unscaled until seen
        self.counts = {m: deque(c, maxlen=self.window) for m, c in sd.get("counts", {}).items() if m in self.history}
        for m in self.metrics:  # a metric added since the save starts with an empty history
            self.history.setdefault(m, deque(maxlen=self.window))
            self.quiet_until.setdefault(m, 0)
        self.fired, self.last_trigger_step = sd["fired"], sd["last_trigger_step"]
