"""The data classes: the batch, the cursor, the mixture, one rank's inputs (and their fixes)."""
from __future__ import annotations

from doctor.classes import batch_ids, declare_class


def _corrupted_batch(diag, run, ckpt, t, b, action, ck) -> dict:
    ids = batch_ids(b)
    return {"variable": f"the batch of step {t} ({ids})",
            "change": f"quarantine it (the loader never serves it), then repair the data stage that produced it (the "
                      f"replay rebuilds {ids} from their ids: compare its input stats with the logged ones)",
            "override": f"train.skip_batches=[{b['first']}]",
            "expect": f"no second spike when the run reaches {ids} again; loss by source back on its trajectory"}


def _distribution_shift(diag, run, ckpt, t, b, action, ck) -> dict:
    src = diag.source
    return {"variable": f"the data of source {src} from step {t}",
            "change": f"compare {src}'s documents before and after step {t} (generator / shard / preprocessing "
                      "version); restore the old ones or declare the change (a new data fingerprint)",
            "override": None, "expect": f"the loss of source {src} back on its trajectory"}


def _continuity(diag, run, ckpt, t, b, action, ck) -> dict:
    return {"variable": "the data cursor (sample ids per step)",
            "change": f"find what moved the loader's samples_consumed at step {t} (a repeated, skipped or "
                      "reset window); every id must be read once, in order", "override": None,
            "expect": f"batch.first of step {t} = batch.first + size of step {t - 1}"}


def _repeated_batch(diag, run, ckpt, t, b, action, ck) -> dict:
    return {"variable": f"the data path after the loader from step {t} (it serves content already read)",
            "change": f"rebuild the batch of step {t} from its sample ids (python -m doctor.replay) and diff it with the "
                      "content the run trained on; find the cache, buffer or worker that returns a stale batch",
            "override": None, "expect": "every step's content hash new; train and eval loss falling together"}


def _mixture(diag, run, ckpt, t, b, action, ck) -> dict:
    return {"variable": "the data mixture weights (data.sources[*].weight)",
            "change": "an objective change, not an optimisation fault: restore the old weights if the switch was "
                      "unintended, else re-baseline the guard and compare per-source losses with their floors",
            "override": None,
            "expect": "per-source losses on their trajectories; total loss at the new mixture floor"}


def _slow_worsening(diag, run, ckpt, t, b, action, ck) -> dict:
    return {"variable": "the data mixture / duplication / mask of the recent data",
            "change": f"compare the recent batches' sources, duplicates and masks with the early ones; change only "
                      f"that and rerun from {ck}", "override": None,
            "expect": "the loss of the last third at or below the first third's"}


def _rank_data(diag, run, ckpt, t, b, action, ck) -> dict:
    return {"variable": f"the inputs of rank {diag.rank}",
            "change": f"compare rank {diag.rank}'s sample ids and local loss at step {t} with the sharding "
                      "(rank r reads ids [first + r·b, first + (r+1)·b)); fix its sampler / data path",
            "override": None, "expect": "per-rank first ids on the sharding; per-rank losses within their spread"}


declare_class("data.corrupted_batch", "the batch deviated before any forward (noise, repetition, misaligned labels)",
              _corrupted_batch)
declare_class("data.distribution_shift", "one source's content changed under the same data fingerprint",
              _distribution_shift)
declare_class("data.continuity", "the data cursor broke its order (ids repeated, skipped or reset)", _continuity)
declare_class("data.repeated_batch", "the batch content repeats while the sample ids advance", _repeated_batch)
declare_class("data.switch", "the data mixture switched and a source's loss rose above its trajectory", _mixture)
declare_class("data.slow_worsening", "the loss worsens slowly with a flat gradient norm", _slow_worsening,
              ("slow worsening with a flat grad norm (loss 缓慢恶化且 norm 平稳)",
               "data mixture, duplication rate, labels or mask", "numerical overflow"))
declare_class("objective.mixture", "the data mixture switched; each source stayed on its trajectory", _mixture)
declare_class("rank.data", "one rank's inputs left the sharding or the content its ids name", _rank_data)
