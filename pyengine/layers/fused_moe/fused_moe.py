"""Fused MoE in Triton (the role of vllm/model_executor/layers/fused_moe/fused_moe.py).

``fused_experts(hidden, w13, w2, topk_weights, topk_ids)`` computes, for every token, the
routing-weighted sum of its top-k experts' SiLU-gated MLPs with two kernel passes over
the (token, slot) pairs and one sum:

1. gate/up: ``inter[p] = silu(x[t] @ gate_e^T) * (x[t] @ up_e^T)`` for pair p = (t, slot)
   routed to expert e, SiLU-and-mul fused into the GEMM (two accumulators, one for the
   gate rows and one for the up rows of the same output columns);
2. down: ``out[p] = w[p] * (inter[p] @ down_e^T)``;
3. ``out.view(T, k, H).sum(1)`` (float32 accumulation in torch's reduction).

The roundings are transformers' (``moe_torch``): each GEMM's output, the SiLU and the
gate*up product are rounded to the activation dtype; the routing weight and its product
too when the router casts its weights (Qwen-MoE, ``cast_weights``), else the product is
float32 until the sum (Mixtral). In float32 none of this rounds.

Two ways to run passes 1 and 2, picked per number of tokens M by the tile config:

* grouped GEMM (``_grouped_kernel``): the pairs are sorted by expert and each expert's
  run padded to a multiple of BLOCK_SIZE_M (``moe_align_block_size``, vLLM's name; three
  small Triton kernels), so every M-block of the sorted list belongs to one expert; a
  program computes one (M-block, N-block) tile with ``tl.dot`` and reads that expert's
  weight tile only: each chosen expert's weights are read once per M-block of its pairs.
* small batch (``_gemv_kernel``): one program per (pair, N-block), a GEMV over the
  pair's own expert; no sorting at all. It reads only the chosen experts' weights, which
  at batch 1 is all a decode step has to read. Its down pass sums the token's k slots in
  the accumulator (``_gemv_down_sum_kernel``, one program per (token, N-block); the
  w2 tile's ``"FUSE_SUM": false`` keeps the per-pair pass and the separate sum). It reads
  an expert's weights once per pair routed to it, so it is for a few tokens only: at 4096
  tokens (Qwen3-30B-A3B's shape) that is 300 GB a layer, 40 ms on the H200.

The router's softmax + top-k + renormalisation is one kernel too (``topk_softmax``).

FP8 expert weights (weight-only, W8A16): w13 / w2 may be ``torch.float8_e4m3fn`` with
float32 scales, per output channel (``w13_scale`` [E, 2I], ``w2_scale`` [E, H]) or per
(bn, bk) block (``block_shape``, DeepSeek / Qwen3-FP8 style: [E, ceil(2I/bn), ceil(H/bk)]
and [E, ceil(H/bn), ceil(I/bk)], element (r, c) scaled by ``scale[e, r // bn, c // bk]``).
The activations stay bf16 / fp16 / float32: every kernel dequantizes each weight it loads
to the activation dtype, ``(w.float() * scale).to(hidden.dtype)``, before its product (the
GEMV's FMA loop, the grouped GEMM's ``tl.dot`` on the dequantized B tile), as vLLM's
weight-only FP8 (Marlin) MoE path does where its FP8 MoE kernels don't run. The result is
therefore ``fused_experts`` on the dequantized weights: bit for bit under the interpreter
(same sums in the same order), and to the GEMMs' own rounding on the GPU. FP8 halves the
weight bytes a decode step reads; the per-element dequantization costs a few ALU
operations a weight (block scales: a gathered scale load a weight on the GEMV path and
where BLOCK_SIZE_K does not divide bk; one row of scales a K chunk where it does).

Packed integer expert weights (weight-only W4A16 / W8A16, GPTQ / AWQ / compressed-tensors
style): w13 / w2 int32 words, ``weight_bits`` 4 or 8, packed along K (per = 32 // bits
unsigned values a word, logical column c in bits [(c % per) * bits, ...) of word c // per:
``quantization.utils.pack_int32(q, bits, dim=-1)``), with float32 scales per group of gs
columns (``block_shape`` (1, gs); None: per output channel), [E, rows, K / gs], and float32
zero points of that shape or none (symmetric: 2**(bits - 1)). As for FP8, every kernel
dequantizes what it loads, ``((q - zero) * scale)`` in float32 rounded to the activation
dtype, so the result is again ``fused_experts`` on the dequantized weights (bit for bit
under the interpreter). A GEMV chunk reads BLOCK_SIZE_K / per words a row and the grouped
GEMM a [BLOCK_SIZE_K / per, BLOCK_SIZE_N] word tile a K chunk, each word once; the values
are shifted out along a new axis after the word axis and a row-major reshape lays them out
as columns (vLLM's ``fused_moe_kernel_gptq_awq`` instead loads, for each value, the byte
holding it). Scales and zeros are loaded a row a K chunk where BLOCK_SIZE_K divides gs, else
one a word (one a value where a word's values span groups). INT4 quarters the bf16 weight
bytes a decode step reads. Except on the GEMV path where a group is whole words (gs a
multiple of 32 / bits: every real checkpoint): there ``_int_gemv_kernel`` and
``_int_gemv_down_sum_kernel`` run the dense int GEMV's chunks (pyengine/ops/quant.py): each
thread's 1-4 consecutive words lie in one group, a value becomes a float by one AND-OR with
the bits of 2**23 and one subtraction (no conversion instruction), and the group's scale
multiplies ``sum(q * x) - zero * sum(x)`` once. The weights are then not rounded to the
activation dtype one by one: the result is ``fused_experts`` on the dequantized weights to
float32 rounding (and to the bf16 weights' own rounding), not bit for bit. The general
kernels unpacked a tile into a [rows, BLOCK_SIZE_K] float32 block a chunk, all chunks
unrolled: at the Qwen3-30B-A3B shape the gate/up pass's build for sm_90 used 255 registers
and spilled 1 KB a thread, with an integer-to-float conversion a value.

Everything stays on the device with shapes fixed by M (no host sync, no data-dependent
launch size): CUDA-graph safe. Accumulation is float32; float32 inputs use IEEE products
in ``tl.dot`` (no TF32), so a float32 model stays token-exact.

Tile configs: ``configs/E=<E>,N=<N>,device_name=<GPU>.json`` (vLLM's file naming; E the
experts this rank holds, N its intermediate size), a map from M to a config:
``{"BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps",
"num_stages"}`` for the grouped GEMM, or ``{"small_batch": true, "BLOCK_SIZE_N",
"BLOCK_SIZE_K", "num_warps"}`` for the GEMV path; optional ``"w13"`` / ``"w2"`` sub-maps
override a field for one pass. The entry of the M nearest in ratio is used when it is
within a factor of 2, else ``get_default_config`` (also without a file): a table swept at a
few Ms says nothing about the others. ``benchmarks/moe.py --sweep`` (``--sweep-quick``: M
1, 16, 256, 4096 in about a minute) writes the files, merged with the entries already there.
A GEMV-path pass may also set ``"SPLIT_K"`` (default 1; 1-64): that many programs a
(pair, N-block) along K, each a run of whole BLOCK_SIZE_K chunks, writing float32 sums
that a finish pass (``_gemv_split_finish_kernel``) adds in split order before the SiLU,
the routing weight and the k-sum, so the roundings stay transformers'; a value that
leaves a split without a chunk is refused (ValueError) before anything runs.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import triton
import triton.language as tl

from pyengine.ops import pdl, smem
from pyengine.ops.quant import MAGIC_2_23, int_gemv_chunk, int_gemv_words

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
PASSES = ("w13", "w2")
# Under triton's interpreter (CPU tests) the kernels round to bf16 in integer arithmetic
# and take float32 dot operands: its own conversions truncate and its bf16 dot is unreliable.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


# ---- tile configs ----------------------------------------------------------------------

def get_config_file_name(num_experts: int, n: int, device_name: str | None = None, dtype: str | None = None) -> str:
    """``E=<num_experts>,N=<n>,device_name=<name>.json`` (spaces in the name as ``_``), with
    ``,dtype=<dtype>`` before ``.json`` for a table of quantized experts (vLLM's names:
    ``int4_w4a16``, ``int8_w8a16``; ``weight_dtype_key``); ``device_name`` defaults to the
    current CUDA device's (vllm/model_executor/layers/fused_moe/fused_moe.py's names)."""
    if device_name is None:
        device_name = torch.cuda.get_device_name()
    suffix = f",dtype={dtype}" if dtype else ""
    return f"E={num_experts},N={n},device_name={device_name.replace(' ', '_')}{suffix}.json"


def weight_dtype_key(weight_bits: int | None) -> str | None:
    """The tile-table key of packed integer experts of ``weight_bits`` bits (W4A16 / W8A16),
    None for float and FP8 experts (their table is the unkeyed one)."""
    return {4: "int4_w4a16", 8: "int8_w8a16"}.get(weight_bits or 0)


def load_tile_configs(num_experts: int, n: int, device_name: str | None = None,
                      config_dir: Path = CONFIG_DIR, dtype: str | None = None) -> dict[int, dict] | None:
    """The tile-config table of this shape, device and weight ``dtype`` key (M -> config),
    or None without a file. Raises ValueError for a file that is not such a table."""
    path = Path(config_dir) / get_config_file_name(num_experts, n, device_name, dtype)
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
        table = {int(m): dict(cfg) for m, cfg in raw.items()}
    except (ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: not a fused-MoE tile config table ({e})") from None
    for m, cfg in table.items():
        for which in ("", *PASSES):
            fields = cfg if not which else cfg.get(which, {})
            if not isinstance(fields, dict):
                raise ValueError(f"{path}: M={m}: {which} must be a JSON object of overrides, got {fields!r}")
            if "SPLIT_K" in fields:
                if not cfg.get("small_batch"):
                    raise ValueError(f"{path}: M={m}: SPLIT_K is a GEMV-path (small_batch) field")
                if not _split_k_ok(fields["SPLIT_K"]):
                    raise ValueError(f"{path}: M={m}: SPLIT_K must be an integer in [1, 64], got "
                                     f"{fields['SPLIT_K']!r}")
    return table or None


def get_default_config(m: int, num_experts: int, n: int, k: int, top_k: int, weight_bits: int | None = None) -> dict:
    """A tile config without a sweep: the GEMV path up to 4 tokens, else a grouped-GEMM tile
    that grows with the pairs each expert gets (``m * top_k / E``): BLOCK_SIZE_M about that
    many rows (padding past it is wasted MMA work), wide N and K tiles while the pass is
    bandwidth-bound, vLLM's large-M H200 tile (128 x 256 x 64, 8 warps, 4 stages) once it is
    compute-bound. The gate/up pass computes BLOCK_SIZE_N gate and BLOCK_SIZE_N up columns,
    so its N tile is half the down pass's for the same work and shared memory. ``n``: the
    intermediate size (the down pass's K), ``k``: the hidden size (gate/up's K). N and K
    tiles never exceed the next power of two of their dims (tiny test shapes).
    ``weight_bits`` (packed integer experts): the GEMV path's tiles for the word kernels,
    the picks of ``benchmarks/moe.py --sections int_tiles`` on an H100 at Qwen3-30B-A3B's
    shape (2026-12-08): gate/up 16 rows a program in chunks of 128 words (32 threads of 4
    words, 4 warps), down 8 rows in chunks of 64 words over 2 warps, K split in two where it
    holds two chunks (the experts' whole batch-1 pair 18.0 us against 51.5 us on 32-word
    chunks; bf16's 46.7)."""
    if m <= 4 and weight_bits:
        per = 32 // weight_bits
        cfg = {"small_batch": True, "w13": {"BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 128 * per, "num_warps": 4},
               "w2": {"BLOCK_SIZE_N": 8, "BLOCK_SIZE_K": 64 * per, "num_warps": 2}}
        if triton.cdiv(n, _gemv_block_k(cfg["w2"], n, weight_bits)) >= 2:  # two chunks or more
            cfg["w2"]["SPLIT_K"] = 2
        return _interpreter_rows(cfg, n, k)
    if m <= 4:
        # GEMV tiles: at most ~64 float32 accumulators a thread (gate/up keeps two), K in
        # few unrolled chunks (down's K, the intermediate size, can be 14336: Mixtral). Up to
        # 2048 wide, the H200 sweep's picks at Qwen3-30B-A3B's shape (E=128, N=768): small
        # programs, many of them — the down pass's one program per (token, N-block) otherwise
        # leaves the GPU a program an SM (16-row tiles: 128 programs, 4x that pass's bandwidth
        # floor on an H100, 2026-12-07).
        cfg = {"small_batch": True,
               "w13": {"BLOCK_SIZE_N": 8 if k <= 4096 else 4, "BLOCK_SIZE_K": 512 if k <= 4096 else 1024,
                       "num_warps": 2 if k <= 2048 else 4},
               "w2": {"BLOCK_SIZE_N": 2 if n <= 2048 else 4, "BLOCK_SIZE_K": 1024,
                      "num_warps": 2 if n <= 2048 else 4}}
        return _interpreter_rows(cfg, n, k)
    pairs_per_expert = m * top_k / max(1, num_experts)
    # (BLOCK_SIZE_M, gate/up BLOCK_SIZE_N, down BLOCK_SIZE_N, BLOCK_SIZE_K, GROUP_SIZE_M, warps, stages)
    if pairs_per_expert <= 2:  # about one M-block per chosen expert
        bm, bn13, bn2, bk, gm, nw, ns = 16, 64, 64, 128, 1, 4, 3
    elif pairs_per_expert <= 8:  # GROUP_SIZE_M: an expert's M-blocks share its B tiles in L2
        bm, bn13, bn2, bk, gm, nw, ns = 16, 64, 128, 128, 8, 4, 3
    elif pairs_per_expert <= 32:
        bm, bn13, bn2, bk, gm, nw, ns = 32, 128, 256, 64, 8, 4, 3
    elif pairs_per_expert < 64:
        bm, bn13, bn2, bk, gm, nw, ns = 64, 64, 128, 64, 8, 4, 3
    else:
        bm, bn13, bn2, bk, gm, nw, ns = 128, 128, 256, 64, 8, 8, 4
    return {"BLOCK_SIZE_M": bm, "GROUP_SIZE_M": gm, "num_warps": nw, "num_stages": ns,
            "w13": {"BLOCK_SIZE_N": _fit_tile(bn13, n), "BLOCK_SIZE_K": _fit_tile(bk, k)},
            "w2": {"BLOCK_SIZE_N": _fit_tile(bn2, k), "BLOCK_SIZE_K": _fit_tile(bk, n)}}


def _interpreter_rows(cfg: dict, n: int, k: int) -> dict:
    # under triton's interpreter a program costs Python time per operation whatever its
    # tile: GEMV tiles of up to 64 rows a program (a tiny model's down pass in 1 program, not
    # 32), the same sums in the same order (a row's sum does not depend on the tile's rows)
    if _INTERPRET:
        cfg["w13"]["BLOCK_SIZE_N"] = min(64, triton.next_power_of_2(n))
        cfg["w2"]["BLOCK_SIZE_N"] = min(64, triton.next_power_of_2(k))
    return cfg


def _fit_tile(block: int, dim: int) -> int:
    # a tile no wider than the dim's next power of two (and at least tl.dot's 16)
    return max(16, min(block, triton.next_power_of_2(max(1, dim))))


def pick_config(table: dict[int, dict] | None, m: int, num_experts: int, n: int, k: int, top_k: int,
                weight_bits: int | None = None) -> dict:
    """The entry of ``table`` for the M nearest ``m`` in ratio (ties: the smaller M) when it
    is within a factor of 2 of ``m``, else ``get_default_config``: an entry measured at one
    M says little about an M far from it (a table holding only M=1's GEMV tile must not
    send M=4096 down the GEMV path, which reads an expert's weights once per pair)."""
    if table:
        key = min(table, key=lambda key: (max(key, m) / max(1, min(key, m)), key))
        if max(key, m) <= 2 * max(1, min(key, m)):
            return table[key]
    return get_default_config(m, num_experts, n, k, top_k, weight_bits)


def pass_config(cfg: dict, which: str) -> dict:
    """``cfg`` with its ``which`` ("w13" | "w2") overrides applied (the other pass's dropped)."""
    out = {key: v for key, v in cfg.items() if key not in PASSES}
    out.update(cfg.get(which, {}))
    return out


# ---- sorting pairs by expert -----------------------------------------------------------

# Alignment tiles: a program's one-hot tile (pairs x buckets) has about this many elements.
_ALIGN_TILE = 4096
# At most this many programs count and scatter the pairs (each a contiguous run of them):
# the prefix over their counts, in one program, stays a few tile loads long.
_ALIGN_MAX_PROGRAMS = 256


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int,
                         expert_map: torch.Tensor | None = None):
    """Sort the (token, slot) pairs by expert and pad each expert's run to a multiple of
    ``block_m`` (vLLM's ``moe_align_block_size``) in three Triton kernels: no host sync,
    output sizes that depend on the shapes only (CUDA-graph safe), and a cost of a few
    microseconds at any batch size (torch's cumsum down a [pairs, experts] one-hot ran one
    thread per expert along all the pairs).

    topk_ids: int [T, k] global expert ids; num_experts: experts this rank holds;
    expert_map: int32 [E_global] (global -> local, -1 elsewhere) or None. Returns
    ``(sorted_ids int32 [P], expert_ids int32 [P / block_m], num_post_padded int32 [1])``:
    ``sorted_ids`` lists pair indices (t * k + slot) expert by expert, in pair order within
    an expert, padding entries equal to T * k; ``expert_ids[b]`` is the local expert of
    block b, -1 for a block of pairs routed to another rank's experts (their own bucket,
    after the local ones) or past the end; ``num_post_padded`` is the used length of
    ``sorted_ids``. P = ceil((T*k + buckets * (block_m - 1)) / block_m) * block_m.
    """
    flat = topk_ids.reshape(-1).to(torch.int32).contiguous()
    n = flat.numel()
    dev = flat.device
    buckets = num_experts + (expert_map is not None)  # other ranks' pairs: one extra bucket
    b_pad = triton.next_power_of_2(buckets)
    sub = max(16, min(512, _ALIGN_TILE // b_pad))  # pairs per one-hot tile
    per = max(sub, triton.cdiv(triton.cdiv(n, _ALIGN_MAX_PROGRAMS), sub) * sub)  # pairs per program
    programs = max(1, triton.cdiv(n, per))
    size = triton.cdiv(n + buckets * (block_m - 1), block_m) * block_m
    num_blocks = size // block_m
    emap = expert_map.to(torch.int32).contiguous() if expert_map is not None else flat
    counts = torch.empty((programs, b_pad), dtype=torch.int32, device=dev)
    starts = torch.empty(b_pad, dtype=torch.int32, device=dev)
    sorted_ids = torch.full((size,), n, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    npost = torch.empty(1, dtype=torch.int32, device=dev)
    has_emap = expert_map is not None
    _align_count_kernel[(programs,)](flat, emap, counts, n, per, num_experts, HAS_EMAP=has_emap, SUB=sub,
                                     B_PAD=b_pad, num_warps=4)
    _align_offsets_kernel[(1,)](counts, starts, expert_ids, npost, programs, buckets, num_experts, num_blocks,
                                block_m, B_PAD=b_pad, ROWS=max(1, _ALIGN_TILE // b_pad), num_warps=4)
    _align_scatter_kernel[(programs,)](flat, emap, counts, starts, sorted_ids, n, per, num_experts,
                                       HAS_EMAP=has_emap, SUB=sub, B_PAD=b_pad, num_warps=4)
    return sorted_ids, expert_ids, npost


@triton.jit
def _align_bucket(ids_ptr, emap_ptr, offs, n, num_local, HAS_EMAP: tl.constexpr):
    # The bucket of each pair in offs: its local expert, num_local for another rank's
    # expert (expert map), -1 past the end.
    valid = offs < n
    e = tl.load(ids_ptr + offs, mask=valid, other=0)
    if HAS_EMAP:
        e = tl.load(emap_ptr + e, mask=valid, other=0)
        e = tl.where(e < 0, num_local, e)
    return tl.where(valid, e, -1)


@triton.jit(do_not_specialize=["n", "per"])
def _align_count_kernel(ids_ptr, emap_ptr, counts_ptr, n, per, num_local, HAS_EMAP: tl.constexpr,
                        SUB: tl.constexpr, B_PAD: tl.constexpr):
    # counts[p, b] = pairs of bucket b among program p's run [p * per, (p + 1) * per).
    pid = tl.program_id(0)
    rb = tl.arange(0, B_PAD)
    cnt = tl.zeros([B_PAD], dtype=tl.int32)
    for s in range(0, per, SUB):
        b = _align_bucket(ids_ptr, emap_ptr, pid * per + s + tl.arange(0, SUB), n, num_local, HAS_EMAP)
        cnt += tl.sum((b[:, None] == rb[None, :]).to(tl.int32), axis=0)
    tl.store(counts_ptr + pid * B_PAD + rb, cnt)


@triton.jit(do_not_specialize=["programs", "num_blocks"])
def _align_offsets_kernel(counts_ptr, starts_ptr, expert_ptr, npost_ptr, programs, buckets, num_local,
                          num_blocks, block_m, B_PAD: tl.constexpr, ROWS: tl.constexpr):
    # One program: counts[p, b] becomes the number of bucket-b pairs in the runs before p
    # (an exclusive prefix down the programs); each bucket's padded run starts at
    # starts[b]; the block -> expert map and the used length.
    rb = tl.arange(0, B_PAD)
    rr = tl.arange(0, ROWS)
    total = tl.zeros([B_PAD], dtype=tl.int32)
    for r0 in range(0, programs, ROWS):
        rows = r0 + rr
        ptrs = counts_ptr + rows[:, None] * B_PAD + rb[None, :]
        m = (rows[:, None] < programs) & (rb[None, :] < B_PAD)
        c = tl.load(ptrs, mask=m, other=0)
        tl.store(ptrs, tl.cumsum(c, axis=0) - c + total[None, :], mask=m)
        total += tl.sum(c, axis=0)
    padded = (total + block_m - 1) // block_m * block_m
    ends = tl.cumsum(padded, axis=0)
    tl.store(starts_ptr + rb, ends - padded)
    tl.store(npost_ptr, tl.sum(padded, axis=0))
    real = rb < buckets
    for b0 in range(0, num_blocks, ROWS):
        blk = b0 + rr
        # the bucket of block blk: how many buckets end at or before its first slot
        e = tl.sum(((ends[None, :] <= (blk * block_m)[:, None]) & real[None, :]).to(tl.int32), axis=1)
        tl.store(expert_ptr + blk, tl.where(e < num_local, e, -1), mask=blk < num_blocks)


@triton.jit(do_not_specialize=["n", "per"])
def _align_scatter_kernel(ids_ptr, emap_ptr, counts_ptr, starts_ptr, sorted_ptr, n, per, num_local,
                          HAS_EMAP: tl.constexpr, SUB: tl.constexpr, B_PAD: tl.constexpr):
    # Each pair of program p's run to its slot: its bucket's start, plus the bucket's pairs
    # in earlier runs, plus its rank among the bucket's pairs in this run.
    pid = tl.program_id(0)
    rb = tl.arange(0, B_PAD)
    nxt = tl.load(counts_ptr + pid * B_PAD + rb) + tl.load(starts_ptr + rb)  # next free slot per bucket
    for s in range(0, per, SUB):
        offs = pid * per + s + tl.arange(0, SUB)
        b = _align_bucket(ids_ptr, emap_ptr, offs, n, num_local, HAS_EMAP)
        hot = (b[:, None] == rb[None, :]).to(tl.int32)
        slot = tl.sum(hot * (tl.cumsum(hot, axis=0) - 1 + nxt[None, :]), axis=1)
        tl.store(sorted_ptr + slot, offs, mask=offs < n)
        nxt += tl.sum(hot, axis=0)


# ---- kernels ---------------------------------------------------------------------------

@triton.jit
def _round(x, ACT: tl.constexpr, EMULATE: tl.constexpr):
    # float32 x rounded to the activation dtype ACT (to nearest, ties to even), as float32.
    # EMULATE (the interpreter, whose float32 -> bf16 conversion truncates): bf16 rounding in
    # integer arithmetic on the bits.
    if EMULATE:
        if ACT == tl.bfloat16:
            b = x.to(tl.uint32, bitcast=True)
            b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
            return b.to(tl.float32, bitcast=True)
        else:
            return x.to(ACT).to(tl.float32)
    else:
        return x.to(ACT).to(tl.float32)


@triton.jit
def _silu_and_mul(gate, up, ACT: tl.constexpr, EMULATE: tl.constexpr):
    # transformers' act_fn(gate) * up on GEMM outputs in the activation dtype ACT: gate and
    # up rounded to ACT, SiLU rounded, then the product (the caller rounds it). In float32
    # the roundings are exact.
    g = _round(gate, ACT, EMULATE)
    s = _round(g / (1.0 + tl.exp(-g)), ACT, EMULATE)
    return s * _round(up, ACT, EMULATE)


@triton.jit
def _times_weight(acc, w, ACT: tl.constexpr, CAST_W: tl.constexpr, EMULATE: tl.constexpr):
    # The down projection's output (rounded to ACT, as the GEMM's) times the routing weight
    # w (float32): with CAST_W the weight is rounded to ACT and so is the product (Qwen-MoE);
    # else a float32 product (Mixtral).
    y = _round(acc, ACT, EMULATE)
    if CAST_W:
        y = _round(y * _round(w, ACT, EMULATE), ACT, EMULATE)
    else:
        y = y * w
    return y


@triton.jit
def _scaled(w, s_base, rows, cols, mask, row_scale, stride_sn, stride_sk, BLOCK_SCALED: tl.constexpr,
            BN_S: tl.constexpr, BK_S: tl.constexpr):
    # An FP8 weight tile w times its float32 scales, in float32 (not rounded): per output row
    # (row_scale, already broadcast to w's shape by the caller), or per BN_S x BK_S block,
    # gathered per element from the expert's scales s_base at [rows // BN_S, cols // BK_S]
    # (rows and cols broadcastable to w's shape; a scalar cols when the tile's columns lie in
    # one block).
    if BLOCK_SCALED:
        s = tl.load(s_base + (rows // BN_S) * stride_sn + (cols // BK_S) * stride_sk, mask=mask, other=0.0)
    else:
        s = row_scale
    return w.to(tl.float32) * s


@triton.jit
def _gemv_weight(w, s_base, rows, cols, mask, row_scale, stride_sn, stride_sk, ACT: tl.constexpr,
                 EMULATE: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_SCALED: tl.constexpr, BN_S: tl.constexpr,
                 BK_S: tl.constexpr):
    # A GEMV weight tile as float32 values of the activation dtype ACT: a float weight as it
    # is; an FP8 one dequantized, (w * scale) rounded to ACT (``_scaled``).
    if HAS_SCALE:
        return _round(_scaled(w, s_base, rows, cols, mask, row_scale, stride_sn, stride_sk, BLOCK_SCALED, BN_S, BK_S),
                      ACT, EMULATE)
    else:
        return w.to(tl.float32)


@triton.jit
def _int_weight(words, k, wc, wmask, rows, rmask, s_base, z_base, stride_sn, stride_sk, BITS: tl.constexpr,
                GS: tl.constexpr, HAS_ZP: tl.constexpr, BLOCK_K: tl.constexpr, K_FIRST: tl.constexpr):
    # Packed integer weights -> ((q - zero) * scale) in float32 (not rounded), [R, BLOCK_K]
    # (K_FIRST: [BLOCK_K, R]) of columns [k, k + BLOCK_K), k a multiple of BLOCK_K. words:
    # int32 [R, BLOCK_K / PER] ([BLOCK_K / PER, R]) at word columns wc (wmask: inside K);
    # rows [R]: their weight rows (rmask: existing). Value j of a word is bits [j * BITS,
    # (j + 1) * BITS): unpacked along a new axis after the word axis, so a row-major reshape
    # puts it at column word * PER + j. Scale and zero of (r, c): [r, c // GS].
    PER: tl.constexpr = 32 // BITS
    rj = tl.arange(0, PER)
    if K_FIRST:  # [words, PER, R]
        w3 = words[:, None, :]
        sh = (rj * BITS)[None, :, None]
        j3 = rj[None, :, None]
        r3 = rows[None, None, :]
        rm3 = rmask[None, None, :]
        wc3 = wc[:, None, None]
        wm3 = wmask[:, None, None]
    else:  # [R, words, PER]
        w3 = words[:, :, None]
        sh = (rj * BITS)[None, None, :]
        j3 = rj[None, None, :]
        r3 = rows[:, None, None]
        rm3 = rmask[:, None, None]
        wc3 = wc[None, :, None]
        wm3 = wmask[None, :, None]
    q = ((w3 >> sh) & ((1 << BITS) - 1)).to(tl.float32)  # the arithmetic shift's sign bits masked off
    if GS % BLOCK_K == 0:  # the chunk lies in one group: a scale a row
        off = r3 * stride_sn + (k // GS) * stride_sk
        m = rm3
    elif GS % PER == 0:  # a word's values share a group: a scale a word
        off = r3 * stride_sn + (wc3 // (GS // PER)) * stride_sk
        m = rm3 & wm3
    else:
        off = r3 * stride_sn + ((wc3 * PER + j3) // GS) * stride_sk
        m = rm3 & wm3
    s = tl.load(s_base + off, mask=m, other=0.0)
    if HAS_ZP:
        z = tl.load(z_base + off, mask=m, other=0.0)
        w = (q - z) * s
    else:
        w = (q - (1 << (BITS - 1))) * s
    R: tl.constexpr = rows.shape[0]
    if K_FIRST:
        return tl.reshape(w, [BLOCK_K, R])
    else:
        return tl.reshape(w, [R, BLOCK_K])


@triton.jit
def _gemv_tile(b_rows, k, rows, rmask, row_scale, s_base, z_base, stride_sn, stride_sk, K: tl.constexpr,
               ACT: tl.constexpr, EMULATE: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_SCALED: tl.constexpr,
               BN_S: tl.constexpr, BK_S: tl.constexpr, INT_BITS: tl.constexpr, HAS_ZP: tl.constexpr,
               BLOCK_K: tl.constexpr):
    # Columns [k, k + BLOCK_K) of the weight rows at b_rows ([R, 1] pointers; rows [R] their
    # indices, rmask which exist) as float32 values of ACT, [R, BLOCK_K]: ``_gemv_weight``,
    # or INT_BITS-bit integers read as the chunk's BLOCK_K / PER words a row and dequantized
    # (``_int_weight``, BK_S its group size) then rounded to ACT.
    if INT_BITS:
        PER: tl.constexpr = 32 // INT_BITS
        wc = k // PER + tl.arange(0, BLOCK_K // PER)
        wmask = wc < K // PER
        words = tl.load(b_rows + wc[None, :], mask=rmask[:, None] & wmask[None, :], other=0)
        return _round(_int_weight(words, k, wc, wmask, rows, rmask, s_base, z_base, stride_sn, stride_sk, INT_BITS,
                                  BK_S, HAS_ZP, BLOCK_K, False), ACT, EMULATE)
    else:
        cols = k + tl.arange(0, BLOCK_K)
        mask = rmask[:, None] & (cols < K)[None, :]
        w = tl.load(b_rows + cols[None, :], mask=mask, other=0.0)
        return _gemv_weight(w, s_base, rows[:, None], cols[None, :], mask, row_scale, stride_sn, stride_sk, ACT,
                            EMULATE, HAS_SCALE, BLOCK_SCALED, BN_S, BK_S)


@triton.jit
def _grouped_b(b, k0, rows, nmask, bmask, row_scale, s_base, z_base, stride_sn, stride_sk, K, ACT: tl.constexpr,
               IEEE: tl.constexpr, EMULATE: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_SCALED: tl.constexpr,
               BN_S: tl.constexpr, BK_S: tl.constexpr, S_K_UNIFORM: tl.constexpr, INT_BITS: tl.constexpr,
               HAS_ZP: tl.constexpr, BLOCK_K: tl.constexpr):
    # A grouped-GEMM B tile as loaded (columns [k0, k0 + BLOCK_K) of weight rows ``rows``
    # [BLOCK_N]; int32 words [BLOCK_K / PER, BLOCK_N] with INT_BITS) as tl.dot's operand:
    # FP8 or integer weights dequantized and rounded to ACT (float32 values of it under
    # EMULATE, whose low-precision dot is unreliable; float32 for IEEE).
    if INT_BITS:
        PER: tl.constexpr = 32 // INT_BITS
        wc = k0 // PER + tl.arange(0, BLOCK_K // PER)
        b = _int_weight(b, k0, wc, wc < K // PER, rows, nmask, s_base, z_base, stride_sn, stride_sk, INT_BITS, BK_S,
                        HAS_ZP, BLOCK_K, True)
    elif HAS_SCALE:
        if S_K_UNIFORM:
            b = _scaled(b, s_base, rows[None, :], k0, nmask[None, :], row_scale, stride_sn, stride_sk, BLOCK_SCALED,
                        BN_S, BK_S)
        else:
            b = _scaled(b, s_base, rows[None, :], (k0 + tl.arange(0, BLOCK_K))[:, None], bmask, row_scale, stride_sn,
                        stride_sk, BLOCK_SCALED, BN_S, BK_S)
    if HAS_SCALE:
        if EMULATE:
            b = _round(b, ACT, EMULATE)
        elif not IEEE:
            b = b.to(ACT)
    if EMULATE:
        b = b.to(tl.float32)
    return b


@triton.jit(do_not_specialize=["EM", "num_valid"])  # one compiled variant whatever the batch size
def _grouped_kernel(a_ptr, b_ptr, c_ptr, w_ptr, sorted_ptr, expert_ptr, npost_ptr,
                    N, K, EM, num_valid, stride_am, stride_be, stride_bn, stride_cm,
                    s_ptr, z_ptr, stride_se, stride_sn, stride_sk,
                    A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, CAST_W: tl.constexpr,
                    IEEE: tl.constexpr, EMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, HAS_SCALE: tl.constexpr,
                    BLOCK_SCALED: tl.constexpr, BN_S: tl.constexpr, BK_S: tl.constexpr, S_K_UNIFORM: tl.constexpr,
                    INT_BITS: tl.constexpr, HAS_ZP: tl.constexpr):
    # One (M-block of sorted pairs, N-block) tile: C[pairs, n] = A[rows of pairs] @ B[e]^T.
    # HAS_SCALE: B is FP8 with scales at s_ptr (``_scaled``), each tile dequantized to a's
    # dtype (float32 values of it under EMULATE) before the dot; S_K_UNIFORM: BLOCK_K divides
    # BK_S, so a K chunk's block scales are one row of them per N column. INT_BITS: B is
    # packed integers (K / PER int32 words a row) with group scales (and zeros at z_ptr,
    # HAS_ZP), a K chunk's tile read as BLOCK_K / PER words a column (``_grouped_b``).
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(EM, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_pid_n  # M-blocks walked in groups so their B tiles stay in L2
    first_m = (pid // group) * GROUP_M
    group_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % group_m
    pid_n = (pid % group) // group_m
    if pid_m * BLOCK_M >= tl.load(npost_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ptr + offs_m).to(tl.int64)
    pmask = pairs < num_valid
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    c_ptrs = c_ptr + pairs[:, None] * stride_cm + rn[None, :]
    cmask = pmask[:, None] & nmask[None, :]
    e = tl.load(expert_ptr + pid_m).to(tl.int64)
    if e < 0:  # pairs of another rank's experts: they add nothing here
        tl.store(c_ptrs, tl.zeros([BLOCK_M, BLOCK_N], dtype=c_ptr.dtype.element_ty), mask=cmask)
        return
    rk = tl.arange(0, BLOCK_K)
    PER: tl.constexpr = 32 // INT_BITS if INT_BITS else 1  # K values a B element (an int32 word)
    rkb = tl.arange(0, BLOCK_K // PER)
    a_ptrs = a_ptr + (pairs // A_ROW_DIV)[:, None] * stride_am + rk[None, :]
    b_ptrs = b_ptr + e * stride_be + rn[None, :] * stride_bn + rkb[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    ACT: tl.constexpr = a_ptr.dtype.element_ty
    s_base = s_ptr + e * stride_se
    z_base = z_ptr + e * stride_se
    s_gate = 1.0
    s_up = 1.0
    if HAS_SCALE and not BLOCK_SCALED:  # per-channel: the tile's columns' scales, once
        s_gate = tl.load(s_base + rn * stride_sn, mask=nmask, other=0.0)[None, :]
        if GATED:
            s_up = tl.load(s_base + (rn + N) * stride_sn, mask=nmask, other=0.0)[None, :]
    for k0 in range(0, K, BLOCK_K):
        kmask = rk < K - k0
        bmask = (rkb < (K - k0) // PER)[:, None] & nmask[None, :]  # K % PER == 0: whole words
        a = tl.load(a_ptrs, mask=pmask[:, None] & kmask[None, :], other=0.0)
        b = _grouped_b(tl.load(b_ptrs, mask=bmask, other=0.0), k0, rn, nmask, bmask, s_gate, s_base, z_base,
                       stride_sn, stride_sk, K, ACT, IEEE, EMULATE, HAS_SCALE, BLOCK_SCALED, BN_S, BK_S, S_K_UNIFORM,
                       INT_BITS, HAS_ZP, BLOCK_K)
        if EMULATE:  # the interpreter's low-precision dot is unreliable: float32 operands
            a = a.to(tl.float32)
        if IEEE or EMULATE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
        if GATED:  # the up rows of the same columns, N rows further
            bu = _grouped_b(tl.load(b_ptrs + N * stride_bn, mask=bmask, other=0.0), k0, rn + N, nmask, bmask, s_up,
                            s_base, z_base, stride_sn, stride_sk, K, ACT, IEEE, EMULATE, HAS_SCALE, BLOCK_SCALED, BN_S,
                            BK_S, S_K_UNIFORM, INT_BITS, HAS_ZP, BLOCK_K)
            if IEEE or EMULATE:
                acc_up += tl.dot(a, bu, input_precision="ieee")
            else:
                acc_up += tl.dot(a, bu)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K // PER
    if GATED:
        acc = _silu_and_mul(acc, acc_up, c_ptr.dtype.element_ty, EMULATE)
    if MUL_WEIGHT:
        acc = _times_weight(acc, tl.load(w_ptr + pairs, mask=pmask, other=0.0)[:, None], a_ptr.dtype.element_ty,
                            CAST_W, EMULATE)
    tl.store(c_ptrs, _round(acc, c_ptr.dtype.element_ty, EMULATE).to(c_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _pair_expert(ids_ptr, emap_ptr, p, HAS_EMAP: tl.constexpr):
    # pair p's expert on this rank (int64; -1: another rank's, through the expert map)
    e = tl.load(ids_ptr + p).to(tl.int64)
    if HAS_EMAP:
        e = tl.load(emap_ptr + e).to(tl.int64)
    return e


@triton.jit
def _pair_zeros(c_ptrs, part_ptrs, N, nmask, GATED: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr):
    # another rank's expert: a zero output, or zero sums the finish pass makes the zero output
    if SPLIT_K == 1:
        tl.store(c_ptrs, tl.zeros([BLOCK_N], dtype=c_ptrs.dtype.element_ty), mask=nmask)
    else:
        tl.store(part_ptrs, tl.zeros([BLOCK_N], dtype=tl.float32), mask=nmask)
        if GATED:
            tl.store(part_ptrs + N, tl.zeros([BLOCK_N], dtype=tl.float32), mask=nmask)


@triton.jit
def _pair_out(y, up, c_ptrs, part_ptrs, w_ptr, p, N, nmask, ACT: tl.constexpr, GATED: tl.constexpr,
              MUL_WEIGHT: tl.constexpr, CAST_W: tl.constexpr, EMULATE: tl.constexpr, SPLIT_K: tl.constexpr):
    # a GEMV program's float32 row sums y (and up, GATED): one pass, SiLU-and-mul, the routing
    # weight and the rounding, stored; split-K, the partials stored for the finish pass
    if SPLIT_K == 1:
        if GATED:
            y = _silu_and_mul(y, up, c_ptrs.dtype.element_ty, EMULATE)
        if MUL_WEIGHT:
            y = _times_weight(y, tl.load(w_ptr + p), ACT, CAST_W, EMULATE)
        tl.store(c_ptrs, _round(y, c_ptrs.dtype.element_ty, EMULATE).to(c_ptrs.dtype.element_ty), mask=nmask)
    else:
        tl.store(part_ptrs, y, mask=nmask)
        if GATED:
            tl.store(part_ptrs + N, up, mask=nmask)


@triton.jit
def _slot_expert(ids_ptr, emap_ptr, p, nmask, HAS_EMAP: tl.constexpr, BLOCK_N: tl.constexpr):
    # the down pass's slot p: its expert (0 for another rank's) and the rows it adds to, none
    # for another rank's expert
    e = _pair_expert(ids_ptr, emap_ptr, p, HAS_EMAP)
    rows_here = nmask & ((e + tl.zeros([BLOCK_N], dtype=tl.int64)) >= 0)
    return tl.maximum(e, 0), rows_here


@triton.jit(do_not_specialize=["P"])
def _gemv_kernel(a_ptr, b_ptr, c_ptr, w_ptr, ids_ptr, emap_ptr, part_ptr, N, P, stride_am, stride_be, stride_bn,
                 stride_cm, s_ptr, z_ptr, stride_se, stride_sn, stride_sk, K: tl.constexpr, A_ROW_DIV: tl.constexpr,
                 GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                 CAST_W: tl.constexpr, HAS_EMAP: tl.constexpr, EMULATE: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_SCALED: tl.constexpr,
                 BN_S: tl.constexpr, BK_S: tl.constexpr, INT_BITS: tl.constexpr, HAS_ZP: tl.constexpr,
                 PDL: tl.constexpr):
    # One (pair, N-block): c[p, n] = a[row of p] . B[e][n, :], e the pair's expert.
    # HAS_SCALE: B is FP8 or (INT_BITS) packed integers, each weight dequantized to a's
    # dtype (``_gemv_tile``) before its product.
    # SPLIT_K > 1: program (p, j, s) takes the s-th of SPLIT_K runs of whole BLOCK_K chunks
    # (KS columns) and writes its float32 sums (gate, then up when GATED) to part_ptr
    # [SPLIT_K, P, (2 if GATED else 1) * N]; ``_gemv_split_finish_kernel`` does the rest.
    p = tl.program_id(0).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if PDL:  # (pyengine/ops/pdl.py) even the weights read depend on the routing
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    nmask = rn < N
    KS: tl.constexpr = ((K + BLOCK_K - 1) // BLOCK_K + SPLIT_K - 1) // SPLIT_K * BLOCK_K  # columns a split
    W: tl.constexpr = 2 if GATED else 1
    if SPLIT_K == 1:
        k_lo = 0
    else:
        k_lo = tl.program_id(2) * KS
    part_ptrs = part_ptr + (tl.program_id(2) * P + p) * (W * N) + rn
    e = _pair_expert(ids_ptr, emap_ptr, p, HAS_EMAP)
    c_ptrs = c_ptr + p * stride_cm + rn
    if e < 0:  # another rank's expert
        _pair_zeros(c_ptrs, part_ptrs, N, nmask, GATED, SPLIT_K, BLOCK_N)
        return
    a_row = a_ptr + (p // A_ROW_DIV) * stride_am
    b_rows = b_ptr + e * stride_be + rn[:, None] * stride_bn
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    ACT: tl.constexpr = a_ptr.dtype.element_ty
    s_base = s_ptr + e * stride_se
    z_base = z_ptr + e * stride_se
    s_gate = 1.0
    s_up = 1.0
    if HAS_SCALE and not BLOCK_SCALED:  # per-channel: the rows' scales, once
        s_gate = tl.load(s_base + rn * stride_sn, mask=nmask, other=0.0)[:, None]
        if GATED:
            s_up = tl.load(s_base + (rn + N) * stride_sn, mask=nmask, other=0.0)[:, None]
    for k0 in tl.static_range(0, KS, BLOCK_K):  # unrolled: every chunk's loads issued early
        kmask = k_lo + k0 + rk < K
        x = tl.load(a_row + k_lo + k0 + rk, mask=kmask, other=0.0).to(tl.float32)
        acc += _gemv_tile(b_rows, k_lo + k0, rn, nmask, s_gate, s_base, z_base, stride_sn, stride_sk, K, ACT, EMULATE,
                          HAS_SCALE, BLOCK_SCALED, BN_S, BK_S, INT_BITS, HAS_ZP, BLOCK_K) * x[None, :]
        if GATED:
            acc_up += _gemv_tile(b_rows + N * stride_bn, k_lo + k0, rn + N, nmask, s_up, s_base, z_base, stride_sn,
                                 stride_sk, K, ACT, EMULATE, HAS_SCALE, BLOCK_SCALED, BN_S, BK_S, INT_BITS, HAS_ZP,
                                 BLOCK_K) * x[None, :]
    _pair_out(tl.sum(acc, axis=1), tl.sum(acc_up, axis=1), c_ptrs, part_ptrs, w_ptr, p, N, nmask, ACT, GATED,
              MUL_WEIGHT, CAST_W, EMULATE, SPLIT_K)


@triton.jit
def _int_rows_dot(b_rows, x_row, s_base, z_base, rn, nmask, k_lo, k_hi, stride_sn, stride_sk, MAGIC,
                  KW: tl.constexpr, GS: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr, C: tl.constexpr,
                  CW: tl.constexpr, BLOCK_N: tl.constexpr, EVEN: tl.constexpr, ZP: tl.constexpr,
                  GATED: tl.constexpr, N_UP, UP_OFF):
    # float32 [BLOCK_N] sums over the words [k_lo, k_hi) of the packed rows at b_rows ([BLOCK_N, 1]
    # pointers; rows rn): the dense int GEMV's chunks (pyengine/ops/quant.py, ``int_gemv_chunk``:
    # each thread's CW words in one group, sum(q * x) - zero * sum(x) times the group's scale,
    # no conversion instruction a value). GATED: also the up rows, N_UP rows further on (UP_OFF
    # elements: N_UP * the row stride), loaded in the same loop; the second result is 0 otherwise.
    PER: tl.constexpr = 32 // BITS
    BKW: tl.constexpr = C * CW
    rw = tl.arange(0, BKW)
    rc = tl.arange(0, C)
    rcw = rc[:, None] * CW + tl.arange(0, CW)[None, :]
    acc = tl.zeros([BLOCK_N, C], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, C], dtype=tl.float32)
    for kc in range(k_lo, k_hi, BKW):  # a runtime loop: unrolled, every chunk's words would be live at once
        words = int_gemv_words(b_rows, kc, rw, nmask, KW, EVEN)
        if GATED:
            words_up = int_gemv_words(b_rows + UP_OFF, kc, rw, nmask, KW, EVEN)
        acc = int_gemv_chunk(acc, words, kc, x_row, s_base, z_base, rn, nmask, rc, rcw, stride_sk, stride_sn, MAGIC,
                             KW, GS, G, BITS, PER, C, CW, BLOCK_N, False, ZP)
        if GATED:
            acc_up = int_gemv_chunk(acc_up, words_up, kc, x_row, s_base, z_base, rn + N_UP, nmask, rc, rcw,
                                    stride_sk, stride_sn, MAGIC, KW, GS, G, BITS, PER, C, CW, BLOCK_N, False, ZP)
    return tl.sum(acc, axis=1), tl.sum(acc_up, axis=1)


@triton.jit(do_not_specialize=["P"])
def _int_gemv_kernel(a_ptr, b_ptr, c_ptr, w_ptr, ids_ptr, emap_ptr, part_ptr, N, P, stride_am, stride_be, stride_bn,
                     stride_cm, s_ptr, z_ptr, stride_se, stride_sn, stride_sk, MAGIC, K: tl.constexpr,
                     A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, CAST_W: tl.constexpr,
                     HAS_EMAP: tl.constexpr, EMULATE: tl.constexpr, BLOCK_N: tl.constexpr, C: tl.constexpr,
                     CW: tl.constexpr, SPLIT_K: tl.constexpr, GS: tl.constexpr, BITS: tl.constexpr,
                     ZP: tl.constexpr, PDL: tl.constexpr):
    # ``_gemv_kernel`` for packed integer weights whose groups are whole words: one (pair,
    # N-block[, split]) program, chunks of C * CW words a row (``_int_rows_dot``), the same
    # epilogue (SiLU-and-mul, the routing weight, the rounding) or the same float32 partials.
    PER: tl.constexpr = 32 // BITS
    KW: tl.constexpr = K // PER
    BKW: tl.constexpr = C * CW
    KSW: tl.constexpr = ((KW + BKW - 1) // BKW + SPLIT_K - 1) // SPLIT_K * BKW  # words a split
    EVEN: tl.constexpr = KSW * SPLIT_K == KW
    p = tl.program_id(0).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if PDL:  # (pyengine/ops/pdl.py) even the weights read depend on the routing
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    nmask = rn < N
    W: tl.constexpr = 2 if GATED else 1
    k_lo = tl.program_id(2) * KSW if SPLIT_K > 1 else 0
    part_ptrs = part_ptr + (tl.program_id(2) * P + p) * (W * N) + rn
    e = _pair_expert(ids_ptr, emap_ptr, p, HAS_EMAP)
    c_ptrs = c_ptr + p * stride_cm + rn
    if e < 0:  # another rank's expert
        _pair_zeros(c_ptrs, part_ptrs, N, nmask, GATED, SPLIT_K, BLOCK_N)
        return
    y, up = _int_rows_dot(b_ptr + e * stride_be + rn[:, None] * stride_bn, a_ptr + (p // A_ROW_DIV) * stride_am,
                          s_ptr + e * stride_se, z_ptr + e * stride_se, rn, nmask, k_lo, k_lo + KSW, stride_sn,
                          stride_sk, MAGIC, KW, GS, K // GS, BITS, C, CW, BLOCK_N, EVEN, ZP, GATED, N, N * stride_bn)
    _pair_out(y, up, c_ptrs, part_ptrs, w_ptr, p, N, nmask, a_ptr.dtype.element_ty, GATED, MUL_WEIGHT, CAST_W,
              EMULATE, SPLIT_K)


@triton.jit
def _int_gemv_down_sum_kernel(a_ptr, b_ptr, c_ptr, w_ptr, ids_ptr, emap_ptr, N, stride_am, stride_be, stride_bn,
                              stride_cm, s_ptr, z_ptr, stride_se, stride_sn, stride_sk, MAGIC, K: tl.constexpr,
                              TOP_K: tl.constexpr, HAS_EMAP: tl.constexpr, CAST_W: tl.constexpr,
                              EMULATE: tl.constexpr, BLOCK_N: tl.constexpr, C: tl.constexpr, CW: tl.constexpr,
                              GS: tl.constexpr, BITS: tl.constexpr, ZP: tl.constexpr, PDL: tl.constexpr):
    # ``_gemv_down_sum_kernel`` for packed integer weights whose groups are whole words: each
    # slot's row sums by ``_int_rows_dot``, rounded and weighted as there, summed in slot order.
    PER: tl.constexpr = 32 // BITS
    KW: tl.constexpr = K // PER
    EVEN: tl.constexpr = KW % (C * CW) == 0
    t = tl.program_id(0).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if PDL:  # (pyengine/ops/pdl.py) even the weights read depend on the routing
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    nmask = rn < N
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for s in tl.static_range(TOP_K):
        p = t * TOP_K + s
        e, rows_here = _slot_expert(ids_ptr, emap_ptr, p, nmask, HAS_EMAP, BLOCK_N)
        y, _ = _int_rows_dot(b_ptr + e * stride_be + rn[:, None] * stride_bn, a_ptr + p * stride_am,
                             s_ptr + e * stride_se, z_ptr + e * stride_se, rn, rows_here, 0, KW, stride_sn, stride_sk,
                             MAGIC, KW, GS, K // GS, BITS, C, CW, BLOCK_N, EVEN, ZP, False, 0, 0)
        total += _times_weight(y, tl.load(w_ptr + p), a_ptr.dtype.element_ty, CAST_W, EMULATE)
    tl.store(c_ptr + t * stride_cm + rn, _round(total, c_ptr.dtype.element_ty, EMULATE).to(c_ptr.dtype.element_ty),
             mask=nmask)


@triton.jit(do_not_specialize=["P"])
def _gemv_split_finish_kernel(part_ptr, a_ptr, c_ptr, w_ptr, N, P, stride_cm, ROWS: tl.constexpr,
                              SPLIT_K: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                              CAST_W: tl.constexpr, EMULATE: tl.constexpr, BLOCK_N: tl.constexpr,
                              PDL: tl.constexpr):
    # One (output row o, N-block) of a split-K GEMV pass: each of the ROWS pairs o * ROWS + r
    # (ROWS = top_k: the down pass with the k-sum fused; else 1) gets its splits' partial
    # sums added in split order, then what ``_gemv_kernel`` does after its sum (SiLU-and-mul,
    # the routing weight, both in a_ptr's dtype, the activation's), and the rows' results
    # are summed in row order and rounded once: the one-pass kernels' operations and
    # roundings, the GEMM's float32 sum in another order.
    o = tl.program_id(0).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if PDL:  # (pyengine/ops/pdl.py)
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    nmask = rn < N
    W: tl.constexpr = 2 if GATED else 1
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for r in tl.static_range(ROWS):
        p = o * ROWS + r
        y = tl.load(part_ptr + p * (W * N) + rn, mask=nmask, other=0.0)
        for s in tl.static_range(1, SPLIT_K):
            y += tl.load(part_ptr + (s * P + p) * (W * N) + rn, mask=nmask, other=0.0)
        if GATED:
            up = tl.load(part_ptr + p * (W * N) + N + rn, mask=nmask, other=0.0)
            for s in tl.static_range(1, SPLIT_K):
                up += tl.load(part_ptr + (s * P + p) * (W * N) + N + rn, mask=nmask, other=0.0)
            y = _silu_and_mul(y, up, c_ptr.dtype.element_ty, EMULATE)
        if MUL_WEIGHT:
            y = _times_weight(y, tl.load(w_ptr + p), a_ptr.dtype.element_ty, CAST_W, EMULATE)
        total += y
    tl.store(c_ptr + o * stride_cm + rn, _round(total, c_ptr.dtype.element_ty, EMULATE).to(c_ptr.dtype.element_ty),
             mask=nmask)


@triton.jit
def _gemv_down_sum_kernel(a_ptr, b_ptr, c_ptr, w_ptr, ids_ptr, emap_ptr, N, stride_am, stride_be, stride_bn,
                          stride_cm, s_ptr, z_ptr, stride_se, stride_sn, stride_sk, K: tl.constexpr,
                          TOP_K: tl.constexpr, HAS_EMAP: tl.constexpr, CAST_W: tl.constexpr, EMULATE: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_SCALE: tl.constexpr,
                          BLOCK_SCALED: tl.constexpr, BN_S: tl.constexpr, BK_S: tl.constexpr, INT_BITS: tl.constexpr,
                          HAS_ZP: tl.constexpr, PDL: tl.constexpr):
    # One (token, N-block): c[t, n] = sum over the token's slots, in slot order, of the pair's
    # down projection (rounded to the activation dtype) times its routing weight
    # (``_times_weight``), accumulated in float32 and rounded once: transformers' per-pair
    # products and sum, without the [T*k, H] buffer. HAS_SCALE: FP8 or integer weights as
    # ``_gemv_kernel``'s, each slot's expert's scales loaded for its slot.
    t = tl.program_id(0).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if PDL:  # (pyengine/ops/pdl.py) even the weights read depend on the routing
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    nmask = rn < N
    rk = tl.arange(0, BLOCK_K)
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for s in tl.static_range(TOP_K):
        p = t * TOP_K + s
        e, rows_here = _slot_expert(ids_ptr, emap_ptr, p, nmask, HAS_EMAP, BLOCK_N)
        b_rows = b_ptr + e * stride_be + rn[:, None] * stride_bn
        s_base = s_ptr + e * stride_se
        s_row = 1.0
        if HAS_SCALE and not BLOCK_SCALED:
            s_row = tl.load(s_base + rn * stride_sn, mask=rows_here, other=0.0)[:, None]
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in tl.static_range(0, K, BLOCK_K):
            kmask = k0 + rk < K
            x = tl.load(a_ptr + p * stride_am + k0 + rk, mask=kmask, other=0.0).to(tl.float32)
            acc += _gemv_tile(b_rows, k0, rn, rows_here, s_row, s_base, z_ptr + e * stride_se, stride_sn, stride_sk, K,
                              a_ptr.dtype.element_ty, EMULATE, HAS_SCALE, BLOCK_SCALED, BN_S, BK_S, INT_BITS, HAS_ZP,
                              BLOCK_K) * x[None, :]
        total += _times_weight(tl.sum(acc, axis=1), tl.load(w_ptr + p), a_ptr.dtype.element_ty, CAST_W, EMULATE)
    tl.store(c_ptr + t * stride_cm + rn, _round(total, c_ptr.dtype.element_ty, EMULATE).to(c_ptr.dtype.element_ty),
             mask=nmask)


@triton.jit
def _topk_softmax_kernel(logits_ptr, w_ptr, ids_ptr, stride_l, E, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                         E_PAD: tl.constexpr, RENORM: tl.constexpr, PDL: tl.constexpr):
    # One token: softmax over the experts in float32, the top_k largest (descending), renormalised.
    t = tl.program_id(0).to(tl.int64)
    if PDL:  # (pyengine/ops/pdl.py)
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    re = tl.arange(0, E_PAD)
    emask = re < E
    x = tl.load(logits_ptr + t * stride_l + re, mask=emask, other=float("-inf")).to(tl.float32)
    x = tl.exp(x - tl.max(x, axis=0))
    x = tl.where(emask, x, 0.0)
    prob = x / tl.sum(x, axis=0)
    rs = tl.arange(0, K_PAD)
    vals = tl.zeros([K_PAD], dtype=tl.float32)
    idxs = tl.zeros([K_PAD], dtype=tl.int32)
    for s in tl.static_range(TOP_K):
        best = tl.max(prob, axis=0)
        i = tl.argmax(prob, axis=0)
        vals = tl.where(rs == s, best, vals)
        idxs = tl.where(rs == s, i.to(tl.int32), idxs)
        prob = tl.where(re == i, -1.0, prob)
    if RENORM:
        vals = vals / tl.sum(vals, axis=0)
    tl.store(w_ptr + t * TOP_K + rs, vals, mask=rs < TOP_K)
    tl.store(ids_ptr + t * TOP_K + rs, idxs, mask=rs < TOP_K)


def topk_softmax(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``router.fused_topk`` in one kernel (vLLM's ``topk_softmax`` op): router_logits [T, E]
    (any float dtype, unit stride along E) -> (float32 [T, top_k], int32 [T, top_k]),
    descending. Raises ValueError when ``top_k`` is not in [1, E]."""
    t, e = router_logits.shape
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k must be in [1, {e}] (the number of experts), got {top_k}")
    weights = torch.empty((t, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=router_logits.device)
    if t:
        logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
        _topk_softmax_kernel[(t,)](logits, weights, ids, logits.stride(0), e, TOP_K=top_k,
                                   K_PAD=triton.next_power_of_2(top_k), E_PAD=triton.next_power_of_2(e),
                                   RENORM=bool(renormalize), num_warps=1 if e <= 256 else 4,
                                   **pdl.launch_kwargs(logits, "topk_softmax"))
    return weights, ids


# ---- launch ----------------------------------------------------------------------------

_FINISH_BLOCK_N = 128  # outputs a program of the split-K finish pass


def _split_k_ok(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 64


def _gemv_block_k(cfg: dict, k: int, bits: int | None = None) -> int:
    # a GEMV pass's chunk: the tile's BLOCK_SIZE_K, at most K's next power of two, and for
    # packed integer weights at least a word's values (chunks of whole words)
    return max(_per_word(bits), min(int(cfg["BLOCK_SIZE_K"]), triton.next_power_of_2(k)))


def _per_word(bits: int | None) -> int:
    # K values an element of b holds: 32 // bits for packed integer weights, else 1
    return 32 // bits if bits else 1


def gemv_split_k(cfg: dict, k: int, block_k: int) -> int:
    """A GEMV-path pass tile's ``SPLIT_K`` (default 1): programs along K (``k`` columns in
    chunks of ``block_k``), each a run of whole chunks. Raises ValueError for one that is
    not an integer in [1, 64] or that leaves a split without a chunk."""
    split = cfg.get("SPLIT_K", 1)
    if not _split_k_ok(split):
        raise ValueError(f"fused-MoE GEMV tile: SPLIT_K must be an integer in [1, 64], got {split!r}")
    chunks = triton.cdiv(k, block_k)
    if (split - 1) * triton.cdiv(chunks, split) >= chunks:
        raise ValueError(f"fused-MoE GEMV tile: SPLIT_K {split} leaves a split without work (K {k} is {chunks} "
                         f"chunk(s) of BLOCK_SIZE_K {block_k})")
    return split


def _scale_args(b: torch.Tensor, scale: torch.Tensor | None, block_shape: tuple[int, int] | None,
                zp: torch.Tensor | None = None, bits: int | None = None) -> dict:
    """A kernel's weight-scale arguments: none (``HAS_SCALE`` off, b as a pointer that is
    never read) for float weights; FP8 weights' scales, per output row ([E, rows]) or per
    block ([E, row blocks, column blocks] with ``block_shape``), with their strides; packed
    ``bits``-bit integer weights' group scales [E, rows, K / gs] (``block_shape`` (1, gs))
    and zero points ``zp`` of the same layout (None: symmetric), ``INT_BITS`` on."""
    if scale is None:
        return dict(s_ptr=b, z_ptr=b, stride_se=0, stride_sn=0, stride_sk=0, HAS_SCALE=False, BLOCK_SCALED=False,
                    BN_S=1, BK_S=1, INT_BITS=0, HAS_ZP=False)
    blocked = block_shape is not None
    bn, bk = block_shape if block_shape is not None else (1, 1)
    return dict(s_ptr=scale, z_ptr=zp if zp is not None else scale, stride_se=scale.stride(0),
                stride_sn=scale.stride(1), stride_sk=scale.stride(2) if blocked else 0, HAS_SCALE=True,
                BLOCK_SCALED=blocked, BN_S=int(bn), BK_S=int(bk), INT_BITS=int(bits or 0), HAS_ZP=zp is not None)


def int_word_tile(k: int, block_k: int, bits: int | None, block_shape, scale, zp) -> dict | None:
    """The word-chunk arguments of the integer GEMV kernels (``_int_gemv_kernel``,
    ``_int_gemv_down_sum_kernel``) for a pass of K ``k`` in chunks of ``block_k`` values:
    C threads along K with CW consecutive words each (4, 2 or 1: a 16-, 8- or 4-byte load;
    a thread's words in one group), or None where those kernels do not apply (float / FP8
    weights, a group that is not whole words): the general kernels then dequantize value by
    value. The zero points share the scales' strides (``_check_group_tensor``)."""
    if not bits or block_shape is None:
        return None
    per = 32 // bits
    gs = int(block_shape[1])
    kw = k // per
    words = max(1, block_k // per)
    if gs % per:
        return None
    cw = next(c for c in (4, 2, 1) if c <= words and gs % (c * per) == 0 and kw % c == 0)
    return dict(s_ptr=scale, z_ptr=zp if zp is not None else scale, stride_se=scale.stride(0),
                stride_sn=scale.stride(1), stride_sk=scale.stride(2), MAGIC=MAGIC_2_23, C=words // cw, CW=cw,
                GS=gs, BITS=int(bits), ZP=0.0 if zp is not None else float(1 << (bits - 1)))


def _gemv_partials(a, b, topk_ids, expert_map, gated, a_row_div, cfg, n_out, split, block_k, scale=None,
                   block_shape=None, zp=None, bits=None):
    """The split-K partial pass of the GEMV path: float32 [split, pairs, (2 if gated else 1)
    * n_out] sums (every element written: no zeroing)."""
    k = a.shape[1]
    pairs = topk_ids.numel()
    part = torch.empty((split, pairs, (2 if gated else 1) * n_out), dtype=torch.float32, device=a.device)
    grid = (pairs, triton.cdiv(n_out, int(cfg["BLOCK_SIZE_N"])), split)
    it = int_word_tile(k, block_k, bits, block_shape, scale, zp)
    if it is not None:
        _int_gemv_kernel[grid](a, b, part, part, topk_ids, expert_map if expert_map is not None else topk_ids, part,
                               n_out, pairs, a.stride(0), b.stride(0), b.stride(1), 0, K=k, A_ROW_DIV=a_row_div,
                               GATED=gated, MUL_WEIGHT=False, CAST_W=False, HAS_EMAP=expert_map is not None,
                               EMULATE=_INTERPRET, BLOCK_N=int(cfg["BLOCK_SIZE_N"]), SPLIT_K=split, **it,
                               num_warps=int(cfg.get("num_warps", 4)), **pdl.launch_kwargs(a, "moe_gemv"))
        return part
    _gemv_kernel[grid](a, b, part, part, topk_ids, expert_map if expert_map is not None else topk_ids, part,
                       n_out, pairs, a.stride(0), b.stride(0), b.stride(1), 0,
                       K=k, A_ROW_DIV=a_row_div, GATED=gated, MUL_WEIGHT=False, CAST_W=False,
                       HAS_EMAP=expert_map is not None, EMULATE=_INTERPRET,
                       BLOCK_N=int(cfg["BLOCK_SIZE_N"]), BLOCK_K=block_k, SPLIT_K=split,
                       **_scale_args(b, scale, block_shape, zp, bits),
                       num_warps=int(cfg.get("num_warps", 4)), **pdl.launch_kwargs(a, "moe_gemv"))
    return part


def _gemv_finish(part, a, c, topk_weights, rows, gated, mul_weight, cast_weights):
    """c [P / rows, N] from the partials of ``_gemv_partials`` (``_gemv_split_finish_kernel``)."""
    split, pairs, _ = part.shape
    n_out = c.shape[1]
    block = min(_FINISH_BLOCK_N, triton.next_power_of_2(n_out))
    _gemv_split_finish_kernel[(c.shape[0], triton.cdiv(n_out, block))](
        part, a, c, topk_weights, n_out, pairs, c.stride(0), ROWS=rows, SPLIT_K=split, GATED=gated,
        MUL_WEIGHT=mul_weight, CAST_W=bool(cast_weights), EMULATE=_INTERPRET, BLOCK_N=block, num_warps=4,
        **pdl.launch_kwargs(a, "moe_finish"))


def gemv_pass(a, b, c, topk_weights, topk_ids, expert_map, gated, mul_weight, a_row_div, cfg, cast_weights=True,
              scale=None, block_shape=None, zp=None, bits=None):
    """One pass on the GEMV path: ``c[p] = f(a[p // a_row_div] . b[expert of p]^T)`` for
    every pair p; ``gated``: b holds gate then up rows and f is SiLU-and-mul;
    ``mul_weight``: times the pair's routing weight (rounded to a's dtype first with
    ``cast_weights``). ``cfg``: that pass's tile; its ``SPLIT_K`` > 1 (``gemv_split_k``)
    splits K over that many programs a (pair, N-block), whose float32 sums a finish pass
    adds in split order before the SiLU / weight / rounding (deterministic). ``scale``: b's
    float32 scales when b is FP8 (checked by ``fused_experts``): [E, rows], or blocks
    [E, ceil(rows / bn), ceil(K / bk)] with ``block_shape`` (bn, bk); ``bits``: b is int32
    words of that many bits a value, ``scale`` [E, rows, K / gs] with ``block_shape`` (1, gs)
    and ``zp`` (float32, the scale's shape and strides) or None."""
    n_out = c.shape[1]
    k = a.shape[1]
    block_k = _gemv_block_k(cfg, k, bits)
    split = gemv_split_k(cfg, k, block_k)
    if split > 1:
        part = _gemv_partials(a, b, topk_ids, expert_map, gated, a_row_div, cfg, n_out, split, block_k, scale,
                              block_shape, zp, bits)
        _gemv_finish(part, a, c, topk_weights, 1, gated, mul_weight, cast_weights)
        return
    pairs = topk_ids.numel()
    grid = (pairs, triton.cdiv(n_out, int(cfg["BLOCK_SIZE_N"])))
    it = int_word_tile(k, block_k, bits, block_shape, scale, zp)
    if it is not None:
        _int_gemv_kernel[grid](a, b, c, topk_weights, topk_ids, expert_map if expert_map is not None else topk_ids, c,
                               n_out, pairs, a.stride(0), b.stride(0), b.stride(1), c.stride(0), K=k,
                               A_ROW_DIV=a_row_div, GATED=gated, MUL_WEIGHT=mul_weight, CAST_W=bool(cast_weights),
                               HAS_EMAP=expert_map is not None, EMULATE=_INTERPRET, BLOCK_N=int(cfg["BLOCK_SIZE_N"]),
                               SPLIT_K=1, **it, num_warps=int(cfg.get("num_warps", 4)),
                               **pdl.launch_kwargs(a, "moe_gemv"))
        return
    _gemv_kernel[grid](a, b, c, topk_weights, topk_ids, expert_map if expert_map is not None else topk_ids, c,
                       n_out, pairs, a.stride(0), b.stride(0), b.stride(1), c.stride(0),
                       K=k, A_ROW_DIV=a_row_div, GATED=gated, MUL_WEIGHT=mul_weight, CAST_W=bool(cast_weights),
                       HAS_EMAP=expert_map is not None, EMULATE=_INTERPRET,
                       BLOCK_N=int(cfg["BLOCK_SIZE_N"]), BLOCK_K=block_k, SPLIT_K=1,
                       **_scale_args(b, scale, block_shape, zp, bits),
                       num_warps=int(cfg.get("num_warps", 4)), **pdl.launch_kwargs(a, "moe_gemv"))


def gemv_down_sum_pass(a, b, c, topk_weights, topk_ids, expert_map, cfg, cast_weights=True, scale=None,
                       block_shape=None, zp=None, bits=None):
    """The small-batch down pass with the k-sum fused: ``c[t] = sum_slot w * (a[t*k+slot]
    . b[expert]^T)``; c: [T, N]. ``cfg``: the w2 pass's tile; ``cast_weights``, ``scale``,
    ``block_shape``, ``zp`` and ``bits`` as ``gemv_pass``. ``SPLIT_K`` > 1: one program per
    (pair, N-block, split) writes float32 sums and the finish pass adds a token's splits and
    slots in order (as ``gemv_pass``)."""
    n_out = c.shape[1]
    k = a.shape[1]
    block_k = _gemv_block_k(cfg, k, bits)
    split = gemv_split_k(cfg, k, block_k)
    if split > 1:
        part = _gemv_partials(a, b, topk_ids, expert_map, False, 1, cfg, n_out, split, block_k, scale, block_shape,
                              zp, bits)
        _gemv_finish(part, a, c, topk_weights, topk_ids.shape[1], False, True, cast_weights)
        return
    grid = (c.shape[0], triton.cdiv(n_out, int(cfg["BLOCK_SIZE_N"])))
    it = int_word_tile(k, block_k, bits, block_shape, scale, zp)
    if it is not None:
        _int_gemv_down_sum_kernel[grid](a, b, c, topk_weights, topk_ids,
                                        expert_map if expert_map is not None else topk_ids, n_out, a.stride(0),
                                        b.stride(0), b.stride(1), c.stride(0), K=k, TOP_K=topk_ids.shape[1],
                                        HAS_EMAP=expert_map is not None, CAST_W=bool(cast_weights),
                                        EMULATE=_INTERPRET, BLOCK_N=int(cfg["BLOCK_SIZE_N"]), **it,
                                        num_warps=int(cfg.get("num_warps", 4)), **pdl.launch_kwargs(a, "moe_down_sum"))
        return
    _gemv_down_sum_kernel[grid](a, b, c, topk_weights, topk_ids, expert_map if expert_map is not None else topk_ids,
                                n_out, a.stride(0), b.stride(0), b.stride(1), c.stride(0), K=k,
                                TOP_K=topk_ids.shape[1], HAS_EMAP=expert_map is not None, CAST_W=bool(cast_weights),
                                EMULATE=_INTERPRET, **_scale_args(b, scale, block_shape, zp, bits),
                                BLOCK_N=int(cfg["BLOCK_SIZE_N"]), BLOCK_K=block_k, num_warps=int(cfg.get("num_warps", 4)),
                                **pdl.launch_kwargs(a, "moe_down_sum"))


def grouped_tile_bytes(bm: int, bn: int, bk: int, gated: bool, act_bytes: int, w_bytes: int, scaled: bool,
                       block_k_uniform: bool = True, int_bits: int = 0, zero_points: bool = False,
                       group_size: int = 0) -> tuple[int, int]:
    """``(per_stage, fixed)`` shared-memory bytes of ``_grouped_kernel``'s tiles (see
    ``pyengine.ops.smem``): per stage the A tile, the (gate and up) weight tiles and, for FP8
    weights, their float32 block scales (a row a tile when BLOCK_K divides the scale block's
    columns, ``block_k_uniform``, else one a weight); fixed: FP8 weight tiles dequantized to
    the activation dtype for ``tl.dot``. ``int_bits``: packed integer weights (``w_bytes``
    the int32 word's 4), ``int_bits`` / 8 bytes a weight, their group scales (and
    ``zero_points``) a row a tile when BLOCK_K divides ``group_size``, else one a word (one
    a weight where a word's values span groups); dequantized tiles as FP8's."""
    tiles = 2 if gated else 1
    per = _per_word(int_bits)
    per_stage = bm * bk * act_bytes + tiles * bk * bn * w_bytes // per
    if not scaled:
        return per_stage, 0
    s_rows = 1 if block_k_uniform else (bk // per if int_bits and group_size % per == 0 else bk)
    per_stage += tiles * 4 * s_rows * bn * (2 if zero_points else 1)
    return per_stage, tiles * bk * bn * act_bytes


def grouped_pass(a, b, c, topk_weights, aligned, gated, mul_weight, a_row_div, cfg, num_valid, cast_weights=True,
                 scale=None, block_shape=None, zp=None, bits=None):
    """One pass on the grouped-GEMM path over ``aligned`` (``moe_align_block_size``'s
    output for ``cfg["BLOCK_SIZE_M"]``); otherwise as ``gemv_pass``. Raises ValueError for a
    tile that does not fit the device's shared memory (``grouped_tile_bytes``)."""
    sorted_ids, expert_ids, npost = aligned
    n_out = c.shape[1]
    bm, bn, bk = int(cfg["BLOCK_SIZE_M"]), int(cfg["BLOCK_SIZE_N"]), int(cfg["BLOCK_SIZE_K"])
    em = sorted_ids.numel()
    # a K chunk's block scales are one row when the chunk lies in one scale block (chunks start
    # at multiples of bk)
    uniform = block_shape is None or int(block_shape[1]) % bk == 0
    # the stages this tile can have in the device's shared memory (a tile of the table was
    # measured on its GPU; this guards the defaults and other GPUs)
    per_stage, fixed = grouped_tile_bytes(bm, bn, bk, gated, a.element_size(), b.element_size(), scale is not None,
                                          uniform, int(bits or 0), zp is not None,
                                          int(block_shape[1]) if block_shape is not None else 0)
    stages = smem.fit_stages(per_stage, fixed, int(cfg.get("num_stages", 3)), smem.max_shared_mem(a.device))
    if stages == 0:
        raise ValueError(f"fused-MoE tile {bm}x{bn}x{bk} does not fit the device's shared memory")
    grid = (triton.cdiv(em, bm) * triton.cdiv(n_out, bn),)
    _grouped_kernel[grid](a, b, c, topk_weights, sorted_ids, expert_ids, npost,
                          n_out, a.shape[1], em, num_valid, a.stride(0), b.stride(0), b.stride(1), c.stride(0),
                          A_ROW_DIV=a_row_div, GATED=gated, MUL_WEIGHT=mul_weight, CAST_W=bool(cast_weights),
                          IEEE=a.dtype == torch.float32, EMULATE=_INTERPRET,
                          BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=int(cfg.get("GROUP_SIZE_M", 1)),
                          **_scale_args(b, scale, block_shape, zp, bits), S_K_UNIFORM=uniform,
                          num_warps=int(cfg.get("num_warps", 4)), num_stages=stages)


_FP8 = torch.float8_e4m3fn
_FP8_ACTS = (torch.bfloat16, torch.float16, torch.float32)


def _check_block_shape(block_shape) -> tuple[int, int]:
    try:
        bn, bk = block_shape
        ok = all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (bn, bk))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"block_shape must be two positive integers (rows, columns) a scale block, got "
                         f"{block_shape!r}")
    return int(bn), int(bk)


def _check_scale(name: str, w: torch.Tensor, scale: torch.Tensor | None,
                 block_shape: tuple[int, int] | None) -> torch.Tensor | None:
    """``name``'s scale as the kernels take it (None for a float weight), or ValueError."""
    if w.dtype != _FP8:
        if w.dtype.is_floating_point and w.element_size() == 1:
            raise ValueError(f"{name} is {w.dtype}: FP8 expert weights must be torch.float8_e4m3fn")
        if scale is not None:
            raise ValueError(f"{name}_scale given for {name} of dtype {w.dtype}: scales go with "
                             f"torch.float8_e4m3fn weights only (or int32 ones with weight_bits)")
        return None
    if scale is None:
        raise ValueError(f"{name} is torch.float8_e4m3fn: {name}_scale (float32) is required")
    _check_float32_beside(f"{name}_scale", scale, name, w)
    e, rows, cols = w.shape
    given = list(scale.shape)
    if block_shape is None:
        if scale.dim() == 3 and scale.shape[2] == 1:  # vLLM's per-channel layout [E, rows, 1]
            scale = scale[:, :, 0]
        want: tuple[int, ...] = (e, rows)
        what = "per output channel"
    else:
        want = (e, triton.cdiv(rows, block_shape[0]), triton.cdiv(cols, block_shape[1]))
        what = f"per {block_shape[0]}x{block_shape[1]} block"
    if tuple(scale.shape) != want:
        raise ValueError(f"{name}_scale ({what}) must have shape {list(want)} for {name} of shape {list(w.shape)}, "
                         f"got {given}")
    return scale


def _check_float32_beside(name: str, v: torch.Tensor, w_name: str, w: torch.Tensor) -> None:
    # a weight's scale / zero-point tensor: float32, on the weight's device
    if v.dtype != torch.float32:
        raise ValueError(f"{name} must be float32, got {v.dtype}")
    if v.device != w.device:
        raise ValueError(f"{name} is on {v.device}, {w_name} on {w.device}")


def _check_group_tensor(name: str, v: torch.Tensor, w_name: str, w: torch.Tensor, want: tuple[int, int, int],
                        what: str) -> torch.Tensor:
    # a float32 scale / zero-point tensor of integer weights, contiguous (scales and zero
    # points then share strides), [E, rows] taken for per-channel [E, rows, 1]
    _check_float32_beside(name, v, w_name, w)
    given = list(v.shape)
    if v.dim() == 2 and want[2] == 1:
        v = v[:, :, None]
    if tuple(v.shape) != want:
        raise ValueError(f"{name} ({what}) must have shape {list(want)} for {w_name} of shape {list(w.shape)}, "
                         f"got {given}")
    return v.contiguous()


def _check_int(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, scales: tuple, zps: tuple,
               block_shape: tuple[int, int] | None, bits) -> tuple[dict, dict]:
    """The packed integer weights' quantization arguments of the w13 and w2 passes
    (``gemv_pass``'s scale, zp, block_shape (1, gs), bits), or ValueError."""
    if w13.dtype != torch.int32 and w2.dtype != torch.int32:
        raise ValueError(f"weight_bits given for w13 of {w13.dtype} and w2 of {w2.dtype}: it goes with int32 "
                         f"(packed integer) expert weights only")
    if w13.dtype != w2.dtype:
        raise ValueError(f"w13 is {w13.dtype}, w2 {w2.dtype}: packed integer (int32) expert weights are both "
                         f"w13 and w2 or neither")
    if isinstance(bits, bool) or bits not in (4, 8):
        raise ValueError(f"int32 expert weights take weight_bits 4 or 8 (values packed a word), got {bits!r}")
    if hidden.dtype not in _FP8_ACTS:
        raise ValueError(f"integer expert weights take bf16, fp16 or float32 activations, got hidden of {hidden.dtype}")
    per = 32 // bits
    h = hidden.shape[1]
    e, two_i, _ = w13.shape
    inter = two_i // 2
    if two_i % 2 or h % per or inter % per or tuple(w13.shape) != (e, two_i, h // per) or \
            tuple(w2.shape) != (e, h, inter // per):
        raise ValueError(f"{bits}-bit expert weights are packed {per} a word along K: w13 [E, 2 * I, H / {per}] and "
                         f"w2 [E, H, I / {per}] with H {h} (hidden's) a multiple of {per} and 2 * I = w13's rows "
                         f"{two_i}, I a multiple of {per}; got w13 {list(w13.shape)}, w2 {list(w2.shape)}")
    if block_shape is not None and block_shape[0] != 1:
        raise ValueError(f"block_shape of integer weights is (1, group_size), got {block_shape}")
    if block_shape is not None and (h % block_shape[1] or inter % block_shape[1]):
        raise ValueError(f"group size {block_shape[1]} (block_shape) must divide both the hidden size {h} (w13's K) "
                         f"and the intermediate size {inter} (w2's K)")
    out = []
    for name, w, k, scale, zp in (("w13", w13, h, scales[0], zps[0]), ("w2", w2, inter, scales[1], zps[1])):
        if w.device != hidden.device:
            raise ValueError(f"{name} is on {w.device}, hidden on {hidden.device}")
        gs = k if block_shape is None else block_shape[1]
        want = (e, w.shape[1], k // gs)
        what = "per output channel" if block_shape is None else f"per group of {gs}"
        if scale is None:
            raise ValueError(f"{name} is int32 ({bits}-bit): {name}_scale (float32) is required")
        scale = _check_group_tensor(f"{name}_scale", scale, name, w, want, what)
        if zp is not None:
            zp = _check_group_tensor(f"{name}_zp", zp, name, w, want, what)
        out.append(dict(scale=scale, zp=zp, block_shape=(1, gs), bits=bits))
    return out[0], out[1]


def fused_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, expert_map: torch.Tensor | None = None,
                  config: dict | None = None, tile_configs: dict[int, dict] | None = None,
                  cast_weights: bool = True, w13_scale: torch.Tensor | None = None,
                  w2_scale: torch.Tensor | None = None,
                  block_shape: tuple[int, int] | None = None, w13_zp: torch.Tensor | None = None,
                  w2_zp: torch.Tensor | None = None, weight_bits: int | None = None) -> torch.Tensor:
    """hidden: [T, H]; w13: [E_local, 2 * I, H] (gate rows then up rows); w2: [E_local, H, I];
    topk_weights: float32 [T, k]; topk_ids: int32 [T, k] (global ids); expert_map: int32
    [E_global] or None (see ``moe_align_block_size``). Float weights share hidden's dtype;
    weights and hidden have unit stride along their last dim. ``config``: the tile config to use
    (default: ``pick_config(tile_configs, T, ...)``). ``cast_weights``: the routing weights
    are rounded to hidden's dtype before they scale the experts' outputs (Qwen-MoE), else
    the product is float32 (Mixtral); see ``moe_torch``. Returns [T, H] in hidden's dtype:
    ``moe_torch.fused_experts_torch``'s operations and roundings (exactly its value in
    float32 up to summation order, and in bf16 up to the GEMMs' own rounding).

    FP8 weights (weight-only): w13 and/or w2 torch.float8_e4m3fn, hidden bf16, fp16 or
    float32, with float32 scales: ``block_shape`` None: per output channel, w13_scale
    [E_local, 2 * I] (gate rows then up rows; [E_local, 2 * I, 1] is taken too), w2_scale
    [E_local, H]; ``block_shape`` (bn, bk): per block, w13_scale [E_local, ceil(2I / bn),
    ceil(H / bk)], w2_scale [E_local, ceil(H / bn), ceil(I / bk)], element (r, c) of expert e
    scaled by scale[e, r // bn, c // bk]. Each weight is dequantized in the kernel to
    ``(w.float() * scale).to(hidden.dtype)`` before its product, so the result is this
    function's on the dequantized weights (bit for bit under the interpreter). Raises
    ValueError for a scale given for a float weight, missing for an FP8 one, not float32,
    on another device or of the wrong shape; for a block_shape that is not two positive
    integers or given without an FP8 weight; for another 1-byte float weight dtype, or FP8
    weights with a hidden dtype other than bf16 / fp16 / float32.

    Packed integer weights (weight-only W4A16 / W8A16): w13 and w2 both int32, w13
    [E_local, 2 * I, H * bits / 32], w2 [E_local, H, I * bits / 32], ``weight_bits`` (bits) 4
    or 8: logical column c of a row is the unsigned value in bits [(c % per) * bits,
    (c % per + 1) * bits) of word c // per, per = 32 // bits
    (``quantization.utils.pack_int32(q, bits, dim=-1)``). Scales float32 per group of
    ``block_shape`` (1, gs) columns (gs dividing H and I), w13_scale [E_local, 2 * I, H / gs],
    w2_scale [E_local, H, I / gs]; ``block_shape`` None: per output channel ([E_local, rows,
    1], or [E_local, rows]). ``w13_zp`` / ``w2_zp``: float32 zero points (quantized units) of
    the scales' shapes, or None: symmetric, 2**(bits - 1). Each weight is dequantized in the
    kernel to ``((q.float() - zero) * scale).to(hidden.dtype)`` (float32 arithmetic), so the
    result is this function's on the dequantized weights, as for FP8 — bit for bit under the
    interpreter except on the GEMV path where gs is whole words (``int_word_tile``), whose
    kernels apply each group's scale to its float32 sum: there equal to float32 rounding, and
    in bf16 / fp16 to the dequantized weights' own rounding. Raises ValueError for
    int32 weights without weight_bits 4 / 8, weight_bits or a zero point without them, one
    int32 weight with the other not, other integer weight dtypes, packed shapes that do not
    match hidden and w13's rows, weights on another device than hidden, a block_shape not
    (1, gs) or a gs not dividing H and I, a missing scale, and scales / zero points not
    float32, on another device or of the wrong shape; hidden bf16 / fp16 / float32."""
    t, h = hidden.shape
    e_local, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    if block_shape is not None:
        block_shape = _check_block_shape(block_shape)
    for name, w in (("w13", w13), ("w2", w2)):
        if not w.dtype.is_floating_point and w.dtype != torch.int32:
            raise ValueError(f"{name} is {w.dtype}: integer expert weights must be int32 words (weight_bits 4 or 8)")
    if torch.int32 in (w13.dtype, w2.dtype) or weight_bits is not None:
        q13, q2 = _check_int(hidden, w13, w2, (w13_scale, w2_scale), (w13_zp, w2_zp), block_shape, weight_bits)
    else:
        for name, w, zp in (("w13", w13, w13_zp), ("w2", w2, w2_zp)):
            if zp is not None:
                raise ValueError(f"{name}_zp given for {name} of dtype {w.dtype}: zero points go with int32 "
                                 f"(weight_bits) weights only")
        w13_scale = _check_scale("w13", w13, w13_scale, block_shape)
        w2_scale = _check_scale("w2", w2, w2_scale, block_shape)
        if w13_scale is None and w2_scale is None:
            if block_shape is not None:
                raise ValueError("block_shape given without FP8 (torch.float8_e4m3fn) or int32 weights")
        elif hidden.dtype not in _FP8_ACTS:
            raise ValueError(f"FP8 expert weights take bf16, fp16 or float32 activations, got hidden of {hidden.dtype}")
        q13 = dict(scale=w13_scale, block_shape=block_shape)
        q2 = dict(scale=w2_scale, block_shape=block_shape)
    if t == 0:
        return torch.zeros_like(hidden)
    hidden = hidden.contiguous()
    topk_ids = topk_ids.to(torch.int32).contiguous()
    topk_weights = topk_weights.to(torch.float32).contiguous()
    cfg = config if config is not None else pick_config(tile_configs, t, e_local, inter, h, top_k,
                                                        q13.get("bits"))
    pairs = t * top_k
    mid = torch.empty((pairs, inter), dtype=hidden.dtype, device=hidden.device)
    # the per-pair products: in hidden's dtype when the weights are cast, else float32
    pair_dtype = hidden.dtype if cast_weights else torch.float32
    c13, c2 = pass_config(cfg, "w13"), pass_config(cfg, "w2")
    if cfg.get("small_batch"):
        # both passes' SPLIT_K checked before anything runs
        gemv_split_k(c13, h, _gemv_block_k(c13, h, q13.get("bits")))
        gemv_split_k(c2, inter, _gemv_block_k(c2, inter, q2.get("bits")))
        gemv_pass(hidden, w13, mid, topk_weights, topk_ids, expert_map, True, False, top_k, c13, **q13)
        if c2.get("FUSE_SUM", True):  # default: no [T*k, H] buffer and no separate sum
            out = torch.empty((t, h), dtype=hidden.dtype, device=hidden.device)
            gemv_down_sum_pass(mid, w2, out, topk_weights, topk_ids, expert_map, c2, cast_weights, **q2)
            return out
        out = torch.empty((pairs, h), dtype=pair_dtype, device=hidden.device)
        gemv_pass(mid, w2, out, topk_weights, topk_ids, expert_map, False, True, 1, c2, cast_weights, **q2)
    else:
        out = torch.empty((pairs, h), dtype=pair_dtype, device=hidden.device)
        if int(c13["BLOCK_SIZE_M"]) != int(c2["BLOCK_SIZE_M"]):
            raise ValueError("the two passes of a grouped-GEMM tile config must share BLOCK_SIZE_M")
        for c, q in ((c13, q13), (c2, q2)):
            if int(c["BLOCK_SIZE_K"]) % _per_word(q.get("bits")):
                raise ValueError(f"fused-MoE tile: BLOCK_SIZE_K {c['BLOCK_SIZE_K']} is not whole int32 words of "
                                 f"{q['bits']}-bit weights")
        aligned = moe_align_block_size(topk_ids, int(c13["BLOCK_SIZE_M"]), e_local, expert_map)
        grouped_pass(hidden, w13, mid, topk_weights, aligned, True, False, top_k, c13, pairs, **q13)
        grouped_pass(mid, w2, out, topk_weights, aligned, False, True, 1, c2, pairs, cast_weights, **q2)
    return out.view(t, top_k, h).sum(dim=1).to(hidden.dtype)
