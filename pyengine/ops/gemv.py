"""Batch-1 linear layer (GEMV) in Triton: ``y = x @ weight.T`` for one token.

At batch 1 a linear layer reads each weight once and does two flops per weight: it is
bound by memory bandwidth alone, and what decides its speed is how many bytes are in
flight. cuBLAS's kernels for this shape reach ~3.6-3.9 TB/s on the widest layers of an
8B model on an H200 but 2.2-3.0 TB/s on the narrower ones, more so with tensor
parallelism halving every layer (q/k/v, o_proj, and down_proj, which cuBLAS splits over K
with a second reduction kernel); benchmarks/gemv.py measures both on every shape.

Each program owns ``BLOCK_N`` output rows and walks K in ``BLOCK_K`` chunks, fully
unrolled, accumulating in float32; no split over K, so one kernel and no reduction pass.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pyengine.ops import pdl


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rn < N
    rk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rn[:, None].to(tl.int64) * K
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    if PDL:  # (pyengine/ops/pdl.py) the first chunk's weights are read during the previous kernel
        tl.extra.cuda.gdc_launch_dependents()
        w0 = tl.load(w_rows + rk[None, :], mask=mask_n[:, None] & (rk < K)[None, :], other=0.0)
        tl.extra.cuda.gdc_wait()
    for k in tl.static_range(0, K, BLOCK_K):  # unrolled: every chunk's loads issued early
        if k + BLOCK_K <= K:
            x = tl.load(x_ptr + k + rk).to(tl.float32)
            if PDL and k == 0:
                w = w0
            else:
                w = tl.load(w_rows + k + rk[None, :], mask=mask_n[:, None], other=0.0)
        else:
            mk = k + rk < K
            x = tl.load(x_ptr + k + rk, mask=mk, other=0.0).to(tl.float32)
            if PDL and k == 0:
                w = w0
            else:
                w = tl.load(w_rows + k + rk[None, :], mask=mask_n[:, None] & mk[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=mask_n)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, block_n: int | None = None,
         block_k: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for one row. x: [1, K] contiguous; weight: [N, K] with
    unit stride along K; bias: [N] or None; all of one dtype. Returns y [1, N] of that
    dtype, accumulated in float32. The default tile (8 rows, K in chunks of 1024 with 4
    warps; 512 with 8 warps below K = 4096; 4 rows and chunks of 2048 from K = 7168) was
    within 4% of the best of 18 tiles on every 8B shape at TP=1 and TP=2 on the H200
    (benchmarks/gemv.py --sweep)."""
    n, k = weight.shape
    long_k = k >= 7168  # down_proj: fewer rows per program, longer chunks
    if block_n is None:
        block_n = 4 if long_k else 8
    if block_k is None:
        block_k = 2048 if long_k else (1024 if k >= 4096 else 512)
    if num_warps is None:
        num_warps = 4 if block_k >= 1024 else 8
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](x, weight, bias if bias is not None else weight, y, n, K=k,
                                             BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None,
                                             num_warps=num_warps, **pdl.launch_kwargs(x, "gemv"))
    return y
