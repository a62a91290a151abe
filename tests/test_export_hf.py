"""Export to transformers: the Llama / Qwen3 / Qwen2-MoE / Qwen3-MoE checkpoint gives ballast's logits, the
tokenizer ballast's ids; every model option is exported faithfully or refused in one line."""
from __future__ import annotations

import dataclasses
from dataclasses import fields, replace

import pytest
import torch

from checkpoint.export_check import tolerance
from checkpoint.export_hf import OPTIONS, export, main, refuse_reason
from data.tokenizers import build_tokenizer
from model import ModelConfig, MoEConfig, Transformer
from tests.helpers import run_train

transformers = pytest.importorskip("transformers", reason="the [hf] extra (transformers, safetensors) is not installed")
pytest.importorskip("safetensors", reason="the [hf] extra (transformers, safetensors) is not installed")

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak. Ünïcødé ok?\n" * 30


def tiny(**kw) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(**{"vocab_size": 256, "seq_len": 32, "d_model": 64, "n_layers": 2, "n_heads": 4, "init_std": 0.1,
                         **kw})
    model = Transformer(cfg).eval()
    with torch.no_grad():  # non-trivial norm weights, so a swapped or missing norm shows
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            if "router" in n:  # confident routing: a wrong expert mapping changes the logits a lot
                p.mul_(10)
    return model


# fp32 on both sides; the two implementations order the same sums differently, so a few ulps of the
# logits' scale (|logit| ~ 1-5 here): atol 1e-4, rtol 1e-4.
@pytest.mark.parametrize("kw", [dict(n_kv_heads=2, tie_embeddings=True), dict(tie_embeddings=False, rope_theta=500.0)],
                         ids=["gqa-tied", "mha-untied"])
def test_logits_match_through_transformers(tmp_path, kw):
    model = tiny(**kw)
    export(model, build_tokenizer("byte", ""), tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    tokens_BT = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours_BTV = model(tokens_BT).logits
        theirs_BTV = hf(tokens_BT).logits
    assert ours_BTV.abs().max() > 1.0  # logits large enough for a wrong RoPE layout to show
    torch.testing.assert_close(theirs_BTV, ours_BTV, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["byte", "char", "bpe"])
def test_tokenizer_ids_match(tmp_path, name):
    tok = build_tokenizer(name, TEXT, 300)
    model = tiny(tie_embeddings=True)
    export(model, tok, tmp_path / "hf")
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = TEXT[:200]
    ids = tok.encode(text).tolist()
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == ids
    assert hf_tok.decode(ids) == text


MOE = dict(n_experts=4, top_k=2, expert_hidden=32, first_dense=1, every=2)


@pytest.mark.parametrize("moe_kw", [dict(shared_expert=True, norm_topk=True), dict(shared_expert=False, norm_topk=False)],
                         ids=["shared-norm", "plain"])
def test_moe_logits_match_through_qwen2_moe(tmp_path, moe_kw):
    model = tiny(n_kv_heads=2, n_layers=4, moe=MoEConfig(**MOE, **moe_kw))
    assert [model.cfg.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    export(model, None, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen2MoeForCausalLM"
    tokens_BT = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens_BT).logits, model(tokens_BT).logits, atol=1e-4, rtol=1e-4)


def same_logits(model, out_dir) -> str:
    """Export, load through transformers, compare the logits (fp32, the tolerance above); the class's name."""
    export(model, None, out_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    tokens_BT = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens_BT).logits, model(tokens_BT).logits, atol=1e-4, rtol=1e-4)
    return type(hf).__name__


def test_every_model_option_has_an_export_decision():
    """A new ModelConfig or MoEConfig field fails here until OPTIONS says how it exports or why it cannot."""
    assert set(OPTIONS) == {f.name for f in fields(ModelConfig)} | {f"moe.{f.name}" for f in fields(MoEConfig)}


@pytest.mark.parametrize("key", list(OPTIONS))
def test_each_option_exports_faithfully_or_refuses_in_one_line(tmp_path, key):
    """The option's probe value on a tiny model (MoE options on the `moe` probe): the same logits through
    transformers, or a one-line refusal naming the key with nothing written."""
    probe = OPTIONS[key].probe
    if key.startswith("moe."):
        default, kw = getattr(MoEConfig(), key[4:]), {"moe": replace(OPTIONS["moe"].probe, **{key[4:]: probe})}
    else:
        default, kw = getattr(ModelConfig(), key), {key: probe}
    assert probe != default, f"{key}: the probe must differ from the default to exercise anything"
    model = tiny(**{"n_layers": 4, **kw})
    if refuse_reason(model) is None:
        same_logits(model, tmp_path / "hf")
        return
    with pytest.raises(ValueError) as e:
        export(model, None, tmp_path / "hf")
    assert str(e.value).startswith(f"cannot export to transformers: model.{key}=") and "\n" not in str(e.value)
    assert not (tmp_path / "hf").exists()


def softcap_model() -> Transformer:
    """A student's new option: a config flag (a Gemma-2 style logit soft-cap) and the forward that reads it."""
    import torch.nn.functional as F

    Student = dataclasses.make_dataclass("ModelConfig", [("logit_softcap", float, dataclasses.field(default=10.0))],
                                         bases=(ModelConfig,))
    torch.manual_seed(0)
    model = Transformer(Student(vocab_size=256, seq_len=32, d_model=64, n_layers=2, n_heads=4, init_std=0.1)).eval()
    cap = model.cfg.logit_softcap
    model.head.forward = lambda x_BTD: cap * torch.tanh(F.linear(x_BTD, model.head.weight) / cap)
    return model


@pytest.mark.parametrize("variant", ["softcap", "parallel_block"])
def test_an_option_the_export_does_not_know_is_refused_by_its_own_check(tmp_path, monkeypatch, variant):
    """A model option OPTIONS never heard of: a new config flag read by the forward, or a block variant (the
    parallel block, model/transformer.py's one block forward replaced). The export loads its conversion in
    transformers, compares the logits and refuses in one line naming the largest difference; nothing is
    written."""
    if variant == "parallel_block":
        from model.transformer import Block
        from tests.test_sample import parallel_block

        monkeypatch.setattr(Block, "_forward", parallel_block)
    model = softcap_model() if variant == "softcap" else tiny()
    assert refuse_reason(model) is None  # the option list has no say on it
    with pytest.raises(ValueError) as e:
        export(model, build_tokenizer("byte", ""), tmp_path / "hf")
    line = str(e.value)
    assert line.startswith("cannot export to transformers: LlamaForCausalLM's logits differ from ballast's by up to ")
    worst = float(line.split("by up to ")[1].split()[0])
    assert "\n" not in line and worst > 100 * tolerance(model.cfg)  # a difference no rounding explains
    assert not (tmp_path / "hf").exists()


def test_a_weight_transformers_would_initialise_at_random_is_refused(tmp_path, monkeypatch):
    """A conversion that forgets a tensor: transformers would fill it at random with a warning; the export's
    check names it and writes nothing."""
    import checkpoint.export_hf as ex

    convert = ex.hf_state_dict
    monkeypatch.setattr(ex, "hf_state_dict", lambda m: {k: v for k, v in convert(m).items()
                                                        if k != "model.layers.1.post_attention_layernorm.weight"})
    with pytest.raises(ValueError, match=r"^cannot export to transformers: the converted checkpoint lacks "
                                         r"model\.layers\.1\.post_attention_layernorm\.weight \(LlamaForCausalLM\)$"):
        export(tiny(), None, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("kw, cls", [(dict(), "Qwen3ForCausalLM"),
                                     (dict(moe=MoEConfig(**MOE)), "Qwen3MoeForCausalLM")], ids=["dense", "moe"])
def test_qk_norm_exports_to_qwen3(tmp_path, kw, cls):
    """Qwen3's q_norm / k_norm: per head over head_dim, before RoPE, one gain each (tiny() makes them non-trivial)."""
    assert same_logits(tiny(qk_norm=True, n_kv_heads=2, n_layers=4, **kw), tmp_path / "hf") == cls


@pytest.mark.parametrize("kw,why", [(dict(moe=MoEConfig(**MOE)), "balancing bias of layer 1 is nonzero"),
                                    (dict(qk_norm=True, moe=MoEConfig(**MOE, shared_expert=True)),
                                     "model.qk_norm=true: Qwen3-MoE")])
def test_refuses_what_transformers_cannot_express(tmp_path, kw, why):
    model = tiny(**kw)
    if "bias" in why:
        model.blocks[1].mlp.bias_E[0] = 0.01  # what bias_update_speed > 0 leaves after training
    with pytest.raises(ValueError, match=why):
        export(model, None, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_export_cli_from_a_run(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    run = tmp_path / "run"
    r = run_train(run, "+experiment=shakespeare_char", f"data.path={text}", "train.steps=2", "checkpoint.every=2",
                  "checkpoint.mode=sync", "train.eval_every=2", "train.eval_samples=12", "train.eval_batch_size=12",
                  "logging.wandb=disabled", "logging.progress=false", "logging.plot=false", "threads=1",
                  "train.compile=false", "model.d_model=32", "model.n_layers=1", "model.n_heads=2",
                  "data.seq_len=32", "optim.schedule.warmup_steps=1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert main([str(run), str(tmp_path / "hf")]) == 0
    from checkpoint.load import load_model
    model, ds, _, _ = load_model(run)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids_BT = torch.tensor([hf_tok("First Citizen:\nBefore", add_special_tokens=False)["input_ids"]])
    assert ids_BT[0].tolist() == ds.tokenizer.encode("First Citizen:\nBefore").tolist()
    with torch.no_grad():
        torch.testing.assert_close(hf(ids_BT).logits, model(ids_BT).logits, atol=1e-4, rtol=1e-4)
