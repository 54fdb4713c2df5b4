"""FP8 (e4m3): HF-native FP8 checkpoints, and bf16 checkpoints quantized at load (mirrors
vllm/model_executor/layers/quantization/fp8.py).

* Checkpoint (``quant_method: "fp8"``): with ``weight_block_size`` [bn, bk] (Qwen3-*-FP8,
  DeepSeek style) an F8_E4M3 ``weight`` and float32 ``weight_scale_inv`` [N/bn, K/bk] (the
  factor each block is multiplied by), activations quantized at run time per ``bk`` columns
  of each token (``activation_scheme: "dynamic"``); without it a per-tensor
  ``weight_scale`` and, with ``activation_scheme: "static"``, a per-tensor ``input_scale``.
  ``modules_to_not_convert`` / ``ignored_layers`` stay unquantized. On CPU the weights are
  dequantized at load and activations kept (transformers' CPU path for these checkpoints).
* At load (``quantization="fp8"`` on an unquantized checkpoint): every linear layer's
  weight quantized per output channel (``scale = amax / 448``), activations per token at
  run time — the arithmetic of compressed-tensors' ``FP8_DYNAMIC``, whose CPU forward (the
  activation quantization too) the CPU path reproduces.
"""
from __future__ import annotations

import torch

from pyengine.layers.quantization.base_config import LinearMethodBase, QuantizationConfig, is_layer_skipped, new_param
from pyengine.layers.quantization.utils import FP8_DTYPE, apply_fp8, finalize_fp8, fp8_quantize, fused_input_scale


class Fp8Config(QuantizationConfig):
    """``serialized``: the checkpoint holds FP8 weights (else they are quantized at load);
    ``activation_scheme``: "dynamic" | "static"; ``block``: (bn, bk) or None; ``ignored``:
    module names (substrings, as transformers matches them) left unquantized."""

    def __init__(self, serialized: bool, activation_scheme: str = "dynamic", block: tuple[int, int] | None = None,
                 ignored: list[str] | None = None):
        self.serialized, self.activation_scheme, self.block = serialized, activation_scheme, block
        self.ignored = list(ignored or [])

    @classmethod
    def get_name(cls) -> str:
        return "fp8"

    @classmethod
    def for_online(cls) -> Fp8Config:
        """Quantize an unquantized checkpoint at load (``quantization="fp8"``)."""
        return cls(serialized=False)

    @classmethod
    def from_config(cls, config: dict) -> Fp8Config:
        scheme = config.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ValueError(f"activation_scheme {scheme!r} is not supported (dynamic or static)")
        if config.get("scale_fmt") not in (None, ""):
            # DeepSeek-V3.1's "ue8m0": power-of-two activation scales, not what transformers computes
            raise ValueError(f"scale_fmt {config.get('scale_fmt')!r} is not supported (float32 scales only)")
        fmt = config.get("fmt", "e4m3")
        if fmt not in ("e4m3", "float8_e4m3fn"):
            raise ValueError(f"FP8 format {fmt!r} is not supported (e4m3)")
        block = config.get("weight_block_size")
        if block is not None:
            if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(int(b) > 0 for b in block)):
                raise ValueError(f"weight_block_size {block!r} must be two positive integers")
            if scheme != "dynamic":
                raise ValueError("block-wise FP8 needs activation_scheme 'dynamic'")
            block = (int(block[0]), int(block[1]))
        ignored = list(config.get("ignored_layers") or []) + list(config.get("modules_to_not_convert") or [])
        return cls(True, scheme, block, ignored)

    def get_quant_method(self, layer, prefix: str, checkpoint_names: list[str]):
        if is_layer_skipped(prefix, checkpoint_names, lambda n: any(key in n for key in self.ignored)):
            return None
        return Fp8LinearMethod(self)


class Fp8LinearMethod(LinearMethodBase):
    def __init__(self, config: Fp8Config):
        self.config = config

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype):
        c, n, k = self.config, sum(output_partition_sizes), input_size_per_partition
        self.dtype = params_dtype
        if not c.serialized:
            layer.register_parameter("weight", new_param(n, k, dtype=params_dtype, output_dim=0, input_dim=1))
            return
        layer.register_parameter("weight", new_param(n, k, dtype=FP8_DTYPE, output_dim=0, input_dim=1))
        parts = len(output_partition_sizes)
        if c.block is not None:
            bn, bk = c.block
            if k % bk or any(p % bn for p in output_partition_sizes):
                raise ValueError(f"weight_block_size {list(c.block)} does not divide this rank's parts "
                                 f"{output_partition_sizes} x {k}")
            layer.register_parameter("weight_scale_inv", new_param(n // bn, k // bk, dtype=torch.float32, output_dim=0,
                                                                   input_dim=1, row_factors={0: bn, 1: bk}))
        else:
            layer.register_parameter("weight_scale", new_param(parts, dtype=torch.float32, per_shard=True))
        if c.activation_scheme == "static":
            layer.register_parameter("input_scale", new_param(parts, dtype=torch.float32, per_shard=True))

    def process_weights_after_loading(self, layer):
        c = self.config
        if not c.serialized:
            weight, scale = fp8_quantize(layer.weight.data, per_row=True)
            finalize_fp8(layer, weight, scale, self.dtype, act="token", emulate_act=True)
            return
        if c.block is not None:
            finalize_fp8(layer, layer.weight.data, layer.weight_scale_inv.data, self.dtype, block=c.block, act="group")
            return
        sizes = list(layer.output_partition_sizes)
        scale = torch.cat([layer.weight_scale.data[i].expand(sz) for i, sz in enumerate(sizes)])
        static = c.activation_scheme == "static"
        finalize_fp8(layer, layer.weight.data, scale, self.dtype, act="tensor" if static else "token",
                     input_scale=fused_input_scale(layer) if static else None)

    def apply(self, layer, x, bias=None):
        return apply_fp8(layer, x, bias)

    def dummy_weights(self, layer, gen):
        if not self.config.serialized:
            layer.weight.data.uniform_(-0.02, 0.02, generator=gen)
            return
        w = torch.empty(layer.weight.shape, device=layer.weight.device).uniform_(-448, 448, generator=gen)
        layer.weight.data.copy_(w.to(FP8_DTYPE))
        for name in ("weight_scale_inv", "weight_scale"):
            if hasattr(layer, name):
                getattr(layer, name).data.fill_(0.02 / 448)
        if hasattr(layer, "input_scale"):
            layer.input_scale.data.fill_(0.05)
