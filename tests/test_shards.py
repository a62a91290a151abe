"""Sharded text corpora: the shards hold exactly the corpus's tokens, the loader over them keeps the
in-memory loader's contract (same samples, resume, world-size change), and a corrupted shard is caught."""
from __future__ import annotations

import numpy as np
import pytest

from data import Loader, TextDataset, build_data
from data.config import DataConfig
from data.shards import ShardedTextDataset

DOCS = ["".join(f"doc {d} line {i}: the quick brown fox {i * d} jumps.\n" for i in range(20 + d)) for d in range(4)]


@pytest.fixture()
def corpus(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    paths = [d / "a.txt", d / "b.txt", d / "sub" / "c.txt", d / "sub" / "d.txt"]  # sorted order = DOCS order
    for p, text in zip(paths, DOCS):
        p.write_text(text)
    return d


def cfg(path, cache, **kw) -> DataConfig:
    return DataConfig.from_dict({"kind": "text", "path": path, "cache": str(cache), "seq_len": 16, "seed": 7,
                                 "val_fraction": 0.1, "shard_tokens": 300, "num_proc": 1, **kw})


@pytest.mark.parametrize("tokenizer", ["byte", "char", "bpe"])
def test_shards_hold_exactly_the_tokens_of_the_text(corpus, tmp_path, tokenizer):
    ds = build_data(cfg(str(corpus), tmp_path / "cache", tokenizer=tokenizer, bpe_vocab_size=300))
    assert isinstance(ds, ShardedTextDataset) and len(ds._maps) > 3  # several shards, windows cross boundaries
    joined = "\n".join(DOCS)  # the in-memory path's stream: documents joined by the separator
    total = ds.n_tokens("train") + ds.n_tokens("val")
    stream = ds.tokens(0, total)
    assert stream.dtype == np.uint16
    assert stream.astype(np.int64).tolist() == ds.tokenizer.encode(joined).tolist()
    assert ds.tokenizer.decode(stream) == joined


def test_sharded_samples_equal_the_in_memory_loader(corpus, tmp_path):
    """One ASCII file, byte tokenizer: both cut the same stream at the same place, so every sample agrees."""
    f = corpus / "a.txt"
    mem = TextDataset(str(f), seq_len=16, seed=7, tokenizer="byte")
    sh = build_data(cfg(str(f), tmp_path / "cache"))
    assert isinstance(sh, ShardedTextDataset) and sh.n_tokens("train") == mem.n_tokens("train")
    for split in ("train", "val"):
        a, b = mem.samples(range(40), split), sh.samples(range(40), split)
        assert a.tokens.equal(b.tokens) and a.labels.equal(b.labels) and a.sample_ids.equal(b.sample_ids)


def test_resume_and_world_size_change(corpus, tmp_path):
    ds = build_data(cfg([str(corpus / "a.txt"), str(corpus / "sub")], tmp_path / "cache"))
    straight = Loader(ds, 8)
    want = [straight.next() for _ in range(6)]
    first = Loader(ds, 8)
    for _ in range(3):
        first.next()
    sd = first.state_dict()
    # reopen from the cache (a new process would) and continue on 2 ranks
    ds2 = build_data(cfg([str(corpus / "a.txt"), str(corpus / "sub")], tmp_path / "cache"))
    assert ds2.fingerprint == ds.fingerprint
    ranks = [Loader(ds2, 8, rank=r, world=2) for r in range(2)]
    for ld in ranks:
        ld.load_state_dict(sd)
    for k in range(3, 6):
        parts = [ld.next() for ld in ranks]
        got = np.concatenate([p.tokens.numpy() for p in parts])
        assert (got == want[k].tokens.numpy()).all()
        assert [i for p in parts for i in p.sample_ids.tolist()] == want[k].sample_ids.tolist()


def test_cache_is_reused_and_keyed_by_content(corpus, tmp_path):
    c = cfg(str(corpus), tmp_path / "cache")
    a = build_data(c)
    mtime = (a.root / "manifest.json").stat().st_mtime_ns
    b = build_data(c)
    assert b.root == a.root and (b.root / "manifest.json").stat().st_mtime_ns == mtime  # not re-tokenised
    (corpus / "a.txt").write_text(DOCS[0].replace("fox", "cat"))
    c2 = build_data(c)
    assert c2.root != a.root and c2.fingerprint != a.fingerprint


def test_corrupted_shard_is_detected(corpus, tmp_path):
    ds = build_data(cfg(str(corpus), tmp_path / "cache"))
    shard = ds.root / "shard_00001.bin"
    raw = bytearray(shard.read_bytes())
    raw[10] ^= 0x01
    shard.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="shard_00001.bin does not match its sha256"):
        build_data(cfg(str(corpus), tmp_path / "cache"))


def test_bad_paths_name_the_key(corpus, tmp_path):
    with pytest.raises(ValueError, match="data.path=.*nope.txt: file not found"):
        build_data(cfg([str(corpus / "a.txt"), str(corpus / "nope.txt")], tmp_path / "cache"))
    (corpus / "x.parquet").write_bytes(b"")
    with pytest.raises(ValueError, match="mixed formats"):
        build_data(cfg(str(corpus), tmp_path / "cache"))


def test_parquet_shards_with_a_text_field(tmp_path, monkeypatch):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    d = tmp_path / "pq"
    d.mkdir()
    for i, docs in enumerate([DOCS[:2], DOCS[2:]]):
        pq.write_table(pa.table({"body": docs, "id": list(range(len(docs)))}), d / f"part_{i}.parquet")
    ds = build_data(cfg(str(d), tmp_path / "cache", text_field="body", tokenizer="char"))
    total = ds.n_tokens("train") + ds.n_tokens("val")
    assert ds.tokenizer.decode(ds.tokens(0, total)) == "\n".join(DOCS)
    with pytest.raises(ValueError, match="data.text_field=text: not a column"):
        build_data(cfg(str(d), tmp_path / "cache2"))
