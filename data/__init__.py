"""Data: known-entropy synthetic mixtures and real text, behind one protocol.

A dataset has vocab_size, seq_len, source_names, fingerprint, samples(ids, split) -> Batch and
describe(); Loader turns it into a resumable, rank-sharded stream of batches.
"""
from __future__ import annotations

from pathlib import Path

from data.batch import IGNORE_INDEX, Batch
from data.loader import Loader, eval_batches
from data.synthetic import PAD_ID, SyntheticMixture
from data.text import TextDataset
from data.config import DataConfig, SourceConfig
from run.config_errors import typed


def build_data(cfg: DataConfig):
    """Build the dataset named by cfg.kind, from the `data` group's DataConfig (a dict is refused: it
    reaches here through the schema, `DataConfig.from_dict` or `Config.from_dict(d).data`)."""
    cfg = typed(cfg, DataConfig, "build_data")
    if cfg.kind == "synthetic":
        return SyntheticMixture(cfg.sources, seq_len=cfg.seq_len, min_doc_len=cfg.min_doc_len, seed=cfg.seed)
    listed = isinstance(cfg.path, (list, tuple))
    fmt = None if cfg.format == "auto" else cfg.format
    if listed or cfg.cache is not None or Path(cfg.path).expanduser().is_dir():
        # a corpus that need not fit in memory: tokenised once into memory-mapped shards (data/shards.py)
        from data.shards import ShardedTextDataset
        return ShardedTextDataset(list(cfg.path) if listed else cfg.path, seq_len=cfg.seq_len, seed=cfg.seed,
                                  cache=cfg.cache, tokenizer=cfg.tokenizer,
                                  vocab_size=cfg.bpe_vocab_size if cfg.tokenizer == "bpe" else None,
                                  val_fraction=cfg.val_fraction, format=fmt, text_field=cfg.text_field,
                                  shard_tokens=cfg.shard_tokens, num_proc=cfg.num_proc)
    return TextDataset(cfg.path, seq_len=cfg.seq_len, seed=cfg.seed, tokenizer=cfg.tokenizer,
                       vocab_size=cfg.bpe_vocab_size if cfg.tokenizer == "bpe" else None,
                       val_fraction=cfg.val_fraction, format=fmt, text_field=cfg.text_field)


__all__ = ["Batch", "IGNORE_INDEX", "PAD_ID", "Loader", "eval_batches", "SyntheticMixture", "TextDataset",
           "build_data", "DataConfig", "SourceConfig"]
