"""The lifetime of a bad batch, shared by the data drills (labels_shuffle, repeat_token, overlong_doc).

The fault lives in the data: it is keyed by the batch ID (the first global sample id) of the batch the
run's plan puts at step s, (s − 1) · batch size; a rollback that replays that batch meets the same bad
data (the corruption is seeded by the sample ids), one that skips the window never sees it again.
Keyed by its ID from the start, not by the step number, the fault goes where its data goes: a run that quarantines that batch
(train.skip_batches) never meets it, and a counterfactual that trains step s on another batch, or this
batch at another step, moves the fault with the batch (doctor/verify.py)."""
from __future__ import annotations

from stability.drills.base import BATCH, Drill


class BatchDrill(Drill):
    lifetime = BATCH
    points = ("on_batch",)

    def __init__(self, cfg, step, ctx):
        super().__init__(cfg, step, ctx)
        self.bad_id: int | None = None  # the batch ID that is bad, once it fired

    def on_batch(self, s) -> None:
        replay = self.bad_id is not None
        if s.first_id != (self.bad_id if replay else (self.s - 1) * self.ctx.loader.batch_size):
            return
        self.bad_id, self.fired = s.first_id, True
        s.batch = self.corrupt(s.first_id, s.batch)  # this rank's shard of the bad global batch
        self.emit(s.step, batch_first=s.first_id, batch_size=self.ctx.loader.batch_size, replay=replay,
                  **self.event_info())

    def corrupt(self, first_id: int, batch):
        raise NotImplementedError

    def event_info(self) -> dict:
        return {}

    def state_dict(self) -> dict:
        return {"fired": self.fired, "bad_id": self.bad_id}

    def load_state_dict(self, sd: dict) -> None:
        self.fired, self.bad_id = sd["fired"], sd["bad_id"]
