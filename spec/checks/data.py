"""data: every row the forward reads is the sample its plan names, and none is a validation sample.

The specification of a step's data (data/loader.py): step t reads the global sample ids [f_t, f_t + batch), f_1
the first batch ID not quarantined (train.skip_batches) and f_{t+1} the next one after f_t + batch; rank r the
r-th contiguous share; a sample is a pure function of its id (dataset.samples). So the check keeps its own
cursor (carried in the checkpoint, moved on by a rollback's declared data policy and by intervene.kind=batch)
and compares, right before the first forward, the micro-batches the step will train on with the samples the
plan names — tokens, labels (the mask is the labels' IGNORE positions) and sources — exactly. It also hashes
every training row and looks it up among the validation rows (a 64-bit polynomial hash: a false match
among 1e4 × 1e6 rows has probability 1e-9).

How it missed decides the class: the ids off the plan (data.continuity; at a resume, state.resume_fault),
the data the loader draws from is not the config's any more (another mixture: objective.mixture), the rows equal the last
step's (data.repeated_batch), every row of one source, and only those, differ (data.distribution_shift), a training
row is a validation row (forward.below_floor: the model is trained on what it is evaluated on), else
data.corrupted_batch; one rank alone: rank.data (spec/monitor.py).
"""
from __future__ import annotations

import torch
from torch import Tensor

from spec.check import BEFORE, INPUT, STEP, Check, Kind, on_device

ASPECTS = ("ids", "definition", "tokens", "labels", "sources", "leak")
_P = 0x100000001B3  # the FNV-1a 64-bit prime: a row's hash is Σ_t (token_t + 1)·P^t (mod 2^64)


_POWERS: dict[tuple[int, str], Tensor] = {}


def row_hashes(tokens_BT: Tensor) -> Tensor:
    """(B,) int64: each row's polynomial hash (int64 arithmetic wraps: exact mod 2^64, in any summation order)."""
    T, dev = tokens_BT.shape[1], tokens_BT.device
    if (T, str(dev)) not in _POWERS:
        powers, acc = [], 1
        for _ in range(T):
            powers.append(acc - (1 << 64) if acc >= (1 << 63) else acc)
            acc = (acc * _P) % (1 << 64)
        _POWERS[T, str(dev)] = on_device(powers, dev, torch.int64)
    return ((tokens_BT.long() + 1) * _POWERS[T, str(dev)]).sum(-1)


class DataCheck(Check):
    name, layer, cadence, phase = "data", INPUT, STEP, BEFORE
    rank = 10
    doc = "the micro-batches are the samples the plan names, exactly; no training row is a validation row"
    kinds = {
        "corrupted": Kind("data.corrupted_batch", "the batch the forward reads is not its samples' content: the "
                                                  "loader, collation or a transform"),
        "cursor": Kind("data.continuity", "the step reads other sample ids than the plan's: the data cursor"),
        "resume": Kind("state.resume_fault", "the data cursor after the resume is not the saved one"),
        "definition": Kind("objective.mixture", "the dataset's definition (its mixture) changed under the run"),
        "repeated": Kind("data.repeated_batch", "the batch repeats the previous step's content"),
        "source": Kind("data.distribution_shift", "one source's rows are not that source's content"),
        "leak": Kind("forward.below_floor", "a training row is a validation sample: the model trains on its eval"),
        "rank": Kind("rank.data", "one rank's rows are not its shard's samples"),
    }
    rank_kind = "rank"

    def __init__(self, ctx):
        super().__init__(ctx)
        tc = ctx.cfg.train
        self.batch, self.skip = tc.batch_size, frozenset(tc.skip_batches)
        self.local = tc.batch_size // ctx.dist.world
        self.fingerprint = ctx.dataset.fingerprint
        self.next_first: int | None = None   # the plan's next batch ID (None: the cursor the loader starts at)
        self.resumed = False
        self.last: Tensor | None = None      # the last step's row hashes
        val = [row_hashes(b.tokens) for b in ctx.evals]
        self.val = torch.cat(val).sort().values if val else torch.empty(0, dtype=torch.int64)
        iv = ctx.cfg.intervene
        self.intervene = (iv.step, iv.first_id) if iv.kind == "batch" else None

    def served(self, first: int) -> int:
        while first in self.skip:
            first += self.batch
        return first

    def before_forward(self, s) -> None:
        # NOTE: served() again: a resume may declare more quarantined batches (the doctor's fix does)
        plan = self.served(0 if self.next_first is None else self.next_first)
        if self.intervene is not None and s.step == self.intervene[0]:
            plan = self.intervene[1]  # declared: this step trains on that batch (stability/intervene.py)
        self.next_first = self.served(plan + self.batch)
        start = plan + self.ctx.dist.rank * self.local
        want = self.ctx.dataset.samples(range(start, start + self.local), "train")
        micro = s.micro
        dev = micro[0].tokens.device
        tokens = torch.cat([m.tokens for m in micro])
        labels = torch.cat([m.labels for m in micro])
        sources = torch.cat([m.sources for m in micro])
        ids = torch.cat([m.sample_ids for m in micro])
        shape_ok = tokens.shape == want.tokens.shape
        wt, wl, ws = (on_device(want.tokens, dev), on_device(want.labels, dev), on_device(want.sources, dev))
        bad_ids = (on_device(float(s.first_id != plan), dev)
                   + (ids != on_device(want.sample_ids, dev)).sum().double() if shape_ok else on_device(1.0, dev))
        # the data the loader draws from is the config's (a drill or a bug may swap or re-weight it under the run)
        ds = self.ctx.loader.dataset
        changed = on_device(float(ds is not self.ctx.dataset or ds.fingerprint != self.fingerprint), dev)
        hashes = row_hashes(tokens)
        self.val = on_device(self.val, dev)  # once: then it is there
        # NOTE: a binary search of the sorted validation hashes: torch.isin sorts and uniques (a wait on a GPU)
        leak_B = (self.val[torch.searchsorted(self.val, hashes).clamp(max=len(self.val) - 1)] == hashes
                  if self.val.numel() else torch.zeros(tokens.shape[0], dtype=torch.bool, device=dev))
        leaked = leak_B.sum()
        if shape_ok:
            row_bad = ((tokens != wt) | (labels != wl)).any(-1) | (sources != ws)
            # NOTE: a row read under other sample ids, or a validation row in a training row's place, is explained
            # by that finding: its content is not counted again
            explained = (bad_ids > 0) | (changed > 0) | leak_B[:, None]
            counts = [((tokens != wt) & ~explained).sum(), ((labels != wl) & ~explained).sum(),
                      ((sources != ws) & ~explained[:, 0]).sum()]
        else:
            row_bad = torch.ones(tokens.shape[0], dtype=torch.bool, device=dev)
            counts = [on_device(tokens.numel(), dev)] * 3
        err = torch.stack([bad_ids.double(), changed.double(), *[c.double() for c in counts], leaked.double()])
        kind = self.content_kind(hashes, sources, row_bad, dev)
        names = list(self.kinds)

        kinds = torch.stack([on_device(float(names.index("resume" if self.resumed else "cursor")), dev),
                             on_device(float(names.index("definition")), dev), kind, kind, kind,
                             on_device(float(names.index("leak")), dev)])
        # NOTE: exact comparisons: a miss is one element off, so the tolerance is half of one
        self.measure(err, 0.5, kinds, where=list(ASPECTS))
        self.last, self.resumed = hashes, False

    def content_kind(self, hashes: Tensor, sources: Tensor, row_bad: Tensor, dev) -> Tensor:
        """The kind of a content miss, decided on the device: the last step's rows again, or one source's only."""
        names = list(self.kinds)
        idx = {k: on_device(float(names.index(k)), dev) for k in ("corrupted", "repeated", "source")}
        repeated = (self.last is not None and self.last.shape == hashes.shape)
        rep = (hashes == self.last).all() if repeated else torch.zeros((), dtype=torch.bool, device=dev)
        big = torch.iinfo(torch.int64).max
        src_bad = torch.where(row_bad, sources, big)
        lo, hi = src_bad.min(), torch.where(row_bad, sources, -1).max()
        other_ok = (~row_bad & (sources != lo)).any()
        # NOTE: a source's content changed is every row of it off, more than one: a lone row off says nothing of its
        # source (a row duplicated or overwritten in collation is a corrupted batch)
        mine = sources == lo
        one = (lo == hi) & other_ok & (row_bad == mine).all() & (mine.sum() > 1)
        return torch.where(rep, idx["repeated"], torch.where(one, idx["source"], idx["corrupted"]))

    def rolled_back(self, cursor: int) -> None:
        """A guard rollback put the cursor at `cursor` (its declared data policy): the plan continues from there."""
        self.next_first, self.last, self.resumed = cursor, None, False

    def state_dict(self) -> dict:
        return {"next_first": self.next_first}

    def load_state_dict(self, sd: dict) -> None:
        self.next_first, self.resumed, self.last = sd.get("next_first"), True, None
