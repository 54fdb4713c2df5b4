"""Structured outputs: throughput with a JSON schema vs unconstrained, one engine, one run.

The serve workload (``benchmarks/serve.py``'s ``make_workload``: ``--num-prompts``
prompts of ``--input-len`` random token ids, greedy, ``--output-len`` tokens) streamed
through ``AsyncLLM`` at ``--concurrency`` (asyncio, ``serve.run_in_process``), twice per
round on the same engine:

* ``unconstrained``: ``ignore_eos``, so every request generates ``--output-len`` tokens;
* ``json_schema``: ``SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA,
  disable_any_whitespace=True))`` (compact JSON: with random weights and whitespace
  allowed, most tokens would be blanks). ``ignore_eos`` cannot apply to a grammar (the
  request ends once the JSON is complete), so the schema forces long outputs: an array of
  at least ``--min-items`` objects, far more than ``--output-len`` tokens, so that every
  request runs to its token limit like the unconstrained ones.

Each run uses its own prompts (no prefix-cache hits from the other run). Reported per
mode: generated tokens/s, TTFT / TPOT percentiles, host ms per engine step, and for the
schema the bitmask fill time measured inside the engine (``SchedulerStats``'s
``grammar_bitmask_time_s`` / ``_steps`` / ``_rows``: ms per step, µs per constrained
row). Every constrained output's token ids are checked to be a prefix the grammar accepts,
so a constraint that was not applied cannot pass for a fast one.

    python benchmarks/structured.py --json structured.json   # H200, Qwen3-0.6B shape, c=64
    python benchmarks/structured.py --smoke                  # CPU, tiny model, a few requests

Prints the results as JSON (and a markdown table on stderr).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, _REPO)

from benchmarks.common import (  # noqa: E402
    add_common_args,
    finish,
    header_md,
    md_table,
    prepare_model_dir,
    resolve_dtype,
    shutdown_llm,
    start,
    stats_delta,
)
from benchmarks.serve import _Profiler, find_py_spy, make_workload, run_in_process, summarize  # noqa: E402

MODES = ("unconstrained", "json_schema")


def make_schema(min_items: int, max_items: int) -> dict:
    """A list of records: nested objects, an integer and a number with bounds, a bounded
    string, an enum array and a boolean, all required. (Every repeat is bounded: a model
    with random weights would otherwise write one number or string for ever.)"""
    item = {"type": "object",
            "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99999},
                           "name": {"type": "string", "maxLength": 24},
                           "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
                           "score": {"type": "number", "minimum": 0, "maximum": 100},
                           "ok": {"type": "boolean"}},
            "required": ["id", "name", "tags", "score", "ok"]}
    return {"type": "array", "items": item, "minItems": min_items, "maxItems": max_items}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--smoke", action="store_true",
                   help="CPU smoke run: --device cpu --shape tiny, 8 requests at c=4, 16-id prompts, 32 tokens")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--rounds", type=int, default=1, help="unconstrained + schema runs, alternating; medians reported")
    p.add_argument("--min-items", type=int, default=48, help="the schema's minItems (long outputs)")
    p.add_argument("--max-items", type=int, default=64)
    p.add_argument("--any-whitespace", action="store_true",
                   help="allow whitespace between JSON tokens (vLLM's default); off by default because a "
                        "model with random weights then writes mostly whitespace, which a trained one does not")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--no-async-scheduling", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verbose", action="store_true", help="engine INFO logs")
    p.add_argument("--profile-seconds", type=float, default=0.0,
                   help="py-spy each mode's run for this long (two passes: GIL holders, on-CPU threads), "
                        "front end and engine process, 0.5 s into the run")
    return p


def _smoke(args) -> None:
    args.device, args.shape = "cpu", "tiny"
    args.concurrency, args.num_prompts, args.input_len, args.output_len = 4, 8, 16, 32
    args.max_num_seqs, args.max_model_len = 8, 256


def _grammar_checker(engine, so):
    """token ids -> whether the grammar of ``so`` accepts them as (a prefix of) an output."""
    from pyengine.structured_output.backend_xgrammar import XgrammarBackend, validate_structured_outputs
    from pyengine.tokenizer import eos_token_ids, load_tokenizer

    tok = load_tokenizer(engine.config)
    backend = XgrammarBackend(tok, engine.config.hf_config.vocab_size, eos_token_ids(engine.config, tok))
    compiled = backend.compile(validate_structured_outputs(so))

    def check(ids: list[int]) -> bool:
        g = backend.new_grammar(compiled)
        return all(g.accept_token(t) for t in ids)
    return check


def run_mode(engine, args, mode: str, so, prompt_seed: int, check) -> dict:
    vocab = engine.config.hf_config.vocab_size
    reqs = make_workload(args.num_prompts, args.input_len, args.output_len, vocab, prompt_seed)
    sampling = {"structured_outputs": so} if mode == "json_schema" else None
    ids: list = []
    prof = (_Profiler(os.getpid(), find_py_spy(), args.profile_seconds, delay=0.5)
            if args.profile_seconds > 0 else None)
    before = engine.get_stats()
    res, dur = run_in_process(engine, reqs, args.concurrency, math.inf, args.seed,
                              ignore_eos=mode == "unconstrained", sampling=sampling, token_ids=ids)
    after = engine.get_stats()
    failed = [r.error for r in res if not r.ok]
    if failed:
        raise RuntimeError(f"{mode}: {len(failed)} requests failed, e.g. {failed[0]}")
    out = summarize(res, dur)
    out.update(stats_delta(before, after))
    if prof is not None:  # per thread of both processes: GIL and on-CPU shares, hottest frames
        out["profile"] = prof.join()
    out["full_length_requests"] = sum(r.output_tokens == args.output_len for r in res)
    if mode == "json_schema":
        out["grammar_accepts_output"] = sum(check(t) for t in ids)
    return out


def _median(runs: list[dict], key: str) -> float:
    vals = [r[key] for r in runs if r.get(key) == r.get(key)]
    return statistics.median(vals) if vals else float("nan")


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    if argv is None:
        argv = sys.argv[1:]
    if "--smoke" in argv:  # before start(): the device check needs the smoke device
        argv = ["--device", "cpu", "--shape", "tiny"] + list(argv)
    args, hw, cmd = start(parser, argv, "structured.py")
    if args.smoke:
        _smoke(args)
    from pyengine import AsyncLLM, EngineArgs, StructuredOutputsParams
    from pyengine.structured_output.backend_xgrammar import default_fill_threads

    model_dir = prepare_model_dir(args)
    kw = dict(model=str(model_dir), load_format="dummy", dtype=resolve_dtype(args), device=args.device,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, seed=args.seed)
    if args.device == "cuda":
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.no_async_scheduling:
        kw["async_scheduling"] = False
    engine = AsyncLLM.from_engine_args(EngineArgs(**kw))
    schema = make_schema(args.min_items, args.max_items)
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=not args.any_whitespace)
    runs: dict = {m: [] for m in MODES}
    try:
        check = _grammar_checker(engine, so)
        vocab = engine.config.hf_config.vocab_size
        for m in MODES:  # warm-up: first-use costs, CUDA graphs, the schema's compilation
            # as many at once as the measured runs hold: the bitmask kernel's triton
            # specializations for that batch size compile here, not inside a measured run
            warm = make_workload(min(args.concurrency, args.num_prompts), args.input_len, 8, vocab, args.seed + 99)
            run_in_process(engine, warm, len(warm), math.inf, args.seed, ignore_eos=m == "unconstrained",
                           sampling={"structured_outputs": so} if m == "json_schema" else None)
        for r in range(args.rounds):
            for j, m in enumerate(MODES):
                res = run_mode(engine, args, m, so, args.seed + 1000 + 2 * r + j, check)
                runs[m].append(res)
                print(f"round {r} {m:13s}: {res['output_throughput']:10.1f} tok/s  host {res['host_ms_per_step']:.3f} "
                      f"ms/step  bitmask {res['grammar_bitmask_ms_per_step']:.3f} ms/step", file=sys.stderr)
        config = {"async_scheduling": engine.config.async_scheduling,
                  "engine_core": type(engine.engine_core).__name__, "vocab_size": vocab,
                  "bitmask_fill_threads": default_fill_threads(), "cpu_count": os.cpu_count()}
    finally:
        engine.shutdown()
        shutdown_llm(engine)

    summary = {m: {k: _median(rs, k) for k in ("output_throughput", "p50_ttft_ms", "p50_tpot_ms", "host_ms_per_step",
                                               "grammar_bitmask_ms_per_step", "grammar_bitmask_ms_per_constrained_step",
                                               "grammar_bitmask_us_per_row")}
               for m, rs in runs.items()}
    ratio = summary["json_schema"]["output_throughput"] / summary["unconstrained"]["output_throughput"]
    rows = [[m, s["output_throughput"], s["p50_ttft_ms"], s["p50_tpot_ms"], s["host_ms_per_step"],
             s["grammar_bitmask_ms_per_step"], s["grammar_bitmask_us_per_row"]] for m, s in summary.items()]
    print(header_md(f"Structured outputs vs unconstrained (AsyncLLM): {args.shape}, c={args.concurrency}, "
                    f"{args.num_prompts} requests, prompt {args.input_len} ids, output {args.output_len} tokens",
                    hw, cmd), file=sys.stderr)
    print(md_table(["mode", "output tok/s", "TTFT p50 (ms)", "TPOT p50 (ms)", "host ms/step",
                    "bitmask ms/step", "bitmask µs/row"], rows), file=sys.stderr)
    print(f"\njson_schema / unconstrained throughput: {ratio:.3f}×\n", file=sys.stderr)
    payload = finish("structured", args, hw, cmd, shape=args.shape, schema=schema, config=config,
                     summary=summary, ratio_json_schema_vs_unconstrained=ratio, runs=runs)
    print(json.dumps(payload, indent=2, default=str))
    return payload


if __name__ == "__main__":
    main()
