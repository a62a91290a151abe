"""Sampling: the KV cache changes no id, a seed fixes the samples, a run samples through `python -m sample`."""
from __future__ import annotations

import pytest
import torch

import sample
from model import ModelConfig, MoEConfig, Transformer
from model.generate import KVCache, forward_cached, generate
from tests.helpers import run_train
from data.config import DataConfig

TEXT = "ROMEO: But soft, what light through yonder window breaks?\nJULIET: Ay me.\n" * 40


def tiny(moe: bool, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=37, seq_len=16, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, tie_embeddings=False, init_std=0.5,
                      moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=24, shared_expert=True, score="sigmoid",
                                    first_dense=1) if moe else None)
    model = Transformer(cfg).double().eval()
    # NOTE: a wide init (std 0.5, untied head) gives sharp logits that depend on the whole context,
    # so greedy has no near-ties to flip and does not settle into a constant stream.
    with torch.no_grad():
        if moe:
            for _, m in model.moe_layers():
                m.bias_E.copy_(torch.linspace(-0.1, 0.1, 4))  # a nonzero balancing bias routes as in training
    return model


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_cached_logits_equal_full_forward(moe):
    model = tiny(moe)
    tokens_BT = torch.randint(0, 37, (2, 16), generator=torch.Generator().manual_seed(1))
    full_BTV = model(tokens_BT).logits
    cache = KVCache.empty(model, 2)
    parts = [forward_cached(model, tokens_BT[:, :5], cache)] + [forward_cached(model, tokens_BT[:, t:t + 1], cache)
                                                                 for t in range(5, 16)]
    torch.testing.assert_close(torch.cat(parts, 1), full_BTV, rtol=1e-10, atol=1e-10)
    assert cache.nbytes() == 3 * 2 * (2 * 16 * 2 * 8) * 8  # layers · (k, v) · B·T·n_kv·d_head · fp64


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_greedy_with_cache_equals_without(moe):
    model = tiny(moe)
    prompt_BT = torch.tensor([[3, 7, 1], [5, 5, 2]])
    # 30 new tokens: past seq_len=16 the window crops, which both paths must do identically
    a = generate(model, prompt_BT, 30, temperature=0, use_cache=True)
    b = generate(model, prompt_BT, 30, temperature=0, use_cache=False)
    assert a.shape == (2, 33)
    assert torch.equal(a, b)
    assert len(set(a[0, 3:].tolist())) > 1  # not a degenerate constant stream


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
