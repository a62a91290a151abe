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
    entropy          unigram entropy of the batch's valid inputs, nats (noise raises it, repetition
                     lowers it: the doctor reads it two-sided)
    kl_running       KL(batch unigram ‖ running unigram of every earlier batch), nats; the running
                     histogram is add-one smoothed so an unseen token costs log(N + V), not inf
    rare_frac        share of valid inputs whose id held < 1/(100 V) of the running histogram (ids the
                     run has almost never seen: out-of-distribution / out-of-vocabulary text)

The last two need the run's history: pass an InputBaseline (one per run, rank-identical since it is
fed the all-reduced histogram). It is NOT restored by a rollback or resume: a baseline of what the run
has read, which a replayed batch only sharpens.
"""
from __future__ import annotations

import torch

from data.batch import IGNORE_INDEX
from parallel.dist import all_reduce_sum


class InputBaseline:
    """The running unigram histogram of every batch the run has read (float64 counts, V entries), and
    the owner block of every id when the dataset has them (dataset.token_ranges())."""
    # the statistics read against that histogram: a process starts it empty (it is not in a checkpoint), so
    # a resumed run's values of these differ from a straight run's (the doctor waits HIST_WARM steps)
    RUNNING = ("kl_running", "rare_frac")

    def __init__(self, dataset):
        V = dataset.vocab_size
        self.hist_V = torch.zeros(V, dtype=torch.float64)
        self.owner_V = None
        ranges = dataset.token_ranges() if hasattr(dataset, "token_ranges") else None
        if ranges:
            self.owner_V = torch.full((V,), -1, dtype=torch.int64)
            for k, r in enumerate(ranges):
                self.owner_V[r.start:r.stop] = k

    def foreign(self, tokens, valid) -> tuple[float, float]:
        """(valid inputs outside their row's block, valid inputs) of one micro-batch."""
        own_BT = self.owner_V[tokens.clamp(0, len(self.owner_V) - 1)]
        bad = valid & (own_BT != own_BT[:, :1])
        return float(bad.sum()), float(valid.sum())

    def compare(self, hist_V: torch.Tensor) -> dict[str, float]:
        """kl_running and rare_frac of a batch histogram against the baseline, then absorb it."""
        out = {}
        n, seen = hist_V.sum().item(), self.hist_V.sum().item()
        if n and seen:
            V = hist_V.numel()
            p_V = hist_V / n
            q_V = (self.hist_V + 1.0) / (seen + V)
            nz = p_V > 0
            out["kl_running"] = (p_V[nz] * (p_V[nz] / q_V[nz]).log()).sum().item()
            rare = self.hist_V < seen / (100.0 * V)
            out["rare_frac"] = (hist_V[rare].sum() / n).item()
        self.hist_V += hist_V
        return out


def input_stats(micro_batches, device, vocab_size: int, doc_start_ids: list[int] | None = None,
                baseline: InputBaseline | None = None) -> dict[str, float]:
    """The fractions above over every micro-batch on every rank."""
    counts = torch.zeros(7 + vocab_size, dtype=torch.float64)  # 7 counters, then a token histogram
    structured = baseline is not None and baseline.owner_V is not None
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
        if structured:
            counts[6] += baseline.foreign(tokens, valid)[0]
    counts = all_reduce_sum(counts.to(device)).cpu()
    hist = counts[7:]
    total = hist.sum().item()
    out = {"valid_frac": (counts[0] / counts[1]).item(),
           "label_alignment": (counts[2] / counts[3]).item() if counts[3] else 1.0,
           "top_token_frac": (hist.max() / hist.sum()).item() if total else 0.0}
    if doc_start_ids:
        out["doc_start_frac"] = (counts[4] / counts[5]).item()
    if total:
        p = hist[hist > 0] / total
        out["entropy"] = -(p * p.log()).sum().item() if p.numel() > 1 else 0.0
    if structured:
        out["foreign_frac"] = (counts[6] / counts[0]).item() if counts[0] else 0.0
    if baseline is not None:
        out.update(baseline.compare(hist))
    return out
