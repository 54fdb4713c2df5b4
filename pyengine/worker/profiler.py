"""One rank's profiling window (the role of vllm/v1/worker/gpu_worker.py's ``profile`` and
vllm/profiler): host time per phase of each step, and optionally a torch.profiler trace.

``ModelRunner.start_profile`` opens a window on every tensor-parallel rank (rank 0 sends
the request down the step stream, so the ranks' windows cover the same steps) and
``stop_profile`` closes it; each rank writes its own files into the directory given:

* ``rank{R}-w{W}.phases.json``: per phase, count, total ms and mean µs (``perf_counter``
  laps; the phases are named by the runner: rank 0 ``pack``, ``send``, ``prepare``,
  ``forward``, ``logits``, ``sample``; the other ranks ``recv`` (waiting for the step, then reading it),
  ``prepare``, ``forward``, ``logits``, ``token_bcast``), steps, window wall time;
* ``rank{R}-w{W}.trace.json.gz`` (with ``trace``): the chrome trace, CPU activity (each
  phase is a ``record_function`` range) plus CUDA activity on a GPU, where a one-byte
  marker kernel (``bitwise_not``) is queued at the end of every step so the stream's work
  falls into steps (see benchmarks/gpu_idle.py).

Nothing here runs unless a window is open: the runner checks one attribute per phase.
"""
from __future__ import annotations

import json
import os
import time

import torch

MARKER_KERNEL = "bitwise_not"  # the step marker's kernel name contains this; no engine step runs one


class RankProfiler:
    """A window on rank ``rank``; ``window`` numbers the windows of one engine (file names)."""

    def __init__(self, rank: int, out_dir: str, window: int, trace: bool, device: torch.device):
        self.rank, self.out_dir, self.window, self.trace = rank, out_dir, window, trace
        self.device = device
        self.totals: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.steps = 0
        self._name: str | None = None
        self._t = 0.0
        self._range = None
        self._prof = None
        self._cuda = device.type == "cuda"
        self._marker = torch.zeros(1, dtype=torch.uint8, device=device) if (trace and self._cuda) else None
        os.makedirs(out_dir, exist_ok=True)
        if trace:
            from torch.profiler import ProfilerActivity, profile
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self._cuda else [])
            self._prof = profile(activities=acts)
            self._prof.start()
        self._t0 = time.perf_counter()

    def phase(self, name: str) -> None:
        """End the current phase (if any) and start ``name``."""
        now = time.perf_counter()
        self._close(now)
        self._name, self._t = name, now
        if self._prof is not None:
            self._range = torch.profiler.record_function(name)
            self._range.__enter__()

    def _close(self, now: float) -> None:
        if self._name is None:
            return
        self.totals[self._name] = self.totals.get(self._name, 0.0) + (now - self._t)
        self.counts[self._name] = self.counts.get(self._name, 0) + 1
        self._name = None
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None

    def end_step(self) -> None:
        """The step's last host work is queued: close its phase, mark the stream."""
        self._close(time.perf_counter())
        self.steps += 1
        if self._marker is not None:
            self._marker.bitwise_not_()

    def stop(self) -> dict:
        """Close the window (waits for the device), write this rank's files; returns the summary."""
        self._close(time.perf_counter())
        if self._cuda:
            torch.cuda.synchronize(self.device)
        wall = time.perf_counter() - self._t0
        base = os.path.join(self.out_dir, f"rank{self.rank}-w{self.window}")
        trace_file = None
        if self._prof is not None:
            self._prof.stop()
            trace_file = base + ".trace.json.gz"
            self._prof.export_chrome_trace(trace_file)
            self._prof = None
        steps = max(self.steps, 1)
        summary = {
            "rank": self.rank, "window": self.window, "trace_file": trace_file, "steps": self.steps,
            "wall_s": wall, "device": str(self.device),
            "phases": {n: {"count": self.counts[n], "total_ms": 1e3 * t, "mean_us": 1e6 * t / self.counts[n],
                           "per_step_us": 1e6 * t / steps}
                       for n, t in self.totals.items()},
        }
        with open(base + ".phases.json", "w") as f:
            json.dump(summary, f, indent=1)
        return summary
