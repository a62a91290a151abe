"""Is each rank's batch the content its sample ids name? An exact invariant, from the records alone.

Samples are pure functions of their id (data/loader.py), and every record carries, per rank, the first id,
the count and a content hash of the tokens that rank trained on (stability/resume_fields.py rank_inputs,
data/batch.py content_hash). The doctor rebuilds the run's data from config.yaml, hashes the samples the
ids name, and compares: a rank that trained on other content than its ids — a data path that swaps,
corrupts or repeats what the loader served — is found at its step, with its rank.

Checked only where the rebuilt data is the run's (the record's data fingerprint equals the rebuilt
dataset's: after a mixture switch the loader serves another dataset), and on at most MAX_BATCHES batches
(evenly spread over a longer run, which the report's notes then say).
"""
from __future__ import annotations

import math

from doctor.timeline import INPUT, Deviation, Run

MAX_BATCHES = 2000  # rebuilt batches per run (a 16 × 128 synthetic batch costs a few ms)
ORDER = 10_000      # after every input statistic of the same step in the timeline's order


def content_check(run: Run) -> tuple[list[tuple[int, Deviation]], str | None]:
    """[(record index, Deviation)] where a rank's recorded hash differs from its ids' content, and a note
    (None when every record was checked or none could be)."""
    recs = [(i, r) for i, r in enumerate(run.records) if (r.get("ranks") or {}).get("hash")]
    data_cfg = (run.config or {}).get("data")
    if not recs or not data_cfg:
        return [], None
    try:
        from data import DataConfig, build_data
        from data.batch import content_hash
        from data.config import read_keys
        ds = build_data(DataConfig.from_dict(read_keys(data_cfg)))
    except Exception as e:  # NOTE: data the doctor's machine cannot build (a missing file): not checked
        return [], f"batch content not checked against the sample ids: the data cannot be rebuilt here ({type(e).__name__})"
    fp = ds.fingerprint[:12]
    recs = [(i, r) for i, r in recs if (r.get("fingerprint") or {}).get("data", fp) == fp]
    stride = max(1, math.ceil(len(recs) / MAX_BATCHES))
    out = []
    for i, r in recs[::stride]:
        rk = r["ranks"]
        world = len(rk["hash"])
        off = [k for k in range(world) if rk["n"][k] > 0 and rk["first"][k] >= 0 and rk["hash"][k] != content_hash(
            ds.samples(range(rk["first"][k], rk["first"][k] + rk["n"][k]), "train").tokens)]
        if off:
            # NOTE: some ranks apart from the others: those ranks' data; every rank: the batch itself. Ordered after
            # the input statistics of the same step (ORDER), which say what the content became
            one = world > 1 and len(off) < world
            out.append((i, Deviation("ranks.content" if one else "input.content", INPUT, ORDER, r["step"],
                                     float(rk["hash"][off[0]]), None, math.inf, f"rank {off[0]}" if one else None,
                                     "invariant", "rank.data" if one else "data.corrupted_batch")))
    note = (f"batch content checked against the sample ids on every {stride}th step ({len(recs[::stride])} of "
            f"{len(recs)})" if stride > 1 else None)
    return out, note
