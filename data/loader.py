"""A deterministic, resumable loader: its whole state is one integer, the samples consumed.

Global step s covers sample ids [s*batch_size, (s+1)*batch_size) of the split; rank r takes the
contiguous share [r*b, (r+1)*b), b = batch_size // world. Since samples are pure functions of their id,
restoring the count under another world size continues the exact same global sequence.
"""
from __future__ import annotations

from data.batch import Batch


def _check_shard(batch_size: int, rank: int, world: int) -> int:
    if batch_size <= 0:
        raise ValueError(f"batch_size={batch_size}: must be > 0")
    if world <= 0 or not 0 <= rank < world:
        raise ValueError(f"rank={rank}, world={world}: need 0 <= rank < world")
    if batch_size % world:
        raise ValueError(f"batch_size={batch_size}: must be divisible by world={world} (global samples per step)")
    return batch_size // world


class Loader:
    def __init__(self, dataset, batch_size: int, rank: int = 0, world: int = 1, split: str = "train",
                 skip: tuple[int, ...] = ()):
        """skip: batch IDs (first global sample ids) never served: quarantined data (train.skip_batches)."""
        self.dataset, self.batch_size, self.rank, self.world, self.split = dataset, batch_size, rank, world, split
        self.local_batch_size = _check_shard(batch_size, rank, world)
        self.skip = frozenset(skip)
        # global, identical on every rank; always the first id of the next batch served (never quarantined)
        self.samples_consumed = self._served(0)

    def _served(self, first: int) -> int:
        """The batch at cursor `first`, or the first one after it that is not quarantined (passed over whole)."""
        while first in self.skip:
            first += self.batch_size
        return first

    def next(self) -> Batch:
        b = self.local_batch_size
        first = self.samples_consumed
        self.samples_consumed = self._served(first + self.batch_size)
        start = first + self.rank * b
        return self.dataset.samples(range(start, start + b), self.split)

    def peek(self, k: int) -> Batch:
        """The local batch that the k-th call of next() from now would return (k = 0: the next one),
        without moving the cursor. k = -1 is the batch the last next() returned: anticipatory routing
        with delay 0 routes the batch being trained. Pure, since a sample is a function of its id."""
        bad = isinstance(k, bool) or not isinstance(k, int)
        first = -1 if bad else self.samples_consumed + min(k, 0) * self.batch_size
        for _ in range(max(k, 0) if not bad else 0):
            first = self._served(first + self.batch_size)
        if first < 0:
            raise ValueError(f"peek k={k!r}: must be an integer with a batch at or after sample 0 "
                             f"(samples_consumed={self.samples_consumed}, batch_size={self.batch_size})")
        b = self.local_batch_size
        start = first + self.rank * b
        return self.dataset.samples(range(start, start + b), self.split)

    def state_dict(self) -> dict:
        return {"samples_consumed": self.samples_consumed, "fingerprint": self.dataset.fingerprint}

    def load_state_dict(self, sd: dict, allow_data_change: bool = False) -> None:
        saved, current = sd["fingerprint"], self.dataset.fingerprint
        if saved != current and not allow_data_change:
            raise ValueError(f"data fingerprint changed: checkpoint {saved} vs config {current}; "
                             f"pass allow_data_change=True to resume on different data")
        consumed = int(sd["samples_consumed"])
        if consumed < 0:
            raise ValueError(f"samples_consumed={consumed}: must be >= 0")
        # NOTE: a count that is not a multiple of the new batch_size is fine: ids stay contiguous.
        self.samples_consumed = self._served(consumed)


def eval_batches(dataset, n_samples: int, batch_size: int, rank: int = 0, world: int = 1) -> list[Batch]:
    """The fixed validation set: ids 0..n_samples-1 of the "val" split, each global batch sharded as in
    Loader, so the eval loss is comparable across steps, runs and world sizes."""
    _check_shard(batch_size, rank, world)
    if n_samples <= 0 or n_samples % batch_size:
        raise ValueError(f"n_samples={n_samples}: must be a positive multiple of batch_size={batch_size}")
    loader = Loader(dataset, batch_size, rank, world, split="val")
    return [loader.next() for _ in range(n_samples // batch_size)]
