"""Shared-memory budgets of Triton kernels (the check Triton makes at launch, made before
it: a kernel whose tiles and pipeline stages need more shared memory than a block may have
fails with ``OutOfResources``; the H200 allows 227 KiB, 232448 bytes, per block).

* ``max_shared_mem(device)``: the per-block limit of a CUDA device in bytes (Triton's
  device property ``max_shared_mem``), None for a CPU device (the interpreter has none).
* ``fit_stages(per_stage, fixed, num_stages, limit)``: the most pipeline stages, at most
  ``num_stages``, whose buffers fit ``limit``.

A kernel's need is estimated from its tiles: ``num_stages - 1`` copies of the tiles it
loads in its K loop (Triton's software pipeline buffers that many iterations ahead, in
shared memory) plus ``fixed``, the operands it computes in registers and hands to
``tl.dot`` (staged through shared memory). This is what Triton allocated on the H200 for
the packed-int GEMM (tests/ops/test_smem.py records that case: 262144 bytes).
"""
from __future__ import annotations

import functools

import torch


@functools.cache
def _device_max_shared_mem(index: int) -> int:
    import triton

    return int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])


def max_shared_mem(device: torch.device) -> int | None:
    """Bytes of shared memory one block may use on ``device``; None off CUDA (no limit to
    respect: the interpreter)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return _device_max_shared_mem(device.index if device.index is not None else torch.cuda.current_device())


def fit_stages(per_stage: int, fixed: int, num_stages: int, limit: int | None) -> int:
    """The largest ``s`` in [1, num_stages] with ``smem_need(per_stage, fixed, s) <= limit``
    (``num_stages`` when ``limit`` is None), or 0 when even one stage does not fit (the
    caller shrinks its tiles). Sizes in bytes."""
    if limit is None:
        return max(1, num_stages)
    for s in range(max(1, num_stages), 0, -1):
        if smem_need(per_stage, fixed, s) <= limit:
            return s
    return 0


def smem_need(per_stage: int, fixed: int, num_stages: int) -> int:
    """Bytes of shared memory a kernel with ``num_stages`` pipeline stages needs by the
    model above: ``max(1, num_stages - 1) * per_stage + fixed``."""
    return max(1, num_stages - 1) * per_stage + fixed
