"""Tensor parallelism: batch-1 decode TPOT and offline throughput at TP=N vs TP=1, from
one run.

Runs ``benchmarks/latency.py`` (batch 1, Llama-3.1-8B shape by default) and
``benchmarks/throughput.py`` (nano-vllm's workload, Qwen3-0.6B and Llama-3.1-8B shapes by
default) once per tensor-parallel size, each in its own process (a fresh CUDA context;
a crash or hang of one run costs only its own figure), then reports the ratios:
TPOT(TP=N) / TPOT(TP=1) (target <= 0.65 at N=2) and output tok/s (TP=N) / (TP=1).

    python benchmarks/tp.py --json tp.json                                  # 2-GPU machine
    python benchmarks/tp.py --throughput-shapes qwen3-0.6b --json tp.json
    python benchmarks/tp.py --device cpu --latency-shape tiny --throughput-shapes tiny \\
        --output-len 8 --iters 1 --num-requests 4 --min-len 8 --max-len 64    # smoke
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from benchmarks.common import SHAPES, finish, header_md, md_table, parse_shapes, start  # noqa: E402

TPOT_TARGET = 0.65  # TP=2 / TP=1, batch 1, Llama-3.1-8B shape


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2, help="the tensor-parallel size compared with 1")
    p.add_argument("--latency-shape", choices=SHAPES, default="llama-3.1-8b")
    p.add_argument("--throughput-shapes", type=parse_shapes, default=parse_shapes("qwen3-0.6b,llama-3.1-8b"))
    p.add_argument("--no-throughput", action="store_true")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--output-len", type=int, default=128, help="latency: output tokens")
    p.add_argument("--iters", type=int, default=3, help="latency: runs (median)")
    p.add_argument("--num-requests", type=int, default=None, help="throughput: default the workload's 256")
    p.add_argument("--min-len", type=int, default=None, help="throughput: default the workload's 100")
    p.add_argument("--max-len", type=int, default=None, help="throughput: default the workload's 1024")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    p.add_argument("--json", dest="json_out", default=None, metavar="OUT")
    p.add_argument("--verbose", action="store_true", help="the runs' engine INFO logs")
    return p


def _run(script: str, argv: list[str], timeout: float, env: dict | None = None) -> dict:
    """One benchmark in its own process (``env`` added to its environment); returns its
    JSON payload, or {"error": ...}."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "r.json"
        cmd = [sys.executable, str(_REPO / "benchmarks" / script), *argv, "--json", str(out)]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=str(_REPO),
                                  env={**os.environ, **(env or {})})
        except subprocess.TimeoutExpired as e:
            tail = (e.stderr or b"")[-2000:]
            return {"error": f"timed out after {timeout:.0f} s", "stderr_tail": tail.decode(errors="replace")
                    if isinstance(tail, bytes) else tail, "command": " ".join(cmd)}
        wall = time.perf_counter() - t0
        if proc.returncode != 0 or not out.is_file():
            return {"error": f"exit code {proc.returncode}", "stderr_tail": proc.stderr[-3000:],
                    "command": " ".join(cmd)}
        payload = json.loads(out.read_text())
        payload["wall_s"] = wall
        return payload


def _ratio(a, b) -> float | None:
    try:
        return a / b if a and b else None
    except TypeError:
        return None


def main(argv: list[str] | None = None) -> dict:
    args, hw, cmd = start(build_parser(), argv, "tp.py")
    sizes = [1, args.tp]
    common = ["--device", args.device] + (["--threads", str(args.threads)] if args.threads else []) + \
        (["--verbose"] if args.verbose else [])
    runs: dict = {"latency": {}, "throughput": {}}
    latency_argv = ["--shape", args.latency_shape, "--batch-sizes", "1", "--output-len", str(args.output_len),
                    "--iters", str(args.iters)]
    # TP=N twice: as configured (by default in an engine process of its own, small
    # all-reduces through symmetric memory, fused with the norms after them), and every
    # all-reduce through NCCL (VENGINE_SYMM_MEM_ALLREDUCE=0), keyed "N-nccl"
    jobs = [("latency", args.latency_shape, tp, "latency.py", latency_argv, None) for tp in sizes]
    jobs.append(("latency", args.latency_shape, f"{args.tp}-nccl", "latency.py", latency_argv,
                 {"VENGINE_SYMM_MEM_ALLREDUCE": "0"}))
    extra = (["--num-requests", str(args.num_requests)] if args.num_requests else []) + \
            (["--min-len", str(args.min_len)] if args.min_len else []) + \
            (["--max-len", str(args.max_len)] if args.max_len else [])
    if not args.no_throughput:
        jobs += [("throughput", shape, tp, "throughput.py", ["--shape", shape] + extra, None)
                 for shape in args.throughput_shapes for tp in sizes]
    summary: dict = {}
    for kind, shape, tp, script, argv_, env in jobs:
        print(f"{kind}, {shape}, TP={tp} ...", flush=True)
        size = str(tp).split("-")[0]
        runs[kind].setdefault(shape, {})[tp] = _run(script, common + argv_ + ["--tensor-parallel-size", size],
                                                    args.timeout, env)
        summary = _summary(runs, args.tp)
        finish("tp", args, hw, cmd, summary=summary, runs=runs)  # after each run: a later hang loses nothing

    print()
    print(header_md(f"Tensor parallelism: TP={args.tp} vs TP=1", hw, cmd))
    rows = [[f"TPOT batch 1, {shape} (ms)", t.get(1), t.get(args.tp), t["ratio"]]
            for shape, t in summary["tpot_ms"].items()]
    rows += [[f"TPOT batch 1, {shape} (ms), every all-reduce through NCCL", t.get(1),
              t.get(f"{args.tp}-nccl"), t.get("ratio_nccl")] for shape, t in summary["tpot_ms"].items()]
    rows += [[f"offline output tok/s, {shape}", t.get(1), t.get(args.tp), t["ratio"]]
             for shape, t in summary["throughput_output_tok_s"].items()]
    print(md_table(["measure", "TP=1", f"TP={args.tp}", f"TP={args.tp} / TP=1"], rows))
    print(f"\nTPOT target TP={args.tp} <= {TPOT_TARGET} x TP=1: {'met' if summary['tpot_target_met'] else 'NOT met'}")
    for kind, by_shape in runs.items():
        for shape, by_tp in by_shape.items():
            for tp, r in by_tp.items():
                if "error" in r:
                    print(f"error in {kind} {shape} TP={tp}: {r['error']}\n{r.get('stderr_tail', '')}",
                          file=sys.stderr)
    return finish("tp", args, hw, cmd, summary=summary, runs=runs)


def _summary(runs: dict, n: int) -> dict:
    """TPOT (ms) and output tok/s per shape and tensor-parallel size, with TP=n / TP=1."""
    def tpot(r):
        return ((r.get("results") or [{}])[0]).get("tpot_ms")

    def tok_s(r):
        return (r.get("results") or {}).get("ours", {}).get("output_tok_s")

    out: dict = {"tpot_ms": {}, "throughput_output_tok_s": {}, "tpot_target": TPOT_TARGET}
    for key, kind, fn in (("tpot_ms", "latency", tpot), ("throughput_output_tok_s", "throughput", tok_s)):
        for shape, by_tp in runs[kind].items():
            vals = {tp: fn(r) for tp, r in by_tp.items()}
            out[key][shape] = {**vals, "ratio": _ratio(vals.get(n), vals.get(1))}
            if f"{n}-nccl" in vals:
                out[key][shape]["ratio_nccl"] = _ratio(vals[f"{n}-nccl"], vals.get(1))
    ratios = [t["ratio"] for t in out["tpot_ms"].values()]
    out["tpot_target_met"] = bool(ratios) and all(r is not None and r <= TPOT_TARGET for r in ratios)
    return out


if __name__ == "__main__":
    main()
