"""Every lab's asserted effect holds beyond seed 7: seeds 0-9, quick sizes where the lab has them.

The default suite checks each lab at seed 7 (test_labs_*.py); this grid (~110 lab runs, tens of
minutes on one core) is the sweep (`-m sweep`): a lab whose effect shows on some seeds only rides an edge,
and teaches the wrong lesson on the others. `python -m bench.seeds.labs_seeds` prints the same grid.
"""
from __future__ import annotations

import importlib

import pytest

from labs import LABS

pytestmark = [pytest.mark.sweep, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("name", list(LABS))
def test_lab_effect_holds_for_seed(name, seed):
    r = importlib.import_module(LABS[name]).run(seed, quick=True)
    assert r["ok"] and all(r["checks"].values()), f"{name} seed {seed}:\n{r['table']}"
