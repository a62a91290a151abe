"""What makes sample g a pure function of (data seed, split, g), and the hash that names the data."""
from __future__ import annotations

import hashlib
import json
from typing import Iterable, Sequence

import numpy as np

SPLIT_CODES = {"train": 0, "val": 1}


def split_code(split: str) -> int:
    if split not in SPLIT_CODES:
        raise ValueError(f"split={split!r}: expected one of {', '.join(SPLIT_CODES)}")
    return SPLIT_CODES[split]


def sample_rngs(seed: int, split: str, ids: Sequence[int]) -> Iterable[tuple[int, np.random.Generator]]:
    """One independent generator per sample, seeded by (seed, split, g).

    NOTE: never one stream consumed in call order: that is what lets a loader resume from a bare
    sample count, shard across ranks, and change world size without changing any sample.
    """
    code = split_code(split)
    for g in ids:
        g = int(g)
        if g < 0:
            raise ValueError(f"sample id {g}: ids must be non-negative")
        yield g, np.random.default_rng([seed, code, g])


def fingerprint_of(manifest: dict) -> str:
    """sha256 of a canonical JSON manifest: equal iff every sample-changing setting is equal."""
    blob = json.dumps(manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(blob.encode()).hexdigest()
