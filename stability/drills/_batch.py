"""The lifetime of a bad batch, shared by the data drills (labels_shuffle, repeat_token, overlong_doc).

The fault lives in the data: it is keyed by the batch ID (the first global sample id of the step-s
batch) recorded when it first fires; a rollback that replays that batch meets the same bad data (the
corruption is seeded by the sample ids), one that skips the window never sees it again."""
from __future__ import annotations

from stability.drills.base import BATCH, Drill


class BatchDrill(Drill):
    lifetime = BATCH
    points = ("on_batch",)

    def __init__(self, cfg, step, ctx):
        super().__init__(cfg, step, ctx)
        self.bad_id: int | None = None  # the batch ID that is bad

    def on_batch(self, s) -> None:
        replay = self.bad_id is not None
        if not (s.first_id == self.bad_id if replay else s.step == self.s):
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
