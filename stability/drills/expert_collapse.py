"""expert_collapse: from step s every MoE router sends every token to experts {0, 1} only (its top-k
restricted to them; the gates still come from the router's scores): the load of every other expert is 0.
MoE models with top_k <= 2 only."""
from __future__ import annotations

import functools

import torch

from stability.drills.base import PERSISTENT, Drill

KEEP = 2  # experts 0..KEEP-1 keep the traffic


def _collapsed_top_ids(moe, scores_NE: torch.Tensor) -> torch.Tensor:
    """model/moe.py MoE.top_ids with every expert >= KEEP out of reach."""
    biased_NE = scores_NE.detach() + moe.bias_E
    biased_NE[:, KEEP:] = float("-inf")
    return torch.topk(biased_NE, moe.top_k, dim=-1).indices


class ExpertCollapse(Drill):
    kind = "expert_collapse"
    expects = "moe.load_collapse"
    lifetime = PERSISTENT
    points = ("before_forward",)

    def check(self) -> None:
        moes = self.ctx.model.moe_layers()
        if not moes:
            self.fail("needs an MoE model (e.g. model=moe_tiny or the mixed default); this one is dense")
        k = max(m.top_k for _, m in moes)
        if k > KEEP:
            self.fail(f"collapses onto {KEEP} experts, so it needs model.moe.top_k <= {KEEP}; got {k}")

    def before_forward(self, s) -> None:
        if not self.fired and self.persists(s.step, experts=list(range(KEEP))):
            self._collapse()

    def _collapse(self) -> None:
        # NOTE: on the instance: select() (anticipatory routing's route ids) and forward() both read it
        for _, moe in self.ctx.model.moe_layers():
            moe.top_ids = functools.partial(_collapsed_top_ids, moe)

    def load_state_dict(self, sd: dict) -> None:
        super().load_state_dict(sd)
        if self.fired:
            self._collapse()
