"""FP8 (e4m3) expert weights in the Triton fused MoE (weight-only, W8A16): per-channel and
block scales on every kernel path (tiles.GEMV with the k-sum fused and not, split-K, grouped GEMM),
expert parallelism, the argument checks, and on the GPU the Qwen3-30B-A3B shape and CUDA
graphs.

The contract: FP8 weights with their scales give ``fused_experts`` on the dequantized
weights ``(w.float() * scale).to(hidden.dtype)``: bit for bit under the interpreter, to the
GEMMs' rounding on the GPU.

CPU: ``TRITON_INTERPRET=1 pytest tests/layers/fused_moe`` (tiny shapes);
GPU: ``pytest -m gpu tests/layers/fused_moe``.
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

from pyengine.layers.fused_moe import fused_moe  # noqa: E402
from pyengine.layers.fused_moe.moe_torch import fused_experts_torch  # noqa: E402
from pyengine.layers.fused_moe.router import fused_topk  # noqa: E402
from tests.helpers import rank_expert_map, triton_device  # noqa: E402
from tests.layers.fused_moe import tiles  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


_dev = triton_device


def _tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)


def _problem(t, e, h, inter, k, dev, seed=0):
    """float32 activations and weights (quantized by the caller), routing."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * inter, h, generator=g) / h ** 0.5
    w2 = torch.randn(e, h, inter, generator=g) / inter ** 0.5
    w, ids = fused_topk(torch.randn(t, e, generator=g), k, renormalize=True)
    return [v.to(dev) for v in (x, w13, w2, w, ids)]


def _expand(scale, block, shape):
    """Scales broadcast to a weight of ``shape`` [E, N, K]: per row [E, N] or blocks."""
    if block is None:
        return scale[..., None]
    n, k = shape[1:]
    return scale.repeat_interleave(block[0], 1)[:, :n].repeat_interleave(block[1], 2)[:, :, :k]


def quantize(w, block=None):
    """w [E, N, K] -> (FP8 [E, N, K], float32 scales [E, N] or [E, ceil(N/bn), ceil(K/bk)]):
    ``scale = amax / 448`` over each row or block (the float32 tiny for an all-zero one),
    ``w / scale`` rounded to e4m3."""
    wf = w.float()
    if block is None:
        amax = wf.abs().amax(dim=2)
    else:
        e, n, k = wf.shape
        bn, bk = block
        nb, kb = -(-n // bn), -(-k // bk)
        padded = torch.zeros(e, nb * bn, kb * bk, dtype=torch.float32, device=w.device)
        padded[:, :n, :k] = wf
        amax = padded.view(e, nb, bn, kb, bk).abs().amax(dim=(2, 4))
    scale = (amax / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny).contiguous()
    q = (wf / _expand(scale, block, wf.shape)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize(q, scale, block, dtype):
    """The contract's dequantized weight: ``(q.float() * scale).to(dtype)``."""
    return (q.float() * _expand(scale, block, q.shape)).to(dtype)


def _fp8_problem(t, e, h, inter, k, dtype, dev, block, seed=0):
    x, w13, w2, w, ids = _problem(t, e, h, inter, k, dev, seed)
    q13, s13 = quantize(w13, block)
    q2, s2 = quantize(w2, block)
    return x.to(dtype), q13, s13, q2, s2, w, ids



# per channel; 16 x 16 blocks (BLOCK_SIZE_K 16 inside one block's columns, 32 across two;
# the gate/up boundary at row I = 24 inside a block; w2's 24 columns: a partial block);
# 32 x 8 blocks (row blocks that never divide 48; every BLOCK_SIZE_K spans several column blocks)
SCHEMES = [None, (16, 16), (32, 8)]


@pytest.mark.parametrize("kind", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("block", SCHEMES, ids=["channel", "block16x16", "block32x8"])
@pytest.mark.parametrize("cfg,t", tiles.CONFIGS, ids=tiles.CONFIG_IDS)
def test_fp8_is_the_dequantized_weights_run(kind, dtype, block, cfg, t):
    """FP8 weights with their scales == the same call on the dequantized weights (bit for bit
    under the interpreter: the same values summed in the same order), and close to the torch
    path on them."""
    dev = _dev(kind)
    x, q13, s13, q2, s2, w, ids = _fp8_problem(t, 8, 48, 24, 2, dtype, dev, block)
    d13, d2 = dequantize(q13, s13, block, dtype), dequantize(q2, s2, block, dtype)
    got = fused_moe.fused_experts(x, q13, q2, w, ids, config=cfg, w13_scale=s13, w2_scale=s2, block_shape=block)
    want = fused_moe.fused_experts(x, d13, d2, w, ids, config=cfg)
    assert got.dtype == dtype and got.shape == x.shape
    if dev == "cpu":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, **_tol(dtype))
    torch.testing.assert_close(got, fused_experts_torch(x, d13, d2, w, ids), **_tol(dtype))


@pytest.mark.parametrize("kind", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("case", ["fp16", "mixtral-weights", "w13-only", "scale-e-n-1", "default-config"])
def test_fp8_variants(kind, case):
    """fp16 activations; float32 routing products (``cast_weights=False``); FP8 gate/up with a
    bf16 down projection; per-channel scales in vLLM's [E, N, 1] layout; the default tile
    config at 40 tokens (grouped GEMM)."""
    dev = _dev(kind)
    dtype = torch.float16 if case == "fp16" else torch.bfloat16
    t = 40 if case == "default-config" else 3
    block = (16, 16) if case == "default-config" else None
    x, q13, s13, q2, s2, w, ids = _fp8_problem(t, 8, 48, 24, 2, dtype, dev, block, seed=2)
    d13, d2 = dequantize(q13, s13, block, dtype), dequantize(q2, s2, block, dtype)
    cfg = None if case == "default-config" else tiles.GEMV_UNFUSED
    kw = dict(config=cfg, cast_weights=case != "mixtral-weights")
    if case == "w13-only":
        got = fused_moe.fused_experts(x, q13, d2, w, ids, w13_scale=s13, **kw)
    elif case == "scale-e-n-1":
        got = fused_moe.fused_experts(x, q13, q2, w, ids, w13_scale=s13[..., None], w2_scale=s2[..., None], **kw)
    else:
        got = fused_moe.fused_experts(x, q13, q2, w, ids, w13_scale=s13, w2_scale=s2, block_shape=block, **kw)
    want = fused_moe.fused_experts(x, d13, d2, w, ids, **kw)
    if dev == "cpu":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, **_tol(dtype))


@pytest.mark.parametrize("kind", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("block", [None, (16, 8)], ids=["channel", "block16x8"])
@pytest.mark.parametrize("cfg", [tiles.GROUPED, tiles.GEMV, tiles.GEMV_UNFUSED, {**tiles.GEMV, "BLOCK_SIZE_K": 8, "SPLIT_K": 2}],
                         ids=["grouped", "gemv", "gemv-unfused", "split-k"])
def test_fp8_expert_map(kind, block, cfg):
    """Rank r of 2 under expert parallelism holds experts 4r..4r+3 and their FP8 weights and
    scales: each rank's result is its dequantized weights' (other ranks' experts add
    nothing), and the two add up to the whole."""
    dev = _dev(kind)
    x, q13, s13, q2, s2, w, ids = _fp8_problem(9, 8, 32, 16, 3, torch.float32, dev, block, seed=1)
    d13, d2 = dequantize(q13, s13, block, torch.float32), dequantize(q2, s2, block, torch.float32)
    parts = []
    for r in range(2):
        emap = rank_expert_map(r, 8, 2, dev)
        local = slice(4 * r, 4 * r + 4)
        got = fused_moe.fused_experts(x, q13[local].contiguous(), q2[local].contiguous(), w, ids, expert_map=emap,
                                      config=cfg, w13_scale=s13[local].contiguous(),
                                      w2_scale=s2[local].contiguous(), block_shape=block)
        want = fused_moe.fused_experts(x, d13[local].contiguous(), d2[local].contiguous(), w, ids, expert_map=emap,
                                       config=cfg)
        if dev == "cpu":
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, **_tol(torch.float32))
        parts.append(got)
    torch.testing.assert_close(parts[0] + parts[1], fused_experts_torch(x, d13, d2, w, ids), **_tol(torch.float32))


def _refusal_inputs():
    x, q13, s13, q2, s2, w, ids = _fp8_problem(2, 4, 32, 16, 2, torch.bfloat16, "cpu", None)
    _, _, b13, _, b2, _, _ = _fp8_problem(2, 4, 32, 16, 2, torch.bfloat16, "cpu", (16, 16))
    return dict(x=x, q13=q13, s13=s13, q2=q2, s2=s2, w=w, ids=ids, b13=b13, b2=b2,
                f13=dequantize(q13, s13, None, torch.bfloat16), f2=dequantize(q2, s2, None, torch.bfloat16))


@pytest.mark.parametrize("args, word", [
    (lambda d: dict(w13=d["q13"], w2=d["q2"], w2_scale=d["s2"]),
     "w13 is torch.float8_e4m3fn: w13_scale \\(float32\\) is required"),
    (lambda d: dict(w13=d["q13"], w2=d["q2"], w13_scale=d["s13"]), "w2_scale \\(float32\\) is required"),
    (lambda d: dict(w13=d["f13"], w2=d["f2"], w13_scale=d["s13"]),
     "w13_scale given for w13 of dtype torch.bfloat16: scales go with torch.float8_e4m3fn weights only"),
    (lambda d: dict(w13=d["q13"], w2=d["f2"], w13_scale=d["s13"], w2_scale=d["s2"]), "w2_scale given for w2"),
    (lambda d: dict(w13=d["q13"], w2=d["q2"], w13_scale=d["s13"][:, :-1], w2_scale=d["s2"]),
     r"w13_scale \(per output channel\) must have shape \[4, 32\] for w13 of shape \[4, 32, 32\], got \[4, 31\]"),
    (lambda d: dict(w13=d["q13"], w2=d["q2"], w13_scale=d["s13"], w2_scale=d["b2"]),
     r"w2_scale \(per output channel\) must have shape \[4, 32\].*got \[4, 2, 1\]"),
    (lambda d: dict(w13=d["q13"], w2=d["q2"], w13_scale=d["s13"], w2_scale=d["s2"], block_shape=(16, 16)),
     r"w13_scale \(per 16x16 block\) must have shape \[4, 2, 2\] for w13 of shape \[4, 32, 32\], got \[4, 32\]"),
    (lambda d: dict(w13=d["q13"], w2=d["q2"], w13_scale=d["b13"], w2_scale=d["b2"], block_shape=(16, 8)),
     r"w13_scale \(per 16x8 block\) must have shape \[4, 2, 4\]"),
    (lambda d: dict(w13=d["q13"], w2=d["q2"], w13_scale=d["s13"].double(), w2_scale=d["s2"]),
     "w13_scale must be float32, got torch.float64"),
    (lambda d: dict(w13=d["q13"], w2=d["q2"], w13_scale=d["b13"], w2_scale=d["b2"], block_shape=(16, 0)),
     "block_shape must be two positive integers"),
    (lambda d: dict(w13=d["q13"], w2=d["q2"], w13_scale=d["b13"], w2_scale=d["b2"], block_shape=16),
     "block_shape must be two positive integers"),
    (lambda d: dict(w13=d["f13"], w2=d["f2"], block_shape=(16, 16)), "block_shape given without FP8"),
    (lambda d: dict(w13=d["q13"].view(torch.float8_e5m2), w2=d["q2"], w13_scale=d["s13"], w2_scale=d["s2"]),
     "w13 is torch.float8_e5m2: FP8 expert weights must be torch.float8_e4m3fn"),
    (lambda d: dict(x=d["x"].to(torch.float64), w13=d["q13"], w2=d["q2"], w13_scale=d["s13"], w2_scale=d["s2"]),
     "FP8 expert weights take bf16, fp16 or float32 activations"),
])
def test_fp8_refusals(args, word):
    """Checked before any launch (no device needed), zero tokens included."""
    d = _refusal_inputs()
    for t in (2, 0):
        kw = args(d)
        x = kw.pop("x", d["x"])
        with pytest.raises(ValueError, match=word):
            fused_moe.fused_experts(x[:t], kw.pop("w13"), kw.pop("w2"), d["w"][:t], d["ids"][:t], config=tiles.GEMV, **kw)


def test_grouped_tile_bytes():
    """The grouped pass's shared-memory model: FP8 weight tiles are 1 byte an element a
    stage, their scales a row a stage (or one a weight), and the dequantized tiles held for
    ``tl.dot``."""
    assert fused_moe.grouped_tile_bytes(64, 128, 64, True, 2, 2, False) == (64 * 64 * 2 + 2 * 64 * 128 * 2, 0)
    assert fused_moe.grouped_tile_bytes(64, 128, 64, True, 2, 1, True) == (
        64 * 64 * 2 + 2 * 64 * 128 + 2 * 4 * 128, 2 * 64 * 128 * 2)
    assert fused_moe.grouped_tile_bytes(64, 128, 64, False, 2, 1, True, False) == (
        64 * 64 * 2 + 64 * 128 + 4 * 64 * 128, 64 * 128 * 2)


# ---- GPU ---------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("block", [None, (128, 128)], ids=["channel", "block128"])
@pytest.mark.parametrize("t", [1, 64, 512])
def test_gpu_fp8_qwen3_30b_a3b_shape(block, t):
    """bf16 activations, FP8 weights at the Qwen3-30B-A3B expert shape (128 experts, top-8,
    H 2048, I 768) with the shipped tile configs: the dequantized weights' run to bf16
    tolerance (the same values into the same FMA loops / tl.dot), and the float32 torch path
    on the dequantized weights."""
    dev = _dev("cuda")
    x, q13, s13, q2, s2, w, ids = _fp8_problem(t, 128, 2048, 768, 8, torch.bfloat16, dev, block)
    d13, d2 = dequantize(q13, s13, block, torch.bfloat16), dequantize(q2, s2, block, torch.bfloat16)
    table = fused_moe.load_tile_configs(128, 768)
    got = fused_moe.fused_experts(x, q13, q2, w, ids, tile_configs=table, w13_scale=s13, w2_scale=s2,
                                  block_shape=block)
    want = fused_moe.fused_experts(x, d13, d2, w, ids, tile_configs=table)
    torch.testing.assert_close(got, want, **_tol(torch.bfloat16))
    assert float((got != want).float().mean()) < 0.1
    ref = fused_experts_torch(x.float(), d13.float(), d2.float(), w, ids)
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("block", [None, (128, 128)], ids=["channel", "block128"])
@pytest.mark.parametrize("cfg", [tiles.GEMV, tiles.GROUPED, None, {**tiles.GEMV, "SPLIT_K": 2}],
                         ids=["gemv", "grouped", "default", "split-k"])
def test_gpu_fp8_cuda_graph_replay(block, cfg):
    """Captured once, replayed with new routing and activations: no host sync on the FP8
    path, results follow the inputs."""
    dev = _dev("cuda")
    x, q13, s13, q2, s2, w, ids = _fp8_problem(4, 16, 256, 128, 2, torch.bfloat16, dev, block)
    kw = dict(config=cfg, w13_scale=s13, w2_scale=s2, block_shape=block)
    fused_moe.fused_experts(x, q13, q2, w, ids, **kw)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fused_moe.fused_experts(x, q13, q2, w, ids, **kw)
    x2, _, _, _, _, w_new, ids_new = _fp8_problem(4, 16, 256, 128, 2, torch.bfloat16, dev, block, seed=5)
    x.copy_(x2)
    w.copy_(w_new)
    ids.copy_(ids_new)
    g.replay()
    torch.cuda.synchronize()
    d13, d2 = dequantize(q13, s13, block, torch.bfloat16), dequantize(q2, s2, block, torch.bfloat16)
    torch.testing.assert_close(out, fused_moe.fused_experts(x, d13, d2, w, ids, config=cfg), **_tol(torch.bfloat16))
