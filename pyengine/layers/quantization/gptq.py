"""GPTQ checkpoints (AutoGPTQ, GPTQModel; mirrors vllm/model_executor/layers/quantization/gptq.py).

``quantization_config``: ``bits`` (4 or 8), ``group_size`` (-1: one group per output
channel), ``desc_act`` (activation order: ``g_idx`` maps each input row to its group),
``sym``, ``checkpoint_format`` (``gptq``: zero points stored minus one, as AutoGPTQ writes
them; ``gptq_v2``: as they are). Tensors per linear layer: ``qweight`` int32 [K*bits/32, N]
(values packed along K, value j of a word in bits [j*bits, (j+1)*bits)), ``qzeros`` int32
[groups, N*bits/32] packed along N, ``scales`` [groups, N] (fp16), ``g_idx`` int32 [K].
Dequantized: ``w[k, n] = (q[k, n] - zero[g, n]) * scale[g, n]`` with ``g = g_idx[k]``.
A quantized ``lm_head``, per-module ``dynamic`` overrides and other bit widths are refused.
MoE experts: per expert in the same tensors (``moe_wna16.MoeWNA16Method``).
"""
from __future__ import annotations

import torch

from pyengine.layers.quantization.base_config import LinearMethodBase, QuantizationConfig, is_layer_skipped, new_param
from pyengine.layers.quantization.utils import apply_int, check_g_idx, finalize_int, pack_int32, unpack_int32


class GPTQConfig(QuantizationConfig):
    def __init__(self, bits: int, group_size: int, desc_act: bool, sym: bool, v1_zeros: bool,
                 modules: list[str] | None = None):
        self.bits, self.group_size, self.desc_act, self.sym, self.v1_zeros = bits, group_size, desc_act, sym, v1_zeros
        self.modules = modules  # modules_in_block_to_quantize, flattened (None: every linear layer)

    @classmethod
    def get_name(cls) -> str:
        return "gptq"

    @classmethod
    def from_config(cls, config: dict) -> GPTQConfig:
        bits = config.get("bits")
        if bits not in (4, 8):
            raise ValueError(f"GPTQ bits={bits!r} is not supported (4 or 8)")
        gs = config.get("group_size", -1)
        if not isinstance(gs, int) or not (gs == -1 or gs > 0):
            raise ValueError(f"GPTQ group_size={gs!r} must be -1 or a positive integer")
        if config.get("lm_head"):
            raise ValueError("a GPTQ-quantized lm_head (lm_head: true) is not supported")
        if config.get("dynamic"):
            raise ValueError("GPTQ per-module overrides (dynamic) are not supported")
        fmt = config.get("checkpoint_format") or "gptq"  # null: the default (AutoGPTQ's v1)
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
        blocks = config.get("modules_in_block_to_quantize")
        modules = [m for group in blocks for m in (group if isinstance(group, list) else [group])] if blocks else None
        return cls(bits, gs, bool(config.get("desc_act", False)), bool(config.get("sym", True)), fmt == "gptq",
                   modules)

    def _skipped(self, prefix: str, checkpoint_names: list[str]) -> bool:
        return self.modules is not None and is_layer_skipped(
            prefix, checkpoint_names, lambda n: not any(n.endswith("." + m) or n == m for m in self.modules))

    def get_quant_method(self, layer, prefix: str, checkpoint_names: list[str]):
        if self._skipped(prefix, checkpoint_names):
            return None
        return GPTQLinearMethod(self.bits, self.group_size, self.desc_act, self.v1_zeros, self.sym)

    def get_moe_method(self, layer, prefix: str, checkpoint_names: list[str]):
        """The experts' GPTQ tensors, per expert as the linear layers' (``MoeWNA16Method``)."""
        from pyengine.layers.quantization.moe_wna16 import MoeWNA16Method

        if self._skipped(prefix, checkpoint_names):
            return None
        return MoeWNA16Method(lambda: GPTQLinearMethod(self.bits, self.group_size, self.desc_act, self.v1_zeros,
                                                       self.sym), self.bits, "GPTQ", act_order=self.desc_act)


class GPTQLinearMethod(LinearMethodBase):
    def __init__(self, bits: int, group_size: int, desc_act: bool, v1_zeros: bool, sym: bool = True):
        self.bits, self.group_size, self.desc_act, self.v1_zeros, self.sym = bits, group_size, desc_act, v1_zeros, sym

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype):
        n, k, per = sum(output_partition_sizes), input_size_per_partition, 32 // self.bits
        self.dtype = params_dtype
        gs = self.group_size if self.group_size != -1 else input_size
        self.local_group_size = gs if self.group_size != -1 else k
        if k % per or (self.group_size != -1 and k % gs) or any(p % per for p in output_partition_sizes):
            raise ValueError(f"GPTQ {self.bits}-bit with group size {self.group_size} cannot split {k} inputs x "
                             f"{output_partition_sizes} outputs")
        row_parallel = input_size != input_size_per_partition
        if self.group_size == -1:
            groups, grouped = 1, {}
        elif row_parallel and self.desc_act:  # act order: a rank's rows may use any group: all of them
            groups, grouped = input_size // gs, {}
        else:
            groups, grouped = k // gs, {"input_dim": 0, "row_factors": {0: gs}}
        layer.register_parameter("qweight", new_param(k // per, n, dtype=torch.int32, input_dim=0, output_dim=1,
                                                      row_factors={0: per}))
        layer.register_parameter("g_idx", new_param(k, dtype=torch.int32, input_dim=0, same_for_parts=True))
        zf = {1: per, **grouped.get("row_factors", {})}
        layer.register_parameter("qzeros", new_param(groups, n // per, dtype=torch.int32, output_dim=1, row_factors=zf,
                                                     **{k_: v for k_, v in grouped.items() if k_ == "input_dim"}))
        layer.register_parameter("scales", new_param(groups, n, dtype=torch.float32, output_dim=1, **grouped))

    def process_weights_after_loading(self, layer):
        q = unpack_int32(layer.qweight.data, self.bits, 0)
        zeros = unpack_int32(layer.qzeros.data, self.bits, 1).to(torch.float32)
        if self.v1_zeros:
            zeros = zeros + 1  # AutoGPTQ stores zero - 1
        g_idx = layer.g_idx.data.to(torch.int64)
        groups, k = layer.scales.shape[0], g_idx.shape[0]
        if self.desc_act:
            check_g_idx(g_idx, groups)
        else:
            # desc_act false: the rows' groups are k // group_size (this rank's rows: offset); a
            # checkpoint whose g_idx says otherwise would dequantize differently from its writer
            offset = layer.tp_rank * k if layer.input_size != k else 0
            trivial = (torch.arange(k, device=g_idx.device) + offset) // self.local_group_size
            if self.group_size != -1 and not torch.equal(g_idx, trivial):
                raise ValueError("desc_act is false in the quantization_config but g_idx is not the trivial "
                                 "row // group_size (an act-order checkpoint?); set desc_act: true")
            g_idx = None
        finalize_int(layer, q, layer.scales.data, zeros, self.bits, self.local_group_size, self.dtype, g_idx)

    def apply(self, layer, x, bias=None):
        return apply_int(layer, x, bias)

    def dummy_weights(self, layer, gen):
        layer.qweight.data.random_(generator=gen)
        if self.sym:  # what a symmetric checkpoint stores: every zero point 2**(bits - 1)
            groups, words = layer.qzeros.shape
            zero = (1 << (self.bits - 1)) - (1 if self.v1_zeros else 0)  # v1 (AutoGPTQ): stored minus one
            full = torch.full((groups, words * (32 // self.bits)), zero, dtype=torch.int32)
            layer.qzeros.data.copy_(pack_int32(full, self.bits, 1))
        else:
            layer.qzeros.data.random_(generator=gen)
        layer.scales.data.fill_(0.02 / (1 << (self.bits - 1)))
        k = layer.g_idx.shape[0]
        # the rows' groups as a checkpoint holds them: global ones (this rank's rows start at
        # tp_rank * k under a row-parallel split), which is what loading checks
        offset = layer.tp_rank * k if layer.input_size != k else 0
        layer.g_idx.data.copy_((torch.arange(k) + offset) // self.local_group_size)
