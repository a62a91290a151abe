"""continuity: each step starts from the state the previous one ended with — across a resume and a rollback too.

At the end of every step (after the balancing update, every lever and drill) the check takes a fingerprint of
the whole training state: per tensor (parameters, persistent buffers such as the MoE bias, every optimizer
state tensor) the exact sum of a strided sample of its bit patterns (every 61st element, so any row of the
model is sampled: an integer sum is exact in any order, and a sign flip or a moved row shows where a norm
cannot), and the scheduler's counter. Right before the next step's first forward (after its batch is loaded: a
loader that writes into the model is caught) the same fingerprint must come out again, exactly. A checkpoint
(or a rollback snapshot) carries its state's fingerprint with each tensor's FP32 norm besides, compared within
the rounding of its own summation, λ·√n·u32 (another process may sum with other threads), and
the config keys a resume must match, so the first step after a resume or a rollback compares with what was
saved: a resumed state that is not the saved one, or a config changed without resume.allow_config_change,
is a resume fault at that step.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from spec.check import BACKWARD, BEFORE, STEP, Check, Kind
from spec.tolerance import LAMBDA, U32

STRIDE = 61  # a prime: the sample meets every row and column pattern of a tensor


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class ContinuityCheck(Check):
    name, layer, cadence, phase = "continuity", BACKWARD, STEP, BEFORE
    doc = "the state a step starts from against the fingerprint the previous step (or the checkpoint) left"
    kinds = {"state": Kind("state.continuity", "the named tensor changed between two steps, outside any update"),
             "optimizer": Kind("optim.state", "the named optimizer state changed between two steps"),
             "schedule": Kind("optim.lr_switch", "the scheduler's counter is not the step's"),
             "resume": Kind("state.resume_fault", "the state after the resume (or rollback) is not the saved one, "
                                                   "or the config changed without resume.allow_config_change")}

    def __init__(self, ctx):
        super().__init__(ctx)
        model, opt = ctx.model, ctx.optimizer
        self.tensors: list[tuple[str, str]] = []  # (name, kind) in fingerprint order
        self.end: Tensor | None = None       # (2, n) the last step's end: norms, sample sums (device)
        self.saved: list | None = None       # the checkpoint's (host), at a resume or a rollback
        self.config_saved: dict | None = None
        self.names = {id(p): n for n, p in model.named_parameters()}
        keys = set(model.state_dict())
        self.buffers = [n for n, _ in model.named_buffers() if n in keys]  # persistent ones: training state
        self._listed: tuple[int, list[Tensor]] | None = None

    def collect(self) -> list[Tensor]:
        """The state's tensors, flat (re-listed only when the optimizer's state gained or lost a tensor)."""
        model, opt = self.ctx.model, self.ctx.optimizer
        size = sum(len(st) for st in opt.state.values())
        if self._listed is not None and self._listed[0] == size:
            return self._listed[1]
        out, names = [], []
        for n, p in model.named_parameters():
            out.append(_local(p.detach()).reshape(-1))
            names.append((n, "state"))
        buffers = dict(model.named_buffers())
        for n in self.buffers:
            out.append(_local(buffers[n]).reshape(-1))
            names.append((n, "state"))
        for p, st in opt.state.items():
            for k, v in st.items():
                if torch.is_tensor(v):
                    out.append(_local(v).reshape(-1))
                    names.append((f"{self.names.get(id(p), '?')}.{k}", "optimizer"))
        self.tensors = names
        self.n_max = max(f.numel() for f in out)
        self.lengths = torch.tensor([len(f[::STRIDE]) for f in out])
        self._listed = (size, out)
        return out

    def fingerprint(self, norms: bool = True) -> Tensor:
        """(2, tensors + 1): each tensor's FP32 norm (0 when `norms` is off: between two steps of one process the
        exact sample sums suffice) and its sample sum; the scheduler's counter last."""
        flat = self.collect()
        dev = flat[0].device
        sample = torch.cat([_bits32(f[::STRIDE]) for f in flat])
        # exact: at most 2^31 × (n / STRIDE) per tensor, far below 2^53
        sums = torch.segment_reduce(sample.double(), "sum", lengths=self.lengths.to(dev))
        n = (torch.stack(torch._foreach_norm([f if f.dtype == torch.float32 else f.float() for f in flat], 2)).double()
             if norms else torch.zeros_like(sums))
        counter = self.counter = float(self.ctx.scheduler.last_epoch) if self.ctx.scheduler is not None else 0.0
        return torch.stack([torch.cat([n.to(dev), torch.tensor([counter], dtype=torch.float64, device=dev)]),
                            torch.cat([sums, torch.zeros(1, dtype=torch.float64, device=dev)])])

    def before_forward(self, s) -> None:
        resumed = self.saved is not None
        now = self.fingerprint(norms=resumed)  # the norms: against a checkpoint only (another process, threads)
        against = self.end
        if resumed:
            # NOTE: another world size shards the tensors otherwise: their local fingerprints are not comparable
            against = (torch.tensor(self.saved["end"], dtype=torch.float64, device=now.device)
                       if self.saved["end"] is not None and self.saved["world"] == self.ctx.dist.world else None)
        names = [n for n, _ in self.tensors] + ["scheduler.last_epoch"]
        kinds = [list(self.kinds).index("resume" if resumed else k) for _, k in self.tensors]
        kinds.append(list(self.kinds).index("resume" if resumed else "schedule"))
        rel = LAMBDA * (math.sqrt(self.n_max) + 2) * U32
        if against is None or against.shape != now.shape:
            if against is not None:  # another set of tensors than was saved: a state lost or added
                self.measure(torch.tensor([1.0], dtype=torch.float64), torch.tensor([0.5], dtype=torch.float64),
                             "resume" if resumed else "state", where=["tensor set"])
            else:
                counter_err = torch.tensor(abs(self.counter - (s.step - 1)), dtype=torch.float64)
                self.measure(counter_err, torch.tensor(0.5, dtype=torch.float64), "resume" if resumed else "schedule",
                             where=["scheduler.last_epoch"])
        else:
            norm_err = (now[0] - against[0]).abs()
            norm_tol = rel * against[0].abs() + 1e-300
            norm_tol[-1] = 0.5  # the counter: an integer
            sum_err = (now[1] - against[1]).abs()
            err = torch.maximum(norm_err / norm_tol, sum_err / 0.5)  # exact sums: half an integer is a miss
            counter = torch.tensor(abs(self.counter - (s.step - 1)), dtype=torch.float64, device=err.device)
            err[-1] = torch.maximum(err[-1], counter / 0.5)
            self.measure(err, torch.ones_like(err), torch.tensor(kinds, dtype=torch.float64), where=names)
        config_off = self.config_changes() if self.config_saved is not None else []
        if config_off:
            self.measure(torch.tensor([1.0], dtype=torch.float64), torch.tensor([0.5], dtype=torch.float64), "resume",
                         where=[f"config {config_off[0]}"])
        self.saved = self.config_saved = None

    def end_step(self, s) -> None:
        self.end = self.fingerprint(norms=False)

    def config_changes(self) -> list[str]:
        now, declared = config_keys(self.ctx.cfg), list(self.ctx.cfg.resume.allow_config_change
                                                        if hasattr(self.ctx.cfg.resume, "allow_config_change") else [])
        keys = set(now) | set(self.config_saved)
        return sorted(k for k in keys if now.get(k) != self.config_saved.get(k)
                      and not any(k == d or k.startswith(d + ".") for d in declared))

    def rolled_back(self, cursor: int) -> None:
        """A rollback restored a snapshot whose end fingerprint came back with it (load_state_dict): compare with
        it, as at a resume, except for the config (a rollback keeps it)."""
        self.config_saved = None

    def state_dict(self) -> dict:
        """Taken at a checkpoint or a rollback snapshot, after a step: the state is the step's end, fingerprinted
        in full (norms too) for the comparison at a resume."""
        end = self.fingerprint(norms=True) if self.end is not None else None
        return {"end": None if end is None else end.tolist(), "world": self.ctx.dist.world,
                "config": config_keys(self.ctx.cfg)}

    def load_state_dict(self, sd: dict) -> None:
        self.saved, self.config_saved = {"end": sd.get("end"), "world": sd.get("world")}, sd.get("config")


def _bits32(t: Tensor) -> Tensor:
    """A tensor's elements' bit patterns as int32 (a 4-byte dtype as it is, a narrower one widened; float64 folded
    to its high word), so that their sum is exact in any order."""
    if t.element_size() == 4:
        return t.contiguous().view(torch.int32)
    if t.element_size() == 8:
        return t.contiguous().view(torch.int32)[1::2]
    return t.contiguous().view({2: torch.int16, 1: torch.int8}[t.element_size()]).to(torch.int32)


def config_keys(cfg) -> dict:
    """The flattened config keys a resume must match (checkpoint/resume.py MUST_MATCH), as strings."""
    from dataclasses import asdict, is_dataclass

    from checkpoint.resume import MUST_MATCH, _under, flatten
    d = asdict(cfg) if is_dataclass(cfg) else dict(cfg)
    return {k: repr(v) for k, v in flatten(d).items() if _under(k, MUST_MATCH)}
