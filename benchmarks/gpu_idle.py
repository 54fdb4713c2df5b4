"""GPU idle fraction between decode steps, async scheduling on and off.

For each mode: ``--batch`` (64) requests with a short prompt are admitted and prefilled, a
few warm-up decode steps run, then

* a timed window of ``--timed-steps`` decode steps (no profiler) gives decode tokens/s;
* a profiled window of ``--profile-steps`` decode steps under
  ``torch.profiler.profile(activities=[CUDA])`` gives every kernel / memcpy / memset
  interval; idle = 1 - (union of busy intervals) / window, the window running from the
  first step marker (below) to the last, so that the trace's edges (the profiler starting,
  a batch queued before it started) are left out; the whole-trace figure and its longest
  gaps are kept in the JSON too.

The idle time is split in two. A one-byte marker kernel is queued on the compute stream
after every ``step()`` call, so the stream's work falls into the groups each step launched.
The idle gaps the markers fall into are **between steps** (the GPU waited for the host to
queue the next step: the figure async scheduling exists to shrink); every other gap is a
**bubble inside a step** (kernel-to-kernel latency on the GPU, present even when the host
is far ahead). Marker kernels count as idle, never as busy.

A floor for the bubbles: the same batch's decode CUDA graph replayed back to back
(``--profile-steps`` replays, no host work in between; the host queues replays faster than
the GPU runs them) gives the idle fraction of the forward pass alone ("graph replay idle").

The on/off ratio of decode tokens/s is printed too (``throughput.py
--no-async-scheduling`` gives the same ratio on the full throughput workload).

    python benchmarks/gpu_idle.py                        # Qwen3-0.6B shape, batch 64
    python benchmarks/gpu_idle.py --batch 256 --trace-dir /tmp/traces
    python benchmarks/gpu_idle.py --device cpu --shape tiny --batch 2 --timed-steps 4   # smoke (no profile)
"""
from __future__ import annotations

import argparse
import bisect
import json
import os
import sys
import tempfile
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
    prepare_model_dir,
    random_prompts,
    resolve_dtype,
    shutdown_llm,
    start,
    stats_delta,
)

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--timed-steps", type=int, default=200)
    p.add_argument("--profile-steps", type=int, default=100)
    p.add_argument("--modes", default="on,off", help="async scheduling modes to run: on,off | on | off")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--gap-us", type=float, default=5.0, help="report gaps longer than this (microseconds)")
    p.add_argument("--trace-dir", default=None, help="keep the chrome traces here")
    p.add_argument("--verbose", action="store_true", help="engine INFO logs")
    p.add_argument("--structured", action="store_true",
                   help="constrain every request with structured.py's JSON schema (greedy), and record the "
                        "host timeline too: the engine core's phases and CUDA runtime waits per step")
    return p


def idle_gaps(ops: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (start, end) gaps of the union of [start, end) intervals, in time order."""
    ivs = sorted(ops)
    gaps = []
    cur_e = ivs[0][1] if ivs else 0.0
    for s, e in ivs[1:]:
        if s > cur_e:
            gaps.append((cur_e, s))
        cur_e = max(cur_e, e)
    return gaps


def busy_union(intervals: list[tuple[float, float]]) -> tuple[float, float, float, list[float]]:
    """(window start, window end, busy time, gap lengths) of [start, end) intervals (any unit)."""
    if not intervals:
        return 0.0, 0.0, 0.0, []
    start, end = min(s for s, _ in intervals), max(e for _, e in intervals)
    gaps = [b - a for a, b in idle_gaps(intervals)]
    return start, end, (end - start) - sum(gaps), gaps


def split_idle(ops: list[tuple[float, float]], markers: list[tuple[float, float]]) -> tuple[float, float]:
    """(idle between steps, idle inside steps) given busy ``ops`` and step ``markers`` intervals.

    A gap of the ops' busy union is "between steps" if a marker's midpoint falls in it.
    """
    mids = sorted((a + b) / 2 for a, b in markers)
    between = inside = 0.0
    for a, b in idle_gaps(ops):
        i = bisect.bisect_right(mids, a)  # first midpoint after the gap's start
        if i < len(mids) and mids[i] < b:
            between += b - a
        else:
            inside += b - a
    return between, inside


def clip_to_markers(ops: list[tuple[float, float]], markers: list[tuple[float, float]]):
    """(ops clipped to the window, window) where the window runs from the first step marker's
    start to the last one's end. Its edges are left out: work queued before the profiler
    started (async scheduling keeps a batch in flight) and the profiler's own start-up
    would otherwise count as idle. Zero-length ops pin the window's ends, so the idle time
    at either edge (where a marker sits) counts as between steps. Window None: < 2 markers."""
    if len(markers) < 2:
        return ops, None
    ws, we = min(a for a, _ in markers), max(b for _, b in markers)
    clipped = [(max(a, ws), min(b, we)) for a, b in ops if b > ws and a < we]
    return [(ws, ws)] + clipped + [(we, we)], (ws, we)


def top_gaps(ops: list[tuple[float, float]], markers: list[tuple[float, float]], k: int = 5) -> list[dict]:
    """The k longest idle gaps of the ops' busy union: length (us), start relative to the
    first op (ms), and how many step markers ran before it."""
    if not ops:
        return []
    t0 = min(a for a, _ in ops)
    mstarts = sorted(a for a, _ in markers)
    longest = sorted(idle_gaps(ops), key=lambda g: g[1] - g[0], reverse=True)[:k]
    return [{"gap_us": b - a, "at_ms": (a - t0) / 1e3, "markers_before": bisect.bisect_left(mstarts, a)}
            for a, b in longest]


HOST_PHASES = (("scheduler", "schedule"), ("scheduler", "update_from_output"), ("scheduler", "get_grammar_bitmask"),
               ("model_executor", "execute_model"), ("model_executor", "sample_tokens"))
CUDA_WAITS = ("cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync",
              "cudaGraphLaunch", "cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx")


def wrap_host_phases(core) -> None:
    """Wrap the engine core's step phases in ``record_function`` ranges named
    ``phase:<method>`` (instance attributes: only this benchmark's engine is affected)."""
    from torch.profiler import record_function

    def wrapped(fn, label):
        def call(*a, **k):
            with record_function(label):
                return fn(*a, **k)
        return call
    for owner, name in HOST_PHASES:
        obj = getattr(core, owner)
        setattr(obj, name, wrapped(getattr(obj, name), f"phase:{name}"))


def host_timeline(path: str, steps: int, window) -> dict:
    """Host-side figures of a CPU+CUDA trace inside the marker window: ms per step in each
    ``phase:*`` range and each CUDA runtime call of ``CUDA_WAITS`` (count per step too)."""
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    ws, we = window if window else (float("-inf"), float("inf"))
    out: dict = {}
    for ev in events:
        name = str(ev.get("name", ""))
        if ev.get("ph") != "X" or not (name.startswith("phase:") or name in CUDA_WAITS):
            continue
        ts = float(ev.get("ts", 0.0))
        if not ws <= ts <= we:
            continue
        d = out.setdefault(name, {"ms_per_step": 0.0, "calls_per_step": 0.0})
        d["ms_per_step"] += float(ev.get("dur", 0.0)) / 1e3 / steps
        d["calls_per_step"] += 1.0 / steps
    return out


MARKER_KERNEL = "bitwise_not"  # the marker's kernel name contains this; no engine step runs one


def gpu_intervals_from_trace(path: str) -> list[tuple[float, float, str]]:
    """Busy intervals (microseconds) and names of kernels, memcpys and memsets in a chrome trace."""
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    out = []
    for ev in events:
        if ev.get("ph") != "X" or str(ev.get("cat", "")).lower() not in GPU_CATEGORIES:
            continue
        ts, dur = float(ev.get("ts", 0.0)), float(ev.get("dur", 0.0))
        out.append((ts, ts + max(dur, 0.0), str(ev.get("name", ""))))
    return out


def kernel_table(ops: list[tuple[float, float, str]], steps: int, top: int = 25) -> list[dict]:
    """The GPU ops of a profiled window by name, most time first: calls and microseconds per
    step (what to compare between two checkouts when the busy time per step differs)."""
    by: dict[str, list[float]] = {}
    for a, b, name in ops:
        if MARKER_KERNEL in name:
            continue
        e = by.setdefault(name[:120], [0, 0.0])
        e[0] += 1
        e[1] += b - a
    rows = sorted(by.items(), key=lambda kv: -kv[1][1])[:top]
    return [{"name": n, "calls_per_step": c / steps, "us_per_step": us / steps} for n, (c, us) in rows]


def graph_replay_idle(llm, batch: int, replays: int, trace_dir: str) -> float | None:
    """Idle fraction of ``replays`` back-to-back replays of the decode graph that serves
    ``batch`` (its buffers still hold the last step's inputs, so it recomputes that step and
    rewrites the same KV slots with the same values). None without CUDA graphs."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    gr = llm.llm_engine.engine_core.model_runner.graph_runner
    if gr is None or batch > gr.max_batch_size:
        return None
    graph = gr.graphs[next(s for s in gr.sizes if s >= batch)]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    path = os.path.join(trace_dir, "graph_replay.json")
    prof.export_chrome_trace(path)
    start, end, busy, _ = busy_union([(a, b) for a, b, _ in gpu_intervals_from_trace(path)])
    os.remove(path)
    return (1.0 - busy / (end - start)) if end > start else None


def run_mode(args, model_dir, async_on: bool) -> dict:
    import torch

    from pyengine import LLM, RequestOutputKind, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(str(model_dir), load_format="dummy", dtype=resolve_dtype(args), device=args.device,
              max_model_len=args.max_model_len, max_num_seqs=max(args.batch, 1), async_scheduling=async_on,
              enforce_eager=args.enforce_eager, gpu_memory_utilization=args.gpu_memory_utilization)
    startup = time.perf_counter() - t0
    eng = llm.llm_engine
    cfg = eng.config
    cuda = cfg.device.type == "cuda"
    prompts = random_prompts(args.batch, args.input_len, args.input_len, cfg.hf_config.vocab_size, seed=11)
    total_steps = args.warmup_steps + args.timed_steps + args.profile_steps + 16
    max_tokens = min(total_steps, args.max_model_len - args.input_len - 1)
    if max_tokens < total_steps:
        raise SystemExit(f"error: {total_steps} decode steps do not fit max_model_len {args.max_model_len}")
    so = None
    if args.structured:
        from benchmarks.structured import make_schema
        from pyengine import StructuredOutputsParams
        so = StructuredOutputsParams(json=make_schema(48, 64), disable_any_whitespace=True)
    sp = SamplingParams(temperature=0.0 if so else 0.6, ignore_eos=True, max_tokens=max_tokens, detokenize=False,
                        output_kind=RequestOutputKind.DELTA, structured_outputs=so)
    ids = [f"idle{i}" for i in range(args.batch)]
    for rid, p in zip(ids, prompts):
        eng.add_request(rid, p, sp)

    marker = torch.zeros(1, dtype=torch.uint8, device=cfg.device) if cuda else None

    def steps(n, mark=False) -> int:
        toks = 0
        for _ in range(n):
            for out in eng.step():
                toks += sum(len(c.token_ids) for c in out.outputs)
            if mark:
                marker.bitwise_not_()  # step boundary in the compute stream (see the module doc)
        return toks

    # Prefill (one step for the default sizes), then until every request has a token.
    seen = 0
    for _ in range(64):
        seen += steps(1)
        if seen >= args.batch:
            break
    steps(args.warmup_steps)
    st = eng.get_stats()
    if st.num_running != args.batch or st.num_waiting:
        print(f"warning: {st.num_running} running, {st.num_waiting} waiting (expected {args.batch} running)",
              file=sys.stderr)

    before = eng.get_stats()
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    toks = steps(args.timed_steps)
    if cuda:
        torch.cuda.synchronize()
    timed_s = time.perf_counter() - t
    sd = stats_delta(before, eng.get_stats())

    res = {"async_scheduling": cfg.async_scheduling, "enforce_eager": cfg.enforce_eager, "startup_s": startup,
           "batch": args.batch, "timed_steps": args.timed_steps, "decode_tokens": toks, "timed_s": timed_s,
           "decode_tok_s": toks / timed_s, "wall_ms_per_step": 1e3 * timed_s / max(args.timed_steps, 1),
           "host_ms_per_step": sd["host_ms_per_step"], "idle_fraction": None}

    if cuda and args.profile_steps > 0:
        from torch.profiler import ProfilerActivity, profile
        trace_dir = args.trace_dir or tempfile.mkdtemp(prefix="vengine_idle_")
        os.makedirs(trace_dir, exist_ok=True)
        path = os.path.join(trace_dir, f"decode_async_{'on' if cfg.async_scheduling else 'off'}.json")
        acts = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if args.structured else [])
        if args.structured:
            wrap_host_phases(eng.engine_core)
        with profile(activities=acts) as prof:
            steps(args.profile_steps, mark=True)
            torch.cuda.synchronize()
        prof.export_chrome_trace(path)
        ops = gpu_intervals_from_trace(path)
        markers = [(a, b) for a, b, name in ops if MARKER_KERNEL in name]
        raw = [(a, b) for a, b, name in ops if MARKER_KERNEL not in name]
        s0, e0, busy0, _ = busy_union(raw)
        iv, win = clip_to_markers(raw, markers)
        start, end, busy, gaps = busy_union(iv)
        window = end - start
        long_gaps = [g for g in gaps if g > args.gap_us]
        between, inside = split_idle(iv, markers)
        if len(markers) != args.profile_steps:
            print(f"warning: found {len(markers)} step markers for {args.profile_steps} steps", file=sys.stderr)
        res.update({
            "idle_fraction": (1.0 - busy / window) if window > 0 else None,
            "idle_fraction_whole_trace": (1.0 - busy0 / (e0 - s0)) if e0 > s0 else None,
            "longest_gaps_whole_trace": top_gaps(raw, markers),
            "idle_between_steps_fraction": between / window if window > 0 else None,
            "idle_inside_steps_fraction": inside / window if window > 0 else None,
            "num_step_markers": len(markers),
            "profile_window_ms": window / 1e3, "gpu_busy_ms": busy / 1e3, "num_gpu_ops": len(iv),
            "profile_steps": args.profile_steps,
            "idle_ms_per_step": (window - busy) / 1e3 / max(len(markers) - 1 if win else args.profile_steps, 1),
            "gaps_over_threshold": len(long_gaps), "gap_threshold_us": args.gap_us,
            "max_gap_us": max(gaps) if gaps else 0.0,
            "trace": path if args.trace_dir else None,
        })
        res["gpu_ops_per_step"] = len(iv) / args.profile_steps
        res["kernels_per_step"] = kernel_table(ops, args.profile_steps)
        if args.structured:
            res["host_timeline"] = host_timeline(path, max(len(markers) - 1, 1), win)
            res["grammar"] = {k: v for k, v in sd.items() if "grammar" in k}
        res["graph_replay_idle_fraction"] = graph_replay_idle(llm, args.batch, args.profile_steps, trace_dir)
        if len(iv) < 5 * args.profile_steps:
            print(f"warning: the profiler recorded only {len(iv)} GPU ops over {args.profile_steps} steps; kernels "
                  f"inside CUDA-graph replays may be missing from the trace (check with --enforce-eager)",
                  file=sys.stderr)
        if not args.trace_dir:
            try:
                os.remove(path)
                os.rmdir(trace_dir)
            except OSError:
                pass
    eng.abort_request(ids)
    for _ in range(8):  # let the aborts (and any in-flight batch) drain
        if not eng.has_unfinished_requests():
            break
        eng.step()
    shutdown_llm(llm)
    del llm, eng
    free_cuda()
    return res


def main(argv: list[str] | None = None) -> dict:
    args, hw, cmd = start(build_parser(), argv, "gpu_idle.py")
    modes = async_modes(args.modes)
    model_dir = prepare_model_dir(args)
    results = {m: run_mode(args, model_dir, m == "on") for m in modes}
    ratio = None
    if "on" in results and "off" in results:
        ratio = results["on"]["decode_tok_s"] / max(results["off"]["decode_tok_s"], 1e-9)

    print()
    print(header_md(f"GPU idle between decode steps: {args.shape}, batch {args.batch}, "
                    f"{args.profile_steps} profiled steps", hw, cmd))
    g = results[modes[0]]
    print(f"CUDA graphs {'off' if g['enforce_eager'] else 'on'}, dtype {resolve_dtype(args)}\n")

    def pct(v):
        return "n/a" if v is None else f"{100 * v:.2f}%"
    print(md_table(["async scheduling", "GPU idle", "whole trace", "between steps", "inside steps", "graph replay idle", "idle ms/step", "wall ms/step", "host ms/step", "decode tok/s",
                    f"gaps > {args.gap_us:g} us", "max gap (us)", "GPU ops/step"],
                   [[m, pct(r["idle_fraction"]), pct(r.get("idle_fraction_whole_trace")),
                     pct(r.get("idle_between_steps_fraction")),
                     pct(r.get("idle_inside_steps_fraction")), pct(r.get("graph_replay_idle_fraction")),
                     r.get("idle_ms_per_step"), r["wall_ms_per_step"],
                     r["host_ms_per_step"], r["decode_tok_s"], r.get("gaps_over_threshold"), r.get("max_gap_us"),
                     r.get("gpu_ops_per_step")]
                    for m, r in results.items()]))
    for m, r in results.items():
        for g in r.get("longest_gaps_whole_trace") or []:
            print(f"async {m}: gap {g['gap_us']:,.0f} us at {g['at_ms']:.2f} ms into the trace, "
                  f"after {g['markers_before']} step markers")
    for m, r in results.items():
        for name, d in sorted((r.get("host_timeline") or {}).items()):
            print(f"async {m}: host {name}: {d['ms_per_step']:.3f} ms/step, {d['calls_per_step']:.1f} calls/step")
        if r.get("grammar"):
            print(f"async {m}: grammar {r['grammar']}")
    if ratio is not None:
        print(f"\nasync on / off (decode tok/s): {ratio:.3f}x")
    print()
    return finish("gpu_idle", args, hw, cmd, shape=args.shape, results=results, ratio_on_off_decode_tok_s=ratio)


if __name__ == "__main__":
    main()
