"""repeat_batch: from step s every step trains on the content of the step-s batch (every rank its own
shard of it), while the loader's sample ids keep advancing: the record's batch ids move as usual and
only the content hash stands still — a data pipeline stuck on one buffer."""
from __future__ import annotations

import dataclasses

from stability.drills.base import PERSISTENT, Drill


class RepeatBatch(Drill):
    kind = "repeat_batch"
    expects = "data.repeated_batch"
    lifetime = PERSISTENT
    points = ("on_batch",)

    def __init__(self, cfg, step, ctx):
        super().__init__(cfg, step, ctx)
        self.bad_id: int | None = None  # the batch ID whose content repeats
        self._content = None            # this rank's shard of it

    def on_batch(self, s) -> None:
        if not self.fired and self.persists(s.step, batch_first=s.first_id, batch_size=self.ctx.loader.batch_size):
            self.bad_id, self._content = s.first_id, s.batch
        if self.fired:
            c = self._content  # NOTE: the ids stay the loader's: only the content repeats
            s.batch = dataclasses.replace(s.batch, tokens=c.tokens, labels=c.labels, sources=c.sources, floor=c.floor)

    def state_dict(self) -> dict:
        return {"fired": self.fired, "bad_id": self.bad_id}

    def load_state_dict(self, sd: dict) -> None:
        self.fired, self.bad_id = sd["fired"], sd["bad_id"]
        if self.fired:  # a sample is a function of its id: rebuild this rank's shard
            ld = self.ctx.loader
            start = self.bad_id + ld.rank * ld.local_batch_size
            self._content = ld.dataset.samples(range(start, start + ld.local_batch_size), ld.split)
