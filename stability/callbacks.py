"""The seam where components act on the step: named points of one optimizer step, and the step's state.

train.py runs the step — batch → forward/backward → clip → guard → update → record — and calls the
attached callbacks at these points (OLMo-core's trainer does the same), so a drill, per-layer telemetry
or anticipatory routing is one object attached at start, and the loop does not grow with them:

    before_batch(s)     before loader.next()                    a mixture switch drill
    on_batch(s)         s.batch is this step's batch            a data drill corrupts it; anticipatory
                                                                routing sets s.routes / s.routing
    before_forward(s)   right before the first micro-batch      telemetry hooks on; NaN / reduce drills arm
    before_update(s)    gradients final (after the backward),   telemetry snapshots θ; an LR drill scales
                        before clip, guard and optimizer.step   the LRs (s.lr and s.max_grad_norm are read
                                                                after this point)
    after_clip(s)       s.update holds the measured norm and    the clip check compares them with the policy
                        the clip coefficient, before the guard  (spec/checks/clip.py)
                        and the optimizer step
    after_update(s)     s.result holds the update's outcome,    QK-clip rescales W_q, W_k (the levers);
                        before zero_grad                        telemetry reads grads and Δθ into s.post;
                                                                an LR drill restores the planned LRs; an
                                                                optimizer-state drill corrupts the moments
    end_step(s)         the step's state is final (scheduler    the specification checks take what the step
                        stepped, balancing bias moved), before  left (spec/monitor.py)
                        the step's read

Each callback declares, where it is defined, its `order` at every point it acts at (lower runs
first; `Callbacks` sorts once and refuses a tie): the drill acts first on the way in (it corrupts the
batch or arms a hook before anyone measures) and last on the way out, where QK-clip rescales W_q, W_k
first, telemetry then measures the whole update, and an optimizer-state drill corrupts the moments
after both.
WARN: every rank must call every point (telemetry and the reduce drill run collectives inside them).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass
class StepState:
    """What one step has computed so far, in the order the step fills it: each section names the phase
    that writes its fields and who writes them there; a later phase only reads an earlier one's (a drill
    at its point may rewrite its own phase's inputs). stability/record.py turns it into the StepRecord.

    NOTE: `numbers` (valid tokens, input statistics, global sums, per-rank inputs, the update's norm and clip
    coefficient: stability/step_numbers.py StepNumbers) is the host's copy of the step's device tensors
    (parallel/host_scalars.py), set by train.py where it reads them: before the update only when the guard
    judges first; no callback point sees them, so no callback makes the step wait for them."""
    step: int                         # the loop
    # --- batch: train.py (loader.next, micro-batches, the global valid count on the device) and the
    # on_batch callbacks (a data drill replaces the batch; anticipatory routing sets routes, routing) ---
    first_id: int = 0                 # global id of the batch's first sample (the batch ID)
    batch: Any = None                 # this rank's Batch
    micro: list = field(default_factory=list)     # its micro-batches, on the device
    routes: list | None = None        # anticipatory routes per micro-batch (None: normal top-k routing)
    routing: dict = field(default_factory=dict)   # StepRecord.routing
    n_valid_t: Any = None             # global valid label tokens, a device tensor, before any forward
    host: Any = None                  # the step's HostScalars: a callback puts device tensors for its one read
    # --- update: the before_update callbacks (an LR / clip drill), train.py's optimizer step and the guard's
    # veto in it, then the after_update callbacks (levers: qk_clip, clip; telemetry: post) ---
    max_grad_norm: float | None = None  # the clip threshold this step's update uses (train.max_grad_norm
    #                                   unless a drill changed it; read after before_update)
    lr: float = float("nan")          # the LR this step's update used (group 0, without its lr_scale)
    update: Any = None                # precision.step.Update: the norm and clip coefficient, before the step
    vetoed: bool = False              # the guard vetoed this update (known before it when the guard can veto)
    result: Any = None                # precision.step.StepResult: as the update left it, before the read (its
    #                                   `skipped` may be the device's 0-d flag); the host's answer is `skipped`
    post: dict = field(default_factory=dict)      # telemetry after the update (layers, ρ, replicas; train.py
    #                                               adds the optimizer state's non-finite flag)
    clip: dict = field(default_factory=dict)      # the adaptive clip's numbers (train.clip=zscore)
    qk_clip: dict = field(default_factory=dict)   # heads QK-clip scaled after the update
    # --- the read: train.py, from the host's copy (before the update when the guard judges first) ---
    numbers: Any = None               # stability.step_numbers.StepNumbers: the forward's and the clip's numbers
    skipped: bool = False             # the update was not applied: a non-finite gradient or the guard's veto
    # --- post-update and record: train.py after the scheduler step (time_s.route: anticipatory routing,
    # booked at on_batch; events: any writer, one-line notes) ---
    loads: dict = field(default_factory=dict)     # MoE layer -> (E,) global expert loads, on the device
    moe: dict = field(default_factory=dict)       # expert-load summary per MoE layer
    spec: dict = field(default_factory=dict)      # StepRecord.spec: the specification checks (spec/monitor.py)
    opt_state: dict = field(default_factory=dict)  # optimizer-state and MoE-bias norms (stability/resume_fields.py)
    eval: dict | None = None
    events: list[str] = field(default_factory=list)  # one-line notes of this step (StepRecord.events)
    time_s: dict[str, float] = field(default_factory=dict)


POINTS = ("before_batch", "on_batch", "before_forward", "before_update", "after_clip", "after_update", "end_step")


class Callback:
    """Base: every point is a no-op. A subclass overrides the points it acts at and declares its
    `order` at each of them (lower runs first): the order is stated with the callback, not by where
    it happens to be attached.

    `reads_verdict`: True for a callback that, after the update, reads what the guard judged before it
    (FaultDrill's quiet-before-injection check). The step then reads its numbers before the update, as a
    vetoing guard makes it do; otherwise, under guard=log, the guard judges after the update."""
    order: ClassVar[dict[str, int]] = {}
    reads_verdict: bool = False

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        missing = [p for p in POINTS if getattr(cls, p) is not getattr(Callback, p) and p not in cls.order]
        if missing:
            raise TypeError(f"{cls.__name__} acts at {', '.join(missing)} without an order there (Callback.order)")

    def before_batch(self, s: StepState) -> None: ...

    def on_batch(self, s: StepState) -> None: ...

    def before_forward(self, s: StepState) -> None: ...

    def before_update(self, s: StepState) -> None: ...

    def after_clip(self, s: StepState) -> None: ...

    def after_update(self, s: StepState) -> None: ...

    def end_step(self, s: StepState) -> None: ...


class Callbacks:
    """The attached callbacks (None: not attached), each point's sorted once by the callbacks' `order`."""

    def __init__(self, callbacks):
        items = [c for c in callbacks if c is not None]
        self.at: dict[str, list[Callback]] = {}
        for point in POINTS:
            acting = sorted((c for c in items if point in c.order), key=lambda c: c.order[point])
            for a, b in zip(acting, acting[1:]):
                if a.order[point] == b.order[point]:
                    raise ValueError(f"callbacks {type(a).__name__} and {type(b).__name__} both declare order "
                                     f"{a.order[point]} at {point}: the order between them would be unstated")
            self.at[point] = acting
        self.reads_verdict = any(c.reads_verdict for c in self.at["after_update"])

    def before_batch(self, s: StepState) -> None:
        for c in self.at["before_batch"]:
            c.before_batch(s)

    def on_batch(self, s: StepState) -> None:
        for c in self.at["on_batch"]:
            c.on_batch(s)

    def before_forward(self, s: StepState) -> None:
        for c in self.at["before_forward"]:
            c.before_forward(s)

    def before_update(self, s: StepState) -> None:
        for c in self.at["before_update"]:
            c.before_update(s)

    def after_clip(self, s: StepState) -> None:
        for c in self.at["after_clip"]:
            c.after_clip(s)

    def after_update(self, s: StepState) -> None:
        for c in self.at["after_update"]:
            c.after_update(s)

    def end_step(self, s: StepState) -> None:
        for c in self.at["end_step"]:
            c.end_step(s)
