"""rank_content: 2+ processes only. From step s rank `rank` trains on the content of other samples (its
ids + 7919·batch_size, the same shape) while its recorded sample ids are its own:
one replica's shard silently points elsewhere in the data."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from run.config_errors import check
from stability.drills.base import PERSISTENT, Drill

STRIDE = 7919  # a prime number of global batches away: never a batch this run trains anyway


@dataclass
class Config:
    rank: int = 1  # the rank whose content moves

    def __post_init__(self) -> None:
        check(self.rank >= 0, "rank", self.rank, "must be >= 0")


class RankContent(Drill):
    kind = "rank_content"
    expects = "rank.data"
    lifetime = PERSISTENT
    points = ("on_batch",)
    Config = Config
    min_world = 2

    def check(self) -> None:
        world = self.ctx.world
        if world < 2 or self.cfg.rank >= world:
            rank = self.key("rank")
            self.fail(f"needs 2+ processes and {rank} < world; got world={world}, {rank}={self.cfg.rank}")

    def on_batch(self, s) -> None:
        ld = self.ctx.loader
        offset = STRIDE * ld.batch_size
        if not self.persists(s.step, rank=self.cfg.rank, offset=offset) or self.ctx.rank != self.cfg.rank:
            return
        start = int(s.batch.sample_ids[0]) + offset  # a rank's shard is contiguous ids
        other = ld.dataset.samples(range(start, start + len(s.batch)), ld.split)
        s.batch = dataclasses.replace(s.batch, tokens=other.tokens, labels=other.labels, sources=other.sources,
                                      floor=other.floor)
