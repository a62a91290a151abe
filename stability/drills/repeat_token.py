"""repeat_token: every input and label of the step-s batch is one token id, every position valid."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from data import IGNORE_INDEX
from run.config_errors import check
from stability.drills._batch import BatchDrill


@dataclass
class Config:
    token: int | None = None  # null = the most frequent label id of that (global) batch

    def __post_init__(self) -> None:
        check(self.token is None or self.token >= 0, "token", self.token, "must be >= 0 or null")


class RepeatToken(BatchDrill):
    kind = "repeat_token"
    expects = "data.corrupted_batch"
    Config = Config

    def __init__(self, cfg, step, ctx):
        super().__init__(cfg, step, ctx)
        self.token: int | None = cfg.token  # fixed at the first fire

    def check(self) -> None:
        vocab = self.ctx.loader.dataset.vocab_size
        if self.token is not None and self.token >= vocab:
            raise ValueError(f"{self.key('token')}={self.token}: must be < vocab size {vocab}")

    def corrupt(self, first_id: int, batch):
        if self.token is None:  # the most frequent label of the GLOBAL batch: the same id on every rank
            ld = self.ctx.loader
            full = ld.dataset.samples(range(first_id, first_id + ld.batch_size), ld.split)
            self.token = int(torch.bincount(full.labels[full.labels != IGNORE_INDEX]).argmax())
        fill_bT = torch.full_like(batch.tokens, self.token)
        return dataclasses.replace(batch, tokens=fill_bT, labels=fill_bT.clone(), floor=None)

    def event_info(self) -> dict:
        return {"token": self.token}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "token": self.token}

    def load_state_dict(self, sd: dict) -> None:
        super().load_state_dict(sd)
        self.token = sd["token"]
