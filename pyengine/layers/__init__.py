"""Model building blocks. Each op is a small function (``rms_norm``, ``fused_add_rms_norm``,
``silu_and_mul``, ``apply_rotary``) so device kernels can replace it."""
from pyengine.layers.activation import SiluAndMul, silu_and_mul
from pyengine.layers.embedding import LMHead, VocabEmbedding
from pyengine.layers.layernorm import RMSNorm, fused_add_rms_norm, rms_norm
from pyengine.layers.linear import Linear, MergedLinear, QKVLinear, default_weight_loader
from pyengine.layers.rotary import RotaryEmbedding, apply_rotary, get_rope_params

__all__ = ["SiluAndMul", "silu_and_mul", "LMHead", "VocabEmbedding", "RMSNorm", "fused_add_rms_norm",
           "rms_norm", "Linear", "MergedLinear", "QKVLinear", "default_weight_loader",
           "RotaryEmbedding", "apply_rotary", "get_rope_params"]
