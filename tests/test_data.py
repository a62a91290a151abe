"""Batch, loader (determinism, resume, sharding, world-size change, fingerprints) and text sources."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from data import IGNORE_INDEX, Batch, Loader, build_data, eval_batches
from data.config import DataConfig
from data.tokenizers import BPETokenizer, ByteTokenizer, CharTokenizer

REPO = Path(__file__).resolve().parents[1]
SYN = {
    "kind": "synthetic", "seq_len": 64, "min_doc_len": 8, "seed": 1234,
    "sources": [
        {"name": "markov", "kind": "markov", "weight": 0.7, "alphabet": 16, "order": 2, "support": 4,
         "concentration": 0.5},
        {"name": "copy", "kind": "copy", "weight": 0.3, "alphabet": 16, "segment": 6},
    ],
}


def build(cfg):
    """The dataset of a test's dict (or OmegaConf node), through the data group's schema: build_data takes
    the DataConfig only."""
    return build_data(DataConfig.from_dict(cfg))


def _same(a: Batch, b: Batch) -> bool:
    return (a.sample_ids.equal(b.sample_ids) and a.tokens.equal(b.tokens) and a.labels.equal(b.labels)
            and a.sources.equal(b.sources) and (a.floor is None) == (b.floor is None)
            and (a.floor is None or a.floor.equal(b.floor)))


# ---- Batch -------------------------------------------------------------------------------------
def test_micro_batches_have_unequal_valid_counts_and_round_trip():
    ds = build({**SYN, "seq_len": 128, "min_doc_len": 16})
    batch = Loader(ds, batch_size=16).next()
    mbs = batch.micro_batches(4)
    counts = [mb.n_valid for mb in mbs]
    assert len(set(counts)) > 1 and sum(counts) == batch.n_valid
    assert batch.n_valid == sum(int((row != IGNORE_INDEX).sum()) for row in batch.labels)
    assert _same(Batch.concat(mbs), batch)
    with pytest.raises(ValueError, match="n=3"):
        batch.micro_batches(3)
    bid = json.loads(json.dumps(batch.batch_id()))
    assert bid == {"samples": list(range(16)), "sources": batch.sources.tolist()}
    assert _same(batch.to("cpu"), batch)


# ---- Loader ------------------------------------------------------------------------------------
def test_same_seed_same_batches():
    a, b = Loader(build(SYN), 8), Loader(build(SYN), 8)
    for _ in range(3):
        x, y = a.next(), b.next()
        assert _same(x, y)
    assert x.sample_ids.tolist() == list(range(16, 24))
    other = Loader(build({**SYN, "seed": 99}), 8)
    other.next(), other.next()
    assert not other.next().tokens.equal(x.tokens)


def test_restore_mid_run_continues_identically():
    ref = Loader(build(SYN), 8)
    straight = [ref.next() for _ in range(5)]
    first = Loader(build(SYN), 8)
    first.next(), first.next()
    sd = json.loads(json.dumps(first.state_dict()))  # what a checkpoint would hold
    resumed = Loader(build(SYN), 8)
    resumed.load_state_dict(sd)
    for want in straight[2:]:
        assert _same(resumed.next(), want)


def test_ranks_see_disjoint_shares_of_the_single_process_batch():
    ds = build(SYN)
    single = Loader(ds, 8)
    ranks = [Loader(ds, 8, rank=r, world=4) for r in range(4)]
    for _ in range(3):
        want = single.next()
        parts = [ld.next() for ld in ranks]
        ids = [set(p.sample_ids.tolist()) for p in parts]
        assert all(not (ids[i] & ids[j]) for i in range(4) for j in range(i + 1, 4))
        assert _same(Batch.concat(parts), want)
    with pytest.raises(ValueError, match="world=3"):
        Loader(ds, 8, rank=0, world=3)


def test_world_size_change_after_restore_consumes_the_straight_run_ids():
    ds = build(SYN)
    straight = Loader(ds, 8)
    want = [straight.next() for _ in range(5)]
    two = [Loader(ds, 8, rank=r, world=2) for r in range(2)]
    for _ in range(2):
        for ld in two:
            ld.next()
    sd = two[0].state_dict()
    assert sd == two[1].state_dict()
    one = Loader(ds, 8, rank=0, world=1)
    one.load_state_dict(sd)
    for w in want[2:]:
        assert _same(one.next(), w)


def test_fingerprint_mismatch_raises_unless_allowed():
    saved = Loader(build(SYN), 8)
    saved.next()
    sd = saved.state_dict()
    other = Loader(build({**SYN, "seed": 7}), 8)
    with pytest.raises(ValueError) as e:
        other.load_state_dict(sd)
    assert sd["fingerprint"] in str(e.value) and other.dataset.fingerprint in str(e.value)
    other.load_state_dict(sd, allow_data_change=True)
    assert other.next().sample_ids.tolist() == list(range(8, 16))


def _with_source(i, **kw):
    srcs = [dict(s) for s in SYN["sources"]]
    srcs[i].update(kw)
    return {**SYN, "sources": srcs}


@pytest.mark.parametrize("cfg", [
    {**SYN, "seed": 1}, {**SYN, "seq_len": 65}, {**SYN, "min_doc_len": 9},
    _with_source(0, weight=0.6), _with_source(0, alphabet=17), _with_source(0, order=1),
    _with_source(0, support=5), _with_source(0, concentration=0.4), _with_source(1, segment=5),
    _with_source(1, name="induction"),
])
def test_fingerprint_changes_when_a_config_value_changes(cfg):
    assert build(cfg).fingerprint != build(SYN).fingerprint


def test_fingerprint_is_stable_for_equal_data():
    base = build(SYN)
    assert build(json.loads(json.dumps(SYN))).fingerprint == base.fingerprint
    # Weights are a distribution: scaling them changes no sample, so not the fingerprint either.
    scaled = build({**SYN, "sources": [dict(SYN["sources"][0], weight=7.0),
                                       dict(SYN["sources"][1], weight=3.0)]})
    assert scaled.fingerprint == base.fingerprint
    base.set_weights([0.5, 0.5])
    assert base.fingerprint != scaled.fingerprint


def test_eval_batches_are_the_fixed_sharded_val_set():
    ds = build(SYN)
    single = eval_batches(ds, n_samples=16, batch_size=8)
    assert torch.cat([b.sample_ids for b in single]).tolist() == list(range(16))
    assert _same(single[0], ds.samples(range(8), split="val"))
    shards = [eval_batches(ds, 16, 8, rank=r, world=2) for r in range(2)]
    for i in range(2):
        assert _same(Batch.concat([shards[0][i], shards[1][i]]), single[i])
    with pytest.raises(ValueError, match="n_samples=10"):
        eval_batches(ds, 10, 8)


# ---- text --------------------------------------------------------------------------------------
TEXT = "".join(f"line {i}: the quick brown fox jumps over the lazy dog, ünïcødé {i * i}.\n" for i in range(60))


@pytest.fixture()
def hf_cache(tmp_path, monkeypatch):
    """Keep `datasets`' arrow cache of these throwaway files out of the user's ~/.cache."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


@pytest.fixture()
def txt(tmp_path, hf_cache):
    p = tmp_path / "tiny.txt"
    p.write_text(TEXT, encoding="utf-8")
    return p


@pytest.mark.parametrize("tok", [ByteTokenizer(), CharTokenizer(TEXT)])
def test_tokenizers_round_trip(tok):
    ids = tok.encode(TEXT)
    assert ids.dtype.kind == "i" and ids.min() >= 0 and ids.max() < tok.vocab_size
    assert tok.decode(ids) == TEXT


def test_char_tokenizer_rejects_unknown_char():
    with pytest.raises(ValueError, match="'Z'"):
        CharTokenizer("abc").encode("abZ")


def test_bpe_trains_deterministically_and_round_trips():
    a, b = BPETokenizer(TEXT, 300), BPETokenizer(TEXT, 300)
    assert a.state() == b.state() and 256 < a.vocab_size <= 300
    ids = a.encode(TEXT)
    assert len(ids) < len(TEXT.encode()) and a.decode(ids) == TEXT  # merges compress, decoding is exact
    assert a.decode(a.encode("héllo, 世界")) == "héllo, 世界"  # unseen characters fall back to bytes
    with pytest.raises(ValueError, match="data.bpe_vocab_size=100"):
        BPETokenizer(TEXT, 100)


@pytest.mark.parametrize("tokenizer", ["byte", "char", "bpe"])
def test_text_val_split_is_the_tail_and_windows_stay_inside(txt, tokenizer):
    ds = build({"kind": "text", "path": str(txt), "seq_len": 32, "seed": 0, "tokenizer": tokenizer,
                "bpe_vocab_size": 300, "format": "auto"})
    cut = round(len(TEXT) * 0.9)
    assert ds.tokenizer.decode(ds._streams["val"]) == TEXT[cut:]
    assert ds.tokenizer.decode(ds._streams["train"]) == TEXT[:cut]
    for split in ("train", "val"):
        stream = ds._streams[split].tolist()
        b = ds.samples(range(20), split)
        assert b.floor is None and b.sources.eq(0).all() and b.n_valid == 20 * 32
        assert b.labels[:, :-1].equal(b.tokens[:, 1:])
        for row_in, row_lab in zip(b.tokens.tolist(), b.labels.tolist()):
            w = row_in + row_lab[-1:]
            assert any(stream[o:o + 33] == w for o in range(len(stream) - 32)), split


def test_text_fingerprint_tracks_content_and_tokenizer(txt, tmp_path):
    cfg = {"kind": "text", "path": str(txt), "seq_len": 32, "seed": 0}
    base = build(cfg).fingerprint
    assert build(cfg).fingerprint == base
    assert build({**cfg, "tokenizer": "char"}).fingerprint != base
    edited = tmp_path / "edited.txt"
    edited.write_text(TEXT.replace("fox", "cat"), encoding="utf-8")
    assert build({**cfg, "path": str(edited)}).fingerprint != base


def test_jsonl_with_text_field_loads(tmp_path, hf_cache):
    p = tmp_path / "docs.jsonl"
    docs = [f"document {i} says hello" for i in range(40)]
    p.write_text("".join(json.dumps({"id": i, "body": d}) + "\n" for i, d in enumerate(docs)), encoding="utf-8")
    ds = build({"kind": "text", "path": str(p), "seq_len": 16, "seed": 0, "text_field": "body"})
    joined = "\n".join(docs)
    cut = round(len(joined) * 0.9)
    assert ds.tokenizer.decode(ds._streams["train"]) == joined[:cut]
    with pytest.raises(ValueError, match="data.text_field=text"):
        build({"kind": "text", "path": str(p), "seq_len": 16, "seed": 0})


def test_missing_file_names_data_path(tmp_path):
    missing = str(tmp_path / "nope.txt")
    with pytest.raises(ValueError, match=f"data.path={missing}: file not found"):
        build({"kind": "text", "path": missing, "seq_len": 16, "seed": 0})


def test_hub_name_offline_gives_one_line_error():
    # The offline switches are read when `datasets` is imported, so this runs in a fresh interpreter.
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    code = ("from data import DataConfig, build_data\n"
            "try:\n build_data(DataConfig.from_dict({'kind': 'text', 'path': 'owner/name', 'seq_len': 8, 'seed': 0}))\n"
            "except ValueError as e:\n print('ERR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600).stdout  # a hang guard only
    assert out.strip() == ("ERR data.path=owner/name: cannot reach the Hugging Face hub (offline); "
                           "pass a local file")


def test_build_data_takes_the_typed_config_only():
    with pytest.raises(TypeError) as e:
        build_data(SYN)
    assert str(e.value).startswith("build_data takes a DataConfig") and "\n" not in str(e.value)


def test_shipped_data_configs_build(txt):
    from omegaconf import OmegaConf

    syn_cfg = OmegaConf.load(REPO / "conf/data/synthetic.yaml")  # a DictConfig and its plain dict agree
    assert build(syn_cfg).fingerprint == build(OmegaConf.to_container(syn_cfg)).fingerprint
    text_cfg = OmegaConf.load(REPO / "conf/data/text.yaml")
    text_cfg.path, text_cfg.seq_len = str(txt), 32
    for tok in ("byte", "char", "bpe"):
        text_cfg.tokenizer = tok
        ds = build(text_cfg)
        assert ds.tokenizer.name == tok and ds.samples([0]).tokens.max() < ds.vocab_size
