"""Input-layer telemetry: what the batch itself looked like, before any forward (docs/course.md §1:
the first layer of the timeline — data switches, corrupted text, label misalignment, overlong
sequences — is where many "loss spikes" start).

Exact, cheap counts over the global batch (one small SUM all-reduce):
    valid_frac       valid label positions / all positions       (padding vanished: overlong documents)
    label_alignment  labels[t] == tokens[t+1] where both are real (next-token data agrees with itself:
                     1.0 unless labels were shifted or shuffled)
    top_token_frac   share of valid inputs taken by the single most frequent token id (repeated text)
    doc_start_frac   samples whose first input is a document start, i.e. not padding-free noise; the
                     caller passes the ids that start documents (the synthetic sources' BOS ids)
"""
from __future__ import annotations

import torch

from data.batch import IGNORE_INDEX
from parallel.dist import all_reduce_sum


def input_stats(micro_batches, device, vocab_size: int, doc_start_ids: list[int] | None = None) -> dict[str, float]:
    """The four fractions above over every micro-batch on every rank."""
    counts = torch.zeros(7 + vocab_size, dtype=torch.float64)  # 7 counters, then a token histogram
    for mb in micro_batches:
        tokens, labels = mb.tokens.cpu(), mb.labels.cpu()
        valid = labels != IGNORE_INDEX
        counts[0] += valid.sum()
        counts[1] += labels.numel()
        # labels[t] should be tokens[t+1] wherever both positions are real
        both = valid[:, :-1] & valid[:, 1:]
        counts[2] += (labels[:, :-1] == tokens[:, 1:])[both].sum()
        counts[3] += both.sum()
        counts[7:] += torch.bincount(tokens[valid], minlength=vocab_size)[:vocab_size].double()
        if doc_start_ids:
            counts[4] += torch.isin(tokens[:, 0], torch.tensor(doc_start_ids)).sum()
        counts[5] += tokens.shape[0]
    counts = all_reduce_sum(counts.to(device)).cpu()
    hist = counts[7:]
    out = {"valid_frac": (counts[0] / counts[1]).item(),
           "label_alignment": (counts[2] / counts[3]).item() if counts[3] else 1.0,
           "top_token_frac": (hist.max() / hist.sum()).item() if hist.sum() else 0.0}
    if doc_start_ids:
        out["doc_start_frac"] = (counts[4] / counts[5]).item()
    return out
