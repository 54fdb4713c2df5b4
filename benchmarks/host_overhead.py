"""Host time per engine step, split by phase, with the model forward stubbed out — the
part of a decode step that a GPU cannot hide, measurable on any CPU.

When this host work outgrows the GPU's step time, the GPU idles between decode steps
(docs/benchmarks.md, "GPU idle"), so it can be optimized here and then confirmed on the
GPU. The model is a tiny random Qwen3 on CPU whose forward is replaced by
a constant hidden state; scheduling, input preparation, sampling, the scheduler update
and the output processor run for real.

    python benchmarks/host_overhead.py --batch-sizes 1,64,256 --steps 200 --json out.json
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


def _timed(obj, name: str, acc: dict) -> None:
    """Wrap obj.name so its wall time accumulates in acc[name] (seconds)."""
    fn = getattr(obj, name)

    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[name] += time.perf_counter() - t
    setattr(obj, name, wrapper)


def measure(batch: int, steps: int, async_scheduling: bool, model_dir: str) -> dict:
    import torch

    from pyengine import LLM, RequestOutputKind, SamplingParams

    llm = LLM(model_dir, device="cpu", load_format="dummy", max_num_seqs=max(batch, 1),
              max_model_len=steps + 64, async_scheduling=async_scheduling)
    eng = llm.llm_engine
    runner = eng.engine_core.model_runner
    hidden = runner.dims.hidden_size
    # The forward pass is what a GPU does; stub it so only host work is timed.
    runner.model.forward = lambda ids, pos, meta: torch.zeros(ids.shape[0], hidden)
    acc: dict = defaultdict(float)
    sched = eng.engine_core.scheduler
    _timed(sched, "schedule", acc)
    _timed(sched, "update_from_output", acc)
    _timed(runner, "_prepare_inputs", acc)
    _timed(runner.sampling_state, "metadata", acc)
    _timed(runner, "sampler", acc)
    _timed(eng.output_processor, "process_outputs", acc)
    sp = SamplingParams(temperature=0.8, max_tokens=steps, ignore_eos=True,
                        output_kind=RequestOutputKind.DELTA)
    for i in range(batch):
        eng.add_request(f"h{i}", [10 + i % 50] * 32, sp)
    for _ in range(5):  # prefill and warm-up
        eng.step()
    acc.clear()
    t0 = time.perf_counter()
    n = 0
    while eng.has_unfinished_requests():
        eng.step()
        n += 1
    wall = time.perf_counter() - t0
    llm.shutdown()
    per_step = {k: 1e3 * v / n for k, v in acc.items()}
    return {"batch": batch, "async": async_scheduling, "steps": n, "wall_ms_per_step": 1e3 * wall / n,
            **{f"{k}_ms": v for k, v in per_step.items()}}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", type=parse_ints, default=[1, 64, 256])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--no-async-scheduling", action="store_true")
    p.add_argument("--json", dest="json_out", default=None)
    args = p.parse_args(argv)
    import tempfile
    model_dir = str(make_model_dir("tiny", os.path.join(tempfile.gettempdir(), "vengine_bench_models", "tiny")))
    rows = [measure(b, args.steps, not args.no_async_scheduling, model_dir) for b in args.batch_sizes]
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
