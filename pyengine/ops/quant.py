"""Quantized linear kernels in Triton (roles of vllm's ``scaled_fp8_quant``,
``w8a8_block_fp8_matmul``, ``cutlass_scaled_mm`` and the GPTQ/AWQ W4A16 GEMMs).

Weight forms (pyengine/layers/quantization/utils.py makes them at load):

* FP8: ``weight`` float8_e4m3fn [N, K], ``weight_scale`` float32 [N] (per output row) or
  [ceil(N/bn), ceil(K/bk)] (blocks of ``block = (bn, bk)``).
* packed integer: ``qweight`` int32 [N, K*bits/32] (value j of word i of row n is input
  column i*32/bits + j, bits [j*bits, (j+1)*bits)): each output row's words contiguous, so
  the batch-1 GEMV reads whole 16-byte vectors along K and each activation value serves
  all the rows of a program. ``scales`` / ``zeros`` [ceil(K/group_size), N] in the compute
  dtype, any strides (both the same): ``w[n, k] = (q[n, k] - zeros[k // group_size, n]) *
  scales[k // group_size, n]``; ``zeros`` None: every zero point 2**(bits-1) (symmetric).

Entry points, each ``x [M, K] (bf16/fp16/fp32) -> [M, N]`` in x.dtype:

* ``fp8_linear(x, weight, weight_scale, input_scale, bias, block, act)``: x is quantized to
  FP8 as ``act`` says ("token" per row, "group" per ``bk`` columns of a row, "tensor" with
  the static ``input_scale``; None: not at all, weight-only). One row (batch-1 decode) runs
  ``fp8_gemv``, which quantizes x in registers (no extra launch) and reads the FP8 weight
  (half the bytes of bf16); more rows quantize x (``quant_fp8``) and run the W8A8 GEMM:
  ``torch.nn.functional.scaled_mm`` for row-wise scales on a GPU that has it (compute
  capability >= 8.9; ``VENGINE_FP8_SCALED_MM=0``: the Triton kernel), else ``fp8_gemm``.
* ``int_linear(x, qweight, scales, zeros, bits, group_size, bias)``: ``int_gemv`` for one
  row, ``int_gemm`` (dequantize each tile in registers, then ``tl.dot``) for more.

No host syncs and no allocations but the outputs (and the quantized activations, and a
split-K GEMV's float32 [split_k, N] partial sums): CUDA-graph safe. Split-K GEMVs (a launch
config's ``split_k`` > 1) add their partials in a second pass in a fixed order, so they are
deterministic, and round once, as the one-pass kernels do. Accumulation is float32. Under
``TRITON_INTERPRET=1`` the kernels run on CPU tensors (tests), with ``tl.dot`` operands
upcast to float32 (the interpreter's low-precision dot is unreliable).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from pyengine import envs
from pyengine.ops import pdl, smem

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # vLLM's floor: an all-zero row still divides by something
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


# ---- activation quantization --------------------------------------------------------------
@triton.jit
def _fp8_quant_kernel(x_ptr, q_ptr, s_ptr, static_ptr, K, stride_xm, stride_qm, GROUP, groups_per_row,
                      BLOCK: tl.constexpr, STATIC: tl.constexpr, MIN_SCALE: tl.constexpr):
    row = tl.program_id(0)
    g = tl.program_id(1)
    start = g * GROUP
    end = tl.minimum(start + GROUP, K)
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    q_row = q_ptr + row.to(tl.int64) * stride_qm
    if STATIC:
        scale = tl.load(static_ptr).to(tl.float32)
    else:
        amax = tl.zeros([BLOCK], tl.float32)
        for k0 in range(start, end, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_row + offs, mask=offs < end, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, 0) / 448.0, MIN_SCALE)
        tl.store(s_ptr + row.to(tl.int64) * groups_per_row + g, scale)
    for k0 in range(start, end, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < end, other=0.0).to(tl.float32)
        q = tl.clamp(x / scale, -448.0, 448.0)
        tl.store(q_row + offs, q.to(q_ptr.dtype.element_ty), mask=offs < end)


def quant_fp8(x: torch.Tensor, group_size: int | None = None,
              static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (FP8 [M, K], float32 scales): per row ([M, 1]; ``scale = max(amax / 448,
    1/(448*512))``), per ``group_size`` columns of a row ([M, ceil(K/group_size)]), or with the
    static ``static_scale`` (returned expanded to [M, 1])."""
    m, k = x.shape
    # The interpreter rounds float32 -> e4m3 wrongly for some values (e.g. -124 -> -64): there
    # the kernel writes the scaled float32 values and torch rounds them.
    q = torch.empty((m, k), dtype=torch.float32 if _INTERPRET else FP8_DTYPE, device=x.device)
    if x.stride(-1) != 1:
        x = x.contiguous()
    group = group_size or k
    groups = triton.cdiv(k, group)
    if static_scale is not None:
        s = static_scale.reshape(1, 1).float().expand(m, 1)
    else:
        s = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m == 0:
        return q.to(FP8_DTYPE), s
    block = min(triton.next_power_of_2(group), 1024)
    _fp8_quant_kernel[(m, groups)](x, q, s, static_scale if static_scale is not None else s, k, x.stride(0),
                                   q.stride(0), group, groups, BLOCK=block, STATIC=static_scale is not None,
                                   MIN_SCALE=_MIN_SCALE, num_warps=4)
    return (q.to(FP8_DTYPE) if _INTERPRET else q), s


# ---- split-K GEMVs: the sum pass --------------------------------------------------------
@triton.jit
def _split_sum_kernel(p_ptr, b_ptr, y_ptr, N, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
                      PDL: tl.constexpr):
    # y[n] = (p[0, n] + p[1, n] + ... + p[SPLIT - 1, n]) (+ bias[n]), in that order, float32
    rn = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = rn < N
    if PDL:  # (pyengine/ops/pdl.py)
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    y = tl.load(p_ptr + rn, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        y += tl.load(p_ptr + s * N + rn, mask=mask, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=mask)


_SPLIT_SUM_BLOCK = 256  # outputs a program of the split-K sum pass (16 programs at N = 4096)


def _split_partials(split_k: int, n: int, device: torch.device) -> torch.Tensor:
    """The float32 [split_k, n] partial sums of a split-K GEMV (each program's rows of its
    split; every element written, so no zeroing)."""
    return torch.empty((split_k, n), dtype=torch.float32, device=device)


def _split_sum(part: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor) -> None:
    """y [1, N] = the sum of part [S, N] over its S splits in order (+ bias), rounded once."""
    split, n = part.shape
    _split_sum_kernel[(triton.cdiv(n, _SPLIT_SUM_BLOCK),)](part, bias if bias is not None else part, y, n, SPLIT=split,
                                                           HAS_BIAS=bias is not None, BLOCK=_SPLIT_SUM_BLOCK,
                                                           num_warps=2, **pdl.launch_kwargs(y, "split_sum"))


def split_chunks(chunks: int, split_k: int, what: str) -> int:
    """Chunks each of ``split_k`` splits takes of ``chunks`` (``ceil(chunks / split_k)``).
    Raises ValueError when a split would have none (split_k too large for this K and chunk)."""
    if split_k < 1:
        raise ValueError(f"{what}: split_k must be >= 1, got {split_k}")
    per = -(-chunks // split_k)
    if (split_k - 1) * per >= chunks:
        raise ValueError(f"{what}: split_k {split_k} leaves a split without work: K is {chunks} chunk(s) of this "
                         f"config, {per} a split")
    return per


# ---- FP8 GEMV (one row) ---------------------------------------------------------------------
@triton.jit
def _round_fp8(v, EMULATE: tl.constexpr):
    """v (float32, within +-448) rounded to the nearest e4m3 value (ties to even), as float32.
    EMULATE: in arithmetic, for the interpreter, whose float32 -> e4m3 conversion drops the
    carry of a mantissa that rounds up to the next power of two."""
    if EMULATE:
        a = tl.abs(v)
        e = tl.floor(tl.log2(tl.maximum(a, 0.015625)))  # below 2**-6: subnormal steps of 2**-9
        ulp = tl.exp2(e - 3.0)
        t = a / ulp
        f = tl.floor(t)
        d = t - f
        odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
        r = tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f) * ulp
        return tl.where(v < 0, -r, r)
    else:
        return v.to(tl.float8e4nv).to(tl.float32)


@triton.jit
def _fp8_gemv_x(x_ptr, k0, rs, rc, K: tl.constexpr, S: tl.constexpr):
    """Chunk k0's activation as the dot's [S, 16] operand (column c: slice c), float32."""
    offs_x = k0 + rc[None, :] * S + rs[:, None]
    return tl.load(x_ptr + offs_x, mask=offs_x < K, other=0.0).to(tl.float32)


@triton.jit
def _token_scale(x_ptr, xs_ptr, K: tl.constexpr, ACT: tl.constexpr, MIN_SCALE: tl.constexpr,
                 AMAX_BLOCK: tl.constexpr):
    """The FP8 GEMVs' activation scale (float32): per token (ACT 1) from the amax of the
    whole (small, cached) row, all its loads at once; static (ACT 3) from xs_ptr; else 1."""
    x_scale = 1.0
    if ACT == 1:
        ra = tl.arange(0, AMAX_BLOCK)
        amax = tl.zeros([AMAX_BLOCK], tl.float32)
        for a0 in tl.static_range(0, K, AMAX_BLOCK):
            offs = a0 + ra
            amax = tl.maximum(amax, tl.abs(tl.load(x_ptr + offs, mask=offs < K, other=0.0).to(tl.float32)))
        x_scale = tl.maximum(tl.max(amax, 0) / 448.0, MIN_SCALE)
    if ACT == 3:
        x_scale = tl.load(xs_ptr).to(tl.float32)
    return x_scale


@triton.jit
def _fp8_gemv_chunk(acc, w, x, x_ptr, s_ptr, k0, x_scale, rn_m, c_m, mask_m, rc, stride_sn, K: tl.constexpr,
                    S: tl.constexpr, M: tl.constexpr, BN_SCALE: tl.constexpr, BK_SCALE: tl.constexpr,
                    BLOCK_SCALED: tl.constexpr, ACT: tl.constexpr, MIN_SCALE: tl.constexpr, IEEE: tl.constexpr,
                    EMULATE: tl.constexpr):
    """One chunk of ``_fp8_gemv_kernel``: acc [M, 16] += the dot of the chunk's weight w
    [M, S] and its activation x [S, 16] (quantized here; rows scaled for per-slice scales)."""
    if ACT == 2:
        gs = tl.maximum(tl.max(tl.abs(x), 0) / 448.0, MIN_SCALE)  # [16]: each slice's scale
        xq = tl.clamp(x / gs[None, :], -448.0, 448.0)
    elif ACT != 0:
        xq = tl.clamp(x / x_scale, -448.0, 448.0)
    else:
        xq = x
    if EMULATE and ACT != 0:
        xq = _round_fp8(xq, True)
    if EMULATE:  # the interpreter: float32 operands (its low-precision dot is unreliable)
        part = tl.dot(w.to(tl.float32), xq, input_precision="ieee")
    elif ACT == 0:
        if IEEE:  # float32 activations: no TF32
            part = tl.dot(w.to(tl.float32), xq, input_precision="ieee")
        else:  # e4m3 values are exact in bf16/fp16: exact products, float32 sums
            part = tl.dot(w.to(x_ptr.dtype.element_ty), xq.to(x_ptr.dtype.element_ty))
    elif S < 32:  # Hopper's FP8 MMA takes K >= 32: 16-column slices go through bf16, where e4m3 is exact
        part = tl.dot(w.to(tl.bfloat16), xq.to(tl.float8e4nv).to(tl.bfloat16))
    else:
        part = tl.dot(w, xq.to(tl.float8e4nv))
    if ACT == 2 or BLOCK_SCALED:
        sc = tl.full([M], 1.0, tl.float32)
        if BLOCK_SCALED:
            sc = sc * tl.load(s_ptr + (rn_m // BN_SCALE) * stride_sn + (k0 + c_m * S) // BK_SCALE,
                              mask=mask_m & (k0 + c_m * S < K), other=0.0)
        if ACT == 2:
            acc += part * (sc[:, None] * gs[None, :])
        else:
            acc += part * sc[:, None]
    else:
        acc += part
    return acc


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, xs_ptr, y_ptr, p_ptr, N, stride_sn, K: tl.constexpr,
                     BN_SCALE: tl.constexpr, BK_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     BLOCK_SCALED: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, MIN_SCALE: tl.constexpr,
                     AMAX_BLOCK: tl.constexpr, IEEE: tl.constexpr, EMULATE: tl.constexpr, SPLIT_K: tl.constexpr,
                     PDL: tl.constexpr):
    # ACT: 0 x unquantized (weight-only), 1 per token, 2 per S = BLOCK_K / 16 (= BK_SCALE)
    # columns, 3 static. One row on the tensor cores without a 16x broadcast of x: each chunk
    # of BLOCK_K columns is cut into 16 slices of S columns; the dot multiplies the
    # [BLOCK_N * 16, S] weight (row (n, c): slice c of output row n, S contiguous bytes) by
    # the [S, 16] activation (column c: slice c), and R[(n, c), c] is row n's part of slice
    # c. The diagonal is summed once after the loop (per-slice scales are applied to R's
    # rows inside it). With BLOCK_N * 16 >= 64 the dot is a wgmma reading the weight straight
    # from the shared memory the software pipeline fills (num_stages), so the per-byte work
    # is a few instructions and the kernel is bound by HBM alone.
    # SPLIT_K > 1: program (i, s) takes the s-th of SPLIT_K runs of whole chunks (KS columns)
    # and writes its float32 rows (scaled, without the bias) to p_ptr [SPLIT_K, N]; the sum
    # pass adds them in split order, adds the bias and rounds.
    S: tl.constexpr = BLOCK_K // 16
    KS: tl.constexpr = ((K + BLOCK_K - 1) // BLOCK_K + SPLIT_K - 1) // SPLIT_K * BLOCK_K  # columns a split
    M: tl.constexpr = BLOCK_N * 16
    pid = tl.program_id(0)
    rm = tl.arange(0, M)
    rn_m = pid * BLOCK_N + rm // 16  # the output row of each dot row
    c_m = rm % 16  # and its slice
    mask_m = rn_m < N
    rs = tl.arange(0, S)
    rc = tl.arange(0, 16)
    w_tile = w_ptr + (rn_m.to(tl.int64) * K + c_m * S)[:, None] + rs[None, :]  # chunk 0's [M, S] weight
    cols = c_m[:, None] * S + rs[None, :]  # and its columns
    if SPLIT_K == 1:
        k_lo = 0
        k_hi = K
    else:
        k_lo = tl.program_id(1) * KS
        k_hi = k_lo + KS
    # K (a split's) in at most two chunks: both are loaded first, so their bytes are in flight
    # during the token's amax (a pipelined loop would issue them after it, and one chunk
    # after the other)
    PRELOAD: tl.constexpr = KS <= 2 * BLOCK_K  # (KS >= K with SPLIT_K 1)
    if PDL:  # (pyengine/ops/pdl.py) with PRELOAD the weights are read during the previous kernel
        tl.extra.cuda.gdc_launch_dependents()
    if PRELOAD:
        w0 = tl.load(w_tile + k_lo, mask=mask_m[:, None] & (k_lo + cols < K), other=0.0)
        w1 = tl.load(w_tile + k_lo + BLOCK_K, mask=mask_m[:, None] & (k_lo + BLOCK_K + cols < K), other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    if PRELOAD:
        x0 = _fp8_gemv_x(x_ptr, k_lo, rs, rc, K, S)
        x1 = _fp8_gemv_x(x_ptr, k_lo + BLOCK_K, rs, rc, K, S)
    x_scale = _token_scale(x_ptr, xs_ptr, K, ACT, MIN_SCALE, AMAX_BLOCK)  # every program reads the row
    acc = tl.zeros([M, 16], dtype=tl.float32)
    if PRELOAD:
        acc = _fp8_gemv_chunk(acc, w0, x0, x_ptr, s_ptr, k_lo, x_scale, rn_m, c_m, mask_m, rc, stride_sn, K, S, M,
                              BN_SCALE, BK_SCALE, BLOCK_SCALED, ACT, MIN_SCALE, IEEE, EMULATE)
        if BLOCK_K < KS:
            acc = _fp8_gemv_chunk(acc, w1, x1, x_ptr, s_ptr, k_lo + BLOCK_K, x_scale, rn_m, c_m, mask_m, rc,
                                  stride_sn, K, S, M, BN_SCALE, BK_SCALE, BLOCK_SCALED, ACT, MIN_SCALE, IEEE, EMULATE)
    else:
        for k0 in range(k_lo, k_hi, BLOCK_K):  # software-pipelined by Triton (num_stages)
            w = tl.load(w_tile + k0, mask=mask_m[:, None] & (k0 + cols < K), other=0.0)
            x = _fp8_gemv_x(x_ptr, k0, rs, rc, K, S)
            acc = _fp8_gemv_chunk(acc, w, x, x_ptr, s_ptr, k0, x_scale, rn_m, c_m, mask_m, rc, stride_sn, K, S, M,
                                  BN_SCALE, BK_SCALE, BLOCK_SCALED, ACT, MIN_SCALE, IEEE, EMULATE)
    d = tl.where(c_m[:, None] == rc[None, :], acc, 0.0)
    y = tl.sum(tl.sum(tl.reshape(d, [BLOCK_N, 16, 16]), axis=2), axis=1)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rn < N
    if ACT == 1 or ACT == 3:
        y = y * x_scale
    if not BLOCK_SCALED:
        y = y * tl.load(s_ptr + rn, mask=mask_n, other=0.0)
    if SPLIT_K == 1:
        if HAS_BIAS:
            y += tl.load(b_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=mask_n)
    else:
        tl.store(p_ptr + tl.program_id(1) * N + rn, y, mask=mask_n)


@triton.jit
def _fp8_gemv_stream_kernel(x_ptr, w_ptr, s_ptr, b_ptr, xs_ptr, y_ptr, N, K: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
                            MIN_SCALE: tl.constexpr, AMAX_BLOCK: tl.constexpr, IEEE: tl.constexpr,
                            EMULATE: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
    # _fp8_gemv_kernel's dot (see there) with per-row weight scales, but a few programs an SM
    # each walk blocks of BLOCK_N rows pid, pid + grid, ... through one software-pipelined
    # loop over (block, chunk) (STAGES buffers: the coming chunks' weights in flight across
    # block boundaries too), and the token's scale is computed once a program, not once a
    # block (every program of the one-pass kernel reads the whole row for its amax).
    S: tl.constexpr = BLOCK_K // 16
    M: tl.constexpr = BLOCK_N * 16
    NCH: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K  # chunks a block
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    total = (tl.cdiv(N, BLOCK_N) - pid + grid - 1) // grid * NCH  # this program's (block, chunk)s
    rm = tl.arange(0, M)
    c_m = rm % 16  # each dot row's slice
    rs = tl.arange(0, S)
    rc = tl.arange(0, 16)
    cols = c_m[:, None] * S + rs[None, :]
    ar = tl.arange(0, BLOCK_N)
    if PDL:  # (pyengine/ops/pdl.py) the pipeline's first loads come after the scale's: nothing before the wait
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    x_scale = _token_scale(x_ptr, xs_ptr, K, ACT, MIN_SCALE, AMAX_BLOCK)  # once a program, for all its blocks
    acc = tl.zeros([M, 16], dtype=tl.float32)
    for i in tl.range(0, total, num_stages=STAGES):
        blk = pid + (i // NCH) * grid
        k0 = (i % NCH) * BLOCK_K
        rn_m = blk * BLOCK_N + rm // 16
        mask_m = rn_m < N
        w = tl.load(w_ptr + (rn_m.to(tl.int64) * K + c_m * S + k0)[:, None] + rs[None, :],
                    mask=mask_m[:, None] & (k0 + cols < K), other=0.0)
        x = _fp8_gemv_x(x_ptr, k0, rs, rc, K, S)
        acc = _fp8_gemv_chunk(acc, w, x, x_ptr, s_ptr, k0, x_scale, rn_m, c_m, mask_m, rc, 0, K, S, M, 1, 1, False,
                              ACT, MIN_SCALE, IEEE, EMULATE)
        if i % NCH == NCH - 1:  # the block's last chunk: the diagonal is its rows' sums
            d = tl.where(c_m[:, None] == rc[None, :], acc, 0.0)
            y = tl.sum(tl.sum(tl.reshape(d, [BLOCK_N, 16, 16]), axis=2), axis=1)
            rn = blk * BLOCK_N + ar
            mask_n = rn < N
            if ACT == 1 or ACT == 3:
                y = y * x_scale
            y = y * tl.load(s_ptr + rn, mask=mask_n, other=0.0)
            if HAS_BIAS:
                y += tl.load(b_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)
            tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=mask_n)
            acc = tl.zeros([M, 16], dtype=tl.float32)


# ---- FP8 GEMV on the CUDA cores (a config's ``fma``) ----------------------------------------
@triton.jit
def _fp8_fma_chunk(acc, w, x_ptr, k0, rk, x_scale, K: tl.constexpr, FULL: tl.constexpr, ACT: tl.constexpr,
                   EMULATE: tl.constexpr):
    """acc [BLOCK_N, BLOCK_K] += the chunk at column k0: its FP8 weight w upcast to float32,
    times the chunk's activation quantized exactly as ``quant_fp8`` quantizes it (ACT != 0)
    or as it is (ACT 0)."""
    if FULL:
        x = tl.load(x_ptr + k0 + rk).to(tl.float32)
    else:
        x = tl.load(x_ptr + k0 + rk, mask=k0 + rk < K, other=0.0).to(tl.float32)
    if ACT != 0:
        x = _round_fp8(tl.clamp(x / x_scale, -448.0, 448.0), EMULATE)
    return acc + w.to(tl.float32) * x[None, :]


@triton.jit
def _fp8_fma_load(w_rows, k0, rk, mask_n, K: tl.constexpr, FULL: tl.constexpr):
    """The chunk at column k0's FP8 weight [BLOCK_N, BLOCK_K] (masked past K unless FULL)."""
    if FULL:
        w = tl.load(w_rows + k0 + rk[None, :], mask=mask_n[:, None], other=0.0)
    else:
        w = tl.load(w_rows + k0 + rk[None, :], mask=mask_n[:, None] & (k0 + rk < K)[None, :], other=0.0)
    return w


@triton.jit
def _fp8_gemv_fma_kernel(x_ptr, w_ptr, s_ptr, b_ptr, xs_ptr, y_ptr, p_ptr, N, K: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, MIN_SCALE: tl.constexpr,
                         AMAX_BLOCK: tl.constexpr, EMULATE: tl.constexpr, SPLIT_K: tl.constexpr):
    # The batch-1 bf16 GEMV's shape (pyengine/ops/gemv.py) on FP8 bytes: each program owns
    # BLOCK_N rows and walks its K in BLOCK_K chunks, fully unrolled, with float32 FMAs of
    # the upcast e4m3 weight and the activation (no tensor cores, no shared-memory staging:
    # a thread's 16 contiguous weight bytes are one 16-byte load, and every chunk's loads can
    # be issued early). ACT as _fp8_gemv_kernel's, per-row weight scales only (0, 1, 3): an
    # e4m3 value times an e4m3 value is exact in float32, so with a quantized activation the
    # sums are those of the reference (quant_fp8's values times the weight), in float32.
    # The first four chunks' weights are loaded before the token's amax and before the first
    # chunk's products: both end in a barrier (the amax's cross-warp maximum; each chunk's
    # activation converted through shared memory from the layout it is loaded in to the
    # weight tile's, which Triton does not rematerialize) that later loads are not moved
    # above, so an unrolled chunk's loads would otherwise wait for the previous chunk's
    # products (offline sm_90 SASS, Triton 3.9). SPLIT_K > 1: as _fp8_gemv_kernel's.
    # Launched without PDL (pyengine/ops/pdl.py): with it the FP8 8B step on the H200 was 4-6%
    # slower than with this kernel alone left out of it, whether the kernel prefetched four
    # chunks, one chunk, or signalled its successor first or last (not explained yet).
    KS: tl.constexpr = ((K + BLOCK_K - 1) // BLOCK_K + SPLIT_K - 1) // SPLIT_K * BLOCK_K  # columns a split
    EVEN: tl.constexpr = KS * SPLIT_K == K  # every chunk whole
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rn < N
    rk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rn[:, None].to(tl.int64) * K
    if SPLIT_K == 1:
        k_lo = 0
    else:
        k_lo = tl.program_id(1) * KS
    # chunk i is whole when the split's chunks all are, or (one split) it ends inside K
    F0: tl.constexpr = EVEN or (SPLIT_K == 1 and BLOCK_K <= K)
    F1: tl.constexpr = EVEN or (SPLIT_K == 1 and 2 * BLOCK_K <= K)
    F2: tl.constexpr = EVEN or (SPLIT_K == 1 and 3 * BLOCK_K <= K)
    F3: tl.constexpr = EVEN or (SPLIT_K == 1 and 4 * BLOCK_K <= K)
    w0 = _fp8_fma_load(w_rows, k_lo, rk, mask_n, K, F0)
    if KS > BLOCK_K:
        w1 = _fp8_fma_load(w_rows, k_lo + BLOCK_K, rk, mask_n, K, F1)
    if KS > 2 * BLOCK_K:
        w2 = _fp8_fma_load(w_rows, k_lo + 2 * BLOCK_K, rk, mask_n, K, F2)
    if KS > 3 * BLOCK_K:
        w3 = _fp8_fma_load(w_rows, k_lo + 3 * BLOCK_K, rk, mask_n, K, F3)
    x_scale = _token_scale(x_ptr, xs_ptr, K, ACT, MIN_SCALE, AMAX_BLOCK)  # every program reads the row
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc = _fp8_fma_chunk(acc, w0, x_ptr, k_lo, rk, x_scale, K, F0, ACT, EMULATE)
    if KS > BLOCK_K:
        acc = _fp8_fma_chunk(acc, w1, x_ptr, k_lo + BLOCK_K, rk, x_scale, K, F1, ACT, EMULATE)
    if KS > 2 * BLOCK_K:
        acc = _fp8_fma_chunk(acc, w2, x_ptr, k_lo + 2 * BLOCK_K, rk, x_scale, K, F2, ACT, EMULATE)
    if KS > 3 * BLOCK_K:
        acc = _fp8_fma_chunk(acc, w3, x_ptr, k_lo + 3 * BLOCK_K, rk, x_scale, K, F3, ACT, EMULATE)
    for kk in tl.static_range(4 * BLOCK_K, KS, BLOCK_K):  # unrolled
        w = _fp8_fma_load(w_rows, k_lo + kk, rk, mask_n, K, EVEN or (SPLIT_K == 1 and kk + BLOCK_K <= K))
        acc = _fp8_fma_chunk(acc, w, x_ptr, k_lo + kk, rk, x_scale, K, EVEN or (SPLIT_K == 1 and kk + BLOCK_K <= K),
                             ACT, EMULATE)
    y = tl.sum(acc, axis=1)
    if ACT == 1 or ACT == 3:
        y = y * x_scale
    y = y * tl.load(s_ptr + rn, mask=mask_n, other=0.0)
    if SPLIT_K == 1:
        if HAS_BIAS:
            y += tl.load(b_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=mask_n)
    else:
        tl.store(p_ptr + tl.program_id(1) * N + rn, y, mask=mask_n)


_ACT_CODES = {None: 0, "token": 1, "group": 2, "tensor": 3}


def fp8_gemv_default(n: int, k: int) -> dict[str, int]:
    """The FP8 GEMV's launch config without a swept one (pyengine/ops/gemv_configs.py): 8
    rows a program (a 128-row wgmma), chunks of 2048 columns (16 slices of 128 bytes), three
    pipeline stages (two chunks, 32 KiB, in flight a program; 59 KiB of shared memory: three
    programs an SM)."""
    return {"block_n": 8, "block_k": 2048 if k >= 2048 else 512, "num_warps": 4, "num_stages": 3}


def fp8_gemv_smem_bytes(block_n: int, block_k: int, num_stages: int, act_bytes: int) -> int:
    """Shared memory ``_fp8_gemv_kernel`` may take: ``num_stages`` buffers of a chunk's weight
    (``block_n * block_k`` bytes) and activation, plus the quantized activation handed to the
    dot (an upper bound of what Triton 3.6 allocated on sm_90: 59 KiB at 8 x 2048 x 3, 66 KiB
    at 16 x 2048 x 3 where K takes two chunks)."""
    return num_stages * (block_n * block_k + block_k * act_bytes) + block_k


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int] | None = None,
             bias: torch.Tensor | None = None, act: str | None = None, input_scale: torch.Tensor | None = None,
             block_n: int | None = None, block_k: int | None = None, num_warps: int | None = None,
             num_stages: int | None = None, split_k: int | None = None, fma: bool | None = None,
             persistent: int | None = None) -> torch.Tensor:
    """One row: x [1, K] (contiguous) @ dequant(weight [N, K] FP8).T -> [1, N] in x.dtype.
    The activation is quantized in the kernel as the GEMM path quantizes it (``act``), so a
    request's output does not depend on the size of its batch; its scale per token is
    computed by every program from the (cached) row. The launch config: the arguments, else
    the swept one of this shape and GPU (``gemv_configs``), else ``fp8_gemv_default``;
    ``block_k`` (a power of two) is cut to the scale block's columns x 16 for block scales
    (``act="group"`` needs its slice, ``block_k / 16``, to be exactly those columns).
    ``split_k`` (default 1) > 1 cuts K into that many runs of whole ``block_k`` chunks, one
    program each (more programs for small N); their float32 partial rows go to a [split_k,
    N] buffer that a second pass adds in split order (deterministic), adding the bias and
    rounding once. ``fma`` (default False): per-row weight scales run
    ``_fp8_gemv_fma_kernel`` instead, the bf16 GEMV's shape on the CUDA cores (float32 FMAs
    of the upcast weight and the in-register quantized activation: the same values and
    products as the reference, float32 sums; ``block_k`` columns a chunk, ``num_stages``
    unused); block scales keep the tensor-core kernel. ``persistent`` > 0 (per-row weight
    scales, ``split_k`` 1, not ``fma``): that many programs an SM (on the CPU: in all) walk
    the blocks of rows through one pipelined loop of ``num_stages`` buffers, the token's
    scale computed once a program (``_fp8_gemv_stream_kernel``). Raises ValueError for a
    config the kernel cannot run (a split_k that leaves a split without a chunk among them:
    ``split_chunks``; ``persistent`` with block scales, ``split_k`` > 1 or ``fma``)."""
    n, k = weight.shape
    cfg = _gemv_config("fp8", n, k, x.device, fp8_gemv_default)
    block_n = block_n or cfg["block_n"]
    block_k = block_k or cfg["block_k"]
    num_warps = num_warps or cfg["num_warps"]
    num_stages = num_stages or cfg["num_stages"]
    split_k = split_k if split_k is not None else cfg.get("split_k", 1)
    fma = fma if fma is not None else bool(cfg.get("fma", False))
    persistent = persistent if persistent is not None else cfg.get("persistent", 0)
    bn, bk = block if block is not None else (1, 1)
    if block_k & (block_k - 1) or block_k < 256 or block_n & (block_n - 1):
        raise ValueError(f"block_k {block_k} must be a power of two >= 256 and block_n {block_n} a power of two")
    if persistent and (block is not None or split_k > 1 or fma):
        raise ValueError("a persistent FP8 GEMV takes per-row weight scales, split_k 1 and the tensor cores "
                         f"(block {block}, split_k {split_k}, fma {fma})")
    if fma and block is None:
        return _fp8_gemv_fma(x, weight, weight_scale, bias, act, input_scale, block_n, block_k, num_warps, split_k)
    if block is not None:  # a slice (block_k / 16 columns) must lie in one scale block
        s = bk & -bk  # the largest power of two dividing bk
        if act == "group" and s != bk or s < 16:
            raise ValueError(f"FP8 block scales of {bk} columns need a power of two >= 16 "
                             f"({'equal to it' if act == 'group' else 'dividing it'}) as the GEMV's slice")
        block_k = 16 * (s if act == "group" else min(s, block_k // 16))
    limit = smem.max_shared_mem(x.device)
    while limit is not None and num_stages > 1 and fp8_gemv_smem_bytes(block_n, block_k, num_stages,
                                                                        x.element_size()) > limit:
        num_stages -= 1  # (the H200's 227 KiB hold every config of the sweep at its stages)
    split_chunks(triton.cdiv(k, block_k), split_k,
                 f"FP8 GEMV {n}x{k} (block_n {block_n}, block_k {block_k}, split_k {split_k})")
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    if persistent:
        grid = min(triton.cdiv(n, block_n), persistent * (_num_sms(x.device.index or 0) if x.is_cuda else 1))
        _fp8_gemv_stream_kernel[(grid,)](
            x, weight, weight_scale, bias if bias is not None else weight_scale,
            input_scale if input_scale is not None else weight_scale, y, n, K=k, BLOCK_N=block_n, BLOCK_K=block_k,
            HAS_BIAS=bias is not None, ACT=_ACT_CODES[act], MIN_SCALE=_MIN_SCALE,
            AMAX_BLOCK=min(2048, triton.next_power_of_2(k)), IEEE=x.dtype == torch.float32, EMULATE=_INTERPRET,
            STAGES=num_stages, num_warps=num_warps, **pdl.launch_kwargs(x, "fp8_gemv_stream"))
        return y
    part = _split_partials(split_k, n, x.device) if split_k > 1 else y
    _fp8_gemv_kernel[(triton.cdiv(n, block_n), split_k)](
        x, weight, weight_scale, bias if bias is not None else weight_scale,
        input_scale if input_scale is not None else weight_scale, y, part, n,
        weight_scale.stride(0) if block is not None else 0, K=k, BN_SCALE=bn, BK_SCALE=bk, BLOCK_N=block_n,
        BLOCK_K=block_k, BLOCK_SCALED=block is not None, HAS_BIAS=bias is not None, ACT=_ACT_CODES[act],
        MIN_SCALE=_MIN_SCALE, AMAX_BLOCK=min(2048, triton.next_power_of_2(k)), IEEE=x.dtype == torch.float32,
        EMULATE=_INTERPRET, SPLIT_K=split_k, num_warps=num_warps, num_stages=num_stages, **pdl.launch_kwargs(x, "fp8_gemv"))
    if split_k > 1:
        _split_sum(part, bias, y)
    return y


def _fp8_gemv_fma(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                  act: str | None, input_scale: torch.Tensor | None, block_n: int, block_k: int, num_warps: int,
                  split_k: int) -> torch.Tensor:
    """``fp8_gemv`` with ``fma`` and per-row weight scales (its arguments, checked there)."""
    n, k = weight.shape
    if act == "group":
        raise ValueError("per-group activations need block scales")
    split_chunks(triton.cdiv(k, block_k), split_k,
                 f"FP8 GEMV {n}x{k} (fma, block_n {block_n}, block_k {block_k}, split_k {split_k})")
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    part = _split_partials(split_k, n, x.device) if split_k > 1 else y
    _fp8_gemv_fma_kernel[(triton.cdiv(n, block_n), split_k)](
        x, weight, weight_scale, bias if bias is not None else weight_scale,
        input_scale if input_scale is not None else weight_scale, y, part, n, K=k, BLOCK_N=block_n, BLOCK_K=block_k,
        HAS_BIAS=bias is not None, ACT=_ACT_CODES[act], MIN_SCALE=_MIN_SCALE,
        AMAX_BLOCK=min(2048, triton.next_power_of_2(k)), EMULATE=_INTERPRET, SPLIT_K=split_k, num_warps=num_warps)
    if split_k > 1:
        _split_sum(part, bias, y)
    return y


def _gemv_config(kind: str, n: int, k: int, device: torch.device, default) -> dict[str, int | bool]:
    """The swept launch config of this GEMV kind and shape (pyengine/ops/gemv_configs.py),
    else ``default(n, k)``."""
    from pyengine.ops import gemv_configs

    return gemv_configs.lookup(kind, n, k, device) or default(n, k)


# ---- FP8 GEMM ------------------------------------------------------------------------------
@triton.jit
def _fp8_gemm_kernel(a_ptr, w_ptr, c_ptr, as_ptr, ws_ptr, b_ptr, M, N, K,
                     stride_am, stride_wn, stride_cm, stride_asm, stride_wsn, BN_SCALE, BK_SCALE,
                     A_FP8: tl.constexpr, BLOCK_SCALED: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # grouped ordering: GROUP_M row tiles share the weight tiles they read (L2 reuse)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mask_m = rm < M
    mask_n = rn < N
    a_rows = a_ptr + rm[:, None].to(tl.int64) * stride_am
    w_cols = w_ptr + rn[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + rk
        mk = offs_k < K
        a = tl.load(a_rows + offs_k[None, :], mask=mask_m[:, None] & mk[None, :], other=0.0)
        w = tl.load(w_cols + offs_k[:, None], mask=mk[:, None] & mask_n[None, :], other=0.0)  # [BK, BN]
        if UPCAST:
            part = tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        elif A_FP8:
            part = tl.dot(a, w)
        elif a.dtype == tl.float32:
            part = tl.dot(a, w.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(a, w.to(a.dtype))
        if BLOCK_SCALED:  # BLOCK_K divides BK_SCALE: one scale column per step
            kb = k0 // BK_SCALE
            w_s = tl.load(ws_ptr + (rn // BN_SCALE) * stride_wsn + kb, mask=mask_n, other=0.0)
            if A_FP8:
                a_s = tl.load(as_ptr + rm * stride_asm + kb, mask=mask_m, other=0.0)
                acc += part * a_s[:, None] * w_s[None, :]
            else:
                acc += part * w_s[None, :]
        else:
            acc += part
    if not BLOCK_SCALED:
        acc = acc * tl.load(ws_ptr + rn, mask=mask_n, other=0.0)[None, :]
        if A_FP8:
            acc = acc * tl.load(as_ptr + rm * stride_asm, mask=mask_m, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def fp8_gemm_tile_bytes(block_m: int, block_n: int, block_k: int, act_bytes: int, a_fp8: bool) -> tuple[int, int]:
    """``(per_stage, fixed)`` shared-memory bytes of ``_fp8_gemm_kernel``'s tiles (see
    ``pyengine.ops.smem``): per stage the activation and FP8 weight tiles and their scale
    rows; fixed: the weight tile upcast to the activations' dtype when they are not FP8."""
    per_stage = block_m * block_k * act_bytes + block_k * block_n + 4 * (block_m + block_n)
    return per_stage, 0 if a_fp8 else block_k * block_n * act_bytes


def fp8_gemm(a: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, a_scale: torch.Tensor | None,
             out_dtype: torch.dtype, block: tuple[int, int] | None = None, bias: torch.Tensor | None = None,
             block_m: int | None = None, block_n: int = 128, block_k: int | None = None,
             num_warps: int = 8, num_stages: int = 3) -> torch.Tensor:
    """a [M, K]: FP8 with ``a_scale`` float32 [M, 1] (per row) or [M, K/bk] (``block``), or
    unquantized (``a_scale`` None: the weight is upcast to a's dtype in registers);
    weight [N, K] FP8 with weight_scale [N] or blocks. Returns [M, N] in ``out_dtype``.
    The stages (then ``block_n``, ``block_m``) are cut until the tiles fit the device's
    shared memory (``fp8_gemm_tile_bytes``)."""
    m, k = a.shape
    n = weight.shape[0]
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return c
    if block_m is None:
        block_m = 64 if m <= 64 else 128
    if block_k is None:
        block_k = min(128, block[1]) if block is not None else 128
    if block is not None and block[1] % block_k:
        raise ValueError(f"block_k {block_k} must divide the scale block {block[1]}")
    bn, bk = block if block is not None else (1, 1)
    limit = smem.max_shared_mem(a.device)
    while True:  # cut the stages, then block_n, then block_m, until the tiles fit (pyengine.ops.smem)
        stages = smem.fit_stages(*fp8_gemm_tile_bytes(block_m, block_n, block_k, a.element_size(),
                                                      a_scale is not None), num_stages, limit)
        if stages or (block_n <= 16 and block_m <= 16):
            break
        if block_n > 16:
            block_n //= 2
        else:
            block_m //= 2
    num_stages = max(1, stages)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _fp8_gemm_kernel[grid](
        a, weight, c, a_scale if a_scale is not None else weight_scale, weight_scale,
        bias if bias is not None else weight_scale, m, n, k, a.stride(0), weight.stride(0), c.stride(0),
        a_scale.stride(0) if a_scale is not None else 0, weight_scale.stride(0) if block is not None else 0, bn, bk,
        A_FP8=a_scale is not None, BLOCK_SCALED=block is not None, HAS_BIAS=bias is not None, UPCAST=_INTERPRET,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, num_warps=num_warps, num_stages=num_stages)
    return c


@functools.cache
def _scaled_mm_ok(device_index: int) -> bool:
    """Whether torch.nn.functional.scaled_mm serves row-wise FP8 GEMMs on this GPU (compute
    capability >= 8.9, and not turned off by VENGINE_FP8_SCALED_MM=0)."""
    return (envs.fp8_scaled_mm() and hasattr(torch.nn.functional, "scaled_mm")
            and torch.cuda.get_device_capability(device_index) >= (8, 9))


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None,
               bias: torch.Tensor | None, block: tuple[int, int] | None, act: str | None) -> torch.Tensor:
    """See the module docstring. x [M, K] -> [M, N] in x.dtype."""
    m = x.shape[0]
    if m == 1 and x.is_contiguous():
        return fp8_gemv(x, weight, weight_scale, block, bias, act, input_scale)
    if act is None:
        return fp8_gemm(x, weight, weight_scale, None, x.dtype, block, bias)
    if block is not None:
        xq, xs = quant_fp8(x, group_size=block[1])
        return fp8_gemm(xq, weight, weight_scale, xs, x.dtype, block, bias)
    xq, xs = quant_fp8(x, static_scale=input_scale if act == "tensor" else None)
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and _scaled_mm_ok(x.device.index or 0):
        f = torch.nn.functional
        return f.scaled_mm(xq, weight.t(), xs.contiguous(), f.ScalingType.RowWise, weight_scale.reshape(1, -1),
                           f.ScalingType.RowWise, bias=bias, output_dtype=x.dtype)
    return fp8_gemm(xq, weight, weight_scale, xs, x.dtype, None, bias)


# ---- packed integer (W4A16 / W8A16) --------------------------------------------------------
@triton.jit
def int_gemv_words(rows, kc, rw, mask_n, KW: tl.constexpr, EVEN: tl.constexpr):
    """The [BLOCK_N, BKW] packed words of the chunk at word ``kc`` (masked past KW unless EVEN)."""
    w_idx = kc + rw
    if EVEN:
        words = tl.load(rows + w_idx[None, :], mask=mask_n[:, None], other=0)
    else:
        words = tl.load(rows + w_idx[None, :], mask=mask_n[:, None] & (w_idx < KW)[None, :], other=0)
    return words


# One packed word of 4-bit values against its 8 activations in f16x2 arithmetic (HALF2): the
# values q0..q7 at bits 4j. An AND-OR with 0x64006400 (two f16 1024.0s) puts the values at
# bits 0-3 and 16-19 of a word into the mantissas of two f16s, 1024 + q (the LOP3 trick of
# FasterTransformer's and Marlin's dequantization); bits 4-7 and 20-23 give 1024 + 16q, and
# the word shifted right by 8 the other four. An exact f16x2 subtraction leaves q (or 16q,
# whose activations $3 and $5 come pre-divided by 16), a product and three FMAs sum the
# eight products in two f16 lanes, and the lanes are added in float32: 17 instructions for
# 8 values against ~35 in float32 (offline sm_90 builds; on the H200 a tile's time alone did
# not change, the kernel waiting on memory: docs/benchmarks.md, 2026-12-04 third session).
# $2..$5: the activation pairs (x0, x4), (x1, x5) / 16, (x2, x6), (x3, x7) / 16 as f16x2.
_INT4_HALF2_ASM = tl.constexpr("""{
.reg .b32 m, a, b, c, d, w8, s;
.reg .f16 h0, h1;
.reg .f32 f0, f1;
mov.b32 m, 0x64006400;
lop3.b32 a, $1, 0x000f000f, m, 0xea;
lop3.b32 b, $1, 0x00f000f0, m, 0xea;
shr.u32 w8, $1, 8;
lop3.b32 c, w8, 0x000f000f, m, 0xea;
lop3.b32 d, w8, 0x00f000f0, m, 0xea;
sub.f16x2 a, a, m;
sub.f16x2 b, b, m;
sub.f16x2 c, c, m;
sub.f16x2 d, d, m;
mul.f16x2 s, a, $2;
fma.rn.f16x2 s, b, $3, s;
fma.rn.f16x2 s, c, $4, s;
fma.rn.f16x2 s, d, $5, s;
mov.b32 {h0, h1}, s;
cvt.f32.f16 f0, h0;
cvt.f32.f16 f1, h1;
add.f32 $0, f0, f1;
}""")


@triton.jit
def _f16x2(lo, hi):
    """Two float32 tensors rounded to f16 and packed as one int32 each (lo in bits 0-15)."""
    return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", [lo, hi], dtype=tl.int32,
                                     is_pure=True, pack=1)


@triton.jit
def _half2_x(kc, x_ptr, rcw, KW: tl.constexpr):
    """The f16x2 path's activations of the chunk at word ``kc``: per thread, the pairs
    (x0, x4), (x1, x5) / 16, (x2, x6), (x3, x7) / 16 of each of its CW words as f16x2
    (int32 [C, CW] each), scaled by the thread's power of two; ``up`` [C] (float32) that
    scale's inverse, and ``xs`` [C] (float32) the sum of the thread's activations.

    f16 holds the products without loss of range: each thread scales its 8 * CW activations
    by a power of two that brings their largest magnitude into [16, 32) (a product of a
    4-bit value is then < 512, a lane's sum of four < 2048) and scales its sums back in
    float32; an activation more than 2**18 below its thread's largest keeps fewer bits (an f16
    subnormal), a contribution far below the output's rounding. Products and the lanes' sums
    round to f16 (11 bits), each word's sum to float32 from there."""
    m = kc + rcw < KW
    base = x_ptr + (kc + rcw) * 8
    x0 = tl.load(base + 0, mask=m, other=0.0).to(tl.float32)
    x1 = tl.load(base + 1, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(base + 2, mask=m, other=0.0).to(tl.float32)
    x3 = tl.load(base + 3, mask=m, other=0.0).to(tl.float32)
    x4 = tl.load(base + 4, mask=m, other=0.0).to(tl.float32)
    x5 = tl.load(base + 5, mask=m, other=0.0).to(tl.float32)
    x6 = tl.load(base + 6, mask=m, other=0.0).to(tl.float32)
    x7 = tl.load(base + 7, mask=m, other=0.0).to(tl.float32)
    xs = tl.sum(((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)), axis=1)
    amax = tl.maximum(tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)), tl.maximum(tl.abs(x2), tl.abs(x3))),
                      tl.maximum(tl.maximum(tl.abs(x4), tl.abs(x5)), tl.maximum(tl.abs(x6), tl.abs(x7))))
    amax = tl.max(amax, axis=1)  # [C]: the thread's largest
    e = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF  # its biased exponent
    e = tl.minimum(tl.maximum(e, 16), 250)  # all zeros or subnormal: any scale will do
    down = ((258 - e) << 23).to(tl.float32, bitcast=True)[:, None]  # 2**(131 - e): largest -> [16, 32)
    up = ((e - 4) << 23).to(tl.float32, bitcast=True)  # 2**(e - 131)
    p0 = _f16x2(x0 * down, x4 * down)
    p1 = _f16x2(x1 * (down * 0.0625), x5 * (down * 0.0625))
    p2 = _f16x2(x2 * down, x6 * down)
    p3 = _f16x2(x3 * (down * 0.0625), x7 * (down * 0.0625))
    return p0, p1, p2, p3, up, xs


@triton.jit
def _half2_dot(words, p0, p1, p2, p3, up):
    """t [BLOCK_N, C] (float32): the products of 4-bit words [BLOCK_N, C, CW] and the
    activations ``_half2_x`` prepared, summed over each thread's words, scaled back."""
    t = tl.inline_asm_elementwise(_INT4_HALF2_ASM, "=f,r,r,r,r,r", [words, p0[None, :, :], p1[None, :, :],
                                                                   p2[None, :, :], p3[None, :, :]],
                                  dtype=tl.float32, is_pure=True, pack=1)
    return tl.sum(t, axis=2) * up[None, :]


@triton.jit
def _int_gemv_scale(acc, t, xsum, kc, s_ptr, z_ptr, rn, mask_n, rc, stride_sg, stride_sn, GROUP: tl.constexpr,
                    G: tl.constexpr, PER: tl.constexpr, CW: tl.constexpr, ZP: tl.constexpr):
    """acc [BLOCK_N, C] += scale * (t - zero * xsum), each thread's group's scale and zero
    (scales[g, n] at g * stride_sg + n * stride_sn, zeros likewise; ZP > 0: every zero is
    ZP, nothing loaded)."""
    g = ((kc + rc * CW) * PER) // GROUP  # [C]: each thread's group
    m2 = mask_n[:, None] & (g < G)[None, :]
    off = g[None, :].to(tl.int64) * stride_sg + rn[:, None].to(tl.int64) * stride_sn
    sc = tl.load(s_ptr + off, mask=m2, other=0.0).to(tl.float32)
    if ZP > 0:
        zc = ZP
    else:
        zc = tl.load(z_ptr + off, mask=m2, other=0.0).to(tl.float32)
    return acc + sc * (t - zc * xsum[None, :])


@triton.jit
def int_gemv_chunk(acc, words, kc, x_ptr, s_ptr, z_ptr, rn, mask_n, rc, rcw, stride_sg, stride_sn, MAGIC,
                    KW: tl.constexpr, GROUP: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr, PER: tl.constexpr,
                    C: tl.constexpr, CW: tl.constexpr, BLOCK_N: tl.constexpr, HALF2: tl.constexpr, ZP: tl.constexpr):
    """acc [BLOCK_N, C] += one chunk's products: words [BLOCK_N, BKW] (from word ``kc``)
    unpacked, times the activation, less the zero points, times the scales (see the kernel)."""
    words = tl.reshape(words, [BLOCK_N, C, CW])  # no data movement: CW is each thread's vector
    if HALF2:
        p0, p1, p2, p3, up, xsum = _half2_x(kc, x_ptr, rcw, KW)
        t = _half2_dot(words, p0, p1, p2, p3, up)
    else:
        hi = (words.to(tl.uint32, bitcast=True) >> 16).to(tl.int32, bitcast=True)
        t3 = tl.zeros([BLOCK_N, C, CW], dtype=tl.float32)
        xs = tl.zeros([C, CW], dtype=tl.float32)
        for j in tl.static_range(PER):
            LOW = j * BITS + BITS <= 20
            POS = j * BITS if LOW else j * BITS - 16
            # loaded as [C, CW], not reshaped from [BKW]: the load then has the layout the
            # products use (no shared-memory conversion and barrier a value)
            xj = tl.load(x_ptr + (kc + rcw) * PER + j, mask=kc + rcw < KW, other=0.0).to(tl.float32)
            xs += xj
            src = words if LOW else hi
            f = ((src & (((1 << BITS) - 1) << POS)) | MAGIC).to(tl.float32, bitcast=True) - 8388608.0
            t3 += f * (xj * (1.0 / (1 << POS)))[None, :, :]
        t = tl.sum(t3, axis=2)
        xsum = tl.sum(xs, axis=1)
    return _int_gemv_scale(acc, t, xsum, kc, s_ptr, z_ptr, rn, mask_n, rc, stride_sg, stride_sn, GROUP, G, PER, CW, ZP)


@triton.jit
def _int_gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, b_ptr, y_ptr, p_ptr, N, stride_sg, stride_sn, MAGIC,
                     K: tl.constexpr,
                     GROUP: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr, CW: tl.constexpr,
                     NUM_WARPS: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                     PREFETCH: tl.constexpr, HALF2: tl.constexpr, ZP: tl.constexpr, PDL: tl.constexpr):
    # qweight [N, K / PER]: every thread owns CW consecutive words (a 16-byte load at CW = 4)
    # of all BLOCK_N rows, the threads side by side along K (a chunk of 32 * NUM_WARPS * CW
    # words a step), so each activation value is loaded, converted and scaled once per
    # program and serves BLOCK_N rows. A value q at bits [p, p + BITS) of a word (p <= 16)
    # becomes the float 2**23 + q * 2**p by one AND-OR (MAGIC, the bits of 2**23, lives in a
    # register: an AND with one immediate and an OR with a register is a single LOP3) and
    # q * 2**p by one exact FADD; x is pre-scaled by 2**-p, so the FFMA adds q * x exactly.
    # The values above bit 20 come from the word shifted right by 16. A thread's CW words lie
    # in one group: t = sum(q * x) - zero * sum(x) and acc += scale * t, per row and chunk.
    # SPLIT_K > 1: program (i, s) takes the s-th of SPLIT_K runs of whole chunks (KSW words)
    # and writes its float32 row sums to p_ptr [SPLIT_K, N] (bias and rounding: the sum pass).
    # PREFETCH: the next chunk's words are loaded before this one's products (two chunks in
    # flight a program; twice the word registers).
    PER: tl.constexpr = 32 // BITS
    KW: tl.constexpr = K // PER
    G: tl.constexpr = (K + GROUP - 1) // GROUP
    C: tl.constexpr = 32 * NUM_WARPS
    BKW: tl.constexpr = C * CW
    KSW: tl.constexpr = ((KW + BKW - 1) // BKW + SPLIT_K - 1) // SPLIT_K * BKW  # words a split
    EVEN: tl.constexpr = KSW * SPLIT_K == KW  # every chunk whole: no mask along K
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rn < N
    rw = tl.arange(0, BKW)
    rc = tl.arange(0, C)
    rcw = rc[:, None] * CW + tl.arange(0, CW)[None, :]  # [C, CW]: the chunk's words by thread
    rows = qw_ptr + rn[:, None].to(tl.int64) * KW
    acc = tl.zeros([BLOCK_N, C], dtype=tl.float32)
    if SPLIT_K == 1:
        k_lo = 0
        k_hi = KW
    else:
        k_lo = tl.program_id(1) * KSW
        k_hi = k_lo + KSW
    if PDL:  # (pyengine/ops/pdl.py) the first chunk's words are read during the previous kernel
        tl.extra.cuda.gdc_launch_dependents()
    if PREFETCH and KSW > BKW:
        words = int_gemv_words(rows, k_lo, rw, mask_n, KW, EVEN)
        if PDL:
            tl.extra.cuda.gdc_wait()
        for kc in range(k_lo, k_lo + KSW - BKW, BKW):  # every chunk but the last, the next one loaded first
            nxt = int_gemv_words(rows, kc + BKW, rw, mask_n, KW, EVEN)
            acc = int_gemv_chunk(acc, words, kc, x_ptr, s_ptr, z_ptr, rn, mask_n, rc, rcw, stride_sg, stride_sn, MAGIC, KW,
                                  GROUP, G, BITS, PER, C, CW, BLOCK_N, HALF2, ZP)
            words = nxt
        acc = int_gemv_chunk(acc, words, k_lo + KSW - BKW, x_ptr, s_ptr, z_ptr, rn, mask_n, rc, rcw, stride_sg, stride_sn,
                              MAGIC, KW, GROUP, G, BITS, PER, C, CW, BLOCK_N, HALF2, ZP)
    elif PDL:  # the first chunk before the wait, the rest as below
        words = int_gemv_words(rows, k_lo, rw, mask_n, KW, EVEN)
        tl.extra.cuda.gdc_wait()
        acc = int_gemv_chunk(acc, words, k_lo, x_ptr, s_ptr, z_ptr, rn, mask_n, rc, rcw, stride_sg, stride_sn, MAGIC, KW, GROUP,
                              G, BITS, PER, C, CW, BLOCK_N, HALF2, ZP)
        for kc in range(k_lo + BKW, k_hi, BKW):
            words = int_gemv_words(rows, kc, rw, mask_n, KW, EVEN)
            acc = int_gemv_chunk(acc, words, kc, x_ptr, s_ptr, z_ptr, rn, mask_n, rc, rcw, stride_sg, stride_sn, MAGIC, KW,
                                  GROUP, G, BITS, PER, C, CW, BLOCK_N, HALF2, ZP)
    else:
        for kc in range(k_lo, k_hi, BKW):  # a runtime loop: unrolled, the loads of every chunk would be hoisted and spill
            words = int_gemv_words(rows, kc, rw, mask_n, KW, EVEN)
            acc = int_gemv_chunk(acc, words, kc, x_ptr, s_ptr, z_ptr, rn, mask_n, rc, rcw, stride_sg, stride_sn, MAGIC, KW,
                                  GROUP, G, BITS, PER, C, CW, BLOCK_N, HALF2, ZP)
    y = tl.sum(acc, axis=1)
    if SPLIT_K == 1:
        if HAS_BIAS:
            y += tl.load(b_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=mask_n)
    else:
        tl.store(p_ptr + tl.program_id(1) * N + rn, y, mask=mask_n)


@triton.jit
def _int_gemv_stream_step(acc, words, i, pid, grid, x_ptr, s_ptr, z_ptr, b_ptr, y_ptr, ar, rc, rcw, N, stride_sg,
                          stride_sn, MAGIC,
                          p0, p1, p2, p3, up, xsum, KW: tl.constexpr, GROUP: tl.constexpr, G: tl.constexpr,
                          BITS: tl.constexpr, PER: tl.constexpr, C: tl.constexpr, CW: tl.constexpr,
                          BLOCK_N: tl.constexpr, BKW: tl.constexpr, NCH: tl.constexpr, HAS_BIAS: tl.constexpr,
                          HALF2: tl.constexpr, HOIST: tl.constexpr, ZP: tl.constexpr):
    """The stream kernel's (block, chunk) ``i``: its products into acc, and at the block's
    last chunk its rows' sums stored (acc then starts over)."""
    rn = (pid + (i // NCH) * grid) * BLOCK_N + ar
    mask_n = rn < N
    if HOIST:
        t = _half2_dot(tl.reshape(words, [BLOCK_N, C, CW]), p0, p1, p2, p3, up)
        acc = _int_gemv_scale(acc, t, xsum, 0, s_ptr, z_ptr, rn, mask_n, rc, stride_sg, stride_sn, GROUP, G, PER, CW,
                              ZP)
    else:
        acc = int_gemv_chunk(acc, words, (i % NCH) * BKW, x_ptr, s_ptr, z_ptr, rn, mask_n, rc, rcw, stride_sg, stride_sn, MAGIC,
                              KW, GROUP, G, BITS, PER, C, CW, BLOCK_N, HALF2, ZP)
    if i % NCH == NCH - 1:  # the block's last chunk: its rows are done
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(b_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=mask_n)
        acc = tl.zeros([BLOCK_N, C], dtype=tl.float32)
    return acc


@triton.jit
def _int_gemv_stream_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, b_ptr, y_ptr, N, stride_sg, stride_sn, MAGIC,
                            K: tl.constexpr,
                            GROUP: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr, CW: tl.constexpr,
                            NUM_WARPS: tl.constexpr, HAS_BIAS: tl.constexpr, HALF2: tl.constexpr,
                            STAGES: tl.constexpr, ZP: tl.constexpr, PDL: tl.constexpr):
    # The one-pass kernel's chunks (see _int_gemv_kernel), but each program walks the
    # blocks of BLOCK_N rows pid, pid + grid, ... (a grid of a few programs an SM) with the
    # coming (block, chunk)s' words in flight while it multiplies the current one. With a
    # program a block, every program of a wave loads, then computes, in step: the HBM idles
    # while the SMs multiply (the 4-bit products cost ~3-4 instructions a value).
    # STAGES 1: the next chunk's words are loaded into registers before the current
    # products; STAGES >= 2: Triton's software pipeline (cp.async into shared memory),
    # STAGES - 1 chunks ahead, at fewer registers (H200, offline sm_90 build at 8 rows x 4
    # warps: 96 registers and 36 KB at 3 stages, against 128 and none).
    PER: tl.constexpr = 32 // BITS
    KW: tl.constexpr = K // PER
    G: tl.constexpr = (K + GROUP - 1) // GROUP
    C: tl.constexpr = 32 * NUM_WARPS
    BKW: tl.constexpr = C * CW
    NCH: tl.constexpr = (KW + BKW - 1) // BKW  # chunks a block
    EVEN: tl.constexpr = NCH * BKW == KW
    HOIST: tl.constexpr = HALF2 and NCH == 1  # one chunk a block: every block's activations are the same
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    total = (tl.cdiv(N, BLOCK_N) - pid + grid - 1) // grid * NCH  # this program's (block, chunk)s
    ar = tl.arange(0, BLOCK_N)
    rw = tl.arange(0, BKW)
    rc = tl.arange(0, C)
    rcw = rc[:, None] * CW + tl.arange(0, CW)[None, :]
    acc = tl.zeros([BLOCK_N, C], dtype=tl.float32)
    if PDL:  # (pyengine/ops/pdl.py)
        tl.extra.cuda.gdc_launch_dependents()
    if STAGES == 1:
        rn = pid * BLOCK_N + ar  # the first chunk's words are read during the previous kernel
        words = int_gemv_words(qw_ptr + rn[:, None].to(tl.int64) * KW, 0, rw, rn < N, KW, EVEN)
    else:  # unused (the pipeline loads its own)
        words = tl.zeros([BLOCK_N, BKW], dtype=tl.int32)
    if PDL:  # the pipeline's first loads follow the activations' (below), so they wait
        tl.extra.cuda.gdc_wait()
    if HOIST:
        p0, p1, p2, p3, up, xsum = _half2_x(0, x_ptr, rcw, KW)
    else:  # unused (the HOIST branches are not built)
        p0 = 0
        p1 = 0
        p2 = 0
        p3 = 0
        up = 0
        xsum = 0
    if STAGES == 1:
        for i in range(0, total):
            j = i + 1
            nrn = (pid + (j // NCH) * grid) * BLOCK_N + ar
            lim = tl.where(j < total, N, 0)  # past this program's last chunk: nothing loaded
            nxt = int_gemv_words(qw_ptr + nrn[:, None].to(tl.int64) * KW, (j % NCH) * BKW, rw, nrn < lim, KW, EVEN)
            acc = _int_gemv_stream_step(acc, words, i, pid, grid, x_ptr, s_ptr, z_ptr, b_ptr, y_ptr, ar, rc, rcw, N, stride_sg,
                                        stride_sn, MAGIC, p0, p1, p2, p3, up, xsum, KW, GROUP, G, BITS, PER, C, CW, BLOCK_N, BKW,
                                        NCH, HAS_BIAS, HALF2, HOIST, ZP)
            words = nxt
    else:
        for i in tl.range(0, total, num_stages=STAGES):
            rn = (pid + (i // NCH) * grid) * BLOCK_N + ar
            words = int_gemv_words(qw_ptr + rn[:, None].to(tl.int64) * KW, (i % NCH) * BKW, rw, rn < N, KW, EVEN)
            acc = _int_gemv_stream_step(acc, words, i, pid, grid, x_ptr, s_ptr, z_ptr, b_ptr, y_ptr, ar, rc, rcw, N, stride_sg,
                                        stride_sn, MAGIC, p0, p1, p2, p3, up, xsum, KW, GROUP, G, BITS, PER, C, CW, BLOCK_N, BKW,
                                        NCH, HAS_BIAS, HALF2, HOIST, ZP)


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


MAGIC_2_23 = 0x4B000000  # the bits of float32 2**23: OR-ed below a value of < 23 bits, it is 2**23 + value


def _zeros_arg(scales: torch.Tensor, zeros: torch.Tensor | None) -> torch.Tensor:
    """The zero points the int kernels read: laid out as the scales (one pair of strides
    serves both); None (symmetric: the constant ``_const_zero``) passes the scales, unread.
    Raises ValueError for zeros of another shape or layout."""
    if zeros is None:
        return scales
    if zeros.shape != scales.shape or zeros.stride() != scales.stride():
        raise ValueError(f"zeros {tuple(zeros.shape)} strides {zeros.stride()} must match the scales' "
                         f"{tuple(scales.shape)} strides {scales.stride()}")
    return zeros


def _const_zero(zeros: torch.Tensor | None, bits: int) -> float:
    """The kernels' ZP: 0.0 (load the zeros), else the symmetric zero point 2**(bits-1)."""
    return 0.0 if zeros is not None else float(1 << (bits - 1))


def int_gemv_default(n: int, k: int) -> dict[str, int]:
    """The packed-integer GEMV's launch config without a swept one (gemv_configs): 8 rows a
    program (each activation value serves 8 rows), 4 warps where K fits one chunk of 512
    words (K = 4096 at 4 bits: every load issued at once), else 2 (256-word chunks: 7 even
    steps of down_proj's 1792 words). Below 512 words, the warps whose 128-word share the row
    still fills (K = 2048: 2, not 4 with half the threads masked off: Qwen3-30B-A3B's qkv_proj,
    5x its floor on an H100 with 4; 2026-12-08, not yet measured with 2)."""
    words = k // 8
    if words <= 512:
        return {"block_n": 8, "num_warps": max(1, min(4, words // 128))}
    return {"block_n": 8, "num_warps": 2}


def int_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
             group_size: int, bias: torch.Tensor | None = None, block_n: int | None = None,
             num_warps: int | None = None, split_k: int | None = None, prefetch: bool | None = None,
             half2: bool | None = None, persistent: int | None = None, vec: int | None = None,
             stages: int | None = None) -> torch.Tensor:
    """One row: x [1, K] (contiguous) @ dequant(qweight [N, K * bits / 32]).T -> [1, N] in
    x.dtype (scales, zeros [ceil(K / group_size), N]; bias [N] or None). The launch config:
    the arguments, else the swept one of this shape and GPU (``gemv_configs``), else
    ``int_gemv_default``. Its knobs:

    * ``block_n`` rows a program, ``num_warps``; a chunk is ``32 * num_warps * vec`` words,
      ``vec`` the words a thread loads at once (0: 4 where the group size allows, else 2 or
      1; a thread's words lie in one group);
    * ``split_k`` > 1: K cut into that many runs of whole chunks, one program each, whose
      float32 partial sums a second pass adds in split order (deterministic; the bias and
      the rounding there); ``prefetch``: a program loads its next chunk before it
      multiplies the current one;
    * ``persistent`` > 0 (``split_k`` 1, no ``prefetch``): that many programs an SM (on the
      CPU: in all) walk the blocks of rows with the next block's words in flight during the
      current products (``_int_gemv_stream_kernel``), in registers (``stages`` 1) or in a
      software pipeline of ``stages`` shared-memory buffers;
    * ``half2``: 4-bit words against bf16/fp16 activations multiplied in f16x2 arithmetic
      (``_half2_x``, ``_half2_dot``: products and sums of four rounded to f16, not exact
      float32 ones); GPU only, other inputs keep the float32 path.

    Raises ValueError for a group size that is not a multiple of the values a word holds, a
    ``vec`` a group cannot hold, a ``split_k`` that leaves a split without a chunk
    (``split_chunks``), ``prefetch`` with one chunk a split, ``stages`` > 1 without
    ``persistent``, or ``persistent`` with ``split_k`` > 1 or ``prefetch``."""
    n, kw = qweight.shape
    per = 32 // bits
    k = kw * per
    cfg = _gemv_config(f"int{bits}", n, k, x.device, int_gemv_default)
    block_n = block_n or cfg["block_n"]
    num_warps = num_warps or cfg["num_warps"]
    split_k = split_k if split_k is not None else cfg.get("split_k", 1)
    prefetch = prefetch if prefetch is not None else bool(cfg.get("prefetch", False))
    half2 = half2 if half2 is not None else bool(cfg.get("half2", False))
    half2 = half2 and bits == 4 and x.is_cuda and not _INTERPRET and x.dtype in (torch.bfloat16, torch.float16)
    persistent = persistent if persistent is not None else cfg.get("persistent", 0)
    stages = stages or cfg.get("stages", 1)
    if group_size % per:
        raise ValueError(f"group size {group_size} must be a multiple of the {per} values an int32 word holds")
    vec = vec or cfg.get("vec", 0)
    if vec:  # the words a thread loads at once: in one group, and a whole number along K
        if group_size % (vec * per) or kw % vec:
            raise ValueError(f"vec {vec}: {vec * per} values a thread do not tile groups of {group_size} and K {k}")
        cw = vec
    else:
        cw = next(c for c in (4, 2, 1) if group_size % (c * per) == 0 and kw % c == 0)
    what = f"int{bits} GEMV {n}x{k} (block_n {block_n}, num_warps {num_warps}, split_k {split_k})"
    if prefetch and split_chunks(triton.cdiv(kw, 32 * num_warps * cw), split_k, what) < 2:
        raise ValueError(f"{what}: prefetch needs at least two chunks a split")
    split_chunks(triton.cdiv(kw, 32 * num_warps * cw), split_k, what)
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    if stages > 1 and not persistent:
        raise ValueError(f"{what}: stages {stages} needs persistent programs")
    if persistent:
        if split_k > 1 or prefetch:
            raise ValueError(f"{what}: persistent programs take neither split_k > 1 nor prefetch (they prefetch)")
        blocks = triton.cdiv(n, block_n)
        grid = min(blocks, persistent * (_num_sms(x.device.index or 0) if x.is_cuda else 1))
        _int_gemv_stream_kernel[(grid,)](
            x, qweight, scales, _zeros_arg(scales, zeros), bias if bias is not None else scales, y, n,
            scales.stride(0), scales.stride(1), MAGIC_2_23, K=k, GROUP=group_size, BITS=bits, BLOCK_N=block_n, CW=cw,
            NUM_WARPS=num_warps, HAS_BIAS=bias is not None, HALF2=half2, STAGES=stages, ZP=_const_zero(zeros, bits),
            num_warps=num_warps, **pdl.launch_kwargs(x, "int_gemv_stream"))
        return y
    part = _split_partials(split_k, n, x.device) if split_k > 1 else y
    _int_gemv_kernel[(triton.cdiv(n, block_n), split_k)](
        x, qweight, scales, _zeros_arg(scales, zeros), bias if bias is not None else scales, y, part, n,
        scales.stride(0), scales.stride(1), MAGIC_2_23, K=k, GROUP=group_size, BITS=bits, BLOCK_N=block_n, CW=cw,
        NUM_WARPS=num_warps, HAS_BIAS=bias is not None, SPLIT_K=split_k, PREFETCH=bool(prefetch), HALF2=half2,
        ZP=_const_zero(zeros, bits), num_warps=num_warps, **pdl.launch_kwargs(x, "int_gemv"))
    if split_k > 1:
        _split_sum(part, bias, y)
    return y


@triton.jit
def _int_gemm_kernel(a_ptr, qw_ptr, s_ptr, z_ptr, b_ptr, c_ptr, M, N, K, GROUP_SIZE, stride_am, stride_cm, stride_sg,
                     stride_sn, BITS: tl.constexpr, ZP: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
                     TILE_IN_GROUP: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # Each K step loads the BLOCK_K / PER packed words of its rows once ([WORDS, BLOCK_N] of
    # qweight [N, K / PER], contiguous along K) and splits them in registers; with TILE_IN_GROUP (BLOCK_K divides
    # GROUP_SIZE) the step's rows share one group, whose scale and zero are one row each.
    PER: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    WORDS: tl.constexpr = BLOCK_K // PER
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rw = tl.arange(0, WORDS)
    shifts = tl.arange(0, PER) * BITS
    mask_m = rm < M
    mask_n = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + rk
        mk = offs_k < K
        a = tl.load(a_ptr + rm[:, None].to(tl.int64) * stride_am + offs_k[None, :],
                    mask=mask_m[:, None] & mk[None, :], other=0.0)
        w_row = k0 // PER + rw
        words = tl.load(qw_ptr + rn[None, :].to(tl.int64) * (K // PER) + w_row[:, None],
                        mask=(w_row < K // PER)[:, None] & mask_n[None, :], other=0)  # [WORDS, BLOCK_N]
        q = tl.reshape((words[:, None, :] >> shifts[None, :, None]) & MASK, [BLOCK_K, BLOCK_N]).to(tl.float32)
        if TILE_IN_GROUP:  # rows past K: q is 0 there and so is a
            g = (k0 // GROUP_SIZE).to(tl.int64) * stride_sg + rn.to(tl.int64) * stride_sn
            s = tl.load(s_ptr + g, mask=mask_n, other=0.0).to(tl.float32)
            if ZP > 0:  # every zero point ZP (symmetric): nothing to load
                w = (q - ZP) * s[None, :]
            else:
                z = tl.load(z_ptr + g, mask=mask_n, other=0.0).to(tl.float32)
                w = (q - z[None, :]) * s[None, :]
        else:
            m2 = mk[:, None] & mask_n[None, :]
            g = (offs_k // GROUP_SIZE)[:, None].to(tl.int64) * stride_sg + rn[None, :].to(tl.int64) * stride_sn
            s = tl.load(s_ptr + g, mask=m2, other=0.0).to(tl.float32)
            if ZP > 0:
                w = (q - ZP) * s
            else:
                z = tl.load(z_ptr + g, mask=m2, other=0.0).to(tl.float32)
                w = (q - z) * s
        if UPCAST:
            acc += tl.dot(a.to(tl.float32), w, input_precision="ieee")
        elif a.dtype == tl.float32:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w.to(a.dtype))
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def int_gemm_tile_bytes(block_m: int, block_n: int, block_k: int, bits: int, act_bytes: int, scale_bytes: int,
                        tile_in_group: bool) -> tuple[int, int]:
    """``(per_stage, fixed)`` shared-memory bytes of ``_int_gemm_kernel``'s tiles (see
    ``pyengine.ops.smem``): per stage the activation tile, the packed words and the scale
    and zero rows (whole [BLOCK_K, BLOCK_N] tiles when a step spans groups); fixed: the
    dequantized weight tile handed to ``tl.dot``."""
    sz = 2 * block_n * scale_bytes * (1 if tile_in_group else block_k)
    per_stage = block_m * block_k * act_bytes + block_k * bits // 8 * block_n + sz
    return per_stage, block_k * block_n * act_bytes


def int_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
             group_size: int, bias: torch.Tensor | None = None, block_m: int | None = None,
             block_n: int = 128, block_k: int = 64, num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """x [M, K] @ dequant(qweight).T -> [M, N] in x.dtype, each weight tile dequantized in
    registers. The stages (then ``block_n``, then ``block_m``) are cut until the tiles fit
    the device's shared memory (``int_gemm_tile_bytes``); ``block_k`` (at least 16 and 32 / bits)
    is halved while that makes it divide ``group_size``. Raises ValueError for a
    ``block_k`` that is not a power of two holding whole packed words."""
    m, k = x.shape
    n = qweight.shape[0]
    c = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return c
    if x.stride(-1) != 1:
        x = x.contiguous()
    if block_k & (block_k - 1) or block_k < max(16, 32 // bits):
        raise ValueError(f"block_k {block_k} must be a power of two >= {max(16, 32 // bits)}")
    if block_m is None:
        block_m = 16 if m <= 16 else (64 if m <= 64 else 128)
    while group_size % block_k and block_k // 2 >= max(16, 32 // bits):
        block_k //= 2
    tile_in_group = group_size % block_k == 0
    limit = smem.max_shared_mem(x.device)
    ab, sb = x.element_size(), scales.element_size()
    while True:
        stages = smem.fit_stages(*int_gemm_tile_bytes(block_m, block_n, block_k, bits, ab, sb, tile_in_group),
                                 num_stages, limit)
        if stages or (block_n <= 16 and block_m <= 16):
            break
        if block_n > 16:
            block_n //= 2
        else:
            block_m //= 2
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _int_gemm_kernel[grid](x, qweight, scales, _zeros_arg(scales, zeros), bias if bias is not None else scales, c, m,
                           n, k, group_size, x.stride(0), c.stride(0), scales.stride(0), scales.stride(1), BITS=bits,
                           ZP=_const_zero(zeros, bits), HAS_BIAS=bias is not None, UPCAST=_INTERPRET,
                           TILE_IN_GROUP=tile_in_group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8,
                           num_warps=num_warps, num_stages=max(1, stages))
    return c


def int_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
               group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """See the module docstring. x [M, K] -> [M, N] in x.dtype."""
    if x.shape[0] == 1 and x.is_contiguous():
        return int_gemv(x, qweight, scales, zeros, bits, group_size, bias)
    return int_gemm(x, qweight, scales, zeros, bits, group_size, bias)


# ---- torch references (tests, benchmarks) ---------------------------------------------------
def dequant_int_ref(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
                    group_size: int) -> torch.Tensor:
    """The float32 [N, K] weight the packed form (qweight [N, K*bits/32]) stands for."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=qweight.device)
    q = ((qweight.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).flatten(1).float()  # [N, K]
    g = torch.arange(q.shape[1], device=q.device) // group_size
    z = zeros.float()[g].t() if zeros is not None else float(1 << (bits - 1))
    return (q - z) * scales.float()[g].t()
