"""dead_expert: from step s one expert's output is multiplied by 0 in every MoE layer (or in
model.blocks[layer] only), its routing unchanged: tokens still go to it and get nothing back, and its
weights get no gradient."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from run.config_errors import check
from stability.drills.base import PERSISTENT, Drill


@dataclass
class Config:
    expert: int = 0           # the expert that goes dead
    layer: int | None = None  # model.blocks[layer] (an MoE layer); null = every MoE layer

    def __post_init__(self) -> None:
        check(self.expert >= 0, "expert", self.expert, "must be >= 0")
        check(self.layer is None or self.layer >= 0, "layer", self.layer, "must be >= 0 or null")


class DeadExpert(Drill):
    kind = "dead_expert"
    expects = "moe.dead_expert"
    lifetime = PERSISTENT
    points = ("before_forward",)
    Config = Config

    def check(self) -> None:
        moes = dict(self.ctx.model.moe_layers())
        if not moes:
            self.fail("needs an MoE model (e.g. model=moe_tiny or the mixed default); this one is dense")
        c = self.cfg
        if c.layer is not None and c.layer not in moes:
            raise ValueError(f"{self.key('layer')}={c.layer}: not an MoE layer (MoE layers: {sorted(moes)})")
        n = min(m.n_experts for m in moes.values())
        if c.expert >= n:
            raise ValueError(f"{self.key('expert')}={c.expert}: must be < model.moe.n_experts={n}")
        self._layers = {i: m for i, m in sorted(moes.items()) if c.layer is None or i == c.layer}

    def before_forward(self, s) -> None:
        if not self.fired and self.persists(s.step, expert=self.cfg.expert, layers=list(self._layers)):
            self._kill()

    def _kill(self) -> None:
        for moe in self._layers.values():
            moe.experts.register_forward_hook(self._hook)

    def _hook(self, module, args, out_MD: torch.Tensor) -> torch.Tensor:
        """GroupedExperts returns its rows sorted by expert: expert e's are counts[:e].sum() onwards."""
        counts_E = torch.as_tensor(args[1]).tolist()
        e = self.cfg.expert
        start = sum(counts_E[:e])
        keep_M1 = torch.ones(out_MD.shape[0], 1, dtype=out_MD.dtype, device=out_MD.device)
        keep_M1[start:start + counts_E[e]] = 0.0
        return out_MD * keep_M1

    def load_state_dict(self, sd: dict) -> None:
        super().load_state_dict(sd)
        if self.fired:
            self._kill()
