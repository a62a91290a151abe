"""spec/rerun.py's question — a rounding or another function? — where a few elements dominate the miss (a loss row's
positions with the largest lse²): the answer must not hang on the draw of the perturbed point."""
import pytest
import torch
from torch import nn

import spec.rerun as rr
from spec.reference import F64
from spec.rerun import Rerun

D, LOUD = 32, 8  # LOUD of the D outputs are 100× the rest: the miss is about LOUD comparable draws


def gains(dtype) -> torch.Tensor:
    return torch.tensor([100.0] * LOUD + [1.0] * (D - LOUD), dtype=dtype)


class Layer(nn.Module):
    """y = (x·Wᵀ) ⊙ g, its output rounded to bf16 (a rounding) or scaled by 1.02 (another function, as close)."""

    def __init__(self, fault: str):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(D, D, generator=torch.Generator().manual_seed(0)) / D ** 0.5)
        self.fault = fault

    def forward(self, x):
        y = (x @ self.weight.T) * gains(x.dtype)
        return y.bfloat16().to(y.dtype) if self.fault == "bf16" else y * 1.02


def kinds(fault: str, seeds: range, draws: int, monkeypatch) -> list[str]:
    """The kind judged with each of `seeds` as the perturbation's seed, on `draws` perturbed points."""
    x = torch.randn(1, D, generator=torch.Generator().manual_seed(1))
    rerun = Rerun(Layer(fault), "", (x,), {}, lambda x, w: (x @ w["weight"].T) * gains(F64))
    monkeypatch.setattr(rr, "DRAWS", draws)
    out = []
    for seed in seeds:
        monkeypatch.setattr(rr, "SEED", seed)
        out.append(rerun.kind(rerun.miss()))
    return out


@pytest.mark.parametrize("fault, kind", [("bf16", "precision"), ("x1.02", "mismatch")])
def test_a_miss_made_of_few_draws_is_judged_alike_at_every_seed(fault, kind, monkeypatch):
    assert set(kinds(fault, range(40), rr.DRAWS, monkeypatch)) == {kind}


def test_one_perturbed_point_would_take_a_rounding_for_another_function(monkeypatch):
    """Why DRAWS: judged on one perturbed point, the same rounding is another function at some seeds."""
    assert "mismatch" in kinds("bf16", range(40), 1, monkeypatch)
