"""Quantized models on one GPU (issue 26): batch-1 TPOT and offline throughput of FP8 and
INT4 weights against bf16, FP8 KV cache capacity, and the kernels' bandwidth.

Random weights of the named shape (default the Llama-3.1-8B shape), made on the GPU at
start-up, no checkpoint:

* ``bf16``: ``load_format="dummy"``;
* ``fp8``: the same bf16 weights quantized at load by ``quantization="fp8"`` (per-channel
  FP8 weights, per-token FP8 activations);
* ``w4a16``: a GPTQ 4-bit, group-128 config (``quantization_config`` in the shape's
  config.json) whose packed weights, scales and zero points ``load_format="dummy"`` fills
  with random valid values on the GPU;
* ``fp8_kv``: bf16 weights with ``kv_cache_dtype="fp8"``;
* ``fp8_fp8kv`` (``--throughput-fp8-kv``, throughput only): FP8 weights and the FP8 KV
  cache, as FP8 deployments usually run; its ratio is reported beside the FP8-weights
  one, not instead of it (issue 26's target is FP8 weights against bf16).

Parts (``--parts``, default all):

* ``tpot``: batch 1, 32-token prompt, ``--output-len`` tokens, greedy, ``ignore_eos``: time
  per output token (request metrics), median of ``--iters``; ratios to bf16 (targets:
  fp8 <= 0.60, w4a16 <= 0.40);
* ``throughput``: nano-vllm's workload (``--num-requests`` 256 in flight, prompt and output
  lengths uniform in [100, 1024]) for bf16 and fp8: output tokens/s, the best of
  ``--throughput-repeats`` runs, and the ratio (target >= 1.3);
* ``kv``: KV cache blocks/tokens with the bf16 and the FP8 cache at the same
  ``--gpu-memory-utilization`` (target 2x);
* ``kernels``: per linear-layer shape of the model, one-token GEMV time and weight
  bandwidth of bf16 (ops.linear), FP8 (ops.quant.fp8_gemv, per-token activations) and INT4
  (ops.quant.int_gemv, group ``--group-size``): a CUDA graph of back-to-back calls rotating
  over copies of the weight (4x the L2 cache in all, so every call reads HBM, as a decode
  step does), plus the single call after an L2 flush that earlier runs recorded
  (``*_single_us``); a layer's four GEMVs summed against bf16's; and the prefill GEMM
  (``--gemm-m`` rows; 0: none) of bf16, FP8 (scaled_mm and the Triton kernel) and INT4;
  the INT4 GEMV also on its scales' and zeros' other forms (``w4a16_gemv_forms``: zeros
  as loaded, none (symmetric), none with the scales stored row-major).
  ``--sweep`` (kinds: ``--sweep-kinds``) also times the GEMV launch configs (``FP8_SWEEP``, ``INT_SWEEP``: block sizes,
  warps, stages, split-K, prefetch; an estimated 30-40 s of compiles and timings on one
  H200), reports the best per shape and writes them to
  ``pyengine/ops/configs/gemv,device_name=<GPU>.json`` (merged with what is there;
  ``--config-dir``) and a copy into the output directory: the table the GEMVs read
  (pyengine/ops/gemv_configs.py);
* ``attention``: paged decode attention over bf16 and FP8 caches (batch x context from
  ``--attn-cases``): time and KV bytes read per second;
* ``profile`` (asked for by name only, not in the default): the ``tpot`` part's engines
  (``--profile-variants``, default bf16, fp8, w4a16) on its prompt, ``--profile-steps``
  (20) batch-1 decode steps each under ``torch.profiler`` (CPU and CUDA activity, CUDA
  graphs as served): per kernel and class (attention, GEMV by layer role, norm, rope, quant,
  sampling, copies), GPU busy against the step's wall time, kernels per step
  (benchmarks/decode_profile.py); ``--trace-dir`` keeps the chrome traces. Alone it writes
  ``quant_profile.json`` instead of ``quant.json`` (about 60 s on the H200).

One JSON file, ``quant.json``, goes into the output directory given on the command line;
a markdown summary is printed. On one H200 the whole run takes about 5-6 minutes.

    python benchmarks/quant.py results/2026-12-02-h200                 # everything
    python benchmarks/quant.py OUT --parts tpot,kv
    python benchmarks/quant.py OUT --parts profile                      # batch-1 decode step per kernel
    python benchmarks/quant.py OUT --parts kernels --sweep --gemm-m 0   # GEMV configs per layer shape
    python benchmarks/quant.py OUT --device cpu --shape tiny --output-len 4 --num-requests 4 \\
        --max-len 24 --iters 1 --group-size 32                           # CPU smoke (engine parts)
    TRITON_INTERPRET=1 python benchmarks/quant.py OUT --device cpu --shape tiny --parts kernels,attention
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

from benchmarks.common import (  # noqa: E402
    add_common_args,
    free_cuda,
    header_md,
    md_table,
    prepare_model_dir,
    random_prompts,
    resolve_dtype,
    shutdown_llm,
    start,
    write_json,
)
from benchmarks.decode_profile import add_profile_args, compare_md, profile_decode, report_md  # noqa: E402

PARTS = ("tpot", "throughput", "kv", "kernels", "attention")
EXTRA_PARTS = ("profile",)  # asked for by name only
PROFILE_VARIANTS = ("bf16", "fp8", "w4a16")
TARGETS = {"tpot_fp8_over_bf16": 0.60, "tpot_w4a16_over_bf16": 0.40, "throughput_fp8_over_bf16": 1.3,
           "kv_tokens_fp8_over_bf16": 2.0}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, default_shape="llama-3.1-8b")
    p.add_argument("out_dir", help="directory for quant.json")
    p.add_argument("--parts", default=",".join(PARTS),
                   help=f"comma-separated, from {', '.join(PARTS + EXTRA_PARTS)} (default: all but profile)")
    p.add_argument("--profile-variants", default=",".join(PROFILE_VARIANTS),
                   help="engines of the profile part, from " + ", ".join(PROFILE_VARIANTS))
    add_profile_args(p)
    p.add_argument("--output-len", type=int, default=128, help="tokens per request of the TPOT runs")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--throughput-fp8-kv", action="store_true",
                   help="throughput part: also FP8 weights with the FP8 KV cache (fp8_fp8kv)")
    p.add_argument("--throughput-repeats", type=int, default=2,
                   help="timed runs of the throughput workload per engine (the best is reported)")
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--group-size", type=int, default=128, help="INT4 group size (32 for --shape tiny)")
    p.add_argument("--layer-shapes", type=_parse_layer_shapes, default=None,
                   help="the kernels part's layers instead of the shape's: NAME=NxK,... (e.g. Qwen3-30B-A3B's "
                        "attention: qkv_proj=5120x2048,o_proj=2048x4096)")
    p.add_argument("--gemm-m", type=int, default=2048, help="rows of the prefill GEMMs (kernels part; 0: none)")
    p.add_argument("--attn-cases", default="1x4096,64x2048,256x1024", help="batch x context of the attention part")
    p.add_argument("--sweep", action="store_true",
                   help="kernels part: also time the GEMV launch configs (FP8_SWEEP, INT_SWEEP), record the best per "
                        "layer shape and write them to pyengine/ops/configs/gemv,device_name=<GPU>.json (and OUT)")
    p.add_argument("--sweep-kinds", default="fp8,int4",
                   help="--sweep: the GEMV kinds to sweep (fp8, int4); the table keeps the other kinds' entries")
    p.add_argument("--config-dir", default=None, help="where --sweep writes its configs (default: pyengine/ops/configs)")
    p.add_argument("--verbose", action="store_true", help="engine INFO logs")
    return p


def _sync(device: str) -> None:
    if device == "cuda":
        import torch
        torch.cuda.synchronize()


def _time_us(fn: Callable[[], object], device: str, reps: int = 50) -> float:
    """Median microseconds of ``fn`` (CUDA events on the GPU; wall time on CPU)."""
    if device == "cuda":
        import triton.testing
        return 1e3 * triton.testing.do_bench(fn, warmup=10, rep=reps, return_mode="median")
    fn()
    times = []
    for _ in range(max(3, reps // 25)):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e6 * statistics.median(times)


# ---- engines ------------------------------------------------------------------------------
def _w4a16_dir(base: Path, group_size: int) -> Path:
    """The shape's dir with a GPTQ 4-bit quantization_config (files linked)."""
    out = base.parent / f"{base.name}-gptq4-g{group_size}"
    out.mkdir(parents=True, exist_ok=True)
    for f in base.iterdir():
        if f.name != "config.json" and not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    cfg = json.loads((base / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": False,
                                  "sym": True}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def _engine(args, model_dir: Path, variant: str, max_num_seqs: int):
    from pyengine import LLM

    kw = {"fp8": {"quantization": "fp8"}, "fp8_kv": {"kv_cache_dtype": "fp8"},
          "fp8_fp8kv": {"quantization": "fp8", "kv_cache_dtype": "fp8"}}.get(variant, {})
    t0 = time.perf_counter()
    llm = LLM(str(model_dir), load_format="dummy", dtype=resolve_dtype(args), device=args.device,
              max_model_len=args.max_model_len, max_num_seqs=max_num_seqs,
              gpu_memory_utilization=args.gpu_memory_utilization, **kw)
    _sync(args.device)
    return llm, time.perf_counter() - t0


def _tpot_ms(args, llm) -> float:
    from pyengine import SamplingParams

    vocab = llm.llm_engine.config.hf_config.vocab_size
    n = args.output_len
    sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n, detokenize=False)
    llm.generate(random_prompts(1, 32, 32, vocab, seed=1), SamplingParams(max_tokens=4, ignore_eos=True),
                 use_tqdm=False)  # warm-up
    tpots = []
    for i in range(args.iters):
        out = llm.generate(random_prompts(1, 32, 32, vocab, seed=100 + i), sp, use_tqdm=False)[0]
        m = out.metrics
        tpots.append((m.last_token_time - m.first_token_time) / max(n - 1, 1))
    return 1e3 * statistics.median(tpots)


def _throughput(args, llm) -> dict:
    import random

    from pyengine import SamplingParams

    vocab = llm.llm_engine.config.hf_config.vocab_size
    rng = random.Random(0)
    prompts = random_prompts(args.num_requests, args.min_len, args.max_len, vocab, seed=0)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=rng.randint(args.min_len, args.max_len),
                             detokenize=False) for _ in prompts]
    llm.generate(prompts[:2], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)  # warm-up
    # The whole workload --throughput-repeats times, the best run reported: the first run of
    # the first engine in a process compiles the batch shapes' kernel variants (Triton's
    # cache), which confounded a 2026-12-04 bf16-vs-FP8 ratio by ~6%.
    runs = []
    for _ in range(max(args.throughput_repeats, 1)):
        _sync(args.device)
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        _sync(args.device)
        elapsed = time.perf_counter() - t
        toks = sum(len(o.outputs[0].token_ids) for o in outs)
        runs.append({"output_tokens": toks, "elapsed_s": elapsed, "output_tok_s": toks / elapsed})
    best = max(runs, key=lambda r: r["output_tok_s"])
    return {**best, "runs_output_tok_s": [r["output_tok_s"] for r in runs]}


def _kv_info(llm) -> dict:
    runner = llm.llm_engine.engine_core.model_runner
    cfg = llm.llm_engine.config
    blocks = runner.num_blocks - 1  # the null block
    return {"kv_cache_dtype": cfg.kv_cache_dtype, "num_blocks": blocks, "tokens": blocks * cfg.block_size,
            "bytes_per_block": runner.kv_bytes_per_block()}


def run_engines(args, parts: set, results: dict) -> None:
    base = prepare_model_dir(args)
    variants = []
    if parts & {"tpot", "throughput", "kv"}:
        variants.append("bf16")
    if parts & {"tpot", "throughput"}:
        variants.append("fp8")
    if "tpot" in parts:
        variants.append("w4a16")
    if "throughput" in parts and args.throughput_fp8_kv:
        variants.append("fp8_fp8kv")
    if "kv" in parts:
        variants.append("fp8_kv")
    for v in variants:
        model_dir = _w4a16_dir(base, args.group_size) if v == "w4a16" else base
        # fp8_kv is sized like bf16 (same max_num_seqs: the same profiling peak), so their
        # KV capacities compare
        seqs = args.num_requests if (v in ("bf16", "fp8", "fp8_kv", "fp8_fp8kv") and "throughput" in parts) else 1
        print(f"[{v}] building the engine ...", flush=True)
        llm, startup = _engine(args, model_dir, v, max(seqs, 1))
        r = {"startup_s": startup, "quantization": llm.llm_engine.config.quantization,
             "kv_cache_dtype": llm.llm_engine.config.kv_cache_dtype}
        if "tpot" in parts and v not in ("fp8_kv", "fp8_fp8kv"):
            r["tpot_ms"] = _tpot_ms(args, llm)
            print(f"[{v}] TPOT {r['tpot_ms']:.3f} ms", flush=True)
        if "throughput" in parts and v in ("bf16", "fp8", "fp8_fp8kv"):
            r["throughput"] = _throughput(args, llm)
            print(f"[{v}] {r['throughput']['output_tok_s']:,.0f} output tok/s", flush=True)
        if "kv" in parts and v in ("bf16", "fp8_kv"):
            r["kv"] = _kv_info(llm)
        results["engines"][v] = r
        shutdown_llm(llm)
        del llm
        free_cuda()
    e = results["engines"]

    def ratio(a, b):
        return a / b if a is not None and b else None
    tp = {k: e.get(k, {}).get("tpot_ms") for k in ("bf16", "fp8", "w4a16")}
    results["ratios"] = {
        "tpot_fp8_over_bf16": ratio(tp["fp8"], tp["bf16"]), "tpot_w4a16_over_bf16": ratio(tp["w4a16"], tp["bf16"]),
        "throughput_fp8_over_bf16": ratio(e.get("fp8", {}).get("throughput", {}).get("output_tok_s"),
                                          e.get("bf16", {}).get("throughput", {}).get("output_tok_s")),
        "kv_tokens_fp8_over_bf16": ratio(e.get("fp8_kv", {}).get("kv", {}).get("tokens"),
                                         e.get("bf16", {}).get("kv", {}).get("tokens")),
    }
    if "fp8_fp8kv" in e:  # (no target: reported beside the FP8-weights ratio)
        results["ratios"]["throughput_fp8_fp8kv_over_bf16"] = ratio(
            e["fp8_fp8kv"]["throughput"]["output_tok_s"], e.get("bf16", {}).get("throughput", {}).get("output_tok_s"))


def run_profile(args, results: dict, save: Callable[[], None] | None = None) -> None:
    """The TPOT part's engines (``--profile-variants``; max_num_seqs 1, as ``--parts tpot``
    builds them) on its 32-token prompt: ``--profile-steps`` batch-1 decode steps under
    torch.profiler each, per kernel and class (benchmarks/decode_profile.py)."""
    base = prepare_model_dir(args)
    variants = [v.strip() for v in args.profile_variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in PROFILE_VARIANTS]
    if bad or not variants:
        raise SystemExit(f"error: --profile-variants takes {', '.join(PROFILE_VARIANTS)}; got {args.profile_variants!r}")
    out = results.setdefault("profile", {})
    for v in variants:
        model_dir = _w4a16_dir(base, args.group_size) if v == "w4a16" else base
        print(f"[profile {v}] building the engine ...", flush=True)
        llm, startup = _engine(args, model_dir, v, 1)
        try:
            r = profile_decode(llm, input_len=32, profile_steps=args.profile_steps,
                               warmup_steps=args.profile_warmup_steps, timed_steps=args.profile_timed_steps,
                               trace_dir=os.path.join(args.trace_dir, v) if args.trace_dir else None, seed=100)
            r.update(startup_s=startup, quantization=llm.llm_engine.config.quantization)
        except Exception as e:  # keep the other variants' profiles
            import traceback
            traceback.print_exc()
            r = {"error": f"{type(e).__name__}: {e}"}
        finally:
            shutdown_llm(llm)
            del llm
            free_cuda()
        out[v] = r
        print(report_md(f"[profile {v}]", r, top=12), flush=True)
        if save is not None:  # a run cut short keeps the variants done
            save()
    ok = {v: r for v, r in out.items() if "error" not in r}
    if "bf16" in ok:
        results["profile_ratios"] = {
            f"{v}_over_bf16": {"wall": r["wall_us_per_step"] / ok["bf16"]["wall_us_per_step"],
                               "busy": r["gpu_busy_us_per_step"] / ok["bf16"]["gpu_busy_us_per_step"],
                               "gemm": (r["by_group"].get("gemm", {}).get("us_per_step", 0.0) /
                                        (ok["bf16"]["by_group"].get("gemm", {}).get("us_per_step") or float("nan")))}
            for v, r in ok.items() if v != "bf16"}


# ---- kernels ------------------------------------------------------------------------------
def _parse_layer_shapes(text: str) -> dict[str, tuple[int, int]]:
    """``NAME=NxK,...`` -> {name: (N, K)}; argparse.ArgumentTypeError for anything else."""
    out = {}
    for part in (t.strip() for t in str(text).split(",") if t.strip()):
        name, _, dims = part.partition("=")
        n, _, k = dims.partition("x")
        if not name or not n.isdigit() or not k.isdigit() or int(n) < 1 or int(k) < 1:
            raise argparse.ArgumentTypeError(f"layer shape {part!r}: want NAME=NxK (positive integers)")
        out[name] = (int(n), int(k))
    if not out:
        raise argparse.ArgumentTypeError("--layer-shapes: no NAME=NxK given")
    return out


def _layer_shapes(hf) -> dict[str, tuple[int, int]]:
    """(N, K) of one decoder layer's linear layers (tensor parallel 1)."""
    hd = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    kvh = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    h, i = hf.hidden_size, hf.intermediate_size
    return {"qkv_proj": ((hf.num_attention_heads + 2 * kvh) * hd, h), "o_proj": (h, hf.num_attention_heads * hd),
            "gate_up_proj": (2 * i, h), "down_proj": (h, i)}


# The launch configs the sweep times, per GEMV (see ops/quant.py): FP8 rows a program x
# columns a chunk x pipeline stages (4 warps: one wgmma warp group) x split_k (programs
# along K, partials added by a sum pass), then the CUDA-core FP8 kernel's (``fma``: rows x
# chunk x warps, stages unused; offline sm_90 builds, Triton 3.9: 72-250 registers and no
# spill at K = 4096 and 14336, 3.3-5.2 SASS instructions a weight byte against the bf16
# GEMV's ~2), packed-int rows a program x warps x split_k x prefetch (the next chunk's words
# loaded before this one's products; block_n 32: 255 registers, no spill at 4 warps and
# K = 4096 or 8 warps and K = 14336, 7% fewer instructions a value than 16 rows); the first
# of each is its CPU smoke run's. A config that cannot run a shape (a split without a chunk,
# prefetch with one chunk a split) is refused before it compiles. 28 + 55 configs, about 170
# compiles for the 8B shapes' two K values (~0.5 s each; the unrolled FMA kernel at
# K = 14336 longer: the 15 configs of 12-02 swept in 17 s on the H200).
FP8_SWEEP: list[dict[str, int | bool]] = [
    {"block_n": bn, "block_k": bk, "num_warps": 4, "num_stages": st}
    for bn, bk, st in ((8, 2048, 3), (4, 1024, 4), (4, 2048, 3), (8, 1024, 4), (8, 2048, 4), (16, 2048, 3),
                       (16, 2048, 4))]
FP8_SWEEP += [{"block_n": bn, "block_k": bk, "num_warps": 4, "num_stages": st, "split_k": sk}
              for bn, bk, st, sk in ((8, 1024, 4, 2), (8, 2048, 3, 2), (4, 1024, 4, 2), (8, 1024, 4, 4))]
FP8_FMA_SWEEP: list[dict[str, int | bool]] = [
    {"block_n": bn, "block_k": bk, "num_warps": nw, "num_stages": 1, **({"split_k": sk} if sk > 1 else {}),
     "fma": True}
    for bn, bk, nw, sk in ((16, 512, 4, 1), (8, 512, 4, 1), (8, 1024, 4, 1), (32, 512, 4, 1), (16, 512, 2, 1),
                           (4, 2048, 4, 1), (8, 2048, 8, 1), (8, 512, 4, 2), (16, 512, 4, 2))]
FP8_SWEEP += FP8_FMA_SWEEP
# persistent tensor-core programs (a few an SM walk the blocks through one pipelined loop, the
# token's scale once a program; offline sm_90 builds: 50 registers and ~30 KB at 8 rows x
# 1024 columns x 3 stages), per SM x rows x chunk x stages
FP8_SWEEP += [{"block_n": bn, "block_k": bk, "num_warps": 4, "num_stages": st, "persistent": p}
              for bn, bk, st, p in ((8, 1024, 3, 4), (8, 1024, 4, 4), (8, 2048, 3, 2), (16, 1024, 3, 3), (4, 1024, 4, 6),
                                    (8, 512, 4, 6), (16, 2048, 2, 2), (8, 1024, 3, 6))]
INT_SWEEP: list[dict[str, int | bool]] = [
    {"block_n": bn, "num_warps": nw} for bn, nw in ((8, 2), (4, 1), (4, 2), (8, 1), (8, 4), (16, 1), (16, 2), (16, 4),
                                                    (32, 4), (32, 8))]
INT_SWEEP += [{"block_n": bn, "num_warps": nw, **({"split_k": sk} if sk > 1 else {}),
               **({"prefetch": True} if pf else {})}
              for bn, nw, sk, pf in ((16, 2, 2, False), (16, 4, 2, False), (8, 1, 4, False), (16, 1, 1, True),
                                     (16, 2, 1, True), (8, 2, 1, True), (16, 1, 2, True), (8, 1, 1, True),
                                     (8, 4, 1, True))]
# the f16x2 products (``half2``: ~3.7 SASS instructions an int4 value at 16 rows against
# ~4.6, offline sm_90 builds), at the tiles above that can use them
INT_SWEEP += [{"block_n": bn, "num_warps": nw, **({"split_k": sk} if sk > 1 else {}),
               **({"prefetch": True} if pf else {}), "half2": True}
              for bn, nw, sk, pf in ((8, 2, 1, False), (8, 4, 1, False), (16, 2, 1, False), (16, 4, 1, False),
                                     (32, 4, 1, False), (32, 8, 1, False), (16, 8, 1, False), (8, 1, 1, True),
                                     (16, 1, 1, True), (16, 2, 1, True), (8, 2, 1, True), (16, 4, 2, False))]
# persistent programs (a few an SM, each walking blocks of rows with the next one's words in
# flight during the products; offline sm_90 builds: 128 registers at 8 rows x 4 warps, 4
# programs an SM; 255 at 16 rows, 2), per SM x rows x warps x words a thread (``vec``)
INT_SWEEP += [{"block_n": bn, "num_warps": nw, "persistent": p, **({"vec": v} if v else {}), "half2": True}
              for bn, nw, p, v in ((8, 4, 4, 0), (8, 4, 3, 0), (8, 4, 2, 0), (16, 4, 2, 0), (4, 4, 4, 0), (8, 2, 4, 8),
                                   (8, 2, 6, 0), (16, 2, 3, 0), (4, 2, 8, 8), (8, 1, 8, 0), (16, 8, 1, 0), (8, 8, 2, 0))]
INT_SWEEP += [{"block_n": 8, "num_warps": 4, "persistent": 4}]  # the float32 products, persistent
# ... their words through Triton's software pipeline (cp.async into shared memory, stages - 1
# chunks ahead; 96 registers and ~36 KB at 8 rows x 4 warps x 3 stages: 5 programs an SM)
INT_SWEEP += [{"block_n": bn, "num_warps": nw, "persistent": p, "stages": st, "half2": True}
              for bn, nw, p, st in ((8, 4, 4, 3), (8, 4, 5, 3), (8, 4, 4, 4), (8, 4, 3, 4), (16, 4, 2, 3), (16, 4, 3, 3),
                                    (8, 2, 8, 3), (8, 2, 6, 4), (4, 4, 6, 3), (16, 2, 4, 3), (8, 2, 10, 3))]


def _copies(dev: str, nbytes: int) -> int:
    """Weight copies a timing rotates over: at least 4x the L2 cache in all (every call reads
    HBM, as in a forward), one on CPU."""
    if dev != "cuda":
        return 1
    import torch
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return max(2, -(-4 * l2 // nbytes))


def _rotated_us(dev: str, calls: list[Callable[[], object]], iters: int = 10, repeats: int = 5) -> float:
    """Microseconds per call of back-to-back calls over the weight copies in a CUDA graph
    (how a decode step runs them); on CPU, ``_time_us`` of the first."""
    if dev != "cuda":
        return _time_us(calls[0], dev, reps=25)
    from benchmarks.common import cuda_graph_replay_us
    return cuda_graph_replay_us(lambda: [c() for c in calls], iters, repeats) / len(calls)


def run_kernels(args, results: dict) -> None:
    import torch
    from transformers import AutoConfig

    from pyengine import ops
    from pyengine.layers.quantization.utils import fp8_quantize, pack_int32
    from pyengine.ops import quant

    dev = args.device
    dtype = getattr(torch, resolve_dtype(args))
    hf = AutoConfig.from_pretrained(str(prepare_model_dir(args)))
    rows = []
    gs = args.group_size
    sweep_t0 = None
    for name, (n, k) in (args.layer_shapes or _layer_shapes(hf)).items():
        g = torch.Generator(device=dev).manual_seed(n + k)
        w_bytes, fp8_bytes, int_bytes = n * k * 2, n * k, n * k // 2 + 4 * n * k // gs
        ws = [torch.randn(n, k, device=dev, dtype=dtype, generator=g) * 0.02 for _ in range(_copies(dev, w_bytes))]
        fp8 = [fp8_quantize(torch.randn(n, k, device=dev, dtype=dtype, generator=g) * 0.02)
               for _ in range(_copies(dev, fp8_bytes))]
        ints = [(pack_int32(torch.randint(0, 16, (n, k), device=dev, dtype=torch.int32, generator=g), 4, 1),
                 torch.rand(k // gs, n, device=dev, generator=g).to(dtype) * 0.004,
                 torch.randint(0, 16, (k // gs, n), device=dev, generator=g).to(dtype))
                for _ in range(_copies(dev, int_bytes))]
        x1 = torch.randn(1, k, device=dev, dtype=dtype, generator=g)
        row = {"layer": name, "N": n, "K": k, "copies": {"bf16": len(ws), "fp8": len(fp8), "int4": len(ints)}}
        gemvs = {"bf16_gemv": ([lambda w=w: ops.linear(x1, w) for w in ws], w_bytes),
                 "fp8_gemv": ([lambda wq=wq, sc=sc: quant.fp8_gemv(x1, wq, sc, act="token") for wq, sc in fp8],
                              fp8_bytes),
                 "w4a16_gemv": ([lambda q=q: quant.int_gemv(x1, q[0], q[1], q[2], 4, gs) for q in ints], int_bytes)}
        row.update(_gemv_errors(x1, fp8[0], ints[0], gs))
        for label, (calls, nbytes) in gemvs.items():
            us = _rotated_us(dev, calls)
            row[f"{label}_us"], row[f"{label}_gb_s"] = us, nbytes / us / 1e3
            # one call after an L2 flush (triton's do_bench): what earlier runs recorded
            row[f"{label}_single_us"] = _time_us(calls[0], dev)
        # the int4 GEMV (its shipped config) on the scales' and zeros' other forms: symmetric (no zeros
        # tensor: what finalize_int keeps of a sym checkpoint) and the scales stored row-major too
        sym = [(q[0], q[1], None) for q in ints]
        rowm = [(q[0], q[1].t().contiguous().t(), None) for q in ints]
        row["w4a16_gemv_forms"] = {
            form: _rotated_us(dev, [lambda q=q: quant.int_gemv(x1, q[0], q[1], q[2], 4, gs) for q in qs])
            for form, qs in (("zeros", ints), ("symmetric", sym), ("symmetric_row_major_scales", rowm))}
        if args.sweep:
            sweep_t0 = sweep_t0 or time.perf_counter()
            row["sweep"] = _sweep_gemv(dev, x1, fp8, ints, gs, fp8_bytes, int_bytes, _sweep_kinds(args))
            for label in set(_SWEEP_KINDS.values()) - _sweep_kinds(args):  # not swept: the shipped config's time
                row["sweep"].update({f"{label}_best": "(not swept)", f"{label}_best_us": row[f"{label}_us"],
                                     f"{label}_best_gb_s": row[f"{label}_gb_s"]})
        m = args.gemm_m if dev == "cuda" else 16
        if m:
            row.update(_time_gemms(dev, dtype, m, ws[0], fp8[0], ints[0], gs))
        rows.append(row)
        print(f"[kernels] {name}: " + ", ".join(f"{k_}={v:.1f}" for k_, v in row.items()
                                               if k_.endswith("_us") and not k_.endswith("single_us")), flush=True)
        del ws, fp8, ints
        free_cuda()
    layer = {x: sum(r[f"{x}_us"] for r in rows) for x in ("bf16_gemv", "fp8_gemv", "w4a16_gemv")}
    out = {"gemm_m": m, "group_size": gs, "rows": rows,
           "layer_gemv_us": layer, "layer_gemv_ratio": {"fp8": layer["fp8_gemv"] / layer["bf16_gemv"],
                                                         "w4a16": layer["w4a16_gemv"] / layer["bf16_gemv"]}}
    if args.sweep:
        best = {x: sum(r["sweep"][f"{x}_best_us"] for r in rows) for x in ("fp8_gemv", "w4a16_gemv")}
        out["layer_gemv_best_us"] = best
        out["layer_gemv_best_ratio"] = {"fp8": best["fp8_gemv"] / layer["bf16_gemv"],
                                        "w4a16": best["w4a16_gemv"] / layer["bf16_gemv"]}
        out["sweep_s"] = time.perf_counter() - sweep_t0
        out["config_files"] = _write_gemv_configs(args, dev, rows)
    results["kernels"] = out


def _gemv_errors(x1, fp8, ints, gs) -> dict:
    """Each quantized GEMV (default config) against its dequantized float32 reference: the
    largest error over the largest reference value (the GPU tests' bound for bf16: 1e-2)."""

    from pyengine.ops import quant

    wq, ws = fp8
    xf = x1.float()
    xs = (xf.abs().amax() / 448.0).clamp(min=quant._MIN_SCALE)
    xq = (xf / xs).clamp(-448.0, 448.0).to(quant.FP8_DTYPE).float() * xs
    refs = {"fp8_gemv": (quant.fp8_gemv(x1, wq, ws, act="token"), xq @ (wq.float() * ws[:, None]).t()),
            "w4a16_gemv": (quant.int_gemv(x1, *ints, 4, gs), xf @ quant.dequant_int_ref(*ints, 4, gs).t())}
    out = {}
    for label, (y, ref) in refs.items():
        out[f"{label}_rel_err"] = ((y.float() - ref).abs().max() / ref.abs().max().clamp(min=1e-6)).item()
    return out


def _time_gemms(dev, dtype, m, w, fp8, ints, gs) -> dict:
    """The prefill GEMMs (m rows) of one layer shape: us and TFLOP/s."""
    import torch

    from pyengine.ops import quant

    (wq, wsc), (qw, s, z) = fp8, ints
    n, k = w.shape
    xm = torch.randn(m, k, device=dev, dtype=dtype)
    xq, xs = quant.quant_fp8(xm)
    flops = 2 * m * n * k
    gemms = [("bf16_gemm", lambda: torch.nn.functional.linear(xm, w)),
             # what a prefill runs: activation quantization + scaled_mm (or the Triton GEMM)
             ("fp8_gemm", lambda: quant.fp8_linear(xm, wq, wsc, None, None, None, "token")),
             ("fp8_gemm_triton", lambda: quant.fp8_gemm(xq, wq, wsc, xs, dtype)),  # the GEMM alone
             ("w4a16_gemm", lambda: quant.int_gemm(xm, qw, s, z, 4, gs))]
    out = {}
    for label, fn in gemms:
        us = _time_us(fn, dev, reps=25)
        out[f"{label}_us"], out[f"{label}_tflops"] = us, flops / us / 1e6
    return out


_SWEEP_KINDS = {"fp8": "fp8_gemv", "int4": "w4a16_gemv"}  # --sweep-kinds -> the sweep's labels


def _sweep_kinds(args) -> set[str]:
    kinds = {k.strip() for k in args.sweep_kinds.split(",") if k.strip()}
    if not kinds or kinds - set(_SWEEP_KINDS):
        raise SystemExit(f"error: --sweep-kinds takes {', '.join(_SWEEP_KINDS)}; got {args.sweep_kinds!r}")
    return {_SWEEP_KINDS[k] for k in kinds}


def _sweep_gemv(dev, x1, fp8, ints, gs, fp8_bytes, int_bytes, kinds: set[str]) -> dict:
    """Every config of FP8_SWEEP / INT_SWEEP (the ``kinds`` of them) on one layer shape
    (configs whose output differs from the default's by more than bf16 rounding are
    refused), and the fastest."""
    from pyengine.ops import quant

    grids = {"fp8_gemv": FP8_SWEEP if dev == "cuda" else FP8_SWEEP[:2] + FP8_FMA_SWEEP[:1],
             "w4a16_gemv": INT_SWEEP if dev == "cuda" else INT_SWEEP[:2]}
    grids = {kind: grid for kind, grid in grids.items() if kind in kinds}
    calls = {"fp8_gemv": lambda cfg, q: quant.fp8_gemv(x1, q[0], q[1], act="token", **cfg),
             "w4a16_gemv": lambda cfg, q: quant.int_gemv(x1, q[0], q[1], q[2], 4, gs, **cfg)}
    weights = {"fp8_gemv": fp8, "w4a16_gemv": ints}
    nbytes = {"fp8_gemv": fp8_bytes, "w4a16_gemv": int_bytes}
    out: dict = {}
    for kind, grid in grids.items():
        ref = calls[kind]({}, weights[kind][0]).float()
        tol = 1e-2 * ref.abs().max().item() + 1e-6
        timed, refused = {}, {}
        for cfg in grid:
            label = ",".join(f"{k}={v}" for k, v in cfg.items())
            try:  # a config that fails to compile or launch is recorded, not fatal
                err = (calls[kind](cfg, weights[kind][0]).float() - ref).abs().max().item()
                if not err <= tol:
                    refused[label] = f"max error {err:.3g} > {tol:.3g}"
                    continue
                timed[label] = _rotated_us(dev, [lambda q=q, cfg=cfg: calls[kind](cfg, q) for q in weights[kind]])
            except Exception as e:  # noqa: BLE001 (triton's compile and resource errors have no common base)
                refused[label] = f"{type(e).__name__}: {str(e)[:200]}"
        out[f"{kind}_us"], out[f"{kind}_refused"] = timed, refused
        if not timed:
            raise RuntimeError(f"every {kind} config was refused: {refused}")
        best = min(timed, key=timed.get)
        out[f"{kind}_best"], out[f"{kind}_best_us"] = best, timed[best]
        out[f"{kind}_best_gb_s"] = nbytes[kind] / timed[best] / 1e3
        out[f"{kind}_best_config"] = next(c for c in grid if ",".join(f"{k}={v}" for k, v in c.items()) == best)
    return out


def _write_gemv_configs(args, dev: str, rows: list[dict]) -> list[str]:
    """The sweep's best configs as the table pyengine/ops/gemv_configs.py reads, merged into
    the device's file in the package (and copied into the output directory); [] off CUDA."""
    if dev != "cuda":
        return []
    import torch

    from pyengine.ops import gemv_configs

    name = gemv_configs.config_file_name(torch.cuda.get_device_name(0))
    pkg = Path(args.config_dir) if args.config_dir else gemv_configs.CONFIG_DIR
    path = pkg / name
    table = gemv_configs.parse_table(json.loads(path.read_text()), str(path)) if path.is_file() else {}
    for r in rows:
        key = gemv_configs.shape_key(r["N"], r["K"])
        for kind, label in _SWEEP_KINDS.items():
            if f"{label}_best_config" in r["sweep"]:
                table.setdefault(kind, {})[key] = r["sweep"][f"{label}_best_config"]
    text = json.dumps(table, indent=1, sort_keys=True) + "\n"
    pkg.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    copy = Path(args.out_dir) / name
    copy.parent.mkdir(parents=True, exist_ok=True)
    copy.write_text(text)
    gemv_configs.load_table.cache_clear()
    return [str(path), str(copy)]


def run_attention(args, results: dict) -> None:
    import math

    import torch
    from transformers import AutoConfig

    from pyengine.ops.paged_attention import default_num_splits, paged_decode

    dev = args.device
    dtype = getattr(torch, resolve_dtype(args))
    hf = AutoConfig.from_pretrained(str(prepare_model_dir(args)))
    hq = hf.num_attention_heads
    hkv = getattr(hf, "num_key_value_heads", None) or hq
    d = getattr(hf, "head_dim", None) or hf.hidden_size // hq
    bs = 16
    sms = torch.cuda.get_device_properties(0).multi_processor_count if dev == "cuda" else 8
    cases = [tuple(int(v) for v in c.split("x")) for c in args.attn_cases.split(",")]
    if dev != "cuda":
        cases = [(2, 64)]
    rows = []
    for batch, ctx in cases:
        per = math.ceil(ctx / bs)
        g = torch.Generator(device=dev).manual_seed(0)
        kv = torch.randn(2, batch * per + 1, bs, hkv, d, device=dev, dtype=dtype, generator=g)
        bt = (torch.randperm(batch * per, device=dev, generator=g) + 1).to(torch.int32).view(batch, per)
        seq = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        q = torch.randn(batch, hq, d, device=dev, dtype=dtype, generator=g)
        out = torch.empty_like(q)
        splits = default_num_splits(batch, hkv, sms)
        part_out = torch.empty(batch * hq * splits * d, dtype=torch.float32, device=dev)
        part_lse = torch.empty(batch * hq * splits, dtype=torch.float32, device=dev)
        row = {"batch": batch, "context": ctx, "splits": splits}
        for label, cache in (("bf16", kv), ("fp8", (kv / 4).to(torch.float8_e4m3fn))):
            us = _time_us(lambda c=cache: paged_decode(q, c[0], c[1], bt, seq, out, d ** -0.5, splits, part_out,
                                                       part_lse, k_scale=4.0, v_scale=4.0), dev)
            nbytes = 2 * batch * ctx * hkv * d * cache.element_size()
            row[f"{label}_us"], row[f"{label}_kv_gb_s"] = us, nbytes / us / 1e3
        row["fp8_speedup"] = row["bf16_us"] / row["fp8_us"]
        rows.append(row)
        print(f"[attention] {batch}x{ctx}: bf16 {row['bf16_us']:.1f} us, fp8 {row['fp8_us']:.1f} us", flush=True)
    results["attention"] = {"num_heads": hq, "num_kv_heads": hkv, "head_dim": d, "block_size": bs, "rows": rows}


# ---- report -------------------------------------------------------------------------------
def report(results: dict, hw: dict, cmd: str) -> None:
    print()
    print(header_md(f"Quantized models, {results['shape']} shape (random weights)", hw, cmd))
    e = results.get("engines", {})
    if e:
        print(md_table(["variant", "TPOT b=1 (ms)", "output tok/s (256 in flight)", "KV tokens", "start-up (s)"],
                       [[v, r.get("tpot_ms"), r.get("throughput", {}).get("output_tok_s"), r.get("kv", {}).get("tokens"),
                         r["startup_s"]] for v, r in e.items()]))
        print()
        print(md_table(["ratio", "measured", "target"],
                       [[k, v, TARGETS.get(k)] for k, v in results.get("ratios", {}).items() if v is not None]))
        print()
    if "kernels" in results:
        kern = results["kernels"]
        rows = kern["rows"]
        print("GEMV: one row, a CUDA graph of back-to-back calls over weight copies (HBM reads); "
              "us (GB/s of weight bytes)")
        print(md_table(["layer", "N x K", "bf16 GEMV", "FP8 GEMV", "W4A16 GEMV", "FP8 / bf16", "W4A16 / bf16",
                        "bf16 GEMM us", "FP8 GEMM us", "FP8 Triton GEMM us", "W4A16 GEMM us"],
                       [[r["layer"], f"{r['N']}x{r['K']}"] +
                        [f"{r[f'{x}_us']:.1f} ({r[f'{x}_gb_s']:.0f})" for x in ("bf16_gemv", "fp8_gemv", "w4a16_gemv")] +
                        [r["fp8_gemv_us"] / r["bf16_gemv_us"], r["w4a16_gemv_us"] / r["bf16_gemv_us"]] +
                        [r.get(f"{x}_us") for x in ("bf16_gemm", "fp8_gemm", "fp8_gemm_triton", "w4a16_gemm")]
                        for r in rows]))
        errs = {x: max(r[f"{x}_rel_err"] for r in rows) for x in ("fp8_gemv", "w4a16_gemv")}
        print(f"\nLargest error against the dequantized reference (of the largest output; bound 1e-2): FP8 "
              f"{errs['fp8_gemv']:.2e}, W4A16 {errs['w4a16_gemv']:.2e}" +
              ("" if max(errs.values()) <= 1e-2 else "  ** OVER THE BOUND **"))
        ratio = kern["layer_gemv_ratio"]
        print(f"\nA layer's four GEMVs: bf16 {kern['layer_gemv_us']['bf16_gemv']:.1f} us, FP8 "
              f"{kern['layer_gemv_us']['fp8_gemv']:.1f} us ({ratio['fp8']:.3f}x), W4A16 "
              f"{kern['layer_gemv_us']['w4a16_gemv']:.1f} us ({ratio['w4a16']:.3f}x)")
        print()
        forms = list(rows[0].get("w4a16_gemv_forms", {})) if rows else []
        if forms:
            print("W4A16 GEMV (shipped config) by the form of its scales and zeros, us")
            print(md_table(["layer"] + forms, [[r["layer"]] + [r["w4a16_gemv_forms"][f] for f in forms]
                                               for r in rows]))
            print()
        if rows and "sweep" in rows[0]:
            print(md_table(["layer", "FP8 GEMV best config", "us (GB/s)", "W4A16 GEMV best config", "us (GB/s)"],
                           [[r["layer"], r["sweep"]["fp8_gemv_best"],
                             f"{r['sweep']['fp8_gemv_best_us']:.1f} ({r['sweep']['fp8_gemv_best_gb_s']:.0f})",
                             r["sweep"]["w4a16_gemv_best"],
                             f"{r['sweep']['w4a16_gemv_best_us']:.1f} ({r['sweep']['w4a16_gemv_best_gb_s']:.0f})"]
                            for r in rows]))
            best = kern["layer_gemv_best_ratio"]
            print(f"\nBest configs, a layer: FP8 {best['fp8']:.3f}x bf16, W4A16 {best['w4a16']:.3f}x bf16; sweep "
                  f"{kern['sweep_s']:.0f} s; configs written: {', '.join(kern['config_files']) or 'none (CPU)'}")
            print()
    if results.get("profile"):
        prof = results["profile"]
        print("Batch-1 decode step per kernel group (us per step; profile part)")
        print(compare_md(prof))
        print()
        print(compare_md(prof, "by_class"))
        print()
        for v, r in prof.items():
            print(report_md(f"profile {v}", r, top=15))
            print()
        for v, q in results.get("profile_ratios", {}).items():
            print(f"{v}: wall {q['wall']:.3f}x, GPU busy {q['busy']:.3f}x, GEMV/GEMM {q['gemm']:.3f}x")
        print()
    if "attention" in results:
        print(md_table(["batch x context", "splits", "bf16 us (KV GB/s)", "FP8 us (KV GB/s)", "FP8 speed-up"],
                       [[f"{r['batch']}x{r['context']}", r["splits"], f"{r['bf16_us']:.1f} ({r['bf16_kv_gb_s']:.0f})",
                         f"{r['fp8_us']:.1f} ({r['fp8_kv_gb_s']:.0f})", r["fp8_speedup"]]
                        for r in results["attention"]["rows"]]))
        print()


def main(argv: list[str] | None = None) -> dict:
    args, hw, cmd = start(build_parser(), argv, "quant.py")
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if not parts or parts - set(PARTS + EXTRA_PARTS):
        raise SystemExit(f"error: --parts takes {', '.join(PARTS + EXTRA_PARTS)}; got {args.parts!r}")
    t0 = time.perf_counter()
    results: dict = {"benchmark": "quant", "command": cmd, "hardware": hw, "args": vars(args), "shape": args.shape,
                     "targets": TARGETS, "engines": {}}
    if "kernels" in parts:
        run_kernels(args, results)
    if "attention" in parts:
        run_attention(args, results)
    if parts & {"tpot", "throughput", "kv"}:
        run_engines(args, parts, results)
    out = str(Path(args.out_dir) / ("quant_profile.json" if parts == {"profile"} else "quant.json"))
    if "profile" in parts:
        run_profile(args, results, lambda: write_json(out, results))
    results["elapsed_s"] = time.perf_counter() - t0
    report(results, hw, cmd)
    write_json(out, results)
    return results


if __name__ == "__main__":
    main()
