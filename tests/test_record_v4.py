"""The per-rank content hash of StepRecord.ranks (data/batch.py content_hash) against the formula it had
before it moved out of stability/step_state.py: the hashes of records already written stay comparable."""
from __future__ import annotations

import pytest
import torch

from data.batch import content_hash

pytestmark = pytest.mark.usefixtures("one_thread")


def old_hash(tokens: torch.Tensor) -> int:
    """stability/step_state.py rank_inputs' hash as it was written there (record versions 2 and 3)."""
    tok = tokens.cpu().long().flatten()
    w = torch.arange(1, tok.numel() + 1, dtype=torch.int64) * 2 + 1
    return int(((tok + 1) * w % 2_147_483_629).sum() % 2_147_483_629)


# ---------------------------------------------------------------- content hash


def test_content_hash_is_the_formula_the_records_used():
    assert content_hash(torch.arange(12).view(3, 4)) == 1378  # Σ_j j·(2j + 1), j = 1..12: 2·650 + 78
    g = torch.Generator().manual_seed(0)
    for shape, vocab in (((8, 16), 40), ((3, 257), 50_000), ((1, 1), 2), ((0, 16), 5)):
        tok = torch.randint(0, vocab, shape, generator=g)
        assert content_hash(tok) == old_hash(tok), shape
    tok = torch.randint(0, 40, (4, 16), generator=g)
    assert content_hash(tok.int()) == old_hash(tok)  # the dtype does not enter
    swapped = tok.clone()
    swapped[0, :2] = tok[0, :2].flip(0)
    assert tok[0, 0] == tok[0, 1] or content_hash(swapped) != content_hash(tok)  # positions count
