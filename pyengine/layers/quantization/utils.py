"""What the quantization methods share (roles of vllm/model_executor/layers/quantization/utils/
{quant_utils,w8a8_utils,fp8_utils}.py): int packing, the FP8 quantizers, and the two forms
every method turns its checkpoint tensors into after loading —

* **FP8** (``finalize_fp8``): weight ``float8_e4m3fn`` [N, K] with float32 scales, one per
  output row ([N]) or per block ([ceil(N/bn), ceil(K/bk)]); activations quantized per token,
  per 128-group of a token (block scales) or with a static per-tensor scale — or not at all;
* **packed integer** (``finalize_int``): 4- or 8-bit unsigned values packed along K into
  int32 [N, K * bits / 32] (each output row's words contiguous: the batch-1 GEMV's layout,
  not GPTQ's [K * bits / 32, N]), scales and zero points [num_groups, N] in the compute
  dtype (zero points in quantized units), weight-only.

On CPU (and wherever the quantized kernels do not run) the weight is dequantized at load
into one dense [N, K] weight of the compute dtype: ``(q - zero) * scale`` in float32, then
cast — the arithmetic transformers and compressed-tensors use, so outputs are token-exact
against them. Activation quantization that the checkpoint prescribes (compressed-tensors'
W8A8 schemes) is reproduced on CPU as compressed-tensors runs it (``fake_quant_fp8``).
"""
from __future__ import annotations

import torch
from torch import nn

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448


# ---- int packing --------------------------------------------------------------------------
def unpack_int32(packed: torch.Tensor, bits: int, dim: int, order: list[int] | None = None) -> torch.Tensor:
    """int32 words -> their ``32 // bits`` unsigned values each, along ``dim`` (value j of a
    word in bits [j*bits, (j+1)*bits)). ``order``: AWQ's interleave (value j of a word is
    logical position ``order[j]`` in its run of 32 // bits). Returns int32 with that dim
    ``32 // bits`` times longer."""
    per = 32 // bits
    p = packed.to(torch.int32).movedim(dim, -1)
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=p.device)
    vals = (p.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., words, per]
    if order is not None:
        inv = [0] * per
        for j, pos in enumerate(order):
            inv[pos] = j
        vals = vals[..., inv]
    return vals.flatten(-2).movedim(-1, dim).contiguous()


def pack_int32(values: torch.Tensor, bits: int, dim: int, order: list[int] | None = None) -> torch.Tensor:
    """The inverse of ``unpack_int32``: unsigned values (< 2**bits) packed into int32 along
    ``dim`` (its length a multiple of 32 // bits)."""
    per = 32 // bits
    v = values.to(torch.int64).movedim(dim, -1)
    if v.shape[-1] % per:
        raise ValueError(f"{v.shape[-1]} values do not fill whole int32 words of {per}")
    v = v.unflatten(-1, (-1, per))
    if order is not None:
        v = v[..., order]
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=v.device)
    words = (v << shifts).sum(-1)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)  # two's complement int32
    return words.to(torch.int32).movedim(-1, dim).contiguous()


# ---- FP8 ----------------------------------------------------------------------------------
def fp8_quantize(w: torch.Tensor, per_row: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (FP8 [N, K], float32 scales [N] (per row) or [1]): ``scale = amax / 448``,
    ``q = clamp(w / scale)`` rounded to e4m3, as vLLM's ``scaled_fp8_quant``. An all-zero row
    gets the scale of float32's smallest normal instead of 0."""
    wf = w.float()
    amax = wf.abs().amax(dim=1) if per_row else wf.abs().amax().reshape(1)
    scale = (amax / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    q = (wf / (scale[:, None] if per_row else scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def fake_quant_fp8(x: torch.Tensor, static_scale: torch.Tensor | None = None,
                   group_size: int | None = None) -> torch.Tensor:
    """Quantize ``x`` [T, K] to e4m3 and back in x.dtype, as compressed-tensors' forward does:
    dynamic per token (``static_scale`` None: ``scale = amax / 448`` in x.dtype, 0 replaced
    by the dtype's eps), per ``group_size`` columns of a token, or with a static scale;
    ``clamp(x / scale)`` rounded to e4m3, times the scale."""
    if x.numel() == 0:
        return x
    if static_scale is not None:
        scale = static_scale.to(x.dtype).reshape(())
        return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).to(x.dtype) * scale
    shape = x.shape
    v = x.unflatten(-1, (-1, group_size)) if group_size else x
    lo = torch.minimum(v.amin(dim=-1, keepdim=True), torch.zeros((), dtype=x.dtype))
    hi = torch.maximum(v.amax(dim=-1, keepdim=True), torch.zeros((), dtype=x.dtype))
    scale = torch.maximum(lo.abs(), hi) / torch.tensor(FP8_MAX, dtype=x.dtype)
    scale = torch.where(scale == 0, torch.tensor(torch.finfo(x.dtype).eps, dtype=x.dtype), scale)
    q = (v / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).to(x.dtype)
    return (q * scale).reshape(shape)


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None) -> torch.Tensor:
    """FP8 weight [N, K] times its float32 scales ([N], [1] or blocks [ceil(N/bn), ceil(K/bk)])
    -> float32 [N, K]."""
    w = weight.to(torch.float32)
    if block is not None:
        n, k = w.shape
        s = scale.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
        return w * s
    s = scale.float()
    return w * (s.reshape(-1, 1) if s.numel() > 1 else s.reshape(()))


def fused_input_scale(layer: nn.Module) -> torch.Tensor:
    """The one static activation scale (float32 scalar) of a layer whose fused parts (q/k/v,
    gate/up) each carry an ``input_scale`` [parts]: the input is quantized once for all of
    them. vLLM takes the largest; that differs from running each part on its own scale (what
    transformers does), so parts whose scales differ are refused. Raises ValueError."""
    scales = layer.input_scale.data
    if not bool((scales == scales[0]).all()):
        raise ValueError(f"the fused parts' static input_scale values differ ({scales.tolist()}): their shared "
                         f"input can only be quantized with one scale")
    return scales[0]


def replace_parameters(layer: nn.Module, **tensors: torch.Tensor | None) -> None:
    """Drop every parameter of ``layer`` but its bias, then register ``tensors`` (frozen
    parameters; None values skipped)."""
    for name, _ in list(layer.named_parameters(recurse=False)):
        if name != "bias":
            delattr(layer, name)
    for name, t in tensors.items():
        if t is not None:
            layer.register_parameter(name, nn.Parameter(t, requires_grad=False))


def use_quant_kernels(t: torch.Tensor) -> bool:
    """Whether the quantized GPU kernels run for a weight on ``t``'s device (CUDA, or the
    triton interpreter with VENGINE_TRITON_OPS_ON_CPU=1) rather than the dequantized weight."""
    from pyengine import ops
    return ops.use_triton(t)


class Fp8Linear:
    """How a finalized FP8 layer runs (kept on the layer as ``layer.fp8``). ``act``:
    ``"token"`` (dynamic per token), ``"group"`` (dynamic per ``block[1]`` columns of a
    token), ``"tensor"`` (static, ``layer.input_scale``) or None (weight-only on CPU);
    ``emulate``: reproduce the activation quantization on the dequantized path (CPU)."""

    def __init__(self, block: tuple[int, int] | None, act: str | None, emulate: bool, dense: bool):
        self.block, self.act, self.emulate, self.dense = block, act, emulate, dense


def finalize_fp8(layer: nn.Module, weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype,
                 block: tuple[int, int] | None = None, act: str | None = "token",
                 input_scale: torch.Tensor | None = None, emulate_act: bool = False) -> None:
    """Give ``layer`` its FP8 form (see the module docstring). weight: FP8 [N, K]; weight_scale:
    float [N] / [1] (per tensor: expanded to [N]) or blocks; input_scale: static scale or
    None. Off the kernel path the weight is dequantized to ``dtype``."""
    if not use_quant_kernels(weight):
        dense = dequantize_fp8(weight, weight_scale, block).to(dtype)
        keep = input_scale.float().reshape(()) if (emulate_act and input_scale is not None) else None
        replace_parameters(layer, weight=dense, input_scale=keep)
        layer.fp8 = Fp8Linear(block, act, emulate_act, dense=True)
        return
    scale = weight_scale.float()
    if block is None:
        scale = scale.reshape(-1).expand(weight.shape[0]).contiguous() if scale.numel() == 1 else scale.reshape(-1)
    replace_parameters(layer, weight=weight.contiguous(), weight_scale=scale.contiguous(),
                       input_scale=input_scale.float().reshape(1) if input_scale is not None else None)
    layer.fp8 = Fp8Linear(block, act, emulate_act, dense=False)


def apply_fp8(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [T, K] -> [T, N]`` through a layer ``finalize_fp8`` prepared."""
    f: Fp8Linear = layer.fp8
    if f.dense:
        if f.emulate and f.act is not None:
            x = fake_quant_fp8(x, getattr(layer, "input_scale", None),
                               f.block[1] if f.act == "group" and f.block else None)
        return torch.nn.functional.linear(x, layer.weight, bias)
    from pyengine.ops import quant as qops
    return qops.fp8_linear(x, layer.weight, layer.weight_scale, getattr(layer, "input_scale", None), bias,
                           f.block, f.act)


# ---- packed integers ------------------------------------------------------------------------
class IntLinear:
    """How a finalized packed-integer layer runs (``layer.int_linear``)."""

    def __init__(self, bits: int, group_size: int, dense: bool):
        self.bits, self.group_size, self.dense = bits, group_size, dense


def check_g_idx(g_idx: torch.Tensor, groups: int) -> None:
    """Raises ValueError when an activation-order ``g_idx`` (each input row's group) names a
    group outside the ``groups`` its scales hold."""
    if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
        raise ValueError(f"g_idx holds group {int(g_idx.max())} (or {int(g_idx.min())}), outside the {groups} groups "
                         f"of its scales")


def dequantize_int(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    """q [K, N] unsigned values, scales/zeros [G, N], g_idx [K] (each row's group) ->
    float32 [N, K] = ``((q - zero) * scale)^T``."""
    s = scales.float().index_select(0, g_idx.long())
    z = zeros.float().index_select(0, g_idx.long())
    return ((q.float() - z) * s).t().contiguous()


class IntParts:
    """An MoE expert projection's unpacked values, kept for its ``FusedMoE`` to stack
    (``moe_wna16``): q uint8 [K, N] unsigned values, scales / zeros float32 [G, N] (zeros in
    quantized units), g_idx int64 [K] (each input row's group), ``group_size``, ``bits``."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor, bits: int,
                 group_size: int):
        self.q, self.scales, self.zeros, self.g_idx = q, scales, zeros, g_idx
        self.bits, self.group_size = bits, group_size

    def trivial_groups(self) -> bool:
        """Whether input row k is in group k // group_size (no activation order)."""
        k = self.g_idx.shape[0]
        return torch.equal(self.g_idx, torch.arange(k, device=self.g_idx.device) // self.group_size)


def finalize_int(layer: nn.Module, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
                 group_size: int, dtype: torch.dtype, g_idx: torch.Tensor | None = None) -> None:
    """Give ``layer`` its packed-integer form (see the module docstring). q: int [K, N]
    unsigned values (< 2**bits); scales, zeros: [G, N] (zeros in quantized units); g_idx
    [K]: each input row's group (None: row // group_size). ``group_size`` = K: one group
    (per output channel). With act-order g_idx the kernels read the rows sorted by group and
    the input is permuted to match (``layer.perm``). A layer with ``keep_int_parts`` set (an
    MoE expert's projection) keeps the values as ``layer.int_parts`` (``IntParts``) instead."""
    k = q.shape[0]
    trivial = torch.arange(k, device=q.device) // group_size
    if g_idx is None:
        g_idx = trivial
    g_idx = g_idx.to(torch.int64)
    if getattr(layer, "keep_int_parts", False):
        replace_parameters(layer)
        layer.int_parts = IntParts(q.to(torch.uint8), scales.float(), zeros.float(), g_idx, bits, group_size)
        return
    perm = None
    if not torch.equal(g_idx, trivial):
        perm = torch.argsort(g_idx, stable=True)
    # Sorted act-order rows must form whole groups of group_size for the kernels (a group cut
    # between tensor-parallel ranks does not): otherwise the dequantized weight runs.
    kernels = use_quant_kernels(q) and (perm is None or torch.equal(g_idx.index_select(0, perm) - g_idx.min(), trivial))
    if not kernels:
        dense = dequantize_int(q, scales, zeros, g_idx).to(dtype)
        replace_parameters(layer, weight=dense)
        layer.int_linear = IntLinear(bits, group_size, dense=True)
        return
    if perm is not None:
        first = int(g_idx.min())
        q, scales, zeros = q.index_select(0, perm), scales[first:], zeros[first:]
    # the kernels' layout: [N, K * bits / 32], each output row's words contiguous (ops/quant.py);
    # symmetric (every zero point 2**(bits - 1)): no zeros tensor, the kernels use the constant
    # (the same arithmetic, one load fewer a row and group)
    symmetric = bool((zeros == float(1 << (bits - 1))).all())
    replace_parameters(layer, qweight=pack_int32(q.t(), bits, 1), scales=scales.to(dtype).contiguous(),
                       zeros=None if symmetric else zeros.to(dtype).contiguous(), perm=perm)
    layer.int_linear = IntLinear(bits, group_size, dense=False)


def apply_int(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [T, K] -> [T, N]`` through a layer ``finalize_int`` prepared."""
    f: IntLinear = layer.int_linear
    if f.dense:
        return torch.nn.functional.linear(x, layer.weight, bias)
    from pyengine.ops import quant as qops
    perm = getattr(layer, "perm", None)
    if perm is not None:
        x = x.index_select(-1, perm)
    return qops.int_linear(x, layer.qweight, layer.scales, getattr(layer, "zeros", None), f.bits, f.group_size, bias)
