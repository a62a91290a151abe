"""Export a run to a Hugging Face checkpoint that `transformers` loads with no custom code, in the class
that computes exactly what ballast does: dense → Llama, dense + QK-norm → Qwen3, MoE → Qwen2-MoE,
MoE + QK-norm → Qwen3-MoE.

    python -m checkpoint.export_hf runs/<run> out/hf [--checkpoint PATH]
    # then: transformers.AutoModelForCausalLM.from_pretrained("out/hf"); AutoTokenizer.from_pretrained("out/hf")

Needs the optional extra `pip install -e '.[hf]'` (safetensors to write, transformers to prove it).

The export proves itself before it writes (checkpoint/export_check.py): it stages the files, loads them
through transformers as a user will, and compares the logits with ballast's on a probe batch; a missing or
unread weight, or logits apart by more than FP32 rounding allows, refuses in one line naming the largest
difference, and nothing is written. That holds for an option OPTIONS does not know as for one it maps.

Writes config.json, model.safetensors (fp32) and, for data=text runs, the tokenizer:
tokenizer.json + tokenizer_config.json for a PreTrainedTokenizerFast whose ids equal the run's ids:
  byte  a byte-level BPE with the 256 byte symbols and no merges: id = the UTF-8 byte value
  char  a word-level vocabulary of the run's characters, one token per character, decoded by fusing
  bpe   the run's own trained tokenizer
Synthetic runs have no text; no tokenizer is written (ids are the model's interface).

Every model option (each field of ModelConfig and MoEConfig) is declared once in OPTIONS: how
transformers gets it, or why a value is refused (one line naming the key, before any conversion);
tests/test_export_hf.py exports each option's probe value, so a new option without a decision fails there.

The mapping, ballast → Llama:
  qkv (fused, heads [q | k | v])  → q_proj, k_proj, v_proj, with the q and k rows of every head permuted:
      ballast's RoPE rotates interleaved pairs (x[2i], x[2i+1]) by angle t·θ_i; Llama's rotate_half rotates
      (x[i], x[i + d/2]) by the same angle. Reordering each head's output rows to [0, 2, 4, …, 1, 3, 5, …]
      turns one into the other, and q·k is unchanged because q and k get the same permutation.
  SwiGLU w_gate_up (rows [gate | up]) → gate_proj, up_proj;  w_down → down_proj
  RMSNorm weights and eps, rope_theta, tied embeddings (the head is not written when tied).
QK-norm (→ Qwen3, Qwen3-MoE): both normalise each q and k head over head_dim before RoPE with one gain per
  q and one per k and the model's rms_norm_eps, as ballast does; the gains get the heads' row permutation
  (a norm over head_dim does not care about the order, its gain does).
MoE (→ Qwen2-MoE): router → mlp.gate, experts → mlp.experts.<e>.{gate,up,down}_proj, dense layers
  listed in mlp_only_layers; the shared expert's sigmoid gate is written as zeros (sigmoid(0) = 0.5 exactly)
  with its down_proj doubled, or as an all-zero expert when ballast has none; q/k/v biases as zeros.
  Qwen3-MoE: the same experts and router, no shared expert and no q/k/v biases.
Refused with one line (OPTIONS): model.swiglu_clamp, sigmoid router scores, QK-norm with a shared expert;
and, from the weights, a nonzero balancing bias (Qwen's MoE classes select by the scores alone).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from einops import rearrange

from checkpoint.export_check import verify
from model.config import ModelConfig, MoEConfig


@dataclass(frozen=True)
class Option:
    """The export's decision on one model option: `how` transformers gets it, and `refuse`, for the values
    it cannot express, why (None: every value exports). `probe`: a non-default value that the export
    test builds a tiny model with (d_model 64, 4 heads, 4 layers; `moe.*` on the `moe` probe) and exports,
    or sees refused; the sampling test (tests/test_sample.py) decodes the same probe with and without
    the KV cache."""
    how: str
    probe: object
    refuse: Callable[[ModelConfig], str | None] | None = None


NO_CLAMP = ("Llama's and Qwen's MLPs cannot clamp; whether the clamp binds depends on the inputs, so an export "
            "could silently change the model")
TRAINING = "training only: the trained weights carry it; nothing to export"
OPTIONS: dict[str, Option] = {
    "vocab_size": Option("vocab_size (embedding rows)", 300),
    "seq_len": Option("max_position_embeddings", 48),
    "d_model": Option("hidden_size", 48),
    "n_layers": Option("num_hidden_layers", 3),
    "n_heads": Option("num_attention_heads, head_dim", 2),
    "n_kv_heads": Option("num_key_value_heads", 2),
    "mlp_hidden": Option("intermediate_size", 96),
    "mlp_multiple_of": Option("intermediate_size (8/3·d_model rounded up to a multiple of it)", 100),
    "rope_theta": Option("rope_theta / rope_parameters", 500.0),
    "norm_eps": Option("rms_norm_eps (every RMSNorm, the q/k norms too)", 1e-3),
    "tie_embeddings": Option("tie_word_embeddings (lm_head written only when untied)", False),
    "init_std": Option("initializer_range (" + TRAINING + ")", 0.05),
    "swiglu_clamp": Option("refused when set", 10.0, lambda c: c.swiglu_clamp is not None and NO_CLAMP),
    "qk_norm": Option("Qwen3 / Qwen3-MoE q_norm, k_norm", True, lambda c: c.qk_norm and c.moe is not None
                      and c.moe.shared_expert and "Qwen3-MoE, the transformers class with q/k norms and experts, "
                      "has no shared expert (model.moe.shared_expert=true)"),
    "moe": Option("Qwen2-MoE / Qwen3-MoE", MoEConfig(n_experts=4, top_k=2, expert_hidden=32)),
    "moe.n_experts": Option("num_experts", 6),
    "moe.top_k": Option("num_experts_per_tok", 1),
    "moe.expert_hidden": Option("moe_intermediate_size", 16),
    "moe.shared_expert": Option("Qwen2-MoE shared_expert (gate 0, down ×2)", True),
    "moe.score": Option("softmax only", "sigmoid", lambda c: c.moe.score != "softmax" and
                        "Qwen2-MoE and Qwen3-MoE (the transformers classes with ballast's layout) route with "
                        "softmax scores only"),
    "moe.norm_topk": Option("norm_topk_prob (ballast never renormalises one expert's weight)", False),
    "moe.first_dense": Option("mlp_only_layers", 2),
    "moe.every": Option("mlp_only_layers", 2),
    "moe.balance_coef": Option(TRAINING, 0.0),
    "moe.bias_update_speed": Option(TRAINING + "; the nonzero selection bias it trains is refused", 0.01),
    "moe.router_z_coef": Option(TRAINING, 0.001),
}


def _hydra(value) -> str:
    """A value as an override spells it: true, false, null."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def refuse_reason(model) -> str | None:
    """The one-line reason transformers cannot hold this model (the first refused option, then the
    weights' own check), or None."""
    cfg = model.cfg
    for key, opt in OPTIONS.items():
        if opt.refuse is not None and (cfg.moe is not None or not key.startswith("moe.")):
            why = opt.refuse(cfg)
            if why:
                value = getattr(cfg.moe, key[4:]) if key.startswith("moe.") else getattr(cfg, key)
                return f"model.{key}={_hydra(value)}: {why}"
    biased = [i for i, m in model.moe_layers() if bool(m.bias_E.ne(0).any())]
    if biased:
        return (f"the MoE balancing bias of layer {biased[0]} is nonzero (model.moe.bias_update_speed > 0): "
                "Qwen's MoE classes have no selection bias, so they would route tokens to other experts")
    return None


def rope_rows(head_dim: int):
    """Permutation of one head's rows: interleaved RoPE pairs → rotate-half pairs."""
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])


def llama_config(cfg) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.seq_len, "rms_norm_eps": cfg.norm_eps,
        # NOTE: both spellings: transformers >= 5 reads rope_parameters, 4.x reads rope_theta.
        "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "mlp_bias": False,
        "initializer_range": cfg.init_std, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
        "torch_dtype": "float32", "use_cache": True,
    }


def _moe_keys(model) -> dict:
    """What Qwen2-MoE and Qwen3-MoE share: a softmax router, top-k, optional renormalisation, dense layers
    by mlp_only_layers. NOTE: ballast never renormalises a single expert's weight (model/moe.py), Qwen does
    when norm_topk_prob is set, so k = 1 exports as False."""
    cfg, moe = model.cfg, model.cfg.moe
    return {"num_experts": moe.n_experts, "num_experts_per_tok": moe.top_k,
            "norm_topk_prob": moe.norm_topk and moe.top_k > 1, "moe_intermediate_size": moe.expert_hidden,
            "decoder_sparse_step": 1, "mlp_only_layers": [i for i in range(cfg.n_layers) if not cfg.is_moe_layer(i)],
            "use_sliding_window": False, "sliding_window": None, "output_router_logits": False,
            "router_aux_loss_coef": 0.0}


def hf_config(model) -> dict:
    """config.json: Llama's keys, and those of the class the options need (module docstring)."""
    cfg = model.cfg
    out = llama_config(cfg)
    out.pop("mlp_bias")  # Llama's only
    if cfg.moe is None:
        if not cfg.qk_norm:
            return llama_config(cfg)
        return {**out, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "use_sliding_window": False,
                "sliding_window": None, "max_window_layers": cfg.n_layers}
    out.pop("head_dim")  # the MoE classes derive it: hidden_size / num_attention_heads, as ballast does
    if cfg.qk_norm:
        return {**out, **_moe_keys(model), "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}
    out.pop("attention_bias")  # Qwen2-MoE: q/k/v biases (written as zeros), a sigmoid-gated shared expert
    return {**out, **_moe_keys(model), "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
            "qkv_bias": True, "shared_expert_intermediate_size": cfg.moe.expert_hidden,
            "max_window_layers": cfg.n_layers}


def _mlp(sd: dict, p: str, mlp) -> None:
    gate_HD, up_HD = mlp.w_gate_up.weight.chunk(2, dim=0)
    sd[p + "gate_proj.weight"], sd[p + "up_proj.weight"] = gate_HD, up_HD
    sd[p + "down_proj.weight"] = mlp.w_down.weight


def _moe(sd: dict, p: str, moe, d_model: int, shared: bool) -> None:
    sd[p + "gate.weight"] = moe.router.weight
    gate_up_EXD, down_EDH = moe.experts.w_gate_up, moe.experts.w_down
    for e in range(moe.n_experts):
        gate_HD, up_HD = gate_up_EXD[e].chunk(2, dim=0)
        sd[p + f"experts.{e}.gate_proj.weight"], sd[p + f"experts.{e}.up_proj.weight"] = gate_HD, up_HD
        sd[p + f"experts.{e}.down_proj.weight"] = down_EDH[e]
    if not shared:  # Qwen3-MoE: no shared expert (refuse_reason: ballast has none either)
        return
    # Qwen2-MoE adds sigmoid(gate·x)·shared(x): a zero gate gives exactly 0.5, so down ×2 (exact in binary
    # floating point) makes it ballast's ungated shared expert; without one, a zero down makes it 0.
    sd[p + "shared_expert_gate.weight"] = torch.zeros(1, d_model)
    H = moe.cfg.expert_hidden
    if moe.shared is not None:
        _mlp(sd, p + "shared_expert.", moe.shared)
        sd[p + "shared_expert.down_proj.weight"] = 2 * moe.shared.w_down.weight
    else:
        for name, shape in (("gate_proj", (H, d_model)), ("up_proj", (H, d_model)), ("down_proj", (d_model, H))):
            sd[p + f"shared_expert.{name}.weight"] = torch.zeros(shape)


def hf_state_dict(model) -> dict[str, torch.Tensor]:
    cfg = model.cfg
    H, K, d = cfg.n_heads, cfg.kv_heads, cfg.head_dim
    perm = rope_rows(d)
    qwen2_moe = cfg.moe is not None and not cfg.qk_norm
    sd = {"model.embed_tokens.weight": model.tok_emb.weight, "model.norm.weight": model.norm.weight}
    if not cfg.tie_embeddings:
        sd["lm_head.weight"] = model.head.weight
    for i, b in enumerate(model.blocks):
        p = f"model.layers.{i}."
        if qwen2_moe:  # Qwen2-MoE's attention has q/k/v biases
            for name, n in (("q", H), ("k", K), ("v", K)):
                sd[p + f"self_attn.{name}_proj.bias"] = torch.zeros(n * d)
        if cfg.qk_norm:  # one gain per q and per k over head_dim, in the heads' permuted row order
            sd[p + "self_attn.q_norm.weight"] = b.attn.q_norm.weight[perm]
            sd[p + "self_attn.k_norm.weight"] = b.attn.k_norm.weight[perm]
        w_XD = b.attn.qkv.weight
        q_HdD = rearrange(w_XD[: H * d], "(h d) c -> h d c", d=d)[:, perm]
        k_KdD = rearrange(w_XD[H * d:(H + K) * d], "(h d) c -> h d c", d=d)[:, perm]
        sd[p + "self_attn.q_proj.weight"] = rearrange(q_HdD, "h d c -> (h d) c")
        sd[p + "self_attn.k_proj.weight"] = rearrange(k_KdD, "h d c -> (h d) c")
        sd[p + "self_attn.v_proj.weight"] = w_XD[(H + K) * d:]
        sd[p + "self_attn.o_proj.weight"] = b.attn.proj_out.weight
        if cfg.is_moe_layer(i):
            _moe(sd, p + "mlp.", b.mlp, cfg.d_model, shared=qwen2_moe)
        else:
            _mlp(sd, p + "mlp.", b.mlp)
        sd[p + "input_layernorm.weight"] = b.attn_norm.weight
        sd[p + "post_attention_layernorm.weight"] = b.mlp_norm.weight
    return {k: v.detach().float().contiguous().cpu().clone() for k, v in sd.items()}  # fp32, no shared storage


def hf_tokenizer(tok):
    """A `tokenizers.Tokenizer` with the run's ids, or None (synthetic data)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    if tok is None:
        return None
    if tok.name == "bpe":
        return Tokenizer.from_str(tok._tok.to_str())
    if tok.name == "byte":
        # the byte-level alphabet maps byte b to one printable symbol; symbol → id b, no merges
        symbols = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda s: _byte_of(s))
        out = Tokenizer(models.BPE(vocab={s: _byte_of(s) for s in symbols}, merges=[]))
        out.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        out.decoder = decoders.ByteLevel()
        return out
    if tok.name == "char":
        chars = tok.decode(range(tok.vocab_size))
        out = Tokenizer(models.WordLevel(vocab={c: i for i, c in enumerate(chars)}, unk_token=None))
        out.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        out.decoder = decoders.Fuse()
        return out
    raise ValueError(f"tokenizer {tok.name}: no Hugging Face form known")


_BYTES_TO_SYMBOL: dict[str, int] = {}


def _byte_of(symbol: str) -> int:
    # GPT-2's table: printable bytes map to themselves, the other 68 to chr(256 + n) in byte order.
    if not _BYTES_TO_SYMBOL:
        printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
        n = 0
        for b in range(256):
            if b in printable:
                _BYTES_TO_SYMBOL[chr(b)] = b
            else:
                _BYTES_TO_SYMBOL[chr(256 + n)] = b
                n += 1
    return _BYTES_TO_SYMBOL[symbol]


def export(model, tokenizer, out_dir: Path) -> list[str]:
    """Write the checkpoint; returns the files written. Raises ValueError, with nothing written, for a model
    transformers cannot express: a declared refusal (refuse_reason, before the `[hf]` extra is needed), or
    a converted model whose logits are not ballast's (verify: whatever the cause, OPTIONS knowing it or not)."""
    reason = refuse_reason(model)
    if reason:
        raise ValueError(f"cannot export to transformers: {reason}")
    try:
        from safetensors.torch import save_file
        import transformers  # noqa: F401  (the export proves itself through it)
    except ImportError:
        raise ValueError("needs safetensors and transformers: pip install -e '.[hf]'") from None
    out_dir = Path(out_dir)
    with tempfile.TemporaryDirectory(prefix="ballast-export-") as tmp:
        staged = Path(tmp)
        (staged / "config.json").write_text(json.dumps(hf_config(model), indent=1) + "\n")
        save_file(hf_state_dict(model), str(staged / "model.safetensors"), metadata={"format": "pt"})
        written = ["config.json", "model.safetensors"]
        tok = hf_tokenizer(tokenizer)
        if tok is not None:
            tok.save(str(staged / "tokenizer.json"))
            (staged / "tokenizer_config.json").write_text(json.dumps(
                {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model.cfg.seq_len,
                 "clean_up_tokenization_spaces": False, "ballast_tokenizer": tokenizer.name}, indent=1) + "\n")
            written += ["tokenizer.json", "tokenizer_config.json"]
        mismatch = verify(model, staged)
        if mismatch:
            raise ValueError(f"cannot export to transformers: {mismatch}")
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in written:
            shutil.move(staged / name, out_dir / name)
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m checkpoint.export_hf", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir")
    p.add_argument("out_dir")
    p.add_argument("--checkpoint", default=None, help="a checkpoint directory (default: the run's latest)")
    args = p.parse_args(argv)
    try:
        from checkpoint.load import load_model

        model, ds, path, _ = load_model(args.run_dir, args.checkpoint)
        files = export(model, getattr(ds, "tokenizer", None), Path(args.out_dir))
    except ValueError as e:
        print(f"export_hf: {e}", file=sys.stderr)
        return 2
    print(f"exported {path} → {args.out_dir}: {', '.join(files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
