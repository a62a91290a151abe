"""A specification check: one declaration, registered like a signal or a drill.

A check compares what the step did with what its specification says, at the step's named points
(stability/callbacks.py), and measures how far it missed: for every place it looks at (a parameter, a layer,
a rank) an error `err` and the tolerance `tol` the precision recipe allows there (spec/tolerance.py), never a
calibrated threshold. The step's StepRecord holds the worst `miss = err / tol` of each check that ran; a miss
above 1 is an execution fault at that step, of the class the check declares for the way it failed.

    class ClipCheck(Check):
        name, layer, rank = "clip", UPDATE, 40
        kinds = {"coef": Kind("optim.settings", "the clip coefficient is not the configured policy's")}
        def after_clip(self, s): self.measure(err_P, tol_P, kind="coef")   # device tensors, nothing read

Everything a check measures stays on the device until the step's one read (parallel/host_scalars.py):
`measure` keeps them; at the read every check's worst place is packed as (miss, where, kind, err, tol) in one set
of ops (pack) and spec/monitor.py reads it with the step's other numbers. `rank` orders the registry: within a step
the first failed check in it is the first that broke (the state the step started from, 0; its data, 10; forward
20; gradient 30; update 40; the system, 60).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

LAYERS = ("input", "forward", "backward", "update", "system")
INPUT, FORWARD, BACKWARD, UPDATE, SYSTEM = LAYERS
STEP, REFERENCE = "step", "reference"  # cadences: every step | the reference steps (spec.every)
BEFORE, AFTER = "before", "after"      # verdict known before the update (the guard can veto) | after it


@dataclass(frozen=True)
class Kind:
    """One way a check can fail: the doctor class it implies and what to look at; `layer`, when this way of
    failing belongs to another timeline layer than the check's (a non-finite activation found by a gradient
    check is the forward's)."""
    cls: str
    fix: str
    layer: str | None = None


@dataclass
class SpecContext:
    """What checks read beside the step's state: the run's components, its typed config, the process."""
    cfg: Any            # run.config.Config (typed)
    model: torch.nn.Module   # the bare Transformer
    model_cfg: Any      # the model as the config says it (cfg.model sized by the data): the checks' and the reference's,
    #                     never the built model's own cfg (a model built against its config is what they catch)
    wrapped: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loader: Any
    dataset: Any
    dist: Any
    recipe: Any
    scaler: Any
    evals: list
    scheduler: Any = None
    clip_policy: Any = None  # the adaptive clip (train.clip=zscore), or None: the fixed clip
    sharded: bool = False    # FSDP2: parameters and gradients are shards
    compiled: bool = False   # train.compile: the step's forward is a compiled graph (no Python hooks inside)
    max_grad_norm: float | None = None  # train.max_grad_norm: the clip threshold the config sets
    reference_step: Any = None  # the monitor's: step -> whether it is a reference step (spec.every)
    reference_every: int = 1   # spec.every: a reference step every this many steps (and the first)
    names: dict[int, str] = field(default_factory=dict)  # id(parameter) -> its name
    # filled during a step, for the checks that read another's result
    probe: Any = None        # the monitor's probe(s): the step's probe run, on a reference step
    coef_spec: Any = None    # the clip coefficient the policy gives (spec/checks/clip.py), a device tensor
    coef_tol: Any = None     # the relative error the clip check allows the applied coefficient against it
    norm_finite: Any = None  # whether the gradient's norm is finite (a non-finite one skips the step)
    schedule: Any = None     # the LR schedule in force (spec/schedule.py fields): the lr check's, across a resume


CHECKS: dict[str, type["Check"]] = {}
_ARANGE: dict[tuple[int, str], Tensor] = {}


def on_device(value, device, dtype: torch.dtype | None = None) -> Tensor:
    """A host value (a Python number or list, or a tensor) as a tensor on `device`, the host not waiting for it.
    NOTE: a copy to a CUDA device from pageable memory (torch.tensor(x, device=cuda), cpu_tensor.to(cuda))
    synchronises: the host waits for every kernel queued before it, between the step's kernels
    (tests/test_host_syncs.py on a GPU). A number is filled on the device (no copy); anything else goes through
    pinned memory, asynchronously (torch's pinned allocator keeps the buffer until the copy has run)."""
    device = torch.device(device)
    if isinstance(value, (bool, int, float)):
        return torch.full((), value, dtype=dtype or torch.float64, device=device)
    t = torch.as_tensor(value, dtype=dtype)
    if t.device.type == "cpu" and device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _arange(n: int, device) -> Tensor:
    """0..n−1 in float64 on `device` (cached: the places a check measures are the same every step)."""
    key = (n, str(device))
    if key not in _ARANGE:
        _ARANGE[key] = torch.arange(n, dtype=torch.float64, device=device)
    return _ARANGE[key]


_LAYOUTS: dict[tuple, tuple] = {}


def _layout(key: tuple, device) -> tuple:
    """The index vectors that lay the checks' measurements out, by element: where each one's err, tol and kind lie
    in the packed vector (parts first, in the order measured, then the host numbers), its check's row and its place
    in that check. Cached: the same layout every step while the checks measure the same shapes."""
    cached = _LAYOUTS.get((key, str(device)))
    if cached is not None:
        return cached
    n_parts = sum(d for desc in key if desc is not None for d in desc if d >= 0)
    off, ci = 0, n_parts
    e_idx, t_idx, k_idx, seg, local, rows = [], [], [], [], [], []
    for j, desc in enumerate(key):
        if desc is None:
            continue
        length = desc[0] if desc[0] >= 0 else 1
        for d, out in zip(desc, (e_idx, t_idx, k_idx)):
            if d < 0:  # a host number, broadcast
                out += [ci] * length
                ci += 1
            else:  # a tensor: one element per place, or one for all
                out += list(range(off, off + length)) if d == length else [off] * length
                off += d
        seg += [len(rows)] * length
        local += range(length)
        rows.append(j)
    n = len(e_idx)
    as_dev = lambda v, dtype=torch.int64: on_device(v, device, dtype)  # noqa: E731
    empty = as_dev([[-1.0, 0, 0, 0, 0]] * len(key), torch.float64)  # the row of a check with nothing to report
    cached = (as_dev(e_idx), as_dev(t_idx), as_dev(k_idx), as_dev(seg), as_dev(local, torch.float64),
              as_dev(list(range(n))), n, len(rows), as_dev(rows), empty)
    if len(_LAYOUTS) >= 64:  # layouts that come and go (a check that raised, a resume): never an unbounded cache
        _LAYOUTS.clear()
    _LAYOUTS[(key, str(device))] = cached
    return cached


def pack(checks: list["Check"], device) -> Tensor:
    """(len(checks), 5) float64 on `device`: each check's worst place of this step as (miss, where, kind, err, tol),
    miss = err / tol (a NaN tolerance judges nothing: inf; a NaN or infinite error is a miss of inf); a check that
    measured nothing, (−1, 0, 0, 0, 0). NOTE: one set of ops for every check of the step (a concatenation, the
    ratio, a segmented argmax), not one set each: the checks run between the step's kernels, where every op costs its
    dispatch; nothing is read to the host."""
    parts, consts, key = [], [], []
    for c in checks:
        if c.measured is None:
            key.append(None)
            continue
        err, tol, kind = c.measured
        if not torch.is_tensor(kind):
            names = list(c.kinds)
            kind = float(names.index(kind or names[0]))
        desc = []
        for v in (err, tol, kind):
            if torch.is_tensor(v):
                v = v.reshape(-1) if v.dim() != 1 else v
                parts.append(v if v.device == device else on_device(v, device))
                desc.append(v.numel())
            else:
                consts.append(float(v))
                desc.append(-1)
        if desc[0] == 0:  # an empty err: nothing to report
            del parts[len(parts) - sum(d >= 0 for d in desc):]
            del consts[len(consts) - sum(d < 0 for d in desc):]
            key.append(None)
            continue
        key.append(tuple(desc))
    e_idx, t_idx, k_idx, seg, local, pos, n, n_rows, rows, empty = _layout(tuple(key), device)
    table = empty.clone()
    if not n:
        return table
    every = torch.cat(parts + ([on_device(consts, device, torch.float64)] if consts else [])).to(torch.float64)
    err, tol, kind = (every.index_select(0, i) for i in (e_idx, t_idx, k_idx))
    tol = tol.nan_to_num(nan=math.inf, posinf=math.inf, neginf=-math.inf)
    miss = (err / tol.clamp(min=1e-300)).nan_to_num(nan=math.inf, posinf=math.inf, neginf=-math.inf)
    worst = torch.full((n_rows,), -math.inf, dtype=torch.float64, device=device).scatter_reduce(0, seg, miss, "amax")
    first = torch.where(miss == worst.index_select(0, seg), pos, n)  # each check's first place at its worst
    at = torch.full((n_rows,), n, dtype=torch.int64, device=device).scatter_reduce(0, seg, first, "amin")
    return table.index_copy_(0, rows, torch.stack([miss, local, kind, err, tol], 1).index_select(0, at))


class Check:
    """Base: a check acts at the points it overrides; `measure` records this step's result."""
    name: ClassVar[str]
    layer: ClassVar[str]
    doc: ClassVar[str] = ""
    kinds: ClassVar[dict[str, Kind]]  # the first is the default
    cadence: ClassVar[str] = STEP
    phase: ClassVar[str] = BEFORE
    rank: ClassVar[int]  # the order its failures are read within a step (lower: it broke first)
    # a check that does not run every step (cadence REFERENCE) finds a fault up to spec.every − 1 steps after it
    # began: the record's per-step series (StepRecord.spec.<name>, by place) whose jump at the failing place dates
    # it within that gap (doctor/conformance.py); None: the failure is dated at its step
    onset_series: ClassVar[str | None] = None
    # the check whose places this one checks on the other steps (spec/checks/prefix.py: the forward check's layers
    # between its reference steps): the doctor reads a failure of either at a place as one incident
    family: ClassVar[str | None] = None

    def __init_subclass__(cls, **kw) -> None:
        super().__init_subclass__(**kw)
        if cls.__dict__.get("name") is None:  # an abstract intermediate
            return
        if cls.name in CHECKS:
            raise ValueError(f"spec check {cls.name!r} declared twice")
        if cls.layer not in LAYERS or not cls.kinds or not isinstance(cls.__dict__.get("rank"), int):
            raise TypeError(f"spec check {cls.name}: layer must be one of {LAYERS}, kinds non-empty and rank an int")
        CHECKS[cls.name] = cls

    def __init__(self, ctx: SpecContext):
        self.ctx = ctx
        self.where: list[str] = []  # the names of the places it measures, in the order of its vectors
        self.measured: tuple | None = None  # this step's (err, tol, kind), until the monitor packs it
        self.extra: dict[str, tuple[list[str], Tensor]] = {}  # name -> (places, (L,) values) for the record
        self.seconds = 0.0  # host time in this check (its points, its hooks inside the step's forward) since took()
        self.raised = False  # a point of this step raised (spec/monitor.py): the check failed, its other points skip

    @classmethod
    def applies(cls, ctx: SpecContext) -> bool:
        """Whether this run has what the check checks (an MoE layer, a second rank, ...)."""
        return True

    def measure(self, err: Tensor, tol: Tensor | float, kind: str | Tensor | None = None,
                where: list[str] | None = None) -> None:
        """err, tol: (L,) per place (or 0-d; tol may be a number); kind: one of self.kinds, or an (L,) tensor of
        indices into it. The worst place (largest err/tol; a NaN err is a miss of inf) is found at the read, for every
        check of the step in one set of ops (pack)."""
        if where is not None:
            self.where = where
        n = err.numel() if torch.is_tensor(err) else 1
        for name, v in (("tol", tol), ("kind", kind)):
            if torch.is_tensor(v) and v.numel() not in (1, n):
                raise ValueError(f"{self.name}: {name} has {v.numel()} elements for {n} places")
        self.measured = (err, tol, kind)

    @property
    def out(self) -> Tensor | None:
        """This step's packed result (miss, where, kind, err, tol), or None: nothing measured."""
        if self.measured is None:
            return None
        device = next((v.device for v in self.measured if torch.is_tensor(v)), torch.device("cpu"))
        return pack([self], device)[0]

    def kind_name(self, index: float) -> str:
        return list(self.kinds)[int(index)]

    # classify(i) -> kind name, optional: how place i missed, decided on the host after the read for a failure
    # only (a check whose kind costs more than its comparison defines it; spec/checks/forward.py)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, sd: dict) -> None: ...

    # the step's points (spec/monitor.py calls the ones a check overrides)
    def before_batch(self, s) -> None: ...
    def on_batch(self, s) -> None: ...
    def before_forward(self, s) -> None: ...
    def before_update(self, s) -> None: ...
    def after_clip(self, s) -> None: ...
    def after_update(self, s) -> None: ...
    def end_step(self, s) -> None: ...
