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

Two halves, so that train.py reads these with the step's other numbers (parallel/host_scalars.py):
input_tensors() counts on the micro-batches' device and leaves every number there; input_fractions()
makes the dict above from the host's copy. input_stats() is both, reading at once.
"""
from __future__ import annotations

import torch

from data.batch import IGNORE_INDEX
from parallel.dist import all_reduce_sum
from parallel.host_scalars import HostScalars


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

    def foreign(self, tokens, valid) -> torch.Tensor:
        """Valid inputs outside their row's block, of one micro-batch: a 0-d count on tokens' device."""
        self.owner_V = self.owner_V.to(tokens.device)  # NOTE: moved once: the step's batches stay on one device
        own_BT = self.owner_V[tokens.clamp(0, len(self.owner_V) - 1)]
        return (valid & (own_BT != own_BT[:, :1])).sum()

    def compare(self, hist_V: torch.Tensor, seen_N: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """kl_running and rare_frac of a batch histogram against the baseline (0-d tensors, meaningful when
        both "n" and "seen" are > 0), then absorb it. `seen_N`: the ids with a count, if known."""
        self.hist_V = self.hist_V.to(hist_V.device)
        n, seen = hist_V.sum(), self.hist_V.sum()
        V = hist_V.numel()
        nz_N = (hist_V > 0).nonzero().squeeze(1) if seen_N is None else seen_N  # where p > 0 (when n > 0)
        p_N = hist_V[nz_N] / n
        q_N = (self.hist_V[nz_N] + 1.0) / (seen + V)
        out = {"n": n, "seen": seen, "kl_running": (p_N * (p_N / q_N).log()).sum()}
        # NOTE: a select, not a compaction: the counts are integers, summed exactly in any order
        rare = self.hist_V < seen / (100.0 * V)
        out["rare_frac"] = torch.where(rare, hist_V, 0.0).sum() / n
        self.hist_V += hist_V
        return out


def input_tensors(micro_batches, device, vocab_size: int, doc_start_ids: list[int] | None = None,
                  baseline: InputBaseline | None = None) -> dict[str, torch.Tensor]:
    """The fractions above over every micro-batch on every rank, as "inputs/<name>" 0-d tensors on `device`
    (one SUM all-reduce, nothing read), and the counts that decide which of them input_fractions keeps."""
    counts = torch.zeros(7 + vocab_size, dtype=torch.float64, device=device)  # 7 counters, then a histogram
    structured = baseline is not None and baseline.owner_V is not None
    for mb in micro_batches:
        tokens, labels = mb.tokens, mb.labels
        valid = labels != IGNORE_INDEX
        counts[0] += valid.sum()
        counts[1] += labels.numel()
        # labels[t] should be tokens[t+1] wherever both positions are real
        both = valid[:, :-1] & valid[:, 1:]
        counts[2] += ((labels[:, :-1] == tokens[:, 1:]) & both).sum()
        counts[3] += both.sum()
        # NOTE: a scatter of ones, not bincount(tokens[valid]): the same integer counts, without the two
        # data-dependent shapes that make a GPU wait
        keep = valid & (tokens < vocab_size)
        counts[7:].index_add_(0, tokens.clamp(max=vocab_size - 1).flatten(), keep.flatten().to(torch.float64))
        if doc_start_ids:
            starts = torch.zeros_like(valid[:, 0])
            for i in doc_start_ids:
                starts |= tokens[:, 0] == i
            counts[4] += starts.sum()
        counts[5] += tokens.shape[0]
        if structured:
            counts[6] += baseline.foreign(tokens, valid)
    counts = all_reduce_sum(counts)
    hist = counts[7:]
    total = hist.sum()
    out = {"counts": counts[:7], "total": total, "valid_frac": counts[0] / counts[1],
           "label_alignment": counts[2] / counts[3], "top_token_frac": hist.max() / hist.sum()}
    if doc_start_ids:
        out["doc_start_frac"] = counts[4] / counts[5]
    # NOTE: the one data-dependent shape of the step (a GPU waits for it, before the forward, with little
    # queued): the ids the batch holds, for the entropy and the KL, each summed over them as before
    seen_N = (hist > 0).nonzero().squeeze(1)
    p = hist[seen_N] / total
    out["entropy"] = -(p * p.log()).sum() if p.numel() > 1 else torch.zeros((), dtype=torch.float64, device=device)
    if structured:
        out["foreign_frac"] = counts[6] / counts[0]
    if baseline is not None:
        out.update(baseline.compare(hist, seen_N))
    return {f"inputs/{k}": v for k, v in out.items()}


def input_fractions(host) -> dict[str, float]:
    """The StepRecord's `inputs` from the host's copy of input_tensors() (a mapping name -> numbers); a ratio
    whose denominator is 0 takes its neutral value, a statistic without its data is left out."""
    def get(k):
        return host[f"inputs/{k}"] if f"inputs/{k}" in host else None

    c, total = get("counts"), get("total")
    out = {"valid_frac": get("valid_frac"), "label_alignment": get("label_alignment") if c[3] else 1.0,
           "top_token_frac": get("top_token_frac") if total else 0.0}
    if get("doc_start_frac") is not None:
        out["doc_start_frac"] = get("doc_start_frac")
    if total:
        out["entropy"] = get("entropy")
    if get("foreign_frac") is not None:
        out["foreign_frac"] = get("foreign_frac") if c[0] else 0.0
    if get("n") and get("seen"):
        out["kl_running"], out["rare_frac"] = get("kl_running"), get("rare_frac")
    return out


def input_stats(micro_batches, device, vocab_size: int, doc_start_ids: list[int] | None = None,
                baseline: InputBaseline | None = None) -> dict[str, float]:
    """input_tensors, read to the host at once (a caller outside train.py's step)."""
    host = HostScalars()
    host.put(**input_tensors(micro_batches, device, vocab_size, doc_start_ids, baseline))
    host.read()
    return input_fractions(host)
