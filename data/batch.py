"""The Batch: what one loader step hands to the training loop, with the IDs that make it replayable."""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

# Same value as torch.nn.functional.cross_entropy's default ignore_index, so labels go straight in.
IGNORE_INDEX = -100

# NOTE: a fixed odd multiplier per position mod a prime below 2^31: the hash stays an exact integer in
# float64 after stability/resume_fields.py's all-reduce (every other rank adds 0 to this rank's slot).
HASH_MOD = 2_147_483_629


def content_hash(tokens: torch.Tensor) -> int:
    """A position-weighted hash of the tokens in row-major order, in [0, HASH_MOD): the per-rank hash of
    StepRecord.ranks, so a reader can recompute it from the sample ids a record names
    (dataset.samples(range(first, first + n), "train").tokens)."""
    return int(content_hash_t(tokens))


def content_hash_t(tokens: torch.Tensor) -> torch.Tensor:
    """content_hash as a 0-d int64 tensor on the tokens' device (the step reads it with its other numbers)."""
    tok = tokens.detach().long().flatten()
    w = torch.arange(1, tok.numel() + 1, dtype=torch.int64, device=tok.device) * 2 + 1
    return ((tok + 1) * w % HASH_MOD).sum() % HASH_MOD


@dataclass
class Batch:
    tokens: torch.Tensor  # (b, T) int64 inputs
    labels: torch.Tensor  # (b, T) int64 next-token targets, IGNORE_INDEX where there is none
    sources: torch.Tensor  # (b,) int64 source index of each sample (one document of one source)
    sample_ids: torch.Tensor  # (b,) int64 global sample index within its split: the batch ID
    # (b, T) float32 expected loss (nats) of the Bayes-optimal predictor per label, 0 where ignored;
    # None when it is unknown (real text).
    floor: torch.Tensor | None = None

    def __post_init__(self):
        b_T = tuple(self.tokens.shape)
        if len(b_T) != 2 or tuple(self.labels.shape) != b_T:
            raise ValueError(f"Batch tokens={b_T} and labels={tuple(self.labels.shape)}: expected equal (b, T)")
        if tuple(self.sources.shape) != b_T[:1] or tuple(self.sample_ids.shape) != b_T[:1]:
            raise ValueError(f"Batch sources/sample_ids shapes must be ({b_T[0]},)")
        if self.floor is not None and tuple(self.floor.shape) != b_T:
            raise ValueError(f"Batch floor={tuple(self.floor.shape)}: expected {b_T}")

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def n_valid(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())

    def micro_batches(self, n: int) -> list["Batch"]:
        # NOTE: micro-batches have equal sample counts but (with padded documents) unequal valid-token
        # counts; the loop must divide the summed loss by the *global* n_valid, never per micro-batch.
        b = len(self)
        if n <= 0 or b % n:
            raise ValueError(f"micro_batches n={n}: must be a positive divisor of the batch size b={b}")
        m = b // n
        return [self._select(slice(i * m, (i + 1) * m)) for i in range(n)]

    @classmethod
    def concat(cls, batches: list["Batch"]) -> "Batch":
        """Inverse of micro_batches (and of rank sharding): join along b."""
        if not batches:
            raise ValueError("Batch.concat: needs at least one batch")
        has_floor = {b.floor is not None for b in batches}
        if len(has_floor) > 1:
            raise ValueError("Batch.concat: cannot mix batches with and without a floor")
        out = {}
        for f in fields(cls):
            parts = [getattr(b, f.name) for b in batches]
            out[f.name] = None if parts[0] is None else torch.cat(parts, dim=0)
        return cls(**out)

    def batch_id(self) -> dict:
        return {"samples": self.sample_ids.tolist(), "sources": self.sources.tolist()}

    def to(self, device, non_blocking: bool = False) -> "Batch":
        """The batch on `device`. non_blocking, to a CUDA device: each tensor pinned and copied asynchronously,
        so the host does not wait for the kernels queued before the copy (a pageable copy waits for them)."""
        pin = non_blocking and torch.device(device).type == "cuda"
        return Batch(**{f.name: None if (t := getattr(self, f.name)) is None else
                        (t.pin_memory() if pin else t).to(device, non_blocking=pin) for f in fields(self)})

    def _select(self, idx) -> "Batch":
        return Batch(**{f.name: None if (t := getattr(self, f.name)) is None else t[idx]
                        for f in fields(self)})
