"""Device-to-host reads per optimizer step (docs/host_reads.md): on a GPU each one stops the host queueing
kernels until the device has caught up, so the default job reads every number its step needs in ONE transfer.

Counted on a CPU, where nothing waits but the same calls are the ones that would (bench/speed/host_syncs.py):
train.py as a user runs it, in a child process whose torch.Tensor has item / tolist / cpu / numpy /
__float__ / __int__ / __bool__ wrapped; each call from this repository's code (not torch's own) is booked
to the step in progress by its call site. A new `.item()` on the default path fails
test_the_default_job_reads_once_a_step. No time is measured. The GPU twin at the end asks CUDA's sync
debug mode instead, which also sees the implicit waits (a data-dependent shape, a pageable copy).
"""
from __future__ import annotations

import collections

import pytest

from bench.speed.host_syncs import measure

# Every read a step may make, by (file, function), and why it exists. A read elsewhere fails every test.
WHY = {
    ("parallel/host_scalars.py", "read"):
        "the step's transfer: all the record, the guard's verdict, the console line and the sinks read",
    ("precision/step.py", "apply_update"):
        "the first optimizer step's skip, decided on the host: found_inf would create the moments that a "
        "skipped first step never had (precision/step.py skips_on_device); from step 2 on the device decides",
    ("train.py", "evaluate"):
        "the evaluation's own transfer, on its steps (train.eval_every, and the last step)",
    ("stability/telemetry.py", "finish"):
        "telemetry's transfer of its per-layer numbers, on its steps",
    ("stability/telemetry_layers.py", "norms"):
        "telemetry: which FP32 norms of grads, θ and Δθ to redo in FP64 (an overflow or an underflow), on its steps",
    ("model/attention.py", "head_logit_max"):
        "telemetry's attention-logit probe on a CPU only (a vectorised add, checked finite): a GPU takes the "
        "masked_fill branch, which reads nothing",
    ("model/swiglu.py", "_hits"):
        "telemetry's clamp count on a CPU only (a bound check on the clamped halves while in cache): a GPU "
        "counts on the device",
}
READ = ("parallel/host_scalars.py", "read")
TELEMETRY_OWN = {("stability/telemetry.py", "finish"): 1, ("stability/telemetry_layers.py", "norms"): 3}
CPU_ONLY = {("model/attention.py", "head_logit_max"), ("model/swiglu.py", "_hits")}
FIRST_STEP = {("precision/step.py", "apply_update"): 1}
EVAL = {("train.py", "evaluate"): 1}


def by_reason(entry: dict) -> collections.Counter:
    """Counter of (file, function) over one step's reads; a site WHY does not name fails here, by name."""
    got = collections.Counter()
    for s in entry["sites"]:
        where, method = s.rsplit(" ", 1)
        key = (where.split(":")[0], where.split(" ")[1])
        assert key in WHY, f"step {entry['step']}: a read WHY does not explain: {s}"
        got[key] += 1
    return got


def check(book: list[dict], reads_a_step: int, telemetry_every: int, last: int) -> None:
    """Every step of the run holds exactly: `reads_a_step` transfers, the first step's host-decided skip
    where the device cannot decide it yet, telemetry's reads on its steps, the evaluation's on the last."""
    steps = [e for e in book if e["step"] > 0]
    assert [e["step"] for e in steps] == list(range(1, last + 1))
    for e in steps:
        t, got = e["step"], by_reason(e)
        want = collections.Counter({READ: reads_a_step})
        if t == 1 and reads_a_step == 1:  # a guard that judges first has read the overflow already
            want.update(FIRST_STEP)
        if telemetry_every and t % telemetry_every == 0:
            want.update(TELEMETRY_OWN)
            for key in CPU_ONLY:  # as many as the model has probed layers × micro-batches: at least one
                assert got[key] > 0, (t, key, e["sites"])
                want[key] = got[key]
        if t == last:
            want.update(EVAL)
        assert got == want, (t, e["sites"])


def test_the_default_job_reads_once_a_step():
    """The default job (guard=log, telemetry every 10 steps): ONE read a step. Its guard never vetoes, so it
    judges the step after the update, from the same numbers; a non-finite step is skipped on the device (fused
    AdamW's found_inf). Step 10 is a telemetry step, step 12 evaluates."""
    check(measure([], steps=12), reads_a_step=1, telemetry_every=10, last=12)


def test_telemetry_every_step_reads_its_own_numbers_beside_the_step():
    check(measure(["telemetry.every=1"], steps=4), reads_a_step=1, telemetry_every=1, last=4)


@pytest.mark.parametrize("guard", ["skip", "rollback"])
def test_a_guard_that_can_veto_reads_before_and_after_the_update(guard):
    """TWO reads a step: the veto must be decided before the update (parameters, moments and step count
    untouched by a skip), by the detector on the host; the record's post-update numbers (‖m‖, ‖v‖, ‖θ‖)
    exist only after it. Rollback's snapshot every 5 steps reads nothing."""
    check(measure([f"guard={guard}"], steps=6), reads_a_step=2, telemetry_every=10, last=6)


@pytest.mark.slow  # 2-process launches
@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_ddp_and_fsdp_on_two_processes_read_once_a_step(mode):
    """The same one read a step on 2 gloo processes: the interrupt check's MAX-reduce rides in it (the first
    boundary, before any step, reads its own: step 0, not counted here); FSDP's fused AdamW takes the
    agreed flag on its DTensor parameters."""
    check(measure([f"parallel.mode={mode}"], nproc=2, steps=4), reads_a_step=1, telemetry_every=10, last=4)


@pytest.mark.gpu
def test_on_a_gpu_the_step_waits_only_for_its_read_and_one_shape():
    """CUDA's sync debug mode on steps 2..: the same one read, and besides it one wait only: the input
    statistics' compaction of the batch's token ids (before the forward, with almost nothing queued). The
    batch is copied from pinned memory; bf16 runs the experts as one grouped GEMM (fp32 on CUDA takes the
    per-expert loop, one read of split sizes per MoE layer)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    book = measure(["device=cuda", "precision=bf16"], steps=6, sync_debug=True)
    for e in (e for e in book if 2 <= e["step"] < 6):
        assert by_reason(e) == {READ: 1}, (e["step"], e["sites"])
        syncs = collections.Counter(s.split(":")[0] + " " + s.split(" ")[-1] for s in e["syncs"])
        want = {"parallel/host_scalars.py read": 1, "stability/inputs.py input_tensors": 1}
        assert syncs == want, (e["step"], e["syncs"])
