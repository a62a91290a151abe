"""Real text through HuggingFace `datasets`: local text/json/parquet files, or hub names when online.

Documents are joined into one text; the validation split is its tail `val_fraction`; the tokenizer is
trained (if it trains) on the head only. Sample g of a split is a random crop (nanoGPT style) at an
offset drawn by the sample's own rng: inputs = w[:-1], labels = w[1:], every label valid.
"""
from __future__ import annotations

import hashlib
import math
import re
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from data.batch import Batch
from data.ids import fingerprint_of, sample_rngs, split_code
from data.tokenizers import UnknownChar, build_tokenizer

FORMATS = ("text", "json", "parquet")
_EXT_FORMAT = {".txt": "text", ".text": "text", ".md": "text", ".json": "json", ".jsonl": "json",
               ".ndjson": "json", ".parquet": "parquet"}
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# NOTE: no EOS id (the byte tokenizer has no spare id); a newline marks document boundaries.
DOC_SEPARATOR = "\n"


def load_text(path: str, fmt: str | None = None, text_field: str = "text") -> str:
    """All documents of `path` joined into one string. Sets no global state: offline behaviour comes
    from the caller's HF_DATASETS_OFFLINE / HF_HUB_OFFLINE."""
    import datasets

    # fmt: None (by extension) or one of FORMATS, checked by the schema (data/config.py)
    p = Path(path).expanduser()
    if p.is_dir():
        raise ValueError(f"data.path={path}: is a directory; pass a file")
    if p.is_file():
        fmt = fmt or _EXT_FORMAT.get(p.suffix.lower())
        if fmt is None:
            raise ValueError(f"data.path={path}: unknown extension {p.suffix!r}; set data.format to one of "
                             f"{', '.join(FORMATS)}")
        if fmt == "text":
            _check_utf8(p, path)
        # A .txt file is one document (one stream), not one document per line.
        extra = {"sample_by": "document"} if fmt == "text" else {}
        bars = datasets.utils.logging.is_progress_bar_enabled()
        if fmt == "text":  # NOTE: its "Generating train split" bar counts one document: a line of noise
            datasets.disable_progress_bars()
        try:
            ds = datasets.load_dataset(fmt, data_files=str(p), split="train", **extra)
        finally:
            if bars:
                datasets.enable_progress_bars()
    elif _HUB_NAME.match(path) and p.suffix.lower() not in _EXT_FORMAT:
        try:
            ds = datasets.load_dataset(path, split="train")
        except ConnectionError:  # includes huggingface_hub's OfflineModeIsEnabled
            raise ValueError(f"data.path={path}: cannot reach the Hugging Face hub (offline); "
                             "pass a local file") from None
        except datasets.exceptions.DatasetNotFoundError:
            raise ValueError(f"data.path={path}: no such dataset on the Hugging Face hub") from None
    else:
        raise ValueError(f"data.path={path}: file not found")
    if text_field not in ds.column_names:
        raise ValueError(f"data.text_field={text_field}: not a column of {path} (columns: {ds.column_names})")
    text = DOC_SEPARATOR.join(str(t) for t in ds[text_field] if t is not None)
    if not text:
        raise ValueError(f"data.path={path}: holds no text")
    return text


def _check_utf8(p: Path, path: str) -> None:
    """A text file must be UTF-8 (every tokenizer here reads Unicode text; the byte tokenizer encodes it
    back to UTF-8 bytes). Checked here so the user gets the byte offset, not a datasets traceback."""
    raw = p.read_bytes()
    if not raw:
        raise ValueError(f"data.path={path}: the file is empty")
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"data.path={path}: not UTF-8 text: byte {raw[e.start]:#04x} at byte offset {e.start} "
                         f"({e.reason}); convert it, e.g. iconv -f latin1 -t utf-8") from None


def too_small(path: str, text: str, cut: int, split: str, tokens: int, seq_len: int, val_fraction: float) -> str:
    """The one line for a split shorter than one sample, with the sizes and what to change."""
    chars = cut if split == "train" else len(text) - cut
    per_token = max(chars, 1) / max(tokens, 1)  # this tokenizer's characters per token on this file
    need = math.ceil((seq_len + 1) * per_token / min(val_fraction, 1.0 - val_fraction))  # both splits hold one
    which = (f"the training split (the first {1 - val_fraction:.0%}" if split == "train" else
             f"the validation split (the last {val_fraction:.0%}")
    return (f"data.path={path} is too small for one sample: {which} of its {len(text)} characters) holds "
            f"{tokens} tokens, and a sample needs data.seq_len + 1 = {seq_len + 1}; use a file of at least about "
            f"{need} characters, or a smaller data.seq_len")


def unseen_char(path: str, text: str, cut: int, e: UnknownChar) -> str:
    """The one line for a validation character the char vocabulary (the training text's) lacks: which, where,
    and the fix."""
    at = cut + e.index
    line = text.count("\n", 0, at) + 1
    return (f"data.path={path}: data.tokenizer=char builds its vocabulary from the training text (the first "
            f"{cut} of {len(text)} characters), which lacks {e.char!r} (U+{ord(e.char):04X}) found at character {at} "
            f"(line {line}) in the validation text; use data.tokenizer=byte (it encodes any text), or a larger file "
            f"whose training part holds every character")


class TextDataset:
    source_names = ["text"]

    def __init__(self, path: str, seq_len: int, seed: int, tokenizer: str = "byte",
                 vocab_size: int | None = None, val_fraction: float = 0.1, format: str | None = None,
                 text_field: str = "text"):
        self.path, self.seq_len, self.seed, self.val_fraction = path, seq_len, seed, val_fraction
        text = load_text(path, format, text_field)
        self.n_chars = len(text)
        self.content_sha256 = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
        cut = int(round(len(text) * (1.0 - val_fraction)))
        splits = {"train": text[:cut], "val": text[cut:]}
        self.tokenizer = build_tokenizer(tokenizer, splits["train"], vocab_size)
        self.vocab_size = self.tokenizer.vocab_size
        dtype = np.int32 if self.vocab_size < 2**31 else np.int64
        self._streams = {}
        for split, part in splits.items():  # sizes first: a file too small is the problem to name, whatever else
            try:
                self._streams[split] = self.tokenizer.encode(part).astype(dtype)
            except UnknownChar as e:
                raise ValueError(unseen_char(path, text, cut, e)) from None
            if len(self._streams[split]) < seq_len + 1:
                raise ValueError(too_small(path, text, cut, split, len(self._streams[split]), seq_len, val_fraction))
        self._manifest = {"kind": "text", "version": 1, "content_sha256": self.content_sha256,
                          "seq_len": seq_len, "seed": seed, "val_fraction": val_fraction,
                          "tokenizer": self.tokenizer.state()}
        self.fingerprint = fingerprint_of(self._manifest)

    def n_tokens(self, split: str) -> int:
        return len(self._streams[split])

    def samples(self, ids: Sequence[int], split: str = "train") -> Batch:
        T = self.seq_len
        split_code(split)  # raises on an unknown split
        stream = self._streams[split]
        gs, offsets = [], []
        for g, rng in sample_rngs(self.seed, split, ids):
            gs.append(g)
            offsets.append(rng.integers(0, len(stream) - T))  # window [off, off + T] stays inside the split
        idx_BT1 = np.asarray(offsets, dtype=np.int64).reshape(-1, 1) + np.arange(T + 1)
        w_BT1 = torch.from_numpy(stream[idx_BT1].astype(np.int64))
        return Batch(tokens=w_BT1[:, :-1].contiguous(), labels=w_BT1[:, 1:].contiguous(),
                     sources=torch.zeros(len(gs), dtype=torch.int64),
                     sample_ids=torch.tensor(gs, dtype=torch.int64), floor=None)

    def describe(self) -> str:
        return (f"text from {self.path} ({self.n_chars} chars, sha256 {self.content_sha256[:12]}), tokenizer "
                f"{self.tokenizer.name} (vocab {self.vocab_size}), {self.n_tokens('train')} train / "
                f"{self.n_tokens('val')} val tokens (val = last {self.val_fraction:.0%} of the text), "
                f"seq_len {self.seq_len}, random crops, seed {self.seed}; loss floor unknown.")
