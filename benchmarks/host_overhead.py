"""Host time per engine step, split by phase, with the model forward stubbed out — the
part of a decode step that a GPU cannot hide, measurable on any CPU.

When this host work outgrows the GPU's step time, the GPU idles between decode steps
(docs/benchmarks.md, "GPU idle"), so it can be optimized here and then confirmed on the
GPU. The model is a tiny random Qwen3 on CPU whose forward is replaced by
a constant hidden state; scheduling, input preparation, sampling, the scheduler update
and the output processor run for real.

    python benchmarks/host_overhead.py --batch-sizes 1,64,256 --steps 200 --json out.json

Each phase's figure is its mean per step; ``--quantile 0.1`` reports that quantile of its
per-call times instead (on a shared machine a run's mean moves by a quarter from run to
run, a low quantile far less: compare checkouts by the median of such runs, interleaved).
``--temperature 0`` samples greedily (the stub's constant hidden state then gives one token
id for every row and step).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

from benchmarks.common import command_line, hardware_info, header_md, make_model_dir, md_table, parse_ints, write_json  # noqa: E402


def _timed(obj, name: str, acc: dict, key: str | None = None) -> None:
    """Wrap obj.name so the wall time of each call goes to the list acc[key or name] (seconds)."""
    fn = getattr(obj, name)
    times = acc[key or name]

    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            times.append(time.perf_counter() - t)
    setattr(obj, name, wrapper)


def measure(batch: int, steps: int, async_scheduling: bool, model_dir: str, temperature: float = 0.8,
            quantile: float | None = None) -> dict:
    import torch

    from pyengine import LLM, RequestOutputKind, SamplingParams

    llm = LLM(model_dir, device="cpu", load_format="dummy", max_num_seqs=max(batch, 1),
              max_model_len=steps + 64, async_scheduling=async_scheduling)
    eng = llm.llm_engine
    runner = eng.engine_core.model_runner
    hidden = runner.dims.hidden_size
    # The forward pass is what a GPU does; stub it so only host work is timed.
    runner.model.forward = lambda ids, pos, meta: torch.zeros(ids.shape[0], hidden)
    acc: dict = defaultdict(list)
    sched = eng.engine_core.scheduler
    _timed(sched, "schedule", acc)
    _timed(sched, "update_from_output", acc)
    _timed(runner, "_prepare_inputs", acc)
    if hasattr(runner, "sampling_state"):
        _timed(runner.sampling_state, "metadata", acc)
    else:  # a checkout before the runner's split (89ee766): same phase
        _timed(runner, "_sampling_metadata", acc, "metadata")
    _timed(runner, "sampler", acc)
    _timed(eng.output_processor, "process_outputs", acc)
    sp = SamplingParams(temperature=temperature, max_tokens=steps, ignore_eos=True,
                        output_kind=RequestOutputKind.DELTA)
    for i in range(batch):
        eng.add_request(f"h{i}", [10 + i % 50] * 32, sp)
    for _ in range(5):  # prefill and warm-up
        eng.step()
    for v in acc.values():
        v.clear()
    step_times = []
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        t = time.perf_counter()
        eng.step()
        step_times.append(time.perf_counter() - t)
    wall = time.perf_counter() - t0
    llm.shutdown()
    n = len(step_times)

    def per_step(times: list) -> float:
        if quantile is None:
            return 1e3 * sum(times) / n
        ordered = sorted(times)
        return 1e3 * ordered[min(int(quantile * len(ordered)), len(ordered) - 1)] if ordered else 0.0
    return {"batch": batch, "async": async_scheduling, "steps": n,
            "wall_ms_per_step": 1e3 * wall / n if quantile is None else per_step(step_times),
            **{f"{k}_ms": per_step(v) for k, v in acc.items()}}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", type=parse_ints, default=[1, 64, 256])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--no-async-scheduling", action="store_true")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--quantile", type=float, default=None,
                   help="report this quantile of each phase's per-call times (default: the mean per step)")
    p.add_argument("--json", dest="json_out", default=None)
    args = p.parse_args(argv)
    import tempfile
    model_dir = str(make_model_dir("tiny", os.path.join(tempfile.gettempdir(), "vengine_bench_models", "tiny")))
    if args.quantile is not None and not 0 <= args.quantile <= 1:
        p.error("--quantile must be in [0, 1]")
    rows = [measure(b, args.steps, not args.no_async_scheduling, model_dir, args.temperature, args.quantile)
            for b in args.batch_sizes]
    phases = ["schedule", "_prepare_inputs", "metadata", "sampler", "update_from_output",
              "process_outputs"]
    hw = hardware_info("cpu")
    print(header_md("Host time per decode step (model forward stubbed)", hw, command_line()))
    print(md_table(["batch", "async", "wall ms/step"] + [f"{ph} ms" for ph in phases],
                   [[r["batch"], r["async"], round(r["wall_ms_per_step"], 3)]
                    + [round(r.get(f"{ph}_ms", 0.0), 3) for ph in phases] for r in rows]))
    result = {"benchmark": "host_overhead", "command": command_line(), "hardware": hw, "results": rows}
    write_json(args.json_out, result)
    return result


if __name__ == "__main__":
    main()
