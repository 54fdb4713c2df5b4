"""AWQ checkpoints (AutoAWQ's GEMM format; mirrors vllm/model_executor/layers/quantization/awq.py).

``quantization_config``: ``bits`` / ``w_bit`` (4), ``group_size`` / ``q_group_size``,
``zero_point`` (true), ``version`` (``gemm``), ``modules_to_not_convert``. Tensors per
linear layer: ``qweight`` int32 [K, N/8] and ``qzeros`` int32 [K/group, N/8], both packed
along N in AWQ's order (value j of a word is column ``AWQ_ORDER[j]`` of its run of 8), and
``scales`` [K/group, N] (fp16). Dequantized: ``w[k, n] = (q - zero) * scale`` of row k's
group. Other versions (gemv, marlin, exllama) and zero_point false are refused. MoE
experts: per expert in the same tensors (``moe_wna16.MoeWNA16Method``).
"""
from __future__ import annotations

import torch

from pyengine.layers.quantization.base_config import LinearMethodBase, QuantizationConfig, is_layer_skipped, new_param
from pyengine.layers.quantization.utils import apply_int, finalize_int, unpack_int32

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


class AWQConfig(QuantizationConfig):
    def __init__(self, group_size: int, not_converted: list[str]):
        self.group_size, self.not_converted = group_size, not_converted

    @classmethod
    def get_name(cls) -> str:
        return "awq"

    @classmethod
    def from_config(cls, config: dict) -> AWQConfig:
        bits = config.get("bits", config.get("w_bit"))
        if bits != 4:
            raise ValueError(f"AWQ bits={bits!r} is not supported (4)")
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ version {version!r} is not supported (gemm)")
        if not config.get("zero_point", True):
            raise ValueError("AWQ without zero points (zero_point: false) is not supported")
        gs = config.get("group_size", config.get("q_group_size"))
        if not isinstance(gs, int) or gs <= 0:
            raise ValueError(f"AWQ group_size={gs!r} must be a positive integer")
        return cls(gs, list(config.get("modules_to_not_convert") or []))

    def get_quant_method(self, layer, prefix: str, checkpoint_names: list[str]):
        if is_layer_skipped(prefix, checkpoint_names, lambda n: any(key in n for key in self.not_converted)):
            return None
        return AWQLinearMethod(self.group_size)

    def get_moe_method(self, layer, prefix: str, checkpoint_names: list[str]):
        """The experts' AWQ tensors, per expert as the linear layers' (``MoeWNA16Method``)."""
        from pyengine.layers.quantization.moe_wna16 import MoeWNA16Method

        if is_layer_skipped(prefix, checkpoint_names, lambda n: any(key in n for key in self.not_converted)):
            return None
        return MoeWNA16Method(lambda: AWQLinearMethod(self.group_size), 4, "AWQ")


class AWQLinearMethod(LinearMethodBase):
    def __init__(self, group_size: int):
        self.group_size = group_size

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype):
        n, k, gs = sum(output_partition_sizes), input_size_per_partition, self.group_size
        self.dtype = params_dtype
        if k % gs or any(p % 8 for p in output_partition_sizes):
            raise ValueError(f"AWQ with group size {gs} cannot split {k} inputs x {output_partition_sizes} outputs")
        layer.register_parameter("qweight", new_param(k, n // 8, dtype=torch.int32, input_dim=0, output_dim=1,
                                                      row_factors={1: 8}))
        layer.register_parameter("qzeros", new_param(k // gs, n // 8, dtype=torch.int32, input_dim=0, output_dim=1,
                                                     row_factors={0: gs, 1: 8}))
        layer.register_parameter("scales", new_param(k // gs, n, dtype=torch.float32, input_dim=0, output_dim=1,
                                                     row_factors={0: gs}))

    def process_weights_after_loading(self, layer):
        q = unpack_int32(layer.qweight.data, 4, 1, AWQ_ORDER)
        zeros = unpack_int32(layer.qzeros.data, 4, 1, AWQ_ORDER).to(torch.float32)
        finalize_int(layer, q, layer.scales.data, zeros, 4, self.group_size, self.dtype)

    def apply(self, layer, x, bias=None):
        return apply_int(layer, x, bias)

    def dummy_weights(self, layer, gen):
        layer.qweight.data.random_(generator=gen)
        layer.qzeros.data.random_(generator=gen)
        layer.scales.data.fill_(0.02 / 8)
