"""The doctor's fault classes, each declared once: what it means, and its row of the course's symptom
table where it has one (docs/course.md §10: symptom, what to check first, what it is easily mistaken for).

A Signal (stability/signals.py) names the class it implies when it moves first; a drill (stability/drills/)
names the class it must produce; the doctor's rules name the classes its context decides. tests/test_signals.py
checks that every one of those names is declared here.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FaultClass:
    name: str
    means: str
    symptom: tuple[str, str, str] | None = None  # (symptom, check first, easily mistaken for)
    natural: bool = False  # an incident of this class may be the run itself (doctor/judge.py weighs it)


CLASSES: dict[str, FaultClass] = {}


def declare_class(name: str, means: str, symptom: tuple[str, str, str] | None = None,
                  natural: bool = False) -> FaultClass:
    if name in CLASSES:
        raise ValueError(f"fault class {name!r} declared twice")
    c = CLASSES[name] = FaultClass(name, means, symptom, natural)
    return c


def symptom(name: str) -> tuple[str, str, str] | None:
    c = CLASSES.get(name)
    return c.symptom if c else None


declare_class("healthy", "no incident was judged a fault")
declare_class("data.corrupted_batch", "the batch deviated before any forward (noise, repetition, misaligned labels)")
declare_class("data.distribution_shift", "one source's content changed under the same data fingerprint")
declare_class("data.continuity", "the data cursor broke its order (ids repeated, skipped or reset)")
declare_class("data.repeated_batch", "the batch content repeats while the sample ids advance")
declare_class("data.switch", "the data mixture switched and a source's loss rose above its trajectory")
declare_class("data.slow_worsening", "the loss worsens slowly with a flat gradient norm",
              ("slow worsening with a flat grad norm (loss 缓慢恶化且 norm 平稳)",
               "data mixture, duplication rate, labels or mask", "numerical overflow"))
declare_class("objective.mixture", "the data mixture switched; each source stayed on its trajectory")
declare_class("rank.data", "one rank's inputs left the sharding or the content its ids name")
declare_class("numerics.nonfinite", "a non-finite value", ("one-step NaN (单步突然 NaN)",
              "the current batch, loss scale, reductions and kernels", "an LR that is too large in general"))
# NOTE: the spike classes, an update that jumped and clipping are what a clean run also shows as it learns: each
# is judged (natural or fault, doctor/judge.py); every other class names a broken invariant, a changed setting
# or data, a fault whatever happens after it
declare_class("numerics.activation_outlier", "an activation moved first", natural=True)
declare_class("numerics.attention_logits", "an attention block's logits grew first", natural=True)
declare_class("forward.loss_spike", "the loss rose first with normal inputs and settings", natural=True)
declare_class("forward.below_floor", "the loss fell below the exact floor: the model sees what it predicts")
declare_class("optim.gradient_spike", "the gradient (and with it the update) moved first", natural=True)
declare_class("optim.lr_switch", "the LR left its schedule")
declare_class("optim.state", "the update or the optimizer state jumped with a normal gradient and LR", natural=True)
declare_class("optim.settings", "an optimizer setting changed without the config saying so (every layer's "
              "update, or the weights' decay)")
declare_class("optim.heavy_clipping", "the clip coefficient fell and stayed low: clipping hides a recipe problem",
              natural=True)
declare_class("numerics.mismatch", "a layer computes another function than its specification (a kernel, a hook, "
              "a module)")
declare_class("numerics.precision", "a layer rounds coarser than its precision recipe says (a cast, a kernel)")
declare_class("optim.gradient_mismatch", "the gradient is not the gradient of the step's own loss (its backward, a "
              "hook, the token normalisation)")
declare_class("moe.routing", "an MoE layer's experts or gates are not its router's definition")
declare_class("moe.balancing", "an MoE layer's balancing bias or loss did not follow its rule")
declare_class("state.continuity", "a step started from another state than the previous step left")
declare_class("moe.load_collapse", "an MoE layer's routing collapsed onto a few experts")
declare_class("moe.dead_expert", "an expert's output vanished while its routing stayed")
declare_class("state.resume_fault", "the resumed state is not the saved one", ("jump right after resume (resume 后立即跳变)",
              "optimizer / scheduler state, RNG, data cursor", "a new data distribution"))
declare_class("state.config_change", "the run's config changed without a resume declaring it")
declare_class("system.rank_divergence", "the replicas stopped holding the same bits",
              ("only some ranks diverge (只有某些 rank 发散)", "the collective, shard ownership, a bad device",
               "ordinary random fluctuation"))
declare_class("system.throughput", "throughput dropped with a normal loss",
              ("throughput drop with a normal loss (吞吐下降但 loss 正常)",
               "shapes, routing load, communication and recomputation", "optimizer degradation"))
declare_class("system.slow_component", "one component of the step slowed",
              ("throughput drop with a normal loss (吞吐下降但 loss 正常)",
               "the one component whose share of the step grew (data / fwd_bwd / optim)", "a machine-wide slowdown"))
