"""Quantized linear kernels (pyengine/ops/quant.py) against their dequantized references.

CPU: under ``TRITON_INTERPRET=1`` (tiny shapes); GPU: ``pytest -m gpu tests/ops`` (8B-model
shapes). The reference computes in float32 from the same quantized data (the FP8 or int
weight dequantized; for W8A8 the activations quantized by the torch reference), so what is
left is accumulation order and the output's rounding. Tolerance, as the largest error over
the largest reference value: 1e-5 for float32 outputs, 1e-2 for bf16/fp16 (their rounding is
2**-8 / 2**-11 of a value; sums of thousands of products in another order add a little).
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
import triton  # noqa: E402

from pyengine.layers.quantization.utils import dequantize_fp8, fp8_quantize, pack_int32  # noqa: E402
from pyengine.ops import quant  # noqa: E402
from tests.helpers import triton_device  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


_dev = triton_device


# Hopper's FP8 tensor-core MMA adds its exact e4m3 products with a narrower accumulator than
# float32 (DeepSeek-V3's report measures ~14 bits kept per fused add), so an FP8 x FP8 dot of
# K = 2048 lands ~1e-4 from the float32 sum of the same products (5-9e-5 seen on the H200).
FP8_MMA_TOL = 5e-4


def _check(y, ref, dtype, tol=None):
    tol = tol or (1e-5 if dtype == torch.float32 else 1e-2)
    err = (y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-6)
    assert err <= tol, f"relative error {err:.3g} > {tol}"


def _shapes(dev):
    # (M, K, N): batch-1 GEMV, a few rows, a prefill chunk
    if dev == "cpu":
        return [(1, 128, 48), (5, 64, 96), (33, 128, 40)]
    return [(1, 4096, 6144), (1, 14336, 4096), (7, 4096, 28672), (256, 4096, 4096), (1000, 4096, 14336)]


def _dtypes(dev):
    return [torch.float32, torch.bfloat16] if dev == "cpu" else [torch.bfloat16, torch.float16]


def _fp8_weight(n, k, dev, block=None):
    g = torch.Generator(device="cpu").manual_seed(n * 31 + k)
    w = torch.randn(n, k, generator=g).to(dev) * 0.05
    if block is None:
        return fp8_quantize(w, per_row=True)
    bn, bk = block
    b = w.unflatten(0, (-1, bn)).unflatten(-1, (-1, bk))
    scale = b.abs().amax((1, 3)) / 448.0
    s = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)
    return (w / s).to(quant.FP8_DTYPE), scale.float()


def test_round_fp8_emulation_is_torch_rounding():
    """The interpreter's e4m3 rounding in arithmetic (ties, carries into the next power of
    two, subnormals) equals torch's cast, for every e4m3 value and the midpoints between."""
    if not INTERPRET:
        pytest.skip("set TRITON_INTERPRET=1")
    import triton.language as tl

    @triton.jit
    def k(x_ptr, y_ptr, N: tl.constexpr):
        r = tl.arange(0, N)
        tl.store(y_ptr + r, quant._round_fp8(tl.load(x_ptr + r), True))

    vals = torch.arange(256, dtype=torch.uint8).view(quant.FP8_DTYPE).float()
    vals = vals[vals.isfinite()].unique()
    mids = (vals[1:] + vals[:-1]) / 2
    x = torch.cat([vals, mids, mids.nextafter(torch.tensor(float("inf"))), mids.nextafter(torch.tensor(-float("inf")))])
    x = x[x.abs() <= 448]
    n = triton.next_power_of_2(x.numel())
    xp = torch.zeros(n)
    xp[: x.numel()] = x
    y = torch.empty(n)
    k[(1,)](xp, y, N=n)
    torch.testing.assert_close(y, xp.to(quant.FP8_DTYPE).float(), rtol=0, atol=0)


def _ref_act(x, group=None, static=None):
    """The activation quantization as the kernels define it, in torch: (x_q float32, scale)."""
    xf = x.float()
    if static is not None:
        s = static.float().reshape(1, 1)
        return (xf / s).clamp(-448, 448).to(quant.FP8_DTYPE).float() * s
    v = xf.unflatten(-1, (-1, group)) if group else xf.unsqueeze(-2)
    s = (v.abs().amax(-1, keepdim=True) / 448.0).clamp(min=quant._MIN_SCALE)
    return ((v / s).clamp(-448, 448).to(quant.FP8_DTYPE).float() * s).flatten(-2)


@pytest.mark.parametrize("kind", DEVICES)
@pytest.mark.parametrize("act", ["token", "tensor", None])
def test_fp8_linear_per_channel(kind, act):
    dev = _dev(kind)
    for dtype in _dtypes(dev):
        for m, k, n in _shapes(dev):
            w, ws = _fp8_weight(n, k, dev)
            x = torch.randn(m, k, device=dev).to(dtype)
            bias = torch.randn(n, device=dev).to(dtype)
            static = x.float().abs().amax().reshape(1) / 448.0 * 1.5 if act == "tensor" else None
            y = quant.fp8_linear(x, w, ws, static, bias, None, act)
            assert y.shape == (m, n) and y.dtype == dtype
            xr = x.float() if act is None else _ref_act(x, static=static)
            _check(y, xr @ dequantize_fp8(w, ws).t() + bias.float(), dtype)


@pytest.mark.parametrize("kind", DEVICES)
@pytest.mark.parametrize("act", ["group", None])
def test_fp8_linear_block(kind, act):
    dev = _dev(kind)
    block = (16, 32) if dev == "cpu" else (128, 128)
    for dtype in _dtypes(dev):
        for m, k, n in _shapes(dev):
            n = -(-n // block[0]) * block[0]
            w, ws = _fp8_weight(n, k, dev, block)
            x = torch.randn(m, k, device=dev).to(dtype)
            y = quant.fp8_linear(x, w, ws, None, None, block, act)
            xr = _ref_act(x, group=block[1]) if act else x.float()
            _check(y, xr @ dequantize_fp8(w, ws, block).t(), dtype)


@pytest.mark.parametrize("kind", DEVICES)
def test_quant_fp8_matches_reference(kind):
    dev = _dev(kind)
    x = torch.randn(9, 256, device=dev) * 3
    x[2] = 0  # an all-zero row keeps a nonzero scale
    q, s = quant.quant_fp8(x)
    assert q.dtype == quant.FP8_DTYPE and s.shape == (9, 1) and bool((s > 0).all())
    torch.testing.assert_close((q.float() * s), _ref_act(x), rtol=0, atol=0)
    q, s = quant.quant_fp8(x, group_size=64)
    assert s.shape == (9, 4)
    torch.testing.assert_close((q.float().unflatten(-1, (4, 64)) * s[..., None]).flatten(-2), _ref_act(x, group=64),
                               rtol=0, atol=0)


def _int_weight(n, k, bits, group_size, dev):
    g = torch.Generator(device="cpu").manual_seed(n + 7 * k + bits)
    q = torch.randint(0, 1 << bits, (k, n), generator=g, dtype=torch.int32)
    groups = k // group_size
    scales = (torch.rand(groups, n, generator=g) * 0.02 + 0.001)
    zeros = torch.randint(0, 1 << bits, (groups, n), generator=g).float()
    return pack_int32(q.t(), bits, 1).to(dev), scales.to(dev), zeros.to(dev)  # the kernels' [N, K*bits/32]


@pytest.mark.parametrize("kind", DEVICES)
@pytest.mark.parametrize("bits, group_size", [(4, 32), (4, 128), (8, 64), (4, -1), (4, 8)])  # 8: a step spans groups
def test_int_linear(kind, bits, group_size):
    dev = _dev(kind)
    for dtype in _dtypes(dev):
        for m, k, n in _shapes(dev):
            gs = k if group_size == -1 else min(group_size, k)
            qw, s, z = _int_weight(n, k, bits, gs, dev)
            s, z = s.to(dtype), z.to(dtype)
            x = torch.randn(m, k, device=dev).to(dtype)
            bias = torch.randn(n, device=dev).to(dtype)
            y = quant.int_linear(x, qw, s, z, bits, gs, bias)
            assert y.shape == (m, n) and y.dtype == dtype
            _check(y, x.float() @ quant.dequant_int_ref(qw, s, z, bits, gs).t() + bias.float(), dtype)


@pytest.mark.parametrize("kind", DEVICES)
@pytest.mark.parametrize("bits, group_size", [(4, 128), (4, 64), (8, 32), (4, -1), (4, 16)])
@pytest.mark.parametrize("block_n, num_warps", [(4, 1), (16, 2), (8, 4)])
def test_int_gemv_configs(kind, bits, group_size, block_n, num_warps):
    """The GEMV at every launch config the sweep tries: K over several chunks of
    32 * num_warps * 4 words, evenly (2048 for 4-bit at 1-2 warps) and not (1792 at 4 warps:
    a masked last chunk; 8-bit: twice the words), N not a multiple of block_n, group
    sizes whose words a thread splits (16: two words a thread)."""
    dev = _dev(kind)
    for k in (2048, 1792):
        n = 20 if dev == "cpu" else 4100
        gs = k if group_size == -1 else group_size
        qw, s, z = _int_weight(n, k, bits, gs, dev)
        x = torch.randn(1, k, device=dev) * 3
        bias = torch.randn(n, device=dev)
        y = quant.int_gemv(x, qw, s, z, bits, gs, bias, block_n=block_n, num_warps=num_warps)
        _check(y, x @ quant.dequant_int_ref(qw, s, z, bits, gs).t() + bias, torch.float32)


@pytest.mark.parametrize("kind", DEVICES)
@pytest.mark.parametrize("act", ["token", "tensor", None, "group"])
@pytest.mark.parametrize("block_n, block_k, fma", [(2, 256, False), (4, 512, False), (8, 1024, False), (2, 256, True),
                                                   (8, 512, True), (32, 512, True)])
def test_fp8_gemv_configs(kind, act, block_n, block_k, fma):
    """The FP8 GEMV at the launch configs the sweep tries: K over several chunks, evenly
    and not (1000: a masked last chunk and slices), N not a multiple of block_n; block
    scales (their columns, 32 or 64: the slice for per-group activations; K = 1088, a whole
    number of groups) and per-row ones; K in at most two chunks (loaded before the amax)
    and in more (the pipelined loop; the CUDA-core kernel's unrolled chunks). ``fma``: the
    CUDA-core kernel (per-row scales; block scales keep the tensor-core one), whose sums are
    float32 ones of exact products: the float32 bound on the GPU too."""
    if fma and act == "group" and kind == "cpu":
        pytest.skip("block scales keep the tensor-core kernel: its own parametrizations run it")
    dev = _dev(kind)
    for k in (2048, 1088 if act == "group" else 1000):
        n = 24 if dev == "cpu" else 4104
        bk = max(32, block_k // 16)  # per-group activations: slices of the block's columns
        block = (8, bk) if act == "group" else None
        w, ws = _fp8_weight(-(-n // 8) * 8, -(-k // bk) * bk, dev, block)
        w = w[:n, :k].contiguous()
        if block is None:
            ws = ws[:n]
        x = torch.randn(1, k, device=dev) * 3
        bias = torch.randn(n, device=dev)
        static = x.abs().amax().reshape(1) / 448.0 * 1.5 if act == "tensor" else None
        y = quant.fp8_gemv(x, w, ws, block, bias, act, static, block_n=block_n, block_k=block_k, fma=fma)
        xr = x if act is None else _ref_act(x, group=bk if act == "group" else None, static=static)
        dense = dequantize_fp8(w, ws, block)
        # float32 x with act None stays float32 through the dot (no TF32): 1e-5; quantized
        # activations take the FP8 MMA, whose accumulator is narrower on the GPU
        tol = FP8_MMA_TOL if act is not None and dev == "cuda" and (block is not None or not fma) else None
        _check(y, xr @ dense.t() + bias, torch.float32, tol)


@pytest.mark.parametrize("kind", DEVICES)
@pytest.mark.parametrize("bits, group_size", [(4, 128), (8, 32), (4, 16)])
@pytest.mark.parametrize("block_n, num_warps, split_k, prefetch",
                         [(4, 1, 2, False), (8, 1, 1, True), (16, 1, 2, True), (8, 1, 3, False), (16, 2, 2, False)])
def test_int_gemv_split_k_and_prefetch(kind, bits, group_size, block_n, num_warps, split_k, prefetch):
    """The int GEMV's split-K (float32 partials, the sum pass) and prefetch variants against
    the dequantized reference: K in several chunks (7168 at 4 bits, 1 warp: seven 128-word
    chunks; 8 bits: 14; 16-value groups: 64-word chunks) split evenly and not (a shorter
    last split), and in few (1792: two chunks at 4 bits, 3.5 at 8, a masked last one;
    4096 and 14336 on the GPU: o_proj's and down_proj's K), N not a multiple of block_n,
    with a bias; float32 (1e-5) and bf16 (1e-2) activations; the same bits on a second call
    (the sum pass adds the splits in a fixed order). A K the config cannot split is refused."""
    dev = _dev(kind)
    checked = 0
    for k in ((7168, 1792) if dev == "cpu" else (4096, 14336)):
        n = 20 if dev == "cpu" else 4100
        qw, s, z = _int_weight(n, k, bits, group_size, dev)
        kw = k * bits // 32
        cw = next(c for c in (4, 2, 1) if group_size % (c * 32 // bits) == 0)  # the words a thread takes
        chunks = -(-kw // (32 * num_warps * cw))
        per = -(-chunks // split_k)
        if (split_k - 1) * per >= chunks or (prefetch and per < 2):  # not this K's config: refused
            with pytest.raises(ValueError, match="split_k .* leaves a split without work|prefetch needs"):
                quant.int_gemv(torch.ones(1, k, device=dev), qw, s, z, bits, group_size, block_n=block_n,
                               num_warps=num_warps, split_k=split_k, prefetch=prefetch)
            continue
        for dtype in _dtypes(dev)[:1 if checked and dev == "cpu" else None]:  # CPU: bf16 at the first K only
            x = (torch.randn(1, k, device=dev) * 3).to(dtype)
            bias = torch.randn(n, device=dev).to(dtype)
            sd, zd = s.to(dtype), z.to(dtype)
            y = quant.int_gemv(x, qw, sd, zd, bits, group_size, bias, block_n=block_n, num_warps=num_warps,
                               split_k=split_k, prefetch=prefetch)
            assert y.shape == (1, n) and y.dtype == dtype
            _check(y, x.float() @ quant.dequant_int_ref(qw, sd, zd, bits, group_size).t() + bias.float(), dtype)
            again = quant.int_gemv(x, qw, sd, zd, bits, group_size, bias, block_n=block_n, num_warps=num_warps,
                                   split_k=split_k, prefetch=prefetch)
            assert torch.equal(y, again)
            checked += 1
    assert checked  # every parametrization runs on at least one K


@pytest.mark.parametrize("kind", DEVICES)
@pytest.mark.parametrize("bits, group_size", [(4, 128), (8, 32), (4, 16)])
@pytest.mark.parametrize("block_n, num_warps, persistent, vec, stages", [(4, 1, 2, 0, 1), (8, 2, 3, 8, 1), (4, 1, 1, 2, 1),
                                                                       (16, 4, 4, 0, 1), (4, 1, 2, 0, 3), (8, 4, 4, 0, 4)])
def test_int_gemv_persistent(kind, bits, group_size, block_n, num_warps, persistent, vec, stages):
    """The persistent programs (``_int_gemv_stream_kernel``: a program walks blocks of rows,
    the next block's words loaded before the current products) against the dequantized
    reference: fewer programs than blocks (on the CPU ``persistent`` is the grid: 5 blocks
    of 4 rows over 2 or 1 programs, the last block part-masked), K in one chunk and in
    several with a masked last one, ``vec`` words a thread (8: twice the default; refused
    where a group cannot hold them), the register prefetch and the shared-memory pipeline
    (``stages``), float32 (1e-5) and bf16 activations, a bias; on the GPU the f16x2
    products too (bf16 and fp16: the 1e-2 bound)."""
    dev = _dev(kind)
    if dev == "cuda" and group_size == 16:
        pytest.skip("two words a thread: the CPU's cases (the GPU's compiles are the step's time)")
    n = 18 if dev == "cpu" else 4100
    for k in ((512, 1792) if dev == "cpu" else (4096, 14336)):
        qw, s, z = _int_weight(n, k, bits, group_size, dev)
        per = 32 // bits
        if vec and (group_size % (vec * per) or (k // per) % vec):
            with pytest.raises(ValueError, match=f"vec {vec}"):
                quant.int_gemv(torch.ones(1, k, device=dev), qw, s, z, bits, group_size, block_n=block_n,
                               num_warps=num_warps, persistent=persistent, vec=vec)
            continue
        for dtype in (_dtypes(dev) if dev == "cpu" else [torch.bfloat16]):  # fp16: test_int4_gemv_half2
            x = (torch.randn(1, k, device=dev) * 3).to(dtype)
            bias = torch.randn(n, device=dev).to(dtype)
            sd, zd = s.to(dtype), z.to(dtype)
            ref = x.float() @ quant.dequant_int_ref(qw, sd, zd, bits, group_size).t() + bias.float()
            for half2 in ((False, True) if dev == "cuda" else (False,)):
                y = quant.int_gemv(x, qw, sd, zd, bits, group_size, bias, block_n=block_n, num_warps=num_warps,
                                   persistent=persistent, vec=vec, half2=half2, stages=stages)
                assert y.shape == (1, n) and y.dtype == dtype
                _check(y, ref, dtype)


@pytest.mark.parametrize("kind", DEVICES)
@pytest.mark.parametrize("bits, group_size", [(4, 128), (8, 32), (4, 16)])
@pytest.mark.parametrize("layout", ["group_major", "row_major"])
@pytest.mark.parametrize("symmetric", [False, True])
def test_int_scale_layouts_and_symmetric_zeros(kind, bits, group_size, layout, symmetric):
    """Scales and zeros [G, N] stored group-major (contiguous) or row-major (a view of an
    [N, G] tensor: a row's groups side by side, what a GEMV's block of rows reads), and
    zeros None (symmetric: every zero point 2**(bits - 1), none read): the one-pass, split-K
    and persistent GEMVs and the GEMM against the dequantized reference of the same values;
    float32 activations (the 1e-5 bound), and on the GPU bf16 ones through the f16x2 path."""
    dev = _dev(kind)
    n, k = (20, 2048) if dev == "cpu" else (4100, 4096)
    qw, s, z = _int_weight(n, k, bits, group_size, dev)
    if symmetric:
        z = None
    if layout == "row_major":
        s = s.t().contiguous().t()
        z = z.t().contiguous().t() if z is not None else None
    x = torch.randn(1, k, device=dev) * 3
    bias = torch.randn(n, device=dev)
    dense = quant.dequant_int_ref(qw, s, z, bits, group_size)
    if symmetric:  # the reference's zero points: the constant
        assert torch.equal(dense, quant.dequant_int_ref(qw, s, torch.full_like(s, 1 << (bits - 1)), bits, group_size))
    ref = x @ dense.t() + bias
    for kw in ({}, {"block_n": 4, "num_warps": 1, "split_k": 2}, {"block_n": 4, "num_warps": 1, "persistent": 2},
               {"block_n": 4, "num_warps": 1, "persistent": 2, "stages": 3}):
        _check(quant.int_gemv(x, qw, s, z, bits, group_size, bias, **kw), ref, torch.float32)
        if dev == "cuda" and bits == 4:  # the f16x2 products on these forms too
            xb = x.to(torch.bfloat16)
            _check(quant.int_gemv(xb, qw, s, z, bits, group_size, bias.to(torch.bfloat16), half2=True, **kw),
                   xb.float() @ dense.t() + bias.to(torch.bfloat16).float(), torch.bfloat16)
    xm = torch.randn(5, k, device=dev)
    _check(quant.int_gemm(xm, qw, s, z, bits, group_size, bias), xm @ dense.t() + bias, torch.float32)


def test_int_zeros_must_match_the_scales_layout():
    qw = torch.zeros(8, 256, dtype=torch.int32)
    s = torch.ones(16, 8)
    with pytest.raises(ValueError, match="zeros .* must match the scales"):
        quant.int_gemv(torch.ones(1, 2048), qw, s, s.t().contiguous().t(), 4, 128)


def test_int_gemv_persistent_refuses_split_and_prefetch():
    qw = torch.zeros(8, 256, dtype=torch.int32)
    s = torch.ones(16, 8)
    for kw in ({"split_k": 2}, {"prefetch": True}):
        with pytest.raises(ValueError, match="persistent programs take neither"):
            quant.int_gemv(torch.ones(1, 2048), qw, s, s, 4, 128, block_n=4, num_warps=1, persistent=2, **kw)
    with pytest.raises(ValueError, match="stages 3 needs persistent programs"):
        quant.int_gemv(torch.ones(1, 2048), qw, s, s, 4, 128, block_n=4, num_warps=1, stages=3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, group_size", [(torch.bfloat16, 128), (torch.float16, 128), (torch.bfloat16, 8)])
@pytest.mark.parametrize("block_n, num_warps, split_k, prefetch, persistent",
                         [(16, 4, 1, False, 0), (32, 4, 1, False, 0), (16, 2, 1, True, 0), (8, 1, 2, False, 0),
                          (8, 4, 1, False, 3)])
def test_int4_gemv_half2(monkeypatch, dtype, group_size, block_n, num_warps, split_k, prefetch, persistent):
    """The f16x2 path (``half2``) against the dequantized float32 reference, at bf16/fp16
    tolerance: K of o_proj / down_proj and a masked last chunk (1792 at 4 warps), N not a
    multiple of block_n, groups of 128 (four words a thread) and 8 values (one), with
    activations whose magnitudes span 2**-20 to 2**13 among one
    thread's values (each thread's own power-of-two scaling keeps f16 in range: a wrong
    scale overflows or flushes); the persistent programs too (one chunk a block: the
    activations prepared once); and it is the path that ran (not bit-equal to the float32
    FMAs' output)."""
    if not torch.cuda.is_available() or INTERPRET:
        pytest.skip("needs CUDA")
    seen = []
    name = "_int_gemv_stream_kernel" if persistent else "_int_gemv_kernel"
    kernel = getattr(quant, name)

    class Spy:
        def __getitem__(self, grid):
            def launch(*a, **kw):
                seen.append(kw["HALF2"])
                return kernel[grid](*a, **kw)
            return launch

    monkeypatch.setattr(quant, name, Spy())
    g = torch.Generator(device="cpu").manual_seed(group_size + block_n)
    for k in (4096, 14336, 1792):
        n = 4100
        qw, s, z = _int_weight(n, k, 4, group_size, "cuda")
        sd, zd = s.to(dtype), z.to(dtype)
        mag = 2.0 ** torch.randint(-20, 14 if dtype == torch.bfloat16 else 11, (1, k), generator=g)
        x = (torch.randn(1, k, generator=g) * mag).to(dtype).cuda()
        bias = torch.randn(n, device="cuda").to(dtype)
        ref = x.float() @ quant.dequant_int_ref(qw, sd, zd, 4, group_size).t() + bias.float()
        kw = dict(block_n=block_n, num_warps=num_warps, split_k=split_k, prefetch=prefetch, persistent=persistent)
        if prefetch and k == 1792:
            continue  # one chunk a program: refused (test_int_gemv_split_k_and_prefetch)
        y = quant.int_gemv(x, qw, sd, zd, 4, group_size, bias, half2=True, **kw)
        exact = quant.int_gemv(x, qw, sd, zd, 4, group_size, bias, half2=False, **kw)
        assert seen[-2:] == [True, False]
        _check(y, ref, dtype)
        _check(exact, ref, dtype)
        assert not torch.equal(y, exact)
        assert torch.equal(y, quant.int_gemv(x, qw, sd, zd, 4, group_size, bias, half2=True, **kw))


@pytest.mark.parametrize("kind", DEVICES)
@pytest.mark.parametrize("act", ["token", "tensor", None, "group"])
@pytest.mark.parametrize("block_n, block_k, split_k, fma", [(2, 256, 2, False), (8, 256, 4, False), (4, 512, 3, False),
                                                            (8, 1024, 2, False), (4, 256, 3, True), (8, 512, 2, True)])
def test_fp8_gemv_split_k(kind, act, block_n, block_k, split_k, fma):
    """The FP8 GEMV's split-K variant: each split's chunks in the preloaded form (at most two
    a split) and in the pipelined loop (more; the CUDA-core kernel's unrolled chunks with
    ``fma``), splits of equal and unequal length (the last one's chunks past K masked),
    per-row and block scales, every activation scheme, a bias added once; against the
    dequantized reference and bitwise equal on a second call. A split_k that leaves a split
    without a chunk is refused."""
    if fma and act == "group":
        pytest.skip("block scales keep the tensor-core kernel: its own parametrizations run it")
    dev = _dev(kind)
    checked = 0
    for k in (4096, 1088 if act == "group" else 1000):
        n = 24 if dev == "cpu" else 4104
        bk = max(32, block_k // 16)
        block = (8, bk) if act == "group" else None
        w, ws = _fp8_weight(-(-n // 8) * 8, -(-k // bk) * bk, dev, block)
        w = w[:n, :k].contiguous()
        if block is None:
            ws = ws[:n]
        x = torch.randn(1, k, device=dev) * 3
        bias = torch.randn(n, device=dev)
        static = x.abs().amax().reshape(1) / 448.0 * 1.5 if act == "tensor" else None
        chunks = -(-k // (16 * bk if act == "group" else block_k))
        per = -(-chunks // split_k)
        if (split_k - 1) * per >= chunks:
            with pytest.raises(ValueError, match="leaves a split without work"):
                quant.fp8_gemv(x, w, ws, block, bias, act, static, block_n=block_n, block_k=block_k, split_k=split_k,
                               fma=fma)
            continue
        y = quant.fp8_gemv(x, w, ws, block, bias, act, static, block_n=block_n, block_k=block_k, split_k=split_k,
                           fma=fma)
        xr = x if act is None else _ref_act(x, group=bk if act == "group" else None, static=static)
        tol = FP8_MMA_TOL if act is not None and dev == "cuda" and not fma else None
        _check(y, xr @ dequantize_fp8(w, ws, block).t() + bias, torch.float32, tol)
        assert torch.equal(y, quant.fp8_gemv(x, w, ws, block, bias, act, static, block_n=block_n, block_k=block_k,
                                             split_k=split_k, fma=fma))
        checked += 1
    assert checked


@pytest.mark.parametrize("kind", DEVICES)
@pytest.mark.parametrize("act", ["token", "tensor", None])
@pytest.mark.parametrize("block_n, block_k, persistent, num_stages", [(2, 256, 2, 3), (4, 512, 1, 2), (8, 1024, 4, 4)])
def test_fp8_gemv_persistent(kind, act, block_n, block_k, persistent, num_stages):
    """The persistent FP8 GEMV (``_fp8_gemv_stream_kernel``: a few programs walk the blocks
    of rows through one pipelined loop, the token's scale once a program) against the
    reference: fewer programs than blocks (on the CPU ``persistent`` is the grid), K in
    several chunks, evenly and not (1000: a masked last chunk), N not a multiple of block_n,
    each activation scheme, a bias; the one-pass kernel's bound. Block scales, split-K and
    the CUDA-core kernel are refused."""
    dev = _dev(kind)
    for k in (2048, 1000):
        n = 24 if dev == "cpu" else 4104
        w, ws = _fp8_weight(n, k, dev)
        x = torch.randn(1, k, device=dev) * 3
        bias = torch.randn(n, device=dev)
        static = x.abs().amax().reshape(1) / 448.0 * 1.5 if act == "tensor" else None
        y = quant.fp8_gemv(x, w, ws, None, bias, act, static, block_n=block_n, block_k=block_k,
                           num_stages=num_stages, persistent=persistent)
        xr = x if act is None else _ref_act(x, static=static)
        tol = FP8_MMA_TOL if act is not None and dev == "cuda" else None
        _check(y, xr @ dequantize_fp8(w, ws, None).t() + bias, torch.float32, tol)
    for kw in ({"split_k": 2}, {"fma": True}):
        with pytest.raises(ValueError, match="a persistent FP8 GEMV takes"):
            quant.fp8_gemv(x, w, ws, None, bias, act, static, block_n=block_n, block_k=block_k, persistent=2, **kw)


def test_dequant_int_ref_matches_unpack():
    """The reference's unpacking is pack_int32's inverse (so the kernel tests test something)."""
    from pyengine.layers.quantization.utils import dequantize_int, unpack_int32

    qw, s, z = _int_weight(24, 64, 4, 32, "cpu")
    q = unpack_int32(qw, 4, 1).t()
    g = torch.arange(64) // 32
    torch.testing.assert_close(quant.dequant_int_ref(qw, s, z, 4, 32), dequantize_int(q, s, z, g))


@pytest.mark.gpu
def test_kernels_capture_in_cuda_graph():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev, dtype = "cuda", torch.bfloat16
    w, ws = _fp8_weight(4096, 4096, dev)
    qw, s, z = _int_weight(4096, 4096, 4, 128, dev)
    s, z = s.to(dtype), z.to(dtype)
    for m in (1, 8):
        x = torch.randn(m, 4096, device=dev, dtype=dtype)
        eager = (quant.fp8_linear(x, w, ws, None, None, None, "token"), quant.int_linear(x, qw, s, z, 4, 128))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = (quant.fp8_linear(x, w, ws, None, None, None, "token"), quant.int_linear(x, qw, s, z, 4, 128))
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(eager, out):
            torch.testing.assert_close(a, b)


@pytest.mark.gpu
def test_split_k_gemvs_capture_in_cuda_graph():
    """The split-K GEMVs (partials buffer, sum pass), the CUDA-core FP8 GEMV and the
    prefetching int GEMV replay in a CUDA graph to the bits of their eager calls, with x
    changed between capture and replay."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev, dtype = "cuda", torch.bfloat16
    w, ws = _fp8_weight(4096, 4096, dev)
    qw, s, z = _int_weight(4096, 4096, 4, 128, dev)
    s, z = s.to(dtype), z.to(dtype)
    bias = torch.randn(4096, device=dev, dtype=dtype)
    x = torch.randn(1, 4096, device=dev, dtype=dtype)

    def calls():
        return (quant.fp8_gemv(x, w, ws, None, bias, "token", block_n=8, block_k=1024, num_stages=4, split_k=2),
                quant.fp8_gemv(x, w, ws, None, bias, "token", block_n=16, block_k=512, fma=True),
                quant.fp8_gemv(x, w, ws, None, bias, "token", block_n=8, block_k=512, split_k=2, fma=True),
                quant.int_gemv(x, qw, s, z, 4, 128, bias, block_n=16, num_warps=2, split_k=2),
                quant.int_gemv(x, qw, s, z, 4, 128, bias, block_n=16, num_warps=1, prefetch=True))
    calls()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = calls()
    x.copy_(torch.randn(1, 4096, device=dev, dtype=dtype))
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(calls(), out):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_int_gemv_default_fills_its_threads():
    """Without a swept config every thread of a chunk (32 a warp, 4 words each) has words of the
    row: 4 warps at K 4096 (int4: 512 words), 2 at 2048, 1 at 1024 and below; long rows 2."""
    from pyengine.ops.quant import int_gemv_default

    assert [int_gemv_default(4096, k)["num_warps"] for k in (512, 1024, 2048, 4096, 14336)] == [1, 1, 2, 4, 2]
    for k in (1024, 2048, 4096):
        assert 32 * int_gemv_default(4096, k)["num_warps"] * 4 <= k // 8
