"""The stability levers a run switches on from its config, as one object the training loop calls.

    levers = build_levers(train.clip, train.zscore, optim.qk_clip, model)
    res = optimizer_step(..., clip=levers.clip)   # None: the fixed clip; a ZScoreClip: adaptive
    after_update(s)                               # the step's callback point: QK-clip after the update,
                                                  # s.qk_clip and s.clip for the StepRecord
    TrainState(extras={..., **levers.extras()})   # the z-score EMA state rides in checkpoints

(model.qk_norm is part of the model and Muon part of the optimizer: neither needs the loop.)
"""
from __future__ import annotations

from optim.config import QKClipConfig, ZScoreConfig
from optim.qk_clip import QKClip
from optim.zclip import ZScoreClip, build_clip_policy
from stability.callbacks import Callback, StepState


class Levers(Callback):
    order = {"after_update": 10}  # QK-clip first: telemetry's Δθ and the drills then see the clipped weights
    def __init__(self, clip: ZScoreClip | None, qk_clip: QKClip | None):
        self.clip, self.qk_clip = clip, qk_clip

    def qk_clip_after(self, micro_batches, skipped=False) -> dict:
        # NOTE: not on a skipped step: a guard skip promises parameters untouched (the weights are the
        # previous step's, already clipped on its batch). `skipped` may be the device's flag
        # (precision/step.py apply_update): with QK-clip on, it is read here.
        if self.qk_clip is None or skipped:
            return {}
        return self.qk_clip.after_update([mb.tokens for mb in micro_batches])

    def after_update(self, s: StepState) -> None:
        s.qk_clip = self.qk_clip_after(s.micro, s.result.skipped)
        s.clip = self.clip_record()

    def clip_record(self) -> dict:
        return dict(self.clip.last) if self.clip is not None else {}

    def extras(self) -> dict:
        return {"zscore_clip": self.clip} if self.clip is not None else {}


def build_levers(clip: str, zscore: ZScoreConfig, qk_clip: QKClipConfig, model) -> Levers:
    """clip, zscore: train.clip, train.zscore; qk_clip: optim.qk_clip; model: the bare Transformer."""
    return Levers(build_clip_policy(clip, zscore), QKClip(model, qk_clip) if qk_clip.tau is not None else None)
