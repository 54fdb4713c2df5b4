"""Triton fused elementwise kernels for the decoder layers (role of vLLM's CUDA ops in
csrc/layernorm_kernels.cu, csrc/activation_kernels.cu, csrc/pos_encoding_kernels.cu and
the Qwen3 fused QK-norm + RoPE kernel).

Rounding follows the torch layer functions in ``pyengine/layers`` (which follow HF):
statistics in float32, the normalized value rounded to the input dtype before the weight
multiply, each elementwise product/sum rounded to the input dtype where HF's eager bf16
code rounds. So bf16 outputs match the torch path to within summation-order effects.

Inputs may be strided views (e.g. q/k split out of the fused qkv projection): 2-D
``[rows, hidden]`` or 3-D ``[tokens, heads, head_dim]`` with a contiguous last dim.
Outputs are new contiguous tensors.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pyengine.ops import pdl


def _rows_view(x: torch.Tensor):
    """(x2, n_inner, stride_outer, stride_inner): rows addressed as (r // n_inner, r % n_inner)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 3:
        return x, x.shape[1], x.stride(0), x.stride(1)
    if x.dim() == 2:
        return x, 1, x.stride(0), 0
    if x.dim() == 1:
        return x.view(1, -1), 1, x.shape[0], 0
    x = x.reshape(-1, x.shape[-1])
    return x, 1, x.stride(0), 0


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr, eps,
                     stride_xo, stride_xi, stride_ro, stride_ri,
                     N_INNER: tl.constexpr, N: tl.constexpr, BLOCK: tl.constexpr,
                     ADD: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    o = row // N_INNER
    i = row % N_INNER
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    if PDL:  # (pyengine/ops/pdl.py) the weight is the only input no kernel writes
        tl.extra.cuda.gdc_launch_dependents()
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + o * stride_xo + i * stride_xi + offs, mask=mask, other=0.0)
    dt = x.dtype
    if ADD:
        r = tl.load(r_ptr + o * stride_ro + i * stride_ri + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)
        tl.store(res_out_ptr + row * N + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps)
    y = (xf * rstd).to(dt).to(tl.float32) * w
    tl.store(out_ptr + row * N + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _norm_launch(x, residual, weight, eps):
    shape = x.shape
    n = shape[-1]
    x2, n_inner, sxo, sxi = _rows_view(x)
    rows = x2.numel() // n if x2.dim() == 2 else x2.shape[0] * x2.shape[1]
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    if residual is not None:
        r2, r_inner, sro, sri = _rows_view(residual)
        assert r_inner == n_inner
        res_out = torch.empty(shape, dtype=x.dtype, device=x.device)
    else:
        r2, sro, sri, res_out = x2, 0, 0, out
    if rows == 0:
        return out, res_out
    block = triton.next_power_of_2(n)
    nw = 8 if block >= 4096 else (4 if block >= 1024 else 1)
    _rms_norm_kernel[(rows,)](x2, r2, weight, out, res_out, float(eps), sxo, sxi, sro, sri,
                              N_INNER=n_inner, N=n, BLOCK=block, ADD=residual is not None,
                              num_warps=nw, **pdl.launch_kwargs(x2, "rms_norm"))
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton RMSNorm. x: [..., hidden] (bf16/fp16/fp32, last dim contiguous); weight:
    [hidden]. Returns y shaped/typed like x (contiguous).
    Mirrors vllm csrc/layernorm_kernels.cu ``rms_norm``."""
    return _norm_launch(x, None, weight, eps)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton residual add + RMSNorm. x, residual: [..., hidden], same dtype; weight:
    [hidden]. Returns (rms_norm(x + residual), x + residual), both new tensors shaped like x;
    the sum is rounded to x.dtype before the norm (as HF). Mirrors vllm
    ``fused_add_rms_norm`` (which is in place; this one is not)."""
    return _norm_launch(x, residual, weight, eps)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, D: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if PDL:  # (pyengine/ops/pdl.py) every input is another kernel's output
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * stride_x + D + offs, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    tl.store(out_ptr + row * D + offs, (s * u.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Triton SiLU-and-mul. x: [..., 2*d] = cat(gate, up); returns silu(gate) * up,
    [..., d], dtype of x (silu rounded to x.dtype before the product, as torch eager).
    Mirrors vllm csrc/activation_kernels.cu ``silu_and_mul``."""
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x.shape[:-1] + (d,), dtype=x.dtype, device=x.device)
    rows = x2.shape[0]
    if rows == 0:
        return out
    block = min(1024, triton.next_power_of_2(d))
    _silu_and_mul_kernel[(rows, triton.cdiv(d, block))](x2, out, x2.stride(0), D=d, BLOCK=block,
                                                         num_warps=4, **pdl.launch_kwargs(x2, "silu_and_mul"))
    return out


@triton.jit
def _rope_heads(src_ptr, t, stride_t, stride_h, dst_base, dst_stride_h, h_limit, cos, sin, w_ptr, eps,
                H_PAD: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr):
    """Rotate heads [0, h_limit) of token t of src and store them at dst_base + h * dst_stride_h."""
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, HALF)
    mask = (offs_h < h_limit)[:, None]
    base = src_ptr + t * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + HALF, mask=mask, other=0.0)
    dt = x1.dtype
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    if NORM:
        rstd = 1.0 / tl.sqrt((tl.sum(x1f * x1f, 1) + tl.sum(x2f * x2f, 1)) / (2 * HALF) + eps)
        w1 = tl.load(w_ptr + offs_d).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + offs_d).to(tl.float32)
        x1f = ((x1f * rstd[:, None]).to(dt).to(tl.float32) * w1[None, :]).to(dt).to(tl.float32)
        x2f = ((x2f * rstd[:, None]).to(dt).to(tl.float32) * w2[None, :]).to(dt).to(tl.float32)
    # neox: out1 = x1*cos - x2*sin, out2 = x2*cos + x1*sin, each product rounded like HF
    a = (x1f * cos[None, :]).to(dt).to(tl.float32)
    b = (-x2f * sin[None, :]).to(dt).to(tl.float32)
    c = (x2f * cos[None, :]).to(dt).to(tl.float32)
    e = (x1f * sin[None, :]).to(dt).to(tl.float32)
    out = dst_base + offs_h[:, None] * dst_stride_h + offs_d[None, :]
    tl.store(out, (a + b).to(dt), mask=mask)
    tl.store(out + HALF, (c + e).to(dt), mask=mask)


@triton.jit
def _rope_q(q_ptr, q_out_ptr, t, pos_ptr, cache_ptr, qw_ptr, eps, stride_qt, stride_qh, stride_c,
            HQ: tl.constexpr, HQ_PAD: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr):
    """Shared prologue of the RoPE kernels: load token t's cos/sin, rotate its q heads into
    the contiguous q_out; returns (cos, sin) for the k heads."""
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, HALF)
    cos = tl.load(cache_ptr + pos * stride_c + offs_d).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_c + HALF + offs_d).to(tl.float32)
    _rope_heads(q_ptr, t, stride_qt, stride_qh, q_out_ptr + t * (HQ * 2 * HALF), 2 * HALF, HQ,
                cos, sin, qw_ptr, eps, HQ_PAD, HALF, NORM)
    return cos, sin


@triton.jit
def _rope_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cache_ptr, qw_ptr, kw_ptr, eps,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_c,
                 HQ: tl.constexpr, HQ_PAD: tl.constexpr, HK: tl.constexpr, HK_PAD: tl.constexpr,
                 HALF: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    if PDL:  # (pyengine/ops/pdl.py) q, k and the positions are other kernels' outputs
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    cos, sin = _rope_q(q_ptr, q_out_ptr, t, pos_ptr, cache_ptr, qw_ptr, eps, stride_qt, stride_qh, stride_c,
                       HQ, HQ_PAD, HALF, NORM)
    _rope_heads(k_ptr, t, stride_kt, stride_kh, k_out_ptr + t * (HK * 2 * HALF), 2 * HALF, HK,
                cos, sin, kw_ptr, eps, HK_PAD, HALF, NORM)


@triton.jit
def _rope_cache_kernel(q_ptr, k_ptr, v_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, slot_ptr,
                       cache_ptr, qw_ptr, kw_ptr, eps,
                       stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_c,
                       stride_cb, stride_cs, stride_ch,
                       HQ: tl.constexpr, HQ_PAD: tl.constexpr, HK: tl.constexpr, HK_PAD: tl.constexpr,
                       HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    if PDL:  # (pyengine/ops/pdl.py) q, k, v, positions and slots are other kernels' outputs
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    cos, sin = _rope_q(q_ptr, q_out_ptr, t, pos_ptr, cache_ptr, qw_ptr, eps, stride_qt, stride_qh, stride_c,
                       HQ, HQ_PAD, HALF, NORM)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    # Padding rows (slot -1) write nothing: fold the skip into the head bound.
    hk_limit = tl.where(slot >= 0, HK, 0)
    s = tl.where(slot >= 0, slot, 0)
    dst = (s // BLOCK_SIZE) * stride_cb + (s % BLOCK_SIZE) * stride_cs
    _rope_heads(k_ptr, t, stride_kt, stride_kh, k_cache_ptr + dst, stride_ch, hk_limit,
                cos, sin, kw_ptr, eps, HK_PAD, HALF, NORM)
    offs_h = tl.arange(0, HK_PAD)
    offs_v = tl.arange(0, 2 * HALF)
    m = (offs_h < hk_limit)[:, None]
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_v[None, :], mask=m, other=0.0)
    tl.store(v_cache_ptr + dst + offs_h[:, None] * stride_ch + offs_v[None, :],
             v.to(v_cache_ptr.dtype.element_ty), mask=m)


def rope_and_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                   cos_sin_cache: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, q_norm_weight: torch.Tensor | None = None,
                   k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """One kernel for (optional per-head q/k RMSNorm) + neox RoPE + the KV-cache write.

    q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] (before RoPE; last dim
    contiguous); positions: int64 [T]; cos_sin_cache: [max_positions, head_dim];
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim];
    slot_mapping: int64 [>= T], -1 rows write nothing. Rotated k goes straight into the
    cache (attention reads it from there); returns the rotated q, [T, num_heads, head_dim].
    Mirrors the fused rope + reshape_and_cache path of vLLM's attention backends.
    """
    T, hq, d = q.shape
    hk = k.shape[1]
    assert d % 2 == 0 and (d // 2) & (d // 2 - 1) == 0, "head_dim/2 must be a power of two"
    assert key_cache.stride() == value_cache.stride() and key_cache.stride(-1) == 1
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    q_out = torch.empty((T, hq, d), dtype=q.dtype, device=q.device)
    if T == 0:
        return q_out
    norm = q_norm_weight is not None
    qw = q_norm_weight if norm else q
    kw = k_norm_weight if norm else k
    _rope_cache_kernel[(T,)](
        q, k, v, q_out, key_cache, value_cache, positions, slot_mapping, cos_sin_cache, qw, kw, float(eps),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin_cache.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        HQ=hq, HQ_PAD=triton.next_power_of_2(hq), HK=hk, HK_PAD=triton.next_power_of_2(hk),
        HALF=d // 2, BLOCK_SIZE=key_cache.shape[1], NORM=norm, num_warps=4, **pdl.launch_kwargs(q, "rope_and_cache"))
    return q_out


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor, q_norm_weight: torch.Tensor | None = None,
                 k_norm_weight: torch.Tensor | None = None,
                 eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton neox-style RoPE on q and k, optionally preceded by per-head RMSNorm (Qwen3's
    q_norm / k_norm, weights [head_dim]) in the same kernel.

    q: [T, num_heads, head_dim]; k: [T, num_kv_heads, head_dim] (token/head strides free,
    last dim contiguous); positions: int64 [T]; cos_sin_cache: [max_positions, head_dim] =
    cat(cos, sin) over head_dim/2 frequencies (model dtype). Returns new contiguous (q, k).
    Mirrors vllm csrc/pos_encoding_kernels.cu and the fused qk-norm-rope kernel.
    """
    T, hq, d = q.shape
    hk = k.shape[1]
    assert d % 2 == 0 and (d // 2) & (d // 2 - 1) == 0, "head_dim/2 must be a power of two"
    assert cos_sin_cache.shape[-1] == d and cos_sin_cache.stride(-1) == 1
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    q_out = torch.empty((T, hq, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((T, hk, d), dtype=k.dtype, device=k.device)
    if T == 0:
        return q_out, k_out
    norm = q_norm_weight is not None
    qw = q_norm_weight if norm else q
    kw = k_norm_weight if norm else k
    _rope_kernel[(T,)](q, k, q_out, k_out, positions, cos_sin_cache, qw, kw, float(eps),
                       q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
                       HQ=hq, HQ_PAD=triton.next_power_of_2(hq), HK=hk,
                       HK_PAD=triton.next_power_of_2(hk), HALF=d // 2, NORM=norm, num_warps=4,
                       **pdl.launch_kwargs(q, "rope"))
    return q_out, k_out


@triton.jit
def _mix32(x):  # native.mix32 on uint32 (wrapping multiplies, logical shifts)
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _seeded_exp_kernel(lo_ptr, hi_ptr, pos_ptr, out_ptr, V, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    lo = tl.load(lo_ptr + row).to(tl.uint32)
    hi = tl.load(hi_ptr + row).to(tl.uint32)
    pos = tl.load(pos_ptr + row).to(tl.uint32)
    key = _mix32(_mix32(_mix32(pos ^ 0x9E3779B9) ^ hi) ^ lo)
    tok = _mix32(offs.to(tl.uint32) + 0x6A09E667)
    h = _mix32(key ^ tok)
    u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # < 1 exactly (native.seeded_exponentials)
    tl.store(out_ptr + row.to(tl.int64) * stride_o + offs, -tl.log(u), mask=offs < V)


def seeded_exponentials(seed_lo: torch.Tensor, seed_hi: torch.Tensor, positions: torch.Tensor,
                        vocab_size: int) -> torch.Tensor:
    """``native.seeded_exponentials`` in one kernel (the same 32-bit words; the log may
    differ from torch's in the last bit)."""
    R = positions.shape[0]
    out = torch.empty((R, vocab_size), dtype=torch.float32, device=positions.device)
    if R:
        block = 1024
        _seeded_exp_kernel[(R, triton.cdiv(vocab_size, block))](seed_lo, seed_hi, positions, out, vocab_size,
                                                                out.stride(0), BLOCK=block, num_warps=4)
    return out
