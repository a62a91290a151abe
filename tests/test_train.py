"""train.py end to end, as a user runs it: the run directory, the StepRecord, config errors, DDP (`-m slow`)."""
from __future__ import annotations

import math

import pytest
import yaml

from helpers import ROOT, TINY, run_train
from stability.record import read_records

RECORD_FIELDS = {"step", "tokens", "ckpt_id", "batch", "source_mix", "valid_tokens", "tokens_by_source", "loss",
                 "loss_by_source", "z_loss", "aux_loss", "logit_max", "expert_load", "lr", "grad_norm",
                 "clip_coef", "skipped", "time_s", "tokens_per_s", "memory_mb", "world", "events", "eval"}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """`python train.py` on TINY, once for the two tests below: its run directory and the finished process."""
    run = tmp_path_factory.mktemp("tiny") / "run"
    return run, run_train(run, *TINY)


def test_quickstart_smoke_writes_records(tiny_run):
    run, r = tiny_run
    assert r.returncode == 0, r.stderr[-3000:]
    recs = read_records(run / "metrics.jsonl")
    assert [x["step"] for x in recs] == list(range(1, 7))
    assert RECORD_FIELDS <= set(recs[0])
    for x in recs:
        assert math.isfinite(x["loss"]) and x["grad_norm"] > 0 and 0 < x["clip_coef"] <= 1
        assert x["valid_tokens"] == sum(x["tokens_by_source"].values())
        assert sum(x["source_mix"].values()) == 8
        assert set(x["time_s"]) >= {"data", "fwd_bwd", "optim", "total"}
    # tokens accumulate the per-step valid counts; batch ids advance by the global batch size
    assert recs[-1]["tokens"] == sum(x["valid_tokens"] for x in recs)
    assert [x["batch"]["first"] for x in recs] == [8 * i for i in range(6)]
    # the mixed model has MoE layers, each with a load share per expert summing to 1
    assert recs[0]["expert_load"] and all(abs(sum(v) - 1) < 1e-6 for v in recs[0]["expert_load"].values())
    evals = [x for x in recs if x["eval"]]
    assert [x["step"] for x in evals] == [3, 6]
    assert evals[-1]["eval"]["floor"] > 0 and evals[-1]["eval"]["loss"] > evals[-1]["eval"]["floor"]
    # an evaluating step's record times its evaluation apart, inside the step's own times; no other step has it
    assert all(0 < x["time_s"]["eval"] <= x["time_s"]["log_eval"] and 0 <= x["time_s"]["eval_cpu"] <= x["time_s"]["cpu"]
               for x in evals)
    assert not any("eval" in x["time_s"] for x in recs if not x["eval"])
    from bench.speed.speedrun import read_ballast  # the speedrun bench counts an evaluating step without its eval
    steps = read_ballast(run, "cpu")["step_s"]
    assert all(steps[x["step"]] == x["time_s"]["cpu"] - x["time_s"]["eval_cpu"] for x in recs if x["eval"])
    assert "final eval loss" in r.stdout and "exact floor" in r.stdout
    assert (run / "loss.png").stat().st_size > 1000
    assert (run / "config.yaml").exists()


def test_a_run_shorter_than_its_warmup_trains_on_the_clamped_schedule(tmp_path):
    """`python train.py train.steps=20`, the README's smoke run, under the default config's longer warmup."""
    r = run_train(tmp_path / "run", *[o for o in TINY if not o.startswith("optim.schedule.")], "train.steps=20",
                  "train.eval_every=20", "logging.plot=false")
    assert r.returncode == 0, r.stderr[-3000:]
    cfg = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    warmup, lr = cfg["optim"]["schedule"]["warmup_steps"], cfg["optim"]["lr"]
    assert warmup > 20, "the default warmup no longer exceeds the smoke run: pick a shorter train.steps here"
    notes = [line for line in r.stdout.splitlines() if "clamped" in line]
    assert notes == [f"optim.schedule clamped to train.steps=20: warmup_steps {warmup} → 20"]
    recs = read_records(tmp_path / "run" / "metrics.jsonl")
    assert all(math.isfinite(x["loss"]) for x in recs)
    # step t's record holds the lr of its update: the warmup now spans the run, peak at the last step
    assert [x["lr"] for x in recs] == pytest.approx([lr * t / 20 for t in range(1, 21)], rel=1e-12)


def test_run_dir_is_never_reused_silently(tiny_run):
    run, first = tiny_run
    assert first.returncode == 0, first.stderr[-3000:]
    r = run_train(run, *TINY)
    assert r.returncode != 0 and "already holds a run" in r.stderr


BAD_CONFIG = [  # an override, and what the one line that refuses it names
    ("model.d_model=33", "model.d_model"),
    ("model.moe.top_k=9", "model.moe.top_k"),
    ("optim.schedule.name=triangle", "optim.schedule.name"),
    ("train.batch_size=7", "train.batch_size"),
    ("data.sources.0.weight=-1", "data.sources"),
    ("guard.action=panic", "guard.action"),  # the stability pieces validate before anything is written too
    ("train.stpes=100", "train.stpes: unknown key (did you mean train.steps?)"),  # Hydra's own message, in one line
    ("train.steps=abc", "train.steps=abc: expected an integer (got str)"),
]
# NOTE: train.py turns every one of them into its line by the same path (run/config.py's pre-flight): two launches
# in the default suite, Hydra's own message and a component's check; the schema refuses all of them in process below
LAUNCHED = {"guard.action=panic", "train.stpes=100"}


@pytest.mark.parametrize("override, key", [pytest.param(o, k, marks=() if o in LAUNCHED else pytest.mark.slow)
                                           for o, k in BAD_CONFIG])
def test_bad_config_exits_nonzero_naming_the_key(tmp_path, override, key):
    r = run_train(tmp_path / "run", *TINY, override)
    assert r.returncode == 2
    err = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(err) == 1 and key in err[0], r.stderr
    assert not (tmp_path / "run").exists()  # stopped before anything was written, the directory included


@pytest.fixture(scope="module")
def hydra_conf():
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):  # once: each init costs ~0.5 s
        yield


@pytest.mark.parametrize("override, key", BAD_CONFIG)
def test_bad_config_is_refused_by_the_schema_naming_the_key(hydra_conf, override, key):
    """What train.py runs before it writes anything (run.config.compose_check), on the same command line."""
    from run.config import compose_check

    with pytest.raises(ValueError) as e:
        compose_check([*TINY, override])
    assert len(str(e.value).splitlines()) == 1 and key in str(e.value), str(e.value)


@pytest.mark.slow  # two launches; test_config.py and test_data.py refuse both in process
def test_text_experiment_errors(tmp_path):
    r = run_train(tmp_path / "a", "+experiment=shakespeare_char", "logging.wandb=disabled")
    assert r.returncode == 2 and "data.path" in r.stderr
    r = run_train(tmp_path / "b", "+experiment=shakespeare_char", "data.path=/no/such/file.txt", "logging.wandb=disabled")
    assert r.returncode == 2 and "data.path" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert sorted(tmp_path.iterdir()) == []  # a start that fails leaves no directory behind


def test_text_file_trains(tmp_path):
    text = tmp_path / "tiny.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 200)
    r = run_train(tmp_path / "run", "+experiment=shakespeare_char", f"data.path={text}", "train.steps=4",
                  "train.eval_every=2", "train.eval_samples=24", "train.eval_batch_size=12", "optim.schedule.warmup_steps=2",
                  "logging.wandb=disabled", "logging.progress=false", "threads=1",
                  "train.compile=false")  # no cold compile; test_compile.py checks the compiled model
    assert r.returncode == 0, r.stderr[-3000:]
    recs = read_records(tmp_path / "run" / "metrics.jsonl")
    assert len(recs) == 4 and recs[-1]["eval"]["floor"] is None
    assert recs[-1]["valid_tokens"] == 12 * 64  # random crops: every label is valid


@pytest.mark.slow  # a 2-process launch beside a 1-process run
@pytest.mark.distributed
def test_ddp_two_processes_match_single_process(tmp_path):
    """Same global batches on 1 and 2 gloo processes: per-step loss and grad norm agree."""
    # NOTE: Switch balancing and router z-loss are means per micro-batch, which depend on how the
    # batch is split; bias balancing uses all-reduced loads and is partition-free, so keep only it.
    common = [*TINY, "train.steps=5", "model.moe.balance_coef=0", "model.moe.router_z_coef=0"]
    one = run_train(tmp_path / "one", *common, "train.micro_batches=2")
    two = run_train(tmp_path / "two", *common, "train.micro_batches=1", nproc=2)
    assert one.returncode == 0, one.stderr[-3000:]
    assert two.returncode == 0, two.stderr[-3000:]
    assert "FutureWarning" not in two.stderr, two.stderr[-3000:]  # issue 38: DDP's and the mesh scan's, gone
    a = read_records(tmp_path / "one" / "metrics.jsonl")
    b = read_records(tmp_path / "two" / "metrics.jsonl")
    assert len(a) == len(b) == 5 and b[0]["world"] == 2
    for x, y in zip(a, b):
        assert x["batch"] == y["batch"] and x["valid_tokens"] == y["valid_tokens"]
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5)
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-4)
    assert a[-1]["eval"]["loss"] == pytest.approx(b[-1]["eval"]["loss"], rel=1e-5)
