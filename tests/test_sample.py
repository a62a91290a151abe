"""Sampling: the KV cache changes no logit and no id for any model option, a seed fixes the samples, a run samples
through `python -m sample`."""
from __future__ import annotations

from dataclasses import fields, replace

import pytest
import torch

import sample
from checkpoint.export_hf import OPTIONS
from model import ModelConfig, MoEConfig, Transformer
from model.generate import KVCache, forward_cached, generate
from tests.helpers import run_train
from data.config import DataConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: a second thread only spin-waits (conftest.py)

TEXT = "ROMEO: But soft, what light through yonder window breaks?\nJULIET: Ay me.\n" * 40


def tiny(moe: bool, seed: int = 0) -> Transformer:
    return sharpen(ModelConfig(vocab_size=37, seq_len=16, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2,
                               tie_embeddings=False, init_std=0.5,
                               moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=24, shared_expert=True,
                                             score="sigmoid", first_dense=1) if moe else None), seed)


def sharpen(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """The model in fp64, in eval mode, with what a trained one has and an init lacks: norm gains away from 1
    (so a skipped norm shows) and a nonzero MoE balancing bias (it routes as in training)."""
    torch.manual_seed(seed)
    model = Transformer(cfg).double().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
        for _, m in model.moe_layers():
            m.bias_E.copy_(torch.linspace(-0.1, 0.1, m.n_experts))
    return model


# NOTE: a wide init (std 0.5) gives sharp logits that depend on the whole context, so greedy has no near-ties
# to flip and does not settle into a constant stream. Every probe value of OPTIONS differs from these.
BASE = dict(vocab_size=37, seq_len=16, d_model=32, n_layers=4, n_heads=4, init_std=0.5)
OPTION_KEYS = [f.name for f in fields(ModelConfig)] + [f"moe.{f.name}" for f in fields(MoEConfig)]


def with_option(key: str) -> Transformer:
    """BASE with one model option at its probe value (checkpoint/export_hf.py OPTIONS declares one per option;
    a `moe.*` option on the `moe` probe)."""
    probe = OPTIONS[key].probe  # a KeyError: a model option with no declared probe (and no export decision)
    if key.startswith("moe."):
        kw = {"moe": replace(OPTIONS["moe"].probe, **{key[4:]: probe})}
    else:
        assert probe != BASE.get(key, getattr(ModelConfig(), key)), f"{key}: the probe must change the model"
        kw = {key: probe}
    return sharpen(ModelConfig(**{**BASE, **kw}))


@pytest.mark.parametrize("key", OPTION_KEYS)
def test_cached_logits_equal_full_forward_for_every_model_option(key):
    """Prefill, then one position at a time through the KV cache: the full forward's logits (fp64)."""
    model = with_option(key)
    B, T, V = 2, model.cfg.seq_len, model.cfg.vocab_size
    tokens_BT = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    full_BTV = model(tokens_BT).logits
    cache = KVCache.empty(model, B)
    parts = [forward_cached(model, tokens_BT[:, :5], cache)] + [forward_cached(model, tokens_BT[:, t:t + 1], cache)
                                                                 for t in range(5, T)]
    torch.testing.assert_close(torch.cat(parts, 1), full_BTV, rtol=1e-10, atol=1e-10)
    cfg = model.cfg
    assert cache.length == T and cache.nbytes() == cfg.n_layers * 2 * (B * T * cfg.kv_heads * cfg.head_dim) * 8
    with pytest.raises(ValueError, match=f"KV cache: {T} \\+ 1 positions > model.seq_len={T}"):
        forward_cached(model, tokens_BT[:, :1], cache)


@pytest.mark.parametrize("key", OPTION_KEYS)
def test_greedy_with_cache_equals_without_for_every_model_option(key):
    model = with_option(key)
    prompt_BT = torch.tensor([[3, 7, 1], [5, 5, 2]])
    # past seq_len the window crops, which both paths must do identically
    n = model.cfg.seq_len + 6
    a = generate(model, prompt_BT, n, temperature=0, use_cache=True)
    b = generate(model, prompt_BT, n, temperature=0, use_cache=False)
    assert a.shape == (2, 3 + n) and torch.equal(a, b)


def parallel_block(self, x_BTD, cos_TF, sin_TF, route_ids_BTk, valid_BT, router_only, kv):
    """A student's block variant (GPT-J / PaLM parallel block, dense): attention and MLP read the same input."""
    return x_BTD + self.attn(self.attn_norm(x_BTD), cos_TF, sin_TF, kv=kv) + self.mlp(self.mlp_norm(x_BTD)), None


def test_a_block_variant_is_one_edit_for_training_checkpointing_and_decoding(monkeypatch):
    """model/transformer.py's Block._forward is the one block forward: replaced, the variant trains (the same
    gradient under activation checkpointing as without) and decodes (cached = full forward)."""
    from model.transformer import Block

    tokens_BT = torch.randint(0, 37, (2, 16), generator=torch.Generator().manual_seed(1))
    sequential_BTV = tiny(False)(tokens_BT).logits
    monkeypatch.setattr(Block, "_forward", parallel_block)
    model = tiny(False)
    full_BTV = model(tokens_BT).logits
    assert not torch.allclose(full_BTV, sequential_BTV)  # the variant is in use
    cache = KVCache.empty(model, 2)
    cached_BTV = torch.cat([forward_cached(model, tokens_BT[:, :4], cache),
                            forward_cached(model, tokens_BT[:, 4:], cache)], 1)
    torch.testing.assert_close(cached_BTV, full_BTV, rtol=1e-10, atol=1e-10)
    grads = []
    for mode in ("none", "full"):
        model.zero_grad(set_to_none=True)
        for block in model.blocks:
            block.checkpointing = mode
        model(tokens_BT, tokens_BT).loss_sum.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_sampling_is_deterministic_for_a_seed():
    model = tiny(True)
    prompt_BT = torch.tensor([[3, 7, 1]] * 3)
    kw = dict(temperature=1.0, top_k=20, top_p=0.95)
    a = generate(model, prompt_BT, 12, seed=5, **kw)
    assert torch.equal(a, generate(model, prompt_BT, 12, seed=5, **kw))
    assert torch.equal(a, generate(model, prompt_BT, 12, seed=5, use_cache=False, **kw))
    assert not torch.equal(a, generate(model, prompt_BT, 12, seed=6, **kw))
    assert not torch.equal(a[0], a[1])  # each sample of a batch draws its own ids
    top1 = generate(model, prompt_BT, 12, temperature=1.0, top_k=1, seed=9)
    assert torch.equal(top1, generate(model, prompt_BT, 12, temperature=0))  # top-k 1 is greedy


def test_sample_cli_on_a_char_run(tmp_path, capsys):
    text = tmp_path / "tiny.txt"
    text.write_text(TEXT)
    run = tmp_path / "run"
    r = run_train(run, "+experiment=shakespeare_char", f"data.path={text}", "train.steps=3", "checkpoint.every=3",
                  "checkpoint.mode=sync", "train.eval_every=3", "train.eval_samples=12", "train.eval_batch_size=12",
                  "logging.wandb=disabled", "logging.progress=false", "logging.plot=false", "threads=1",
                  "train.compile=false", "model.d_model=32", "model.n_layers=2", "model.n_heads=2",
                  "data.seq_len=32", "optim.schedule.warmup_steps=1")
    assert r.returncode == 0, r.stderr[-3000:]
    bare = tmp_path / "bare"  # a run dir whose run saved nothing
    bare.mkdir()
    (bare / "config.yaml").write_text((run / "config.yaml").read_text().replace(str(run), str(bare)))
    assert sample.main([str(bare)]) == 2
    assert "no checkpoints" in capsys.readouterr().err
    args = [str(run), "--prompt", "ROMEO:", "--max-new-tokens", "20", "--temperature", "0.8", "--top-k", "5",
            "--seed", "1", "--num-samples", "2"]
    assert sample.main(args) == 0
    out = capsys.readouterr().out
    bodies = out.split("--- sample ")[1:]
    assert len(bodies) == 2 and all(b.split("\n", 1)[1].startswith("ROMEO:") for b in bodies)
    assert set("".join(b.split("\n", 1)[1] for b in bodies)) <= set(TEXT)  # char vocabulary only
    assert sample.main(args) == 0 and capsys.readouterr().out == out  # seeded
    assert sample.main([str(run), "--prompt", "ROMEO: ¿qué?"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'¿'" in err


def test_synthetic_prompts_are_ids_or_a_source_name():
    from data import build_data
    from tests.test_data import SYN

    ds = build_data(DataConfig.from_dict(SYN))
    bos = [r.start for r in ds.token_ranges()]
    assert sample.encode_prompt(ds, "copy") == [bos[1]]
    assert sample.encode_prompt(ds, f"{bos[0]} {bos[0] + 3}") == [bos[0], bos[0] + 3]
    assert sample.decode(ds, [bos[0], bos[0] + 3]) == f"{bos[0]} {bos[0] + 3}"
    for bad in ("ROMEO:", f"{ds.vocab_size}"):
        with pytest.raises(ValueError, match="--prompt="):
            sample.encode_prompt(ds, bad)
    assert "markov: BOS" in sample.vocabulary_note(ds)
