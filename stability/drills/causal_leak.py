"""causal_leak: from step s the attention of every block sees the future (the causal mask dropped, in the
training forward and in eval): position t can read token t+1, its own label, so once the model learns to
look there the loss falls below the data's exact floor, a loss no honest predictor reaches."""
from __future__ import annotations

from stability.drills.base import PERSISTENT, Drill


class CausalLeak(Drill):
    kind = "causal_leak"
    expects = "forward.below_floor"
    lifetime = PERSISTENT
    points = ("before_forward",)

    def before_forward(self, s) -> None:
        if not self.fired and self.persists(s.step, blocks=len(self.ctx.model.blocks)):
            self._leak()

    def _leak(self) -> None:
        for block in self.ctx.model.blocks:
            block.attn.causal = False  # model/attention.py Attention: full attention instead of causal

    def load_state_dict(self, sd: dict) -> None:
        super().load_state_dict(sd)
        if self.fired:
            self._leak()
