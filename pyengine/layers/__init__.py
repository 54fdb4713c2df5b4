"""Model building blocks (vLLM's ``model_executor/layers``): RMSNorm, SiluAndMul,
RotaryEmbedding over the ops of ``pyengine.ops`` (Triton on CUDA, torch elsewhere), and
the tensor-parallel linear layers and embedding / LM head (vLLM's classes; with one rank
they are plain ``F.linear`` / ``F.embedding``). The models only call these modules."""
from pyengine.layers.activation import SiluAndMul
from pyengine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pyengine.layers.layernorm import RMSNorm
from pyengine.layers.linear import (
                                    ColumnParallelLinear,
                                    MergedColumnParallelLinear,
                                    QKVParallelLinear,
                                    RowParallelLinear,
                                    default_weight_loader,
)
from pyengine.layers.rotary import RotaryEmbedding

__all__ = ["SiluAndMul", "ParallelLMHead", "VocabParallelEmbedding", "RMSNorm", "ColumnParallelLinear",
           "MergedColumnParallelLinear", "QKVParallelLinear", "RowParallelLinear", "default_weight_loader",
           "RotaryEmbedding"]
