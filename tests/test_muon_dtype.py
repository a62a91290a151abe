"""optim.muon.ns_dtype=auto (the speedrun's): NS5 in bfloat16 only where the device multiplies it natively
(optim/muon.py ns_dtype_for, precision/units.py), and the run's optimizer and checks use what it resolved to."""
from __future__ import annotations

import pytest
import torch

import precision.units as units
from bench.config import compose_config
from model import ModelConfig, Transformer
from optim import build_optimizer
from optim.config import MuonConfig, OptimConfig
from optim.muon import ns_dtype_for
from precision.units import native_bf16
from helpers import SMALL, run_train
from stability.record import read_records


@pytest.mark.parametrize("flags, want", [({"avx2", "avx512f", "avx512_bf16"}, "bfloat16"),
                                         ({"avx2", "amx_bf16", "amx_tile"}, "bfloat16"),
                                         ({"avx2", "avx512f"}, "float32"),  # bf16 emulated on AVX-512 alone
                                         (set(), "float32")])               # no flags known (not Linux)
def test_auto_takes_bfloat16_only_with_bf16_units_on_a_cpu(monkeypatch, flags, want):
    monkeypatch.setattr(units, "cpu_flags", lambda: frozenset(flags))
    got, why = ns_dtype_for("auto", "cpu")
    assert got == want and why.startswith("auto: ")
    assert ("avx512_bf16" in why or "amx_bf16" in why)


@pytest.mark.parametrize("supported", [True, False])
def test_auto_on_a_gpu_asks_the_gpu(monkeypatch, supported):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: supported)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "GPU X")
    assert ns_dtype_for("auto", torch.device("cuda", 0))[0] == ("bfloat16" if supported else "float32")
    assert ns_dtype_for("auto", "mps")[0] == "float32"  # no bf16 units known there


def test_an_explicit_dtype_wins(monkeypatch):
    monkeypatch.setattr(units, "cpu_flags", lambda: frozenset())
    assert ns_dtype_for("bfloat16", "cpu") == ("bfloat16", "optim.muon.ns_dtype=bfloat16")
    assert ns_dtype_for("float32", "cuda")[0] == "float32"


def test_the_speedrun_leaves_it_to_the_device():
    assert compose_config(["+experiment=speedrun", "data.path=x.txt"]).optim.muon.ns_dtype == "auto"


def test_the_optimizer_resolves_it_wherever_it_is_built(monkeypatch):
    """build_optimizer is what the benches build too (bench/config.py): auto never reaches NS5 unresolved."""
    model = Transformer(ModelConfig(vocab_size=16, seq_len=8, d_model=32, n_layers=1, n_heads=2))
    for flags, want in (({"avx512_bf16"}, "bfloat16"), (set(), "float32")):
        monkeypatch.setattr(units, "cpu_flags", lambda: frozenset(flags))
        opt, _ = build_optimizer(model, OptimConfig(name="muon", muon=MuonConfig(ns_dtype="auto")))
        assert opt.ns_dtype == getattr(torch, want)


def test_a_resume_keeps_this_machines_choice():
    """The dtype is not in the optimizer's state: a checkpoint written where bfloat16 was native, resumed where it is
    emulated, runs float32 there (and the optimizer check, which resolves it alike, bounds that)."""
    model = Transformer(ModelConfig(vocab_size=16, seq_len=8, d_model=32, n_layers=1, n_heads=2))
    there, _ = build_optimizer(model, OptimConfig(name="muon", muon=MuonConfig(ns_dtype="bfloat16")))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    there.step()
    here, _ = build_optimizer(model, OptimConfig(name="muon", muon=MuonConfig(ns_dtype="float32")))
    here.load_state_dict(there.state_dict())
    assert here.ns_dtype == torch.float32 and "ns_dtype" not in here.state_dict()["param_groups"][0]


def test_a_run_uses_what_auto_resolved_to(tmp_path):
    """The header says it, and the optimizer and the checks run on it: the Muon step and the optimizer check's NS5
    bound (in the resolved dtype) on a reference step, every check passing."""
    want = "bfloat16" if native_bf16("cpu")[0] else "float32"
    r = run_train(tmp_path / "run", "optim=muon", "optim.muon.ns_dtype=auto", "train.steps=4", "spec.every=2",
                  *SMALL)
    assert r.returncode == 0, r.stderr[-2000:]
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("optim.muon.ns_dtype:"))
    assert line.startswith(f"optim.muon.ns_dtype: {want} (auto: "), line
    recs = read_records(tmp_path / "run" / "metrics.jsonl")
    assert len(recs) == 4 and all("optimizer" in r["spec"]["miss"] and not r["spec"]["fail"] for r in recs)
