"""Model configuration: the `model` group's schema (registered by run/config.py), validated on construction
with one-line messages that name the Hydra key. vocab_size and seq_len come from the data, never the user."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from run.config_errors import check, fail

SCORES = ("softmax", "sigmoid")


def _round_up(x: float, multiple: int) -> int:
    return int(multiple * -(-x // multiple))


def _positive_int(key: str, value) -> None:
    check(value > 0, key, value, "must be a positive integer")


def _positive(key: str, value) -> None:
    check(value > 0, key, value, "must be a positive number")


def _non_negative(key: str, value) -> None:
    check(value >= 0, key, value, "must be >= 0")


@dataclass
class MoEConfig:
    n_experts: int = 8
    top_k: int = 2
    expert_hidden: int = 128        # hidden width of each routed SwiGLU expert
    shared_expert: bool = False     # one always-on SwiGLU expert of width expert_hidden
    score: str = "softmax"          # "softmax" | "sigmoid"
    norm_topk: bool = True          # renormalise the k gate weights to sum to 1 (always for sigmoid; never at k = 1)
    first_dense: int = 1            # the first `first_dense` layers are dense
    every: int = 1                  # after that, layer i is MoE iff (i - first_dense) % every == 0
    balance_coef: float = 0.01      # Switch load-balancing loss coefficient (0 = off)
    bias_update_speed: float = 0.0  # DeepSeek aux-loss-free bias speed gamma (0 = off)
    router_z_coef: float = 0.0      # router z-loss coefficient

    def __post_init__(self) -> None:
        p = "model.moe"
        _positive_int(f"{p}.n_experts", self.n_experts)
        _positive_int(f"{p}.top_k", self.top_k)
        if self.top_k > self.n_experts:
            fail(f"{p}.top_k", self.top_k, f"> {p}.n_experts={self.n_experts}", sep=" ")
        _positive_int(f"{p}.expert_hidden", self.expert_hidden)
        check(self.score in SCORES, f"{p}.score", repr(self.score), f"expected one of {', '.join(SCORES)}")
        check(self.first_dense >= 0, f"{p}.first_dense", self.first_dense, "must be an integer >= 0")
        _positive_int(f"{p}.every", self.every)
        for key in ("balance_coef", "bias_update_speed", "router_z_coef"):
            _non_negative(f"{p}.{key}", getattr(self, key))


@dataclass
class ModelConfig:
    vocab_size: int | None = None   # from the data (dataset.vocab_size): never a user setting
    seq_len: int | None = None      # from the data (data.seq_len)
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None   # grouped-query attention; None = n_heads
    mlp_hidden: int | None = None   # None -> round_up(8/3 * d_model, mlp_multiple_of)
    mlp_multiple_of: int = 32
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    init_std: float = 0.02
    swiglu_clamp: float | None = None   # L; None = off
    qk_norm: bool = False           # RMSNorm on each q and k head before RoPE (model/attention.py)
    moe: MoEConfig | None = None

    def for_data(self, dataset) -> "ModelConfig":
        """This model sized by the data: vocab_size and seq_len are the dataset's, never a user setting."""
        return dataclasses.replace(self, vocab_size=dataset.vocab_size, seq_len=dataset.seq_len)

    def check_sizes(self) -> None:
        for key in ("vocab_size", "seq_len"):
            check(getattr(self, key) is not None, f"model.{key}", None, "missing (it comes from the data)")

    # Resolved sizes: the rest of the package reads these, never the Optional fields.
    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def ffn_hidden(self) -> int:
        # NOTE: 8/3·d keeps a SwiGLU MLP (3 matrices) at the parameter count of a 4·d GELU MLP (2 matrices).
        if self.mlp_hidden is not None:
            return self.mlp_hidden
        return _round_up(8 * self.d_model / 3, self.mlp_multiple_of)

    def __post_init__(self) -> None:
        for key in ("vocab_size", "seq_len", "n_kv_heads", "mlp_hidden"):
            if getattr(self, key) is not None:
                _positive_int(f"model.{key}", getattr(self, key))
        for key in ("d_model", "n_layers", "n_heads", "mlp_multiple_of"):
            _positive_int(f"model.{key}", getattr(self, key))
        for key in ("rope_theta", "norm_eps", "init_std"):
            _positive(f"model.{key}", getattr(self, key))
        if self.swiglu_clamp is not None:
            _positive("model.swiglu_clamp", self.swiglu_clamp)
        if self.d_model % self.n_heads:
            fail("model.d_model", self.d_model, f"is not divisible by model.n_heads={self.n_heads}", sep=" ")
        if self.n_heads % self.kv_heads:
            fail("model.n_heads", self.n_heads, f"is not divisible by model.n_kv_heads={self.kv_heads}", sep=" ")
        if self.head_dim % 2:
            fail("model.d_model/model.n_heads", self.head_dim, "must be even (RoPE rotates pairs)", sep=" ")
        if self.moe is not None:
            check(isinstance(self.moe, MoEConfig), "model.moe", self.moe, "must be a MoEConfig or null")
            if self.moe.first_dense >= self.n_layers:
                fail("model.moe.first_dense", self.moe.first_dense,
                     f"leaves no MoE layer (model.n_layers={self.n_layers})", sep=" ")

    def is_moe_layer(self, i: int) -> bool:
        m = self.moe
        return m is not None and i >= m.first_dense and (i - m.first_dense) % m.every == 0


def default_model() -> ModelConfig:
    """The default run's model (the root schema's `model`; conf/model/*.yaml change it from here): dense
    layers 0 and 2, MoE layers 1 and 3 with a shared expert and aux-loss-free bias balancing, SwiGLU
    clamped at 10 (DeepSeek-V4: silu(min(gate, 10)) * clamp(up, -10, 10)). A bare ModelConfig() is the
    dense model a test or lab starts from."""
    return ModelConfig(swiglu_clamp=10.0, moe=MoEConfig(shared_expert=True, every=2, bias_update_speed=0.001,
                                                        router_z_coef=0.001))
