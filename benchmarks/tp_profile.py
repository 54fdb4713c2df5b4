"""Where a tensor-parallel decode step's time goes: per-step wall time, each rank's GPU
busy/idle, the largest idle gaps and what precedes them, GPU time per kernel class, and
host time per step phase on every rank.

Each ``--configs`` entry (``1``, ``2``, ``2-symm-mem``, ``2-symm-mem-gloo``: the
tensor-parallel size; ``symm-mem``: ``VENGINE_SYMM_MEM_ALLREDUCE=1`` (else it is set to 0,
so a bare size measures NCCL alone), which fuses each
layer's all-reduces with the residual add and RMSNorm after them unless ``nofuse``
(``VENGINE_FUSED_ALLREDUCE_RMSNORM=0``); ``gloo``: the steps over gloo instead of the
shared-memory ring, ``VENGINE_TP_SHM_BROADCAST=0``) runs in a
process of its own (one engine per
process; a hang costs only its entry). In each: ``--batch`` (1) requests of a
``--input-len``-token prompt, greedy, ``ignore_eos``, are prefilled and decoded
``--warmup-steps``, then two windows opened with ``EngineCore.profile`` (every rank opens
and closes it at the same step; pyengine/worker/profiler.py):

* timed (``--timed-steps``, no torch.profiler): wall time of each ``LLMEngine.step`` and
  host time per phase on every rank (``perf_counter`` laps). Rank 0's engine phases
  ``schedule``, ``wait`` (for the oldest in-flight step's sampled ids), ``update`` and
  ``output`` (the output processor) are timed here around the engine's calls; the
  runner's own phases (``pack``, ``send``, ``prepare``, ``forward``, ``logits``,
  ``sample``, ``token_bcast``; other ranks ``recv`` (waiting for the step, then reading it), ``prepare``,
  ``forward``, ``logits``, ``token_bcast``) inside the runner;
* profiled (``--profile-steps``, torch.profiler with CPU and CUDA activity on every
  rank): a one-byte marker kernel ends each step on each rank; per rank, GPU idle in
  the window from its first marker to its last (split into between steps, where a
  marker falls in the gap, and inside steps), the ``--top-gaps`` longest gaps with the
  kernel before and after each and the host phase (``record_function`` range) that
  launched the one after, and GPU time per kernel class (GEMM, attention, norms / RoPE /
  SiLU, all-reduce, logits gather, token broadcast, sampling, copies, other). The all-reduce row also
  gives count x its fastest instance: the rest of its time is waiting for the other
  rank (a collective's kernel spins until every rank has joined).

Traces (gzip) and per-rank phase files stay in ``--trace-dir`` when given.

    python benchmarks/tp_profile.py --json tp_profile.json --trace-dir /tmp/tp_traces   # 2 GPUs
    python benchmarks/tp_profile.py --device cpu --shape tiny --configs 2 --timed-steps 20 \\
        --profile-steps 8 --warmup-steps 4                                               # smoke
"""
from __future__ import annotations

import argparse
import bisect
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from benchmarks.common import (  # noqa: E402
    add_common_args,
    finish,
    header_md,
    md_table,
    prepare_model_dir,
    random_prompts,
    resolve_dtype,
    shutdown_llm,
    start,
)
from benchmarks.gpu_idle import GPU_CATEGORIES, busy_union, clip_to_markers, idle_gaps, split_idle  # noqa: E402
from benchmarks.tp import _run  # noqa: E402
from pyengine.worker.profiler import MARKER_KERNEL  # noqa: E402

# Kernel classes, first match wins (names from NCCL, torch, cuBLAS/CUTLASS and our triton ops).
KERNEL_CLASSES = (
    ("marker", re.compile(MARKER_KERNEL)),
    ("all_reduce", re.compile(r"AllReduce|all_reduce|allreduce|one_shot|two_shot|multimem", re.I)),
    ("gather", re.compile(r"nccl.*(SendRecv|Gather|Send|Recv)|gather_kernel", re.I)),
    ("broadcast", re.compile(r"nccl.*Broadcast", re.I)),
    ("nccl_other", re.compile(r"nccl", re.I)),
    ("gemm", re.compile(r"gemm|gemv|cutlass|xmma|nvjet|cublas|splitK|dot_kernel", re.I)),
    ("attention", re.compile(r"attn|attention|paged|_decode_split|_decode_reduce|_extend_kernel|reshape_and_cache"
                             r"|flash", re.I)),
    ("norm_rope_act", re.compile(r"rms_norm|rmsnorm|_rope|rotary|silu_and_mul|act_and_mul", re.I)),
    ("sampling", re.compile(r"ArgMax|argmax|sort|topk|softmax|multinomial|exponential|sampl|cumsum", re.I)),
    ("copy", re.compile(r"^Memcpy|^Memset|copy_kernel|CatArrayBatchedCopy|cat_", re.I)),
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, default_shape="llama-3.1-8b")
    p.add_argument("--configs", default="1,2,2-symm-mem,2-symm-mem-gloo",
                   help="comma-separated: a tensor-parallel size, optionally -symm-mem, -gloo (own process each)")
    p.add_argument("--config", default=None, help=argparse.SUPPRESS)  # one config, in this process
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--warmup-steps", type=int, default=30)
    p.add_argument("--timed-steps", type=int, default=200)
    p.add_argument("--profile-steps", type=int, default=40)
    p.add_argument("--top-gaps", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--no-async-scheduling", action="store_true")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--trace-dir", default=None, help="keep each config's traces and phase files under this folder")
    p.add_argument("--timeout", type=float, default=200.0, help="seconds per config")
    p.add_argument("--verbose", action="store_true", help="engine INFO logs")
    return p


# ---- trace analysis ---------------------------------------------------------------------

def kernel_class(name: str) -> str:
    for cls, pat in KERNEL_CLASSES:
        if pat.search(name):
            return cls
    return "other"


def load_trace(path: str) -> dict:
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        trace = json.load(f)
    return trace if isinstance(trace, dict) else {"traceEvents": trace}


def _host_phase_of(ts: float, tid, ranges: dict) -> str | None:
    """The innermost ``record_function`` range on thread ``tid`` that contains ``ts``."""
    best = None
    for s, e, name in ranges.get(tid, ()):
        if s <= ts <= e and (best is None or s >= best[0]):
            best = (s, name)
    return best[1] if best else None


def analyze_trace(path: str, top_k: int = 8) -> dict:
    """GPU busy/idle, top gaps and time per kernel class of one rank's trace (see the
    module doc); the window runs from the rank's first step marker to its last. Times in
    microseconds; ``window_abs_us`` on the host clock (``baseTimeNanoseconds`` + ts), so
    the ranks' windows can be compared."""
    trace = load_trace(path)
    base_us = float(trace.get("baseTimeNanoseconds", 0)) / 1e3
    events = trace["traceEvents"]
    gpu, launches, ranges = [], {}, {}
    for ev in events:
        if ev.get("ph") != "X":
            continue
        cat = str(ev.get("cat", "")).lower()
        ts, dur = float(ev.get("ts", 0.0)), max(float(ev.get("dur", 0.0)), 0.0)
        args = ev.get("args") or {}
        if cat in GPU_CATEGORIES:
            gpu.append((ts, ts + dur, str(ev.get("name", "")), args.get("correlation")))
        elif cat in ("cuda_runtime", "cuda_driver") and args.get("correlation") is not None:
            launches[args["correlation"]] = (ts, ev.get("tid"), str(ev.get("name", "")))
        elif cat == "user_annotation":
            ranges.setdefault(ev.get("tid"), []).append((ts, ts + dur, str(ev.get("name", ""))))
    out: dict = {"trace": os.path.basename(path), "num_gpu_ops": len(gpu)}
    if not gpu:
        out["note"] = "no GPU activity in the trace (CPU run)"
        out["host_phases_from_trace_ms"] = _range_totals(ranges)
        return out
    gpu.sort(key=lambda g: (g[0], g[1]))
    markers = [(a, b) for a, b, n, _ in gpu if MARKER_KERNEL in n]
    ops = [(a, b) for a, b, n, _ in gpu if MARKER_KERNEL not in n]
    iv, win = clip_to_markers(ops, markers)
    if win is None:
        out["note"] = f"{len(markers)} step markers: no window"
        return out
    ws, we = win
    start, end, busy, gaps = busy_union(iv)
    window = end - start
    steps = max(len(markers) - 1, 1)
    between, inside = split_idle(iv, markers)
    by_class: dict = {}
    ar_durs = []
    for a, b, name, _ in gpu:
        if b <= ws or a >= we:
            continue
        d = min(b, we) - max(a, ws)
        cls = kernel_class(name)
        c = by_class.setdefault(cls, {"count": 0, "total_us": 0.0})
        c["count"] += 1
        c["total_us"] += d
        if cls == "all_reduce":
            ar_durs.append(b - a)
    for c in by_class.values():
        c["per_step_us"] = c["total_us"] / steps
    if ar_durs:
        fastest = min(ar_durs)
        by_class["all_reduce"].update({
            "median_us": statistics.median(ar_durs), "min_us": fastest,
            "beyond_fastest_per_step_us": (sum(ar_durs) - fastest * len(ar_durs)) / steps})
    names = {}
    for a, b, name, _ in gpu:
        if ws < b and a < we and MARKER_KERNEL not in name:
            k = names.setdefault(name[:120], [0, 0.0])
            k[0] += 1
            k[1] += min(b, we) - max(a, ws)
    top_kernels = sorted(names.items(), key=lambda kv: -kv[1][1])[:15]
    # the longest gaps: what ran before, what ran after, and which host phase launched the latter
    starts = [a for a, _, _, _ in gpu]
    mids = sorted((a + b) / 2 for a, b in markers)
    gap_rows = []
    for a, b in sorted(idle_gaps(iv), key=lambda g: g[0] - g[1])[:top_k]:
        i = bisect.bisect_left(starts, b)
        after = gpu[i] if i < len(gpu) else None
        before = max((g for g in gpu[:i] if g[1] <= a + 1e-3 and MARKER_KERNEL not in g[2]),
                     key=lambda g: g[1], default=None)
        launch = launches.get(after[3]) if after is not None else None
        j = bisect.bisect_right(mids, a)
        gap_rows.append({
            "gap_us": b - a, "at_ms": (a - ws) / 1e3, "between_steps": j < len(mids) and mids[j] < b,
            "before": before[2][:100] if before else None, "after": after[2][:100] if after else None,
            "after_launched_by": launch[2] if launch else None,
            "after_launch_phase": _host_phase_of(launch[0], launch[1], ranges) if launch else None,
            "after_launch_lead_us": (after[0] - launch[0]) if launch else None,
        })
    out.update({
        "steps": steps, "window_us": window, "window_abs_us": [base_us + ws, base_us + we],
        "gpu_busy_us_per_step": busy / steps, "gpu_idle_us_per_step": (window - busy) / steps,
        "wall_us_per_step": window / steps, "idle_fraction": 1 - busy / window if window > 0 else None,
        "idle_between_steps_us_per_step": between / steps, "idle_inside_steps_us_per_step": inside / steps,
        "gpu_ops_per_step": len(iv) / steps, "by_class": by_class, "top_gaps": gap_rows,
        "top_kernels": [{"name": n, "count": c, "total_us": t, "per_step_us": t / steps} for n, (c, t) in top_kernels],
        "host_phases_from_trace_ms": _range_totals(ranges),
    })
    return out


def _range_totals(ranges: dict) -> dict:
    tot: dict = {}
    for rs in ranges.values():
        for s, e, name in rs:
            tot[name] = tot.get(name, 0.0) + (e - s) / 1e3
    return tot


# ---- one config, in this process ----------------------------------------------------------

class _Laps:
    """Host time of rank 0's engine-level phases, accumulated while ``on``."""

    def __init__(self):
        self.on = False
        self.totals: dict = {}
        self.counts: dict = {}

    def wrap(self, name: str, fn):
        def timed(*a, **kw):
            if not self.on:
                return fn(*a, **kw)
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - t
                self.counts[name] = self.counts.get(name, 0) + 1
        return timed

    def take(self, steps: int) -> dict:
        out = {n: {"count": self.counts[n], "total_ms": 1e3 * t, "mean_us": 1e6 * t / self.counts[n],
                   "per_step_us": 1e6 * t / max(steps, 1)} for n, t in self.totals.items()}
        self.totals, self.counts = {}, {}
        return out


class _WaitTimed:
    """A pending runner output whose ``get_output`` is timed as rank 0's ``wait``."""

    def __init__(self, inner, laps: _Laps):
        self._inner, self._get = inner, laps.wrap("wait", inner.get_output)

    def get_output(self):
        return self._get()

    def __getattr__(self, name):
        return getattr(self._inner, name)


def run_config(args, config: str) -> dict:
    import torch

    from pyengine import LLM, RequestOutputKind, SamplingParams

    tp = int(config.split("-")[0])
    model_dir = prepare_model_dir(args)
    cuda = args.device == "cuda"
    out_dir = os.path.join(args.trace_dir, f"tp{config}") if args.trace_dir else tempfile.mkdtemp(prefix="vengine_tpprof_")
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.perf_counter()
    llm = LLM(str(model_dir), load_format="dummy", dtype=resolve_dtype(args), device=args.device,
              max_model_len=args.max_model_len, max_num_seqs=max(args.batch, 1),
              enforce_eager=args.enforce_eager, gpu_memory_utilization=args.gpu_memory_utilization,
              async_scheduling=False if args.no_async_scheduling else None, tensor_parallel_size=tp)
    startup = time.perf_counter() - t0
    eng = llm.llm_engine
    core = eng.engine_core
    cfg = eng.config
    laps = _Laps()
    core.scheduler.schedule = laps.wrap("schedule", core.scheduler.schedule)
    core.scheduler.update_from_output = laps.wrap("update", core.scheduler.update_from_output)
    ex = core.model_executor
    execute = ex.execute_model

    def execute_timed(*a, **kw):
        out = execute(*a, **kw)
        return _WaitTimed(out, laps) if (laps.on and out is not None and hasattr(out, "get_output")) else out

    ex.execute_model = execute_timed
    core_step = eng._step
    eng._step = laps.wrap("core_step", core_step)

    steps_needed = args.warmup_steps + args.timed_steps + args.profile_steps + 16
    if args.input_len + steps_needed >= args.max_model_len:
        raise SystemExit(f"error: {steps_needed} decode steps do not fit max_model_len {args.max_model_len}")
    prompts = random_prompts(args.batch, args.input_len, args.input_len, cfg.hf_config.vocab_size, seed=5)
    sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=steps_needed, detokenize=False,
                        output_kind=RequestOutputKind.DELTA)
    ids = [f"prof{i}" for i in range(args.batch)]
    for rid, p in zip(ids, prompts):
        eng.add_request(rid, p, sp)

    def steps(n: int, times: list | None = None) -> int:
        toks = 0
        for _ in range(n):
            t = time.perf_counter()
            for out in eng.step():
                toks += sum(len(c.token_ids) for c in out.outputs)
            if times is not None:
                times.append(time.perf_counter() - t)
        return toks

    seen = 0
    for _ in range(64):  # prefill, until every request has its first token
        seen += steps(1)
        if seen >= args.batch:
            break
    steps(args.warmup_steps)
    if cuda:
        torch.cuda.synchronize()

    # timed window: phase laps on every rank, no torch.profiler
    core.profile(True, out_dir, trace=False)
    laps.on = True
    times: list = []
    t = time.perf_counter()
    toks = steps(args.timed_steps, times)
    wall = time.perf_counter() - t
    laps.on = False
    engine_phases = laps.take(args.timed_steps)
    r0 = core.profile(False)
    phase_files = sorted(Path(out_dir).glob(f"rank*-w{r0['window']}.phases.json"))
    rank_phases = {}
    for f in phase_files:
        d = json.loads(f.read_text())
        rank_phases[str(d["rank"])] = d["phases"]
    cs, rest = engine_phases.get("core_step"), dict(engine_phases)
    rest.pop("core_step", None)
    if cs is not None:  # LLMEngine.step minus the core's step: the output processor
        rest["output"] = {"per_step_us": 1e6 * (sum(times) / len(times)) - cs["per_step_us"]}
    timed = {
        "steps": args.timed_steps, "tokens": toks, "wall_s": wall,
        "ms_per_token": 1e3 * wall * args.batch / max(toks, 1),
        "step_ms": {"median": 1e3 * statistics.median(times), "mean": 1e3 * statistics.mean(times),
                    "p90": 1e3 * sorted(times)[int(0.9 * (len(times) - 1))], "max": 1e3 * max(times)},
        "rank0_engine_phases": rest, "rank_phases": rank_phases,
    }

    # profiled window: torch.profiler on every rank
    core.profile(True, out_dir, trace=True)
    steps(args.profile_steps)
    r0 = core.profile(False)
    traces = sorted(Path(out_dir).glob(f"rank*-w{r0['window']}.trace.json.gz"))
    profiled = {}
    for f in traces:
        rank = f.name[4:f.name.index("-")]
        profiled[rank] = analyze_trace(str(f), args.top_gaps)
        profiled[rank]["trace_bytes"] = f.stat().st_size
    if len(profiled) > 1 and all("window_abs_us" in r for r in profiled.values()):
        w = {r: p["window_abs_us"] for r, p in profiled.items()}
        profiled["rank_window_offsets_us"] = {r: w[r][0] - w["0"][0] for r in w}

    eng.abort_request(ids)
    for _ in range(8):
        if not eng.has_unfinished_requests():
            break
        eng.step()
    shutdown_llm(llm)
    if not args.trace_dir:
        for f in Path(out_dir).iterdir():
            f.unlink()
        os.rmdir(out_dir)
    return {"config": config, "tensor_parallel_size": tp, "symm_mem": "symm" in config,
            "step_transport": "gloo" if "gloo" in config else "shm", "startup_s": startup,
            "async_scheduling": cfg.async_scheduling, "enforce_eager": cfg.enforce_eager,
            "dtype": str(cfg.dtype).replace("torch.", ""), "timed": timed, "profiled": profiled,
            "trace_dir": out_dir if args.trace_dir else None}


# ---- report -------------------------------------------------------------------------------

def _print_config(r: dict) -> None:
    t = r["timed"]
    print(f"\n### config {r['config']}: {t['ms_per_token']:.3f} ms/token (step median {t['step_ms']['median']:.3f} ms)\n")
    rows = [["rank 0 engine", n, v["per_step_us"]] for n, v in t["rank0_engine_phases"].items()]
    for rank, ph in sorted(t["rank_phases"].items()):
        rows += [[f"rank {rank} runner", n, v["per_step_us"]] for n, v in ph.items()]
    print(md_table(["where", "host phase", "µs per step"], rows))
    for rank, p in sorted((k, v) for k, v in r["profiled"].items() if k.isdigit()):
        if "by_class" not in p:
            print(f"\nrank {rank}: {p.get('note')}")
            continue
        print(f"\nrank {rank} GPU: {p['wall_us_per_step']:.0f} µs/step, busy {p['gpu_busy_us_per_step']:.0f}, idle "
              f"{p['gpu_idle_us_per_step']:.0f} (between steps {p['idle_between_steps_us_per_step']:.0f}, inside "
              f"{p['idle_inside_steps_us_per_step']:.0f}), {p['gpu_ops_per_step']:.0f} ops/step\n")
        print(md_table(["kernel class", "count/step", "µs per step"],
                       [[c, v["count"] / p["steps"], v["per_step_us"]] for c, v in
                        sorted(p["by_class"].items(), key=lambda kv: -kv[1]["total_us"])]))
        ar = p["by_class"].get("all_reduce")
        if ar and "min_us" in ar:
            print(f"all-reduce: median {ar['median_us']:.1f} µs, fastest {ar['min_us']:.1f} µs, "
                  f"{ar['beyond_fastest_per_step_us']:.0f} µs/step beyond the fastest (waiting for the peer)")
        print()
        print(md_table(["gap µs", "at ms", "between steps", "before", "after", "launched in phase"],
                       [[g["gap_us"], g["at_ms"], g["between_steps"], g["before"], g["after"],
                         g["after_launch_phase"]] for g in p["top_gaps"]]))


def main(argv: list[str] | None = None) -> dict:
    args, hw, cmd = start(build_parser(), argv, "tp_profile.py")
    if args.config:  # a child run
        res = run_config(args, args.config)
        return finish("tp_profile", args, hw, cmd, results={args.config: res})
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    results: dict = {}
    for c in configs:
        print(f"config {c} ...", flush=True)
        argv_c = [a for a in (sys.argv[1:] if argv is None else argv)]
        argv_c = _drop_opt(_drop_opt(argv_c, "--json"), "--configs") + ["--config", c]
        env = {"VENGINE_SYMM_MEM_ALLREDUCE": "1" if "symm" in c else "0",
               "VENGINE_TP_SHM_BROADCAST": "0" if "gloo" in c else "1",
               "VENGINE_FUSED_ALLREDUCE_RMSNORM": "0" if "nofuse" in c else "1"}
        r = _run("tp_profile.py", argv_c, args.timeout, env)
        results[c] = r.get("results", {}).get(c, r)
        finish("tp_profile", args, hw, cmd, results=results)  # after each: a later hang loses nothing
    print()
    print(header_md(f"Tensor-parallel decode profile: {args.shape}, batch {args.batch}", hw, cmd))
    rows = []
    for c, r in results.items():
        if "error" in r:
            print(f"config {c}: {r['error']}\n{r.get('stderr_tail', '')}", file=sys.stderr)
            continue
        p0 = r["profiled"].get("0", {})
        rows.append([c, r["timed"]["ms_per_token"], r["timed"]["step_ms"]["median"],
                     p0.get("gpu_busy_us_per_step"), p0.get("gpu_idle_us_per_step")])
    print(md_table(["config", "ms/token", "step median ms", "rank 0 GPU busy µs/step", "rank 0 GPU idle µs/step"],
                   rows))
    for r in results.values():
        if "error" not in r:
            _print_config(r)
    return finish("tp_profile", args, hw, cmd, results=results)


def _drop_opt(argv: list[str], opt: str) -> list[str]:
    """``argv`` without ``opt VALUE`` / ``opt=VALUE``."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == opt:
            skip = True
            continue
        if a.startswith(opt + "="):
            continue
        out.append(a)
    return out


if __name__ == "__main__":
    main()
