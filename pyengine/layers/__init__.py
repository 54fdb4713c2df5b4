"""Model building blocks. Each op is a small module-level function (``rms_norm``,
``fused_add_rms_norm`` in ``layernorm``, ``silu_and_mul`` in ``activation``, ``apply_rotary``
in ``rotary``) that the modules (RMSNorm, SiluAndMul, RotaryEmbedding) look up at call
time, so a kernel can replace it by assigning the module attribute, e.g.
``pyengine.layers.layernorm.rms_norm = triton_rms_norm`` (same signature and semantics).
The models only call the modules, never the functions directly.

Linear layers and the embedding / LM head are tensor-parallel (vLLM's classes); with one
rank they are plain ``F.linear`` / ``F.embedding``."""
from pyengine.layers.activation import SiluAndMul, silu_and_mul
from pyengine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pyengine.layers.layernorm import RMSNorm, fused_add_rms_norm, rms_norm
from pyengine.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                    RowParallelLinear, default_weight_loader)
from pyengine.layers.rotary import RotaryEmbedding, apply_rotary, get_rope_params

__all__ = ["SiluAndMul", "silu_and_mul", "ParallelLMHead", "VocabParallelEmbedding", "RMSNorm",
           "fused_add_rms_norm", "rms_norm", "ColumnParallelLinear", "MergedColumnParallelLinear",
           "QKVParallelLinear", "RowParallelLinear", "default_weight_loader",
           "RotaryEmbedding", "apply_rotary", "get_rope_params"]
