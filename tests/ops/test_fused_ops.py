"""Triton fused ops (pyengine/ops/fused.py) vs their torch references (pyengine/ops/native.py).

CPU: runs only under ``TRITON_INTERPRET=1`` (triton interpreter, tiny shapes):
    TRITON_INTERPRET=1 pytest tests/ops
GPU: ``pytest -m gpu tests/ops`` (realistic shapes).
"""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

# triton is a test dependency on Linux (setup.py): there its absence fails, elsewhere it skips
if not sys.platform.startswith("linux") and importlib.util.find_spec("triton") is None:
    pytest.skip("triton is a test dependency on Linux only", allow_module_level=True)
import triton  # noqa: E402,F401

import pyengine.ops as ops  # noqa: E402
from pyengine.layers import rotary  # noqa: E402
from pyengine.ops import (
    fused,  # noqa: E402
    native,  # noqa: E402
)
from tests.helpers import triton_device  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available()


_dev = triton_device


def _tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _cache(max_pos, d, dtype, device):
    params = {"rope_type": "default", "rope_theta": 10000.0}
    return rotary.RotaryEmbedding(d, max_pos, params, dtype).cos_sin_cache.to(device)


@pytest.mark.parametrize("kind", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(kind, dtype):
    dev = _dev(kind)
    hidden = 64 if dev == "cpu" else 1024
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, hidden, generator=g).to(dtype).to(dev)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).to(dev)
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-6), native.rms_norm(x, w, 1e-6), **_tol(dtype))
    # strided 3-D view (per-head norm on a slice of a fused qkv output)
    qkv = torch.randn(5, 6 * 16, generator=g).to(dtype).to(dev)
    q = qkv[:, : 4 * 16].view(5, 4, 16)
    w16 = w[:16].contiguous()
    torch.testing.assert_close(fused.rms_norm(q, w16, 1e-6), native.rms_norm(q, w16, 1e-6), **_tol(dtype))


@pytest.mark.parametrize("kind", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm(kind, dtype):
    dev = _dev(kind)
    hidden = 48 if dev == "cpu" else 4096
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, hidden, generator=g).to(dtype).to(dev)
    r = torch.randn(9, hidden, generator=g).to(dtype).to(dev)
    w = torch.randn(hidden, generator=g).to(dtype).to(dev)
    out, res = fused.fused_add_rms_norm(x, r, w, 1e-5)
    eout, eres = native.fused_add_rms_norm(x, r, w, 1e-5)
    # exact on the GPU; the CPU interpreter's fp32->bf16 cast may round differently
    exact = dev == "cuda" or dtype == torch.float32
    torch.testing.assert_close(res, eres, **(dict(atol=0, rtol=0) if exact else _tol(dtype)))
    torch.testing.assert_close(out, eout, **_tol(dtype))


@pytest.mark.parametrize("kind", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(kind, dtype):
    dev = _dev(kind)
    d = 40 if dev == "cpu" else 3072
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 2 * d, generator=g).to(dtype).to(dev)
    torch.testing.assert_close(fused.silu_and_mul(x), native.silu_and_mul(x), **_tol(dtype))


@pytest.mark.parametrize("kind", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rotary(kind, dtype, qk_norm):
    dev = _dev(kind)
    hq, hk, d, T = (4, 2, 16, 5) if dev == "cpu" else (16, 8, 128, 37)
    g = torch.Generator().manual_seed(3)
    cache = _cache(4096, d, dtype, dev)
    qkv = torch.randn(T, (hq + 2 * hk) * d, generator=g).to(dtype).to(dev)
    q = qkv[:, : hq * d].view(T, hq, d)
    k = qkv[:, hq * d:(hq + hk) * d].view(T, hk, d)
    pos = torch.randint(0, 4096, (T,), generator=g).to(dev)
    if qk_norm:
        qw = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype).to(dev)
        kw = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype).to(dev)
        eq, ek = native.apply_rotary(native.rms_norm(q, qw, 1e-6), native.rms_norm(k, kw, 1e-6),
                                     pos, cache)
        oq, ok = fused.apply_rotary(q, k, pos, cache, qw, kw, 1e-6)
    else:
        eq, ek = native.apply_rotary(q, k, pos, cache)
        oq, ok = fused.apply_rotary(q, k, pos, cache)
    torch.testing.assert_close(oq, eq, **_tol(dtype))
    torch.testing.assert_close(ok, ek, **_tol(dtype))


@pytest.mark.parametrize("kind", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,bias", [(40, 1100, True), (24, 2048, False), (6, 7300, False)])
def test_gemv_matches_linear(kind, dtype, n, k, bias):
    """One row through ops/gemv.py: N not a multiple of the row tile, K not a multiple of
    the K chunk (the masked tail), with and without a bias."""
    from pyengine.ops.gemv import gemv
    dev = _dev(kind)
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(1, k, generator=g).to(dev, dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dev, dtype)
    b = torch.randn(n, generator=g).to(dev, dtype) if bias else None
    ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    torch.testing.assert_close(gemv(x, w, b).float(), ref, **_tol(dtype))


def test_dispatch_cpu_uses_torch():
    x = torch.randn(3, 8)
    w = torch.ones(8)
    assert not ops.use_triton(x)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), native.rms_norm(x, w, 1e-6))
    q, k = torch.randn(2, 2, 8), torch.randn(2, 1, 8)
    cache = _cache(16, 8, torch.float32, "cpu")
    pos = torch.tensor([1, 5])
    w8 = torch.rand(8)
    a = ops.apply_rotary(q, k, pos, cache, w8, w8, 1e-6)
    b = native.apply_rotary(native.rms_norm(q, w8, 1e-6), native.rms_norm(k, w8, 1e-6), pos, cache)
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", DEVICES)
def test_rope_and_cache(kind, dtype, qk_norm):
    """Fused (q/k norm +) RoPE + KV write == apply_rotary + a plain cache write; padded
    rows (slot -1) leave the cache untouched."""
    dev = _dev(kind)
    hq, hk, d, T, bs, nb = (4, 2, 16, 6, 4, 8) if dev == "cpu" else (16, 8, 128, 40, 16, 64)
    g = torch.Generator().manual_seed(4)
    cache = _cache(4096, d, dtype, dev)
    qkv = torch.randn(T, (hq + 2 * hk) * d, generator=g).to(dtype).to(dev)
    q = qkv[:, : hq * d].view(T, hq, d)
    k = qkv[:, hq * d:(hq + hk) * d].view(T, hk, d)
    v = qkv[:, (hq + hk) * d:].view(T, hk, d)
    pos = torch.randint(0, 4096, (T,), generator=g).to(dev)
    slots = torch.randperm(nb * bs, generator=g)[:T].to(dev)
    slots[-1] = -1  # a padding row
    kc = torch.zeros(nb, bs, hk, d, dtype=dtype, device=dev)
    vc = torch.zeros_like(kc)
    w = {}
    if qk_norm:
        w = dict(q_norm_weight=(1 + 0.1 * torch.randn(d, generator=g)).to(dtype).to(dev),
                 k_norm_weight=(1 + 0.1 * torch.randn(d, generator=g)).to(dtype).to(dev), eps=1e-6)
        eq, ek = native.apply_rotary(native.rms_norm(q, w["q_norm_weight"], 1e-6),
                                     native.rms_norm(k, w["k_norm_weight"], 1e-6), pos, cache)
    else:
        eq, ek = native.apply_rotary(q, k, pos, cache)
    oq = fused.rope_and_cache(q, k, v, pos, cache, kc, vc, slots, **w)
    torch.testing.assert_close(oq, eq, **_tol(dtype))
    real = slots >= 0
    flat_k, flat_v = kc.view(nb * bs, hk, d), vc.view(nb * bs, hk, d)
    torch.testing.assert_close(flat_k[slots[real]], ek[real], **_tol(dtype))
    torch.testing.assert_close(flat_v[slots[real]], v[real], atol=0, rtol=0)
    untouched = torch.ones(nb * bs, dtype=torch.bool, device=dev)
    untouched[slots[real]] = False
    assert flat_k[untouched].abs().sum() == 0 and flat_v[untouched].abs().sum() == 0


# ---- seeded rows' draws (ops.seeded_exponentials) -----------------------------------------
SEEDS = [0, 1, 7, -1, 2**63 - 1, -2**63, 123456789012345, 2**64 - 1]


def test_seeded_bits_are_a_bijection_of_the_token_and_differ_by_seed_and_position():
    pos = torch.tensor([0, 0, 5, 5, 2**31 - 1, 9, 9, 9])
    lo = torch.tensor([s & 0xFFFFFFFF for s in SEEDS])
    hi = torch.tensor([(s >> 32) & 0xFFFFFFFF for s in SEEDS])
    bits = native.seeded_bits(lo, hi, pos, 4096)
    assert bits.min() >= 0 and bits.max() < 2**32
    assert all(len(set(r.tolist())) == 4096 for r in bits)  # no two tokens of a row share a word
    # -1 and 2**64 - 1 are the same 64 bits; every other (seed, position) row differs
    assert torch.equal(bits[3], native.seeded_bits(lo[7:], hi[7:], pos[3:4], 4096)[0])
    assert len({tuple(r[:16].tolist()) for r in bits}) == len(SEEDS)
    # each bit is set about half the time (mixing reaches every bit)
    frac = torch.stack([(bits >> b) & 1 for b in range(32)]).double().mean(dim=(1, 2))
    assert (frac - 0.5).abs().max() < 0.02, frac


def test_seeded_exponentials_are_exp1():
    n = 64
    e = ops.seeded_exponentials([3] * n, torch.arange(n), 2048).flatten().double()
    assert e.min() > 0
    # the largest word gives the smallest draw, still > 0 (a 0 or -0 draw makes 0 / -0 = NaN win)
    top = native.seeded_exponentials(torch.tensor([0]), torch.tensor([0]), torch.tensor([0]), 1)
    assert top.item() > 0
    ones = torch.full((1, 1), 2**32 - 1)
    u = ((ones >> 9).to(torch.float32) + 0.5) * 2.0 ** -23
    assert u.item() < 1.0 and -torch.log(u).item() > 0
    assert abs(float(e.mean()) - 1.0) < 0.02 and abs(float(e.var()) - 1.0) < 0.05
    # Kolmogorov-Smirnov against 1 - exp(-x): D < 1.63 / sqrt(N) at p ~ 0.01
    x, _ = torch.sort(e)
    cdf = 1 - torch.exp(-x)
    emp = torch.arange(1, x.numel() + 1, dtype=torch.float64) / x.numel()
    assert float((cdf - emp).abs().max()) < 1.63 / x.numel() ** 0.5
    # neighbouring positions are uncorrelated
    a = ops.seeded_exponentials([3] * n, torch.arange(n), 2048)
    b = ops.seeded_exponentials([3] * n, torch.arange(n) + 1, 2048)
    assert abs(float(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1])) < 0.02
    with pytest.raises(ValueError, match="seeds"):
        ops.seeded_exponentials([1, 2], torch.arange(3), 8)


@pytest.mark.parametrize("kind", DEVICES)
def test_seeded_exponentials_kernel(kind):
    dev = _dev(kind)
    pos = torch.tensor([0, 3, 3, 40, 2**31 - 1, 1000, 17, 2], device=dev)
    V = 3000 if dev == "cpu" else 151_936
    lo = torch.tensor([s & 0xFFFFFFFF for s in SEEDS], device=dev)
    hi = torch.tensor([(s >> 32) & 0xFFFFFFFF for s in SEEDS], device=dev)
    got = fused.seeded_exponentials(lo, hi, pos, V)
    want = native.seeded_exponentials(lo, hi, pos, V)
    # the same 32-bit words; only the log's last bit may differ
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert fused.seeded_exponentials(lo[:0], hi[:0], pos[:0], V).shape == (0, V)
