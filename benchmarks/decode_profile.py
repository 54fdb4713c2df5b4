"""Where one batch-1 decode step's time goes, kernel by kernel: the profiling part of
benchmarks/moe.py (``--sections profile``) and benchmarks/quant.py (``--parts profile``).

``profile_decode(llm, ...)`` takes an engine the caller built (the one its TPOT
measurement builds), adds one greedy ``ignore_eos`` request of an ``input_len``-token
prompt, prefills it, and then

* runs ``warmup_steps`` decode steps;
* times ``timed_steps`` decode steps without a profiler (wall time per ``LLMEngine.step``:
  what TPOT sees);
* records ``profile_steps`` decode steps in the engine's profiling window
  (``EngineCore.profile``, pyengine/worker/profiler.py: ``torch.profiler.profile`` with
  CPU and CUDA activity, the runner's step phases as ``record_function`` ranges and a
  one-byte marker kernel queued at the end of every step) and reads its chrome trace back.

On CUDA the steps are the spans between consecutive markers (``profile_steps - 1`` whole
steps). Every kernel, memcpy and memset of them gets a class: a group by its name
(attention, gemm, norm, rope, act, quant, moe_align, moe_gemm, topk_router, sampling,
embedding, memcpy, memset, torch_elementwise, other) and, for the GEMV/GEMM kernels (and
the FP8 activation quantization and split-K sums around them), the layer role it plays,
taken from where it falls in the step (Triton's kernel names say nothing of the layer:
qkv, o, gate/up, down, the MoE router and experts all run ``_gemv_kernel``): after a
layer's first RMSNorm ``qkv_proj``, after attention ``o_proj``, after the second RMSNorm
``gate_up_proj`` (``router`` when a top-k kernel follows), after SiLU-and-mul
``down_proj``, after the top-k the MoE passes (the first ``w13``, later ones ``w2``), and
what follows the last RMSNorm with no attention after it ``lm_head``. It returns

* ``kernels``: one row per (kernel name, class): calls per step, GPU us per step, mean us
  per call, share of the busy time; sorted by time;
* ``by_class`` / ``by_group``: the same summed per class (``gemm:qkv_proj``) and per group
  (``gemm``), with us per layer;
* GPU busy us per step against the step's wall time on the GPU clock (marker to marker),
  idle split into between steps (the GPU waiting for the host's next step) and inside
  steps (kernel-to-kernel bubbles; gaps counted and their median), GPU ops and kernels per
  step, CUDA graph launches per step, and host time per runner phase.

CUDA graphs: CUPTI records the kernels of a graph replay one by one (torch 2.x,
``ProfilerActivity.CUDA``), so a decode step replayed from its graph shows every kernel;
nothing in this repository turns that off (gpu_idle.py / tp_profile.py traces with graphs
on counted ~330-470 ops per step). ``cuda_graph_launches_per_step`` says whether the
steps replayed a graph; a warning lands in ``warnings`` when they did but the trace holds
fewer than 4 kernels per layer.

On the CPU (smoke runs) the rows are the CPU ops (``aten::...``) with their self time
(nested ops subtracted), classed by name only (no roles), and busy is the union of the
top-level ops' spans.
"""
from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.gpu_idle import GPU_CATEGORIES
from pyengine.worker.profiler import MARKER_KERNEL  # the step marker's kernel

# groups by name, first match wins (our Triton kernels, torch/cuBLAS/CUTLASS names, aten ops on CPU)
GROUPS = (
    ("marker", re.compile(MARKER_KERNEL)),
    ("moe_align", re.compile(r"_align_(count|offsets|scatter)_kernel|moe_align|align_block_size")),
    ("moe_gemm", re.compile(r"_grouped_kernel|_gemv_down_sum_kernel|_gemv_split_finish_kernel|fused_moe|fused_experts")),
    ("topk_router", re.compile(r"topk_softmax")),
    ("attention", re.compile(r"_decode_split_kernel|_decode_reduce_kernel|_extend_kernel|reshape_and_cache|attn"
                             r"|attention|flash|paged", re.I)),
    ("rope", re.compile(r"_rope|rotary", re.I)),
    ("norm", re.compile(r"rms_?norm|layer_?norm|_norm_kernel", re.I)),
    ("act", re.compile(r"silu|gelu|act_and_mul", re.I)),
    ("quant", re.compile(r"_fp8_quant|quant_fp8|quantize|scaled_fp8", re.I)),
    ("gemm", re.compile(r"gemv|gemm|cutlass|xmma|nvjet|cublas|splitK|_split_sum_kernel|dot_kernel|matmul"
                        r"|^aten::(mm|addmm|bmm|baddbmm|linear)$", re.I)),
    ("sampling", re.compile(r"argmax|multinomial|exponential|sampl|cumsum|gumbel|softmax|sort|topk", re.I)),
    ("embedding", re.compile(r"indexSelect|embedding|index_select", re.I)),
    ("memcpy", re.compile(r"^Memcpy|^aten::(copy_|to|_to_copy)$")),
    ("memset", re.compile(r"^Memset|^aten::(fill_|zero_|zeros)$")),
    ("torch_elementwise", re.compile(r"elementwise|CatArrayBatchedCopy|copy_kernel|reduce_kernel|index_")),
)
LINEAR_GROUPS = ("gemm", "quant")  # the kernels that take a layer role from their place in the step


def base_group(name: str, cat: str = "kernel") -> str:
    if cat == "gpu_memcpy":
        return "memcpy"
    if cat == "gpu_memset":
        return "memset"
    for group, pat in GROUPS:
        if pat.search(name):
            return group
    return "other"


def label_step(events: list[tuple[float, float, str, str]]) -> list[tuple[str, str | None]]:
    """(group, role) of each event of one decode step, in stream order (see the module doc)."""
    out: list[tuple[str, str | None]] = []
    state = "start"  # start, pre_attn, attn_out, post_attn, moe, down
    attn_seen = False
    seg: list[int] = []  # linear kernels since the last norm that no attention has followed yet
    post: list[int] = []  # linear kernels since the post-attention norm (the router, if a top-k follows)
    moe_mains = 0
    for _, _, name, cat in events:
        g = base_group(name, cat)
        role: str | None = None
        if g == "norm":
            state = "post_attn" if attn_seen else "pre_attn"
            attn_seen, seg, post, moe_mains = False, [], [], 0
        elif g == "attention":
            attn_seen, state, seg = True, "attn_out", []
        elif g == "act" and state in ("post_attn", "down"):
            state = "down"
        elif g == "topk_router" or (g == "sampling" and state == "post_attn" and re.search("topk|softmax", name, re.I)):
            g, role, state, moe_mains = "topk_router", "topk", "moe", 0
            for i in post:
                out[i] = ("topk_router", "router")
            post = []
        elif g == "moe_align":
            state = "moe" if state == "post_attn" else state
        elif g in ("moe_gemm",) or (g in LINEAR_GROUPS and state == "moe"):
            if g == "gemm" or re.search("_grouped_kernel|_gemv_down_sum", name):
                moe_mains += 1
            g, role = "moe_gemm", "w13" if moe_mains <= 1 else "w2"
        elif g in LINEAR_GROUPS:
            role = {"start": "unassigned", "pre_attn": "qkv_proj", "attn_out": "o_proj", "post_attn": "gate_up_proj",
                    "down": "down_proj"}[state]
            if state == "pre_attn":
                seg.append(len(out))
            elif state == "post_attn":
                post.append(len(out))
        out.append((g, role))
    for i in seg:  # after the final norm, no attention: the LM head
        out[i] = (out[i][0], "lm_head")
    return out


def load_trace(path: str) -> dict:
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        trace = json.load(f)
    return trace if isinstance(trace, dict) else {"traceEvents": trace}


def _union(iv: list[tuple[float, float]]) -> tuple[float, list[float]]:
    """(busy time, gap lengths) of [start, end) intervals."""
    if not iv:
        return 0.0, []
    iv = sorted(iv)
    busy, gaps = 0.0, []
    cs, ce = iv[0]
    for s, e in iv[1:]:
        if s > ce:
            busy += ce - cs
            gaps.append(s - ce)
            cs, ce = s, e
        else:
            ce = max(ce, e)
    return busy + ce - cs, gaps


def _aggregate(labelled: list[tuple[str, str, str | None, float]], steps: int, busy: float, layers: int) -> dict:
    """Rows per (name, class), per class and per group from (name, group, role, us) tuples."""
    rows: dict = {}
    classes: dict = {}
    groups: dict = {}
    for name, g, role, us in labelled:
        cls = g if role is None else f"{g}:{role}"
        r = rows.setdefault((name, cls), {"name": name[:160], "class": cls, "group": g, "role": role, "calls": 0,
                                          "total_us": 0.0})
        r["calls"] += 1
        r["total_us"] += us
        for d, key in ((classes, cls), (groups, g)):
            c = d.setdefault(key, {"calls": 0, "total_us": 0.0})
            c["calls"] += 1
            c["total_us"] += us

    def per_step(d: dict) -> dict:
        d["calls_per_step"] = d["calls"] / steps
        d["us_per_step"] = d["total_us"] / steps
        d["mean_us"] = d["total_us"] / max(d["calls"], 1)
        d["us_per_layer"] = d["us_per_step"] / max(layers, 1)
        d["share_of_busy"] = d["us_per_step"] / busy if busy > 0 else None
        return d
    out_rows = sorted((per_step(r) for r in rows.values()), key=lambda r: -r["total_us"])
    by_class = dict(sorted(((k, per_step(v)) for k, v in classes.items()), key=lambda kv: -kv[1]["total_us"]))
    by_group = dict(sorted(((k, per_step(v)) for k, v in groups.items()), key=lambda kv: -kv[1]["total_us"]))
    return {"kernels": out_rows, "by_class": by_class, "by_group": by_group}


def analyze_cuda(events: list[dict], layers: int) -> dict:
    gpu = []
    graph_launches = []
    for ev in events:
        if ev.get("ph") != "X":
            continue
        cat = str(ev.get("cat", "")).lower()
        ts, dur = float(ev.get("ts", 0.0)), max(float(ev.get("dur", 0.0)), 0.0)
        if cat in GPU_CATEGORIES:
            gpu.append((ts, ts + dur, str(ev.get("name", "")), cat))
        elif cat in ("cuda_runtime", "cuda_driver") and "GraphLaunch" in str(ev.get("name", "")):
            graph_launches.append(ts)
    gpu.sort(key=lambda g: (g[0], g[1]))
    marks = [g for g in gpu if MARKER_KERNEL in g[2]]
    if len(marks) < 2:
        return {"error": f"{len(marks)} step markers in the trace ({len(gpu)} GPU ops): no whole step"}
    steps = len(marks) - 1
    bounds = [m[0] for m in marks]
    per_step: list[list] = [[] for _ in range(steps)]
    j = 0
    for g in gpu:
        if MARKER_KERNEL in g[2] or g[0] < bounds[0] or g[0] >= bounds[-1]:
            continue
        while g[0] >= bounds[j + 1]:
            j += 1
        per_step[j].append(g)
    labelled = []
    busy_total, inside, gaps_all, between = 0.0, 0.0, [], 0.0
    for k, evs in enumerate(per_step):
        for ev, (group, role) in zip(evs, label_step(evs)):
            labelled.append((ev[2], group, role, ev[1] - ev[0]))
        ws, we = bounds[k], bounds[k + 1]
        busy, gaps = _union([(max(a, ws), min(b, we)) for a, b, _, _ in evs])
        busy_total += busy
        inside += sum(gaps)
        gaps_all += gaps
        between += (we - ws) - busy - sum(gaps)
    window = bounds[-1] - bounds[0]
    busy = busy_total / steps
    agg = _aggregate(labelled, steps, busy, layers)
    ops = sum(len(e) for e in per_step)
    kernels = sum(1 for e in per_step for g in e if g[3] == "kernel")
    res = {
        "device": "cuda", "steps": steps, "wall_us_per_step": window / steps, "gpu_busy_us_per_step": busy,
        "gpu_idle_us_per_step": window / steps - busy, "busy_fraction": busy * steps / window if window else None,
        "idle_between_steps_us_per_step": between / steps, "idle_inside_steps_us_per_step": inside / steps,
        "gaps_inside_per_step": len(gaps_all) / steps,
        "gap_inside_median_us": statistics.median(gaps_all) if gaps_all else 0.0,
        "gap_inside_mean_us": statistics.mean(gaps_all) if gaps_all else 0.0,
        "gpu_ops_per_step": ops / steps, "kernels_per_step": kernels / steps,
        "cuda_graph_launches_per_step": sum(1 for t in graph_launches if bounds[0] <= t < bounds[-1]) / steps,
        **agg,
    }
    return res


def _self_times(ops: list[tuple[float, float, str, object]]) -> list[tuple[str, float, float, float, bool]]:
    """(name, start, end, self time, top-level) of CPU ops, nested ops' time taken off their parents."""
    out: list[list] = []
    by_tid: dict = {}
    for o in ops:
        by_tid.setdefault(o[3], []).append(o)
    for evs in by_tid.values():
        evs.sort(key=lambda o: (o[0], -o[1]))
        stack: list[list] = []  # [end, index into out]
        for s, e, name, _ in evs:
            while stack and s >= stack[-1][0]:
                stack.pop()
            if stack:
                parent = out[stack[-1][1]]
                parent[3] -= e - s
            out.append([name, s, e, e - s, not stack])
            stack.append([e, len(out) - 1])
    return [tuple(o) for o in out]  # type: ignore[misc]


def analyze_cpu(events: list[dict], steps: int, layers: int) -> dict:
    ops = [(float(ev.get("ts", 0.0)), float(ev.get("ts", 0.0)) + max(float(ev.get("dur", 0.0)), 0.0),
            str(ev.get("name", "")), ev.get("tid"))
           for ev in events if ev.get("ph") == "X" and str(ev.get("cat", "")).lower() == "cpu_op"]
    if not ops:
        return {"error": "no CPU ops in the trace"}
    steps = max(steps, 1)
    timed = _self_times(ops)
    busy, gaps = _union([(s, e) for _, s, e, _, top in timed if top])
    agg = _aggregate([(n, base_group(n, "cpu_op"), None, max(st, 0.0)) for n, _, _, st, _ in timed], steps,
                     busy / steps, layers)
    window = max(e for _, e, _, _ in ops) - min(s for s, _, _, _ in ops)
    return {"device": "cpu", "steps": steps, "wall_us_per_step": window / steps, "gpu_busy_us_per_step": busy / steps,
            "gpu_idle_us_per_step": (window - busy) / steps, "busy_fraction": busy / window if window else None,
            "gpu_ops_per_step": len(timed) / steps, "kernels_per_step": len(timed) / steps,
            "note": "CPU run: rows are CPU ops (self time), classed by name only; 'gpu_*' fields mean the host's ops",
            **agg}


def analyze_trace(path: str, cuda: bool, steps: int, layers: int) -> dict:
    events = load_trace(path).get("traceEvents", [])
    return analyze_cuda(events, layers) if cuda else analyze_cpu(events, steps, layers)


# ---- the run -----------------------------------------------------------------------------

def profile_decode(llm, *, input_len: int, profile_steps: int = 20, warmup_steps: int = 8, timed_steps: int = 32,
                   trace_dir: str | None = None, seed: int = 7,
                   prompt_token_ids: list[int] | None = None, tokens_per_step: int = 1) -> dict:
    """Profile ``profile_steps`` batch-1 decode steps of ``llm`` (see the module doc). With
    ``trace_dir`` the chrome trace and the phase file stay there (else a temporary folder,
    removed). ``prompt_token_ids``: the prompt (default: ``input_len`` random ids; a real
    prompt lets a speculative engine's proposer find drafts); ``tokens_per_step``: the most
    tokens a step may emit (k + 1 with k speculative tokens), so the request outlasts the steps.

    Raises ValueError when the prompt and the steps do not fit ``max_model_len``."""
    import torch

    from benchmarks.common import random_prompts
    from pyengine import RequestOutputKind, SamplingParams

    eng = llm.llm_engine
    core = eng.engine_core
    cfg = eng.config
    cuda = cfg.device.type == "cuda"
    hf = cfg.hf_config
    layers = int(getattr(hf, "num_hidden_layers", 0) or 0)
    need = (warmup_steps + timed_steps + profile_steps + 16) * max(tokens_per_step, 1)
    if input_len + need >= cfg.max_model_len:
        raise ValueError(f"{input_len}-token prompt + {need} steps do not fit max_model_len {cfg.max_model_len}")
    prompt = (list(prompt_token_ids) if prompt_token_ids is not None
              else random_prompts(1, input_len, input_len, hf.vocab_size, seed=seed)[0])
    sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=need, detokenize=False,
                        output_kind=RequestOutputKind.DELTA)
    rid = "decode-profile"
    eng.add_request(rid, prompt, sp)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def steps(n: int) -> int:
        toks = 0
        for _ in range(n):
            for out in eng.step():
                toks += sum(len(c.token_ids) for c in out.outputs)
        return toks

    out_dir = trace_dir or tempfile.mkdtemp(prefix="vengine_b1prof_")
    os.makedirs(out_dir, exist_ok=True)
    try:
        for _ in range(64):  # prefill, until the first token is out
            if steps(1):
                break
        steps(warmup_steps)
        sync()
        t0 = time.perf_counter()
        toks = steps(timed_steps)
        sync()
        timed_s = time.perf_counter() - t0
        core.profile(True, out_dir, trace=True)
        t0 = time.perf_counter()
        steps(profile_steps)
        host_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        summary = core.profile(False)
        export_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        res = analyze_trace(summary["trace_file"], cuda, summary["steps"], layers)
        analyze_s = time.perf_counter() - t0
    finally:
        eng.abort_request([rid])
        for _ in range(8):
            if not eng.has_unfinished_requests():
                break
            eng.step()
        if not trace_dir:
            shutil.rmtree(out_dir, ignore_errors=True)
    n_prof = max(summary["steps"], 1)
    res.update({
        "input_len": input_len, "warmup_steps": warmup_steps, "profile_steps": profile_steps,
        "num_layers": layers, "enforce_eager": cfg.enforce_eager, "async_scheduling": cfg.async_scheduling,
        "cuda_graphs": getattr(core.model_executor.driver_runner, "graph_runner", None) is not None,
        "unprofiled": {"steps": timed_steps, "tokens": toks, "wall_us_per_step": 1e6 * timed_s / max(timed_steps, 1),
                       "us_per_token": 1e6 * timed_s / max(toks, 1)},
        "host_wall_us_per_step_profiled": 1e6 * host_s / max(profile_steps, 1),
        "host_phases_us_per_step": {k: v["total_ms"] * 1e3 / n_prof for k, v in summary["phases"].items()},
        "profiler_export_s": export_s, "analyze_s": analyze_s,
        "trace_file": summary["trace_file"] if trace_dir else None,
    })
    warn = []
    if cuda and res.get("cuda_graph_launches_per_step", 0) >= 1 and res.get("kernels_per_step", 0) < 4 * max(layers, 1):
        warn.append(f"{res.get('kernels_per_step', 0):.0f} kernels per step for {layers} layers under CUDA graphs: "
                    "kernels inside the graph replays may be missing from the trace (compare --enforce-eager)")
    if cuda and not res.get("cuda_graph_launches_per_step") and res["cuda_graphs"]:
        warn.append("the engine has CUDA graphs but no graph launch was seen in the profiled steps")
    res["warnings"] = warn
    return res


def add_profile_args(p, prefix: str = "profile") -> None:
    p.add_argument(f"--{prefix}-steps", type=int, default=20, help="decode steps recorded by the profile part")
    p.add_argument(f"--{prefix}-warmup-steps", type=int, default=8, help="decode steps before the profile part's timing")
    p.add_argument(f"--{prefix}-timed-steps", type=int, default=32,
                   help="decode steps the profile part times without the profiler (its wall time per step)")
    p.add_argument("--trace-dir", default=None, help="keep the profile part's chrome traces here (default: not kept)")


# ---- markdown ----------------------------------------------------------------------------

def summary_line(res: dict) -> str:
    if "error" in res:
        return f"error: {res['error']}"
    dev = "GPU" if res.get("device") == "cuda" else "host ops"
    s = (f"{res['steps']} steps: wall {res['wall_us_per_step']:.0f} us/step (unprofiled "
         f"{res['unprofiled']['wall_us_per_step']:.0f}), {dev} busy {res['gpu_busy_us_per_step']:.0f} us/step "
         f"({100 * (res['busy_fraction'] or 0):.1f}%), {res['gpu_ops_per_step']:.0f} ops/step")
    if res.get("device") == "cuda":
        s += (f" ({res['kernels_per_step']:.0f} kernels); idle between steps "
              f"{res['idle_between_steps_us_per_step']:.0f} us, inside {res['idle_inside_steps_us_per_step']:.0f} us "
              f"({res['gaps_inside_per_step']:.0f} gaps, median {res['gap_inside_median_us']:.2f} us); "
              f"graph launches/step {res['cuda_graph_launches_per_step']:.1f}")
    return s


def report_md(title: str, res: dict, top: int = 20) -> str:
    from benchmarks.common import md_table

    lines = [f"#### {title}", "", summary_line(res)]
    if "error" in res:
        return "\n".join(lines)
    for w in res.get("warnings", []):
        lines.append(f"\n**warning**: {w}")
    lines += ["", md_table(["class", "calls/step", "us/step", "us/layer", "share"],
                           [[k, v["calls_per_step"], v["us_per_step"], v["us_per_layer"],
                             f"{100 * (v['share_of_busy'] or 0):.1f}%"] for k, v in res["by_class"].items()]),
              "", md_table(["kernel", "class", "calls/step", "us/step", "mean us"],
                           [[r["name"][:70], r["class"], r["calls_per_step"], r["us_per_step"], r["mean_us"]]
                            for r in res["kernels"][:top]])]
    return "\n".join(lines)


def compare_md(results: dict[str, dict], key: str = "by_group") -> str:
    """us per step of each group (or class) side by side, one column per run."""
    from benchmarks.common import md_table

    ok = {k: v for k, v in results.items() if "error" not in v}
    if not ok:
        return ""
    names: list[str] = []
    for r in ok.values():
        names += [n for n in r[key] if n not in names]
    rows = [["wall us/step"] + [r["wall_us_per_step"] for r in ok.values()],
            ["busy us/step"] + [r["gpu_busy_us_per_step"] for r in ok.values()],
            ["ops/step"] + [r["gpu_ops_per_step"] for r in ok.values()]]
    rows += [[n] + [r[key].get(n, {}).get("us_per_step") for r in ok.values()] for n in names]
    return md_table([key.replace("by_", "") + " (us/step)"] + list(ok), rows)


def write_md(path: str | Path, text: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text + "\n")
