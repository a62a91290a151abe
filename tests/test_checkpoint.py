"""Checkpoint protocol, in process: exact state round trip, publish/retention, corruption, failed and
async saves, resume checks. (New-process resume and SIGKILL drills: test_resume.py, test_checkpoint_crash.py.)"""
from __future__ import annotations

import hashlib
import json
import random
import threading

import numpy as np
import pytest
import torch

from checkpoint import Checkpointer, Saver, TrainState, publish, read_tensors, resume_options
from checkpoint.checkpointer import supersede_records
from checkpoint.config import CheckpointConfig, ResumeConfig
from checkpoint.resume import check_config, check_data, check_model
from data import build_data
from data.config import DataConfig
from data.loader import Loader
from helpers import HANG_S, model_config
from model import Transformer
from optim import build_optimizer, build_scheduler, clip_grad_norm
from optim.accumulate import count_valid_tokens, forward_backward, reduce_step_sums
from optim.config import OptimConfig
from optim.scaler import DynamicLossScaler
from parallel import Dist

DATA = {"kind": "synthetic", "seq_len": 16, "min_doc_len": 4, "seed": 5,
        "sources": [{"name": "markov", "kind": "markov", "weight": 0.5, "alphabet": 8, "order": 1, "support": 2},
                    {"name": "copy", "kind": "copy", "weight": 0.5, "alphabet": 8, "segment": 3}]}
MODEL = {"d_model": 16, "n_layers": 2, "n_heads": 2, "swiglu_clamp": 10.0,
         "moe": {"n_experts": 4, "top_k": 2, "expert_hidden": 16, "first_dense": 1, "every": 1,
                 "score": "sigmoid", "balance_coef": 0.0, "bias_update_speed": 0.01}}
OPTIM = {"lr": 1e-2, "betas": [0.9, 0.95], "weight_decay": 0.1,
         "groups": [{"name": "no_decay", "kinds": ["norm", "embedding", "router"], "weight_decay": 0.0}],
         "schedule": {"name": "cosine", "warmup_steps": 2, "min_lr_ratio": 0.1}}
SOLO = Dist(rank=0, world=1, local_rank=0, device=torch.device("cpu"), backend=None)


pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
              pytest.mark.usefixtures("one_thread")]


def make_state(seed=0, data=DATA, model=MODEL, steps=10) -> TrainState:
    torch.manual_seed(seed)
    ds = build_data(DataConfig.from_dict(data))
    m = Transformer(model_config({**model, "vocab_size": ds.vocab_size, "seq_len": ds.seq_len}))
    opt_cfg = OptimConfig.from_dict(OPTIM)
    opt, _ = build_optimizer(m, opt_cfg)
    sched = build_scheduler(opt, opt_cfg.schedule, steps)
    config = {"seed": seed, "model": model, "optim": OPTIM, "data": data,
              "train": {"steps": steps, "batch_size": 4, "micro_batches": 2, "z_loss": 1e-4, "max_grad_norm": 1.0},
              "checkpoint": {"every": 0, "dir": None, "mode": "sync", "keep_last": 2, "keep_every": None,
                             "verify_hashes": True, "stop_after": None},
              "resume": None}
    return TrainState(m, opt, sched, Loader(ds, 4), config)


def train_steps(st: TrainState, n: int) -> list[float]:
    """The train.py step, reduced: every piece of state a step touches, touched the same way."""
    losses = []
    for _ in range(n):
        micro = st.loader.next().micro_batches(2)
        n_valid = count_valid_tokens(micro, "cpu")
        sums = forward_backward(st.model, micro, n_valid, 1e-4, 1, 2)
        clip_grad_norm(st.model.parameters(), 1.0)
        st.optimizer.step()
        st.scheduler.step()
        st.optimizer.zero_grad(set_to_none=True)
        stats = reduce_step_sums(sums, n_valid.item())
        for layer, moe in st.model.moe_layers():
            moe.update_bias(stats["moe_load"][layer])
        st.step += 1
        st.tokens += int(n_valid.item())
        losses.append(stats["loss"])
    return losses


def draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def save(st: TrainState, root, mode="sync", **kw) -> Saver:
    saver = Saver(root, mode, **kw)
    saver.save(publish.step_name(st.step), st.state_dict(), {"step": st.step})
    saver.close()
    return saver


def test_state_round_trip_continues_bit_identically(tmp_path):
    a = make_state(seed=0)
    a.extras = {"loss_scaler": DynamicLossScaler()}
    train_steps(a, 3)
    a.extras["loss_scaler"].update(found_inf=True)  # a backed-off scale and a counted skip
    random.seed(11), np.random.seed(11), torch.manual_seed(11)  # streams mid-way, not at a seed
    save(a, tmp_path)
    saved_tokens = a.tokens
    expect_draws = draws()
    expect_losses = train_steps(a, 3)

    b = make_state(seed=1)  # other init, other RNG: everything must come from the checkpoint
    b.extras = {"loss_scaler": DynamicLossScaler()}
    b.load(tmp_path / "step_000003", saved_world=1)
    assert (b.step, b.tokens) == (3, saved_tokens)
    scaler = b.extras["loss_scaler"].state_dict()
    assert scaler == a.extras["loss_scaler"].state_dict() != DynamicLossScaler().state_dict()
    assert draws() == expect_draws
    assert train_steps(b, 3) == expect_losses  # bit-identical, not approximately
    assert (b.step, b.tokens, b.loader.samples_consumed) == (a.step, a.tokens, a.loader.samples_consumed)
    assert b.scheduler.get_last_lr() == a.scheduler.get_last_lr()
    for (name, x), y in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(x, y), name
    bias = [m.bias_E for _, m in b.model.moe_layers()]
    assert all(v.abs().sum() > 0 for v in bias)  # the balancing bias moved and came back
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    for i in sa:
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(sa[i][k], sb[i][k]), (i, k)


def test_publish_writes_marker_last_and_retention_keeps_last_k_plus_every_m(tmp_path):
    saver = Saver(tmp_path, "sync", keep_last=2, keep_every=3)
    for step in range(1, 8):
        saver.save(publish.step_name(step), {"w": torch.full((5,), float(step)), "step": step}, {"step": step})
    assert all(err is None for _, _, err in saver.close())
    kept = {s for s, _ in publish.list_steps(tmp_path)}
    assert kept == {s for s in range(1, 8) if s >= 6 or s % 3 == 0} == {3, 6, 7}
    assert publish.read_latest(tmp_path) == "step_000007"
    ckpt = tmp_path / "step_000007"
    marker = json.loads((ckpt / publish.MARKER).read_text())
    files = {p.name for p in ckpt.iterdir()} - {publish.MARKER}
    assert set(marker["files"]) == files and ".metadata" in files
    for name, want in marker["files"].items():  # hashes recomputed independently
        assert hashlib.sha256((ckpt / name).read_bytes()).hexdigest() == want["sha256"]
    assert read_tensors(ckpt)["w"].tolist() == [7.0] * 5
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp or trash left


def _truncate(ckpt):
    f = next(ckpt.glob("*.distcp"))
    f.write_bytes(f.read_bytes()[:-10])


def _flip_byte(ckpt):
    f = next(ckpt.glob("*.distcp"))
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, reason", [
    (_truncate, "truncated"),
    (lambda c: (c / publish.MARKER).unlink(), "no marker.json"),
    (_flip_byte, "sha256"),
])
def test_damaged_latest_falls_back_with_a_note_and_explicit_path_errors(tmp_path, damage, reason):
    saver = Saver(tmp_path, "sync", keep_last=5)
    for step in (1, 2):
        saver.save(publish.step_name(step), {"w": torch.full((64,), float(step))}, {"step": step})
    damage(tmp_path / "step_000002")
    path, notes = publish.resolve("latest", tmp_path)
    assert path.name == "step_000001" and len(notes) == 1
    assert "step_000002" in notes[0] and reason in notes[0] and "falling back" in notes[0]
    assert read_tensors(path)["w"][0].item() == 1.0
    with pytest.raises(ValueError, match=reason):
        publish.resolve(str(tmp_path / "step_000002"), tmp_path)
    (tmp_path / "step_000001" / publish.MARKER).unlink()
    with pytest.raises(ValueError, match="no complete checkpoint"):
        publish.resolve("latest", tmp_path)


def test_newer_directory_without_latest_pointer_is_not_committed(tmp_path):
    saver = Saver(tmp_path, "sync")
    for step in (1, 2):
        saver.save(publish.step_name(step), {"w": torch.zeros(2)}, {"step": step})
    publish.set_latest(tmp_path, "step_000001")  # killed between the rename and the pointer move
    path, notes = publish.resolve("latest", tmp_path)
    assert path.name == "step_000001" and "never committed" in notes[0]


class DCPFailure(BaseException):
    """What torch.distributed.checkpoint raises for a rank's failure (CheckpointException): not an Exception,
    its message every rank's traceback, the cause in `failures`."""

    def __init__(self, cause: BaseException):
        super().__init__("CheckpointException ranks:dict_keys([0])\nTraceback (most recent call last): ...\n")
        self.failures = {0: (cause, None)}


@pytest.mark.parametrize("stage", ["write", "marker", "base_exception"])
def test_failed_save_never_touches_the_last_good_checkpoint(tmp_path, monkeypatch, stage):
    saver = Saver(tmp_path, "async", keep_last=1)
    saver.save("step_000001", {"w": torch.ones(32)}, {"step": 1})
    saver.wait()
    good = {p.name: p.read_bytes() for p in (tmp_path / "step_000001").iterdir()}

    def broken_write(tmp, sd):  # half a file, then the disk fills up
        (tmp / "__0_0.distcp").write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    def broken_marker(tmp, info):
        raise OSError(5, "I/O error")

    def dcp_failure(tmp, sd):  # DCP's wrapper: a BaseException whose message is a traceback, the cause inside
        (tmp / "__0_0.distcp").write_bytes(b"partial")
        raise DCPFailure(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"))

    if stage == "write":
        monkeypatch.setattr(saver, "_write", broken_write)
    elif stage == "base_exception":
        monkeypatch.setattr(saver, "_write", dcp_failure)
    else:
        monkeypatch.setattr(publish, "write_marker", broken_marker)
    saver.save("step_000002", {"w": torch.zeros(32)}, {"step": 2})
    done = saver.close()
    assert done[0][0] == "step_000001" and done[0][2] is None
    name, _, error = done[1]
    assert name == "step_000002" and error is not None and "\n" not in error.line
    expect = {"write": ("OSError: [Errno 28]", True), "marker": ("OSError: [Errno 5]", False),
              "base_exception": ("RuntimeError: [enforce fail", False)}[stage]
    assert error.line.removeprefix("disk full: ").startswith(expect[0]) and error.disk_full == expect[1], error
    assert publish.read_latest(tmp_path) == "step_000001"
    assert {p.name: p.read_bytes() for p in (tmp_path / "step_000001").iterdir()} == good
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000001"]  # no temp left behind


def test_async_snapshot_excludes_changes_after_the_snapshot_point(tmp_path, monkeypatch):
    st = make_state()
    train_steps(st, 2)
    saver = Saver(tmp_path, "async")
    release, order = threading.Event(), []
    real_write = saver._write

    def slow_write(tmp, sd):  # hold the background write until the main thread has moved on
        order.append(("start", tmp.name))
        release.wait(timeout=HANG_S)  # a hang guard only: the test sets it
        real_write(tmp, sd)
        order.append(("end", tmp.name))

    monkeypatch.setattr(saver, "_write", slow_write)
    before = {k: v.clone() for k, v in st.model.state_dict().items()}
    moments = {k: v["exp_avg"].clone() for k, v in st.tensors()[1]["state"].items()}  # keyed by name
    lr_before = st.scheduler.get_last_lr()
    saver.save("step_000002", st.state_dict(), {"step": 2})
    # save() came back while its write is still held: it did not wait for the write (no clock needed)
    assert saver.busy and ("end", ".tmp-step_000002") not in order
    train_steps(st, 1)  # mutates parameters, moments, bias, lr, cursor while the write waits
    with torch.no_grad():
        for p in st.model.parameters():
            p.add_(1.0)

    second = threading.Thread(target=saver.save, args=("step_000003", st.state_dict(), {"step": 3}))
    second.start()  # must wait for the first save, not interleave with it
    second.join(timeout=0.5)  # NOTE: a slow machine only makes this check weaker, never false
    assert order == [("start", ".tmp-step_000002")]
    release.set()
    second.join()
    saver.close()
    assert order == [("start", ".tmp-step_000002"), ("end", ".tmp-step_000002"),
                     ("start", ".tmp-step_000003"), ("end", ".tmp-step_000003")]

    got = read_tensors(tmp_path / "step_000002")
    for k, v in before.items():
        if f"model.{k}" in got:
            assert torch.equal(got[f"model.{k}"], v), k
    assert any("bias_E" in k for k in got)
    for name, m in moments.items():
        assert torch.equal(got[f"optim.state.{name}.exp_avg"], m), name
    restored = make_state(seed=3)
    restored.load(tmp_path / "step_000002", saved_world=1)
    assert restored.scheduler.get_last_lr() == lr_before and restored.loader.samples_consumed == 8


def test_resume_checks_name_the_difference():
    st = make_state()
    cfg = st.config
    bigger = {**cfg, "model": {**cfg["model"], "d_model": 32}}
    with pytest.raises(ValueError, match=r"model\.d_model=32 but checkpoint step_000004 has model\.d_model=16"):
        check_config(cfg, bigger, [], "step_000004")
    notes = check_config(cfg, {**cfg, "train": {**cfg["train"], "steps": 20}}, ["train.steps"], "step_000004")
    assert len(notes) == 1 and "train.steps=20" in notes[0]
    # micro-batching, logging, checkpoint cadence may change freely
    assert check_config(cfg, {**cfg, "train": {**cfg["train"], "micro_batches": 4}}, [], "x") == []
    # a key newer than the checkpoint's code: its default is what that code ran; another value is a change
    newer = {**cfg, "model": {**cfg["model"], "new_knob": None}}
    assert check_config(cfg, newer, [], "x", defaults={"model": {"new_knob": None}}) == []
    with pytest.raises(ValueError, match=r"model\.new_knob=2 but checkpoint x has model\.new_knob=<absent>"):
        check_config(cfg, {**cfg, "model": {**cfg["model"], "new_knob": 2}}, [], "x", defaults={"model": {"new_knob": None}})

    shapes = {k: tuple(v.shape) for k, v in st.model.state_dict().items()}
    check_model(shapes, st.model.state_dict(), "x")
    with pytest.raises(ValueError, match="tok_emb.weight has shape"):
        check_model({**shapes, "tok_emb.weight": (3, 3)}, st.model.state_dict(), "x")
    with pytest.raises(ValueError, match="lacks"):
        check_model({**shapes, "extra.weight": (1,)}, st.model.state_dict(), "x")
    with pytest.raises(ValueError, match="resume.allow_data_change=true"):
        check_data("a" * 64, "b" * 64, False, "x")
    assert "allow_data_change" in check_data("a" * 64, "b" * 64, True, "x")[0]


def _checkpointer(st, tmp_path, resume):
    cfg = {**st.config, "resume": resume}
    return Checkpointer(CheckpointConfig(**cfg["checkpoint"]), ResumeConfig(**resume) if isinstance(resume, dict)
                        else resume, cfg["train"]["steps"], SOLO, tmp_path / "run",
                        TrainState(st.model, st.optimizer, st.scheduler, st.loader, cfg))


def test_checkpointer_resume_refuses_other_model_and_data_then_allows_declared_data_change(tmp_path):
    a = make_state()
    train_steps(a, 2)
    save(a, tmp_path / "run" / "checkpoints")

    wide = make_state(model={**MODEL, "d_model": 32})
    with pytest.raises(ValueError, match="model.d_model") as e:
        _checkpointer(wide, tmp_path, "latest").resume()
    assert "\n" not in str(e.value)

    other = {**DATA, "seed": 6}
    moved = make_state(data=other)
    moved.config["data"] = other
    with pytest.raises(ValueError, match="resume.allow_data_change"):
        _checkpointer(moved, tmp_path, "latest").resume()
    ck = _checkpointer(moved, tmp_path, {"path": "latest", "allow_data_change": True})
    ck.resume()
    assert ck.state.step == 2 and ck.state.loader.samples_consumed == 8 and ck.ckpt_id == "step_000002"
    assert any("data changed" in e for e in ck.pop_events())


def test_resume_options_shorthand_and_full_form():
    assert resume_options(None) == (None, False, [])
    assert resume_options("latest") == ("latest", False, [])
    full = ResumeConfig(path="latest", allow_data_change=True, allow_config_change=["train.steps"])
    assert resume_options(full) == ("latest", True, ["train.steps"])


def test_supersede_records_truncates_in_place(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 6)) + '{"step": 6, "lo')
    appender = open(path, "a", buffering=1)  # the JSONL sink, opened before the resume
    assert supersede_records(path, 3) == 3
    appender.write(json.dumps({"step": 4}) + "\n")
    appender.close()
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3, 4]
    assert (tmp_path / "metrics.superseded.jsonl").read_text().count("\n") == 2
