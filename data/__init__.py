"""Data: known-entropy synthetic mixtures and real text, behind one protocol.

A dataset has vocab_size, seq_len, source_names, fingerprint, samples(ids, split) -> Batch and
describe(); Loader turns it into a resumable, rank-sharded stream of batches.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

from data.batch import IGNORE_INDEX, Batch
from data.loader import Loader, eval_batches
from data.synthetic import PAD_ID, SyntheticMixture
from data.text import TextDataset
from data.validate import check_keys, get_choice, get_float, get_int

KINDS = ("synthetic", "text")
_SYNTHETIC_KEYS = {"kind", "seq_len", "min_doc_len", "seed", "sources"}
_TEXT_KEYS = {"kind", "path", "seq_len", "seed", "tokenizer", "bpe_vocab_size", "val_fraction", "format", "text_field",
              "cache", "shard_tokens", "num_proc"}


def build_data(cfg: Mapping):
    """Build the dataset named by cfg["kind"] (a plain dict or an OmegaConf DictConfig)."""
    if hasattr(cfg, "_metadata"):  # OmegaConf container -> plain, resolved python
        from omegaconf import OmegaConf
        cfg = OmegaConf.to_container(cfg, resolve=True)
    kind = cfg.get("kind")
    if kind not in KINDS:
        raise ValueError(f"data.kind={kind}: expected one of {', '.join(KINDS)}")
    if kind == "synthetic":
        check_keys(cfg, _SYNTHETIC_KEYS, "data")
        seq_len = get_int(cfg, "seq_len", "data", lo=1)
        return SyntheticMixture(cfg.get("sources"), seq_len=seq_len,
                                min_doc_len=get_int(cfg, "min_doc_len", "data", lo=2, hi=seq_len + 1),
                                seed=get_int(cfg, "seed", "data", lo=0))
    check_keys(cfg, _TEXT_KEYS, "data")
    path = cfg.get("path")
    listed = isinstance(path, (list, tuple)) and path and all(isinstance(p, str) and p for p in path)
    if not listed and (not isinstance(path, str) or not path):
        raise ValueError(f"data.path={path!r}: expected a file, a directory, a list of files or a hub name")
    tokenizer = get_choice(cfg, "tokenizer", "data", ("byte", "char", "bpe"), "byte")
    vocab_size = get_int(cfg, "bpe_vocab_size", "data", lo=1) if tokenizer == "bpe" else None
    fmt = get_choice(cfg, "format", "data", ("auto", "text", "json", "parquet"), "auto")
    cache = cfg.get("cache")
    if cache is not None and (not isinstance(cache, str) or not cache):
        raise ValueError(f"data.cache={cache!r}: expected a directory path or null")
    if listed or cache is not None or Path(path).expanduser().is_dir():
        # a corpus that need not fit in memory: tokenised once into memory-mapped shards (data/shards.py)
        from data.shards import ShardedTextDataset
        num_proc = cfg.get("num_proc")
        return ShardedTextDataset(list(path) if listed else path, seq_len=get_int(cfg, "seq_len", "data", lo=1),
                                  seed=get_int(cfg, "seed", "data", lo=0), cache=cache, tokenizer=tokenizer,
                                  vocab_size=vocab_size, val_fraction=get_float(cfg, "val_fraction", "data", 0.1),
                                  format=None if fmt == "auto" else fmt, text_field=str(cfg.get("text_field") or "text"),
                                  shard_tokens=get_int(cfg, "shard_tokens", "data", 1 << 26, lo=1),
                                  num_proc=None if num_proc is None else get_int(cfg, "num_proc", "data", lo=1))
    return TextDataset(path, seq_len=get_int(cfg, "seq_len", "data", lo=1), seed=get_int(cfg, "seed", "data", lo=0),
                       tokenizer=tokenizer, vocab_size=vocab_size,
                       val_fraction=get_float(cfg, "val_fraction", "data", 0.1),
                       format=None if fmt == "auto" else fmt,
                       text_field=str(cfg.get("text_field") or "text"))


__all__ = ["Batch", "IGNORE_INDEX", "PAD_ID", "Loader", "eval_batches", "SyntheticMixture", "TextDataset",
           "build_data"]
