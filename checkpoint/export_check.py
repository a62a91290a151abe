"""The export's proof (checkpoint/export_hf.py): the checkpoint it staged, loaded back through transformers as
a user will load it, must give ballast's logits on a probe batch, or the export refuses and writes nothing.

It checks the result, not the exporter's list of options: a model option that OPTIONS does not know (a new
config flag, a block variant) changes ballast's logits and not transformers', and fails here.

    probe        PROBE_BATCH sequences of model.seq_len random ids (seeded): every RoPE position is used
    loading      no weight transformers expects may be missing (it would initialise it at random, with a
                 warning only) and none written may go unread
    tolerance    from the dtype and the depth, never from a calibration run (tolerance below)
    MoE ties     a token whose k-th and (k+1)-th expert scores are closer than rounding can separate may be
                 routed differently by two correct implementations; attention is causal, so only the
                 positions before a sequence's first such token are compared (none: the export refuses)
"""
from __future__ import annotations

import contextlib
import copy
import math
from pathlib import Path

import torch

PROBE_BATCH, PROBE_SEED = 2, 0
# NOTE: the roundings one sublayer chains: its RMSNorm and at most three products (attention: q·k, the
# weights·v, the output projection; MLP: gate/up, down, an MoE gate weight). A count, not a fit.
PRODUCTS = 4


def tolerance(cfg, dtype: torch.dtype = torch.float32) -> float:
    """The largest relative difference of the logits (to their largest magnitude) that rounding alone gives
    two correct implementations of the same model in `dtype`.

    An inner product of length n that two implementations sum in different orders differs by about √n·u
    (u the unit roundoff; the probabilistic bound of Higham & Mary 2019, where n·u is the worst case); each
    of the 2·n_layers sublayers and the head adds PRODUCTS such roundings to the residual stream, relative to
    its scale, and the errors add. n is the model's longest inner product."""
    u = torch.finfo(dtype).eps / 2
    widths = [cfg.d_model, cfg.ffn_hidden, cfg.seq_len, *([cfg.moe.expert_hidden] if cfg.moe is not None else [])]
    return PRODUCTS * (2 * cfg.n_layers + 1) * math.sqrt(max(widths)) * u


def probe(cfg) -> torch.Tensor:
    """(PROBE_BATCH, seq_len) int64 ids, the same for every export of a model of this shape."""
    gen = torch.Generator().manual_seed(PROBE_SEED)
    return torch.randint(0, cfg.vocab_size, (PROBE_BATCH, cfg.seq_len), generator=gen)


def verify(model, staged: Path) -> str | None:
    """Load `staged` (config.json, model.safetensors) through transformers and compare its logits with
    `model`'s on the probe. None when they agree; else one line naming the largest difference."""
    import transformers

    cfg = model.cfg
    p = next(model.parameters())
    # the export writes FP32 weights: the reference is ballast in FP32 on the CPU, the same numbers
    ref = model if (p.dtype, p.device.type) == (torch.float32, "cpu") else copy.deepcopy(model).float().cpu()
    try:
        with _quiet(transformers):  # what it would say is said below, in one line
            # NOTE: mismatched sizes reported (below, by name), not raised with a pointer to a report
            hf, info = transformers.AutoModelForCausalLM.from_pretrained(staged, output_loading_info=True,
                                                                         ignore_mismatched_sizes=True)
    except (OSError, ValueError, RuntimeError, KeyError) as e:  # a config it cannot read, a shape it cannot load
        first = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
        return f"transformers cannot load the conversion: {first}"
    for what, keys in (("lacks", info.get("missing_keys")), ("holds unread", info.get("unexpected_keys")),
                       ("holds a wrong shape of", info.get("mismatched_keys"))):
        if keys:
            name = sorted(keys)[0]  # mismatched: (name, shapes...) tuples
            name = name[0] if isinstance(name, tuple) else name
            return f"the converted checkpoint {what} {name} ({type(hf).__name__})"
    tokens_BT = probe(cfg)
    was_training = ref.training
    ref.eval()
    try:
        with torch.no_grad():
            ours_BTV, ties_BT = _logits_and_ties(ref, tokens_BT, tolerance(cfg))
            theirs_BTV = hf.float().eval()(tokens_BT).logits.float()
    finally:
        ref.train(was_training)
    # compare each sequence up to its first ambiguous route (causal: the positions before it never see it)
    T = tokens_BT.shape[1]
    first_B = torch.where(ties_BT.any(1), ties_BT.int().argmax(1), T)
    keep_BT = torch.arange(T)[None, :] < first_B[:, None]
    if not keep_BT.any():
        return ("cannot verify the conversion: every probe sequence routes its first token on a tie of expert "
                "scores that FP32 rounding cannot separate")
    if not torch.isfinite(ours_BTV[keep_BT]).all():
        return "ballast's own logits on the probe are not finite: nothing to compare the conversion with"
    diff_BT = torch.where(keep_BT, (theirs_BTV - ours_BTV).abs().nan_to_num(nan=math.inf).amax(-1), 0.0)
    worst, allowed = float(diff_BT.max()), tolerance(cfg) * float(ours_BTV[keep_BT].abs().max())
    if worst > allowed:
        b, t = divmod(int(diff_BT.flatten().argmax()), T)
        return (f"{type(hf).__name__}'s logits differ from ballast's by up to {worst:.3g} (probe sequence {b}, "
                f"position {t}), beyond the {allowed:.2g} FP32 rounding allows through {cfg.n_layers} layers: the "
                "conversion misses something this model computes (a model option checkpoint/export_hf.py "
                "does not map?)")
    return None


@contextlib.contextmanager
def _quiet(transformers):
    """transformers' progress bar and load report off for the duration (restored after)."""
    log = transformers.utils.logging
    verbosity, bar = log.get_verbosity(), log.is_progress_bar_enabled()
    log.set_verbosity_error()
    log.disable_progress_bar()
    try:
        yield
    finally:
        log.set_verbosity(verbosity)
        if bar:
            log.enable_progress_bar()


def _logits_and_ties(model, tokens_BT: torch.Tensor, rel: float) -> tuple[torch.Tensor, torch.Tensor]:
    """ballast's logits (B, T, V) in FP32, and (B, T) bool: the positions some MoE layer routes on a
    near-tie, a gap between its k-th and (k+1)-th selection score (bias included) that a relative error
    `rel` of the router logits could close."""
    B, T = tokens_BT.shape
    ties_BT = torch.zeros(B, T, dtype=torch.bool)

    def see(moe, args):
        nonlocal ties_BT
        if moe.top_k >= moe.n_experts:  # every expert chosen: no selection to flip
            return
        logits_NE = moe.router_logits(args[0].reshape(-1, args[0].shape[-1]))
        scores_NE = moe.scores(logits_NE)
        sel_Nk1, ids_Nk1 = torch.topk(scores_NE + moe.bias_E, moe.top_k + 1, dim=-1)
        # a logit off by δ moves a softmax or sigmoid score s by at most 2·s·δ: the k-th and (k+1)-th
        # selections may swap when their gap is within 2·(s_k + s_k+1)·δ, δ = rel × the logits' scale
        s_N2 = scores_NE.gather(-1, ids_Nk1[:, -2:])
        delta = rel * float(logits_NE.abs().max())
        ties_BT = ties_BT | (sel_Nk1[:, -2] - sel_Nk1[:, -1] <= 2 * s_N2.sum(-1) * delta).reshape(B, T).cpu()

    hooks = [moe.register_forward_pre_hook(see) for _, moe in model.moe_layers()]
    try:
        logits_BTV = model(tokens_BT).logits.float()
    finally:
        for h in hooks:
            h.remove()
    return logits_BTV, ties_BT
