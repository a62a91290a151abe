"""labels_shuffle: the step-s batch has its labels permuted over each sample's valid positions (same
labels, same mask, wrong order)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from data import IGNORE_INDEX
from run.config_errors import check
from stability.drills._batch import BatchDrill


@dataclass
class Config:
    seed: int = 0  # the permutation is seeded by (seed, sample id)

    def __post_init__(self) -> None:
        check(self.seed >= 0, "seed", self.seed, "must be >= 0")


class LabelsShuffle(BatchDrill):
    kind = "labels_shuffle"
    expects = "data.corrupted_batch"
    Config = Config

    def corrupt(self, first_id: int, batch):
        labels_bT = batch.labels.clone()
        for i, g in enumerate(batch.sample_ids.tolist()):
            pos = torch.nonzero(labels_bT[i] != IGNORE_INDEX).squeeze(1)
            perm = torch.from_numpy(np.random.default_rng([self.cfg.seed, g]).permutation(len(pos)))
            labels_bT[i, pos] = labels_bT[i, pos[perm]]
        return dataclasses.replace(batch, labels=labels_bT, floor=None)  # the floor no longer applies
