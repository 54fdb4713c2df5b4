"""Offline throughput on nano-vllm's workload, optionally against transformers' own
continuous batching in the same process run.

Workload (nano-vllm's bench.py): 256 requests, prompt lengths and ``max_tokens`` uniform in
[100, 1024], random prompt token ids below 10000, seed 0, temperature 0.6, ``ignore_eos``,
``max_model_len`` 4096, bf16, random weights of the named shape (``load_format="dummy"``).

Reports output tokens/s (and total tokens/s, prompt + output), start-up time (LLM
construction: weight init + profiling + CUDA-graph capture) and host time per engine step
(the scheduler's ``step_host_time_s`` / ``num_steps``) next to wall time per step.

    python benchmarks/throughput.py                                  # Qwen3-0.6B shape
    python benchmarks/throughput.py --shape llama-3.1-8b
    python benchmarks/throughput.py --peer transformers --json out.json
    python benchmarks/throughput.py --no-async-scheduling --enforce-eager
    python benchmarks/throughput.py --device cpu --shape tiny --num-requests 4 --max-len 64   # smoke

``--peer transformers`` frees our engine, builds the same shape with random bf16 weights on
the GPU through transformers (paged SDPA attention, its CUDA graphs on), runs the same
prompts with the same per-request ``max_new_tokens`` (sampling at temperature 0.6, EOS
disabled) through ``generate``-style continuous batching (``ContinuousBatchingManager``, the
machinery under ``model.generate_batch``; used directly because ``generate_batch`` takes a
single ``max_new_tokens``), and prints ours/peer.
"""
from __future__ import annotations

import argparse
import inspect
import os
import sys
import time
from dataclasses import fields

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

from benchmarks.common import (  # noqa: E402
    add_common_args,
    finish,
    free_cuda,
    header_md,
    md_table,
    prepare_model_dir,
    random_prompts,
    resolve_dtype,
    shutdown_llm,
    start,
    stats_delta,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--min-len", type=int, default=100, help="min prompt length and min max_tokens")
    p.add_argument("--max-len", type=int, default=1024, help="max prompt length and max max_tokens")
    p.add_argument("--max-input-id", type=int, default=10000, help="prompt ids are drawn below this")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="default 0.9, or 0.5 with --peer (the peer needs the memory after ours is freed)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="ranks (one GPU each)")
    p.add_argument("--no-async-scheduling", action="store_true")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--no-warmup", action="store_true", help="skip the short warm-up generate")
    p.add_argument("--peer", choices=("transformers",), default=None,
                   help="also run transformers' continuous batching on the same workload")
    p.add_argument("--peer-cuda-graph", choices=("on", "off", "auto"), default="on",
                   help="transformers' use_cuda_graph (on: forced on; auto: its own heuristic)")
    p.add_argument("--peer-attn", default=None,
                   help="transformers attn_implementation (default: paged|sdpa where registered, else sdpa)")
    p.add_argument("--peer-memory-fraction", type=float, default=0.7,
                   help="transformers' max_memory_percent for its paged cache (fraction of free GPU memory)")
    p.add_argument("--peer-timeout", type=float, default=300.0,
                   help="seconds; a peer run past this is stopped and reported as partial")
    p.add_argument("--progress", action="store_true", help="show progress bars")
    p.add_argument("--verbose", action="store_true", help="engine INFO logs")
    return p


def make_workload(args, vocab_size: int):
    prompts = random_prompts(args.num_requests, args.min_len, args.max_len, vocab_size, seed=args.seed,
                             max_id=args.max_input_id)
    import random
    rng = random.Random(args.seed + 1)
    max_tokens = [rng.randint(args.min_len, args.max_len) for _ in prompts]
    return prompts, max_tokens


def _sync(device: str) -> None:
    if device == "cuda":
        import torch
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------
# Ours


def run_ours(args, model_dir, prompts, max_tokens) -> dict:
    from pyengine import LLM, SamplingParams

    dtype = resolve_dtype(args)
    gmu = args.gpu_memory_utilization or (0.5 if args.peer else 0.9)
    kw = dict(load_format="dummy", dtype=dtype, device=args.device, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, enforce_eager=args.enforce_eager, seed=args.seed,
              async_scheduling=False if args.no_async_scheduling else None, gpu_memory_utilization=gmu,
              tensor_parallel_size=args.tensor_parallel_size)
    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    t0 = time.perf_counter()
    llm = LLM(str(model_dir), **kw)
    _sync(args.device)
    startup = time.perf_counter() - t0
    cfg = llm.llm_engine.config
    vocab = cfg.hf_config.vocab_size

    if not args.no_warmup:  # different ids than the workload, so no prefix-cache hits
        warm = random_prompts(2, 32, 64, vocab, seed=args.seed + 1000, max_id=args.max_input_id)
        llm.generate(warm, SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=16,
                                          detokenize=False), use_tqdm=False)
    params = [SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=m, detokenize=False)
              for m in max_tokens]
    before = llm.llm_engine.get_stats()
    _sync(args.device)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=args.progress)
    _sync(args.device)
    elapsed = time.perf_counter() - t0
    after = llm.llm_engine.get_stats()
    out_toks = sum(len(o.outputs[0].token_ids) for o in outs)
    short = sum(1 for o, m in zip(outs, max_tokens) if len(o.outputs[0].token_ids) != m)
    in_toks = sum(len(p) for p in prompts)
    sd = stats_delta(before, after)
    res = {
        "engine": "vengine", "elapsed_s": elapsed, "startup_s": startup,
        "output_tokens": out_toks, "prompt_tokens": in_toks,
        "output_tok_s": out_toks / elapsed, "total_tok_s": (out_toks + in_toks) / elapsed,
        "num_steps": sd["num_steps"], "host_ms_per_step": sd["host_ms_per_step"],
        "wall_ms_per_step": 1e3 * elapsed / sd["num_steps"] if sd["num_steps"] else float("nan"),
        "num_preemptions": after.num_preemptions - before.num_preemptions,
        "num_gpu_blocks": after.num_gpu_blocks, "requests_short": short,
        "async_scheduling": cfg.async_scheduling, "enforce_eager": cfg.enforce_eager,
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "dtype": str(cfg.dtype).replace("torch.", ""), "gpu_memory_utilization": gmu,
        "max_num_seqs": cfg.max_num_seqs, "max_num_batched_tokens": cfg.max_num_batched_tokens,
        "attention_backend": cfg.attention_backend,
    }
    if short:
        print(f"warning: {short} requests did not get exactly max_tokens tokens", file=sys.stderr)
    del outs
    shutdown_llm(llm)
    del llm
    free_cuda()
    return res


# ----------------------------------------------------------------------------------------
# transformers' continuous batching


def peer_attn_implementation() -> str:
    """``paged|sdpa`` where transformers registers it (5.x before 5.23); later versions take
    plain ``sdpa`` for continuous batching (the ``paged|`` prefix was dropped)."""
    try:
        from transformers.modeling_utils import AttentionInterface
        if "paged|sdpa" in AttentionInterface._global_mapping:
            return "paged|sdpa"
    except Exception:
        pass
    return "sdpa"


def cuda_memory_snapshot() -> dict | None:
    """GiB allocated / reserved by this process's torch and free on the device (None on CPU):
    shows that our engine gave its memory back before the peer starts."""
    import torch
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    g = 2 ** 30
    return {"allocated_gib": torch.cuda.memory_allocated() / g, "reserved_gib": torch.cuda.memory_reserved() / g,
            "free_gib": free / g, "total_gib": total / g}


def _cb_config(args, use_cuda: bool, prompts, max_tokens):
    from transformers import ContinuousBatchingConfig

    names = {f.name for f in fields(ContinuousBatchingConfig)}
    kw = {}
    if not use_cuda and {"num_blocks", "max_batch_tokens", "block_size"} <= names:
        # transformers sizes its cache from GPU memory; on the CPU (smoke runs) size it by hand
        bs = ContinuousBatchingConfig().block_size
        kw["num_blocks"] = sum(-(-(len(p) + m) // bs) for p, m in zip(prompts, max_tokens)) + 8
        kw["max_batch_tokens"] = 1024
    if args.peer_cuda_graph != "auto" and "use_cuda_graph" in names:
        kw["use_cuda_graph"] = (args.peer_cuda_graph == "on") and use_cuda
    if "auto_switch_to_flash" in names:
        kw["auto_switch_to_flash"] = False  # keep the SDPA path we name (no flash-attn download)
    if "seed" in names:
        kw["seed"] = args.seed
    if "max_requests_per_batch" in names:
        kw["max_requests_per_batch"] = args.max_num_seqs
    if use_cuda and args.peer_memory_fraction is not None and "max_memory_percent" in names:
        # transformers sizes its paged cache from free memory; at its default (0.8 with a
        # temperature processor) its own warm-up ran out of memory on the H200
        kw["max_memory_percent"] = args.peer_memory_fraction
    return ContinuousBatchingConfig(**kw)


def run_transformers_peer(args, model_dir, prompts, max_tokens) -> dict:
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    for name in ("ContinuousBatchingConfig",):
        if not hasattr(transformers, name):
            raise RuntimeError(f"transformers {transformers.__version__} has no {name}: the peer needs "
                               f"transformers >= 5 with continuous batching.")
    if not hasattr(AutoModelForCausalLM, "from_config"):
        raise RuntimeError("transformers has no AutoModelForCausalLM.from_config")
    use_cuda = args.device == "cuda"
    dtype = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
             "float32": torch.float32}.get(resolve_dtype(args), torch.bfloat16)
    attn = args.peer_attn or peer_attn_implementation()
    cfg = AutoConfig.from_pretrained(str(model_dir))
    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=dtype)
    model.eval()
    if not hasattr(model, "continuous_batching_context_manager"):
        raise RuntimeError(f"transformers {transformers.__version__}: the model has no continuous batching API")
    _sync(args.device)
    build_s = time.perf_counter() - t0

    gen_kw = dict(do_sample=True, temperature=args.temperature, top_k=0, top_p=1.0,
                  max_new_tokens=max(max_tokens), eos_token_id=-1, pad_token_id=cfg.pad_token_id)
    gcfg = GenerationConfig(**gen_kw)
    model.generation_config = gcfg
    cb_cfg = _cb_config(args, use_cuda, prompts, max_tokens)
    cm_kw = dict(generation_config=gcfg, continuous_batching_config=cb_cfg, block=True, timeout=30)
    sig = inspect.signature(model.continuous_batching_context_manager).parameters
    if "workload_hints" in sig:
        try:
            from transformers.generation.continuous_batching.utils import WorkloadHints
            cm_kw["workload_hints"] = WorkloadHints(max_prompt_length=max(len(p) for p in prompts),
                                                    max_generated_length=max(max_tokens),
                                                    num_requests=len(prompts))
        except Exception:
            pass
    cm_kw = {k: v for k, v in cm_kw.items() if k in sig}

    t0 = time.perf_counter()
    cm = model.continuous_batching_context_manager(**cm_kw)
    manager = cm.__enter__()  # builds the paged cache, warms up / captures graphs, starts the loop
    setup_s = time.perf_counter() - t0
    partial = False
    errors = 0
    results = {}
    try:
        def wait_for(ids, deadline):
            done = {}
            while len(done) < len(ids):
                if time.perf_counter() > deadline:
                    return done, True
                r = manager.get_result(timeout=1)
                if r is None:
                    if not manager.is_running():
                        raise RuntimeError("transformers' continuous batching thread stopped unexpectedly")
                    continue
                if r.is_finished():
                    done[r.request_id] = r
            return done, False

        if not args.no_warmup:
            warm = random_prompts(2, 32, 64, cfg.vocab_size, seed=args.seed + 1000, max_id=args.max_input_id)
            wids = [manager.add_request(p, request_id=f"warm{i}", max_new_tokens=16) for i, p in enumerate(warm)]
            wait_for(wids, time.perf_counter() + 300)
        _sync(args.device)
        t0 = time.perf_counter()
        ids = [manager.add_request(p, request_id=f"r{i}", max_new_tokens=m)
               for i, (p, m) in enumerate(zip(prompts, max_tokens))]
        results, partial = wait_for(ids, t0 + args.peer_timeout)
        _sync(args.device)
        elapsed = time.perf_counter() - t0
    finally:
        try:
            cm.__exit__(None, None, None)
        except Exception as e:  # a stop timeout must not lose the numbers
            print(f"warning: stopping transformers' manager: {e}", file=sys.stderr)
    for r in results.values():
        if getattr(r, "error", None):
            errors += 1
    out_toks = sum(len(r.generated_tokens) for r in results.values() if not getattr(r, "error", None))
    in_toks = sum(len(p) for p in prompts)
    graphs = getattr(cb_cfg, "use_cuda_graph", None)
    res = {
        "engine": f"transformers {transformers.__version__} continuous batching",
        "attn_implementation": attn, "use_cuda_graph": list(graphs) if isinstance(graphs, tuple) else graphs,
        "elapsed_s": elapsed, "startup_s": build_s + setup_s, "model_build_s": build_s, "cb_setup_s": setup_s,
        "output_tokens": out_toks, "prompt_tokens": in_toks,
        "output_tok_s": out_toks / elapsed, "total_tok_s": (out_toks + in_toks) / elapsed,
        "requests_finished": len(results) - errors, "requests_failed": errors, "partial": partial,
    }
    if partial:
        print(f"warning: transformers peer stopped after {args.peer_timeout:.0f}s with {len(results)}/"
              f"{len(prompts)} requests finished; its throughput counts finished requests only "
              f"(an underestimate)", file=sys.stderr)
    del model, manager, cm
    free_cuda()
    return res


# ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    args, hw, cmd = start(build_parser(), argv, "throughput.py")
    model_dir = prepare_model_dir(args)
    from transformers import AutoConfig
    vocab = AutoConfig.from_pretrained(str(model_dir)).vocab_size
    prompts, max_tokens = make_workload(args, vocab)

    results = {"ours": run_ours(args, model_dir, prompts, max_tokens)}
    o = results["ours"]
    print(f"vengine: {o['output_tokens']} output tokens in {o['elapsed_s']:.2f} s = {o['output_tok_s']:,.0f} tok/s "
          f"(start-up {o['startup_s']:.1f} s)", flush=True)
    if args.peer == "transformers":
        try:
            results["gpu_memory_before_peer"] = cuda_memory_snapshot()
            results["peer"] = run_transformers_peer(args, model_dir, prompts, max_tokens)
            results["ratio_output_tok_s"] = o["output_tok_s"] / max(results["peer"]["output_tok_s"], 1e-9)
        except Exception as e:  # keep our numbers; say why the peer failed
            import traceback
            traceback.print_exc()
            results["peer_error"] = f"{type(e).__name__}: {e}"
            print(f"error: the transformers peer failed: {results['peer_error']}", file=sys.stderr)
            free_cuda()

    rows = []
    for key in ("ours", "peer"):
        r = results.get(key)
        if r is None:
            continue
        rows.append([r["engine"] + (" (partial)" if r.get("partial") else ""), r["output_tokens"], r["elapsed_s"],
                     r["output_tok_s"], r["total_tok_s"], r["startup_s"], r.get("host_ms_per_step"),
                     r.get("wall_ms_per_step")])
    ours = results["ours"]
    print()
    print(header_md(f"Throughput: {args.shape}, {args.num_requests} requests, prompt/output lengths "
                    f"U[{args.min_len}, {args.max_len}]", hw, cmd))
    print(f"async scheduling {'on' if ours['async_scheduling'] else 'off'}, "
          f"CUDA graphs {'off' if ours['enforce_eager'] else 'on'}, dtype {ours['dtype']}, "
          f"attention {ours['attention_backend']}, max_num_seqs {ours['max_num_seqs']}, "
          f"KV blocks {ours['num_gpu_blocks']}, preemptions {ours['num_preemptions']}\n")
    print(md_table(["engine", "output tokens", "time (s)", "output tok/s", "total tok/s", "start-up (s)",
                    "host ms/step", "wall ms/step"], rows))
    if "ratio_output_tok_s" in results:
        print(f"\nours / transformers (output tok/s): {results['ratio_output_tok_s']:.2f}x")
    if results.get("gpu_memory_before_peer"):
        m = results["gpu_memory_before_peer"]
        print(f"\nGPU memory when the peer started: {m['allocated_gib']:.2f} GiB allocated, "
              f"{m['reserved_gib']:.2f} GiB reserved by torch, {m['free_gib']:.1f} of {m['total_gib']:.1f} GiB free")
    if "peer_error" in results:
        print(f"\ntransformers peer failed: {results['peer_error']}")
    print()
    return finish("throughput", args, hw, cmd, shape=args.shape, results=results)


if __name__ == "__main__":
    main()
