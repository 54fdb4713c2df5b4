"""Shared-memory budgets (pyengine/ops/smem.py): the stages and tiles a kernel launches with
fit the device's per-block limit. On the H200 (227 KiB a block) the packed-int GEMM asked
for 262144 bytes in float32 (BLOCK 64x128x64, 3 stages: 2 x (16 KiB activations + 32 KiB
words + 2 x 32 KiB scale/zero tiles) + 32 KiB dequantized tile) and failed at launch.

CPU: the kernels run under ``TRITON_INTERPRET=1`` with the limit patched in."""
from __future__ import annotations

import os

import pytest
import torch

from pyengine.ops import smem

H200_LIMIT = 232448


def test_fit_stages():
    assert smem.smem_need(100, 10, 3) == 210 and smem.smem_need(100, 10, 1) == 110
    assert smem.fit_stages(100, 10, 4, None) == 4
    assert smem.fit_stages(100, 10, 4, 310) == 4  # 3 * 100 + 10
    assert smem.fit_stages(100, 10, 4, 309) == 3
    assert smem.fit_stages(100, 10, 4, 109) == 0
    assert smem.max_shared_mem(torch.device("cpu")) is None


def test_old_int_gemm_tiles_are_what_failed_on_the_h200():
    """The model reproduces the failure's number: the old kernel's per-row scale/zero tiles
    and one word per row, in float32."""
    per_stage = 64 * 64 * 4 + 64 * 128 * 4 + 2 * 64 * 128 * 4
    assert smem.smem_need(per_stage, 64 * 128 * 4, 3) == 262144 > H200_LIMIT


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="set TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype,m,limit", [(torch.float32, 24, H200_LIMIT), (torch.float32, 200, 64 * 1024),
                                           (torch.bfloat16, 200, 48 * 1024)])
def test_int_gemm_launches_within_the_limit(dtype, m, limit, monkeypatch):
    from pyengine.layers.quantization.utils import pack_int32
    from pyengine.ops import quant

    launches = []
    real = quant._int_gemm_kernel

    class Spy:
        def __getitem__(self, grid):
            def run(*args, **kw):
                launches.append(kw)
                return real[grid](*args, **kw)
            return run
    monkeypatch.setattr(quant, "_int_gemm_kernel", Spy())
    monkeypatch.setattr(smem, "max_shared_mem", lambda device: limit)
    g = torch.Generator().manual_seed(0)
    k, n, gs = 128, 256, 32
    q = torch.randint(0, 16, (k, n), generator=g, dtype=torch.int32)
    s = (torch.rand(k // gs, n, generator=g) * 0.02 + 0.001).to(dtype)
    z = torch.randint(0, 16, (k // gs, n), generator=g).to(dtype)
    qw = pack_int32(q.t(), 4, 1)  # the kernels' [N, K*bits/32]
    x = torch.randn(m, k, generator=g).to(dtype)
    y = quant.int_gemm(x, qw, s, z, 4, gs)
    (kw,) = launches
    per_stage, fixed = quant.int_gemm_tile_bytes(kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"], 4, x.element_size(),
                                                 s.element_size(), kw["TILE_IN_GROUP"])
    assert smem.smem_need(per_stage, fixed, kw["num_stages"]) <= limit
    ref = x.float() @ quant.dequant_int_ref(qw, s, z, 4, gs).t()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(y.float(), ref, atol=tol * ref.abs().max().item(), rtol=tol)
