"""Packed integer (INT4 / INT8, weight-only W4A16 / W8A16) expert weights in the Triton fused
MoE: group and per-channel scales, symmetric and with zero points, on every kernel path (tiles.GEMV
with the k-sum fused and not, split-K, grouped GEMM), expert parallelism, the argument checks,
and on the GPU the Qwen3-30B-A3B shape and CUDA graphs.

The contract: int32 words (``pack_int32(q, bits, dim=-1)``) with their scales and zero points
give ``fused_experts`` on the dequantized weights ``((q.float() - zero) * scale).to(hidden.dtype)``:
bit for bit under the interpreter, to the GEMMs' rounding on the GPU — except on the GEMV path
where a group is whole words (every real checkpoint's case), whose kernels take each group's
scale out of its sum (``_int_gemv_kernel``): there to float32 rounding, and in bf16 / fp16 to
the dequantized weights' own rounding (``_tol``).

CPU: ``TRITON_INTERPRET=1 pytest tests/layers/fused_moe`` (tiny shapes);
GPU: ``pytest -m gpu tests/layers/fused_moe``.
"""
from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

# triton is a test dependency on Linux (setup.py): there its absence fails, elsewhere it skips
if not sys.platform.startswith("linux") and importlib.util.find_spec("triton") is None:
    pytest.skip("triton is a test dependency on Linux only", allow_module_level=True)
import triton  # noqa: E402,F401

from pyengine.layers.fused_moe import fused_moe  # noqa: E402
from pyengine.layers.fused_moe.moe_torch import fused_experts_torch  # noqa: E402
from pyengine.layers.fused_moe.router import fused_topk  # noqa: E402
from pyengine.layers.quantization.utils import pack_int32, unpack_int32  # noqa: E402
from tests.helpers import rank_expert_map, triton_device  # noqa: E402
from tests.layers.fused_moe import tiles  # noqa: E402

_dev = triton_device


def _tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)


def _word_kernels(cfg, bits, gs):
    """Whether ``cfg`` runs the GEMV path's word kernels (``fused_moe.int_word_tile``): a GEMV
    tile and groups of whole words (per channel: K, a multiple of a word's values here)."""
    return bool(cfg and cfg.get("small_batch")) and (gs is None or gs % (32 // bits) == 0)


def _assert_dequantized_run(got, want, dtype, exact):
    """got == want bit for bit under the interpreter where ``exact``, else to ``_tol``."""
    if exact and got.device.type == "cpu":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, **_tol(dtype))


def _expand(v, gs):
    """[E, N, K / gs] group values broadcast to [E, N, K]."""
    return v.repeat_interleave(gs, 2)


def quantize(w, bits, gs, asym):
    """w [E, N, K] float32 -> (q int32 [E, N, K] unsigned, scales [E, N, K / gs], zero points
    of the scales' shape or None). Symmetric: ``scale = amax / (2**(bits-1) - 1)``, zero
    2**(bits-1); asymmetric: ``scale = (max - min) / (2**bits - 1)``, zero ``round(-min /
    scale)``, both per group of gs columns."""
    e, n, k = w.shape
    wg = w.float().view(e, n, k // gs, gs)
    top = 2 ** bits - 1
    tiny = torch.finfo(torch.float32).tiny
    if asym:
        lo, hi = wg.amin(-1), wg.amax(-1)
        scale = ((hi - lo) / top).clamp(min=tiny)
        zero = (-lo / scale).round().clamp(0, top)
    else:
        scale = (wg.abs().amax(-1) / (2 ** (bits - 1) - 1)).clamp(min=tiny)
        zero = torch.full_like(scale, 2 ** (bits - 1))
    q = (w.float() / _expand(scale, gs)).round() + _expand(zero, gs)
    return q.clamp(0, top).to(torch.int32), scale.contiguous(), (zero.contiguous() if asym else None)


def dequantize(q, scale, zero, bits, gs, dtype):
    """The contract's dequantized weight: ``((q.float() - zero) * scale).to(dtype)``."""
    z = _expand(zero, gs) if zero is not None else 2.0 ** (bits - 1)
    return ((q.float() - z) * _expand(scale, gs)).to(dtype)


class Problem:
    """Activations, routing and int-quantized expert weights: ``q13`` / ``q2`` the packed words,
    ``kw`` their ``fused_experts`` arguments, ``d13`` / ``d2`` the dequantized weights."""

    def __init__(self, t, e, h, inter, k, dtype, dev, bits, gs, asym, seed=0):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(t, h, generator=g)
        w13 = (torch.randn(e, 2 * inter, h, generator=g) / h ** 0.5).to(dev)
        w2 = (torch.randn(e, h, inter, generator=g) / inter ** 0.5).to(dev)
        self.w, self.ids = (v.to(dev) for v in fused_topk(torch.randn(t, e, generator=g), k, renormalize=True))
        self.x = x.to(dev, dtype)
        g13, g2 = gs or h, gs or inter  # None: per output channel
        q13, self.s13, self.z13 = quantize(w13, bits, g13, asym)
        q2, self.s2, self.z2 = quantize(w2, bits, g2, asym)
        self.d13 = dequantize(q13, self.s13, self.z13, bits, g13, dtype)
        self.d2 = dequantize(q2, self.s2, self.z2, bits, g2, dtype)
        self.q13, self.q2 = pack_int32(q13, bits, dim=-1), pack_int32(q2, bits, dim=-1)
        assert torch.equal(unpack_int32(self.q13, bits, dim=-1), q13)
        self.kw = dict(w13_scale=self.s13, w2_scale=self.s2, w13_zp=self.z13, w2_zp=self.z2,
                       block_shape=(1, gs) if gs else None, weight_bits=bits)

    def run(self, **kw):
        return fused_moe.fused_experts(self.x, self.q13, self.q2, self.w, self.ids, **{**self.kw, **kw})

    def want(self, **kw):
        return fused_moe.fused_experts(self.x, self.d13, self.d2, self.w, self.ids, **kw)



# (bits, zero points, group size (None: per channel), hidden, intermediate). The kernels take
# a K chunk's scales as one row where BLOCK_SIZE_K divides the group (per channel at K 48
# with 16-column chunks; 16 at 64 / 32), one a word where the group is whole words (8, 16,
# 24, 32; int8's 12) and one a value where a word's values span groups (int4's 12, int8's 6).
QUANTS = [(4, False, None, 48, 24), (4, True, 8, 48, 24), (4, True, 12, 48, 24), (4, False, 24, 48, 24),
          (4, True, 16, 64, 32), (8, True, None, 48, 24), (8, False, 12, 48, 24), (8, True, 6, 48, 24),
          (8, False, 32, 64, 32)]
QUANT_IDS = [f"int{b}-{'asym' if z else 'sym'}-{'channel' if g is None else f'g{g}'}" + ("" if h == 48 else f"-h{h}")
             for b, z, g, h, _ in QUANTS]


@pytest.mark.parametrize("kind", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("quant", QUANTS, ids=QUANT_IDS)
@pytest.mark.parametrize("cfg,t", tiles.CONFIGS, ids=tiles.CONFIG_IDS)
def test_int_is_the_dequantized_weights_run(kind, dtype, quant, cfg, t):
    """Packed integer weights with their scales (and zero points) == the same call on the
    dequantized weights (bit for bit under the interpreter: the same values summed in the same
    order), and close to the torch path on them."""
    bits, asym, gs, h, inter = quant
    p = Problem(t, 8, h, inter, 2, dtype, _dev(kind), bits, gs, asym)
    got = p.run(config=cfg)
    want = p.want(config=cfg)
    assert got.dtype == dtype and got.shape == p.x.shape
    _assert_dequantized_run(got, want, dtype, not _word_kernels(cfg, bits, gs))
    torch.testing.assert_close(got, fused_experts_torch(p.x, p.d13, p.d2, p.w, p.ids), **_tol(dtype))


@pytest.mark.parametrize("kind", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("case", ["fp16", "mixtral-weights", "channel-scale-e-n", "strided-scales", "small-block-k",
                                  "default-config"])
def test_int_variants(kind, case):
    """fp16 activations; float32 routing products (``cast_weights=False``); per-channel scales
    and zero points as [E, N]; scales of other strides than their zero points; a tiles.GEMV
    BLOCK_SIZE_K under a word's values (chunks widened to a word); the default tile config at
    40 tokens (grouped GEMM)."""
    dtype = torch.float16 if case == "fp16" else torch.bfloat16
    t = 40 if case == "default-config" else 3
    gs = None if case == "channel-scale-e-n" else 8
    p = Problem(t, 8, 48, 24, 2, dtype, _dev(kind), 4, gs, True, seed=2)
    cfg = {"default-config": None, "small-block-k": {**tiles.GEMV, "BLOCK_SIZE_K": 4}}.get(case, tiles.GEMV_UNFUSED)
    kw = dict(config=cfg, cast_weights=case != "mixtral-weights")
    if case == "channel-scale-e-n":
        kw.update(w13_scale=p.s13[..., 0], w2_scale=p.s2[..., 0], w13_zp=p.z13[..., 0], w2_zp=p.z2[..., 0])
    elif case == "strided-scales":
        kw.update(w13_scale=p.s13.transpose(1, 2).contiguous().transpose(1, 2))
    got = p.run(**kw)
    want = p.want(config=cfg, cast_weights=kw["cast_weights"])
    _assert_dequantized_run(got, want, dtype, not _word_kernels(cfg, 4, gs))


@pytest.mark.parametrize("kind", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("quant", [(4, True, 8), (8, False, None)], ids=["int4-asym-g8", "int8-sym-channel"])
@pytest.mark.parametrize("cfg", [tiles.GROUPED, tiles.GEMV, tiles.GEMV_UNFUSED, {**tiles.GEMV, "BLOCK_SIZE_K": 8, "SPLIT_K": 2}],
                         ids=["grouped", "gemv", "gemv-unfused", "split-k"])
def test_int_expert_map(kind, quant, cfg):
    """Rank r of 2 under expert parallelism holds experts 4r..4r+3 and their words, scales and
    zero points: each rank's result is its dequantized weights' (other ranks' experts add
    nothing), and the two add up to the whole."""
    bits, asym, gs = quant
    dev = _dev(kind)
    p = Problem(9, 8, 32, 16, 3, torch.float32, dev, bits, gs, asym, seed=1)
    parts = []
    for r in range(2):
        emap = rank_expert_map(r, 8, 2, dev)
        local = slice(4 * r, 4 * r + 4)
        kw = {key: v[local].contiguous() if isinstance(v, torch.Tensor) else v for key, v in p.kw.items()}
        got = fused_moe.fused_experts(p.x, p.q13[local].contiguous(), p.q2[local].contiguous(), p.w, p.ids,
                                      expert_map=emap, config=cfg, **kw)
        want = fused_moe.fused_experts(p.x, p.d13[local].contiguous(), p.d2[local].contiguous(), p.w, p.ids,
                                       expert_map=emap, config=cfg)
        _assert_dequantized_run(got, want, torch.float32, not _word_kernels(cfg, bits, gs))
        parts.append(got)
    torch.testing.assert_close(parts[0] + parts[1], fused_experts_torch(p.x, p.d13, p.d2, p.w, p.ids),
                               **_tol(torch.float32))


def _refusal_inputs():
    p = Problem(2, 4, 32, 16, 2, torch.bfloat16, "cpu", 4, 8, True)
    q8 = Problem(2, 4, 32, 16, 2, torch.bfloat16, "cpu", 8, 8, True)
    return dict(p=p, q8_13=q8.q13, f13=p.d13, f2=p.d2, fp8_2=p.d2.to(torch.float8_e4m3fn))


@pytest.mark.parametrize("args, word", [
    (lambda d: dict(weight_bits=None), r"int32 expert weights take weight_bits 4 or 8 .*got None"),
    (lambda d: dict(weight_bits=3), r"int32 expert weights take weight_bits 4 or 8 .*got 3"),
    (lambda d: dict(w13=d["f13"], w2=d["f2"], w13_scale=None, w2_scale=None, w13_zp=None, w2_zp=None,
                    block_shape=None),
     "weight_bits given for w13 of torch.bfloat16 and w2 of torch.bfloat16: it goes with int32"),
    (lambda d: dict(w2=d["f2"]), r"w13 is torch.int32, w2 torch.bfloat16: packed integer \(int32\) expert weights "
                                 "are both w13 and w2 or neither"),
    (lambda d: dict(w2=d["fp8_2"]), "w13 is torch.int32, w2 torch.float8_e4m3fn"),
    (lambda d: dict(w13=d["p"].q13.to(torch.int8)), "w13 is torch.int8: integer expert weights must be int32 words"),
    (lambda d: dict(w13=d["f13"], w2=d["f2"], w13_scale=None, w2_scale=None, w2_zp=None, block_shape=None,
                    weight_bits=None),
     "w13_zp given for w13 of dtype torch.bfloat16: zero points go with int32"),
    (lambda d: dict(w2_scale=None), r"w2 is int32 \(4-bit\): w2_scale \(float32\) is required"),
    (lambda d: dict(w13_scale=d["p"].s13.double()), "w13_scale must be float32, got torch.float64"),
    (lambda d: dict(w2_zp=d["p"].z2.to(torch.int32)), "w2_zp must be float32, got torch.int32"),
    (lambda d: dict(w13_scale=d["p"].s13[:, :, :2]),
     r"w13_scale \(per group of 8\) must have shape \[4, 32, 4\] for w13 of shape \[4, 32, 4\], got \[4, 32, 2\]"),
    (lambda d: dict(w2_zp=d["p"].z2[:, :-1]),
     r"w2_zp \(per group of 8\) must have shape \[4, 32, 2\] for w2 of shape \[4, 32, 2\], got \[4, 31, 2\]"),
    (lambda d: dict(block_shape=None),
     r"w13_scale \(per output channel\) must have shape \[4, 32, 1\] for w13 of shape \[4, 32, 4\]"),
    (lambda d: dict(block_shape=(8, 8)), r"block_shape of integer weights is \(1, group_size\), got \(8, 8\)"),
    (lambda d: dict(block_shape=(1, 0)), "block_shape must be two positive integers"),
    (lambda d: dict(block_shape=(1, 32)),
     r"group size 32 \(block_shape\) must divide both the hidden size 32 \(w13's K\) and the intermediate size 16"),
    (lambda d: dict(w13=d["q8_13"]), r"4-bit expert weights are packed 8 a word along K: w13 \[E, 2 \* I, H / 8\] "
                                     r"and w2 \[E, H, I / 8\].*got w13 \[4, 32, 8\], w2 \[4, 32, 2\]"),
    (lambda d: dict(x=d["p"].x.double()), "integer expert weights take bf16, fp16 or float32 activations"),
    (lambda d: dict(w13_zp=d["p"].z13.to("meta")), "w13_zp is on meta, w13 on cpu"),
    (lambda d: dict(w2=d["p"].q2.to("meta")), "w2 is on meta, hidden on cpu"),
])
def test_int_refusals(args, word):
    """Checked before any launch (no device needed), zero tokens included."""
    d = _refusal_inputs()
    p = d["p"]
    for t in (2, 0):
        kw = {**p.kw, "w13": p.q13, "w2": p.q2, **args(d)}
        x = kw.pop("x", p.x)
        with pytest.raises(ValueError, match=word):
            fused_moe.fused_experts(x[:t], kw.pop("w13"), kw.pop("w2"), p.w[:t], p.ids[:t], config=tiles.GEMV, **kw)
    with pytest.raises(ValueError, match="BLOCK_SIZE_K 4 is not whole int32 words of 4-bit weights"):
        p.run(config={**tiles.GROUPED, "w2": {"BLOCK_SIZE_K": 4}})


def test_grouped_tile_bytes_int():
    """The grouped pass's shared-memory model for packed integer weights: bits / 8 bytes a
    weight a stage, their scales (and zero points) a row a stage, one a word, or one a weight
    where a word's values span groups; the dequantized tiles held for ``tl.dot``."""
    a, fixed = 64 * 64 * 2, 2 * 64 * 128 * 2
    assert fused_moe.grouped_tile_bytes(64, 128, 64, True, 2, 4, True, True, 4, True, 128) == (
        a + 2 * 64 * 128 // 2 + 2 * 2 * 4 * 128, fixed)
    assert fused_moe.grouped_tile_bytes(64, 128, 64, True, 2, 4, True, False, 4, False, 32) == (
        a + 2 * 64 * 128 // 2 + 2 * 4 * 8 * 128, fixed)
    assert fused_moe.grouped_tile_bytes(64, 128, 64, False, 2, 4, True, False, 8, True, 6) == (
        a + 64 * 128 + 2 * 4 * 64 * 128, fixed // 2)


# ---- GPU ---------------------------------------------------------------------------------

GPU_QUANTS = [(4, True, 128), (4, False, 128), (8, False, None)]
GPU_QUANT_IDS = ["int4-asym-g128", "int4-sym-g128", "int8-sym-channel"]


@pytest.mark.gpu
@pytest.mark.parametrize("quant", GPU_QUANTS, ids=GPU_QUANT_IDS)
@pytest.mark.parametrize("t", [1, 64, 512])
def test_gpu_int_qwen3_30b_a3b_shape(quant, t):
    """bf16 activations, packed integer weights at the Qwen3-30B-A3B expert shape (128
    experts, top-8, H 2048, I 768) with the shipped tile configs: the dequantized weights' run
    to bf16 tolerance (the same values into the same FMA loops / tl.dot), and the float32
    torch path on the dequantized weights."""
    bits, asym, gs = quant
    p = Problem(t, 128, 2048, 768, 8, torch.bfloat16, _dev("cuda"), bits, gs, asym)
    table = fused_moe.load_tile_configs(128, 768)
    got = p.run(tile_configs=table)
    want = p.want(tile_configs=table)
    torch.testing.assert_close(got, want, **_tol(torch.bfloat16))
    assert float((got != want).float().mean()) < 0.1
    ref = fused_experts_torch(p.x.float(), p.d13.float(), p.d2.float(), p.w, p.ids)
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("quant", GPU_QUANTS, ids=GPU_QUANT_IDS)
@pytest.mark.parametrize("cfg", [tiles.GEMV, tiles.GROUPED, None, {**tiles.GEMV, "SPLIT_K": 2}],
                         ids=["gemv", "grouped", "default", "split-k"])
def test_gpu_int_cuda_graph_replay(quant, cfg):
    """Captured once, replayed with new routing and activations: no host sync on the integer
    path, results follow the inputs."""
    bits, asym, gs = quant
    p = Problem(4, 16, 256, 128, 2, torch.bfloat16, _dev("cuda"), bits, gs, asym)
    p.run(config=cfg)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = p.run(config=cfg)
    new = Problem(4, 16, 256, 128, 2, torch.bfloat16, "cuda", bits, gs, asym, seed=5)
    p.x.copy_(new.x)
    p.w.copy_(new.w)
    p.ids.copy_(new.ids)
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, p.want(config=cfg), **_tol(torch.bfloat16))


def test_word_tile_where_groups_are_whole_words():
    """The GEMV path's word kernels take groups of whole words (a thread's 16-byte load in one
    group where it fits); the rest the general kernels."""
    s = torch.ones(128, 1536, 16)
    t = fused_moe.int_word_tile(2048, 512, 4, (1, 128), s, None)  # Qwen3-30B-A3B's GPTQ w13
    assert (t["C"], t["CW"], t["GS"], t["BITS"], t["ZP"]) == (16, 4, 128, 4, 8.0)
    assert fused_moe.int_word_tile(2048, 512, 4, (1, 128), s, s.clone())["ZP"] == 0.0  # zero points loaded
    assert fused_moe.int_word_tile(48, 32, 4, (1, 16), s, None)["CW"] == 2  # a 16-value group: two words a thread
    assert fused_moe.int_word_tile(48, 16, 8, (1, 48), s, None)["CW"] == 4
    assert fused_moe.int_word_tile(48, 32, 4, (1, 12), s, None) is None  # a word's values span groups
    assert fused_moe.int_word_tile(48, 32, None, None, s, None) is None


@pytest.mark.parametrize("bits", [4, 8])
def test_int_defaults_are_word_tiles(bits):
    """Without a table of their own, integer experts at batch 1 get the word kernels' tiles at
    real shapes (Qwen3-30B-A3B, Mixtral): gate/up in chunks of 128 words (32 threads of 4), down
    in chunks of 64 split in two."""
    for e, inter, h, k in ((128, 768, 2048, 8), (8, 14336, 4096, 2)):
        cfg = fused_moe.get_default_config(1, e, inter, h, k, weight_bits=bits)
        assert cfg["small_batch"] and cfg != fused_moe.get_default_config(1, e, inter, h, k)
        s = torch.ones(e, 2 * inter, h // 128)
        for which, kdim in (("w13", h), ("w2", inter)):
            c = fused_moe.pass_config(cfg, which)
            t = fused_moe.int_word_tile(kdim, fused_moe._gemv_block_k(c, kdim, bits), bits, (1, 128), s, None)
            assert t is not None and (t["C"], t["CW"]) == ((32, 4) if which == "w13" else (16, 4)), (which, t)
        assert fused_moe.pass_config(cfg, "w2")["SPLIT_K"] == 2
    assert "SPLIT_K" not in fused_moe.get_default_config(1, 8, 24, 48, 2, weight_bits=bits)["w2"]  # one chunk
    assert not fused_moe.get_default_config(64, 128, 768, 2048, 8, weight_bits=bits).get("small_batch")
