"""MoE on the H200: the Qwen3-30B-A3B shape (48 layers, 128 experts, top-8, hidden 2048,
expert intermediate 768; random bf16 weights built on the GPU, ``load_format="dummy"``).

One run, one JSON file in ``--out-dir`` (``moe_<shape>.json``, rewritten after each
section, so a run cut short keeps what it measured), in about 4-5 minutes:

* ``kernels``: the fused Triton MoE (``pyengine.layers.fused_moe.fused_experts``, the tile
  table of the shape when one is shipped) against the per-expert torch loop (the CPU
  path) and against one dense gated MLP of the same active size (top_k x intermediate,
  cuBLAS), for several token counts M; time per layer with ``--kernel-layers`` distinct
  weight sets in turn (cold L2, as a forward sees it), bytes read and GB/s, and the max
  difference to the torch loop.
* ``loading``: a checkpoint at the real expert shape (``--load-layers`` layers, per-expert
  tensors, written to a temporary directory) loaded onto the device while a thread
  samples the process's anonymous resident memory: the peak above the baseline against
  the checkpoint's size (expert by expert: a few tensors, not the model).
* ``engine``: ``LLM`` on the shape: start-up; batch-1 TPOT (128-token prompt, 256 greedy
  tokens) against the bandwidth floor of what one decode step reads (attention and router
  weights, the 8 chosen experts of every layer, the LM head and one embedding row, the KV
  cache at the mean context), at ``--bandwidth-tbs`` (4.8 TB/s); offline throughput on
  the serving workload (512 x 128-in / 256-out) and on nano-vllm's (256 requests, prompt
  and output lengths uniform in [100, 1024], temperature 0.6, ignore_eos).

``--sections profile`` (not in the default sections): the engine section's engine, one
batch-1 request of ``--tpot-input-len`` tokens, ``--profile-steps`` (20) decode steps under
``torch.profiler`` (CPU and CUDA activity, CUDA graphs as served): per kernel and class
(attention, GEMV by layer role, norm, rope, MoE align / GEMM, top-k and router, sampling,
copies), GPU busy against the step's wall time, kernels per step (benchmarks/decode_profile.py);
``--trace-dir`` keeps the chrome trace. Run alone it writes ``moe_profile_<shape>.json``
(about 45 s on the H200, most of it the engine's start-up).

``--quantization fp8``: the engine and profile sections on the same shape quantized at load
(attention projections and experts FP8 per output row, run weight-only by the fused MoE;
routers, norms and the LM head bf16), the floor counting those bytes (one per weight, plus
the float32 row scales); the result is ``moe_fp8_<shape>.json``. ``--quantization gptq``:
the shape as a GPTQ W4A16 checkpoint (4 bits, group 128, symmetric: Qwen3-30B-A3B-GPTQ-Int4's
settings) with random valid weights (``load_format="dummy"``); the floor counts half a byte
a weight plus the group scales (float32 for the experts, bf16 for attention); result
``moe_gptq_<shape>.json``.

``--sweep``: instead, search the fused kernel's tile configs per M for the shape (``--sweep-n``
intermediate sizes: 768 at TP=1, 384 at TP=2) within ``--sweep-budget-s`` seconds and
write ``pyengine/layers/fused_moe/configs/E=128,N=<n>,device_name=<GPU>.json`` (or into
``--config-dir``), plus the JSON result with every candidate's time.

    python benchmarks/moe.py --out-dir benchmarks/results/DATE-h200-moe
    python benchmarks/moe.py --sweep --out-dir benchmarks/results/DATE-h200-moe
    python benchmarks/moe.py --sections profile --out-dir benchmarks/results/DATE-h200-moe
    TRITON_INTERPRET=1 python benchmarks/moe.py --cpu-smoke --out-dir /tmp/moe   # the same code paths, tiny, CPU
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

from benchmarks.common import (  # noqa: E402
    BOS,
    EOS,
    PAD,
    build_tokenizer,
    command_line,
    cuda_graph_replay_us,
    free_cuda,
    hardware_info,
    random_prompts,
    shutdown_llm,
    stats_delta,
    write_json,
)
from benchmarks.decode_profile import add_profile_args  # noqa: E402

SHAPES = ("qwen3-30b-a3b", "tiny")


def moe_config(shape: str, bos: int = 0, eos: int = 1, pad: int = 2, vocab_size: int | None = None,
               num_layers: int | None = None):
    """The transformers config of a named MoE shape (random-weight benchmarks)."""
    from transformers import Qwen3MoeConfig

    ids = dict(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)
    if shape == "qwen3-30b-a3b":  # Qwen/Qwen3-30B-A3B's config.json
        kw = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                  num_attention_heads=32, num_key_value_heads=4, head_dim=128, moe_intermediate_size=768,
                  num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                  max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, dtype="bfloat16")
    elif shape == "tiny":
        kw = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                  norm_topk_prob=True, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, dtype="float32")
    else:
        raise ValueError(f"unknown shape {shape!r}; one of {', '.join(SHAPES)}")
    if vocab_size is not None:
        kw["vocab_size"] = vocab_size
    if num_layers is not None:
        kw["num_hidden_layers"] = num_layers
    cfg = Qwen3MoeConfig(**kw, **ids)
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    return cfg


def gptq_config(shape: str) -> dict:
    """``--quantization gptq``'s quantization_config: Qwen3-30B-A3B-GPTQ-Int4's settings (groups
    of 16 for the tiny shape, whose widths 128 does not divide)."""
    return {"quant_method": "gptq", "bits": 4, "group_size": 16 if shape == "tiny" else 128, "desc_act": False,
            "sym": True, "checkpoint_format": "gptq"}


def make_moe_model_dir(shape: str, out_dir, quantization_config: dict | None = None) -> Path:
    """config.json of the shape (with ``quantization_config`` when given) and a tokenizer
    filled to its vocabulary (no weights)."""
    from transformers import AutoTokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    marker = out / ".vengine_shape"
    tag = f"{shape} moe {json.dumps(quantization_config, sort_keys=True) if quantization_config else ''}".strip()
    if marker.is_file() and marker.read_text() == tag and (out / "config.json").is_file():
        return out
    vocab = moe_config(shape).vocab_size
    build_tokenizer(out, fill_to=vocab if vocab > 512 else None)
    tok = AutoTokenizer.from_pretrained(str(out))
    bos, eos, pad = tok.convert_tokens_to_ids([BOS, EOS, PAD])
    cfg = moe_config(shape, bos, eos, pad, vocab_size=max(vocab, len(tok)))
    if quantization_config:
        cfg.quantization_config = dict(quantization_config)
    cfg.save_pretrained(str(out))
    marker.write_text(tag)
    return out


# ---- bytes a decode step reads -----------------------------------------------------------

def expert_bytes(cfg, itemsize: int) -> int:
    return 3 * cfg.hidden_size * cfg.moe_intermediate_size * itemsize


def step_bytes(cfg, itemsize: int, batch: int = 1, context: int = 0, weight_itemsize: float | None = None,
               group_size: int | None = None) -> dict:
    """Bytes one decode step of ``batch`` tokens reads at batch 1 (every token's experts
    distinct at batch 1: top_k per layer), with ``context`` cached tokens per request.
    ``weight_itemsize``: bytes per value of the quantized weights (attention projections and
    experts; 1 for FP8, whose float32 per-row scales are counted too; 0.5 for INT4 with
    ``group_size``: a scale per group of inputs, float32 for the experts and ``itemsize`` for
    attention, as the engine keeps them), default ``itemsize``; norms, routers, the LM head,
    embeddings and the KV cache stay at ``itemsize``."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    wsize = itemsize if weight_itemsize is None else weight_itemsize
    inter = cfg.moe_intermediate_size
    if weight_itemsize is None:
        attn_scales = expert_scales = 0.0
    elif group_size:  # one scale per group of inputs of every output row
        attn_scales = (h * (q + 2 * kv) + q * h) / group_size * itemsize
        expert_scales = 3 * h * inter / group_size * 4
    else:  # float32 per output row
        attn_scales, expert_scales = (q + 2 * kv + h) * 4, (2 * inter + h) * 4
    attn = (h * (q + 2 * kv) + q * h) * wsize + attn_scales + (2 * d + 2 * h) * itemsize
    router = cfg.num_experts * h * itemsize
    one_expert = expert_bytes(cfg, wsize) + expert_scales
    experts = min(cfg.num_experts, cfg.num_experts_per_tok * batch) * one_expert
    layers = cfg.num_hidden_layers
    lm_head = cfg.vocab_size * h * itemsize
    embed = batch * h * itemsize + h * itemsize  # rows looked up, final norm
    kv_cache = batch * context * layers * 2 * kv * itemsize
    parts = {"attention": layers * attn, "router": layers * router, "experts": layers * experts,
             "lm_head": lm_head, "embedding_and_norm": embed, "kv_cache": kv_cache}
    parts["total"] = sum(parts.values())
    return parts


# ---- timing --------------------------------------------------------------------------------

def _sync(device: str) -> None:
    if device == "cuda":
        import torch
        torch.cuda.synchronize()


def graph_us(fn: Callable, device: str, iters: int = 10, repeats: int = 3) -> float:
    """µs per call of ``fn``: CUDA-graph replays on the GPU (no launch overhead), a
    wall-clock loop on the CPU."""
    if device == "cuda":
        return cuda_graph_replay_us(fn, iters, repeats)
    fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e6 / iters


def eager_us(fn: Callable, device: str, iters: int = 5) -> float:
    """µs per call of a function that syncs with the host (the per-expert torch loop)."""
    fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) * 1e6 / iters


def _triton_ok(device: str) -> str | None:
    """None when the Triton kernels can run here, else why not."""
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return "the Triton kernels run on the CPU only under TRITON_INTERPRET=1"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    return None


def _expert_sets(cfg, n_sets: int, n_inter: int, device: str, dtype):
    import torch

    e, h = cfg.num_experts, cfg.hidden_size
    g = torch.Generator(device=device).manual_seed(0)
    sets = []
    for _ in range(n_sets):
        w13 = torch.randn(e, 2 * n_inter, h, device=device, dtype=dtype, generator=g) * h ** -0.5
        w2 = torch.randn(e, h, n_inter, device=device, dtype=dtype, generator=g) * n_inter ** -0.5
        sets.append((w13, w2))
    return sets


def _routing(cfg, m: int, device: str, seed: int = 1):
    import torch

    from pyengine.layers.fused_moe.router import fused_topk

    g = torch.Generator(device=device).manual_seed(seed)
    return fused_topk(torch.randn(m, cfg.num_experts, device=device, generator=g), cfg.num_experts_per_tok, True)


# ---- section: kernels ----------------------------------------------------------------------

def bench_kernels(args, cfg, device: str, dtype) -> dict:
    import torch
    import torch.nn.functional as F

    why = _triton_ok(device)
    if why:
        return {"skipped": why}
    from pyengine.layers.fused_moe import fused_moe
    from pyengine.layers.fused_moe.moe_torch import fused_experts_torch
    from pyengine.ops import silu_and_mul

    h, inter, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    itemsize = torch.empty((), dtype=dtype).element_size()
    sets = _expert_sets(cfg, args.kernel_layers, inter, device, dtype)
    g = torch.Generator(device=device).manual_seed(2)
    dense = [(torch.randn(2 * k * inter, h, device=device, dtype=dtype, generator=g) * h ** -0.5,
              torch.randn(h, k * inter, device=device, dtype=dtype, generator=g) * (k * inter) ** -0.5)
             for _ in sets]
    table = fused_moe.load_tile_configs(cfg.num_experts, inter) if device == "cuda" else None
    rows = []
    for m in args.kernel_m:
        x = torch.randn(m, h, device=device, dtype=dtype, generator=g)
        w, ids = _routing(cfg, m, device, seed=m)
        cfg_m = fused_moe.pick_config(table, m, cfg.num_experts, inter, h, k)

        def fused():
            for w13, w2 in sets:
                fused_moe.fused_experts(x, w13, w2, w, ids, config=cfg_m)

        def loop():
            for w13, w2 in sets:
                fused_experts_torch(x, w13, w2, w, ids)

        def dense_mlp():
            for a, b in dense:
                F.linear(silu_and_mul(F.linear(x, a)), b)
        n = len(sets)
        t_fused = graph_us(fused, device, args.iters, args.repeats) / n
        # the grouped path's sort of the pairs by expert, alone (part of t_fused)
        t_align = None if cfg_m.get("small_batch") else graph_us(
            lambda: fused_moe.moe_align_block_size(ids, int(fused_moe.pass_config(cfg_m, "w13")["BLOCK_SIZE_M"]),
                                                   cfg.num_experts), device,
            args.iters, args.repeats)
        t_loop = eager_us(loop, device, iters=min(args.iters, 2 if m >= 1024 else 5)) / n
        t_dense = graph_us(dense_mlp, device, args.iters, args.repeats) / n
        got = fused_moe.fused_experts(x, sets[0][0], sets[0][1], w, ids, config=cfg_m).float()
        ref = fused_experts_torch(x.float(), sets[0][0].float(), sets[0][1].float(), w, ids)
        distinct = int(torch.unique(ids).numel())
        moe_bytes = distinct * expert_bytes(cfg, itemsize) + 2 * m * h * itemsize
        dense_bytes = 3 * k * inter * h * itemsize + 2 * m * h * itemsize
        rows.append({"m": m, "distinct_experts": distinct, "tile_config": cfg_m,
                     "fused_us": t_fused, "torch_loop_us": t_loop, "dense_same_active_us": t_dense,
                     "align_us": t_align, "bandwidth_floor_us": moe_bytes / (args.bandwidth_tbs * 1e6),
                     "fused_tflops": 2 * m * k * 3 * h * inter / t_fused / 1e6,
                     "fused_gb_s": moe_bytes / t_fused / 1e3, "dense_gb_s": dense_bytes / t_dense / 1e3,
                     "fused_vs_loop_speedup": t_loop / t_fused, "fused_vs_dense": t_fused / t_dense,
                     "max_abs_diff_vs_fp32_loop": float((got - ref).abs().max()),
                     "ref_abs_max": float(ref.abs().max())})
        path = "gemv" if cfg_m.get("small_batch") else f"grouped, align {t_align:.1f} us"
        print(f"kernels M={m}: fused {t_fused:.1f} us ({path}; {rows[-1]['fused_gb_s']:.0f} GB/s, "
              f"{rows[-1]['fused_tflops']:.0f} TFLOPS, bandwidth floor {rows[-1]['bandwidth_floor_us']:.1f} us), "
              f"torch loop {t_loop:.1f} us, dense {t_dense:.1f} us", flush=True)
    del sets, dense
    free_cuda()
    return {"tile_table_shipped": table is not None, "layers_cycled": args.kernel_layers, "rows": rows}


# ---- section: tile-config sweep -------------------------------------------------------------

SWEEP_M = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 2048, 4096, 8192)
QUICK_SWEEP_M = (1, 16, 256, 4096)
PASSES = ("w13", "w2")
H200_SMEM = 232448  # a tile whose stages need more shared memory than this is not tried


def _gemv_candidates(base: dict, k: int, smoke: bool, quick: bool, which: str) -> list[dict]:
    """One GEMV-path pass's tiles to time (K = ``k``), ``base`` (the tile in use) first: its
    split-K variants (SPLIT_K 2, 3, 4: more programs a pair; with its K tile and with one
    at most ``k / SPLIT_K``), its neighbours (N tile
    halved or doubled, K tile halved or doubled, 2 <-> 4 warps) and their SPLIT_K 2; not
    quick: then a grid of N tile x K tile x warps x SPLIT_K 1-2, and for the down pass each
    tile with the k-sum fused and not (quick: as ``base``). Tiles whose SPLIT_K leaves a
    split without a chunk of K are dropped."""
    from pyengine.layers.fused_moe import fused_moe

    keys = ("BLOCK_SIZE_N", "BLOCK_SIZE_K", "num_warps", "SPLIT_K", "FUSE_SUM")
    base = {key: v for key, v in base.items() if key in keys}
    if smoke:
        out = [{"BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 32, "num_warps": 4},
               {"BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 16, "num_warps": 4, "SPLIT_K": 2}]
    else:
        bn, bk, nw = base["BLOCK_SIZE_N"], base["BLOCK_SIZE_K"], base.get("num_warps", 4)
        near = [{**base, "BLOCK_SIZE_N": max(1, bn // 2)}, {**base, "BLOCK_SIZE_N": bn * 2},
                {**base, "BLOCK_SIZE_K": max(32, bk // 2)}, {**base, "BLOCK_SIZE_K": bk * 2},
                {**base, "num_warps": 4 if nw == 2 else 2}]
        # SPLIT_K sk with the base's K tile, and with one small enough to give every split a chunk
        splits = [{**base, "BLOCK_SIZE_K": b, "SPLIT_K": sk} for sk in (2, 3, 4)
                  for b in (bk, min(bk, max(32, 1 << ((k // sk).bit_length() - 1))))]
        out = [base] + splits + near + [{**c, "SPLIT_K": 2} for c in near]
        if not quick:
            out += [{"BLOCK_SIZE_N": bn_, "BLOCK_SIZE_K": bk_, "num_warps": nw_, **({"SPLIT_K": sk} if sk > 1 else {})}
                    for bn_ in (4, 8, 16, 32) for bk_ in (256, 512, 1024) for nw_ in (2, 4, 8) for sk in (1, 2)]
    if which == "w2":
        fuse = (True, False) if not quick or smoke else (base.get("FUSE_SUM", True),)
        out = [{**c, "FUSE_SUM": f} for c in out for f in fuse]
    else:
        out = [{key: v for key, v in c.items() if key != "FUSE_SUM"} for c in out]
    seen, kept = set(), []
    for c in out:
        key = tuple(sorted(c.items()))
        try:
            fused_moe.gemv_split_k(c, k, min(c["BLOCK_SIZE_K"], 1 << (k - 1).bit_length()))
        except ValueError:
            continue
        if key not in seen:
            seen.add(key)
            kept.append(c)
    return kept


def _fits(c: dict, gated: bool) -> bool:
    """A bf16 grouped tile worth timing: its stages within the H200's shared memory, at most
    128 float32 accumulators a thread (more spill: the gate/up pass keeps two)."""
    per_stage = 2 * (c["BLOCK_SIZE_M"] * c["BLOCK_SIZE_K"] + (1 + gated) * c["BLOCK_SIZE_K"] * c["BLOCK_SIZE_N"])
    acc_per_thread = (1 + gated) * c["BLOCK_SIZE_M"] * c["BLOCK_SIZE_N"] / (32 * c["num_warps"])
    return c["num_stages"] * per_stage <= H200_SMEM and acc_per_thread <= 128


def _grouped_candidates(base: dict, gated: bool, smoke: bool, quick: bool) -> list[dict]:
    """One pass's tiles to time at one BLOCK_SIZE_M, the default's (``base``) first: a sweep
    cut short by its budget still has it. Quick: the default and the first three of its
    neighbours that fit the shared memory (K tile 64 <-> 128, N tile doubled or halved,
    4 <-> 8 warps, 3 <-> 4 stages); else all of those, then a grid."""
    if smoke:
        return [{**base, "BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 16, "num_warps": 4, "num_stages": 2}]
    bn_max = 128 if gated else 256
    out = [base,
           {**base, "BLOCK_SIZE_K": 128 if base["BLOCK_SIZE_K"] <= 64 else 64},
           {**base, "BLOCK_SIZE_N": base["BLOCK_SIZE_N"] * 2 if base["BLOCK_SIZE_N"] < bn_max
            else base["BLOCK_SIZE_N"] // 2},
           {**base, "num_warps": 8 if base["num_warps"] == 4 else 4},
           {**base, "num_stages": 4 if base["num_stages"] <= 3 else 3}]
    if not quick:
        out += [{**base, "BLOCK_SIZE_N": bn, "BLOCK_SIZE_K": bk, "num_warps": nw, "num_stages": ns}
                for bn in (64, 128, 256) for bk in (64, 128) for nw in (4, 8) for ns in (2, 3, 4)]
    seen, kept = set(), []
    for c in out:
        key = tuple(sorted(c.items()))
        if key not in seen and _fits(c, gated):
            seen.add(key)
            kept.append(c)
    return kept[:4] if quick else kept


def _block_m_candidates(default_bm: int, m: int, top_k: int, num_experts: int, smoke: bool, quick: bool) -> list[int]:
    if smoke:
        return [16]
    if quick:
        return [default_bm]
    per_expert = m * top_k / num_experts
    return [default_bm] + [bm for bm in (16, 32, 64, 128) if bm != default_bm and bm <= max(16, 2 * per_expert)]


def _entry(c13: dict, c2: dict) -> dict:
    """A table entry from the two passes' tiles: shared fields at the top, the rest per pass."""
    shared = {key: v for key, v in c13.items() if c2.get(key) == v}
    entry = {**shared, "w13": {key: v for key, v in c13.items() if key not in shared},
             "w2": {key: v for key, v in c2.items() if key not in shared}}
    return {key: v for key, v in entry.items() if v != {}}


def sweep_shape(args, cfg, n_inter: int, device: str, dtype, deadline: float,
                current: dict[int, dict] | None = None) -> tuple[dict, list]:
    """Best tile config per M for (E, n_inter) within the deadline, each M an equal share of
    what is left: the GEMV path (M <= 64, each pass's tile alone, up to half the M's share)
    against the grouped GEMM (per BLOCK_SIZE_M, each pass's best tile, the two passes'
    candidates in turn; the alignment's time counted), then each path's best, the default
    and ``current``'s entry (the table in use) timed whole; the fastest is kept. Quick
    (``args.sweep_quick``): only the default BLOCK_SIZE_M and four tiles a pass, GEMV only
    as the default's or the current table's. Returns (table, every timing)."""
    import torch

    from pyengine.layers.fused_moe import fused_moe

    e, h, k = cfg.num_experts, cfg.hidden_size, cfg.num_experts_per_tok
    quick = bool(getattr(args, "sweep_quick", False))
    sets = _expert_sets(cfg, args.kernel_layers, n_inter, device, dtype)
    table, log = {}, []
    ms = args.sweep_m
    for i, m in enumerate(ms):
        now = time.perf_counter()
        if now > deadline:
            log.append({"m": m, "skipped": "budget"})
            continue
        deadline_m = now + (deadline - now) / (len(ms) - i)
        x = torch.randn(m, h, device=device, dtype=dtype)
        w, ids = _routing(cfg, m, device, seed=m)
        pairs = m * k
        mid = torch.empty(pairs, n_inter, device=device, dtype=dtype)
        out = torch.empty(pairs, h, device=device, dtype=dtype)

        def timed(fn, m=m):
            try:
                return graph_us(fn, device, iters=args.iters, repeats=args.repeats) / len(sets)
            except Exception as exc:  # a tile this GPU cannot run (shared memory, registers)
                log.append({"m": m, "error": f"{type(exc).__name__}: {exc}"[:300]})
                return float("inf")

        best = {}  # path -> (total us, config)
        out_t = torch.empty(m, h, device=device, dtype=dtype)
        default = fused_moe.get_default_config(m, e, n_inter, h, k)
        in_use = fused_moe.pick_config(current, m, e, n_inter, h, k) if current else default
        # the GEMV path: every M <= 64 (quick: only where it is the path in use), each pass's
        # tiles alone, the two passes' candidates in turn; half the M's share (quick: all of it)
        if m <= 64 and (not quick or in_use.get("small_batch")):
            gemv_deadline = time.perf_counter() + (deadline_m - time.perf_counter()) * (1.0 if quick else 0.5)
            base = in_use if in_use.get("small_batch") else fused_moe.get_default_config(1, e, n_inter, h, k)
            gemv_cands = {which: _gemv_candidates(fused_moe.pass_config(base, which), h if which == "w13" else n_inter,
                                                  args.cpu_smoke, quick, which) for which in PASSES}
            gemv_scores: dict[str, list] = {which: [] for which in PASSES}
            for j in range(max(len(c) for c in gemv_cands.values())):
                if time.perf_counter() > gemv_deadline and all(gemv_scores.values()):
                    break
                for which in PASSES:
                    if j >= len(gemv_cands[which]):
                        continue
                    c = gemv_cands[which][j]

                    def run(c=c, which=which):
                        for w13, w2 in sets:
                            if which == "w13":
                                fused_moe.gemv_pass(x, w13, mid, w, ids, None, True, False, k, c)
                            elif c["FUSE_SUM"]:
                                fused_moe.gemv_down_sum_pass(mid, w2, out_t, w, ids, None, c)
                            else:  # the per-pair pass and the separate k-sum it needs
                                fused_moe.gemv_pass(mid, w2, out, w, ids, None, False, True, 1, c)
                                out.view(m, k, h).sum(dim=1)
                    t = timed(run)
                    gemv_scores[which].append((t, c))
                    log.append({"m": m, "path": "gemv", "pass": which, "config": c, "us": t})
            if all(gemv_scores.values()):
                (t13, c13), (t2, c2) = (min(gemv_scores[which], key=lambda sc: sc[0]) for which in PASSES)
                best["gemv"] = (t13 + t2, {"small_batch": True, "w13": c13, "w2": c2})
        grouped_default = default if not default.get("small_batch") else fused_moe.get_default_config(
            max(m, 5), e, n_inter, h, k)
        # quick, where the GEMV path is in use and was searched: no grouped search (its default
        # is still timed whole below)
        bms = [] if quick and "gemv" in best else _block_m_candidates(grouped_default["BLOCK_SIZE_M"], m, k, e,
                                                                        args.cpu_smoke, quick)
        for bm in bms:
            if time.perf_counter() > deadline_m and "grouped" in best:
                break
            aligned = fused_moe.moe_align_block_size(ids, bm, e)
            t_align = timed(lambda bm=bm: [fused_moe.moe_align_block_size(ids, bm, e) for _ in sets])
            # the default's tiles seed each pass's candidates (at another BLOCK_SIZE_M, with the
            # M-blocks grouped when an expert has several)
            over = {} if bm == grouped_default["BLOCK_SIZE_M"] else {
                "BLOCK_SIZE_M": bm, "GROUP_SIZE_M": 1 if m * k / e < bm else 8}
            cands = {which: _grouped_candidates({**fused_moe.pass_config(grouped_default, which), **over},
                                                which == "w13", args.cpu_smoke, quick)
                     for which in PASSES}
            scores = {which: [] for which in PASSES}
            for j in range(max(len(c) for c in cands.values())):
                if time.perf_counter() > deadline_m and all(scores.values()):
                    break
                for which, (gated, mul, div) in (("w13", (True, False, k)), ("w2", (False, True, 1))):
                    if j >= len(cands[which]):
                        continue
                    c = cands[which][j]

                    def run(c=c, gated=gated, mul=mul, div=div, which=which, aligned=aligned):
                        for w13, w2 in sets:
                            a, b, dst = (x, w13, mid) if which == "w13" else (mid, w2, out)
                            fused_moe.grouped_pass(a, b, dst, w, aligned, gated, mul, div, c, pairs)
                    t = timed(run)
                    scores[which].append((t, c))
                    log.append({"m": m, "path": "grouped", "pass": which, "config": c, "us": t})
            if all(scores.values()):
                (t13, c13), (t2, c2) = (min(scores[which], key=lambda s: s[0]) for which in PASSES)
                total = t_align + t13 + t2
                if "grouped" not in best or total < best["grouped"][0]:
                    best["grouped"] = (total, _entry(c13, c2))
        # each path's best, the default and the table in use, timed whole (alignment, buffers,
        # k-sum included)
        contenders = [*((p, v[1]) for p, v in best.items()), ("default", default)]
        if current:
            contenders.append(("current", fused_moe.pick_config(current, m, e, n_inter, h, k)))
        if quick and m <= 64 and not default.get("small_batch"):
            # the GEMV path with the table's largest-M GEMV tile (the defaults' without one)
            gemv = [c for _, c in sorted((current or {}).items()) if c.get("small_batch")]
            contenders.append(("gemv", gemv[-1] if gemv else fused_moe.get_default_config(1, e, n_inter, h, k)))
        whole, unique = {}, []
        for name, entry in contenders:
            if all(entry != u for _, u in unique):
                unique.append((name, entry))
                whole[name] = timed(lambda entry=entry: [fused_moe.fused_experts(x, w13, w2, w, ids, config=entry)
                                                         for w13, w2 in sets])
        path = min(whole, key=whole.get)
        if whole[path] == float("inf"):
            log.append({"m": m, "skipped": "every config failed"})
            continue
        table[m] = dict(unique)[path]
        log.append({"m": m, "chosen": table[m], "path": path, "whole_us": whole})
        others = ", ".join(f"{name} {t:.1f}" for name, t in whole.items() if name != path)
        print(f"sweep N={n_inter} M={m}: {path} {whole[path]:.1f} us ({others}): {json.dumps(table[m])}",
              flush=True)
    del sets
    free_cuda()
    return table, log


def _write_tile_table(path: Path, table: dict[int, dict]) -> None:
    """A tile-config table (M -> config) as ``load_tile_configs`` reads it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({str(m): c for m, c in sorted(table.items())}, indent=2) + "\n")


def run_sweep(args, cfg, device: str, dtype) -> dict:
    """The sweep of each ``--sweep-n`` size; its table is merged into that shape's file (the
    Ms it did not time keep their entries) and written."""
    why = _triton_ok(device)
    if why:
        return {"skipped": why}
    from pyengine.layers.fused_moe import fused_moe

    deadline = time.perf_counter() + args.sweep_budget_s
    out = {}
    names = args.sweep_n or [cfg.moe_intermediate_size]
    device_name = None if device == "cuda" else "cpu-interpreter"
    config_dir = Path(args.config_dir) if args.config_dir else fused_moe.CONFIG_DIR
    for i, n_inter in enumerate(names):
        current = fused_moe.load_tile_configs(cfg.num_experts, n_inter, device_name, config_dir) or {}
        # each size gets an equal share of what is left
        share = (deadline - time.perf_counter()) / (len(names) - i)
        table, log = sweep_shape(args, cfg, n_inter, device, dtype, time.perf_counter() + share, current)
        entry = {"table": {str(m): c for m, c in sorted(table.items())}, "log": log,
                 "kept_from_file": sorted(set(current) - set(table))}
        if table:
            merged = {**current, **table}
            path = config_dir / fused_moe.get_config_file_name(cfg.num_experts, n_inter, device_name)
            _write_tile_table(path, merged)
            entry["written"] = str(path)
            print(f"tile configs written to {path} (M {', '.join(str(m) for m in sorted(merged))})")
        out[str(n_inter)] = entry
    return out


# ---- section: int_tiles ----------------------------------------------------------------------

def _int_expert_sets(cfg, n_sets: int, n_inter: int, device: str, group: int):
    """``n_sets`` layers' int4 experts as the GPTQ checkpoint's load leaves them (random words,
    symmetric, float32 group scales): (w13 int32 [E, 2I, H/8], w2 int32 [E, H, I/8], w13
    scales [E, 2I, H/group], w2 scales [E, H, I/group])."""
    import torch

    e, h = cfg.num_experts, cfg.hidden_size
    g = torch.Generator(device=device).manual_seed(0)
    out = []
    for _ in range(n_sets):
        words = [torch.randint(-2 ** 31, 2 ** 31 - 1, (e, r, k // 8), device=device, dtype=torch.int32, generator=g)
                 for r, k in ((2 * n_inter, h), (h, n_inter))]
        scales = [torch.rand(e, r, k // group, device=device, generator=g) * 0.01 + 1e-3
                  for r, k in ((2 * n_inter, h), (h, n_inter))]
        out.append((words[0], words[1], scales[0], scales[1]))
    return out


def _int_tile_candidates(default: dict, which: str) -> list[dict]:
    """One GEMV-path pass's int4 tiles, nearest the bf16 ``default`` (the shape's M=1 config)
    first (a budget cut short has them): N tile x K tile x warps x SPLIT_K, the down pass with
    the k-sum fused."""
    from pyengine.layers.fused_moe import fused_moe

    base = fused_moe.pass_config(default, which)
    grid = [{"BLOCK_SIZE_N": bn, "BLOCK_SIZE_K": bk, "num_warps": nw, **({"SPLIT_K": sk} if sk > 1 else {})}
            for bn in (4, 8, 16, 2) for bk in (512, 1024, 256, 2048) for nw in (2, 4, 8, 1) for sk in (1, 2)]
    grid.sort(key=lambda c: sum(c.get(key) != base.get(key) for key in ("BLOCK_SIZE_N", "BLOCK_SIZE_K", "num_warps"))
              + (c.get("SPLIT_K", 1) > 1))
    out = [{key: v for key, v in base.items() if key != "small_batch"}] + grid
    seen, kept = set(), []
    for c in out:
        if which == "w2":
            c = {**c, "FUSE_SUM": True}
        key = tuple(sorted(c.items()))
        if key not in seen:
            seen.add(key)
            kept.append(c)
    return kept


def bench_int_tiles(args, cfg, device: str, dtype) -> dict:
    """The GEMV path's tiles for int4 experts (``--quantization gptq``'s form: group 128,
    symmetric, float32 scales) at batch 1, whose default is the tile swept for bf16: each
    pass's candidates (``_int_tile_candidates``) timed alone within ``--sweep-budget-s``, the
    best pair and the default timed whole (``fused_experts``, CUDA-graph replays over
    ``--kernel-layers`` layers), each against the int4 bytes' floor at ``--bandwidth-tbs``; the
    bf16 experts' default whole beside them. With a faster pair, the M=1 entry of the
    ``dtype=int4_w4a16`` table (the layer's entries over the unkeyed table's) is written to
    ``--config-dir`` (default the repository's)."""
    import torch

    why = _triton_ok(device)
    if why:
        return {"skipped": why}
    from pyengine.layers.fused_moe import fused_moe

    h, inter, k, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok, cfg.num_experts
    group = gptq_config(args.shape)["group_size"]
    sets = _int_expert_sets(cfg, args.kernel_layers, inter, device, group)
    m = 1
    x = torch.randn(m, h, device=device, dtype=dtype)
    w, ids = _routing(cfg, m, device, seed=m)
    mid = torch.empty(m * k, inter, device=device, dtype=dtype)
    out = torch.empty(m, h, device=device, dtype=dtype)
    q = dict(block_shape=(1, group), bits=4)
    log: list[dict] = []
    n_layers = len(sets)

    def timed(fn):
        try:
            return graph_us(fn, device, iters=args.iters, repeats=args.repeats) / n_layers
        except Exception as exc:  # a tile this GPU cannot run
            log.append({"error": f"{type(exc).__name__}: {exc}"[:300]})
            return float("inf")

    def run_pass(which, c):
        for w13, w2, s13, s2 in sets:
            if which == "w13":
                fused_moe.gemv_pass(x, w13, mid, w, ids, None, True, False, k, c, scale=s13, **q)
            else:
                fused_moe.gemv_down_sum_pass(mid, w2, out, w, ids, None, c, scale=s2, **q)

    # bytes a layer's pass reads at batch 1: the chosen experts' words and scales
    pass_bytes = {"w13": k * 2 * inter * (h // 2 + h // group * 4), "w2": k * h * (inter // 2 + inter // group * 4)}
    floor_us = {p: b / (args.bandwidth_tbs * 1e12) * 1e6 for p, b in pass_bytes.items()}
    default = fused_moe.get_default_config(m, e, inter, h, k, weight_bits=4)
    start = time.perf_counter()
    best = {}
    for i, which in enumerate(PASSES):  # half the budget each
        deadline = start + args.sweep_budget_s * (i + 1) / len(PASSES)
        scores = []
        for c in _int_tile_candidates(default, which):
            if time.perf_counter() > deadline and scores:
                break
            t = timed(lambda c=c, which=which: run_pass(which, c))  # a SPLIT_K without work: inf, logged
            scores.append((t, c))
            log.append({"pass": which, "config": c, "us": t, "of_floor": t / floor_us[which]})
        best[which] = min(scores, key=lambda sc: sc[0])
        print(f"int4 {which}: best {best[which][0]:.2f} us ({best[which][0] / floor_us[which]:.2f}x its floor "
              f"{floor_us[which]:.2f} us) of {len(scores)} tiles: {json.dumps(best[which][1])}", flush=True)
    tuned = {"small_batch": True, "w13": best["w13"][1], "w2": best["w2"][1]}

    def whole(entry, int_weights=True):
        if int_weights:
            return timed(lambda: [fused_moe.fused_experts(x, w13, w2, w, ids, config=entry, w13_scale=s13, w2_scale=s2,
                                                          block_shape=(1, group), weight_bits=4)
                                  for w13, w2, s13, s2 in sets])
        return timed(lambda: [fused_moe.fused_experts(x, a, b, w, ids, config=entry) for a, b in bf16])

    res = {"m": m, "group_size": group, "layers_cycled": n_layers, "floor_us": floor_us,
           "best_pass_us": {p: v[0] for p, v in best.items()}, "tuned": tuned, "default": default,
           "whole_us": {"int4_default": whole(default), "int4_tuned": whole(tuned)}}
    del sets
    free_cuda()
    bf16 = _expert_sets(cfg, args.kernel_layers, inter, device, dtype)
    res["whole_us"]["bf16_default"] = whole(default, int_weights=False)
    del bf16
    free_cuda()
    floor = sum(floor_us.values())
    res["whole_over_int4_floor"] = {name: t / floor for name, t in res["whole_us"].items() if name.startswith("int4")}
    res["tuned_over_default"] = res["whole_us"]["int4_tuned"] / res["whole_us"]["int4_default"]
    res["log"] = log
    print(f"int4 experts at M=1: default {res['whole_us']['int4_default']:.2f} us, tuned "
          f"{res['whole_us']['int4_tuned']:.2f} us ({res['tuned_over_default']:.3f}x), bf16 default "
          f"{res['whole_us']['bf16_default']:.2f} us; int4 floor {floor:.2f} us", flush=True)
    if res["tuned_over_default"] < 0.97 and device == "cuda":
        config_dir = Path(args.config_dir) if args.config_dir else fused_moe.CONFIG_DIR
        key = fused_moe.weight_dtype_key(4)
        current = fused_moe.load_tile_configs(e, inter, None, config_dir, dtype=key) or {}
        path = config_dir / fused_moe.get_config_file_name(e, inter, None, key)
        _write_tile_table(path, {**current, m: tuned})
        res["written"] = str(path)
        print(f"tile configs written to {path}", flush=True)
    return res


# ---- section: loading ------------------------------------------------------------------------

def _rss_anon_kb() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _write_checkpoint(cfg, out: Path, dtype) -> tuple[int, int]:
    """Per-expert Qwen3-MoE safetensors, one file per layer (uninitialised values: only
    the memory is measured). Returns (total bytes, largest tensor bytes)."""
    import torch
    from safetensors.torch import save_file

    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    total = largest = 0
    weight_map = {}

    def shard(name, tensors):
        nonlocal total, largest
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        for key, t in tensors.items():
            weight_map[key] = name
            total += t.numel() * t.element_size()
            largest = max(largest, t.numel() * t.element_size())

    shard("embed.safetensors", {"model.embed_tokens.weight": torch.empty(cfg.vocab_size, h, dtype=dtype),
                                "lm_head.weight": torch.empty(cfg.vocab_size, h, dtype=dtype),
                                "model.norm.weight": torch.ones(h, dtype=dtype)})
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        t = {p + "self_attn.q_proj.weight": torch.empty(q, h, dtype=dtype),
             p + "self_attn.k_proj.weight": torch.empty(kv, h, dtype=dtype),
             p + "self_attn.v_proj.weight": torch.empty(kv, h, dtype=dtype),
             p + "self_attn.o_proj.weight": torch.empty(h, q, dtype=dtype),
             p + "self_attn.q_norm.weight": torch.ones(d, dtype=dtype),
             p + "self_attn.k_norm.weight": torch.ones(d, dtype=dtype),
             p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
             p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype),
             p + "mlp.gate.weight": torch.empty(cfg.num_experts, h, dtype=dtype)}
        for e in range(cfg.num_experts):
            for proj, shape in (("gate_proj", (cfg.moe_intermediate_size, h)), ("up_proj", (cfg.moe_intermediate_size, h)),
                                ("down_proj", (h, cfg.moe_intermediate_size))):
                t[f"{p}mlp.experts.{e}.{proj}.weight"] = torch.empty(shape, dtype=dtype)
        shard(f"layer{i}.safetensors", t)
        del t
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}))
    cfg.save_pretrained(str(out))
    return total, largest


def _load_probe(model_dir: str, device: str, dtype_name: str, queue) -> None:
    """In a fresh process (no freed memory the allocator could hand back unseen): load
    ``model_dir`` while a thread samples RssAnon; puts (baseline kB, peak kB, load s,
    parameter bytes) or an error string on ``queue``."""
    try:
        import torch

        from pyengine.attention.backend import get_backend_cls
        from pyengine.config import EngineArgs
        from pyengine.models.loader import load_model
        from pyengine.models.registry import model_dims

        if device == "cuda":
            torch.zeros(1, device="cuda")  # the CUDA context's own host memory before the baseline
        ecfg = EngineArgs(model=model_dir, device=device, dtype=dtype_name, max_model_len=256).create_engine_config()
        dims = model_dims(ecfg.hf_config)
        backend = get_backend_cls("torch")(dims.num_heads, dims.num_kv_heads, dims.head_dim, dims.head_dim ** -0.5,
                                           16, ecfg.dtype, ecfg.device)
        base = _rss_anon_kb() or 0
        peak = [base]
        stop = threading.Event()

        def sample():
            while not stop.is_set():
                v = _rss_anon_kb()
                if v is not None and v > peak[0]:
                    peak[0] = v
                time.sleep(0.002)
        th = threading.Thread(target=sample, daemon=True)
        th.start()
        t0 = time.perf_counter()
        model = load_model(ecfg, backend)
        _sync(device)
        load_s = time.perf_counter() - t0
        stop.set()
        th.join()
        queue.put((base, peak[0], load_s, sum(p.numel() * p.element_size() for p in model.parameters())))
    except BaseException as e:
        queue.put(f"{type(e).__name__}: {e}")


def bench_loading(args, device: str, dtype) -> dict:
    import multiprocessing as mp

    import torch

    cfg = moe_config(args.shape, vocab_size=min(moe_config(args.shape).vocab_size, 8192), num_layers=args.load_layers)
    dtype_name = str(dtype).replace("torch.", "")
    with tempfile.TemporaryDirectory(dir=args.tmp_dir) as tmp:
        t0 = time.perf_counter()
        ckpt_bytes, largest = _write_checkpoint(cfg, Path(tmp), dtype)
        write_s = time.perf_counter() - t0
        gc.collect()
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        proc = ctx.Process(target=_load_probe, args=(tmp, device, dtype_name, q))
        proc.start()
        got = q.get(timeout=600)
        proc.join(60)
    if isinstance(got, str):
        return {"error": got}
    base, peak, load_s, params = got
    mb = 2 ** 20
    delta = (peak - base) * 1024
    return {"layers": args.load_layers, "checkpoint_mb": ckpt_bytes / mb, "largest_tensor_mb": largest / mb,
            "expert_tensor_mb": cfg.hidden_size * cfg.moe_intermediate_size * torch.empty((), dtype=dtype).element_size() / mb,
            "model_params_mb": params / mb, "write_s": write_s, "load_s": load_s, "load_gb_s": ckpt_bytes / load_s / 1e9,
            "peak_rss_anon_above_baseline_mb": delta / mb, "peak_over_checkpoint": delta / ckpt_bytes,
            "note": ("on CUDA the parameters live on the device: the peak is the loader's host copies "
                     "(expected: a few tensors); on the CPU it includes the model itself")}


# ---- section: engine -------------------------------------------------------------------------

def _metrics_tpot(outs, n: int) -> list[float]:
    tp = []
    for o in outs:
        m = o.metrics
        if m is not None and m.first_token_time is not None and m.last_token_time is not None and n > 1:
            tp.append((m.last_token_time - m.first_token_time) / (n - 1))
    return tp


def _throughput(llm, prompts, max_tokens, temperature: float, device: str) -> dict:
    from pyengine import SamplingParams

    params = [SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=m, detokenize=False, seed=i)
              for i, m in enumerate(max_tokens)]
    before = llm.llm_engine.get_stats()
    _sync(device)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    _sync(device)
    elapsed = time.perf_counter() - t0
    sd = stats_delta(before, llm.llm_engine.get_stats())
    out_toks = sum(len(o.outputs[0].token_ids) for o in outs)
    in_toks = sum(len(p) for p in prompts)
    return {"requests": len(prompts), "elapsed_s": elapsed, "output_tokens": out_toks, "prompt_tokens": in_toks,
            "output_tok_s": out_toks / elapsed, "total_tok_s": (out_toks + in_toks) / elapsed,
            "num_steps": sd["num_steps"], "host_ms_per_step": sd["host_ms_per_step"],
            "requests_short": sum(1 for o, m in zip(outs, max_tokens) if len(o.outputs[0].token_ids) != m)}


def _engine_kwargs(args, device: str, dtype_name: str) -> dict:
    """``LLM``'s arguments of the engine section (and of the profile part: the same engine)."""
    kw = dict(load_format="dummy", dtype=dtype_name, device=device, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, gpu_memory_utilization=args.gpu_memory_utilization, seed=0,
              tensor_parallel_size=args.tensor_parallel_size)
    if args.quantization == "fp8":  # at load; gptq is the model directory's own quantization_config
        kw["quantization"] = args.quantization
    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    return kw


def _floor_kwargs(args) -> dict:
    """``step_bytes``' quantized-weight arguments for ``--quantization``."""
    if args.quantization == "fp8":
        return {"weight_itemsize": 1}
    if args.quantization == "gptq":
        qc = gptq_config(args.shape)
        return {"weight_itemsize": qc["bits"] / 8, "group_size": qc["group_size"]}
    return {}


def bench_engine(args, model_dir: Path, device: str, dtype_name: str, save: Callable[[dict], None]) -> dict:
    import random

    import torch

    from pyengine import LLM, SamplingParams

    kw = _engine_kwargs(args, device, dtype_name)
    t0 = time.perf_counter()
    llm = LLM(str(model_dir), **kw)
    _sync(device)
    res: dict = {"startup_s": time.perf_counter() - t0, "engine_args": kw}
    cfg = llm.llm_engine.config
    hf = cfg.hf_config
    res.update(attention_backend=cfg.attention_backend, async_scheduling=cfg.async_scheduling,
               enforce_eager=cfg.enforce_eager, num_gpu_blocks=llm.llm_engine.get_stats().num_gpu_blocks)
    if device == "cuda":
        res["gpu_memory_allocated_gib"] = torch.cuda.memory_allocated() / 2 ** 30
    vocab = hf.vocab_size
    try:
        warm = random_prompts(2, 32, 64, vocab, seed=1000)
        llm.generate(warm, SamplingParams(temperature=0, ignore_eos=True, max_tokens=16, detokenize=False),
                     use_tqdm=False)
        # batch-1 TPOT against the bytes a step reads
        n_in, n_out = args.tpot_input_len, args.tpot_output_len
        tpots = []
        for i in range(args.tpot_iters):
            p = random_prompts(1, n_in, n_in, vocab, seed=2000 + i)
            outs = llm.generate(p, SamplingParams(temperature=0, ignore_eos=True, max_tokens=n_out, detokenize=False),
                                use_tqdm=False)
            tpots += _metrics_tpot(outs, n_out)
        itemsize = torch.empty((), dtype=cfg.dtype).element_size()
        mean_ctx = n_in + n_out / 2
        floor = step_bytes(hf, itemsize, batch=1, context=int(mean_ctx), **_floor_kwargs(args))
        tpot = statistics.median(tpots) if tpots else float("nan")
        floor_s = floor["total"] / (args.bandwidth_tbs * 1e12)
        res["batch1"] = {"input_len": n_in, "output_len": n_out, "tpot_ms": 1e3 * tpot,
                         "tpot_ms_all": [1e3 * t for t in tpots], "bytes_per_step": floor,
                         "bandwidth_tbs": args.bandwidth_tbs, "floor_ms": 1e3 * floor_s,
                         "tpot_over_floor": tpot / floor_s, "target_over_floor": 1.3,
                         "achieved_tbs": floor["total"] / tpot / 1e12 if tpots else None}
        print(f"batch-1 TPOT {1e3 * tpot:.3f} ms, floor {1e3 * floor_s:.3f} ms "
              f"({tpot / floor_s:.2f}x)", flush=True)
        save(res)
        if not args.serve_requests:  # --serve-requests 0: the batch-1 TPOT alone
            return res
        # the serving workload: N x 128-in / 256-out
        sp = random_prompts(args.serve_requests, args.serve_input_len, args.serve_input_len, vocab, seed=3000)
        res["serving_workload"] = _throughput(llm, sp, [args.serve_output_len] * len(sp), args.temperature, device)
        print(f"serving workload: {res['serving_workload']['output_tok_s']:.0f} output tok/s", flush=True)
        save(res)
        if not args.nano_requests:  # --nano-requests 0: skipped
            return res
        # nano-vllm's workload (benchmarks/throughput.py)
        lo, hi = args.nano_min_len, args.nano_max_len
        prompts = random_prompts(args.nano_requests, lo, hi, vocab, seed=0, max_id=10000)
        rng = random.Random(1)
        max_tokens = [rng.randint(lo, hi) for _ in prompts]
        res["nano_vllm_workload"] = _throughput(llm, prompts, max_tokens, args.temperature, device)
        print(f"nano-vllm workload: {res['nano_vllm_workload']['output_tok_s']:.0f} output tok/s", flush=True)
    finally:
        shutdown_llm(llm)
        del llm
        free_cuda()
    return res


# ---- section: profile ------------------------------------------------------------------------

def bench_profile(args, model_dir: Path, device: str, dtype_name: str) -> dict:
    """The engine section's engine (same arguments), one batch-1 request of the TPOT run's
    prompt length: ``--profile-steps`` decode steps under torch.profiler, per kernel and
    class (benchmarks/decode_profile.py), against the step's bandwidth floor."""
    import torch

    from benchmarks.decode_profile import profile_decode, report_md
    from pyengine import LLM

    kw = _engine_kwargs(args, device, dtype_name)
    t0 = time.perf_counter()
    llm = LLM(str(model_dir), **kw)
    _sync(device)
    startup = time.perf_counter() - t0
    try:
        cfg = llm.llm_engine.config
        res = profile_decode(llm, input_len=args.tpot_input_len, profile_steps=args.profile_steps,
                             warmup_steps=args.profile_warmup_steps, timed_steps=args.profile_timed_steps,
                             trace_dir=args.trace_dir, seed=2000)
        itemsize = torch.empty((), dtype=cfg.dtype).element_size()
        floor = step_bytes(cfg.hf_config, itemsize, batch=1, context=args.tpot_input_len + args.profile_warmup_steps
                           + args.profile_timed_steps + args.profile_steps // 2, **_floor_kwargs(args))
        res.update(startup_s=startup, engine_args=kw, attention_backend=cfg.attention_backend,
                   bytes_per_step=floor, bandwidth_tbs=args.bandwidth_tbs,
                   floor_us=floor["total"] / (args.bandwidth_tbs * 1e6))
        print(report_md(f"Batch-1 decode profile, {args.shape} ({dtype_name}); bandwidth floor "
                        f"{res['floor_us']:.1f} us/step", res), flush=True)
    finally:
        shutdown_llm(llm)
        del llm
        free_cuda()
    return res


# ---- main ------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True, help="directory for the JSON result (moe_<shape>.json)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny shape on the CPU, few requests: the same code paths (kernels under TRITON_INTERPRET=1)")
    p.add_argument("--shape", choices=SHAPES, default="qwen3-30b-a3b")
    p.add_argument("--model-dir", default=None, help="where to write the shape's config + tokenizer")
    p.add_argument("--tmp-dir", default=None, help="where the loading check writes its checkpoint (default: system temp)")
    p.add_argument("--sections", default="kernels,loading,engine",
                   help="comma-separated: kernels, loading, engine, profile (not by default: the engine's batch-1 "
                        "decode steps under torch.profiler, per kernel; alone, it writes moe_profile_<shape>.json)")
    p.add_argument("--sweep", action="store_true", help="run the tile-config sweep instead of the sections")
    p.add_argument("--sweep-n", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="intermediate sizes to sweep (default: the shape's; 384 is TP=2's)")
    p.add_argument("--sweep-budget-s", type=float, default=None,
                   help="seconds the sweep may take (default 330; 48 with --sweep-quick)")
    p.add_argument("--sweep-m", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help=f"token counts to tune (the table's keys; default {','.join(map(str, SWEEP_M))}, "
                        f"{','.join(map(str, QUICK_SWEEP_M))} with --sweep-quick)")
    p.add_argument("--sweep-quick", action="store_true",
                   help="the sweep in about a minute on the H200: M 1,16,256,4096, the default BLOCK_SIZE_M and "
                        "four tiles a pass each; M 1: the GEMV tile in use, its SPLIT_K variants and neighbours")
    p.add_argument("--iters", type=int, default=10, help="timed calls per repeat")
    p.add_argument("--repeats", type=int, default=3, help="repeats (median)")
    p.add_argument("--config-dir", default=None, help="where the sweep writes (default: pyengine/layers/fused_moe/configs)")
    p.add_argument("--kernel-m", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 64, 256, 1024, 4096])
    p.add_argument("--kernel-layers", type=int, default=6, help="weight sets cycled per timing (L2 stays cold)")
    p.add_argument("--load-layers", type=int, default=2)
    p.add_argument("--bandwidth-tbs", type=float, default=4.8, help="usable HBM bandwidth for the floor")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--quantization", choices=("fp8", "gptq"), default=None,
                   help="engine and profile sections: fp8 quantizes at load (attention and experts FP8 per output "
                        "row); gptq makes the model a GPTQ W4A16 checkpoint (group 128) of random valid weights; "
                        "the result file gets the name as a suffix")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--tpot-input-len", type=int, default=128)
    p.add_argument("--tpot-output-len", type=int, default=256)
    p.add_argument("--tpot-iters", type=int, default=3)
    p.add_argument("--serve-requests", type=int, default=512, help="0: skip the serving workload (batch-1 TPOT only)")
    p.add_argument("--serve-input-len", type=int, default=128)
    p.add_argument("--serve-output-len", type=int, default=256)
    p.add_argument("--nano-requests", type=int, default=256, help="0: skip nano-vllm's workload")
    p.add_argument("--nano-min-len", type=int, default=100)
    p.add_argument("--nano-max-len", type=int, default=1024)
    add_profile_args(p)
    return p


def _apply_smoke(args) -> None:
    args.shape = "tiny"
    args.kernel_m = [1, 40]  # the GEMV path and the grouped GEMM
    args.kernel_layers = 1  # one expert set: the interpreter is slow and the code path the same
    args.load_layers = 2
    args.max_model_len = 256
    args.max_num_seqs = 8
    args.tpot_input_len, args.tpot_output_len, args.tpot_iters = 8, 6, 1
    args.profile_steps, args.profile_warmup_steps, args.profile_timed_steps = 6, 2, 4
    args.serve_requests, args.serve_input_len, args.serve_output_len = 4, 8, 6
    args.nano_requests, args.nano_min_len, args.nano_max_len = 3, 4, 12
    args.sweep_m = [1, 40]  # one GEMV-path M, one grouped-GEMM M
    args.iters, args.repeats = 1, 1
    args.sweep_budget_s = min(args.sweep_budget_s or 120.0, 120.0)
    args.config_dir = args.config_dir or str(Path(args.out_dir) / "configs")  # never the repository's


def main(argv: list[str] | None = None) -> dict:
    import torch

    args = build_parser().parse_args(argv)
    if args.sweep_m is None:
        args.sweep_m = list(QUICK_SWEEP_M if args.sweep_quick else SWEEP_M)
    if args.sweep_budget_s is None:
        args.sweep_budget_s = 48.0 if args.sweep_quick else 330.0
    if args.cpu_smoke:
        _apply_smoke(args)
    device = "cpu" if args.cpu_smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: CUDA is not available; pass --cpu-smoke for the CPU smoke run.")
    dtype_name = "float32" if device == "cpu" else "bfloat16"
    dtype = getattr(torch, dtype_name)
    cfg = moe_config(args.shape)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = command_line() if argv is None else "benchmarks/moe.py " + " ".join(argv)
    payload = {"benchmark": "moe", "command": cmd, "hardware": hardware_info(device), "args": vars(args),
               "shape": args.shape, "dtype": dtype_name, "results": {}}
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    stem = "moe_sweep" if args.sweep else "moe_profile" if sections == ["profile"] else \
        "moe_int_tiles" if sections == ["int_tiles"] else "moe"
    if args.quantization:
        stem += f"_{args.quantization}"
    out = out_dir / f"{stem}_{args.shape}.json"
    t_start = time.perf_counter()

    def save(section=None, value=None):
        if section is not None:
            payload["results"][section] = value
        payload["elapsed_s"] = time.perf_counter() - t_start
        write_json(str(out), payload)

    if args.sweep:
        save("sweep", run_sweep(args, cfg, device, dtype))
        return payload
    bad = [s for s in sections if s not in ("kernels", "loading", "engine", "profile", "int_tiles")]
    if bad:
        sys.exit(f"error: unknown sections {bad}")
    for name in sections:
        t0 = time.perf_counter()
        try:
            if name == "kernels":
                value = bench_kernels(args, cfg, device, dtype)
            elif name == "int_tiles":
                value = bench_int_tiles(args, cfg, device, dtype)
            elif name == "loading":
                value = bench_loading(args, device, dtype)
            else:
                gptq = args.quantization == "gptq"
                model_dir = Path(args.model_dir) if args.model_dir else \
                    Path(tempfile.gettempdir()) / "vengine_bench_models" / f"moe-{args.shape}{'-gptq' if gptq else ''}"
                make_moe_model_dir(args.shape, model_dir, gptq_config(args.shape) if gptq else None)
                if name == "profile":
                    value = bench_profile(args, model_dir, device, dtype_name)
                else:
                    value = bench_engine(args, model_dir, device, dtype_name, lambda partial: save("engine", partial))
        except Exception as e:  # keep the other sections' numbers
            import traceback
            traceback.print_exc()
            value = {"error": f"{type(e).__name__}: {e}"}
            free_cuda()
        if isinstance(value, dict):
            value["section_s"] = time.perf_counter() - t0
        save(name, value)
    print(f"done in {time.perf_counter() - t_start:.0f} s")
    return payload


if __name__ == "__main__":
    main()
