"""Tokenizers for real text. Interface: encode(str) -> np.ndarray[int64], decode(ids) -> str,
vocab_size, name, state() (what goes into the data fingerprint)."""
from __future__ import annotations

import hashlib

import numpy as np

# NOTE: encoding large texts in newline-aligned chunks keeps memory flat and, for BPE, lets the
# library parallelise; every chunk round-trips on its own, so the concatenation does too.
_CHUNK_CHARS = 1 << 16


def _chunks(text: str) -> list[str]:
    out, start = [], 0
    while start < len(text):
        end = text.find("\n", start + _CHUNK_CHARS)
        end = len(text) if end < 0 else end + 1
        out.append(text[start:end])
        start = end
    return out


class ByteTokenizer:
    """UTF-8 bytes: no training, no unknowns, vocab 256."""

    name = "byte"
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids) -> str:
        # A random crop can cut a multi-byte character; show it rather than fail.
        return bytes(np.asarray(ids, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")

    def state(self) -> dict:
        return {"name": self.name}


class UnknownChar(ValueError):
    """A character the char vocabulary (built on the training text) does not hold; `index`: its position."""

    def __init__(self, char: str, index: int):
        super().__init__(f"data.tokenizer=char: character {char!r} (U+{ord(char):04X}) is not in the training text")
        self.char, self.index = char, index


class CharTokenizer:
    """One id per distinct character of the training text, in code-point order."""

    name = "char"

    def __init__(self, train_text: str):
        if not train_text:
            raise ValueError("data.tokenizer=char: the training text is empty")
        self._codes = np.unique(_codepoints(train_text))  # sorted
        self.vocab_size = len(self._codes)

    def encode(self, text: str) -> np.ndarray:
        codes = _codepoints(text)
        ids = np.minimum(np.searchsorted(self._codes, codes), self.vocab_size - 1)
        bad = np.flatnonzero(self._codes[ids] != codes)
        if bad.size:
            raise UnknownChar(chr(codes[bad[0]]), int(bad[0]))
        return ids.astype(np.int64)

    def decode(self, ids) -> str:
        return "".join(map(chr, self._codes[np.asarray(ids, dtype=np.int64)].tolist()))

    def state(self) -> dict:
        chars = "".join(map(chr, self._codes.tolist()))
        return {"name": self.name, "chars_sha256": hashlib.sha256(chars.encode("utf-8", "surrogatepass")).hexdigest()}


def _codepoints(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32).astype(np.int64)


class BPETokenizer:
    """Byte-level BPE trained locally on the training text with the `tokenizers` library.

    Byte-level pre-tokenisation means every string encodes (no unknowns) and decodes exactly.
    Training is deterministic for a given text and vocab size (checked across processes).
    """

    name = "bpe"

    def __init__(self, train_text: str | None, vocab_size: int, iterator=None):
        """iterator: batches of documents to train on instead of train_text (a corpus too big for one string)."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        alphabet = pre_tokenizers.ByteLevel.alphabet()
        if vocab_size < len(alphabet):
            raise ValueError(f"data.bpe_vocab_size={vocab_size}: BPE needs at least {len(alphabet)} "
                             "(the byte alphabet)")
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=alphabet,
                                      special_tokens=[], show_progress=False)
        tok.train_from_iterator(_chunks(train_text) if iterator is None else iterator, trainer)
        self._set(tok)
        self.requested_vocab_size = vocab_size

    def _set(self, tok) -> None:
        self._tok = tok
        # NOTE: a small text runs out of merges before the requested size; the real size is what counts.
        self.vocab_size = tok.get_vocab_size()

    @classmethod
    def from_json(cls, blob: str) -> "BPETokenizer":
        """A trained tokenizer back from Tokenizer.to_str() (the shard cache stores it)."""
        from tokenizers import Tokenizer

        self = cls.__new__(cls)
        self._set(Tokenizer.from_str(blob))
        self.requested_vocab_size = self.vocab_size
        return self

    def encode(self, text: str) -> np.ndarray:
        encs = self._tok.encode_batch(_chunks(text))
        parts = [np.asarray(e.ids, dtype=np.int64) for e in encs]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def decode(self, ids) -> str:
        return self._tok.decode(np.asarray(ids, dtype=np.int64).tolist())

    def state(self) -> dict:
        return {"name": self.name, "vocab_size": self.vocab_size,
                "sha256": hashlib.sha256(self._tok.to_str().encode()).hexdigest()}


def build_tokenizer(name: str, train_text: str, vocab_size: int | None = None):
    if name == "byte":
        return ByteTokenizer()
    if name == "char":
        return CharTokenizer(train_text)
    if name == "bpe":
        if vocab_size is None:
            raise ValueError("data.bpe_vocab_size: missing (required by data.tokenizer=bpe)")
        return BPETokenizer(train_text, vocab_size)
    raise ValueError(f"data.tokenizer={name}: expected one of byte, char, bpe")
