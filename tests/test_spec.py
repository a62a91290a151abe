"""The step's specification checks (spec/): a bug planted from outside each check's code (tests/plant.py) fails
that check at its step, naming the place; the steps before it pass. The 2-process launches and the resumes run
under `-m slow`."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench.speed.spec_overhead import by_check
from helpers import ROOT, TINY, env

sys.path.insert(0, str(Path(__file__).parent))
from plant import BETWEEN, BUILT, FAULTS, FLAGGED, ONE_MICRO_BATCH, RESUME, SPARES_ROW0, SUSTAINED  # noqa: E402

S = 3
PLANTED = [*TINY, f"train.steps={S + 1}", "spec.every=1", "checkpoint.every=0", "logging.plot=false"]


def plant(tmp_path: Path, fault: str, *overrides: str, nproc: int = 1, base: list[str] = PLANTED,
          step: int = S) -> list[dict]:
    d = tmp_path / fault
    script = [str(ROOT / "tests/plant.py"), fault, str(step), str(d), *base, *overrides]
    cmd = ([sys.executable, *script] if nproc == 1 else
           [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *script])
    r = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]


def first_failure(rec: dict) -> dict | None:
    fails = rec["spec"].get("fail") or []
    return fails[0] if fails else None


ONE_RANK = ("replica_drift", "lr_rank1")  # 2 processes: one rank's copy or setting changed, the other's not
SINGLE = [f for f in FAULTS if f not in ("reduce_rank1", *ONE_RANK)]


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> dict:
    """Every single-process plant trained once, two at a time (each process runs on one thread: 2 cores);
    a plant that crashed is that plant's test failure, not its neighbours'."""
    from concurrent.futures import ThreadPoolExecutor

    root = tmp_path_factory.mktemp("planted")

    def one(fault: str):
        try:
            return plant(root, fault)
        except AssertionError as e:
            return e
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(SINGLE, pool.map(one, SINGLE)))


@pytest.mark.parametrize("fault", list(BETWEEN))
def test_a_check_that_reads_the_steps_own_forward_fails_between_reference_steps(tmp_path, fault):
    """The route, precision and prefix checks read the step's own forward, every step: a top-k flipped at step 3, a
    layer's output rounded to bf16 there, or a token mid-row changed as the embedding reads it (past the prefix's
    positions: its embedding's output is held over the whole row), fails its check at 3 with spec.every=5 (whose
    reference steps are 1 and 5), before the update; the step before held it. The reference checks then run on that
    step too (on demand), and whatever they name first is of the same class (the forward check's precision, at the
    same layer)."""
    base = [o for o in PLANTED if not o.startswith("spec.every=")]
    recs = plant(tmp_path, fault, base=[*base, "spec.every=5"])
    check, where, kind = BETWEEN[fault]
    fails = recs[S - 1]["spec"]["fail"]
    assert (check, where, kind) in [(f["check"], f["where"], f["kind"]) for f in fails], fails
    own = next(f for f in fails if f["check"] == check)
    assert (fails[0]["class"], fails[0]["where"]) == (own["class"], where), fails
    assert check in recs[S - 2]["spec"]["miss"] and not recs[S - 2]["spec"]["fail"]


@pytest.mark.parametrize("fault", list(FLAGGED))
def test_a_step_the_guard_flags_gets_its_reference_checks(tmp_path, fault):
    """A step the guard's detector flags between reference steps (spec.every=5: 1 and 5; flagged: 3) runs the
    reference checks after its read: a clean one holds them, an attention scaled at that step alone fails the
    forward check there — a one-step fault no reference step would see."""
    base = [o for o in PLANTED if not o.startswith("spec.every=")]
    recs = plant(tmp_path, fault, base=[*base, "spec.every=5"])
    ran = [r["step"] for r in recs if "forward" in r["spec"]["miss"]]
    assert ran == [1, S], ran
    got = first_failure(recs[S - 1])
    if FLAGGED[fault] is None:
        assert got is None and recs[S - 1]["spec"]["miss"]["forward"] <= 1
    else:
        assert got is not None and (got["check"], got["where"], got["kind"]) == FLAGGED[fault], got


def test_a_step_that_fails_an_every_step_check_gets_its_reference_checks(tmp_path):
    """A norm that ignores its gain at step 3 alone, between reference steps (spec.every=5: 1 and 5): the gain gets no
    gradient (the reduce check, every step), and the reference checks then run on that step too, so the first failure
    is the forward check's, at the block whose norm computed otherwise."""
    base = [o for o in PLANTED if not o.startswith("spec.every=")]
    recs = plant(tmp_path, "norm_gain_off", base=[*base, "spec.every=5"])
    assert [r["step"] for r in recs if "forward" in r["spec"]["miss"]] == [1, S]
    fails = recs[S - 1]["spec"]["fail"]
    assert [(f["check"], f["where"], f["kind"]) for f in fails[:1]] == [FAULTS["norm_gain_off"]], fails
    assert ("reduce", "missing") in [(f["check"], f["kind"]) for f in fails], fails


@pytest.mark.parametrize("fault", list(SUSTAINED))
def test_a_fault_between_reference_steps_is_found_or_dated_at_its_onset(tmp_path, fault):
    """The forward and gradient checks run on reference steps only (spec.every=5: steps 1, 5, 10, 15); a fault from
    step 13 on. A layer's fault fails the prefix check at 13 (the forward's layers on a row's first and last
    positions, every step between), whether or not it moves the layer's output RMS (q, k and v rounded to bf16 do
    not) or changes its first positions (a window), and the reference checks run there on demand: the forward check
    names and classes it at 13, the prefix check carries it at 14 and 16, and the doctor reads one incident, from 13. A gradient's fault fails the gradient check at 15, and
    the doctor dates it at 13, where the parameter's gradient norm shifted (the check held at 10); a rounding within
    the recipe's bound (q and k in bf16) fails the exact check at 15, and the doctor dates it at 13, where the layer's
    miss on the prefix's positions left FP32's level."""
    base = [o for o in PLANTED if not o.startswith(("spec.every=", "train.steps="))]
    recs = plant(tmp_path, fault, base=[*base, "spec.every=5", "train.steps=16"], step=13)
    failed = {r["step"]: first_failure(r) for r in recs if first_failure(r)}
    check, where, kind = SUSTAINED[fault]
    if check == "forward":
        assert [(t, f["check"], f["where"]) for t, f in failed.items()] == \
            [(13, "forward", where), (14, "prefix", where), (15, "forward", where), (16, "prefix", where)], failed
        assert "prefix" in {f["check"] for f in recs[12]["spec"]["fail"]} and recs[11]["spec"]["miss"]["prefix"] <= 1
    else:
        assert list(failed) == [15]
    found = min(failed)
    assert (failed[found]["check"], failed[found]["where"], failed[found]["kind"]) == (check, where, kind)
    from doctor.rules import diagnose
    _, diag, _ = diagnose(tmp_path / fault)
    assert (diag.fault_class, diag.step, diag.model_layer) == (failed[found]["class"], 13, where), diag.summary
    spec = [d for d in diag.incidents if d.judgement and d.judgement.evidence.get("check") in ("forward", "prefix", check)]
    assert len(spec) == 1, [d.summary for d in spec]


@pytest.mark.parametrize("fault", ["norm_inline", "mlp_inline_on"])
def test_a_layer_computed_outside_its_module_fails_at_its_step(tmp_path, fault):
    """From step 3 the forward computes a layer otherwise, outside its module (a fused path: no call of the module, so
    no hook reads it), spec.every=5: the final norm with another ε, or block0's MLP ×1.5. The loss_grad check cannot
    rebuild the gain's gradient without the norm's input, nor the prefix check hold a layer it never saw: each fails at
    3 (the norm: loss_grad, kind bypassed; the MLP: prefix, naming it), where both used to skip the step, and the
    reference checks run there on demand; nothing fails at 2. Before, nothing failed until the reference step 5."""
    base = [o for o in PLANTED if not o.startswith("spec.every=")]
    recs = plant(tmp_path, fault, base=[*base, "spec.every=5"])
    fails = recs[S - 1]["spec"]["fail"]
    got = [(f["check"], f["where"], f["kind"]) for f in fails]
    if fault == "norm_inline":
        assert ("loss_grad", "norm", "bypassed") in got, fails
    else:
        assert any(c == "prefix" and "block0.mlp" in w for c, w, _ in got), fails
    assert fails[0]["class"] == "numerics.mismatch", fails
    assert not recs[S - 2]["spec"]["fail"]


@pytest.mark.parametrize("fault", list(ONE_MICRO_BATCH))
def test_a_fault_on_one_micro_batch_is_met_by_the_checks_that_take_them_in_turn(tmp_path, fault):
    """block0's MLP output ×2, or rounded to bf16, on the second micro-batch only, from step 13 on (spec.every=5). The
    reference checks' probe is a forward of its own, which never sees it, nor would a check of the first micro-batch;
    the prefix's row takes the micro-batches in turn (spec/probe.py row): at 13 it is micro-batch 1's, and the check
    fails there, at the layer, classed from its own comparison; the precision check samples micro-batch t mod 2, and
    fails at 13 and 15 on the rounding. At 14 and 16 (micro-batch 0) the layers compute their math. The doctor's
    headline is the fault, at 13."""
    from spec.probe import row
    base = [o for o in PLANTED if not o.startswith(("spec.every=", "train.steps="))]
    recs = plant(tmp_path, fault, base=[*base, "spec.every=5", "train.steps=16"], step=13)
    failed = {r["step"]: first_failure(r) for r in recs if first_failure(r)}
    check, where, kind, steps = ONE_MICRO_BATCH[fault]
    assert [row(t, 2, 4)[0] for t in (13, 14, 16)] == [1, 0, 0]
    assert [(t, f["check"], f["where"], f["kind"]) for t, f in failed.items()] == [(t, check, where, kind)
                                                                                   for t in steps], failed
    from doctor.rules import diagnose
    _, diag, _ = diagnose(tmp_path / fault)
    assert (diag.fault_class, diag.step, diag.model_layer) == (failed[13]["class"], 13, where), diag.summary


def test_the_probe_reads_the_row_the_prefix_failed_on_and_the_rows_in_turn(tmp_path):
    """block0's MLP ×2 from step 13 on every sequence but the batch's first row (spec.every=5, micro-batches of 4
    rows). The prefix's row at 13 is micro-batch 1's row 2: it fails, and the probe run on demand at 13 takes that
    row, so the forward check classes the layer's miss there from the probe (rank 20, before the prefix's 23). The
    reference step 15 is the reference steps' fourth: micro-batch 1's row 1, and the forward check fails there too. At
    16 the prefix's row is micro-batch 0's row 0, the spared one: nothing fails. A probe fixed on the first row sees
    nothing at 13 or 15."""
    from spec.probe import row
    base = [o for o in PLANTED if not o.startswith(("spec.every=", "train.steps="))]
    recs = plant(tmp_path, SPARES_ROW0, base=[*base, "spec.every=5", "train.steps=16"], step=13)
    failed = {r["step"]: first_failure(r) for r in recs if first_failure(r)}
    assert [row(13, 2, 4), row(15 // 5, 2, 4), row(16, 2, 4)] == [(1, 2), (1, 1), (0, 0)]
    assert sorted(failed) == [13, 14, 15], failed
    for t in (13, 15):
        assert (failed[t]["check"], failed[t]["where"], failed[t]["kind"]) == ("forward", "block0.mlp", "scaled"), failed
    assert failed[14]["check"] == "prefix", failed


@pytest.mark.parametrize("fault", SINGLE)
def test_a_planted_bug_fails_its_check_at_its_step(planted, fault):
    check, where, kind = FAULTS[fault]
    recs = planted[fault]
    if isinstance(recs, AssertionError):
        raise recs
    for rec in recs[:S - 1]:
        assert not rec["spec"].get("fail"), (rec["step"], rec["spec"]["fail"])
    got = first_failure(recs[S - 1])
    assert got is not None, f"step {S}: no check failed; misses {recs[S - 1]['spec']['miss']}"
    assert (got["check"], got["kind"]) == (check, kind), got
    if where is not None:
        assert got["where"] == where, got
    assert got["miss"] > 1 and got["class"]


@pytest.mark.parametrize("fault", list(BUILT))
def test_a_component_built_against_the_config_fails_its_check_at_the_first_step(tmp_path, fault):
    """The specification is the config's, not what a component was built with: the optimizer's groups built wrongly
    (a norm gain in the decayed group) break the update's algebra from step 1, with every group's settings right; a
    model built with another norm epsilon than the config's breaks the forward against the reference."""
    check, where, kind = BUILT[fault]
    f = first_failure(plant(tmp_path, fault)[0])
    assert f is not None and f["check"] == check and kind in (None, f["kind"]) and where in (None, f["where"]), f


def test_every_check_declares_what_the_doctor_reads():
    """A check's failure becomes a doctor incident: its layer maps onto the doctor's timeline, its rank orders it,
    every kind names a declared class (with its fix) and says what to look at."""
    from doctor.classes import CLASSES
    from doctor.timeline import LAYERS
    from spec.checks import registry
    from spec.monitor import TIMELINE

    reg = registry()
    assert [c.rank for c in reg.values()] == sorted(c.rank for c in reg.values())
    for name, c in reg.items():
        assert TIMELINE[c.layer] in LAYERS, name
        for kind, k in c.kinds.items():
            assert k.cls in CLASSES and callable(CLASSES[k.cls].fix) and k.fix, (name, kind)


def test_the_read_packs_every_checks_worst_place_as_each_alone():
    """pack lays every check's measurement out in one set of ops: each row must be what the check's own argmax of
    err/tol gives (NaN and infinite errors a miss of inf, a NaN tolerance judging nothing, ties to the first place),
    for tensors and host numbers, broadcast tolerances and kinds, a check that measured nothing or no place."""
    import torch

    from spec.check import Check, Kind, pack

    class Probe(Check):  # an abstract-looking name: not registered (name None)
        kinds = {"a": Kind("numerics.mismatch", "a"), "b": Kind("numerics.mismatch", "b")}

    def alone(err, tol, kind, kinds):
        err = torch.atleast_1d(torch.as_tensor(err, dtype=torch.float64)).reshape(-1)
        tol = torch.atleast_1d(torch.as_tensor(tol, dtype=torch.float64)).reshape(-1).expand_as(err)
        tol = torch.nan_to_num(tol, nan=math.inf, posinf=math.inf, neginf=-math.inf)
        miss = torch.nan_to_num(err / tol.clamp(min=1e-300), nan=math.inf, posinf=math.inf, neginf=-math.inf)
        at = int(miss.argmax())
        k = list(kinds).index(kind or "a") if not torch.is_tensor(kind) else \
            float(torch.atleast_1d(kind).reshape(-1).expand_as(err)[at])
        return [float(miss[at]), float(at), float(k), float(err[at]), float(tol[at])]

    g = torch.Generator().manual_seed(0)
    cases = [
        (torch.rand(7, generator=g), torch.rand(7, generator=g), None),
        (torch.rand(3, dtype=torch.float64, generator=g), 0.25, "b"),
        (torch.tensor([0.1, float("nan"), 0.3]), torch.tensor(0.5), torch.tensor([0.0, 1.0, 0.0])),
        (torch.tensor([2.0, 2.0, 1.0]), torch.tensor([1.0, 1.0, float("nan")]), torch.tensor(1.0)),
        (torch.tensor(float("inf")), 1.0, None),
        (math.inf, 1.0, None),
        None,
        (torch.zeros(0), 1.0, None),
        (torch.rand(2, 3, generator=g), torch.rand(6, generator=g), torch.tensor([1.0] * 6)),
    ]
    checks = []
    for case in cases:
        c = Probe.__new__(Probe)
        c.measured = case
        checks.append(c)
    for _ in range(2):  # the second time from the cached layout
        table = pack(checks, torch.device("cpu"))
        for c, row, case in zip(checks, table.tolist(), cases):
            if case is None or (torch.is_tensor(case[0]) and case[0].numel() == 0):
                assert row == [-1.0, 0.0, 0.0, 0.0, 0.0]
            else:
                want = alone(*case, c.kinds)
                assert row == pytest.approx(want, nan_ok=True), (case, row, want)


def records(d: Path) -> list[dict]:
    return [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]


CLEAN = {  # configuration -> overrides: every step of a short run passes every check that runs
    "fp16": ["precision=fp16"],
    "muon": ["optim=muon"],
    "moe_tiny": ["model=moe_tiny", "model.d_model=32", "model.n_heads=2", "model.n_layers=2"],
    "activation_checkpointing": ["train.activation_checkpointing=full"],
    "bf16": ["precision=bf16"],
    "fp8_block": ["precision=fp8_block"],
    "zscore_clip": ["train.clip=zscore", "train.zscore.warmup=2"],
    "qk_clip": ["optim.qk_clip.tau=0.1"],  # below every head's logit: it clips every step
}
SLOW_CLEAN = {"bf16", "fp8_block", "zscore_clip", "qk_clip"}


# reference steps 1, 2 and 4; step 3 between them, where the prefix check runs
EVERY_OTHER = [*(o for o in PLANTED if not o.startswith("spec.every=")), "spec.every=2"]


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_CLEAN else n for n in CLEAN])
def test_clean_steps_pass_every_check(tmp_path, name):
    recs = plant(tmp_path, "none", *CLEAN[name], base=EVERY_OTHER)
    assert len(recs) == S + 1
    for rec in recs:
        assert rec["spec"]["miss"] and not rec["spec"].get("fail"), (name, rec["step"], rec["spec"].get("fail"))
    ran = set().union(*(r["spec"]["miss"] for r in recs))
    assert {"continuity", "data", "forward", "gradient", "clip", "lr", "optimizer"} <= ran
    assert [r["step"] for r in recs if "prefix" in r["spec"]["miss"]] == [S], name
    # every check's host time, the monitor's beside them, adds up to the step's time_s.spec
    for rec in recs:
        took = {k[len("spec."):]: v for k, v in rec["time_s"].items() if k.startswith("spec.")}
        assert set(rec["spec"]["miss"]) | {"monitor"} <= set(took) and min(took.values()) >= 0, (name, rec["step"])
        assert sum(took.values()) == pytest.approx(rec["time_s"]["spec"], rel=1e-9), (name, rec["step"])
    # the overhead bench's per-check table: the prefix check on the step between, the forward check on the others
    table = {row[0]: row[1:] for row in by_check(recs)}
    assert table["forward"][1] > 0 and table["prefix"][0] > table["prefix"][1], table


def test_a_clipped_step_within_the_clip_tolerance_passes_the_optimizer_check(tmp_path):
    """The step sums its gradient norm in FP32, the clip check in FP64: at a clipped step the coefficient applied may
    be off the policy's by what the clip check allows, and the moments carry it. Planted at half that, every step
    clipping: the clip check sees it and passes, and so must the optimizer check (a clean run's clipped spike is
    not an optimizer fault)."""
    recs = plant(tmp_path, "coef_in_tolerance", "train.max_grad_norm=0.01")
    for rec in recs:
        assert rec["clip_coef"] < 1 and 0.25 < rec["spec"]["miss"]["clip"] <= 1, (rec["step"], rec["spec"]["miss"])
        assert not rec["spec"].get("fail"), (rec["step"], rec["spec"]["fail"])


def test_a_frozen_parameter_is_compared_as_a_gradient_of_zero(planted):
    """The embedding frozen at step S: the reduce check names it (no gradient), and the gradient check, which runs
    there too (spec.every=1), compares its probe gradient as 0 against the reference's: an erased gradient, at its
    name — not a check that could not run."""
    recs = planted["emb_frozen"]
    if isinstance(recs, AssertionError):
        raise recs
    grad = [f for f in recs[S - 1]["spec"]["fail"] if f["check"] == "gradient"]
    assert grad and (grad[0]["where"], grad[0]["kind"]) == ("tok_emb.weight", "mismatch"), grad


def test_a_clip_coefficient_reported_and_not_applied_is_the_clips_fault(tmp_path):
    """At step S the clip's coefficient is the policy's (the clip check passes) but the gradients are left unscaled:
    the moments are their algebra for the gradient times 1/coef, one factor across the group — the clip's fault
    (a setting), not a lost state. Every step clips (a threshold of 0.01); the steps before it pass."""
    recs = plant(tmp_path, "clip_unapplied", "train.max_grad_norm=0.01")
    assert not any(r["spec"].get("fail") for r in recs[:S - 1])
    assert recs[S - 1]["clip_coef"] < 1 and recs[S - 1]["spec"]["miss"]["clip"] <= 1
    got = first_failure(recs[S - 1])
    assert got is not None and (got["check"], got["kind"], got["class"]) == ("optimizer", "clip", "optim.settings"), got


def test_muon_between_reference_steps_checks_its_momentum_and_no_update(tmp_path):
    """Muon's oracle (an FP64 Newton–Schulz of the hidden matrices, one block's in turn) runs on reference steps only: with spec.every=2
    step 3 is not one; its momentum is checked, its matrices' update is not judged, and no step fails."""
    base = [o for o in PLANTED if not o.startswith("spec.every=")] + ["spec.every=2"]
    recs = plant(tmp_path, "none", "optim=muon", base=base)
    assert [r["step"] for r in recs] == list(range(1, S + 2))
    for rec in recs:
        assert "optimizer" in rec["spec"]["miss"] and not rec["spec"].get("fail"), (rec["step"], rec["spec"])


def test_a_muon_update_off_its_multiplier_fails_the_optimizer_check(tmp_path):
    """Muon's update (NS5 in FP32, the default) 10 % larger than its configured rms_scale from step S on, a reference
    step: the whole matrix's update misses the FP64 oracle beyond NS5's normwise bound — a setting's fault. Every
    step before it passes."""
    recs = plant(tmp_path, "muon_scale", "optim=muon")
    assert not any(r["spec"].get("fail") for r in recs[:S - 1])
    got = first_failure(recs[S - 1])
    assert got is not None and (got["check"], got["kind"], got["class"]) == ("optimizer", "update", "optim.settings"), got
    assert got["where"].startswith("blocks."), got  # a hidden matrix: which one misses most is the float path's


def test_muons_oracle_checks_one_blocks_matrices_a_reference_step_in_turn(tmp_path):
    """The FP64 oracle of Muon's update takes block b's matrices on the reference steps k·every with k ≡ b (mod
    n_layers) (spec/checks/optimizer.py muon_turn). Block 0's update 10 % larger from step S = 3 on: step 3 is block
    1's turn and passes; step 4, block 0's, fails on a block-0 matrix."""
    recs = plant(tmp_path, "muon_block0", "optim=muon")
    assert not any(r["spec"].get("fail") for r in recs[:S])
    got = first_failure(recs[S])
    assert got is not None and (got["check"], got["kind"]) == ("optimizer", "update"), got
    assert got["where"].startswith("blocks.0."), got


@pytest.mark.slow  # 2-process launches
@pytest.mark.distributed
@pytest.mark.parametrize("parallel", ["auto", "fsdp"])
def test_clean_steps_pass_under_ddp_and_fsdp(tmp_path, parallel):
    recs = plant(tmp_path, "none", f"parallel={parallel}", nproc=2, base=EVERY_OTHER)
    for rec in recs:
        assert not rec["spec"].get("fail"), (parallel, rec["step"], rec["spec"].get("fail"))
    assert ("prefix" in recs[S - 1]["spec"]["miss"]) == (parallel != "fsdp")  # FSDP2's weights are shards
    assert {"reduce", "replicas"} <= set(recs[-1]["spec"]["miss"]) or parallel == "fsdp"


@pytest.mark.slow  # a 2-process launch
@pytest.mark.distributed
def test_a_reduction_that_drops_one_ranks_share_fails_the_reduce_check(tmp_path):
    """A communication hook halves rank 1's gradient on its way into the all-reduce: every rank's reduced gradient
    is then off the mean of the ranks' own, found at that step, before the update."""
    recs = plant(tmp_path, "reduce_rank1", nproc=2)
    for rec in recs[:S - 1]:
        assert not rec["spec"].get("fail"), (rec["step"], rec["spec"]["fail"])
    got = first_failure(recs[S - 1])
    check, _, kind = FAULTS["reduce_rank1"]
    assert got is not None and (got["check"], got["kind"], got["class"]) == (check, kind, "system.rank_divergence"), got


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("fault", ONE_RANK)
def test_one_rank_changed_is_a_rank_divergence(tmp_path, fault):
    """Rank 0's copy of a weight moved after the update, or rank 1's LRs doubled (the other rank's not): the check
    fails on that rank alone, which makes it that rank's copy or setting (system.rank_divergence), not a setting
    every rank runs."""
    recs = plant(tmp_path, fault, nproc=2)
    for rec in recs[:S - 1]:
        assert not rec["spec"].get("fail"), (rec["step"], rec["spec"]["fail"])
    got = first_failure(recs[S - 1])
    check, where, kind = FAULTS[fault]
    assert got is not None and (got["check"], got["kind"], got["class"]) == (check, kind, "system.rank_divergence"), got
    assert where is None or got["where"] == where, got


@pytest.mark.slow  # three runs, two of them resumes
def test_a_resume_continues_the_specification_and_a_lossy_one_fails_it(tmp_path):
    """A run resumed from its checkpoint passes every check (the continuity check compares the resumed state with
    the checkpoint's fingerprint); a resume that drops the optimizer's moments fails it at the first step after."""
    import shutil
    d = tmp_path / "none"
    plant(tmp_path, "none", f"checkpoint.every={S - 1}", f"checkpoint.stop_after={S - 1}")
    bad = tmp_path / "bad"
    bad.mkdir()
    shutil.copytree(d, bad / "resume_lost_moments")
    resumed = plant(tmp_path, "none", "resume=latest")
    assert resumed[-1]["step"] == S + 1 and not any(r["spec"].get("fail") for r in resumed if r["step"] >= S)
    recs = plant(bad, "resume_lost_moments", "resume=latest")
    first = next(r for r in recs if r["step"] == S)
    got = first_failure(first)
    check, _, kind = RESUME["resume_lost_moments"]
    assert got is not None and (got["check"], got["kind"], got["class"]) == (check, kind, "state.resume_fault"), got


@pytest.mark.slow  # a run and its resume
def test_a_resume_that_quarantines_the_next_batch_passes_every_check(tmp_path):
    """The doctor's fix for a bad batch (doctor --verify) resumes from the step before it with train.skip_batches=[its
    first ID]: the loader serves the batch after it, and the data check's plan must serve the same — a declared
    quarantine is no resume fault and no cursor fault."""
    recs = plant(tmp_path, "none", f"checkpoint.every={S - 1}", f"checkpoint.stop_after={S - 1}")
    b = recs[-1]["batch"]
    bad = b["first"] + b["size"]  # step S's batch
    resumed = plant(tmp_path, "none", "resume=latest", f"train.skip_batches=[{bad}]")
    at = next(r for r in resumed if r["step"] == S)
    assert at["batch"]["first"] == bad + b["size"], at["batch"]
    assert not any(r["spec"].get("fail") for r in resumed if r["step"] >= S), \
        [(r["step"], r["spec"].get("fail")) for r in resumed]


def test_a_rollback_replays_under_the_specification(tmp_path):
    """guard=rollback: an LR spike (the transient drill) fails the lr check at its step, before the update (the guard
    vetoes and rolls back); the replayed steps after the rollback — anticipatory routing on — pass every check."""
    recs = plant(tmp_path, "none", "fault=lr_spike", f"fault.step={S}", "fault.lr_spike.steps=1", "guard=rollback", "guard.rollback.source=memory", "guard.rollback.margin=0",
                 "guard.rollback.snapshot_every=1", f"train.steps={S + 3}")
    at = [r for r in recs if r["step"] == S]
    assert first_failure(at[0])["check"] == "lr" and at[0]["guard"]["vetoed"] and at[0]["guard"]["rollback"]
    after = recs[recs.index(at[0]) + 1:]
    assert after and all(not r["spec"].get("fail") for r in after), [r["spec"].get("fail") for r in after]
    assert any(r.get("routing", {}).get("on") for r in after)
