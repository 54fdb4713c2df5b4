"""The Triton fused MoE (pyengine/layers/fused_moe/fused_moe.py) against the per-expert
torch path: both kernel paths (grouped GEMM over expert-sorted pairs, and the small-batch
GEMV), expert parallelism's expert map, the alignment step, the tile-config table.

CPU: the kernels run only under ``TRITON_INTERPRET=1`` (tiny shapes):
    TRITON_INTERPRET=1 pytest tests/layers/fused_moe
GPU: ``pytest -m gpu tests/layers/fused_moe`` (bf16, the Qwen3-30B-A3B expert shape, CUDA graphs).
"""
from __future__ import annotations

import importlib.util
import json
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

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


_dev = triton_device


def _problem(t, e, h, inter, k, dtype, dev, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * inter, h, generator=g) / h ** 0.5
    w2 = torch.randn(e, h, inter, generator=g) / inter ** 0.5
    w, ids = fused_topk(torch.randn(t, e, generator=g), k, renormalize=True)
    return [v.to(dev) for v in (x.to(dtype), w13.to(dtype), w2.to(dtype), w, ids)]


def _tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)


GROUPED = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 16, "GROUP_SIZE_M": 2, "num_warps": 4,
           "num_stages": 2}
# K tails (hidden 48, intermediate 24 against BLOCK_SIZE_K 32) and N tails (24 against 32)
GROUPED_TAILS = {**GROUPED, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 1}
GEMV = {"small_batch": True, "BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 32, "num_warps": 4}
# Overrides per pass; hidden 48 is not a multiple of BLOCK_SIZE_K 32 (masked tail).
GEMV_SPLIT = {"small_batch": True, "BLOCK_SIZE_N": 8, "BLOCK_SIZE_K": 32, "w2": {"BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 16}}
GEMV_UNFUSED = {**GEMV, "w2": {"FUSE_SUM": False}}  # per-pair down pass, then the separate k-sum
# Split-K: gate/up's K 48 in three 16-column chunks over 3 programs, the down pass's K 24 in
# two (one of them a masked 8-column tail) over 2; fused k-sum and not.
GEMV_SPLIT_K = {"small_batch": True, "BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 16, "num_warps": 4,
                "w13": {"SPLIT_K": 3}, "w2": {"SPLIT_K": 2}}
GEMV_SPLIT_K_UNFUSED = {**GEMV_SPLIT_K, "w2": {"SPLIT_K": 2, "FUSE_SUM": False}}
# Unequal splits: K 48 in chunks of 16 over 2 programs (two chunks, then one).
GEMV_SPLIT_K_UNEVEN = {**GEMV_SPLIT_K, "w13": {"SPLIT_K": 2}}


@pytest.mark.parametrize("kind", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("cfg,t", [(GROUPED, 1), (GROUPED, 7), (GROUPED, 33), (GROUPED_TAILS, 5), (GEMV, 1),
                                   (GEMV, 3), (GEMV_SPLIT, 2), (GEMV_UNFUSED, 3), (None, 2), (None, 40),
                                   (GEMV_SPLIT_K, 1), (GEMV_SPLIT_K, 3), (GEMV_SPLIT_K_UNFUSED, 2),
                                   (GEMV_SPLIT_K_UNEVEN, 2)])
def test_matches_torch_path(kind, cfg, t):
    dev = _dev(kind)
    x, w13, w2, w, ids = _problem(t, 8, 48, 24, 2, torch.float32, dev)
    got = fused_moe.fused_experts(x, w13, w2, w, ids, config=cfg)
    torch.testing.assert_close(got, fused_experts_torch(x, w13, w2, w, ids), **_tol(torch.float32))


@pytest.mark.parametrize("kind", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("cfg", [GROUPED, GEMV, GEMV_UNFUSED,
                                 # split-K at hidden 32 / intermediate 16: 8-column chunks over 2 programs
                                 {**GEMV, "BLOCK_SIZE_K": 8, "SPLIT_K": 2},
                                 {**GEMV, "BLOCK_SIZE_K": 8, "SPLIT_K": 2, "w2": {"FUSE_SUM": False}}])
def test_expert_map_leaves_other_ranks_experts_out(kind, cfg):
    """Rank 1 of 2 under expert parallelism: experts 4..7 local; the two ranks' partial sums
    add up to the whole."""
    dev = _dev(kind)
    x, w13, w2, w, ids = _problem(9, 8, 32, 16, 3, torch.float32, dev, seed=1)
    whole = fused_experts_torch(x, w13, w2, w, ids)
    parts = []
    for r in range(2):
        emap = rank_expert_map(r, 8, 2, dev)
        local = slice(4 * r, 4 * r + 4)
        got = fused_moe.fused_experts(x, w13[local].contiguous(), w2[local].contiguous(), w, ids, expert_map=emap,
                                      config=cfg)
        torch.testing.assert_close(got, fused_experts_torch(x, w13[local], w2[local], w, ids, expert_map=emap))
        parts.append(got)
    torch.testing.assert_close(parts[0] + parts[1], whole, **_tol(torch.float32))


@pytest.mark.parametrize("kind", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("e,k,renorm", [(8, 2, True), (8, 3, False), (60, 4, False), (128, 8, True)])
def test_topk_softmax_matches_router(kind, e, k, renorm):
    dev = _dev(kind)
    logits = torch.randn(11, e, generator=torch.Generator().manual_seed(e)).to(dev)
    w, ids = fused_moe.topk_softmax(logits, k, renorm)
    ref_w, ref_ids = fused_topk(logits, k, renorm)
    assert ids.dtype == torch.int32 and torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=1e-6)
    # bf16 router logits (the model dtype) are read as they are. With 8 mantissa bits they tie
    # often, and torch.topk on CUDA does not order tied values by index: the same experts
    # with the same weights, in any order among equal weights.
    w16, ids16 = fused_moe.topk_softmax(logits.bfloat16(), k, renorm)
    _assert_same_choice(w16, ids16, *fused_topk(logits.bfloat16(), k, renorm), logits.bfloat16(), k)


def _assert_same_choice(w, ids, ref_w, ref_ids, logits, k):
    """Per row: the weights sorted descending match; the chosen experts are the same set
    unless the k-th and (k+1)-th probabilities tie (then either tied expert is a right pick);
    each chosen expert carries its own weight."""
    torch.testing.assert_close(w.sort(1, descending=True).values, ref_w.sort(1, descending=True).values,
                               atol=1e-6, rtol=1e-6)
    probs = torch.softmax(logits.float(), -1)
    top = probs.topk(min(k + 1, probs.shape[1]), -1).values
    for r in range(ids.shape[0]):
        boundary_tie = k < probs.shape[1] and bool(top[r, k - 1] == top[r, k])
        if not boundary_tie:
            assert sorted(ids[r].tolist()) == sorted(ref_ids[r].tolist()), r
        # tied picks have equal probabilities: the chosen probabilities are the same either way
        assert torch.equal(probs[r, ids[r].long()].sort(descending=True).values,
                           probs[r, ref_ids[r].long()].sort(descending=True).values), r
        got = dict(zip(ids[r].tolist(), w[r].tolist()))
        for e, v in zip(ref_ids[r].tolist(), ref_w[r].tolist()):
            if e in got:
                assert abs(got[e] - v) <= 1e-6 * max(1.0, abs(v)), (r, e)


@pytest.mark.parametrize("kind", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_topk_softmax_ties_pick_the_lower_index_first(kind):
    """Exactly tied logits: the lower expert id first (torch.topk's order on CPU, and which
    expert of a tie at the k-th place transformers' router keeps)."""
    dev = _dev(kind)
    logits = torch.tensor([[0.5, 2.0, 0.5, 2.0, 1.0, 0.5]], device=dev).bfloat16()
    w, ids = fused_moe.topk_softmax(logits, 3, False)
    assert ids.tolist() == [[1, 3, 4]]
    w, ids = fused_moe.topk_softmax(logits, 4, True)
    assert ids.tolist() == [[1, 3, 4, 0]]
    torch.testing.assert_close(w.sum(1), torch.ones(1, device=dev))


@pytest.mark.parametrize("kind", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("cast", [True, False])  # Qwen-MoE's bf16 routing weights, Mixtral's float32 ones
@pytest.mark.parametrize("cfg,t", [(GROUPED, 7), (GROUPED_TAILS, 5), (GEMV, 3), (GEMV_UNFUSED, 3), (None, 40),
                                   (GEMV_SPLIT_K, 3), (GEMV_SPLIT_K_UNFUSED, 2)])
def test_bf16_rounds_as_the_torch_path(kind, cast, cfg, t):
    """bf16: the kernels round where transformers (and the torch path) round: each GEMM
    output, the SiLU, gate*up, the routing weight and its product (``cast``), the sum. On CPU
    (interpreter, float32 dots) bit for bit; on the GPU the GEMMs' own roundings differ
    from cuBLAS's in the last bit of a few elements."""
    dev = _dev(kind)
    x, w13, w2, w, ids = _problem(t, 8, 48, 24, 2, torch.bfloat16, dev, seed=5)
    got = fused_moe.fused_experts(x, w13, w2, w, ids, config=cfg, cast_weights=cast)
    ref = fused_experts_torch(x, w13, w2, w, ids, cast_weights=cast)
    assert got.dtype == torch.bfloat16
    if dev == "cpu":
        assert torch.equal(got, ref)
    else:
        assert float((got != ref).float().mean()) < 0.1
        torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2 ** -6)


@pytest.mark.parametrize("kind", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("cfg", [GEMV_SPLIT_K, GEMV_SPLIT_K_UNFUSED])
def test_split_k_is_deterministic(kind, cfg):
    """The split-K GEMV passes add their splits in a fixed order: the same bits every call."""
    dev = _dev(kind)
    x, w13, w2, w, ids = _problem(2, 8, 48, 24, 2, torch.bfloat16, dev, seed=3)
    first = fused_moe.fused_experts(x, w13, w2, w, ids, config=cfg)
    assert torch.equal(first, fused_moe.fused_experts(x, w13, w2, w, ids, config=cfg))


@pytest.mark.parametrize("over, word", [
    ({"w13": {"SPLIT_K": 4}}, "SPLIT_K 4 leaves a split without work"),  # K 48: three chunks of 16
    ({"w2": {"SPLIT_K": 0}}, r"SPLIT_K must be an integer in \[1, 64\], got 0"),
    ({"w2": {"SPLIT_K": True}}, "SPLIT_K must be an integer"),
])
def test_bad_split_k_is_refused(over, word):
    """Checked before any launch, so no device is needed."""
    x, w13, w2, w, ids = _problem(1, 8, 48, 24, 2, torch.float32, "cpu")
    with pytest.raises(ValueError, match=word):
        fused_moe.fused_experts(x, w13, w2, w, ids, config={**GEMV_SPLIT_K, **over})


@pytest.mark.parametrize("entry, word", [
    ({"small_batch": True, "BLOCK_SIZE_N": 8, "BLOCK_SIZE_K": 512, "w2": {"SPLIT_K": "2"}}, "SPLIT_K must be"),
    ({"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64, "SPLIT_K": 2}, "SPLIT_K is a GEMV-path"),
])
def test_bad_split_k_in_a_table_is_refused(tmp_path, entry, word):
    (tmp_path / fused_moe.get_config_file_name(8, 24, "GPU X")).write_text(json.dumps({"1": entry}))
    with pytest.raises(ValueError, match=word):
        fused_moe.load_tile_configs(8, 24, "GPU X", tmp_path)


@pytest.mark.parametrize("kind", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_align_block_size(kind):
    dev = _dev(kind)
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]], dtype=torch.int32, device=dev)  # pairs 0..5
    sorted_ids, expert_ids, npost = fused_moe.moe_align_block_size(ids, 4, num_experts=4)
    # expert 0: pairs 1, 4 (+2 pad); expert 2: pairs 0, 2, 5 (+1 pad); expert 3: pair 3 (+3 pad)
    assert int(npost) == 12
    assert sorted_ids[:12].tolist() == [1, 4, 6, 6, 0, 2, 5, 6, 3, 6, 6, 6]
    assert sorted_ids.numel() == 20 and (sorted_ids[12:] == 6).all()  # ceil((6 + 4*3) / 4) * 4 slots
    assert expert_ids.tolist() == [0, 2, 3, -1, -1]
    # expert map (rank 1 of 2 holds experts 2, 3): experts 0 and 1 go to the "elsewhere" bucket
    emap = torch.tensor([-1, -1, 0, 1], dtype=torch.int32, device=dev)
    sorted_ids, expert_ids, npost = fused_moe.moe_align_block_size(ids, 4, num_experts=2, expert_map=emap)
    assert int(npost) == 12
    assert sorted_ids[:12].tolist() == [0, 2, 5, 6, 3, 6, 6, 6, 1, 4, 6, 6]
    assert expert_ids[:3].tolist() == [0, 1, -1]


def _align_reference(ids, block_m, num_experts, emap=None):
    """Bucket by bucket, in pair order, each run padded to block_m (plain Python)."""
    flat = ids.reshape(-1).long().cpu()
    buckets = num_experts
    if emap is not None:
        flat = emap.long().cpu()[flat]
        flat = torch.where(flat < 0, num_experts, flat)
        buckets += 1
    slots, experts = [], []
    for b in range(buckets):
        pairs = (flat == b).nonzero().flatten().tolist()
        pairs += [flat.numel()] * (-len(pairs) % block_m)
        slots += pairs
        experts += [b if b < num_experts else -1] * (len(pairs) // block_m)
    return slots, experts


@pytest.mark.parametrize("kind", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("t,k,e,block_m,ep", [(1, 8, 128, 16, False), (37, 8, 128, 16, False),
                                              (300, 8, 128, 64, True), (1000, 2, 8, 16, False),
                                              (5, 4, 60, 32, True), (0, 2, 8, 16, False)])
def test_align_block_size_random(kind, t, k, e, block_m, ep):
    """Against a plain reference, with the pairs split over many programs (300 x 8 pairs: 75
    runs of 32), experts that are not a power of two, and the other ranks' bucket."""
    dev = _dev(kind)
    ids = torch.randint(0, e, (t, k), generator=torch.Generator().manual_seed(t), dtype=torch.int32)
    local, emap = e, None
    if ep:
        local = e // 2
        emap = torch.full((e,), -1, dtype=torch.int32)
        emap[local:] = torch.arange(local, dtype=torch.int32)
        emap = emap.to(dev)
    sorted_ids, expert_ids, npost = fused_moe.moe_align_block_size(ids.to(dev), block_m, local, emap)
    slots, experts = _align_reference(ids, block_m, local, emap)
    buckets = local + ep
    assert sorted_ids.numel() == -(-(t * k + buckets * (block_m - 1)) // block_m) * block_m
    assert expert_ids.numel() == sorted_ids.numel() // block_m
    assert int(npost) == len(slots)
    assert sorted_ids[:len(slots)].tolist() == slots and (sorted_ids[len(slots):] == t * k).all()
    assert expert_ids[:len(experts)].tolist() == experts and (expert_ids[len(experts):] == -1).all()


def test_tile_config_table(tmp_path):
    table = {"1": GEMV, "64": GROUPED}
    name = fused_moe.get_config_file_name(128, 768, "NVIDIA H200")
    assert name == "E=128,N=768,device_name=NVIDIA_H200.json"
    (tmp_path / name).write_text(json.dumps(table))
    loaded = fused_moe.load_tile_configs(128, 768, "NVIDIA H200", tmp_path)
    assert loaded == {1: GEMV, 64: GROUPED}
    assert fused_moe.pick_config(loaded, 2, 128, 768, 2048, 8) == GEMV
    assert fused_moe.pick_config(loaded, 40, 128, 768, 2048, 8) == GROUPED
    assert fused_moe.pick_config(loaded, 128, 128, 768, 2048, 8) == GROUPED
    # an entry applies within a factor of 2 of its M only: beyond, the defaults (M=1's GEMV
    # tile on M=4096 read every expert's weights once per pair: 90x the dense GEMM)
    for m in (3, 4, 16, 129, 4096):
        assert fused_moe.pick_config(loaded, m, 128, 768, 2048, 8) == fused_moe.get_default_config(m, 128, 768, 2048, 8)
    assert not fused_moe.pick_config(loaded, 4096, 128, 768, 2048, 8).get("small_batch")
    # nearest in ratio, not in difference: 24 is 1.5x from 16 and 1.33x from 32
    assert fused_moe.pick_config({16: GEMV, 32: GROUPED}, 24, 128, 768, 2048, 8) == GROUPED
    assert fused_moe.load_tile_configs(64, 768, "NVIDIA H200", tmp_path) is None
    assert fused_moe.pick_config(None, 1, 128, 768, 2048, 8)["small_batch"]
    (tmp_path / name).write_text("[1, 2]")
    with pytest.raises(ValueError, match="tile config"):
        fused_moe.load_tile_configs(128, 768, "NVIDIA H200", tmp_path)
    assert fused_moe.pass_config(GEMV_SPLIT, "w2") == {"small_batch": True, "BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 16}


def test_int_experts_tile_table_overrides_the_unkeyed_one(tmp_path):
    """Packed integer experts' own table (vLLM's ``,dtype=int4_w4a16`` file name) holds the
    tiles swept on their weights; the layer takes its entries over the unkeyed table's grouped
    ones, which still serve the Ms it lacks, never the unkeyed GEMV entries (float weights'
    tiles: the integer defaults serve those Ms); float experts never read it."""
    from types import SimpleNamespace

    from pyengine.layers.fused_moe.layer import FusedMoE

    key = fused_moe.weight_dtype_key(4)
    assert (key, fused_moe.weight_dtype_key(8), fused_moe.weight_dtype_key(None)) == ("int4_w4a16", "int8_w8a16", None)
    name = fused_moe.get_config_file_name(128, 768, "NVIDIA H100", key)
    assert name == "E=128,N=768,device_name=NVIDIA_H100,dtype=int4_w4a16.json"
    (tmp_path / fused_moe.get_config_file_name(128, 768, "NVIDIA H100")).write_text(
        json.dumps({"1": GEMV, "64": GROUPED}))
    (tmp_path / name).write_text(json.dumps({"1": GEMV_SPLIT}))
    assert fused_moe.load_tile_configs(128, 768, "NVIDIA H100", tmp_path, dtype=key) == {1: GEMV_SPLIT}
    assert fused_moe.load_tile_configs(128, 768, "NVIDIA H100", tmp_path, dtype="int8_w8a16") is None
    fm = SimpleNamespace(weight_dtype_key=fused_moe.weight_dtype_key,
                         load_tile_configs=lambda e, n, dtype=None: fused_moe.load_tile_configs(
                             e, n, "NVIDIA H100", tmp_path, dtype=dtype))
    layer = SimpleNamespace(local_num_experts=128, intermediate_size_per_partition=768, weight_bits=4)
    assert FusedMoE._load_tile_configs(layer, fm) == {1: GEMV_SPLIT, 64: GROUPED}
    layer.weight_bits = 8  # int8 experts without a table of their own: the grouped entries only
    assert FusedMoE._load_tile_configs(layer, fm) == {64: GROUPED}
    int_default = fused_moe.pick_config({64: GROUPED}, 1, 128, 768, 2048, 8, weight_bits=8)
    assert int_default == fused_moe.get_default_config(1, 128, 768, 2048, 8, weight_bits=8) != GEMV
    layer.weight_bits = None  # float / FP8 experts: the unkeyed table as it is
    assert FusedMoE._load_tile_configs(layer, fm) == {1: GEMV, 64: GROUPED}


H200_SMEM = 232448  # bytes a block may use (227 KiB)


@pytest.mark.parametrize("e,inter,h,k", [(128, 768, 2048, 8), (128, 384, 2048, 8), (8, 14336, 4096, 2),
                                         (60, 1408, 2048, 4)])
def test_default_tiles(e, inter, h, k):
    """The defaults at real shapes (Qwen3-30B-A3B at TP 1 and 2, Mixtral, Qwen2-MoE): the GEMV
    path up to 4 tokens, grouped tiles above whose M-block grows with the pairs per expert,
    and whose every pass keeps all its pipeline stages within the H200's shared memory
    (counted as num_stages full copies, above what smem.py's model asks) and its
    accumulators in registers."""
    last_bm = 0
    for m in (1, 4, 5, 16, 64, 256, 1024, 4096, 16384):
        cfg = fused_moe.get_default_config(m, e, inter, h, k)
        assert bool(cfg.get("small_batch")) == (m <= 4)
        if m <= 4:
            continue
        assert cfg["BLOCK_SIZE_M"] >= last_bm
        last_bm = cfg["BLOCK_SIZE_M"]
        for which, gated in (("w13", True), ("w2", False)):
            c = fused_moe.pass_config(cfg, which)
            per_stage = 2 * (c["BLOCK_SIZE_M"] * c["BLOCK_SIZE_K"] + (1 + gated) * c["BLOCK_SIZE_K"] * c["BLOCK_SIZE_N"])
            assert c["num_stages"] * per_stage <= H200_SMEM, (m, which, c)
            # float32 accumulators a thread (gate/up keeps two): more than 128 spill
            assert (1 + gated) * c["BLOCK_SIZE_M"] * c["BLOCK_SIZE_N"] <= 128 * 32 * c["num_warps"], (m, which, c)
    assert last_bm == 128  # compute-bound at 16384 tokens: the large tile


def test_shipped_configs_are_tables():
    for f in fused_moe.CONFIG_DIR.glob("*.json"):
        e, n = (int(part.split("=")[1]) for part in f.name.split(",")[:2])
        device = f.name.split("device_name=")[1][: -len(".json")]
        table = fused_moe.load_tile_configs(e, n, device)
        # every pass's tile complete once its overrides are applied (shared fields may sit at the top)
        assert table and all(
            {"BLOCK_SIZE_N", "BLOCK_SIZE_K"} | (set() if c.get("small_batch") else {"BLOCK_SIZE_M"})
            <= set(fused_moe.pass_config(c, which)) for c in table.values() for which in fused_moe.PASSES)


# ---- GPU ---------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 2, 4, 8, 16, 64, 256, 1024])
def test_gpu_bf16_qwen3_30b_a3b_shape(t):
    """bf16 at the Qwen3-30B-A3B expert shape (128 experts, top-8, H 2048, I 768) with the
    picked tile config, against the torch path in float32 from the same bf16 weights."""
    dev = _dev("cuda")
    x, w13, w2, w, ids = _problem(t, 128, 2048, 768, 8, torch.bfloat16, dev)
    table = fused_moe.load_tile_configs(128, 768)
    got = fused_moe.fused_experts(x, w13, w2, w, ids, tile_configs=table)
    ref = fused_experts_torch(x.float(), w13.float(), w2.float(), w, ids)
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 2])
@pytest.mark.parametrize("w13, w2", [(2, 3), (4, 1), (1, 3)])
def test_gpu_split_k_qwen3_30b_a3b_shape(t, w13, w2):
    """The GEMV path's split-K at the Qwen3-30B-A3B expert shape (gate/up K 2048 in 512-column
    chunks, down K 768 in 256-column ones, fused k-sum and not), against the float32 torch
    path, and bitwise equal to itself on a second call."""
    dev = _dev("cuda")
    x, w13s, w2s, w, ids = _problem(t, 128, 2048, 768, 8, torch.bfloat16, dev)
    ref = fused_experts_torch(x.float(), w13s.float(), w2s.float(), w, ids)
    for fuse in (True, False):
        cfg = {"small_batch": True, "w13": {"BLOCK_SIZE_N": 8, "BLOCK_SIZE_K": 512, "num_warps": 2, "SPLIT_K": w13},
               "w2": {"BLOCK_SIZE_N": 4, "BLOCK_SIZE_K": 256, "num_warps": 2, "SPLIT_K": w2, "FUSE_SUM": fuse}}
        got = fused_moe.fused_experts(x, w13s, w2s, w, ids, config=cfg)
        torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)
        assert torch.equal(got, fused_moe.fused_experts(x, w13s, w2s, w, ids, config=cfg))


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [GEMV, GROUPED, None, {**GEMV, "SPLIT_K": 2}])
def test_gpu_cuda_graph_replay(cfg):
    """Captured once, replayed with new routing: no host sync in the path, results follow
    the inputs."""
    dev = _dev("cuda")
    x, w13, w2, w, ids = _problem(4, 16, 256, 128, 2, torch.bfloat16, dev)
    fused_moe.fused_experts(x, w13, w2, w, ids, config=cfg)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fused_moe.fused_experts(x, w13, w2, w, ids, config=cfg)
    x2, _, _, w_new, ids_new = _problem(4, 16, 256, 128, 2, torch.bfloat16, dev, seed=5)
    x.copy_(x2)
    w.copy_(w_new)
    ids.copy_(ids_new)
    g.replay()
    torch.cuda.synchronize()
    ref = fused_experts_torch(x.float(), w13.float(), w2.float(), w, ids)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
