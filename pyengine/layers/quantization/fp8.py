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
* MoE experts (``Fp8MoEMethod``): the same checkpoints' per-expert FP8 tensors (and, at
  load, the experts quantized per output row), stacked into ``FusedMoE`` and run
  weight-only by the fused-MoE kernels.
"""
from __future__ import annotations

import torch

from pyengine.layers.quantization.base_config import (
    FusedMoEMethodBase,
    LinearMethodBase,
    QuantizationConfig,
    is_layer_skipped,
    new_param,
)
from pyengine.layers.quantization.utils import (
    FP8_DTYPE,
    apply_fp8,
    dequantize_fp8,
    finalize_fp8,
    fp8_quantize,
    fused_input_scale,
    use_quant_kernels,
)


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

    def get_moe_method(self, layer, prefix: str, checkpoint_names: list[str]):
        return fp8_moe_method(self, prefix, checkpoint_names)


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


# ---- MoE experts ---------------------------------------------------------------------------

MOE_SCALE_FORMS = ("tensor", "channel", "block", "online")


class Fp8MoEMethod(FusedMoEMethodBase):
    """FP8 (e4m3) experts of a ``FusedMoE`` (the role of vllm's ``Fp8MoEMethod`` and
    ``CompressedTensorsW8A8Fp8MoEMethod``). ``form``: how the checkpoint scales each expert's
    projection — ``"tensor"`` (one float32 value; compressed-tensors ``tensor`` strategy,
    HF ``fp8`` without blocks), ``"channel"`` (one per output row, [rows, 1]), ``"block"``
    (``block`` = (bn, bk) tiles, [ceil(rows/bn), ceil(cols/bk)]; ``scale_name``
    ``weight_scale_inv`` for HF ``fp8``, ``weight_scale`` for compressed-tensors) — or
    ``"online"``: a float checkpoint quantized per output row at load (``quantization="fp8"``).

    After loading, with the kernels (CUDA): ``w13_weight`` float8_e4m3fn [E, 2I, H] and
    ``w13_weight_scale`` float32 [E, 2I] (tensor and channel scales, per row) or
    [E, 2I/bn, ceil(H/bk)] (blocks); ``w2_weight`` [E, H, I] and ``w2_weight_scale`` [E, H]
    or [E, ceil(H/bn), ceil(I/bk)]; ``layer.scale_block`` the block or None. The fused-MoE
    kernels dequantize each weight into the activation dtype before its product
    (weight-only: the experts' activations are not quantized, as vLLM's weight-only FP8 MoE
    path; a checkpoint's dynamic activation scheme prescribes no tensors). Elsewhere (CPU)
    the weights are dequantized at load into the model's dtype, ``(q * scale)`` in float32
    then cast, so outputs are token-exact against a float model holding those weights.
    """

    def __init__(self, form: str, block: tuple[int, int] | None = None, scale_name: str = "weight_scale"):
        if form not in MOE_SCALE_FORMS:
            raise ValueError(f"FP8 MoE scale form {form!r} is not one of {MOE_SCALE_FORMS}")
        if (form == "block") != (block is not None):
            raise ValueError("a block shape goes with the 'block' form only")
        self.form, self.block, self.scale_name = form, block, scale_name

    def create_weights(self, layer) -> None:
        if self.form == "online":
            return  # the float weights load as they are and are quantized after loading
        e, ip, h, inter = (layer.local_num_experts, layer.intermediate_size_per_partition, layer.hidden_size,
                           layer.intermediate_size)
        layer.replace_expert_weights(dtype=FP8_DTYPE)
        if self.form == "block":
            bn, bk = self.block
            if ip % bn or layer.intermediate_start % bn:
                raise ValueError(f"weight_block_size {list(self.block)}: block rows {bn} do not divide this rank's "
                                 f"{ip} gate/up rows (intermediate size {inter}); fewer tensor-parallel ranks, or "
                                 f"expert parallelism, split it whole")
            if layer.intermediate_start % bk or (ip != inter and ip % bk):
                raise ValueError(f"weight_block_size {list(self.block)}: block columns {bk} do not divide this rank's "
                                 f"{ip} down-projection columns")
            w13_shape, w2_shape = (e, 2 * ip // bn, -(-h // bk)), (e, -(-h // bn), -(-ip // bk))
        else:
            w13_shape, w2_shape = (e, 2 * ip), (e, h)
        layer.add_expert_scale(f"w13_{self.scale_name}", w13_shape, self.form, self.block)
        layer.add_expert_scale(f"w2_{self.scale_name}", w2_shape, self.form, self.block)

    def process_weights_after_loading(self, layer) -> None:
        w13, w2 = layer.w13_weight.data, layer.w2_weight.data
        if self.form == "online":
            (w13, s13), (w2, s2) = _quantize_experts(w13), _quantize_experts(w2)
        else:
            s13 = getattr(layer, f"w13_{self.scale_name}").data
            s2 = getattr(layer, f"w2_{self.scale_name}").data
        block = self.block if self.form == "block" else None
        if use_quant_kernels(w13):
            layer.set_expert_weights(w13, w2, s13, s2, block)
            return
        dense = [torch.stack([dequantize_fp8(w[i], s[i], block) for i in range(w.shape[0])]).to(layer.params_dtype)
                 for w, s in ((w13, s13), (w2, s2))]
        layer.set_expert_weights(dense[0], dense[1], None, None, None)

    def dummy_weights(self, layer, gen) -> None:
        if self.form == "online":
            super().dummy_weights(layer, gen)
            return
        for w in (layer.w13_weight, layer.w2_weight):
            for i in range(w.shape[0]):  # one expert at a time: no full float32 copy
                v = torch.empty(w.shape[1:], device=w.device).uniform_(-448, 448, generator=gen)
                w.data[i].copy_(v.to(FP8_DTYPE))
        for name in (f"w13_{self.scale_name}", f"w2_{self.scale_name}"):
            getattr(layer, name).data.fill_(0.02 / 448)


def _quantize_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked expert weights [E, rows, cols] -> (FP8 [E, rows, cols], float32 [E, rows]),
    per output row as ``fp8_quantize``, one expert at a time (a float32 copy of one expert
    at most)."""
    q = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
    s = torch.empty(w.shape[:2], dtype=torch.float32, device=w.device)
    for i in range(w.shape[0]):
        q[i], s[i] = fp8_quantize(w[i], per_row=True)
    return q, s


def fp8_moe_method(config: Fp8Config, prefix: str, checkpoint_names: list[str]) -> Fp8MoEMethod | None:
    """``Fp8Config``'s method for the experts of the MoE layer at ``prefix``
    (``checkpoint_names``: every expert projection's module name): None when the config leaves them out, else the FP8 form.
    Raises ValueError for static activation scales (the experts run weight-only, so an
    ``input_scale`` would go unused) or experts only partly left out."""
    if is_layer_skipped(prefix, checkpoint_names, lambda n: any(key in n for key in config.ignored)):
        return None
    if not config.serialized:
        return Fp8MoEMethod("online")
    if config.activation_scheme == "static":
        raise ValueError("FP8 MoE experts with static activation scales (activation_scheme 'static') are not "
                         "supported: the experts run weight-only and the input_scale would go unused")
    if config.block is not None:
        return Fp8MoEMethod("block", config.block, scale_name="weight_scale_inv")
    return Fp8MoEMethod("tensor")
