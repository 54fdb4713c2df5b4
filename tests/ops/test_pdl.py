"""Programmatic dependent launch (pyengine/ops/pdl.py): when it is on, and what each
PDL-aware kernel does before its ``griddepcontrol.wait``.

The order is read from the PTX Triton builds for sm_90 on this (GPU-less) machine: a
kernel may start while the kernel before it still runs, so before the wait it may load
only what no kernel writes (a GEMV's weights) and must store nothing. A store moved above
the wait, or a GEMV whose weight loads all sank below it, fails here; whether the
overlap pays is measured on the H200 (benchmarks/quant.py, benchmarks/moe.py with
``VENGINE_PDL=0`` and ``1``).
"""
from __future__ import annotations

import os
import re

import pytest
import torch
import triton

from pyengine import envs
from pyengine.ops import pdl


def test_off_for_cpu_tensors():
    assert pdl.launch_kwargs(torch.zeros(1), "gemv") == {"PDL": False}
    assert not pdl.enabled(torch.zeros(1), "rms_norm")


def test_unknown_kernel_name_is_refused():
    with pytest.raises(ValueError, match="unknown PDL kernel name 'gemm'"):
        pdl.enabled(torch.zeros(1), "gemm")


def test_misspelt_exclusion_is_refused(monkeypatch):
    monkeypatch.setenv("VENGINE_PDL_EXCLUDE", "rms_norm,fp8gemv")
    pdl._excluded.cache_clear()  # read once a name: this test sets it anew
    try:
        with pytest.raises(ValueError, match=r"VENGINE_PDL_EXCLUDE: unknown kernel name\(s\) 'fp8gemv'"):
            pdl.enabled(torch.zeros(1), "rms_norm")
    finally:
        monkeypatch.delenv("VENGINE_PDL_EXCLUDE")
        pdl._excluded.cache_clear()


def test_env_switch(monkeypatch):
    monkeypatch.delenv("VENGINE_PDL", raising=False)
    assert envs.pdl() is True
    monkeypatch.setenv("VENGINE_PDL", "0")
    assert envs.pdl() is False
    monkeypatch.setenv("VENGINE_PDL", "maybe")
    with pytest.raises(ValueError, match="VENGINE_PDL"):
        envs.pdl()
    monkeypatch.setenv("VENGINE_PDL_EXCLUDE", " fp8_gemv, rms_norm ,")
    assert envs.pdl_exclude() == ("fp8_gemv", "rms_norm")


def _events(fn, types: dict, constexprs: dict, num_warps: int = 4, num_stages: int = 3) -> list[str]:
    """The kernel's griddepcontrol / global load / global store instructions, in PTX order,
    built for sm_90 with 16-byte-aligned pointers (as the JIT specializes them)."""
    from triton.backends.compiler import GPUTarget
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = types.get(name, "*bf16")
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = types.get(name, "i32")
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    if "nvidia" not in triton.backends.backends:  # a Triton build without the CUDA backend
        pytest.skip("cannot build for sm_90 here: no nvidia backend in this Triton")
    if os.environ.get("TRITON_INTERPRET") == "1":  # the kernels are interpreter functions: the plain run builds them
        pytest.skip("TRITON_INTERPRET=1: kernels are not compiled (the run without it checks their PTX)")
    # a kernel that does not build fails here (skipping it would hide exactly that)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages})
    ev = []
    for line in k.asm["ptx"].splitlines():
        if "griddepcontrol.wait" in line:
            ev.append("WAIT")
        elif "griddepcontrol.launch_dependents" in line:
            ev.append("LAUNCH")
        elif re.search(r"\bld\.global", line):
            ev.append("LD")
        elif re.search(r"\b(st|atom|red)\.global", line):
            ev.append("ST")
    return ev


def _gemv():
    from pyengine.ops import gemv
    return gemv._gemv_kernel, {}, dict(K=4096, BLOCK_N=8, BLOCK_K=1024, HAS_BIAS=False)


def _fp8_tc():
    from pyengine.ops import quant
    return quant._fp8_gemv_kernel, dict(w_ptr="*fp8e4nv", s_ptr="*fp32", xs_ptr="*fp32", p_ptr="*fp32"), dict(
        K=4096, BN_SCALE=1, BK_SCALE=1, BLOCK_N=8, BLOCK_K=2048, BLOCK_SCALED=False, HAS_BIAS=False, ACT=1,
        MIN_SCALE=quant._MIN_SCALE, AMAX_BLOCK=2048, IEEE=False, EMULATE=False, SPLIT_K=1)


def _fp8_stream():
    from pyengine.ops import quant
    return quant._fp8_gemv_stream_kernel, dict(w_ptr="*fp8e4nv", s_ptr="*fp32", xs_ptr="*fp32"), dict(
        K=4096, BLOCK_N=8, BLOCK_K=1024, HAS_BIAS=False, ACT=1, MIN_SCALE=quant._MIN_SCALE, AMAX_BLOCK=2048,
        IEEE=False, EMULATE=False, STAGES=3)


def _int4(half2=False):
    from pyengine.ops import quant
    return quant._int_gemv_kernel, dict(qw_ptr="*i32", p_ptr="*fp32"), dict(
        K=4096, GROUP=128, BITS=4, BLOCK_N=8, CW=4, NUM_WARPS=4, HAS_BIAS=False, SPLIT_K=1, PREFETCH=False,
        HALF2=half2, ZP=0.0)


def _int4_half2():
    return _int4(half2=True)


def _int4_stream(stages=1):
    from pyengine.ops import quant
    return quant._int_gemv_stream_kernel, dict(qw_ptr="*i32"), dict(
        K=4096, GROUP=128, BITS=4, BLOCK_N=8, CW=4, NUM_WARPS=4, HAS_BIAS=False, HALF2=True, STAGES=stages,
        ZP=8.0 if stages > 1 else 0.0)


def _int4_pipelined():
    return _int4_stream(stages=3)


def _rms_norm():
    from pyengine.ops import fused
    return fused._rms_norm_kernel, dict(eps="fp32"), dict(N_INNER=1, N=4096, BLOCK=4096, ADD=True)


def _silu():
    from pyengine.ops import fused
    return fused._silu_and_mul_kernel, {}, dict(D=14336, BLOCK=1024)


def _decode_reduce():
    from pyengine.ops import paged_attention
    return paged_attention._decode_reduce_kernel, dict(part_out_ptr="*fp32", part_lse_ptr="*fp32"), dict(
        NUM_HEADS=32, HEAD_DIM=128, NUM_SPLITS=4, SPLITS_PAD=4)


def _topk():
    from pyengine.layers.fused_moe import fused_moe
    return fused_moe._topk_softmax_kernel, dict(w_ptr="*fp32", ids_ptr="*i32"), dict(
        TOP_K=8, K_PAD=8, E_PAD=128, RENORM=True)


def _rope_cache():
    from pyengine.ops import fused
    return fused._rope_cache_kernel, dict(pos_ptr="*i64", slot_ptr="*i64", eps="fp32"), dict(
        HQ=32, HQ_PAD=32, HK=8, HK_PAD=8, HALF=64, BLOCK_SIZE=16, NORM=True)


def _decode_split():
    from pyengine.ops import paged_attention
    return paged_attention._decode_split_kernel, dict(
        block_table_ptr="*i32", seq_lens_ptr="*i32", part_out_ptr="*fp32", part_lse_ptr="*fp32", qk_scale="fp32",
        v_scale="fp32"), dict(NUM_HEADS=32, GROUP=4, GROUP_PAD=16, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_N=64,
                              NUM_SPLITS=4, UPCAST=False)


def _moe_gemv(fp8: bool = False, int4: bool = False):
    from pyengine.layers.fused_moe import fused_moe
    types = dict(w_ptr="*fp32", ids_ptr="*i32", emap_ptr="*i32", part_ptr="*fp32")
    if fp8:  # FP8 expert weights with per-channel scales
        types.update(b_ptr="*fp8e4nv", s_ptr="*fp32")
    if int4:  # packed int4 expert weights, groups of 128 with zero points
        types.update(b_ptr="*i32", s_ptr="*fp32", z_ptr="*fp32")
    return fused_moe._gemv_kernel, types, dict(
        K=2048, A_ROW_DIV=1, GATED=True, MUL_WEIGHT=False, CAST_W=False, HAS_EMAP=False, EMULATE=False, BLOCK_N=16,
        BLOCK_K=512, SPLIT_K=1, HAS_SCALE=fp8 or int4, BLOCK_SCALED=int4, BN_S=1, BK_S=128 if int4 else 1,
        INT_BITS=4 if int4 else 0, HAS_ZP=int4)


def _moe_down_sum(bits: int = 0):
    # FP8 weights with 128 x 128 block scales, or (bits) packed symmetric integers in groups of 128
    from pyengine.layers.fused_moe import fused_moe
    return fused_moe._gemv_down_sum_kernel, dict(
        w_ptr="*fp32", ids_ptr="*i32", emap_ptr="*i32", b_ptr="*i32" if bits else "*fp8e4nv", s_ptr="*fp32"), dict(
        K=768, TOP_K=8, HAS_EMAP=False, CAST_W=True, EMULATE=False, BLOCK_N=2, BLOCK_K=1024, HAS_SCALE=True,
        BLOCK_SCALED=True, BN_S=1 if bits else 128, BK_S=128, INT_BITS=bits, HAS_ZP=False)


def _moe_int_gemv(down_sum: bool = False):
    # the word kernels of packed int4 experts (groups of 128, symmetric): gate/up, or down with the k-sum
    from pyengine.layers.fused_moe import fused_moe
    types = dict(w_ptr="*fp32", ids_ptr="*i32", emap_ptr="*i32", part_ptr="*fp32", b_ptr="*i32", s_ptr="*fp32",
                 z_ptr="*fp32")
    common = dict(HAS_EMAP=False, CAST_W=True, EMULATE=False, CW=4, GS=128, BITS=4, ZP=8.0)
    if down_sum:
        return fused_moe._int_gemv_down_sum_kernel, types, dict(K=768, TOP_K=8, BLOCK_N=2, C=32, **common)
    return fused_moe._int_gemv_kernel, types, dict(K=2048, A_ROW_DIV=8, GATED=True, MUL_WEIGHT=False, BLOCK_N=8,
                                                   C=16, SPLIT_K=1, **common)


# (kernel, whether it prefetches its weights before the wait)
KERNELS = {"gemv": (_gemv, True), "fp8_gemv": (_fp8_tc, True), "fp8_gemv_stream": (_fp8_stream, False),
           "int4_gemv": (_int4, True), "int4_gemv_half2": (_int4_half2, True), "int4_gemv_stream": (_int4_stream, True),
           "int4_gemv_pipelined": (_int4_pipelined, False),
           "rms_norm": (_rms_norm, None),
           "silu_and_mul": (_silu, False),
           "decode_reduce": (_decode_reduce, False), "topk_softmax": (_topk, False),
           "rope_and_cache": (_rope_cache, False), "decode_split": (_decode_split, False),
           "fused_moe_gemv": (_moe_gemv, False), "fused_moe_gemv_fp8": (lambda: _moe_gemv(fp8=True), False),
           "fused_moe_gemv_int4": (lambda: _moe_gemv(int4=True), False),
           "fused_moe_down_sum_fp8_blocks": (_moe_down_sum, False),
           "fused_moe_down_sum_int4": (lambda: _moe_down_sum(4), False),
           "fused_moe_int_gemv": (_moe_int_gemv, False),
           "fused_moe_int_down_sum": (lambda: _moe_int_gemv(down_sum=True), False)}


@pytest.mark.parametrize("name", list(KERNELS))
def test_nothing_written_or_produced_read_before_the_wait(name):
    make, prefetches = KERNELS[name]
    fn, types, constexprs = make()
    ev = _events(fn, types, {**constexprs, "PDL": True})
    assert ev.count("WAIT") == 1 and ev.count("LAUNCH") == 1, ev
    wait = ev.index("WAIT")
    assert ev.index("LAUNCH") < wait  # the successor may start as early as possible
    before = ev[:wait]
    assert "ST" not in before, f"{name}: a store before griddepcontrol.wait races the previous kernel"
    if prefetches:  # the weights' HBM reads overlap the previous kernel
        assert "LD" in before, f"{name}: no weight load issued before the wait"
        assert "LD" in ev[wait:]  # ... and the activation is read after it
    elif prefetches is False:  # every input is another kernel's output
        assert "LD" not in before, f"{name}: loads before the wait read what the previous kernel writes"
    off = _events(fn, types, {**constexprs, "PDL": False})
    assert "WAIT" not in off and "LAUNCH" not in off


def test_fp8_cuda_core_gemv_launches_without_pdl():
    """It measured slower with PDL in every form tried (its comment): no PDL argument, and a
    launch of it never asks for ``launch_pdl``."""
    from pyengine.ops import quant
    assert "PDL" not in quant._fp8_gemv_fma_kernel.arg_names
    assert "fp8_gemv_fma" not in pdl.KERNELS


@pytest.mark.gpu
def test_only_small_launches_use_pdl():
    """Decode-sized launches (<= MAX_ROWS rows) only: PDL slowed 256-in-flight throughput."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs a GPU of compute capability >= 9.0")
    small = torch.zeros(pdl.MAX_ROWS, 8, device="cuda")
    big = torch.zeros(pdl.MAX_ROWS + 1, 8, device="cuda")
    assert pdl.launch_kwargs(small, "rms_norm") == {"PDL": True, "launch_pdl": True}
    assert pdl.launch_kwargs(big, "rms_norm") == {"PDL": False}
