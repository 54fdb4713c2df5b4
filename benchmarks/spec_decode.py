#!/usr/bin/env python3
"""Speculative decoding (issue 27): batch-1 TPOT with speculation on vs off, the mean
acceptance length, and throughput at many streams with the batch-size cutoff.

Parts (``--parts``):

- ``ngram``: the built-in code model (``pyengine/default_model``, or ``--model``) on
  code-editing prompts: a function from the standard library, then the start of the same
  function with one change (a renamed identifier), which the model rewrites; batch 1,
  prompt lookup (``prompt_lookup_min/max``) with ``--k`` drafts.
- ``draft``: a draft-model pair: the target a larger code model trained in this run with
  ``tools/train_default_model.py --tokenizer <built-in model>`` (same vocabulary; or
  ``--target`` given), the built-in 7.6M model drafting; batch 1.
- ``throughput``: ``--streams`` concurrent requests (the code-editing prompts repeated),
  speculation off vs ngram with ``disable_by_batch_size=--cutoff``: output tokens/s.
- ``host``: the host time of a batch-1 step, phase by phase, with the model replaced by a
  teacher-forced stub (``TeacherForcedModel``: the logits of each row are one-hot at the
  token the real model gave there, recorded first), so that speculation accepts exactly
  what it accepts with the real model while the forward costs ~nothing: plain decode (async
  and sync scheduling) against ngram with sync scheduling, whose steps are split into those
  that verified drafts and those that had none, and ngram with async scheduling (the next
  step scheduled with draft placeholders before this one is verified), and the draft model
  (``--draft-k``) with async scheduling, its model stubbed too (``TeacherForcedDraft``: every
  draft accepted) and its drafting through the draft chain (``draft_async``). On CUDA the
  same again with the real model (``*_real`` rows; ``draft_async_real``: the built-in model
  drafting for itself, its chain a CUDA graph): the difference is the device's share of a
  step. ``--host-profile PREFIX`` writes a cProfile of each mode's first run to
  ``PREFIX.MODE.prof``. Runs on CPU too (``--host-clock thread`` on a shared machine).
- ``host_batch``: the host time of a step at ``--streams`` requests (async scheduling,
  the model stubbed), speculation off against ngram configured and cut off
  (``disable_by_batch_size=--cutoff``), phase by phase over the steps with nothing
  waiting, no prefill and at least ``--cutoff`` running; ``--host-profile`` writes a
  cProfile of those steps per mode.
- ``profile``: one batch-1 request on a code-editing prompt, speculation off and ngram on,
  under the engine's profiler (benchmarks/decode_profile.py): kernels, GPU busy vs wall
  time, CUDA graph launches and host phases per step (``--trace-dir`` keeps the traces).

The ngram and draft parts also report ``divergence`` (prompts whose greedy tokens differ
from the first plain run's) and, for those, the plain engine's top logprobs there.

TPOT per request is (last token time - first token time) / (output tokens - 1) from the
engine's RequestMetrics; the reported figure is the mean over requests. Each engine is
built, measured and released before the next one.

    python3 benchmarks/spec_decode.py --json out/spec_decode.json             # H200
    python3 benchmarks/spec_decode.py --device cpu --tiny --parts ngram,draft,throughput   # smoke
    python3 benchmarks/spec_decode.py --device cpu --parts host --num-prompts 4          # host time, CPU
    python3 benchmarks/spec_decode.py --device cpu --parts host_batch --threads 1 --host-clock thread   # 256 streams
"""
from __future__ import annotations

import argparse
import ast
import inspect
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402

# Standard-library modules the code-editing prompts take their functions from.
SOURCE_MODULES = ("textwrap", "shlex", "fnmatch", "glob", "posixpath", "calendar", "string", "difflib",
                  "ipaddress", "csv", "configparser", "argparse")
TARGETS = {"ngram_speedup": 2.0, "draft_speedup": 1.8, "throughput_loss_max": 0.03}


def code_edit_prompts(n: int, min_lines: int = 6, max_lines: int = 30) -> list[str]:
    """``n`` prompts: a top-level or method function of ``SOURCE_MODULES`` (6..30 lines),
    a comment asking for one change (an argument renamed), and the new function's first
    line with that change; the model's best continuation is the old body with the rename."""
    import importlib

    out = []
    for mod_name in SOURCE_MODULES:
        src = inspect.getsource(importlib.import_module(mod_name))
        lines = src.splitlines()
        for node in ast.walk(ast.parse(src)):
            if not isinstance(node, ast.FunctionDef) or not node.args.args:
                continue
            length = node.end_lineno - node.lineno + 1
            if not min_lines <= length <= max_lines:
                continue
            body = "\n".join(lines[node.lineno - 1:node.end_lineno])
            indent = len(body) - len(body.lstrip())
            body = "\n".join(ln[indent:] for ln in body.splitlines())
            arg = next((a.arg for a in node.args.args if a.arg not in ("self", "cls") and len(a.arg) > 1), None)
            if arg is None or not body.splitlines()[0].rstrip().endswith(":"):
                continue  # a header over several lines
            new = arg + "_value"
            first = body.splitlines()[0].replace(arg, new)
            out.append(f"{body}\n\n\n# The same function, with the argument `{arg}` renamed to `{new}`:\n{first}\n")
            if len(out) == n:
                return out
    return out


def _llm(model: str, args, spec: dict | None = None, **kw):
    from pyengine import LLM

    return LLM(model, device=args.device, dtype=common.resolve_dtype(args), speculative_config=spec,
               max_model_len=args.max_model_len, enable_prefix_caching=False, **kw)


def _kv_bytes(args, n_tokens: int) -> dict:
    """Engines that share one GPU at once need a KV size each (the memory profile would
    give the first most of the GPU): room for ``n_tokens`` tokens of the 8-layer built-in
    shape, four times over (the draft model's KV and a larger target)."""
    if args.device != "cuda":
        return {}
    return {"kv_cache_memory_bytes": max(1 << 30, 4 * n_tokens * 8 * 2 * 2 * 64 * 2 * 4)}


def _batch1_one(llm, prompt: str, sp) -> tuple[float | None, list[int]]:
    """One prompt alone (batch 1): (TPOT ms or None for one token, its tokens)."""
    o = llm.generate([prompt], sp, use_tqdm=False)[0]
    c, m = o.outputs[0], o.metrics
    n = len(c.token_ids)
    return ((m.last_token_time - m.first_token_time) / (n - 1) * 1e3 if n > 1 else None), list(c.token_ids)


def _counters(llm) -> tuple[int, int, int]:
    st = llm.llm_engine.get_stats()
    return st.spec_num_drafts, st.spec_num_draft_tokens, st.spec_num_accepted_tokens


def _round_stats(tpots: list[float], toks: list[list[int]], before, after) -> dict:
    drafts, dt, acc = (b - a for a, b in zip(before, after))
    return {"tpot_ms": statistics.mean(tpots) if tpots else 0.0, "output_tokens": sum(len(t) for t in toks),
            "requests": len(toks), "drafts": drafts, "draft_tokens": dt, "accepted_tokens": acc,
            "mean_acceptance_length": 1 + acc / drafts if drafts else None,
            "draft_acceptance_rate": acc / dt if dt else None, "_tokens": toks}


def _on_off(model: str, args, spec: dict, prompts: list[str], more: dict[str, dict] | None = None,
            late: tuple[str, ...] = ()) -> dict:
    """Batch-1 TPOT of speculation off, on (and each of ``more``'s speculative configs):
    every mode's engine is built first and kept, then ``--rounds`` rounds each run every
    prompt on every mode in turn (the order rotating per prompt), so that the modes'
    runs of a round are interleaved prompt by prompt: the host's speed drifts by tens of
    percent over seconds on the H200 machines (12-03: the plain engine at 0.33 and 0.53
    ms/token on the same code minutes apart), which engines built and run one after
    another compared badly. A warm-up pass over every prompt on every engine comes first
    (kernels compiled there, not inside a timed run). Per mode: its best round
    (``tpot_ms``) and every round's (``tpot_runs_ms``); ``speedup`` = best off / best on;
    ``speedup_median``: the median over rounds of that round's off / on; ``sweep`` has
    ``more``'s modes with their speedups over the same off figures.
    ``divergence`` lists each prompt whose greedy tokens differ from the first off round's
    (the run, index, first differing position, both tokens) and ``margins`` the off
    engine's top logprobs at those positions (a bf16 near-tie there is numerics of the
    verify batch shape; a wide gap is a bug). ``late``: modes whose draft model launches
    its chain only after the verification's result is on the host (``early_chain`` off:
    the code before 2026-12-04)."""
    from pyengine import SamplingParams

    modes = {"off": None, "on": spec, **(more or {})}
    sp = SamplingParams(temperature=0, max_tokens=args.output_len)
    engines = {name: _llm(model, args, s, **_kv_bytes(args, 4 * args.max_model_len)) for name, s in modes.items()}
    for name in late:
        engines[name].llm_engine.engine_core.model_runner.drafter.early_chain = False
    runs: dict[str, list[dict]] = {name: [] for name in modes}
    try:
        for llm in engines.values():
            for p in prompts:
                llm.generate([p], sp, use_tqdm=False)
        names = list(modes)
        for _ in range(args.rounds):
            tp = {n: [] for n in names}
            tk = {n: [] for n in names}
            before = {n: _counters(engines[n]) for n in names}
            for i, p in enumerate(prompts):
                for n in names[i % len(names):] + names[:i % len(names)]:
                    t, toks = _batch1_one(engines[n], p, sp)
                    if t is not None:
                        tp[n].append(t)
                    tk[n].append(toks)
            for n in names:
                runs[n].append(_round_stats(tp[n], tk[n], before[n], _counters(engines[n])))
    finally:
        for llm in engines.values():
            common.shutdown_llm(llm)
        engines.clear()
        common.free_cuda()
    ref = runs["off"][0]["_tokens"]
    divergence = []
    for name, rs in runs.items():
        for j, r in enumerate(rs):
            for i, (a, b) in enumerate(zip(ref, r["_tokens"])):
                if a != b:
                    pos = next((t for t, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                    divergence.append({"run": f"{name}{j}", "prompt": i, "position": pos,
                                       "off_token": a[pos] if pos < len(a) else None,
                                       "run_token": b[pos] if pos < len(b) else None,
                                       "off_len": len(a), "run_len": len(b)})
    margins = _margins(model, args, prompts, divergence) if divergence else []
    res = {}
    for name, rs in runs.items():
        res[name] = dict(min(rs, key=lambda r: r["tpot_ms"]))
        res[name]["tpot_runs_ms"] = [r["tpot_ms"] for r in rs]
        res[name].pop("_tokens", None)

    def speedup(name: str) -> float | None:
        return res["off"]["tpot_ms"] / res[name]["tpot_ms"] if res[name]["tpot_ms"] else None

    def paired(name: str) -> float | None:
        r = [a["tpot_ms"] / b["tpot_ms"] for a, b in zip(runs["off"], runs[name]) if b["tpot_ms"]]
        return statistics.median(r) if r else None

    sweep = {name: {"spec_config": modes[name], **res[name], "speedup": speedup(name),
                    "speedup_median": paired(name)} for name in more or {}}
    return {"spec_config": spec, "off": res["off"], "on": res["on"], "greedy_identical": not divergence,
            "divergence": divergence, "margins": margins, "speedup": speedup("on"),
            "speedup_median": paired("on"), "rounds": args.rounds, "sweep": sweep}


def _margins(model: str, args, prompts: list[str], divergence: list[dict], top: int = 5) -> list[dict]:
    """For each diverging (prompt, position) (at most 8): the plain engine's top ``top``
    logprobs at that position, the gap between its first two, and where the other run's
    token ranks."""
    from pyengine import SamplingParams

    seen, rows = set(), []
    llm = _llm(model, args, None)
    try:
        for d in divergence:
            key = (d["prompt"], d["position"])
            if key in seen or len(seen) >= 8 or d["off_token"] is None:
                continue
            seen.add(key)
            sp = SamplingParams(temperature=0, max_tokens=d["position"] + 1, logprobs=top)
            c = llm.generate([prompts[d["prompt"]]], sp, use_tqdm=False)[0].outputs[0]
            lp = c.logprobs[d["position"]] if c.logprobs and len(c.logprobs) > d["position"] else {}
            ranked = sorted(lp.items(), key=lambda kv: -kv[1].logprob)
            vals = [v.logprob for _, v in ranked]
            rows.append({"prompt": d["prompt"], "position": d["position"],
                         "top": [[t, round(v.logprob, 5)] for t, v in ranked],
                         "gap_top2": vals[0] - vals[1] if len(vals) > 1 else None,
                         "run_token_rank": next((r + 1 for r, (t, _) in enumerate(ranked) if t == d["run_token"]), None),
                         "same_token_again": c.token_ids[d["position"]] == d["off_token"]
                         if len(c.token_ids) > d["position"] else None})
    finally:
        common.shutdown_llm(llm)
        del llm
        common.free_cuda()
    return rows


def profile(model: str, args, prompts: list[str]) -> dict:
    """Where a batch-1 step's time goes with speculation off and on (ngram), on a
    code-editing prompt (benchmarks/decode_profile.py's ``profile_decode``: kernels, GPU
    busy vs wall, CUDA graph launches and host phases per step; with speculation on a step
    is a verification and emits up to k + 1 tokens)."""
    from benchmarks.decode_profile import profile_decode

    if args.profile_method == "draft_model":  # the built-in model drafting for itself: a draft step's costs
        spec = {"method": "draft_model", "model": model, "num_speculative_tokens": args.draft_k}
    else:
        spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": args.lookup_min,
                "prompt_lookup_max": args.lookup_max}
    out: dict = {"spec_config": spec}
    for name, s in (("off", None), ("on", spec)):
        llm = _llm(model, args, s)
        try:
            ids = llm.get_tokenizer().encode(prompts[0])
            trace_dir = os.path.join(args.trace_dir, name) if args.trace_dir else None
            out[name] = profile_decode(llm, input_len=len(ids), prompt_token_ids=ids, trace_dir=trace_dir,
                                       tokens_per_step=spec["num_speculative_tokens"] + 1 if s else 1,
                                       profile_steps=args.profile_steps, warmup_steps=8, timed_steps=24)
        finally:
            common.shutdown_llm(llm)
            del llm
            common.free_cuda()
        out[name]["kernels"] = out[name]["kernels"][:25]
    return out


def train_target(args) -> tuple[str, list[str]]:
    """Train the draft pair's target with tools/train_default_model.py (the built-in
    model's tokenizer) into ``--target-out`` for ``--train-minutes`` (or ``--train-steps``);
    returns its directory and the run's summary lines (steps, tokens, held-out perplexity)."""
    from pyengine.config import DEFAULT_MODEL_DIR

    out = args.target_out
    cmd = [sys.executable, str(Path(__file__).resolve().parents[1] / "tools" / "train_default_model.py"),
           "--out", out, "--tokenizer", args.model or str(DEFAULT_MODEL_DIR), "--minutes", str(args.train_minutes),
           "--deadline-minutes", str(args.train_minutes + 1.5), "--n-headers", "4"]
    if args.train_steps:
        cmd += ["--steps", str(args.train_steps)]
    if args.train_compile:
        cmd += ["--compile"]
    if args.tiny:
        cmd += ["--tiny"]
    else:
        cmd += ["--hidden", str(args.target_hidden), "--layers", str(args.target_layers), "--heads",
                str(args.target_hidden // 64), "--kv-heads", str(max(1, args.target_hidden // 128)), "--head-dim", "64",
                "--intermediate", str(args.target_intermediate), "--batch", "32"]
    t0 = time.time()
    print("training the target:", " ".join(cmd), flush=True)
    summary = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            print(line, end="", flush=True)
            if any(key in line for key in ("training:", "trained ", "held-out perplexity", "done:")):
                summary.append(line.strip())
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd)
    print(f"trained in {time.time() - t0:.0f} s", flush=True)
    return out, summary


def _params(model_dir: str) -> int:
    from safetensors import safe_open

    n = 0
    for f in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(f), "pt") as s:
            for k in s.keys():
                n += _prod(s.get_slice(k).get_shape())
    return n


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def throughput(model: str, args, prompts: list[str]) -> dict:
    """Offline throughput at ``args.streams`` requests, speculation off vs ngram with the
    ``disable_by_batch_size`` cutoff: both engines built first and kept, then
    ``args.repeats`` pairs of runs, off then on and on then off in turn (a pair's two runs
    seconds apart: the host's drift, tens of percent over a call, weighs on both alike).
    ``ratio_on_off_paired``: the median over pairs of on / off (the figure the cutoff's
    cost is judged by); ``ratio_on_off``: best on / best off; ``ratio_on_off_median``:
    median on / median off; every run's tok/s is kept (``runs``)."""
    from pyengine import SamplingParams

    reqs = (prompts * (args.streams // max(len(prompts), 1) + 1))[:args.streams]
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": args.lookup_min,
            "prompt_lookup_max": args.lookup_max, "disable_by_batch_size": args.cutoff}
    res: dict = {}
    runs: dict[str, list[float]] = {"off": [], "on": []}
    kv = _kv_bytes(args, args.streams * args.max_model_len)
    engines = {name: _llm(model, args, spec if name == "on" else None, max_num_seqs=max(args.streams, 1), **kv)
               for name in ("off", "on")}
    try:
        for llm in engines.values():
            llm.generate(reqs, sp, use_tqdm=False)  # warm-up: every batch shape of the run
        for r in range(args.repeats):
            for name in (("off", "on") if r % 2 == 0 else ("on", "off")):
                t0 = time.perf_counter()
                outs = engines[name].generate(reqs, sp, use_tqdm=False)
                dt = time.perf_counter() - t0
                n = sum(len(o.outputs[0].token_ids) for o in outs)
                runs[name].append(n / dt)
                if name not in res or n / dt > res[name]["tokens_per_s"]:
                    res[name] = {"output_tokens": n, "seconds": dt, "tokens_per_s": n / dt}
    finally:
        for llm in engines.values():
            common.shutdown_llm(llm)
        engines.clear()
        common.free_cuda()
    res["runs"] = runs
    res["spec_config"] = spec
    res["ratio_on_off"] = res["on"]["tokens_per_s"] / res["off"]["tokens_per_s"]
    res["ratio_on_off_median"] = statistics.median(runs["on"]) / statistics.median(runs["off"])
    res["ratio_on_off_paired"] = statistics.median(a / b for a, b in zip(runs["on"], runs["off"]))
    res["pair_ratios"] = [a / b for a, b in zip(runs["on"], runs["off"])]
    return res


class TeacherForcedModel:
    """Stands in for the model's forward and logits in a batch-1 engine: the hidden state
    of a token row is its position, and a sampled row's logits are one-hot at the token
    that follows that position in ``ref`` (the prompt and the real model's greedy output),
    so greedy decoding replays the real run, speculation included, for a few kernels a step.
    ``install(runner)`` swaps it in (after CUDA-graph capture: ``ModelRunner.forward`` is
    replaced, so no graph of the real model replays)."""

    def __init__(self, vocab_size: int, device):
        self.vocab_size, self.device = vocab_size, device
        self.ref = None  # int64 [L] on the device: the current request's tokens

    def set_reference(self, token_ids: list[int]) -> None:
        import torch

        self.ref = torch.tensor(token_ids, dtype=torch.int64, device=self.device)

    def forward(self, ids, pos, meta):
        return pos.to(dtype=self._float()).unsqueeze(1)

    def compute_logits(self, hidden):
        import torch

        p = (hidden[:, 0].long() + 1).clamp_(max=self.ref.shape[0] - 1)
        logits = torch.zeros(hidden.shape[0], self.vocab_size, dtype=torch.float32, device=hidden.device)
        return logits.scatter_(1, self.ref[p].unsqueeze(1), 1.0)

    @staticmethod
    def _float():
        import torch

        return torch.float32  # positions up to 2^24 exactly

    def install(self, runner) -> None:
        runner.forward = self.forward
        runner.model.compute_logits = self.compute_logits


class TeacherForcedDraft:
    """A draft model's stand-in beside ``TeacherForcedModel``: its hidden state of a row is
    the row's position and its greedy token the reference's next one there, so every draft
    is accepted and the proposer's own host work (the draft chain's staging, its replay or
    eager forwards, the drafts' way into the next step) is what a step costs. ``install``
    swaps it in for the drafter's model (the chain's too; its one-token graphs dropped)."""

    def __init__(self, forcing: TeacherForcedModel):
        self.forcing = forcing

    def __call__(self, ids, pos, meta):
        return self.forcing.forward(ids, pos, meta)

    def compute_greedy(self, hidden):
        ref = self.forcing.ref
        return ref[(hidden[:, 0].long() + 1).clamp_(max=ref.shape[0] - 1)]

    def install(self, drafter) -> None:
        drafter.model = self
        drafter._graphs = None
        if drafter._chain is None:
            drafter.enable_draft_chain()  # (eager off CUDA: the same staging and forwards)
        drafter._chain.model = self
        drafter._chain.graphs.clear()


def _timed(obj, name: str, acc: dict, key: str, clock) -> None:
    """Wrap obj.name so its time on ``clock`` accumulates in acc[key] (seconds)."""
    fn = getattr(obj, name)

    def wrapper(*a, **k):
        t = clock()
        try:
            return fn(*a, **k)
        finally:
            acc[key] += clock() - t
    setattr(obj, name, wrapper)


# --host-clock: wall time, or the engine thread's CPU time (steadier on a shared machine;
# it leaves out time spent waiting, e.g. for the device, unless the wait spins)
HOST_CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


HOST_PHASES = ("schedule", "prepare_inputs", "sampling_metadata", "forward", "sampler", "proposer",
               "sample_rest", "scheduler_update", "output_processor")


def _host_run(model: str, args, spec: dict | None, async_scheduling: bool, refs: list[tuple[list[int], list[int]]],
              stub: bool = True, profile_to: str | None = None) -> dict:
    """Batch-1 decode of each reference (prompt ids, output ids), with the teacher-forced
    stub (``stub``) or the real model: ms per model step of each phase (HOST_PHASES;
    ``forward``: the model's forward and logits, the stub's with ``stub``; ``sample_rest``:
    the sampling call's own work: the device-to-host copy, where the host waits for the
    device, the emitted tokens, the drafts' padding; ``other``: the rest of a step's time),
    counted from each request's first token on, on ``--host-clock``. With sync scheduling
    each engine step is one model step, timed whole: ``verify_step_ms`` for those that
    verified drafts, ``plain_step_ms`` for the others. With ``--host-repeats`` N the
    references run N times and each figure is its smallest run. ``profile_to``: a path for
    a cProfile of the first run's steps (the waits for the device show as the time of the
    calls that wait: an event's ``synchronize``, ``tolist``)."""
    from collections import defaultdict

    from pyengine import SamplingParams

    llm = _llm(model, args, spec, async_scheduling=async_scheduling)
    eng = llm.llm_engine
    core = eng.engine_core
    runner = core.model_runner
    forcing = TeacherForcedModel(runner.dims.vocab_size, runner.device) if stub else None
    if forcing is not None:
        forcing.install(runner)
        if spec is not None and spec["method"] == "draft_model":
            TeacherForcedDraft(forcing).install(runner.drafter)
    acc: dict = defaultdict(float)
    sched = core.scheduler
    clock = HOST_CLOCKS[args.host_clock]
    for obj, name, key in ((sched, "schedule", "schedule"), (sched, "update_from_output", "scheduler_update"),
                           (runner, "_prepare_inputs", "prepare_inputs"),
                           (runner.sampling_state, "metadata", "sampling_metadata"),
                           (runner, "forward", "forward"), (runner.model, "compute_logits", "forward"),
                           (runner, "sampler", "sampler"), (runner, "rejection_sampler", "sampler"),
                           (runner.drafter, "propose", "proposer"), (runner, "_sample", "sample_total"),
                           (eng.output_processor, "process_outputs", "output_processor")):
        if obj is not None:
            _timed(obj, name, acc, key, clock)
    last = {"n": 0, "drafts": False}
    inner = runner.execute_model

    def count(so, *a, **k):
        last["n"] += 1
        last["drafts"] = any(s.spec_token_ids for s in so.scheduled)
        return inner(so, *a, **k)
    runner.execute_model = count
    warm, runs = refs[:1], []
    same = True
    prof = None
    for rep in range(max(args.host_repeats, 1)):
        totals: dict = defaultdict(float)
        steps = tokens = 0
        if profile_to and rep == 0:
            import cProfile
            prof = cProfile.Profile()
        for i, (prompt, out) in enumerate(warm + refs):
            if forcing is not None:
                forcing.set_reference(prompt + out)
            sp = SamplingParams(temperature=0, max_tokens=len(out), ignore_eos=True)
            eng.add_request(f"host{rep}-{i}", prompt, sp)
            got: list[int] = []
            while not got:
                for ro in eng.step():
                    got = list(ro.outputs[0].token_ids)
            snap, m0, n0 = dict(acc), last["n"], len(got)
            if prof is not None and i >= len(warm):
                prof.enable()
            while eng.has_unfinished_requests():
                step_snap = dict(acc) if not async_scheduling else None
                m, t0 = last["n"], clock()
                ros = eng.step()
                dt = clock() - t0
                if step_snap is not None and last["n"] == m + 1:
                    kind = "verify" if last["drafts"] else "plain"
                    totals[f"{kind}_wall"] += dt
                    totals[f"{kind}_steps"] += 1
                    for k, v in acc.items():
                        totals[f"{kind}:{k}"] += v - step_snap.get(k, 0.0)
                totals["wall"] += dt
                for ro in ros:
                    got = list(ro.outputs[0].token_ids)
            if prof is not None:
                prof.disable()
            same &= got == out
            if i < len(warm):
                for k in [k for k in totals]:
                    totals[k] = 0.0
                continue
            steps += last["n"] - m0
            tokens += len(got) - n0
            for k, v in acc.items():
                totals[k] += v - snap.get(k, 0.0)
        for pre in ("", "verify:", "plain:"):
            # (async scheduling: the proposer runs at the start of the next step, outside _sample)
            totals[pre + "sample_rest"] = (totals.pop(pre + "sample_total", 0.0) - totals.get(pre + "sampler", 0.0)
                                           - (0.0 if async_scheduling else totals.get(pre + "proposer", 0.0)))
        runs.append((steps, tokens, totals))
        warm = []
        if prof is not None:
            prof.dump_stats(profile_to)
            prof = None
    stats = eng.get_stats()
    common.shutdown_llm(llm)
    del llm
    common.free_cuda()
    steps, tokens = runs[0][0], runs[0][1]  # (the same in every run)
    best = {k: min(t.get(k, 0.0) for _, _, t in runs) for k in (*HOST_PHASES, "wall", "verify_wall", "plain_wall")}
    ms = {k: 1e3 * best[k] / max(steps, 1) for k in HOST_PHASES}
    wall_ms = 1e3 * best["wall"] / max(steps, 1)
    ms["other"] = max(wall_ms - sum(ms.values()), 0.0)
    kinds: dict = {}
    for kind in ("verify", "plain"):
        n = runs[0][2].get(f"{kind}_steps", 0)
        kinds[f"{kind}_steps"] = int(n)
        kinds[f"{kind}_step_ms"] = 1e3 * best[f"{kind}_wall"] / n if n else None
        if n:
            kp = {k: 1e3 * min(t.get(f"{kind}:{k}", 0.0) for _, _, t in runs) / n for k in HOST_PHASES}
            kp["other"] = max(kinds[f"{kind}_step_ms"] - sum(kp.values()), 0.0)
            kinds[f"{kind}_phases_ms"] = kp
    drafts = stats.spec_num_drafts
    return {"async_scheduling": async_scheduling, "spec": spec is not None, "stub": stub, "steps": steps,
            "output_tokens": tokens, "tokens_per_step": tokens / max(steps, 1), "wall_ms_per_step": wall_ms,
            "wall_ms_per_token": wall_ms * steps / max(tokens, 1), **kinds,
            "host_ms_per_step": wall_ms - ms["forward"] if stub else None,
            "phases_ms_per_step": ms, "tokens_identical": same, "runs": len(runs), "clock": args.host_clock,
            "mean_acceptance_length": 1 + stats.spec_num_accepted_tokens / drafts if drafts else None,
            "draft_acceptance_rate": (stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens
                                      if stats.spec_num_draft_tokens else None)}


class PositionForcedModel:
    """Stands in for the model's forward and logits at any batch size: the logits of a row
    are one-hot at ``table[position + 1]`` (``table``: fixed pseudo-random tokens, one per
    position), so greedy decoding gives every request the same deterministic tokens
    whatever the batch, the scheduling mode or speculation, for a few kernels a step.
    ``install(runner)`` swaps it in as ``TeacherForcedModel.install`` does."""

    def __init__(self, vocab_size: int, max_len: int, device, seed: int = 0):
        import torch

        g = torch.Generator().manual_seed(seed)
        # token 0 is EOS in the built-in model; ignore_eos makes that moot, still keep it out
        self.table = torch.randint(1, vocab_size, (max_len + 2,), generator=g).to(device)
        self.vocab_size = vocab_size

    def forward(self, ids, pos, meta):
        import torch

        return pos.to(dtype=torch.float32).unsqueeze(1)

    def compute_logits(self, hidden):
        import torch

        p = (hidden[:, 0].long() + 1).clamp_(max=self.table.shape[0] - 1)
        logits = torch.zeros(hidden.shape[0], self.vocab_size, dtype=torch.float32, device=hidden.device)
        return logits.scatter_(1, self.table[p].unsqueeze(1), 1.0)

    def install(self, runner) -> None:
        runner.forward = self.forward
        runner.model.compute_logits = self.compute_logits


class BatchTeacherForcedModel:
    """``TeacherForcedModel`` for a batch: request ``rid`` replays the reference
    ``refs[ref_of(rid)]`` (its prompt and the real model's greedy output), each row's
    logits one-hot at the reference's token after that row's position. The runner's
    ``_prepare_inputs`` is wrapped to note the step's requests (nothing more), and the
    stub's forward gives each token row (position, reference index)."""

    def __init__(self, refs: list[list[int]], vocab_size: int, device, ref_of):
        import torch

        width = max(len(r) for r in refs)
        self.table = torch.tensor([r + [r[-1]] * (width - len(r)) for r in refs], dtype=torch.int64, device=device)
        self.vocab_size, self.device, self.ref_of = vocab_size, device, ref_of
        self._so = None

    def forward(self, ids, pos, meta):
        import torch

        rows = []
        for s in self._so.scheduled:
            rows += [self.ref_of(s.request.request_id)] * s.num_new_tokens
        r = torch.tensor(rows, dtype=torch.float32, device=pos.device)
        return torch.stack((pos.to(dtype=torch.float32), r), 1)

    def compute_logits(self, hidden):
        import torch

        p = (hidden[:, 0].long() + 1).clamp_(max=self.table.shape[1] - 1)
        tok = self.table[hidden[:, 1].long(), p]
        logits = torch.zeros(hidden.shape[0], self.vocab_size, dtype=torch.float32, device=hidden.device)
        return logits.scatter_(1, tok.unsqueeze(1), 1.0)

    def install(self, runner) -> None:
        prepare = runner._prepare_inputs

        def noting(so):
            self._so = so
            return prepare(so)
        runner._prepare_inputs = noting
        runner.forward = self.forward
        runner.model.compute_logits = self.compute_logits


BATCH_HOST_PHASES = ("schedule", "prepare_inputs", "sampling_metadata", "forward", "sampler", "sample_rest",
                     "scheduler_update", "output_processor")


def _batch_host_run(model: str, args, spec: dict | None, reqs: list[tuple[list[int], int]], profile_to=None,
                    refs: list[list[int]] | None = None) -> dict:
    """One engine (async scheduling) with the position-forced stub running every request
    of ``reqs`` ((prompt ids, max_tokens), all added at once, greedy, ignore_eos) for
    ``--host-repeats`` passes: ms per engine step of each phase (``BATCH_HOST_PHASES``;
    ``other``: the rest of ``LLMEngine.step``) over the *steady* steps only — nothing
    waiting, no request in prefill and at least ``--cutoff`` running, so with speculation
    configured every one of them is cut off — on ``--host-clock``; each figure the smallest
    over the passes. Also the whole pass's ms/step and the tokens (identical across modes).
    ``profile_to``: a path for a cProfile of the steady steps of the last pass."""
    from collections import defaultdict

    from pyengine import SamplingParams

    llm = _llm(model, args, spec, async_scheduling=True, max_num_seqs=max(len(reqs), 1),
               num_gpu_blocks_override=args.host_kv_blocks)
    eng = llm.llm_engine
    core = eng.engine_core
    runner, sched = core.model_runner, core.scheduler
    if refs is None:
        PositionForcedModel(runner.dims.vocab_size, args.max_model_len, runner.device).install(runner)
    else:  # request "b<pass>-<i>" replays refs[i % len(refs)]
        BatchTeacherForcedModel(refs, runner.dims.vocab_size, runner.device,
                                lambda rid: int(rid.rsplit("-", 1)[1]) % len(refs)).install(runner)
    acc: dict = defaultdict(float)
    clock = HOST_CLOCKS[args.host_clock]
    for obj, name, key in ((sched, "schedule", "schedule"), (sched, "update_from_output", "scheduler_update"),
                           (runner, "_prepare_inputs", "prepare_inputs"),
                           (runner.sampling_state, "metadata", "sampling_metadata"),
                           (runner, "forward", "forward"), (runner.model, "compute_logits", "forward"),
                           (runner, "sampler", "sampler"), (runner, "_sample", "sample_total"),
                           (eng.output_processor, "process_outputs", "output_processor")):
        _timed(obj, name, acc, key, clock)
    spec_steps = [0, 0]  # speculative launches, all launches
    inner = runner.execute_model

    def count(so, *a, **k):
        spec_steps[0] += bool(so.speculative)
        spec_steps[1] += 1
        return inner(so, *a, **k)
    runner.execute_model = count
    prof = None
    runs, outputs = [], None
    for rep in range(max(args.host_repeats, 1) + 1):  # (the first pass warms up)
        totals: dict = defaultdict(float)
        steady = steps = 0
        got: dict[str, list[int]] = {}
        for i, (prompt, n) in enumerate(reqs):
            eng.add_request(f"b{rep}-{i}", prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        if profile_to and rep == args.host_repeats:
            import cProfile
            prof = cProfile.Profile()
        while eng.has_unfinished_requests():
            is_steady = (not len(sched.waiting) and len(sched.running) >= args.cutoff
                         and all(r.num_computed_tokens >= r.num_prompt_tokens for r in sched.running))
            snap, t0, launched = dict(acc), clock(), spec_steps[1]
            if prof is not None and is_steady:
                prof.enable()
            ros = eng.step()
            if prof is not None and is_steady:
                prof.disable()
            dt = clock() - t0
            steps += 1
            totals["no_launch"] += launched == spec_steps[1]  # (a step that only waited for the batch in flight)
            totals["wall_all"] += dt
            if is_steady:
                steady += 1
                totals["wall"] += dt
                for k, v in acc.items():
                    totals[k] += v - snap.get(k, 0.0)
            for ro in ros:
                got[ro.request_id.split("-", 1)[1]] = list(ro.outputs[0].token_ids)
        totals["sample_rest"] = totals.pop("sample_total", 0.0) - totals.get("sampler", 0.0)
        if rep:
            runs.append((steady, steps, totals))
        outputs = got
    stats = eng.get_stats()
    if prof is not None:
        prof.dump_stats(profile_to)
    common.shutdown_llm(llm)
    del llm
    common.free_cuda()
    steady, steps = runs[0][0], runs[0][1]
    best = {k: min(t.get(k, 0.0) for _, _, t in runs) for k in (*BATCH_HOST_PHASES, "wall", "wall_all")}
    ms = {k: 1e3 * best[k] / max(steady, 1) for k in BATCH_HOST_PHASES}
    wall = 1e3 * best["wall"] / max(steady, 1)
    ms["other"] = max(wall - sum(ms.values()), 0.0)
    return {"spec": spec is not None, "steady_steps": steady, "steps": steps, "ms_per_steady_step": wall,
            "ms_total": 1e3 * best["wall_all"], "steps_without_launch": int(runs[0][2]["no_launch"]),
            "ms_per_step_all": 1e3 * best["wall_all"] / max(steps, 1), "phases_ms_per_step": ms,
            "steady_step_counts": sorted({s for s, _, _ in runs}), "clock": args.host_clock, "runs": len(runs),
            "spec_num_drafts": stats.spec_num_drafts, "speculative_steps": spec_steps[0], "_outputs": outputs}


def host_batch(model: str, args, prompts: list[str]) -> dict:
    """The ``host_batch`` part: ``--streams`` requests, greedy, ignore_eos, async
    scheduling, all added at once, with the model stubbed: speculation off against ngram
    configured with ``disable_by_batch_size=--cutoff`` (so cut off in every steady step),
    engines built in turn ``--host-alternations`` times (off, cut off, cut off, off, ...);
    each mode's figures are the smallest over its runs. ``--host-batch-prompts code``
    (default): the throughput part's requests (the code-editing prompts repeated,
    ``--output-len`` tokens), each replaying the real model's greedy output, recorded
    first (``BatchTeacherForcedModel``); ``random``: ``--host-prompt-len`` random prompt
    tokens and 64..``--output-len`` output tokens spread evenly (``PositionForcedModel``).
    Checks that both modes give the same tokens."""
    import random

    n = max(args.streams, 1)
    refs = None
    if args.host_batch_prompts == "code":  # the throughput part's requests, replayed
        from pyengine import SamplingParams

        llm = _llm(model, args, None)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True),
                            use_tqdm=False)
        refs = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]
        common.shutdown_llm(llm)
        del llm
        common.free_cuda()
        reqs = [(list(outs[i % len(outs)].prompt_token_ids), args.output_len) for i in range(n)]
    else:
        rng = random.Random(0)
        lo = min(64, args.output_len)
        reqs = [([rng.randrange(1, 8192) for _ in range(args.host_prompt_len)],
                 lo + (i * (args.output_len - lo)) // max(n - 1, 1)) for i in range(n)]
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": args.lookup_min,
            "prompt_lookup_max": args.lookup_max, "disable_by_batch_size": args.cutoff}
    modes = {"off": None, "cutoff": spec}
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for a in range(max(args.host_alternations, 1)):
        for name, s in (modes.items() if a % 2 == 0 else reversed(modes.items())):  # (ABBA: no order bias)
            prof = (f"{args.host_profile}.{name}.prof" if args.host_profile and a == 0 else None)
            runs[name].append(_batch_host_run(model, args, s, reqs, prof, refs))
    ref = runs["off"][0]["_outputs"]
    identical = all(r["_outputs"] == ref for rs in runs.values() for r in rs)
    rows = {}
    for name, rs in runs.items():
        r = dict(rs[0])
        r.pop("_outputs")
        r["ms_per_steady_step"] = min(x["ms_per_steady_step"] for x in rs)
        r["ms_per_step_all"] = min(x["ms_per_step_all"] for x in rs)
        r["ms_total"] = min(x["ms_total"] for x in rs)
        r["phases_ms_per_step"] = {k: min(x["phases_ms_per_step"][k] for x in rs) for k in (*BATCH_HOST_PHASES, "other")}
        r["ms_per_steady_step_runs"] = [x["ms_per_steady_step"] for x in rs]
        rows[name] = r

    def r3(x):
        return round(x, 3)
    heads = (["mode", "steps", "steady steps", "ms (all steps)", "ms/step (all)", "ms/step (steady)"]
             + list(BATCH_HOST_PHASES) + ["other"])
    table = [[name, r["steps"], r["steady_steps"], round(r["ms_total"], 1), r3(r["ms_per_step_all"]),
              r3(r["ms_per_steady_step"])]
             + [r3(r["phases_ms_per_step"][k]) for k in (*BATCH_HOST_PHASES, "other")] for name, r in rows.items()]
    print(common.md_table(heads, table), flush=True)
    print("tokens identical:", identical, "| speculative steps, drafts (all passes of a run):",
          {m: (r["speculative_steps"], r["spec_num_drafts"]) for m, r in rows.items()},
          "| engine steps that launched nothing (a pass):", {m: r["steps_without_launch"] for m, r in rows.items()},
          "| steady ms/step runs:",
          {m: [r3(x) for x in r["ms_per_steady_step_runs"]] for m, r in rows.items()}, flush=True)
    return {"spec_config": spec, "tokens_identical": identical, **rows}


def host_phases(model: str, args, prompts: list[str]) -> dict:
    """The ``host`` part: record the real model's greedy outputs, then time plain decode
    (async and sync scheduling) and ngram speculation on them with the teacher-forced stub,
    and on CUDA (or with ``--host-real``) with the real model too."""
    from pyengine import SamplingParams

    llm = _llm(model, args, None)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.output_len), use_tqdm=False)
    refs = [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outs]
    common.shutdown_llm(llm)
    del llm
    common.free_cuda()
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": args.lookup_min,
            "prompt_lookup_max": args.lookup_max}
    rows = {}
    draft = {"method": "draft_model", "model": model, "num_speculative_tokens": args.draft_k}
    for stub in (True, False) if args.device == "cuda" or args.host_real else (True,):
        tag = "" if stub else "_real"

        def prof(name: str) -> str | None:
            return f"{args.host_profile}.{name}.prof" if args.host_profile else None
        rows["plain_async" + tag] = _host_run(model, args, None, True, refs, stub, prof("plain_async" + tag))
        rows["plain_sync" + tag] = _host_run(model, args, None, False, refs, stub, prof("plain_sync" + tag))
        rows["ngram" + tag] = _host_run(model, args, spec, False, refs, stub, prof("ngram" + tag))
        rows["ngram_async" + tag] = _host_run(model, args, spec, True, refs, stub, prof("ngram_async" + tag))
        # (the real row: the built-in model drafting for itself, its chain replayed as a CUDA graph)
        rows["draft_async" + tag] = _host_run(model, args, draft, True, refs, stub, prof("draft_async" + tag))

    def r3(x):
        return None if x is None else round(x, 3)
    heads = ["mode", "steps", "tokens/step", "ms/token", "ms/step"] + list(HOST_PHASES) + ["other"]
    table = []
    for name, r in rows.items():
        table.append([name, r["steps"], r3(r["tokens_per_step"]), r3(r["wall_ms_per_token"]), r3(r["wall_ms_per_step"])]
                     + [r3(r["phases_ms_per_step"][k]) for k in (*HOST_PHASES, "other")])
        if r["spec"]:
            for kind in ("verify", "plain"):
                if r.get(f"{kind}_phases_ms"):
                    table.append([f"{name}: {kind} steps", r[f"{kind}_steps"], "", "", r3(r[f"{kind}_step_ms"])]
                                 + [r3(r[f"{kind}_phases_ms"][k]) for k in (*HOST_PHASES, "other")])
    print(common.md_table(heads, table), flush=True)
    return {"spec_config": spec, **rows}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="ngram,draft,throughput")
    p.add_argument("--model", default=None, help="the code model (default: the built-in one)")
    p.add_argument("--target", default=None, help="the draft pair's target (default: trained here)")
    p.add_argument("--target-out", default="/tmp/spec_target", help="where the trained target goes")
    p.add_argument("--train-minutes", type=float, default=3.0)
    p.add_argument("--train-steps", type=int, default=0, help="a fixed step count instead of --train-minutes")
    p.add_argument("--train-compile", action="store_true", help="train the target with its layers compiled")
    # At batch 1 on an H200 both models are launch-bound: a forward costs about its layer
    # count, whatever its width, so the target's depth sets the pair's cost ratio
    p.add_argument("--target-layers", type=int, default=16, help="the trained target's layers")
    p.add_argument("--target-hidden", type=int, default=512, help="its hidden size (heads of 64; kv heads: half)")
    p.add_argument("--target-intermediate", type=int, default=1536, help="its MLP width")
    p.add_argument("--k", type=int, default=8, help="num_speculative_tokens (ngram)")
    p.add_argument("--k-sweep", type=lambda v: [int(x) for x in v.split(",") if x.strip()], default=[],
                   help="ngram part: more num_speculative_tokens values, comma-separated, measured in the same run")
    p.add_argument("--draft-k", type=int, default=4, help="num_speculative_tokens (draft model)")
    p.add_argument("--late-chain", action="store_true",
                   help="draft part: also the draft-k engine with its chain launched only after the "
                        "verification's result is on the host (on_late)")
    p.add_argument("--draft-k-sweep", type=lambda v: [int(x) for x in v.split(",") if x.strip()], default=[],
                   help="more draft-model k values, run in the same pass against the same plain figure")
    p.add_argument("--rounds", type=int, default=3,
                   help="ngram / draft parts: rounds over the prompts, the modes' engines kept and interleaved")
    p.add_argument("--lookup-min", type=int, default=2)
    p.add_argument("--lookup-max", type=int, default=5)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--cutoff", type=int, default=32, help="disable_by_batch_size of the throughput part")
    p.add_argument("--repeats", type=int, default=8,
                   help="throughput part: pairs of runs, off and on, on the two engines kept alive")
    p.add_argument("--host-clock", choices=sorted(HOST_CLOCKS), default="wall",
                   help="the host part's clock: wall time, or the engine thread's CPU time")
    p.add_argument("--host-real", action="store_true", help="host part: also with the real model (on CUDA always)")
    p.add_argument("--host-repeats", type=int, default=1,
                   help="host part: runs per mode; each phase's figure is its smallest over the runs")
    p.add_argument("--host-prompt-len", type=int, default=128, help="host_batch part: prompt tokens per request")
    p.add_argument("--host-batch-prompts", choices=("code", "random"), default="code",
                   help="host_batch part: the code-editing prompts (as the throughput part, each replaying the "
                        "real model's greedy output) or random prompts of --host-prompt-len tokens, 64..--output-len out")
    p.add_argument("--host-kv-blocks", type=int, default=16384, help="host_batch part: KV blocks (no preemption)")
    p.add_argument("--host-alternations", type=int, default=2,
                   help="host_batch part: off / cut-off engines built in turn this many times")
    p.add_argument("--host-profile", default=None,
                   help="host / host_batch parts: write cProfile stats of the first run's steps to PREFIX.MODE.prof")
    p.add_argument("--tiny", action="store_true", help="a CPU smoke run: a tiny target, few tokens")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--dtype", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--profile-steps", type=int, default=12, help="profile part: steps recorded")
    p.add_argument("--trace-dir", default=None, help="profile part: keep the chrome traces here")
    p.add_argument("--profile-method", choices=("ngram", "draft_model"), default="ngram",
                   help="profile part: the proposer (draft_model: the built-in model drafting for itself)")
    p.add_argument("--json", dest="json_out", default=None)
    args, hw, cmd = common.start(p, argv, "spec_decode.py")
    if args.tiny:  # the tiny target's context is 256 tokens (the prompts ~180)
        args.max_model_len, args.output_len = min(args.max_model_len, 256), min(args.output_len, 64)
    from pyengine.config import DEFAULT_MODEL_DIR

    model = args.model or str(DEFAULT_MODEL_DIR)
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    prompts = code_edit_prompts(args.num_prompts)
    fields: dict = {"prompts": len(prompts), "targets": TARGETS}
    if "ngram" in parts:
        spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": args.lookup_min,
                "prompt_lookup_max": args.lookup_max}
        more = {f"on_k{k}": {**spec, "num_speculative_tokens": k} for k in args.k_sweep if k != args.k}
        fields["ngram"] = _on_off(model, args, spec, prompts, more)
        print("ngram:", {k: v for k, v in fields["ngram"].items() if k != "spec_config"}, flush=True)
    if "draft" in parts:
        target, training = (args.target, []) if args.target else train_target(args)
        spec = {"method": "draft_model", "model": model, "num_speculative_tokens": args.draft_k}
        more = {f"on_k{k}": {**spec, "num_speculative_tokens": k} for k in args.draft_k_sweep if k != args.draft_k}
        late = ()
        if args.late_chain:
            more["on_late"] = spec
            late = ("on_late",)
        fields["draft"] = _on_off(target, args, spec, prompts, more, late)
        fields["draft"]["target_params"] = _params(target)
        fields["draft"]["draft_params"] = _params(model)
        fields["draft"]["target_training"] = training
        print("draft:", {k: v for k, v in fields["draft"].items() if k != "spec_config"}, flush=True)
    if "host" in parts:
        fields["host"] = host_phases(model, args, prompts)
    if "host_batch" in parts:
        fields["host_batch"] = host_batch(model, args, prompts)
    if "profile" in parts:
        fields["profile"] = profile(model, args, prompts)
        print("profile:", {m: {k: v for k, v in r.items() if k not in ("kernels", "by_class", "by_group")}
                           for m, r in fields["profile"].items() if m != "spec_config"}, flush=True)
    if "throughput" in parts:
        fields["throughput"] = throughput(model, args, prompts)
        print("throughput:", fields["throughput"], flush=True)
    return common.finish("spec_decode", args, hw, cmd, **fields)


if __name__ == "__main__":
    main()
