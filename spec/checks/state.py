"""continuity: each step starts from the state the previous one ended with — across a resume and a rollback too.

Between two steps of one process nothing may write the training state: every parameter, persistent buffer (the
MoE bias) and optimizer state tensor, and the scheduler's counter. PyTorch counts the in-place writes to a
tensor's storage that its ops make (its version counter, shared by all views of it; a write through .data, or a
fused kernel's, is not counted), so at the end of a step the check notes each tensor's identity, storage and
version, and the FP32 norm of every parameter and buffer; right before the next step's first forward (after its
batch is loaded: a loader that writes into the model is caught) they must be the same — exactly: the same
kernel on the same numbers gives the same bits, and nothing is read from the device. A tensor replaced (an
optimizer state lost) or written (a moment divided, an embedding row scaled) in between is named; a moment
written through .data shows in the optimizer check's probe elements (spec/checks/optimizer.py).

A checkpoint (or a rollback snapshot) carries a fingerprint of its state besides: per tensor its FP32 norm and
the exact sum of a strided sample of its bit patterns (every 61st element, so any row of the model is sampled; an
integer sum is exact in any order and shows a sign flip or a moved row where a norm cannot), and the config keys
a resume must match. The first step after a resume or a rollback compares its state with that: the sample sums
exactly, the norms within the rounding of their own summation, λ·√n·u32 (another process may sum with other
threads). A resumed state that is not the saved one, or a config changed without resume.allow_config_change,
is a resume fault at that step.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from spec.check import BACKWARD, BEFORE, STEP, Check, Kind, on_device
from spec.tolerance import LAMBDA, U32

STRIDE = 61  # a prime: the sample meets every row and column pattern of a tensor


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def module_state(model: torch.nn.Module) -> tuple[list[tuple[str, Tensor]], list[tuple[str, Tensor]]]:
    """(named_parameters(), its persistent named_buffers()): the same names in the same order, each tensor once, from
    one walk of the module tree. NOTE: a check reads them twice a step, between the step's kernels, where
    nn.Module's generators (a prefix string and a memo per level) cost several times this plain recursion."""
    params: list[tuple[str, Tensor]] = []
    buffers: list[tuple[str, Tensor]] = []
    seen: set[int] = set()

    def visit(m: torch.nn.Module, prefix: str) -> None:
        seen.add(id(m))
        for k, p in m._parameters.items():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                params.append((prefix + k, p))
        for k, b in m._buffers.items():
            if b is not None and k not in m._non_persistent_buffers_set and id(b) not in seen:
                seen.add(id(b))
                buffers.append((prefix + k, b))
        for k, c in m._modules.items():
            if c is not None and id(c) not in seen:
                visit(c, prefix + k + ".")

    visit(model, "")
    return params, buffers


class ContinuityCheck(Check):
    name, layer, cadence, phase = "continuity", BACKWARD, STEP, BEFORE
    rank = 0
    doc = "the state a step starts from against what the previous step (or the checkpoint) left"
    kinds = {"state": Kind("state.continuity", "the named tensor changed between two steps, outside any update"),
             "optimizer": Kind("optim.state", "the named optimizer state changed between two steps"),
             "schedule": Kind("optim.lr_switch", "the scheduler's counter is not the step's"),
             "resume": Kind("state.resume_fault", "the state after the resume (or rollback) is not the saved one, "
                                                   "or the config changed without resume.allow_config_change")}

    def __init__(self, ctx):
        super().__init__(ctx)
        model = ctx.model
        self.names = {id(p): n for n, p in model.named_parameters()}
        self._names: dict[tuple[int, str], str] = {}  # (id(parameter), state key) -> the state's name
        self.end: list[tuple] | None = None  # each tensor's (id, storage, version) at the last step's end
        self.saved: dict | None = None       # the checkpoint's fingerprint, at a resume or a rollback
        self.config_saved: dict | None = None

    def collect(self) -> list[tuple[str, str, Tensor]]:
        """(name, kind, tensor) of the whole training state, parameters and buffers first (the tensors themselves,
        not views: their identity is part of what is compared)."""
        params, buffers = module_state(self.ctx.model)
        out = [(n, "state", t) for n, t in params + buffers]
        opt = self.ctx.optimizer
        for p, st in opt.state.items():
            out += [(self._state_name(p, k), "optimizer", v) for k, v in st.items() if torch.is_tensor(v)]
        return out

    def _state_name(self, p, key: str) -> str:
        name = self._names.get((id(p), key))
        if name is None:
            name = self._names[id(p), key] = f"{self.names.get(id(p), '?')}.{key}"
        return name

    def marks(self) -> tuple[list[tuple], Tensor, list[int]]:
        """Each tensor's (name, identity, storage, version), the FP32 norms of the parameters and buffers (a write
        through .data, which PyTorch does not count, changes a value, and a norm of it, computed by the same
        kernel on the same numbers, comes out the same bits or the write is there), and each tensor's kind."""
        items = self.collect()
        local = _local if self.ctx.sharded else (lambda t: t)
        marks = [(n, id(t), local(t).data_ptr(), t._version) for n, _, t in items]
        with torch.no_grad():  # NOTE: a norm of each whole tensor, whatever its shape: no view made
            model = [local(t) for _, k, t in items if k == "state"]
            norms = torch.stack(torch._foreach_norm([f if f.dtype == torch.float32 else f.float() for f in model], 2))
        index = {k: i for i, k in enumerate(self.kinds)}
        return marks, norms, [index[k] for _, k, _ in items]

    def _kinds(self, kinds: list[int], device) -> Tensor:
        """The kinds as a tensor on `device` (cached: the same list every step while the state's tensors stay)."""
        if getattr(self, "_kinds_of", (None,))[0] != kinds:
            self._kinds_of = (kinds, on_device(kinds, device, torch.float64))
        return self._kinds_of[1]

    def counter(self) -> float:
        return float(self.ctx.scheduler.last_epoch) if self.ctx.scheduler is not None else 0.0

    def fingerprint(self) -> dict:
        """The checkpoint's: names, FP32 norms and exact sample sums, the scheduler's counter. NOTE: the numbers as
        CPU tensors, copied with the checkpoint's own transfer (nothing read to the host apart from it)."""
        items = self.collect()
        flat = [_local(t.detach()).reshape(-1) for _, _, t in items]
        norms = torch.stack(torch._foreach_norm([f if f.dtype == torch.float32 else f.float() for f in flat], 2))
        sums = torch.stack([_bits(f[::STRIDE]).to(torch.int64).sum() for f in flat])
        n_max = max(f.numel() for f in flat)
        if self.ctx.sharded:
            # NOTE: each rank holds its shards, and the checkpoint keeps one copy of this blob for every rank: the
            # fingerprint is of the whole tensors (Σ of the shards' squared norms in FP64, the integer sums exact)
            import torch.distributed as tdist
            sq = norms.double().square()
            tdist.all_reduce(sq)
            tdist.all_reduce(sums)
            norms, n_max = sq.sqrt(), n_max * self.ctx.dist.world
        return {"names": [n for n, _, _ in items], "norms": norms.double().to("cpu"), "sums": sums.to("cpu"),
                "n_max": n_max, "counter": self.counter()}

    def before_forward(self, s) -> None:
        f64 = dict(dtype=torch.float64)
        counter_off = abs(self.counter() - (s.step - 1))  # after t − 1 steps the scheduler stepped t − 1 times
        if self.saved is not None:
            self.measure_saved(s, counter_off)
        elif self.end is not None:
            (now, norms, kinds), (then, norms_then, _) = self.marks(), self.end
            if [m[0] for m in now] != [m[0] for m in then]:  # a tensor of the state appeared or went
                gone = sorted(set(m[0] for m in then) ^ set(m[0] for m in now))
                self.measure(torch.tensor([1.0], **f64), torch.tensor([0.5], **f64), "state", where=gone[:1])
            else:
                kinds = self._kinds(kinds + [list(self.kinds).index("schedule")], norms.device)
                err = on_device([float(a[1:] != b[1:]) for a, b in zip(now, then)] + [float(counter_off)],
                                norms.device, torch.float64)
                moved = (norms != norms_then).double()  # the parameters and buffers come first
                err = torch.cat([torch.maximum(err[:len(moved)], moved), err[len(moved):]])
                self.measure(err, 0.5, kinds,
                             where=[m[0] for m in now] + ["scheduler.last_epoch"])
        else:  # the run's first step
            self.measure(torch.tensor(float(counter_off), **f64), torch.tensor(0.5, **f64), "schedule",
                         where=["scheduler.last_epoch"])
        self.saved = self.config_saved = None

    def measure_saved(self, s, counter_off: float) -> None:
        """The first step after a resume or a rollback: the state against the checkpoint's fingerprint."""
        f64, saved = dict(dtype=torch.float64), self.saved
        off = self.config_changes() if self.config_saved is not None else []
        if off:
            self.measure(torch.tensor([1.0], **f64), torch.tensor([0.5], **f64), "resume", where=[f"config {off[0]}"])
            return
        # NOTE: another world size shards the tensors otherwise: their local fingerprints are not comparable
        if saved.get("fp") is None or saved.get("world") != self.ctx.dist.world:
            self.measure(torch.tensor(float(counter_off), **f64), torch.tensor(0.5, **f64), "resume",
                         where=["scheduler.last_epoch"])
            return
        now, then = self.fingerprint(), saved["fp"]
        if now["names"] != then["names"]:
            gone = sorted(set(now["names"]) ^ set(then["names"]))
            self.measure(torch.tensor([1.0], **f64), torch.tensor([0.5], **f64), "resume", where=gone[:1])
            return
        rel = LAMBDA * (math.sqrt(then["n_max"]) + 2) * U32
        a_n, b_n = now["norms"], then["norms"].to(now["norms"].device)
        sums_off = (now["sums"] != then["sums"].to(now["sums"].device)).to(torch.float64)  # exact integers
        err = torch.maximum((a_n - b_n).abs() / (rel * b_n.abs() + 1e-300), sums_off / 0.5)
        err = torch.cat([err, torch.tensor([max(counter_off, abs(now["counter"] - then["counter"])) / 0.5], **f64)])
        self.measure(err, 1.0, "resume", where=now["names"] + ["scheduler.last_epoch"])

    def end_step(self, s) -> None:
        self.end = self.marks()

    def config_changes(self) -> list[str]:
        now = config_keys(self.ctx.cfg)
        declared = list(getattr(self.ctx.cfg.resume, "allow_config_change", None) or [])
        keys = set(now) | set(self.config_saved)
        return sorted(k for k in keys if now.get(k) != self.config_saved.get(k)
                      and not any(k == d or k.startswith(d + ".") for d in declared))

    def rolled_back(self, cursor: int) -> None:
        """A rollback restored a snapshot whose fingerprint came back with it (load_state_dict): compare with it,
        as at a resume, except for the config (a rollback keeps it)."""
        self.config_saved = None

    def state_dict(self) -> dict:
        """Taken at a checkpoint or a rollback snapshot, after a step: the fingerprint of the step's end."""
        return {"fp": self.fingerprint() if self.end is not None else None, "world": self.ctx.dist.world,
                "config": config_keys(self.ctx.cfg)}

    def load_state_dict(self, sd: dict) -> None:
        self.saved, self.config_saved = {"fp": sd.get("fp"), "world": sd.get("world")}, sd.get("config")
        self.end = None


def _bits(t: Tensor) -> Tensor:
    """A flat tensor's elements' bit patterns as integers of their width (their sum is exact in any order)."""
    return t.contiguous().view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[t.element_size()])


def config_keys(cfg) -> dict:
    """The flattened config keys a resume must match (checkpoint/resume.py MUST_MATCH), as strings."""
    from dataclasses import asdict, is_dataclass

    from checkpoint.resume import MUST_MATCH, _under, flatten
    d = asdict(cfg) if is_dataclass(cfg) else dict(cfg)
    return {k: repr(v) for k, v in flatten(d).items() if _under(k, MUST_MATCH)}
