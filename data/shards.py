"""Text corpora larger than memory: tokenised once into memory-mapped token shards, read window by window.

    data.path = a directory (every .txt/.md/.json/.jsonl/.parquet file under it, sorted), a list of files,
                or one file with data.cache set
    data.cache = where the shards live: <cache>/<key>/{manifest.json, shard_00000.bin, ...}

key = sha256 of the files' contents (in order), format, text_field and tokenizer settings: the same corpus is
tokenised once, whatever its path; a changed byte means a new key. Tokenisation is a `datasets` map over
documents (num_proc processes; the corpus is streamed from Arrow files, never held in memory), written as
uint16 ids when vocab_size <= 65536, else uint32, into shards of data.shard_tokens tokens, each with its
sha256 in the manifest. Opening the cache checks every shard's size and sha256: a corrupted shard is named,
never read.

The token stream is the documents' ids joined by the separator "\\n" — for byte and char tokenizers exactly
the ids of the joined text that data=text builds in memory. Train = its head, val = its tail val_fraction
(cut in tokens). Sample g of a split is a random crop at an offset drawn from the sample's own rng
(data/ids.py), so the loader contract is unchanged: deterministic, resumable from a sample count, and
independent of the world size. NOTE: char and BPE tokenizers are trained on the whole corpus (a char
vocabulary or BPE merges only decide which ids exist; the in-memory path trains on the head only).
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import mmap
import os
import shutil
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from data.batch import Batch
from data.ids import fingerprint_of, sample_rngs, split_code
from data.text import _EXT_FORMAT, DOC_SEPARATOR, FORMATS
from data.tokenizers import BPETokenizer, ByteTokenizer, CharTokenizer, build_tokenizer

VERSION = 1


def corpus_files(path, fmt: str | None) -> tuple[list[Path], str]:
    """The corpus's files in a fixed order, and their one format."""
    paths = [path] if isinstance(path, (str, os.PathLike)) else list(path)
    if not paths:
        raise ValueError("data.path=[]: no files")
    files: list[Path] = []
    for p in map(lambda x: Path(x).expanduser(), paths):
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in _EXT_FORMAT
                           and not any(part.startswith(".") for part in f.relative_to(p).parts))
            if not found:
                raise ValueError(f"data.path={p}: no .txt/.md/.json/.jsonl/.parquet file under the directory")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise ValueError(f"data.path={p}: file not found")
    formats = {fmt or _EXT_FORMAT.get(f.suffix.lower()) for f in files}
    if None in formats:
        bad = next(f for f in files if _EXT_FORMAT.get(f.suffix.lower()) is None)
        raise ValueError(f"data.path={bad}: unknown extension {bad.suffix!r}; set data.format to one of {', '.join(FORMATS)}")
    if len(formats) > 1:
        raise ValueError(f"data.path: mixed formats {sorted(formats)}; one corpus must have one format")
    return files, formats.pop()


def content_key(files: list[Path], fmt: str, text_field: str, tokenizer: str, vocab_size: int | None) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(_sha256_file(f).encode())
    return fingerprint_of({"version": VERSION, "files_sha256": h.hexdigest(), "n_files": len(files), "format": fmt,
                           "text_field": text_field, "tokenizer": tokenizer, "bpe_vocab_size": vocab_size})


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _tokenize(batch, indices, tok, field, n_docs, sep_ids, dtype):
    out = []
    for text, i in zip(batch[field], indices):
        ids = tok.encode("" if text is None else str(text))
        if i < n_docs - 1:  # the separator goes *between* documents, as in the joined text
            ids = np.concatenate([ids, sep_ids])
        out.append(ids.astype(dtype))
    return {"ids": out}


def _char_set(batch, field):
    return {"chars": ["".join(sorted(set("".join(str(t) for t in batch[field] if t is not None))))]}


def build_shards(files: list[Path], fmt: str, text_field: str, tokenizer: str, vocab_size: int | None,
                 out: Path, shard_tokens: int, num_proc: int) -> None:
    """Tokenise `files` into `out` (a fresh directory): shards, tokenizer state, manifest.json last."""
    import datasets

    hf_cache = out / "hf"
    extra = {"sample_by": "document"} if fmt == "text" else {}
    ds = datasets.load_dataset(fmt, data_files=[str(f) for f in files], split="train", cache_dir=str(hf_cache), **extra)
    if text_field not in ds.column_names:
        raise ValueError(f"data.text_field={text_field}: not a column of the corpus (columns: {ds.column_names})")
    ds = ds.select_columns([text_field])
    n_docs = len(ds)
    # NOTE: a .txt file is one document (one string in memory), so text batches hold few documents:
    # memory ~ batch × file size. A single file larger than memory must be split into several files.
    docs = 8 if fmt == "text" else 256
    proc = dict(num_proc=num_proc) if num_proc > 1 and n_docs >= num_proc else {}
    if tokenizer == "char":
        chars = ds.map(_char_set, batched=True, batch_size=docs, fn_kwargs={"field": text_field},
                       remove_columns=[text_field], **proc)
        seen = set("".join(chars["chars"])) | ({DOC_SEPARATOR} if n_docs > 1 else set())
        tok = CharTokenizer("".join(sorted(seen)))
    elif tokenizer == "bpe":
        # NOTE: the BPE trainer streams the documents; it never sees the corpus as one string
        tok = BPETokenizer(None, vocab_size, iterator=([t for t in b[text_field] if t] for b in ds.iter(batch_size=docs)))
    else:
        tok = build_tokenizer(tokenizer, "")
    dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32
    sep_ids = tok.encode(DOC_SEPARATOR)
    ids = ds.map(_tokenize, batched=True, batch_size=docs, with_indices=True, remove_columns=[text_field],
                 fn_kwargs=dict(tok=tok, field=text_field, n_docs=n_docs, sep_ids=sep_ids, dtype=dtype), **proc)
    shards, buf, filled = [], np.empty(shard_tokens, dtype=dtype), 0

    def flush(n: int) -> None:
        name = f"shard_{len(shards):05d}.bin"
        buf[:n].tofile(out / name)
        shards.append({"name": name, "tokens": n, "sha256": hashlib.sha256(buf[:n].tobytes()).hexdigest()})

    for tbl in ids.with_format("arrow").iter(batch_size=docs):
        flat = tbl.column("ids").combine_chunks().flatten().to_numpy(zero_copy_only=False).astype(dtype, copy=False)
        while flat.size:
            take = min(shard_tokens - filled, flat.size)
            buf[filled:filled + take], filled, flat = flat[:take], filled + take, flat[take:]
            if filled == shard_tokens:
                flush(filled)
                filled = 0
    if filled or not shards:
        flush(filled)
    del ds, ids
    shutil.rmtree(hf_cache, ignore_errors=True)  # the shards are the cache; the Arrow copies are not needed
    tok_state = {"name": tok.name}
    if tok.name == "char":
        tok_state["chars"] = tok.decode(range(tok.vocab_size))
    elif tok.name == "bpe":
        tok_state["json"] = tok._tok.to_str()
    manifest = {"version": VERSION, "dtype": np.dtype(dtype).name, "vocab_size": tok.vocab_size, "tokenizer": tok_state,
                "files": [str(f) for f in files], "n_docs": n_docs, "tokens": sum(s["tokens"] for s in shards),
                "shards": shards}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))


def load_tokenizer(state: dict):
    if state["name"] == "byte":
        return ByteTokenizer()
    if state["name"] == "char":
        return CharTokenizer(state["chars"])
    return BPETokenizer.from_json(state["json"])


def open_shards(root: Path, verify: bool = True) -> tuple[dict, list[np.memmap]]:
    manifest = json.loads((root / "manifest.json").read_text())
    maps = []
    for s in manifest["shards"]:
        path = root / s["name"]
        size = np.dtype(manifest["dtype"]).itemsize * s["tokens"]
        if not path.is_file() or path.stat().st_size != size:
            raise ValueError(f"data.cache: shard {path} is missing or has the wrong size; delete {root} to re-tokenise")
        if verify and _sha256_file(path) != s["sha256"]:
            raise ValueError(f"data.cache: shard {path} does not match its sha256 in manifest.json (corrupted); "
                             f"delete {root} to re-tokenise")
        if not s["tokens"]:
            maps.append(np.zeros(0, dtype=manifest["dtype"]))
            continue
        m = np.memmap(path, dtype=manifest["dtype"], mode="r", shape=(s["tokens"],))
        # NOTE: random crops: without MADV_RANDOM every page fault reads ahead ~128 KiB around a 0.5 KiB
        # window, and the mapped (page-cache) memory grows toward the corpus size.
        if hasattr(mmap, "MADV_RANDOM") and getattr(m, "_mmap", None) is not None:
            m._mmap.madvise(mmap.MADV_RANDOM)
        maps.append(m)
    return manifest, maps


class ShardedTextDataset:
    source_names = ["text"]

    def __init__(self, path, seq_len: int, seed: int, cache: str | None, tokenizer: str = "byte",
                 vocab_size: int | None = None, val_fraction: float = 0.1, format: str | None = None,
                 text_field: str = "text", shard_tokens: int = 1 << 26, num_proc: int | None = None,
                 verify: bool = True):
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"data.val_fraction={val_fraction}: must be in (0, 1)")
        self.seq_len, self.seed, self.val_fraction = seq_len, seed, val_fraction
        files, fmt = corpus_files(path, format)
        self.key = content_key(files, fmt, text_field, tokenizer, vocab_size)
        cache_root = Path(cache or Path.home() / ".cache" / "ballast" / "shards").expanduser()
        self.root = cache_root / self.key[:16]
        cache_root.mkdir(parents=True, exist_ok=True)
        # NOTE: one builder per cache entry (e.g. every rank of a torchrun launch builds the dataset):
        # the others wait on the lock, then open what it wrote.
        with open(cache_root / f"{self.key[:16]}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (self.root / "manifest.json").is_file():
                tmp = cache_root / f".tmp-{self.key[:16]}-{os.getpid()}"
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
                try:
                    build_shards(files, fmt, text_field, tokenizer, vocab_size, tmp, shard_tokens,
                                 num_proc or min(8, os.cpu_count() or 1))
                except BaseException:
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise
                shutil.rmtree(self.root, ignore_errors=True)  # a half-written entry without a manifest
                tmp.rename(self.root)
        manifest, self._maps = open_shards(self.root, verify)
        self.tokenizer = load_tokenizer(manifest["tokenizer"])
        self.vocab_size, self.n_files = manifest["vocab_size"], len(files)
        self._starts = np.cumsum([0] + [len(m) for m in self._maps])  # global offset of each shard
        total = int(self._starts[-1])
        cut = int(round(total * (1.0 - val_fraction)))
        self._splits = {"train": (0, cut), "val": (cut, total)}
        for split, (a, b) in self._splits.items():
            if b - a < seq_len + 1:
                raise ValueError(f"data.seq_len={seq_len}: the {split} split of {path} has only {b - a} tokens "
                                 f"(a window needs seq_len + 1)")
        self.fingerprint = fingerprint_of({"kind": "text-shards", "version": VERSION, "key": self.key, "seq_len": seq_len,
                                           "seed": seed, "val_fraction": val_fraction, "tokenizer": self.tokenizer.state()})

    def n_tokens(self, split: str) -> int:
        a, b = self._splits[split]
        return b - a

    def tokens(self, start: int, n: int) -> np.ndarray:
        """Tokens [start, start + n) of the whole stream, across shard boundaries."""
        out, i = [], int(np.searchsorted(self._starts, start, side="right")) - 1
        while n > 0:
            local = start - int(self._starts[i])
            part = self._maps[i][local:local + n]
            out.append(part)
            start, n, i = start + len(part), n - len(part), i + 1
        return np.concatenate(out) if len(out) > 1 else np.asarray(out[0])

    def samples(self, ids: Sequence[int], split: str = "train") -> Batch:
        T = self.seq_len
        split_code(split)
        a, b = self._splits[split]
        gs, rows = [], []
        for g, rng in sample_rngs(self.seed, split, ids):
            gs.append(g)
            rows.append(self.tokens(a + int(rng.integers(0, b - a - T)), T + 1))
        w_BT1 = torch.from_numpy(np.stack(rows).astype(np.int64))
        return Batch(tokens=w_BT1[:, :-1].contiguous(), labels=w_BT1[:, 1:].contiguous(),
                     sources=torch.zeros(len(gs), dtype=torch.int64),
                     sample_ids=torch.tensor(gs, dtype=torch.int64), floor=None)

    def describe(self) -> str:
        return (f"text shards {self.root} ({self.n_files} file(s), {len(self._maps)} shard(s), key {self.key[:12]}), "
                f"tokenizer {self.tokenizer.name} (vocab {self.vocab_size}), {self.n_tokens('train')} train / "
                f"{self.n_tokens('val')} val tokens (val = last {self.val_fraction:.0%}), seq_len {self.seq_len}, "
                f"random crops, seed {self.seed}; loss floor unknown.")
