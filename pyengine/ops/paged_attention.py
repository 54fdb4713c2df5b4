"""Triton kernels for paged attention (role of vllm/v1/attention/backends/triton_attn.py and
vllm/attention/ops/{triton_reshape_and_cache_flash,triton_decode_attention,
triton_unified_attention}.py).

KV cache layout, per layer: ``key_cache`` and ``value_cache`` are
``[num_blocks, block_size, num_kv_heads, head_dim]`` views (the two halves of the
``[2, num_blocks, block_size, num_kv_heads, head_dim]`` tensor), last dim contiguous.
Token ``n`` of request ``b`` lives in physical block ``block_table[b, n // block_size]`` at
offset ``n % block_size``.

Three kernels:

* ``reshape_and_cache``: scatter the step's K/V rows into the cache by slot mapping
  (slot -1 = padding row, skipped).
* ``paged_decode``: one query per request. Split-KV ("flash-decoding"): the grid is
  ``(num_reqs, num_kv_heads, num_splits)``; each program owns one KV head and one slice of
  the context, computes all ``num_heads // num_kv_heads`` query heads of that KV head
  (so each KV tile is read once), and writes a partial output and log-sum-exp; a second
  kernel merges the splits. The grid depends only on the batch size and static config,
  so the launch can be captured in a CUDA graph; sequence lengths are read on the device.
* ``paged_extend``: varlen queries (``query_start_loc``), each request's queries are the
  last ``q_len`` positions of its context; causal attention over the cached prefix and
  the new tokens, all read through the block table (the new tokens are written first).
  Query heads of one KV head are packed into the rows of one tile.

All softmax math is float32 (base-2 exponentials with the scale folded in); inputs and
outputs are in the model dtype (bf16/fp16/fp32).

FP8 KV cache (``kv_cache_dtype="fp8"``): the caches are float8_e4m3fn; a layer's K and V
each have a per-tensor scale (the checkpoint's ``k_scale`` / ``v_scale``, else 1.0):
``reshape_and_cache`` stores ``round_e4m3(clamp(k / k_scale))``; the attention kernels read
the FP8 values, fold ``k_scale`` into the softmax scale and multiply the output by
``v_scale`` (both are linear in K and V), so nothing is dequantized in memory.
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from pyengine.ops import pdl
from pyengine.ops.quant import _round_fp8

_LOG2E = 1.4426950408889634
# The triton CPU interpreter computes tl.dot wrongly on bf16 operands: upcast there.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    elif a.dtype == tl.float32:
        # fp32 models need IEEE products: tl.dot defaults to TF32 (10-bit mantissa), which
        # flips near-tie greedy tokens against the reference.
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


# --------------------------------------------------------------------------------------
# KV-cache write
# --------------------------------------------------------------------------------------
@triton.jit
def _reshape_and_cache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    k_inv_scale, v_inv_scale,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK: tl.constexpr, FP8: tl.constexpr, EMULATE: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    h = offs // HEAD_DIM
    d = offs % HEAD_DIM
    # (a scalar-vs-tensor `&` trips the triton interpreter; fold the skip into the bound)
    mask = offs < tl.where(slot >= 0, NUM_KV_HEADS * HEAD_DIM, 0)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    dst = blk * stride_cb + off * stride_cs + h * stride_ch + d
    k = tl.load(k_ptr + t.to(tl.int64) * stride_kt + h * stride_kh + d, mask=mask, other=0.0)
    v = tl.load(v_ptr + t.to(tl.int64) * stride_vt + h * stride_vh + d, mask=mask, other=0.0)
    if FP8:
        k = _round_fp8(tl.clamp(k.to(tl.float32) * k_inv_scale, -448.0, 448.0), EMULATE)
        v = _round_fp8(tl.clamp(v.to(tl.float32) * v_inv_scale, -448.0, 448.0), EMULATE)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
                      v_scale: float = 1.0) -> None:
    """Write K/V rows into the paged cache (in place); an FP8 cache gets ``k / k_scale`` and
    ``v / v_scale`` rounded to e4m3 (clamped to +-448).

    k, v: [T, num_kv_heads, head_dim] (any row/head strides, last dim contiguous);
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim];
    slot_mapping: int64 [>= T], ``block_id * block_size + offset``; -1 rows are skipped.
    Mirrors vllm/attention/ops/triton_reshape_and_cache_flash.py.
    """
    T, num_kv_heads, head_dim = k.shape
    if T == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1
    assert key_cache.stride() == value_cache.stride() and key_cache.stride(-1) == 1
    block = triton.next_power_of_2(num_kv_heads * head_dim)
    _reshape_and_cache_kernel[(T,)](
        k, v, key_cache, value_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), 1.0 / k_scale, 1.0 / v_scale,
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=key_cache.shape[1],
        BLOCK=block, FP8=key_cache.dtype == torch.float8_e4m3fn, EMULATE=_INTERPRET, num_warps=4 if block >= 1024 else 2,
    )


# --------------------------------------------------------------------------------------
# Decode (split-KV + reduction)
# --------------------------------------------------------------------------------------
# query_len at run time, one variant for every Q: a verification's Q varies (fewer drafts at
# the end of a request) and a new constexpr would JIT-compile inside a serving step
@triton.jit(do_not_specialize=["query_len"])
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    qk_scale,  # softmax scale * log2(e) (* k_scale for an FP8 cache)
    v_scale, query_len,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr,
):
    b = tl.program_id(0)  # the query row; its request: b // query_len
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if PDL:  # (pyengine/ops/pdl.py) every input is another kernel's output
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    req = b // query_len
    # row i of a request's query_len rows sees its context up to its own position (causal)
    seq_len = tl.maximum(tl.load(seq_lens_ptr + req) - (query_len - 1 - b % query_len), 0)
    # Tokens per split, a multiple of BLOCK_N; trailing splits may be empty.
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kvh * GROUP + offs_g
    mask_g = offs_g < GROUP
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None], other=0.0)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    head_off = kvh * stride_ch
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        page = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
        row = page * stride_cb + (offs_n % BLOCK_SIZE) * stride_cs + head_off
        k = tl.load(k_cache_ptr + row[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0).to(q.dtype)
        s = _dot(q, tl.trans(k), UPCAST) * qk_scale
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + row[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)
        m_i = m_new

    has = l_i > 0.0
    o = acc * v_scale / tl.where(has, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + b.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=mask_g[:, None])
    else:
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        base = (b.to(tl.int64) * NUM_HEADS + heads) * NUM_SPLITS + split  # [GROUP_PAD]
        tl.store(part_lse_ptr + base, lse, mask=mask_g)
        tl.store(part_out_ptr + base[:, None] * HEAD_DIM + offs_d[None, :], o, mask=mask_g[:, None])


@triton.jit
def _decode_reduce_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr, PDL: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    if PDL:  # (pyengine/ops/pdl.py)
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_s = offs_s < NUM_SPLITS
    base = (b.to(tl.int64) * NUM_HEADS + h) * NUM_SPLITS + offs_s
    lse = tl.load(part_lse_ptr + base, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    denom = tl.sum(w, 0)
    o = tl.load(part_out_ptr + base[:, None] * HEAD_DIM + offs_d[None, :], mask=mask_s[:, None], other=0.0)
    res = tl.sum(o * w[:, None], 0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(out_ptr + b.to(tl.int64) * stride_ot + h * stride_oh + offs_d, res.to(out_ptr.dtype.element_ty))


def paged_decode(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 block_table: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor,
                 scale: float, num_splits: int, part_out: torch.Tensor | None = None,
                 part_lse: torch.Tensor | None = None, block_n: int | None = None,
                 num_warps: int = 4, num_stages: int = 3, k_scale: float = 1.0,
                 v_scale: float = 1.0, query_len: int = 1) -> torch.Tensor:
    """Paged decode attention, one query token per request (an FP8 cache is read with its
    ``k_scale`` / ``v_scale``); with ``query_len`` Q > 1, Q consecutive query rows per
    request (a speculative verification's 1 + k rows, a draft chain's padded first
    forward): row i of request r attends causally over ``seq_lens[r] - (Q - 1 - i)``
    positions, each row a decode query of its own (the role of the decode path vLLM's
    Triton backend gives uniform short queries).

    q: [B, num_heads, head_dim] (row b = request b // Q; row/head strides free, last dim
    contiguous); key_cache/value_cache: [num_blocks, block_size, num_kv_heads, head_dim];
    block_table: int32 [>= B / Q, max_blocks]; seq_lens: int32 [>= B / Q] (context length
    incl. the request's last query token; 0 = padding request, output zeros); out: [B,
    num_heads, head_dim].
    part_out: float32 [>= B * num_heads * num_splits * head_dim], part_lse: float32
    [>= B * num_heads * num_splits] scratch (needed when num_splits > 1).
    Grid ``(B, num_kv_heads, num_splits)``: static for a given B. Returns ``out``.
    Defaults (block_n 64, 4 warps, 3 stages) were the fastest of a sweep on an H200
    (benchmarks/attention_kernels.py --sweep, 2026-11-29).
    """
    B, num_heads, head_dim = q.shape
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    assert num_heads % num_kv_heads == 0 and head_dim == triton.next_power_of_2(head_dim)
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and key_cache.stride(-1) == 1
    assert key_cache.stride() == value_cache.stride()
    if B == 0:
        return out
    group = num_heads // num_kv_heads
    if block_n is None:
        block_n = max(64, block_size) if head_dim <= 128 else max(32, block_size)
    if num_splits > 1:
        assert part_out is not None and part_lse is not None
        assert part_out.numel() >= B * num_heads * num_splits * head_dim
        assert part_lse.numel() >= B * num_heads * num_splits
    else:
        part_out, part_lse = out, out  # unused
    _decode_split_kernel[(B, num_kv_heads, num_splits)](
        q, key_cache, value_cache, block_table, seq_lens,
        out, part_out, part_lse,
        scale * _LOG2E * k_scale, v_scale, query_len,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_table.stride(0),
        NUM_HEADS=num_heads, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_N=block_n, NUM_SPLITS=num_splits, UPCAST=_INTERPRET,
        num_warps=num_warps, num_stages=num_stages, **pdl.launch_kwargs(q, "decode"),
    )
    if num_splits > 1:
        _decode_reduce_kernel[(B, num_heads)](
            out, part_out, part_lse, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits), num_warps=4, **pdl.launch_kwargs(q, "decode_reduce"),
        )
    return out


# --------------------------------------------------------------------------------------
# Prefill / extend (varlen queries over the paged context, causal)
# --------------------------------------------------------------------------------------
@triton.jit
def _extend_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, qsl_ptr, seq_lens_ptr, block_table_ptr,
    qk_scale, v_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kt, stride_cs, stride_ch, stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGED: tl.constexpr, UPCAST: tl.constexpr,
):
    """PAGED: k_ptr/v_ptr are the key/value caches, stride_kt = block stride, stride_cs =
    slot stride. Not PAGED (no cache bound, e.g. profiling runs): k_ptr/v_ptr are the
    step's own K/V rows, stride_kt = row stride, and the context is the query rows."""
    pid_m = tl.program_id(0)
    r = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(qsl_ptr + r)
    q_len = tl.load(qsl_ptr + r + 1) - q_start
    if PAGED:
        seq_len = tl.load(seq_lens_ptr + r)
    else:
        seq_len = q_len
    ctx = seq_len - q_len  # cached prefix length

    ROWS: tl.constexpr = BLOCK_T * GROUP_PAD
    offs_r = tl.arange(0, ROWS)
    tok = pid_m * BLOCK_T + offs_r // GROUP_PAD  # query index within the request
    g = offs_r % GROUP_PAD
    mask_r = (tok < q_len) & (g < GROUP)
    heads = kvh * GROUP + g
    offs_d = tl.arange(0, HEAD_DIM)
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_r[:, None], other=0.0)
    qpos = ctx + tok  # absolute position of each query row

    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)

    active = pid_m * BLOCK_T < q_len
    # keys [0, diag) are visible to every query row of this tile: no causal mask needed
    diag = tl.where(active, ((ctx + pid_m * BLOCK_T) // BLOCK_N) * BLOCK_N, 0)
    hi = tl.where(active, tl.minimum(seq_len, ctx + (pid_m + 1) * BLOCK_T), 0)
    bt_row = block_table_ptr + r.to(tl.int64) * stride_bt
    head_off = kvh * stride_ch
    offs_b = tl.arange(0, BLOCK_N)

    for n0 in range(0, diag, BLOCK_N):
        offs_n = n0 + offs_b
        if PAGED:
            page = tl.load(bt_row + offs_n // BLOCK_SIZE).to(tl.int64)
            row = page * stride_kt + (offs_n % BLOCK_SIZE) * stride_cs + head_off
        else:
            row = (q_start + offs_n).to(tl.int64) * stride_kt + head_off
        k = tl.load(k_ptr + row[:, None] + offs_d[None, :]).to(q.dtype)
        s = _dot(q, tl.trans(k), UPCAST) * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + row[:, None] + offs_d[None, :]).to(q.dtype)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)
        m_i = m_new

    for n0 in range(diag, hi, BLOCK_N):
        offs_n = n0 + offs_b
        mask_n = offs_n < seq_len
        if PAGED:
            page = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
            row = page * stride_kt + (offs_n % BLOCK_SIZE) * stride_cs + head_off
        else:
            row = (q_start + offs_n).to(tl.int64) * stride_kt + head_off
        k = tl.load(k_ptr + row[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0).to(q.dtype)
        s = _dot(q, tl.trans(k), UPCAST) * qk_scale
        vis = (offs_n[None, :] <= qpos[:, None]) & mask_n[None, :]
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + row[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)
        m_i = m_new

    o = acc * v_scale / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=mask_r[:, None])


def paged_extend(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                 block_table: torch.Tensor, out: torch.Tensor, scale: float,
                 max_query_len: int, num_reqs: int, block_t: int | None = None,
                 block_n: int | None = None, num_warps: int | None = None,
                 num_stages: int | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Varlen causal attention over paged context (prefill, chunked prefill, extend with a
    cached prefix, and decode rows mixed in).

    q: [T, num_heads, head_dim]; key_cache/value_cache: [num_blocks, block_size,
    num_kv_heads, head_dim] already holding this step's K/V; query_start_loc: int32
    [num_reqs + 1]; seq_lens: int32 [num_reqs] (context after this step, tokens);
    block_table: int32 [num_reqs, max_blocks]; out: [T, num_heads, head_dim].
    Request i's queries (rows qsl[i]..qsl[i+1]) sit at positions seq_len - q_len + j.
    ``max_query_len`` (host int) sizes the grid ``(cdiv(max_query_len, block_t), num_reqs,
    num_kv_heads)``. Returns ``out``.
    """
    return _extend(q, key_cache, value_cache, query_start_loc, seq_lens, block_table, out,
                   scale, max_query_len, num_reqs, True, block_t, block_n, num_warps, num_stages, k_scale, v_scale)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     query_start_loc: torch.Tensor, out: torch.Tensor, scale: float,
                     max_query_len: int, num_reqs: int) -> torch.Tensor:
    """Causal varlen attention of each request's rows over its own rows only (no cache;
    used before KV caches are bound, e.g. the profiling forward).
    q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim]; query_start_loc: int32
    [num_reqs + 1]; out: [T, num_heads, head_dim]."""
    return _extend(q, k, v, query_start_loc, query_start_loc, query_start_loc, out, scale,
                   max_query_len, num_reqs, False, None, None, None, None)


def _extend(q, k_src, v_src, qsl, seq_lens, block_table, out, scale, max_query_len, num_reqs,
            paged, block_t, block_n, num_warps, num_stages, k_scale=1.0, v_scale=1.0):
    T, num_heads, head_dim = q.shape
    if T == 0 or num_reqs == 0 or max_query_len <= 0:
        return out
    if paged:
        num_kv_heads, block_size = k_src.shape[2], k_src.shape[1]
        assert k_src.stride() == v_src.stride()
        stride_kt, stride_cs, stride_ch = k_src.stride(0), k_src.stride(1), k_src.stride(2)
        stride_bt = block_table.stride(0)
    else:
        num_kv_heads, block_size = k_src.shape[1], 1
        assert k_src.stride() == v_src.stride()
        stride_kt, stride_cs, stride_ch = k_src.stride(0), 0, k_src.stride(1)
        stride_bt = 0
    assert num_heads % num_kv_heads == 0 and head_dim == triton.next_power_of_2(head_dim)
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and k_src.stride(-1) == 1
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    rows = 128 if head_dim <= 128 else 64
    if block_t is None:
        block_t = max(1, rows // group_pad)
        # short queries (decode rows, small chunks): smaller tiles waste less
        block_t = min(block_t, max(16 // group_pad, 1, triton.next_power_of_2(max_query_len)))
    if block_t * group_pad < 16:
        block_t = max(block_t, 16 // group_pad)
    if block_n is None:
        block_n = 64 if head_dim <= 128 else 32
    if num_warps is None:
        num_warps = 8 if block_t * group_pad >= 128 else 4
    if num_stages is None:
        num_stages = 2
    grid = (triton.cdiv(max_query_len, block_t), num_reqs, num_kv_heads)
    _extend_kernel[grid](
        q, k_src, v_src, out, qsl, seq_lens, block_table,
        scale * _LOG2E * k_scale, v_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        stride_kt, stride_cs, stride_ch, stride_bt,
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_T=block_t, BLOCK_N=block_n, PAGED=paged, UPCAST=_INTERPRET,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def default_num_splits(batch: int, num_kv_heads: int, num_sms: int, max_splits: int = 16,
                       waves: float = 2.0) -> int:
    """Split count for the decode kernel: enough programs for ``waves`` programs per SM,
    a power of two in [1, max_splits]. Depends only on static config and batch size.
    On an H200 (132 SMs, 8 KV heads) batch >= 64 measured fastest unsplit (1 split)."""
    want = math.ceil(num_sms * waves / max(1, batch * num_kv_heads))
    splits = 1
    while splits < want and splits < max_splits:
        splits *= 2
    return splits
