"""The torch reference attention backend against a naive dense attention written
independently (per head, per query loops), over a paged cache with non-contiguous blocks."""
from __future__ import annotations

import math
import random

import pytest
import torch

from pyengine.attention.backend import get_backend_cls
from tests.helpers import make_attn_metadata

H, HKV, D, BS = 4, 2, 8, 4


def naive_attention(q, k, v, scale):
    """q: [q_len, H, D] (the last q_len positions); k, v: [s, Hkv, D]."""
    q_len, s = q.shape[0], k.shape[0]
    out = torch.zeros(q_len, q.shape[1], q.shape[2], dtype=torch.float64)
    group = q.shape[1] // k.shape[1]
    for h in range(q.shape[1]):
        kh, vh = k[:, h // group].double(), v[:, h // group].double()
        for j in range(q_len):
            pos = s - q_len + j
            scores = (kh[: pos + 1] @ q[j, h].double()) * scale
            out[j, h] = torch.softmax(scores, 0) @ vh[: pos + 1]
    return out


def _run(query_lens, seq_lens, num_padded, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    num_blocks = 64
    needed = [math.ceil(s / BS) for s in seq_lens]
    perm = rng.sample(range(num_blocks), sum(needed))  # non-contiguous, shuffled
    tables, off = [], 0
    for n in needed:
        tables.append(perm[off: off + n])
        off += n
    meta, _ = make_attn_metadata(query_lens, seq_lens, tables, BS, num_padded_tokens=num_padded)
    kv_cache = torch.randn(2, num_blocks, BS, HKV, D, generator=g).to(dtype)  # garbage everywhere
    full_k = [torch.randn(s, HKV, D, generator=g).to(dtype) for s in seq_lens]
    full_v = [torch.randn(s, HKV, D, generator=g).to(dtype) for s in seq_lens]
    # The cached prefix (positions < s - q) is already in the cache.
    for s, q, t, fk, fv in zip(seq_lens, query_lens, tables, full_k, full_v):
        for p in range(s - q):
            kv_cache[0, t[p // BS], p % BS] = fk[p]
            kv_cache[1, t[p // BS], p % BS] = fv[p]
    T = sum(query_lens) + num_padded
    qs = torch.randn(T, H, D, generator=g).to(dtype)
    ks = torch.randn(T, HKV, D, generator=g).to(dtype)
    vs = torch.randn(T, HKV, D, generator=g).to(dtype)
    row = 0
    for s, q, fk, fv in zip(seq_lens, query_lens, full_k, full_v):
        ks[row: row + q] = fk[s - q:]
        vs[row: row + q] = fv[s - q:]
        row += q
    before = kv_cache.clone()
    scale = D ** -0.5
    backend = get_backend_cls("torch")(H, HKV, D, scale, BS, dtype, torch.device("cpu"))
    out = backend.forward(qs, ks, vs, kv_cache, meta)
    return dict(meta=meta, out=out, qs=qs, full_k=full_k, full_v=full_v, tables=tables,
                kv_cache=kv_cache, before=before, scale=scale)


@pytest.mark.parametrize("query_lens,seq_lens,num_padded", [
    ([5], [5], 0),                          # one fresh prefill
    ([1, 1, 1], [9, 1, 4], 3),              # decode batch + CUDA-graph padding rows
    ([7, 1, 3, 4], [7, 13, 10, 4], 2),      # fresh prefill, decode, chunk over a cached prefix
    ([9, 2], [17, 2], 0),
])
def test_matches_naive(query_lens, seq_lens, num_padded):
    r = _run(query_lens, seq_lens, num_padded)
    row = 0
    for _s, q, fk, fv in zip(seq_lens, query_lens, r["full_k"], r["full_v"]):
        ref = naive_attention(r["qs"][row: row + q], fk, fv, r["scale"])
        torch.testing.assert_close(r["out"][row: row + q].double(), ref, atol=1e-5, rtol=1e-5)
        row += q
    assert r["out"].shape == r["qs"].shape


def test_cache_writes_and_padding_rows_skipped():
    query_lens, seq_lens = [3, 1], [6, 5]
    r = _run(query_lens, seq_lens, num_padded=4)
    cache, before = r["kv_cache"], r["before"].clone()
    written = torch.zeros(cache.shape[1], BS, dtype=torch.bool)
    for s, t, fk, fv in zip(seq_lens, r["tables"], r["full_k"], r["full_v"]):
        for p in range(s):
            b, o = t[p // BS], p % BS
            torch.testing.assert_close(cache[0, b, o], fk[p])
            torch.testing.assert_close(cache[1, b, o], fv[p])
            written[b, o] = True
    # Everything else (including where slot -1 rows could have landed) is untouched,
    # apart from the cached prefix the test itself put there.
    untouched = ~written
    assert torch.equal(cache[:, untouched], before[:, untouched])


def test_bfloat16():
    r = _run([4, 1], [6, 3], 1, dtype=torch.bfloat16)
    row = 0
    for _s, q, fk, fv in zip([6, 3], [4, 1], r["full_k"], r["full_v"]):
        ref = naive_attention(r["qs"][row: row + q], fk, fv, r["scale"])
        assert r["out"].dtype == torch.bfloat16
        torch.testing.assert_close(r["out"][row: row + q].double(), ref, atol=2e-2, rtol=2e-2)
        row += q


def test_without_cache_attends_within_step():
    g = torch.Generator().manual_seed(1)
    meta, _ = make_attn_metadata([3, 5], [3, 5], [[0], [1, 2]], BS)
    q = torch.randn(8, H, D, generator=g)
    k = torch.randn(8, HKV, D, generator=g)
    v = torch.randn(8, HKV, D, generator=g)
    backend = get_backend_cls("torch")(H, HKV, D, D ** -0.5, BS, torch.float32, torch.device("cpu"))
    out = backend.forward(q, k, v, None, meta)
    torch.testing.assert_close(out[:3].double(), naive_attention(q[:3], k[:3], v[:3], D ** -0.5), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[3:].double(), naive_attention(q[3:], k[3:], v[3:], D ** -0.5), atol=1e-5, rtol=1e-5)


def test_registered():
    assert get_backend_cls("torch").name == "torch"
