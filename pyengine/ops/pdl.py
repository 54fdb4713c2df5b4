"""Programmatic dependent launch (PDL) for the decode path's Triton kernels (the role of
FlashInfer's and SGLang's ``enable_pdl`` launches under vLLM's CUDA graphs).

A batch-1 decode step is ~330 kernels (~10 a decoder layer), most of them a few
microseconds long, so the ~1-2 us between one kernel's end and the next one's first
load is a large share of the step. With PDL (compute capability >= 9.0) a kernel
launched with ``launch_pdl=True`` may start while the kernel before it in the stream
still runs: from the moment every program of that kernel has executed
``griddepcontrol.launch_dependents``. Until it executes ``griddepcontrol.wait`` it
must neither read what earlier kernels write nor write anything; after the wait every
earlier kernel has finished and its writes are visible. So each kernel here:

* signals ``gdc_launch_dependents`` first (its successor may be scheduled onto the SMs
  its own programs leave free, e.g. a GEMV's last, partial wave);
* loads what no kernel writes -- weights, weight scales, biases -- before ``gdc_wait``
  (a GEMV's first chunks: its HBM reads start during the previous kernel), and
  everything else, and every store, after it.

Only small launches use it: at most ``MAX_ROWS`` rows (tokens, or a fused-MoE pass's
token-expert pairs) in the tensor a launch is keyed on, the launch-latency-bound decode
steps it is for; larger launches keep the path measured before it. On the H200 PDL made
batch-1 decode 2-8% faster (bf16 and MoE the most); offline bf16 and MoE throughput at 256
in flight measured 4-6% lower with it, but each PDL run went first on a fresh machine, so
Triton compiled in its timed run what the other reused (FP8's, second in each process,
was equal): not separated (docs/benchmarks.md, 2026-12-04), and the cut is not swept.

Kernels take a ``PDL: tl.constexpr``; ``launch_kwargs(t, name)`` gives a launch both it
and the ``launch_pdl`` option (``{"PDL": False}`` where PDL is off: a non-CUDA tensor, an
older GPU, the interpreter, ``VENGINE_PDL=0``, more than ``MAX_ROWS`` rows, or ``name`` listed in
``VENGINE_PDL_EXCLUDE``, the benchmarks' way to measure one kernel family with and
without it; names: ``KERNELS``). The wait is safe in a kernel launched
without PDL, and a kernel launched without it (cuBLAS, torch's) waits for the whole
previous kernel as usual, so PDL and non-PDL kernels mix freely, eagerly and in CUDA
graphs (stream capture records the programmatic edges; CUDA >= 12.3).
"""
from __future__ import annotations

import functools
import os

import torch

from pyengine import envs

__all__ = ["KERNELS", "MAX_ROWS", "enabled", "launch_kwargs"]

# the PDL-aware kernels, by the names VENGINE_PDL_EXCLUDE takes
KERNELS = ("gemv", "fp8_gemv", "fp8_gemv_stream", "int_gemv", "int_gemv_stream", "split_sum", "rms_norm", "silu_and_mul",
           "rope", "rope_and_cache", "decode", "decode_reduce", "topk_softmax", "moe_gemv", "moe_down_sum", "moe_finish")

MAX_ROWS = 16  # decode of up to 16 requests (a batch-1 MoE step's down pass: top_k = 8 pairs)
_OFF = {"PDL": False}
_ON = {"PDL": True, "launch_pdl": True}


@functools.cache
def _device_has_pdl(device_index: int) -> bool:
    """Compute capability >= 9.0, this Triton can emit griddepcontrol, PDL not turned off
    (``VENGINE_PDL=0``; read once a process) and not under ``TRITON_INTERPRET``."""
    if os.environ.get("TRITON_INTERPRET") == "1" or not envs.pdl():
        return False
    try:
        from triton.language.extra import cuda as tl_cuda
    except ImportError:
        return False
    if not hasattr(tl_cuda, "gdc_wait") or not hasattr(tl_cuda, "gdc_launch_dependents"):
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


@functools.cache
def _excluded(name: str) -> bool:
    """``name`` is in ``VENGINE_PDL_EXCLUDE`` (read once a name); ValueError for a name, or a
    listed one, not in ``KERNELS``."""
    if name not in KERNELS:
        raise ValueError(f"unknown PDL kernel name {name!r}")
    excluded = envs.pdl_exclude()
    unknown = [x for x in excluded if x not in KERNELS]
    if unknown:  # a misspelt name would otherwise leave that kernel on without a word
        raise ValueError(f"VENGINE_PDL_EXCLUDE: unknown kernel name(s) {', '.join(map(repr, unknown))}; "
                         f"known: {', '.join(KERNELS)}")
    return name in excluded


def enabled(t: torch.Tensor, name: str) -> bool:
    """Whether kernel ``name`` (one of ``KERNELS``) launches with PDL for ``t`` (its rows:
    ``t.shape[0]``)."""
    # (the cheap tests first: an eager prefill's launches, many a step, stop at the row count)
    if _excluded(name) or not t.is_cuda or (t.dim() and t.shape[0] > MAX_ROWS):
        return False
    index = t.device.index
    return _device_has_pdl(index if index is not None else torch.cuda.current_device())


def launch_kwargs(t: torch.Tensor, name: str) -> dict:
    """Keyword arguments for the launch of PDL-aware kernel ``name`` keyed on ``t``: its
    ``PDL`` constexpr, and Triton's ``launch_pdl`` option when on (shared dicts: do not
    mutate)."""
    return _ON if enabled(t, name) else _OFF
