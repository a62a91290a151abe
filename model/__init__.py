"""ballast model: a decoder-only transformer with dense and MoE SwiGLU layers."""
from model.config import ModelConfig, MoEConfig
from model.loss import IGNORE_INDEX, ModelOutput, token_losses
from model.moe import MoE, MoEOutput
from model.swiglu import SwiGLU
from model.transformer import Transformer

# NOTE: the activation function `swiglu` is not re-exported: it would shadow the submodule
# `model.swiglu` (import it as `from model.swiglu import swiglu`).
__all__ = ["IGNORE_INDEX", "ModelConfig", "ModelOutput", "MoE", "MoEConfig", "MoEOutput", "SwiGLU",
           "Transformer", "token_losses"]
