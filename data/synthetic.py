"""A weighted mixture of known-entropy sources: every label carries its exact Bayes loss floor.

Token layout: id 0 = PAD, then per source its own BOS id followed by its own alphabet range, so a
document's first token names its source and mixing adds no hidden entropy:
vocab_size = 1 + sum_s (1 + alphabet_s).
A document is [BOS_s, x_1, ..., x_{L-1}], L ~ Uniform{min_doc_len, ..., seq_len + 1};
inputs = doc[:-1] padded with PAD, labels = doc[1:] padded with IGNORE_INDEX.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np
import torch

from data.batch import IGNORE_INDEX, Batch
from data.ids import fingerprint_of, sample_rngs
from data.sources import CopySource, MarkovSource
from data.config import DataConfig, SourceConfig

PAD_ID = 0
GENERATOR_VERSION = 1  # bump when the sampling algorithm changes: old cursors then mean other data

def _build_source(cfg: SourceConfig, seed: int) -> tuple[object, dict]:
    """The source of one checked sources[i] entry, and its resolved config (fingerprinted)."""
    out = cfg.resolved()
    if cfg.kind == "markov":
        return MarkovSource(out["name"], cfg.alphabet, cfg.order, cfg.support, out["concentration"], seed), out
    return CopySource(out["name"], cfg.alphabet, cfg.segment), out


class SyntheticMixture:
    def __init__(self, sources_cfg: Sequence[Mapping], seq_len: int, min_doc_len: int, seed: int):
        # the schema checks the keys, types, ranges and unique names (data/config.py)
        cfg = DataConfig.from_dict({"kind": "synthetic", "sources": list(sources_cfg), "seq_len": seq_len,
                                    "min_doc_len": min_doc_len, "seed": seed})
        self.seq_len, self.min_doc_len, self.seed = cfg.seq_len, cfg.min_doc_len, cfg.seed
        built = [_build_source(c, self.seed) for c in cfg.sources]
        self.sources = [s for s, _ in built]
        self._cfgs = [c for _, c in built]
        self.source_names = [s.name for s in self.sources]
        # Source s owns ids [bos_s, bos_s + alphabet_s]: BOS first, then its alphabet.
        self.bos_ids = list(np.cumsum([1] + [1 + s.alphabet for s in self.sources[:-1]]))
        self.vocab_size = 1 + sum(1 + s.alphabet for s in self.sources)
        self.set_weights([c["weight"] for c in self._cfgs])
        # Expected floor at each label position t = 0..seq_len-1 (exact; independent of the weights).
        self._pos_floor_ST = np.stack([s.position_floors(self.seq_len) for s in self.sources])

    # ---- mixture weights ------------------------------------------------------------------------
    def set_weights(self, weights: Sequence[float]) -> None:
        """Change the mixture (e.g. mid-run). Only each sample's source choice changes: its length and
        content uniforms are drawn from its rng regardless of the weights."""
        w = [float(x) for x in weights]
        if len(w) != len(self.sources):
            raise ValueError(f"data.sources weights={w}: expected {len(self.sources)} weights")
        if any(not math.isfinite(x) or x < 0 for x in w) or sum(w) <= 0:
            raise ValueError(f"data.sources weights={w}: must be non-negative and not all zero")
        self.weights = np.asarray(w) / sum(w)
        self._cdf = np.cumsum(self.weights)

    def token_ranges(self) -> list[range]:
        return [range(b, b + 1 + s.alphabet) for b, s in zip(self.bos_ids, self.sources)]

    # ---- sampling -------------------------------------------------------------------------------
    def samples(self, ids: Sequence[int], split: str = "train") -> Batch:
        T = self.seq_len
        B = len(ids)
        ids_B = np.zeros(B, dtype=np.int64)
        u_src_B = np.empty(B)
        len_B = np.empty(B, dtype=np.int64)
        u_BT = np.empty((B, T))
        # Per-sample draws in a fixed order (source, length, content) so each is a pure function of g.
        for i, (g, rng) in enumerate(sample_rngs(self.seed, split, ids)):
            ids_B[i] = g
            u_src_B[i] = rng.random()
            len_B[i] = rng.integers(self.min_doc_len, T + 2)
            u_BT[i] = rng.random(T)
        src_B = np.minimum(np.searchsorted(self._cdf, u_src_B, side="right"), len(self.sources) - 1)

        doc_BT1 = np.empty((B, T + 1), dtype=np.int64)  # [BOS, x_1..x_T]
        floor_BT = np.empty((B, T))
        for s, source in enumerate(self.sources):
            rows = np.flatnonzero(src_B == s)
            if rows.size == 0:
                continue
            x, f = source.generate(u_BT[rows])
            doc_BT1[rows, 0] = self.bos_ids[s]
            doc_BT1[rows, 1:] = self.bos_ids[s] + 1 + x
            floor_BT[rows] = f
        # A document of length L has L-1 labels (positions 0..L-2) and L-1 real inputs.
        valid_BT = np.arange(T)[None, :] < (len_B - 1)[:, None]
        tokens = np.where(valid_BT, doc_BT1[:, :-1], PAD_ID)
        labels = np.where(valid_BT, doc_BT1[:, 1:], IGNORE_INDEX)
        floor = np.where(valid_BT, floor_BT, 0.0)
        return Batch(tokens=torch.from_numpy(tokens), labels=torch.from_numpy(labels),
                     sources=torch.from_numpy(src_B.astype(np.int64)), sample_ids=torch.from_numpy(ids_B),
                     floor=torch.from_numpy(floor).float())

    # ---- exact floors ---------------------------------------------------------------------------
    def _floor_sums(self) -> tuple[np.ndarray, float]:
        """(E[sum of floors over a document's labels] per source, E[number of labels])."""
        n_labels = np.arange(self.min_doc_len - 1, self.seq_len + 1)  # L - 1, uniform
        cum_ST1 = np.concatenate([np.zeros((len(self.sources), 1)), np.cumsum(self._pos_floor_ST, 1)], 1)
        return cum_ST1[:, n_labels].mean(axis=1), float(n_labels.mean())

    def floor_by_source(self) -> dict[str, float]:
        """Expected loss floor per valid label (nats) of each source: E[sum f] / E[n], the token-weighted
        mean that a sum-over-tokens / count loss converges to (not the mean of per-document means)."""
        sums_S, n = self._floor_sums()
        return {name: float(v / n) for name, v in zip(self.source_names, sums_S)}

    def expected_floor(self) -> float:
        # NOTE: lengths do not depend on the source, so this is sum_s w_s floor_s; written as the
        # ratio of expectations so it stays right if that ever changes.
        sums_S, n = self._floor_sums()
        return float((self.weights * sums_S).sum() / (self.weights * n).sum())

    def entropy_rates(self) -> dict[str, float]:
        return {s.name: s.entropy_rate() for s in self.sources}

    # ---- identity -------------------------------------------------------------------------------
    @property
    def fingerprint(self) -> str:
        # NOTE: includes the *current* weights: after set_weights the samples differ, and so does this.
        srcs = [dict(c, weight=round(float(w), 12)) for c, w in zip(self._cfgs, self.weights)]
        return fingerprint_of({"kind": "synthetic", "version": GENERATOR_VERSION, "seq_len": self.seq_len,
                               "min_doc_len": self.min_doc_len, "seed": self.seed, "sources": srcs})

    def describe(self) -> str:
        floors, rates = self.floor_by_source(), self.entropy_rates()
        parts = [f"{s.name} (w={w:.2f}, {s.summary()}, ids {r.start}-{r.stop - 1}): entropy rate "
                 f"{rates[s.name]:.4f}, floor {floors[s.name]:.4f} nats/token"
                 for s, w, r in zip(self.sources, self.weights, self.token_ranges())]
        return (f"synthetic mixture, vocab {self.vocab_size}, seq_len {self.seq_len}, document length "
                f"uniform in [{self.min_doc_len}, {self.seq_len + 1}], seed {self.seed}; "
                + "; ".join(parts) + f"; mixture floor {self.expected_floor():.4f} nats/token.")
