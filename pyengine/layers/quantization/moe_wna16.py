"""INT4 / INT8 weight-only MoE experts (W4A16, W8A16): GPTQ, AWQ and compressed-tensors
``pack-quantized`` checkpoints (the role of vllm/model_executor/layers/quantization/moe_wna16.py's
``MoeWNA16Method`` and ``CompressedTensorsWNA16MoEMethod``).

Loading reuses the dense formats' own code: each local expert's three projections become
that format's quantized linear layers (``make_linear_method()``: ``GPTQLinearMethod``,
``AWQLinearMethod``, ``CompressedTensorsWNA16``), children ``<e>.<proj>`` of the
``FusedMoE`` named as the checkpoint names them, so every tensor (``qweight``, ``qzeros``,
``scales``, ``g_idx``; ``weight_packed``, ``weight_scale``, ``weight_zero_point`` ...) loads
through those layers' loaders: packing, groups, activation order and tensor-parallel splits
are the dense path's. Gate and up are column-parallel, down row-parallel, as the experts'
intermediate split (``FusedMoE``); with expert parallelism they are whole.

After loading each expert's projections are unpacked (``utils.IntParts``) and stacked, one
expert at a time, into the fused-MoE kernels' form (``fused_moe.fused_experts``'s integer
weights): ``w13_weight`` int32 [E, 2I, H * bits / 32] and ``w2_weight`` int32
[E, H, I * bits / 32], packed along the input dim; float32 scales [E, 2I, H / g] and
[E, H, I / g] per group of g input columns (``block_shape`` (1, g); a per-channel or
unequal pair of group sizes is expanded to their gcd); zero points the same shapes, or none
when every one is 2**(bits - 1) (symmetric). Elsewhere (CPU), and for activation-order
checkpoints whose groups are not runs of consecutive rows, the experts are dequantized into
the model's dtype, ``(q - zero) * scale`` in float32 then cast: token-exact against a float
model holding those weights.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from pyengine.layers.quantization.base_config import FusedMoEMethodBase, LinearMethodBase
from pyengine.layers.quantization.utils import IntParts, dequantize_int, pack_int32, use_quant_kernels


class MoeWNA16Method(FusedMoEMethodBase):
    """``make_linear_method``: a fresh linear method of the checkpoint's format for one
    projection; ``bits``: 4 or 8; ``name``: the format, for messages; ``act_order``: the
    checkpoint may group input rows out of order (GPTQ ``desc_act``, compressed-tensors
    group ``actorder``): such experts are dequantized (the kernels read groups of
    consecutive rows). Raises ValueError for other bit widths."""

    def __init__(self, make_linear_method: Callable[[], LinearMethodBase], bits: int, name: str,
                 act_order: bool = False):
        if bits not in (4, 8):
            raise ValueError(f"{name} MoE experts with {bits}-bit weights are not supported (4 or 8)")
        self.make_linear_method, self.bits, self.name, self.act_order = make_linear_method, bits, name, act_order

    def create_weights(self, layer) -> None:
        from pyengine.layers.linear import ColumnParallelLinear, RowParallelLinear

        layer.drop_expert_weights()
        tp = None if layer.use_ep else layer.tp_group
        h, inter = layer.hidden_size, layer.intermediate_size
        for e in layer.local_expert_ids():
            box = nn.Module()
            for proj, kind in layer.expert_proj_names.items():
                with torch.device("meta"):  # no float weight allocated: the method replaces it at once
                    lin = (RowParallelLinear(inter, h, tp_group=tp, reduce_results=False) if kind == "w2"
                           else ColumnParallelLinear(h, inter, tp_group=tp))
                lin.keep_int_parts = True  # finalize_int keeps the values for stacking (utils.IntParts)
                lin.set_quant_method(self.make_linear_method())
                box.add_module(proj, lin)
            layer.add_module(str(e), box)

    def _parts(self, layer, e: int) -> dict[str, IntParts]:
        box = getattr(layer, str(e))
        out = {}
        for proj, kind in layer.expert_proj_names.items():
            lin = getattr(box, proj)
            lin.quant_method.process_weights_after_loading(lin)
            out[kind] = lin.int_parts
        delattr(layer, str(e))  # the projection's tensors are no longer needed
        return out

    def process_weights_after_loading(self, layer) -> None:
        experts = list(layer.local_expert_ids())
        first = self._parts(layer, experts[0])
        if self.act_order or not use_quant_kernels(first["w1"].scales):
            self._dense(layer, experts, first)
            return
        g = math.gcd(first["w1"].group_size, first["w2"].group_size)
        w13, w2, s13, s2, z13, z2 = [], [], [], [], [], []
        parts = first
        for i, e in enumerate(experts):
            if i:
                parts = self._parts(layer, e)
            if not all(p.trivial_groups() for p in parts.values()):  # the formats refuse this without act order
                raise ValueError(f"expert {e}'s {self.name} groups are not runs of consecutive input rows")
            q13 = torch.cat([parts["w1"].q, parts["w3"].q], dim=1)  # [H, 2I]
            w13.append(pack_int32(q13.t(), self.bits, 1))
            w2.append(pack_int32(parts["w2"].q.t(), self.bits, 1))
            s13.append(_groups(torch.cat([parts["w1"].scales, parts["w3"].scales], dim=1), parts["w1"].group_size, g))
            z13.append(_groups(torch.cat([parts["w1"].zeros, parts["w3"].zeros], dim=1), parts["w1"].group_size, g))
            s2.append(_groups(parts["w2"].scales, parts["w2"].group_size, g))
            z2.append(_groups(parts["w2"].zeros, parts["w2"].group_size, g))
        sym = float(1 << (self.bits - 1))
        zp = [None if all(bool((z == sym).all()) for z in zs) else torch.stack(zs) for zs in (z13, z2)]
        layer.set_expert_weights(torch.stack(w13), torch.stack(w2), torch.stack(s13), torch.stack(s2), (1, g),
                                 w13_zp=zp[0], w2_zp=zp[1], weight_bits=self.bits)

    def _dense(self, layer, experts: list[int], first: dict[str, IntParts]) -> None:
        w13, w2 = [], []
        for i, e in enumerate(experts):
            parts = first if i == 0 else self._parts(layer, e)
            gate, up, down = (dequantize_int(p.q, p.scales, p.zeros, p.g_idx) for p in
                              (parts["w1"], parts["w3"], parts["w2"]))
            w13.append(torch.cat([gate, up]).to(layer.params_dtype))
            w2.append(down.to(layer.params_dtype))
        layer.set_expert_weights(torch.stack(w13), torch.stack(w2), None, None, None)

    def dummy_weights(self, layer, gen) -> None:
        for e in layer.local_expert_ids():
            for proj in layer.expert_proj_names:
                lin = getattr(getattr(layer, str(e)), proj)
                lin.quant_method.dummy_weights(lin, gen)


def _groups(t: torch.Tensor, group_size: int, g: int) -> torch.Tensor:
    """[G, N] per ``group_size`` input rows -> float32 [N, G * group_size / g] per ``g`` rows
    (``g`` divides ``group_size``): the kernels' layout, each output row's groups contiguous."""
    return t.float().repeat_interleave(group_size // g, dim=0).t().contiguous()
