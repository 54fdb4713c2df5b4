"""Decode latency: time per output token at batch 1 and batch 32.

For each shape and batch size: ``batch`` requests with a short random prompt (32 tokens,
fresh ids each iteration so no prefix-cache hits), ``N`` = 128 output tokens,
``ignore_eos``, greedy. Two measures, median over ``--iters`` runs:

* TPOT: per request (last_token_time - first_token_time) / (N - 1) from the
  RequestOutput metrics, averaged over the batch (the headline figure);
* (total - prefill) / (N - 1): wall time of the N-token generate minus that of a
  1-token generate of the same shape, per further token.

    python benchmarks/latency.py                                   # both GPU shapes
    python benchmarks/latency.py --shape qwen3-0.6b --batch-sizes 1,32,64
    python benchmarks/latency.py --device cpu --shape tiny --output-len 8 --iters 1   # smoke
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

from benchmarks.common import (  # noqa: E402
    add_common_args,
    finish,
    free_cuda,
    header_md,
    md_table,
    parse_ints,
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
    add_common_args(p, default_shape="qwen3-0.6b,llama-3.1-8b", multi_shape=True)
    p.add_argument("--batch-sizes", type=parse_ints, default=[1, 32])
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="ranks (one GPU each)")
    p.add_argument("--no-async-scheduling", action="store_true")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--verbose", action="store_true", help="engine INFO logs")
    return p


def _sync(device: str) -> None:
    if device == "cuda":
        import torch
        torch.cuda.synchronize()


def bench_shape(args, shape: str, seed_base: int = 0) -> list[dict]:
    from pyengine import LLM, SamplingParams

    model_dir = prepare_model_dir(args, shape)
    t0 = time.perf_counter()
    llm = LLM(str(model_dir), load_format="dummy", dtype=resolve_dtype(args), device=args.device,
              max_model_len=args.max_model_len, max_num_seqs=max(max(args.batch_sizes), 1),
              enforce_eager=args.enforce_eager, gpu_memory_utilization=args.gpu_memory_utilization,
              async_scheduling=False if args.no_async_scheduling else None,
              tensor_parallel_size=args.tensor_parallel_size)
    _sync(args.device)
    startup = time.perf_counter() - t0
    cfg = llm.llm_engine.config
    vocab = cfg.hf_config.vocab_size
    n = args.output_len
    seed = [seed_base + 1]

    def prompts(batch):
        seed[0] += 1
        return random_prompts(batch, args.input_len, args.input_len, vocab, seed=seed[0] * 7919)

    def timed(batch, max_tokens):
        ps = prompts(batch)
        sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens, detokenize=False)
        _sync(args.device)
        t = time.perf_counter()
        outs = llm.generate(ps, sp, use_tqdm=False)
        _sync(args.device)
        return time.perf_counter() - t, outs

    rows = []
    for batch in args.batch_sizes:
        timed(batch, min(n, 16))  # warm-up (first use of these batch sizes)
        tpots, e2e_tpots, prefills, totals = [], [], [], []
        before = llm.llm_engine.get_stats()
        for _ in range(args.iters):
            prefill_s, _ = timed(batch, 1)
            total_s, outs = timed(batch, n)
            assert all(len(o.outputs[0].token_ids) == n for o in outs), "short output"
            per_req = []
            for o in outs:
                m = o.metrics
                if m is not None and m.first_token_time is not None and m.last_token_time is not None and n > 1:
                    per_req.append((m.last_token_time - m.first_token_time) / (n - 1))
            if per_req:
                tpots.append(statistics.mean(per_req))
            e2e_tpots.append((total_s - prefill_s) / max(n - 1, 1))
            prefills.append(prefill_s)
            totals.append(total_s)
        sd = stats_delta(before, llm.llm_engine.get_stats())
        rows.append({
            "shape": shape, "batch": batch, "input_len": args.input_len, "output_len": n,
            "tpot_ms": 1e3 * statistics.median(tpots) if tpots else float("nan"),
            "e2e_minus_prefill_ms_per_token": 1e3 * statistics.median(e2e_tpots),
            "prefill_s": statistics.median(prefills), "total_s": statistics.median(totals),
            "output_tok_s": batch * n / statistics.median(totals),
            "host_ms_per_step": sd["host_ms_per_step"], "startup_s": startup,
            "async_scheduling": cfg.async_scheduling, "enforce_eager": cfg.enforce_eager,
            "tensor_parallel_size": cfg.tensor_parallel_size, "dtype": str(cfg.dtype).replace("torch.", ""), "attention_backend": cfg.attention_backend,
            "tpot_ms_all_iters": [1e3 * t for t in tpots],
        })
    shutdown_llm(llm)
    del llm
    free_cuda()
    return rows


def main(argv: list[str] | None = None) -> dict:
    args, hw, cmd = start(build_parser(), argv, "latency.py")
    rows = []
    for i, shape in enumerate(args.shape):
        rows += bench_shape(args, shape, seed_base=100 * i)
    print()
    print(header_md(f"Decode latency: prompt {args.input_len} tokens, {args.output_len} output tokens, greedy, "
                    f"median of {args.iters}", hw, cmd))
    if rows:
        r0 = rows[0]
        print(f"tensor parallel {r0['tensor_parallel_size']}, async scheduling {'on' if r0['async_scheduling'] else 'off'}, CUDA graphs "
              f"{'off' if r0['enforce_eager'] else 'on'}, dtype {r0['dtype']}, attention {r0['attention_backend']}\n")
    print(md_table(["shape", "batch", "TPOT (ms)", "(total-prefill)/(N-1) (ms)", "prefill (s)", "total (s)",
                    "output tok/s", "host ms/step", "start-up (s)"],
                   [[r["shape"], r["batch"], r["tpot_ms"], r["e2e_minus_prefill_ms_per_token"], r["prefill_s"],
                     r["total_s"], r["output_tok_s"], r["host_ms_per_step"], r["startup_s"]] for r in rows]))
    print()
    return finish("latency", args, hw, cmd, results=rows)


if __name__ == "__main__":
    main()
