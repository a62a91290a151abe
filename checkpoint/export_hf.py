"""Export a run to a Hugging Face checkpoint that `transformers` loads with no custom code: dense → Llama,
MoE → Qwen2-MoE where that class computes exactly what ballast does.

    python -m checkpoint.export_hf runs/<run> out/hf [--checkpoint PATH]
    # then: transformers.AutoModelForCausalLM.from_pretrained("out/hf"); AutoTokenizer.from_pretrained("out/hf")

Needs the optional extra `pip install -e '.[hf]'` (safetensors to write; transformers only to load).

Writes config.json (LlamaForCausalLM), model.safetensors (fp32) and, for data=text runs, the tokenizer:
tokenizer.json + tokenizer_config.json for a PreTrainedTokenizerFast whose ids equal the run's ids:
  byte  a byte-level BPE with the 256 byte symbols and no merges: id = the UTF-8 byte value
  char  a word-level vocabulary of the run's characters, one token per character, decoded by fusing
  bpe   the run's own trained tokenizer
Synthetic runs have no text; no tokenizer is written (ids are the model's interface).

The mapping, ballast → Llama:
  qkv (fused, heads [q | k | v])  → q_proj, k_proj, v_proj, with the q and k rows of every head permuted:
      ballast's RoPE rotates interleaved pairs (x[2i], x[2i+1]) by angle t·θ_i; Llama's rotate_half rotates
      (x[i], x[i + d/2]) by the same angle. Reordering each head's output rows to [0, 2, 4, …, 1, 3, 5, …]
      turns one into the other, and q·k is unchanged because q and k get the same permutation.
  SwiGLU w_gate_up (rows [gate | up]) → gate_proj, up_proj;  w_down → down_proj
  RMSNorm weights and eps, rope_theta, tied embeddings (the head is not written when tied).
MoE (→ Qwen2MoeForCausalLM): router → mlp.gate, experts → mlp.experts.<e>.{gate,up,down}_proj, dense layers
  listed in mlp_only_layers; the shared expert's sigmoid gate is written as zeros (sigmoid(0) = 0.5 exactly)
  with its down_proj doubled, or as an all-zero expert when ballast has none; q/k/v biases as zeros.
Refused, with one line: model.swiglu_clamp (neither class clamps; whether the clamp binds depends on the
inputs, so it cannot be ruled out from the weights), sigmoid router scores, and a nonzero balancing bias
(Qwen2-MoE selects by the scores alone: the bias would route tokens to other experts).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from einops import rearrange


def refuse_reason(model) -> str | None:
    cfg = model.cfg
    if cfg.swiglu_clamp is not None:
        return (f"model.swiglu_clamp={cfg.swiglu_clamp}: Llama's and Qwen2-MoE's MLPs cannot clamp; whether the "
                "clamp binds depends on the inputs, so an export could silently change the model")
    if cfg.moe is not None:
        if cfg.moe.score != "softmax":
            return (f"model.moe.score={cfg.moe.score}: Qwen2-MoE (the transformers class with ballast's layout) "
                    "routes with softmax scores only")
        biased = [i for i, m in model.moe_layers() if bool(m.bias_E.ne(0).any())]
        if biased:
            return (f"the MoE balancing bias of layer {biased[0]} is nonzero (model.moe.bias_update_speed > 0): "
                    "Qwen2-MoE has no selection bias, so it would route tokens to other experts")
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


def qwen2_moe_config(model) -> dict:
    """Qwen2-MoE: Llama's attention (+ qkv biases, written as zeros) and norms; MoE layers with a softmax
    router, top-k, optional renormalisation, a sigmoid-gated shared expert; dense layers via mlp_only_layers."""
    cfg, moe = model.cfg, model.cfg.moe
    out = {**llama_config(cfg), "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
           "num_experts": moe.n_experts, "num_experts_per_tok": moe.top_k, "norm_topk_prob": moe.norm_topk,
           "moe_intermediate_size": moe.expert_hidden, "shared_expert_intermediate_size": moe.expert_hidden,
           "decoder_sparse_step": 1, "mlp_only_layers": [i for i in range(cfg.n_layers) if not cfg.is_moe_layer(i)],
           "qkv_bias": True, "use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.n_layers,
           "output_router_logits": False, "router_aux_loss_coef": 0.0}
    for k in ("mlp_bias", "attention_bias", "head_dim"):
        out.pop(k)
    return out


def _mlp(sd: dict, p: str, mlp) -> None:
    gate_HD, up_HD = mlp.w_gate_up.weight.chunk(2, dim=0)
    sd[p + "gate_proj.weight"], sd[p + "up_proj.weight"] = gate_HD, up_HD
    sd[p + "down_proj.weight"] = mlp.w_down.weight


def _moe(sd: dict, p: str, moe, d_model: int) -> None:
    sd[p + "gate.weight"] = moe.router.weight
    gate_up_EXD, down_EDH = moe.experts.w_gate_up, moe.experts.w_down
    for e in range(moe.n_experts):
        gate_HD, up_HD = gate_up_EXD[e].chunk(2, dim=0)
        sd[p + f"experts.{e}.gate_proj.weight"], sd[p + f"experts.{e}.up_proj.weight"] = gate_HD, up_HD
        sd[p + f"experts.{e}.down_proj.weight"] = down_EDH[e]
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
    sd = {"model.embed_tokens.weight": model.tok_emb.weight, "model.norm.weight": model.norm.weight}
    if not cfg.tie_embeddings:
        sd["lm_head.weight"] = model.head.weight
    for i, b in enumerate(model.blocks):
        p = f"model.layers.{i}."
        if cfg.moe is not None:  # Qwen2-MoE's attention has q/k/v biases
            for name, n in (("q", H), ("k", K), ("v", K)):
                sd[p + f"self_attn.{name}_proj.bias"] = torch.zeros(n * d)
        w_XD = b.attn.qkv.weight
        q_HdD = rearrange(w_XD[: H * d], "(h d) c -> h d c", d=d)[:, perm]
        k_KdD = rearrange(w_XD[H * d:(H + K) * d], "(h d) c -> h d c", d=d)[:, perm]
        sd[p + "self_attn.q_proj.weight"] = rearrange(q_HdD, "h d c -> (h d) c")
        sd[p + "self_attn.k_proj.weight"] = rearrange(k_KdD, "h d c -> (h d) c")
        sd[p + "self_attn.v_proj.weight"] = w_XD[(H + K) * d:]
        sd[p + "self_attn.o_proj.weight"] = b.attn.proj_out.weight
        if cfg.is_moe_layer(i):
            _moe(sd, p + "mlp.", b.mlp, cfg.d_model)
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
    """Write the checkpoint; returns the files written. Raises ValueError for a model Llama cannot express."""
    from safetensors.torch import save_file

    reason = refuse_reason(model)
    if reason:
        raise ValueError(f"cannot export to transformers: {reason}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = qwen2_moe_config(model) if model.cfg.moe is not None else llama_config(model.cfg)
    (out_dir / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    save_file(hf_state_dict(model), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    written = ["config.json", "model.safetensors"]
    tok = hf_tokenizer(tokenizer)
    if tok is not None:
        tok.save(str(out_dir / "tokenizer.json"))
        (out_dir / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model.cfg.seq_len,
             "clean_up_tokenization_spaces": False, "ballast_tokenizer": tokenizer.name}, indent=1) + "\n")
        written += ["tokenizer.json", "tokenizer_config.json"]
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m checkpoint.export_hf", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir")
    p.add_argument("out_dir")
    p.add_argument("--checkpoint", default=None, help="a checkpoint directory (default: the run's latest)")
    args = p.parse_args(argv)
    try:
        import safetensors  # noqa: F401
    except ImportError:
        print("export_hf: needs safetensors: pip install -e '.[hf]'", file=sys.stderr)
        return 2
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
