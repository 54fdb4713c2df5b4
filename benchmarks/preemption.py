"""Preemptions per request under KV-cache pressure (recompute thrash, issue 17 kind 2).

The workload: a KV cache of ``--num-blocks`` blocks (48 by default, of 16 tokens), ``--num-long``
long requests (``--long-tokens`` generated tokens each, ``ignore_eos``) submitted at once,
and a stream of short requests (``--short-tokens`` each) arriving one every
``--arrival-every`` engine steps until ``--num-short`` have arrived. The long requests
alone need more blocks than the cache holds, so the scheduler must preempt; what is
measured is how often each request is preempted (and so recomputed), and how many engine
steps the short requests wait for their first token.

The engine is driven step by step on the caller's thread (``LLM.llm_engine``), so "a step"
is one ``LLMEngine.step()`` call; random weights (``load_format="dummy"``), greedy.

    python benchmarks/preemption.py --device cpu --shape tiny           # the issue's workload
    python benchmarks/preemption.py --device cpu --shape tiny --modes on --num-short 4 --num-long 2 \\
        --long-tokens 40 --num-blocks 12                                 # smoke
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
    async_modes,
    finish,
    header_md,
    md_table,
    prepare_model_dir,
    random_prompts,
    resolve_dtype,
    shutdown_llm,
    start,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, default_shape="tiny")
    p.add_argument("--num-blocks", type=int, default=48, help="KV cache blocks (num_gpu_blocks_override)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-long", type=int, default=6)
    p.add_argument("--long-tokens", type=int, default=200, help="generated tokens per long request")
    p.add_argument("--num-short", type=int, default=40)
    p.add_argument("--short-tokens", type=int, default=30, help="generated tokens per short request")
    p.add_argument("--prompt-len", type=int, default=16, help="prompt tokens of every request")
    p.add_argument("--arrival-every", type=int, default=3, help="engine steps between short arrivals")
    p.add_argument("--policy", choices=("fcfs", "priority"), default="fcfs")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="turn prefix caching off (on: a preempted request's freed blocks may be hit on re-admission)")
    p.add_argument("--modes", default="on,off", help="async scheduling modes: on,off | on | off")
    p.add_argument("--max-steps", type=int, default=20000, help="give up after this many steps")
    p.add_argument("--verbose", action="store_true", help="engine INFO logs")
    return p


def _summary(counts: list[int]) -> dict:
    return {"mean": statistics.mean(counts) if counts else float("nan"), "max": max(counts, default=0),
            "total": sum(counts)}


def run_mode(args, model_dir, async_on: bool) -> dict:
    from pyengine import LLM, RequestOutputKind, SamplingParams

    llm = LLM(str(model_dir), load_format="dummy", dtype=resolve_dtype(args), device=args.device,
              block_size=args.block_size, num_gpu_blocks_override=args.num_blocks,
              max_model_len=(args.num_blocks - 1) * args.block_size, scheduling_policy=args.policy,
              async_scheduling=async_on, enable_prefix_caching=not args.no_prefix_caching)
    engine = llm.llm_engine
    sched = engine.engine_core.scheduler  # the Request objects carry num_preemptions
    vocab = llm.llm_engine.config.hf_config.vocab_size
    prompts = random_prompts(args.num_long + args.num_short, args.prompt_len, args.prompt_len, vocab, seed=0)

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False,
                              output_kind=RequestOutputKind.DELTA)

    reqs: dict[str, object] = {}
    arrived: dict[str, int] = {}
    first_token: dict[str, int] = {}
    finished: dict[str, int] = {}
    tokens: dict[str, int] = {}

    def add(rid: str, prompt, n: int, step: int) -> None:
        engine.add_request(rid, prompt, params(n))
        (core_id,) = engine.output_processor.core_ids(rid)  # the engine-core id (rid + a suffix)
        reqs[rid] = sched.requests[core_id]
        arrived[rid] = step
        tokens[rid] = 0

    try:
        t0 = time.perf_counter()
        for i in range(args.num_long):
            add(f"long-{i}", prompts[i], args.long_tokens, 0)
        step = 0
        next_short = 0
        while engine.has_unfinished_requests() or next_short < args.num_short:
            if next_short < args.num_short and step % args.arrival_every == 0:
                add(f"short-{next_short}", prompts[args.num_long + next_short], args.short_tokens, step)
                next_short += 1
            for out in engine.step():
                n = len(out.outputs[0].token_ids)
                if n and out.request_id not in first_token:
                    first_token[out.request_id] = step
                tokens[out.request_id] += n
                if out.finished:
                    finished[out.request_id] = step
            step += 1
            if step > args.max_steps:
                raise RuntimeError(f"not finished after {args.max_steps} steps")
        elapsed = time.perf_counter() - t0
    finally:
        llm.shutdown()
        shutdown_llm(llm)
    expected = {rid: args.long_tokens if rid.startswith("long") else args.short_tokens for rid in reqs}
    if tokens != expected:
        raise RuntimeError("a request ended short: " + str({k: v for k, v in tokens.items() if v != expected[k]}))
    short = [r for r in reqs if r.startswith("short")]
    long_ = [r for r in reqs if r.startswith("long")]
    wait = [first_token[r] - arrived[r] for r in short]
    e2e = [finished[r] - arrived[r] for r in short]
    return {
        "async_scheduling": "on" if async_on else "off",
        "steps": step, "elapsed_s": elapsed,
        "preemptions_total": sched.num_preemptions,
        "short_preemptions": _summary([reqs[r].num_preemptions for r in short]),
        "long_preemptions": _summary([reqs[r].num_preemptions for r in long_]),
        "short_ttft_steps": {"median": statistics.median(wait) if wait else float("nan"), "max": max(wait, default=0)},
        "short_e2e_steps": {"median": statistics.median(e2e) if e2e else float("nan"), "max": max(e2e, default=0)},
    }


def main(argv: list[str] | None = None) -> dict:
    args, hw, cmd = start(build_parser(), argv, "preemption.py")
    model_dir = prepare_model_dir(args)
    results = {}
    for m in async_modes(args.modes):
        r = run_mode(args, model_dir, m == "on")
        results[m] = r
        print(f"async {m:3s}: {r['preemptions_total']} preemptions, short max {r['short_preemptions']['max']}, "
              f"long max {r['long_preemptions']['max']}, {r['steps']} steps", file=sys.stderr)
    print()
    print(header_md(f"Preemptions per request: {args.num_long} x {args.long_tokens}-token + {args.num_short} x "
                    f"{args.short_tokens}-token requests (one every {args.arrival_every} steps), "
                    f"{args.num_blocks} KV blocks of {args.block_size}, {args.policy}", hw, cmd))
    rows = [[m, r["preemptions_total"], r["short_preemptions"]["mean"], r["short_preemptions"]["max"],
             r["long_preemptions"]["mean"], r["long_preemptions"]["max"], r["short_ttft_steps"]["median"],
             r["short_ttft_steps"]["max"], r["short_e2e_steps"]["median"], r["short_e2e_steps"]["max"], r["steps"],
             r["elapsed_s"]] for m, r in results.items()]
    print(md_table(["async", "preemptions", "short: mean / req", "short: max", "long: mean / req", "long: max",
                    "short TTFT p50 (steps)", "short TTFT max", "short e2e p50 (steps)", "short e2e max",
                    "steps to finish", "time (s)"], rows))
    print()
    return finish("preemption", args, hw, cmd, shape=args.shape, results=results)


if __name__ == "__main__":
    main()
