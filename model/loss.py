"""Token losses as *sums* and *counts*: the trainer divides once by the global valid-token count."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from model.rope import at_least_fp32

IGNORE_INDEX = -100


@dataclass
class ModelOutput:
    loss_sum: Tensor   # scalar fp32: Σ over valid labels of token cross-entropy, with grad
    z_sum: Tensor      # scalar fp32: Σ over valid labels of logsumexp(logits)², with grad
    aux_loss: Tensor   # scalar fp32: Σ over MoE layers of their aux contributions, with grad (0. dense)
    n_valid: Tensor    # scalar int64: number of valid labels
    loss_sum_B: Tensor  # (B,) detached per-sample CE sums
    n_valid_B: Tensor  # (B,) int64 per-sample valid counts
    logit_max: Tensor  # scalar detached: max |logit| over the batch
    moe_load: dict[int, Tensor] = field(default_factory=dict)  # layer -> load_E (detached)
    moe_aux: dict[int, Tensor] = field(default_factory=dict)   # layer -> detached [balance, router z]
    moe_out_sq: dict[int, Tensor] = field(default_factory=dict)  # layer -> MoEOutput.out_sq_E (detached)
    logits: Tensor | None = None  # (B, T, V), only when asked for (or labels is None)


@dataclass
class TokenLosses:
    loss_sum: Tensor
    z_sum: Tensor
    n_valid: Tensor
    loss_sum_B: Tensor
    n_valid_B: Tensor


def token_losses(logits_BTV: Tensor, labels_BT: Tensor) -> TokenLosses:
    """Cross-entropy and z-loss sums over labels != IGNORE_INDEX, from one logsumexp.

    ce = lse - logit[label], z = lse² (PaLM z-loss: pulls log Z toward 0 so logits cannot drift
    upward together, which softmax alone never penalises).
    """
    logits_BTV = logits_BTV.to(at_least_fp32(logits_BTV.dtype))
    valid_BT = labels_BT != IGNORE_INDEX
    lse_BT = torch.logsumexp(logits_BTV, dim=-1)
    safe_BT = torch.where(valid_BT, labels_BT, 0)
    at_label_BT = logits_BTV.gather(-1, safe_BT.unsqueeze(-1)).squeeze(-1)
    zero = lse_BT.new_zeros(())
    # NOTE: where, not multiply-by-mask: an inf at an ignored position must not turn into NaN.
    ce_BT = torch.where(valid_BT, lse_BT - at_label_BT, zero)
    z_BT = torch.where(valid_BT, lse_BT.square(), zero)
    n_valid_B = valid_BT.sum(-1)
    return TokenLosses(ce_BT.sum(), z_BT.sum(), n_valid_B.sum(), ce_BT.sum(-1).detach(), n_valid_B)
