"""Async (overlap) scheduling on vs off through ``AsyncLLM``: output throughput, TPOT and
TTFT at several concurrencies, with host time per engine step.

For each mode (a fresh ``AsyncLLM`` with ``async_scheduling`` on, then off) and each
concurrency ``c``: ``c`` client threads each take the next request from a shared list
(``max(--min-requests, --requests-per-client * c)`` in all), submit it with
``add_request`` (DELTA outputs, ``ignore_eos``, greedy, no detokenization) and read its
collector until it finishes. Per request: TTFT (submit to first token, reader side) and
TPOT ((last token - first token) / (n - 1), reader side). Host ms/step is the scheduler's
``step_host_time_s`` / ``num_steps`` over the level; wall ms/step is the level's wall time
over its steps.

    python benchmarks/async_sched.py                                # Qwen3-0.6B shape on the GPU
    python benchmarks/async_sched.py --device cpu --shape tiny      # tiny model on the CPU
    python benchmarks/async_sched.py --device cpu --shape tiny --concurrency 1,2 --min-requests 2 \\
        --requests-per-client 1 --output-len 4                      # smoke
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import threading
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

from benchmarks.common import (  # noqa: E402
    add_common_args,
    async_modes,
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
    add_common_args(p)
    p.add_argument("--concurrency", type=parse_ints, default=[1, 8, 32, 128])
    p.add_argument("--input-len", type=int, default=None, help="default 128 on cuda, 32 on cpu")
    p.add_argument("--output-len", type=int, default=None, help="default 128 on cuda, 32 on cpu")
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument("--min-requests", type=int, default=16)
    p.add_argument("--modes", default="on,off", help="async scheduling modes: on,off | on | off")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per concurrency level")
    p.add_argument("--verbose", action="store_true", help="engine INFO logs")
    return p


def run_level(llm, prompts: list[list[int]], concurrency: int, output_len: int, tag: str, timeout: float) -> dict:
    from pyengine import RequestOutputKind, SamplingParams

    sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=output_len, detokenize=False,
                        output_kind=RequestOutputKind.DELTA)
    nxt = itertools.count()
    lock = threading.Lock()
    records: list[tuple[float, float, int, float]] = []  # (ttft, tpot, tokens, e2e)
    errors: list[BaseException] = []

    def client():
        while True:
            with lock:
                i = next(nxt)
            if i >= len(prompts) or errors:
                return
            try:
                t_sub = time.perf_counter()
                col = llm.add_request(f"{tag}-{i}", prompts[i], sp)
                t_first = t_last = None
                n = 0
                for out in col:
                    k = len(out.outputs[0].token_ids) if out.outputs else 0
                    if k:
                        now = time.perf_counter()
                        if t_first is None:
                            t_first = now
                            n_first = k
                        t_last = now
                        n += k
                if t_first is None:
                    raise RuntimeError(f"request {i} produced no tokens")
                # tokens delivered with the first output do not count toward TPOT
                tpot = (t_last - t_first) / (n - n_first) if n > n_first else float("nan")
                with lock:
                    records.append((t_first - t_sub, tpot, n, t_last - t_sub))
            except BaseException as e:  # reported after the level
                with lock:
                    errors.append(e)
                return

    before = llm.get_stats()
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    deadline = t0 + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.perf_counter()))
    elapsed = time.perf_counter() - t0
    if any(t.is_alive() for t in threads):
        raise RuntimeError(f"concurrency {concurrency}: not done after {timeout:.0f}s")
    if errors:
        raise RuntimeError(f"concurrency {concurrency}: {type(errors[0]).__name__}: {errors[0]}") from errors[0]
    sd = stats_delta(before, llm.get_stats())
    toks = sum(r[2] for r in records)
    tpots = [r[1] for r in records if r[1] == r[1]]
    ttfts = [r[0] for r in records]
    return {
        "concurrency": concurrency, "requests": len(records), "output_tokens": toks, "elapsed_s": elapsed,
        "output_tok_s": toks / elapsed,
        "tpot_ms_median": 1e3 * statistics.median(tpots) if tpots else float("nan"),
        "tpot_ms_mean": 1e3 * statistics.mean(tpots) if tpots else float("nan"),
        "ttft_ms_median": 1e3 * statistics.median(ttfts) if ttfts else float("nan"),
        "ttft_ms_max": 1e3 * max(ttfts) if ttfts else float("nan"),
        "e2e_ms_median": 1e3 * statistics.median(r[3] for r in records) if records else float("nan"),
        "e2e_ms_max": 1e3 * max(r[3] for r in records) if records else float("nan"),
        # share of the level's wall time that the clients spent inside requests (1.0: always busy)
        "client_busy_fraction": sum(r[3] for r in records) / (concurrency * elapsed) if elapsed > 0 else float("nan"),
        "num_steps": sd["num_steps"], "host_ms_per_step": sd["host_ms_per_step"],
        "wall_ms_per_step": 1e3 * elapsed / sd["num_steps"] if sd["num_steps"] else float("nan"),
    }


def run_mode(args, model_dir, async_on: bool) -> dict:
    from pyengine import AsyncLLM, EngineArgs

    t0 = time.perf_counter()
    llm = AsyncLLM.from_engine_args(EngineArgs(
        model=str(model_dir), load_format="dummy", dtype=resolve_dtype(args), device=args.device,
        max_model_len=args.max_model_len, max_num_seqs=max(args.concurrency), async_scheduling=async_on,
        enforce_eager=args.enforce_eager, gpu_memory_utilization=args.gpu_memory_utilization))
    startup = time.perf_counter() - t0
    mode = "on" if llm.config.async_scheduling else "off"
    try:
        vocab = llm.config.hf_config.vocab_size
        # Warm-up: a few requests at the largest concurrency's batch shapes are not needed;
        # a short concurrent burst covers first-use costs.
        warm = random_prompts(min(8, max(args.concurrency)), args.input_len, args.input_len, vocab, seed=999)
        run_level(llm, warm, len(warm), min(args.output_len, 16), f"warm-{mode}", args.timeout)
        levels = []
        for j, c in enumerate(args.concurrency):
            n = max(args.min_requests, args.requests_per_client * c)
            # Same prompts for both modes; distinct across levels (no prefix-cache reuse in a mode).
            prompts = random_prompts(n, args.input_len, args.input_len, vocab, seed=1000 + j)
            r = run_level(llm, prompts, c, args.output_len, f"{mode}-c{c}", args.timeout)
            r["async_scheduling"] = mode
            levels.append(r)
            print(f"async {mode:3s} c={c:4d}: {r['output_tok_s']:10.1f} tok/s  TPOT {r['tpot_ms_median']:.3f} ms  "
                  f"host {r['host_ms_per_step']:.3f} ms/step", file=sys.stderr)
        return {"async_scheduling": mode, "startup_s": startup, "enforce_eager": llm.config.enforce_eager,
                "levels": levels}
    finally:
        llm.shutdown()
        shutdown_llm(llm)
        del llm
        free_cuda()


def main(argv: list[str] | None = None) -> dict:
    args, hw, cmd = start(build_parser(), argv, "async_sched.py")
    if args.input_len is None:
        args.input_len = 128 if args.device == "cuda" else 32
    if args.output_len is None:
        args.output_len = 128 if args.device == "cuda" else 32
    modes = async_modes(args.modes)
    model_dir = prepare_model_dir(args)
    results = {m: run_mode(args, model_dir, m == "on") for m in modes}

    rows = []
    for m, res in results.items():
        for r in res["levels"]:
            rows.append([m, r["concurrency"], r["requests"], r["output_tok_s"], r["tpot_ms_median"],
                         r["ttft_ms_median"], r["ttft_ms_max"], r["e2e_ms_max"], r["host_ms_per_step"],
                         r["wall_ms_per_step"]])
    ratios = {}
    if "on" in results and "off" in results:
        for a, b in zip(results["on"]["levels"], results["off"]["levels"]):
            ratios[a["concurrency"]] = {
                "output_tok_s_on_off": a["output_tok_s"] / max(b["output_tok_s"], 1e-9),
                "tpot_on_off": a["tpot_ms_median"] / b["tpot_ms_median"] if b["tpot_ms_median"] else float("nan")}
    print()
    print(header_md(f"Async scheduling on vs off (AsyncLLM, threads): {args.shape}, prompt {args.input_len}, "
                    f"output {args.output_len} tokens, greedy", hw, cmd))
    g = next(iter(results.values()))
    print(f"device {args.device}, dtype {resolve_dtype(args)}, CUDA graphs {'off' if g['enforce_eager'] else 'on'}\n")
    print(md_table(["async", "concurrency", "requests", "output tok/s", "TPOT p50 (ms)", "TTFT p50 (ms)",
                    "TTFT max (ms)", "e2e max (ms)", "host ms/step", "wall ms/step"], rows))
    if ratios:
        print()
        print(md_table(["concurrency", "tok/s on/off", "TPOT on/off"],
                       [[c, v["output_tok_s_on_off"], v["tpot_on_off"]] for c, v in ratios.items()]))
    print()
    return finish("async_sched", args, hw, cmd, shape=args.shape, results=results, ratios=ratios)


if __name__ == "__main__":
    main()
