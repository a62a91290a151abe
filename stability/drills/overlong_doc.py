"""overlong_doc: the step-s batch becomes one document of uniform random tokens spanning every position
of every row (no BOS, no padding: every position valid)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from run.config_errors import check
from stability.drills._batch import BatchDrill


@dataclass
class Config:
    seed: int = 0  # the document is seeded by (seed, batch ID): the same one on every replay

    def __post_init__(self) -> None:
        check(self.seed >= 0, "seed", self.seed, "must be >= 0")


class OverlongDoc(BatchDrill):
    kind = "overlong_doc"
    expects = "data.corrupted_batch"
    Config = Config

    def corrupt(self, first_id: int, batch):
        """Row r of the global batch is window [r·T, r·T + T] of one uniform-random document."""
        T, n, ds = batch.tokens.shape[1], self.ctx.loader.batch_size, self.ctx.loader.dataset
        pool = np.setdiff1d(np.arange(1, ds.vocab_size), getattr(ds, "bos_ids", []))  # no PAD, no BOS
        rng = np.random.default_rng([self.cfg.seed, first_id])
        doc = torch.from_numpy(pool[rng.integers(0, len(pool), n * T + 1)])
        rows_b = batch.sample_ids - first_id  # this rank's rows of the global batch
        doc_bT1 = doc[rows_b[:, None] * T + torch.arange(T + 1)]
        return dataclasses.replace(batch, tokens=doc_bT1[:, :-1].clone(), labels=doc_bT1[:, 1:].clone(), floor=None)
