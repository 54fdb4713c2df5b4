"""Triton attention backend vs the torch reference backend.

CPU: runs only under ``TRITON_INTERPRET=1`` (the triton interpreter; tiny shapes), e.g.
    TRITON_INTERPRET=1 pytest tests/attention/test_triton_backend.py
GPU: ``pytest -m gpu tests/attention/test_triton_backend.py`` (realistic shapes).
"""
from __future__ import annotations

import importlib.util
import math
import os
import sys

import pytest
import torch

# triton is a test dependency on Linux (setup.py): there its absence fails, elsewhere it skips
if not sys.platform.startswith("linux") and importlib.util.find_spec("triton") is None:
    pytest.skip("triton is a test dependency on Linux only", allow_module_level=True)
import triton  # noqa: E402,F401

from pyengine.attention.backend import AttentionMetadata, get_backend_cls  # noqa: E402
from pyengine.attention.torch_backend import TorchAttentionBackend  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available()

cpu_only = pytest.mark.skipif(not INTERPRET, reason="set TRITON_INTERPRET=1 to run triton on CPU")


def make_batch(reqs, num_heads, num_kv_heads, head_dim, block_size, dtype, device, pad_rows=0,
               seed=0, num_blocks=None):
    """reqs: list of (q_len, seq_len). Returns q, k, v, kv_cache (prefix filled), meta."""
    g = torch.Generator().manual_seed(seed)
    blocks_per = [math.ceil(s / block_size) for _, s in reqs]
    total_blocks = num_blocks or (sum(blocks_per) + 3)
    perm = torch.randperm(total_blocks, generator=g)
    kv_cache = torch.randn(2, total_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    max_blocks = max(blocks_per) + 2
    block_table = torch.zeros(len(reqs), max_blocks, dtype=torch.int32)
    used = 0
    qsl = [0]
    slots = []
    for i, (ql, sl) in enumerate(reqs):
        ids = perm[used:used + blocks_per[i]]
        used += blocks_per[i]
        block_table[i, :len(ids)] = ids.to(torch.int32)
        qsl.append(qsl[-1] + ql)
        for pos in range(sl - ql, sl):
            slots.append(int(ids[pos // block_size]) * block_size + pos % block_size)
    T = qsl[-1] + pad_rows
    slots += [-1] * pad_rows
    q = torch.randn(T, num_heads, head_dim, generator=g).to(dtype)
    k = torch.randn(T, num_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(T, num_kv_heads, head_dim, generator=g).to(dtype)
    qsl_t = torch.tensor(qsl, dtype=torch.int32)
    seq_t = torch.tensor([s for _, s in reqs], dtype=torch.int32)
    meta = AttentionMetadata(
        num_actual_tokens=qsl[-1], num_reqs=len(reqs), max_query_len=max(ql for ql, _ in reqs),
        max_seq_len=max(s for _, s in reqs), query_start_loc=qsl_t.to(device),
        seq_lens=seq_t.to(device), block_table=block_table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64).to(device),
        query_start_loc_cpu=qsl_t, seq_lens_cpu=seq_t)
    return q.to(device), k.to(device), v.to(device), kv_cache.to(device), meta


def run_compare(reqs, num_heads, num_kv_heads, head_dim, block_size, dtype, device, pad_rows=0,
                atol=2e-2, rtol=2e-2, seed=0, splits=None):
    q, k, v, cache, meta = make_batch(reqs, num_heads, num_kv_heads, head_dim, block_size, dtype,
                                      device, pad_rows, seed)
    scale = head_dim ** -0.5
    tri = get_backend_cls("triton")(num_heads, num_kv_heads, head_dim, scale, block_size, dtype, device)
    if splits is not None:
        tri.num_splits_override = splits
    ref = TorchAttentionBackend(num_heads, num_kv_heads, head_dim, scale, block_size, dtype, device)
    cache_tri = cache.clone()
    cache_ref = cache.clone()
    out = tri.forward(q, k, v, cache_tri, meta)
    expect = ref.forward(q, k, v, cache_ref, meta)
    n = meta.num_actual_tokens
    assert torch.equal(cache_tri, cache_ref), "KV cache write differs"
    torch.testing.assert_close(out[:n].float(), expect[:n].float(), atol=atol, rtol=rtol)
    return out, expect


# ---------------------------------------------------------------- CPU (interpreter) ----
@cpu_only
@pytest.mark.parametrize("splits", [1, 3, 4])
def test_decode_interpret(splits):
    reqs = [(1, 1), (1, 17), (1, 40), (1, 5)]
    run_compare(reqs, 4, 2, 16, 4, torch.float32, "cpu", pad_rows=2, splits=splits, atol=1e-4, rtol=1e-4)


@cpu_only
def test_decode_bf16_interpret():
    run_compare([(1, 9), (1, 33), (1, 2)], 8, 2, 16, 4, torch.bfloat16, "cpu", splits=2,
                atol=3e-2, rtol=3e-2)


@cpu_only
def test_decode_padding_request_interpret():
    # a padding request (seq_len 0) as CUDA-graph padding yields zeros, not NaN
    q, k, v, cache, meta = make_batch([(1, 9), (1, 3)], 4, 2, 16, 4, torch.float32, "cpu")
    meta.seq_lens[1] = 0
    meta.slot_mapping[1] = -1
    tri = get_backend_cls("triton")(4, 2, 16, 0.25, 4, torch.float32, "cpu")
    tri.num_splits_override = 4
    out = tri.forward(q, k, v, cache, meta)
    assert torch.isfinite(out).all() and (out[1] == 0).all()


@cpu_only
@pytest.mark.parametrize("group", [1, 2, 3])
def test_extend_mixed_interpret(group):
    # prefill without prefix, chunk over a cached prefix, decode rows mixed in
    reqs = [(7, 7), (1, 13), (5, 21), (1, 2), (3, 3)]
    run_compare(reqs, 2 * group, 2, 16, 4, torch.float32, "cpu", pad_rows=3, atol=1e-4, rtol=1e-4)


@cpu_only
def test_extend_bf16_interpret():
    run_compare([(6, 10), (1, 4)], 4, 2, 16, 4, torch.bfloat16, "cpu", atol=3e-2, rtol=3e-2)


@cpu_only
@pytest.mark.parametrize("q_len,group,splits", [(2, 1, 1), (5, 2, 4), (6, 3, 2), (16, 2, 3)])
def test_uniform_short_queries_take_the_decode_kernel_interpret(q_len, group, splits, monkeypatch):
    # every request q_len rows (a verification, a draft chain's first forward): the decode
    # kernel row by row, causal within the request; the extend kernel is not called
    import pyengine.attention.triton_backend as tb

    def no_extend(*a, **k):
        raise AssertionError("the extend kernel ran")
    monkeypatch.setattr(tb, "paged_extend", no_extend)
    lens = [q_len, q_len + 3, 2 * q_len + 9, 40][:max(1, 64 // q_len // 2)]
    run_compare([(q_len, s) for s in lens], 2 * group, 2, 16, 4, torch.float32, "cpu", splits=splits,
                atol=1e-4, rtol=1e-4)


@cpu_only
def test_short_queries_outside_the_limits_take_the_extend_kernel_interpret(monkeypatch):
    import pyengine.attention.triton_backend as tb

    calls = []
    extend = tb.paged_extend
    monkeypatch.setattr(tb, "paged_extend", lambda *a, **k: calls.append(1) or extend(*a, **k))
    run_compare([(3, 9), (2, 5)], 4, 2, 16, 4, torch.float32, "cpu", atol=1e-4, rtol=1e-4)  # not uniform
    run_compare([(17, 20)], 4, 2, 16, 4, torch.float32, "cpu", atol=1e-4, rtol=1e-4)  # Q > 16
    run_compare([(4, s) for s in range(4, 21)], 4, 2, 16, 4, torch.float32, "cpu", atol=1e-4, rtol=1e-4)  # 68 rows
    assert len(calls) == 3


@cpu_only
def test_uniform_short_queries_padding_request_interpret():
    # a verification graph's padding request (seq_len 0 here): zeros, not NaN
    q, k, v, cache, meta = make_batch([(4, 9), (4, 4)], 4, 2, 16, 4, torch.float32, "cpu")
    meta.seq_lens[1] = 0
    meta.slot_mapping[4:] = -1
    tri = get_backend_cls("triton")(4, 2, 16, 0.25, 4, torch.float32, "cpu")
    tri.num_splits_override = 2
    out = tri.forward(q, k, v, cache, meta)
    assert torch.isfinite(out).all() and (out[4:8] == 0).all()


@cpu_only
def test_no_cache_profile_run_interpret():
    q, k, v, cache, meta = make_batch([(5, 5), (3, 3)], 4, 2, 16, 4, torch.float32, "cpu")
    tri = get_backend_cls("triton")(4, 2, 16, 0.25, 4, torch.float32, "cpu")
    ref = TorchAttentionBackend(4, 2, 16, 0.25, 4, torch.float32, "cpu")
    out = tri.forward(q, k, v, None, meta)
    expect = ref.forward(q, k, v, None, meta)
    torch.testing.assert_close(out, expect, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------- GPU ------
QWEN = dict(num_heads=16, num_kv_heads=8, head_dim=128, block_size=16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("splits", [None, 1, 8])
def test_decode_gpu(dtype, splits):
    _gpu_or_skip()
    reqs = [(1, s) for s in (1, 15, 16, 17, 100, 513, 1024, 2047, 3000, 31)]
    run_compare(reqs, **QWEN, dtype=dtype, device="cuda", pad_rows=6, splits=splits)


@pytest.mark.parametrize("dtype", [torch.bfloat16])
@pytest.mark.parametrize("heads", [(16, 8), (32, 8), (8, 8)])
def test_extend_gpu(dtype, heads):
    _gpu_or_skip()
    reqs = [(300, 300), (1, 77), (64, 1000), (1, 1), (129, 129 + 48), (17, 17), (1, 2048)]
    cfg = dict(QWEN, num_heads=heads[0], num_kv_heads=heads[1])
    run_compare(reqs, **cfg, dtype=dtype, device="cuda", pad_rows=5)


@pytest.mark.parametrize("q_len,bs", [(5, 1), (5, 8), (6, 4), (16, 4)])
def test_uniform_short_queries_gpu(q_len, bs):
    _gpu_or_skip()
    g = torch.Generator().manual_seed(q_len * bs)
    lens = [q_len + int(x) for x in torch.randint(0, 3000, (bs,), generator=g)]
    run_compare([(q_len, s) for s in lens], **QWEN, dtype=torch.bfloat16, device="cuda")


def test_decode_batch_sizes_gpu():
    _gpu_or_skip()
    for bs in (1, 2, 8, 64, 256):
        g = torch.Generator().manual_seed(bs)
        lens = torch.randint(1, 600, (bs,), generator=g).tolist()
        run_compare([(1, s) for s in lens], **QWEN, dtype=torch.bfloat16, device="cuda", seed=bs)


def test_decode_cuda_graph_gpu():
    _gpu_or_skip()
    reqs = [(1, s) for s in (5, 300, 17, 1000)]
    q, k, v, cache, meta = make_batch(reqs, **QWEN, dtype=torch.bfloat16, device="cuda")
    tri = get_backend_cls("triton")(16, 8, 128, 128 ** -0.5, 16, torch.bfloat16, "cuda")
    tri.reserve(256)
    ref_cache = cache.clone()
    expect = TorchAttentionBackend(16, 8, 128, 128 ** -0.5, 16, torch.bfloat16, "cuda").forward(
        q, k, v, ref_cache, meta)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            tri.forward(q, k, v, cache.clone(), meta)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tri.forward(q, k, v, cache, meta)
    # change lengths on the device after capture: replay must follow them
    meta.seq_lens.copy_(torch.tensor([6, 301, 18, 1001], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    meta2 = AttentionMetadata(**{**meta.__dict__, "seq_lens_cpu": meta.seq_lens.cpu()})
    ref2 = TorchAttentionBackend(16, 8, 128, 128 ** -0.5, 16, torch.bfloat16, "cuda").forward(
        q, k, v, ref_cache.clone(), meta2)
    del expect
    torch.testing.assert_close(out.float(), ref2.float(), atol=2e-2, rtol=2e-2)


def test_reserve_again_keeps_the_scratch_gpu():
    # the engine's device is torch.device("cuda") (no index) while tensors say cuda:0: a
    # second reserve (the verify graphs', the draft chain's) must not swap the scratch that
    # graphs captured before it write into
    _gpu_or_skip()
    tri = get_backend_cls("triton")(16, 8, 128, 128 ** -0.5, 16, torch.bfloat16, torch.device("cuda"))
    tri.reserve(256)
    ptrs = tri._part_lse.data_ptr(), tri._part_out.data_ptr()
    tri.reserve(32)
    tri.reserve(256, torch.device("cuda:0"))
    assert (tri._part_lse.data_ptr(), tri._part_out.data_ptr()) == ptrs


def test_outgrown_scratch_stays_allocated():
    # a CUDA graph captured with the smaller scratch keeps writing into it: freed, its
    # memory would go to other tensors
    import weakref

    tri = get_backend_cls("triton")(4, 2, 16, 0.25, 16, torch.float32, torch.device("cpu"))
    tri.reserve(1)
    old = weakref.ref(tri._part_lse), weakref.ref(tri._part_out)
    tri.reserve(512)
    assert tri._part_lse.numel() > 0 and all(r() is not None for r in old)
    assert old[0]() is not tri._part_lse


def _gpu_or_skip():
    if not HAS_CUDA or INTERPRET:
        pytest.skip("needs CUDA")


for _name in [n for n in list(globals()) if n.endswith("_gpu")]:
    globals()[_name] = pytest.mark.gpu(globals()[_name])
