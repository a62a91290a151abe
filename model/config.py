"""Model configuration: plain dataclasses, validated with messages that name the Hydra key."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

SCORES = ("softmax", "sigmoid")


def _round_up(x: float, multiple: int) -> int:
    return int(multiple * -(-x // multiple))


def _check_positive_int(key: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{key}={value!r} must be a positive integer")


def _check_positive(key: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{key}={value!r} must be a positive number")


def _check_non_negative(key: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{key}={value!r} must be >= 0")


def _fields_from(cls, d: Mapping, prefix: str) -> dict:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"{prefix}.{unknown[0]} is not a known key (known: {', '.join(sorted(names))})")
    return dict(d)


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

    def validate(self, n_layers: int) -> None:
        p = "model.moe"
        _check_positive_int(f"{p}.n_experts", self.n_experts)
        _check_positive_int(f"{p}.top_k", self.top_k)
        if self.top_k > self.n_experts:
            raise ValueError(f"{p}.top_k={self.top_k} > {p}.n_experts={self.n_experts}")
        _check_positive_int(f"{p}.expert_hidden", self.expert_hidden)
        if self.score not in SCORES:
            raise ValueError(f"{p}.score={self.score!r}: expected one of {', '.join(SCORES)}")
        if isinstance(self.first_dense, bool) or not isinstance(self.first_dense, int) or self.first_dense < 0:
            raise ValueError(f"{p}.first_dense={self.first_dense!r} must be an integer >= 0")
        if self.first_dense >= n_layers:
            raise ValueError(f"{p}.first_dense={self.first_dense} leaves no MoE layer (model.n_layers={n_layers})")
        _check_positive_int(f"{p}.every", self.every)
        _check_non_negative(f"{p}.balance_coef", self.balance_coef)
        _check_non_negative(f"{p}.bias_update_speed", self.bias_update_speed)
        _check_non_negative(f"{p}.router_z_coef", self.router_z_coef)


@dataclass
class ModelConfig:
    vocab_size: int
    seq_len: int
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
    moe: MoEConfig | None = None

    @classmethod
    def from_dict(cls, d: Mapping) -> "ModelConfig":
        """Build from a (Hydra) mapping; a nested `moe` mapping becomes MoEConfig. Validates."""
        kwargs = _fields_from(cls, d, "model")
        moe = kwargs.get("moe")
        if isinstance(moe, Mapping):
            kwargs["moe"] = MoEConfig(**_fields_from(MoEConfig, moe, "model.moe"))
        elif moe is not None and not isinstance(moe, MoEConfig):
            raise ValueError(f"model.moe={moe!r} must be a mapping or null")
        try:
            cfg = cls(**kwargs)
        except TypeError as e:  # a required key is missing
            raise ValueError(f"model: {e}") from None
        cfg.validate()
        return cfg

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

    def validate(self) -> None:
        for key in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "mlp_multiple_of"):
            _check_positive_int(f"model.{key}", getattr(self, key))
        if self.n_kv_heads is not None:
            _check_positive_int("model.n_kv_heads", self.n_kv_heads)
        if self.mlp_hidden is not None:
            _check_positive_int("model.mlp_hidden", self.mlp_hidden)
        for key in ("rope_theta", "norm_eps", "init_std"):
            _check_positive(f"model.{key}", getattr(self, key))
        if self.swiglu_clamp is not None:
            _check_positive("model.swiglu_clamp", self.swiglu_clamp)
        if self.d_model % self.n_heads:
            raise ValueError(f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={self.kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"model.d_model/model.n_heads={self.head_dim} must be even (RoPE rotates pairs)")
        if self.moe is not None:
            if not isinstance(self.moe, MoEConfig):
                raise ValueError(f"model.moe={self.moe!r} must be a MoEConfig or null")
            self.moe.validate(self.n_layers)

    def is_moe_layer(self, i: int) -> bool:
        m = self.moe
        return m is not None and i >= m.first_dense and (i - m.first_dense) % m.every == 0
