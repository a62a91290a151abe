"""The `data` group's schema: one dataclass for both kinds (the union of their keys), and the rule that a
kind refuses a key it does not read. The synthetic sources are a list of SourceConfig (markov | copy)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any
from typing import Mapping

from data.sources import MAX_TABLE
from omegaconf import DictConfig, OmegaConf

from run.config_errors import ConfigError, check, choice, from_mapping, unused_keys

KINDS = ("synthetic", "text")
TOKENIZERS = ("byte", "char", "bpe")
FORMATS = ("auto", "text", "json", "parquet")
SOURCE_KINDS = ("markov", "copy")
_USED = {  # keys each kind reads, beside kind / seq_len / seed
    "synthetic": {"min_doc_len", "sources"},
    "text": {"path", "format", "text_field", "tokenizer", "bpe_vocab_size", "val_fraction", "cache", "shard_tokens", "num_proc"},
}
_SOURCE_USED = {"markov": {"alphabet", "order", "support", "concentration"}, "copy": {"alphabet", "segment"}}


def read_keys(saved: Mapping) -> dict:
    """A saved data node with only the keys its kind reads (those it does not never reached the run)."""
    kind = saved.get("kind", "synthetic")
    return {k: v for k, v in saved.items() if k in {"kind", "seq_len", "seed", *_USED.get(kind, ())}}


@dataclass
class SourceConfig:
    """One known-entropy source of the synthetic mixture (data/sources.py)."""
    name: str | None = None     # null: the kind
    kind: str = "markov"        # markov | copy
    weight: float = 1.0         # mixture weight (normalised over the sources)
    alphabet: int = 32
    order: int = 2              # markov: context length k
    support: int = 4            # markov: next-symbol candidates per context
    concentration: float = 0.5  # markov: Dirichlet concentration of the next-symbol probabilities
    segment: int = 12           # copy: the segment that repeats

    def check(self, where: str) -> None:
        """Range and per-kind rules; `where` is `data.sources[i]` (the list index is the parent's)."""
        choice(f"{where}.kind", self.kind, SOURCE_KINDS)
        unused_keys(self, {"name", "kind", "weight", *_SOURCE_USED[self.kind]}, where, f"kind={self.kind}")
        check(math.isfinite(self.weight) and self.weight >= 0, f"{where}.weight", self.weight, "must be >= 0")
        check(self.alphabet >= 2, f"{where}.alphabet", self.alphabet, "must be >= 2")
        if self.kind == "markov":
            check(self.order >= 1, f"{where}.order", self.order, "must be >= 1")
            check(self.support >= 1, f"{where}.support", self.support, "must be >= 1")
            check(self.support <= self.alphabet, f"{where}.support", self.support, f"> alphabet={self.alphabet}",
                  sep=" ")
            check(self.alphabet ** (self.order + 1) <= MAX_TABLE, f"{where}.order", self.order,
                  f"alphabet**(order+1)={self.alphabet ** (self.order + 1)} > {MAX_TABLE} (table too big)")
            check(math.isfinite(self.concentration) and self.concentration > 0, f"{where}.concentration",
                  self.concentration, "must be > 0")
        else:
            check(self.segment >= 1, f"{where}.segment", self.segment, "must be >= 1")

    def resolved(self) -> dict:
        """The keys this kind reads, as the dataset records them (its fingerprint hashes this)."""
        return {"name": self.name or self.kind, "kind": self.kind, "weight": float(self.weight),
                **{f.name: getattr(self, f.name) for f in fields(self) if f.name in _SOURCE_USED[self.kind]}}


def _default_sources() -> list[SourceConfig]:
    """The quickstart's mixture: markov (order 1) + copy, the copy source at weight 0.75."""
    # NOTE: with three copy documents in four the copy source's induction head forms early in the default
    # run's 400 steps on every seed, data seed and thread count tried, and every run ends at its floor; with
    # equal weights (conf/data/synthetic.yaml) it formed late or never (README: the default run; issue 15)
    return [SourceConfig(name="markov", kind="markov", weight=0.25, order=1, support=4, concentration=0.5),
            SourceConfig(name="copy", kind="copy", weight=0.75, segment=12)]


@dataclass
class DataConfig:
    kind: str = "synthetic"     # synthetic | text
    seq_len: int = 128          # tokens per sample (inputs; labels are the next tokens)
    seed: int = 1234            # the data's own seed: samples are pure functions of (seed, split, id)
    # synthetic: documents of Uniform{min_doc_len, ..., seq_len + 1} tokens from a weighted mixture
    min_doc_len: int = 16
    sources: list[SourceConfig] = field(default_factory=_default_sources)
    # text: a local text/json/parquet file (or a hub name when online) through `datasets`
    # required for kind=text: a file, a directory or a list of files (the last two, or any path with `cache`
    # set, are tokenised once into memory-mapped shards: data/shards.py)
    path: Any = None
    format: str = "auto"        # auto (by extension) | text | json | parquet
    text_field: str = "text"
    tokenizer: str = "byte"     # byte | char | bpe
    bpe_vocab_size: int = 1024  # bpe only
    val_fraction: float = 0.1   # the validation split is the tail of the stream
    cache: str | None = None    # shard cache directory (null: ~/.cache/ballast/shards for a directory or list)
    shard_tokens: int = 1 << 26  # tokens per shard file (2^26: 128 MiB of uint16)
    num_proc: int | None = None  # tokenisation processes for the datasets map; null = min(8, CPUs)

    def __post_init__(self) -> None:
        choice("data.kind", self.kind, KINDS)
        unused_keys(self, {"kind", "seq_len", "seed", *_USED[self.kind]}, "data", f"data.kind={self.kind}")
        check(self.seq_len >= 1, "data.seq_len", self.seq_len, "must be >= 1")
        check(self.seed >= 0, "data.seed", self.seed, "must be >= 0")
        if self.kind == "synthetic":
            check(2 <= self.min_doc_len <= self.seq_len + 1, "data.min_doc_len", self.min_doc_len,
                  f"must be in [2, data.seq_len + 1 = {self.seq_len + 1}]")
            check(len(self.sources) > 0, "data.sources", self.sources, "expected a non-empty list of sources")
            for i, s in enumerate(self.sources):
                s.check(f"data.sources[{i}]")
            names = [s.resolved()["name"] for s in self.sources]
            check(len(set(names)) == len(names), "data.sources names", names, "names must be unique")
        else:
            if not self.path:
                raise ConfigError("data.path: required for data=text (e.g. data.path=input.txt)")
            listed = isinstance(self.path, (list, tuple)) and all(isinstance(p, str) and p for p in self.path)
            check(listed or isinstance(self.path, str), "data.path", self.path,
                  "expected a file, a directory, a list of files or a hub name")
            check(self.cache is None or bool(self.cache), "data.cache", self.cache, "expected a directory path or null")
            check(self.shard_tokens >= 1, "data.shard_tokens", self.shard_tokens, "must be >= 1")
            check(self.num_proc is None or self.num_proc >= 1, "data.num_proc", self.num_proc, "must be >= 1 or null")
            choice("data.tokenizer", self.tokenizer, TOKENIZERS)
            choice("data.format", self.format, FORMATS)
            check(self.bpe_vocab_size >= 1, "data.bpe_vocab_size", self.bpe_vocab_size, "must be >= 1")
            check(0.0 < self.val_fraction < 1.0, "data.val_fraction", self.val_fraction, "must be in (0, 1)")

    @classmethod
    def from_dict(cls, d: Mapping) -> "DataConfig":
        if isinstance(d, cls):
            return d
        d = dict(OmegaConf.to_container(d, resolve=True) if isinstance(d, DictConfig) else d)
        if isinstance(d.get("sources"), (list, tuple)):
            # NOTE: one by one, so an error names its index: OmegaConf's own message loses the list path
            d["sources"] = [from_mapping(SourceConfig, src, f"data.sources[{i}]") for i, src in enumerate(d["sources"])]
        return from_mapping(cls, d, "data")
