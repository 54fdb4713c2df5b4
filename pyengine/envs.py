"""Every environment variable vengine reads, in one place, with one prefix: ``VENGINE_``
(mirrors vllm/envs.py). vLLM's documented ``VLLM_API_KEY``, ``VLLM_SERVER_DEV_MODE`` and
``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` are read too, as aliases, so vLLM launch scripts keep working.

Read from Python (the accessors below; each reads the environment when called):

| variable | default | meaning |
| --- | --- | --- |
| ``VENGINE_ENABLE_MULTIPROCESSING`` | 1 | engine core in a process of its own (0: a thread of the front end's process); vLLM's ``VLLM_ENABLE_V1_MULTIPROCESSING`` |
| ``VENGINE_MULTIPROC_METHOD`` | fork where sound, else forkserver | how that process starts: ``fork``, ``forkserver`` or ``spawn``. Unset: ``fork`` when the main module is a script (which the others re-run in the child) and this process holds no CUDA context and runs no other threads; else ``forkserver`` (tensor-parallel workers: ``spawn``) |
| ``VENGINE_ASYNC_SCHED`` | 1 | 0 turns async scheduling off process-wide (rollback switch) |
| ``VENGINE_ALLOW_LONG_MAX_MODEL_LEN`` | 0 | 1 accepts a ``max_model_len`` past the model's context length |
| ``VENGINE_DISABLE_TRITON_OPS`` | 0 | 1: plain torch instead of the fused triton ops on CUDA |
| ``VENGINE_SYMM_MEM_ALLREDUCE`` | 1 in an engine-core process of its own, else 0 | 1: tensor parallelism sends small all-reduces through torch's symmetric memory, fused with the residual add and RMSNorm after them (0: all through NCCL); vLLM's ``VLLM_ALLREDUCE_USE_SYMM_MEM``. Off where the engine core is a thread of the front end's process (``VENGINE_ENABLE_MULTIPROCESSING=0``): a second TP engine in one process hangs in torch's rendezvous (docs/benchmarks.md) |
| ``VENGINE_FUSED_ALLREDUCE_RMSNORM`` | 1 | with ``VENGINE_SYMM_MEM_ALLREDUCE=1``: each decoder layer's all-reduces run in one kernel with the residual add and RMSNorm after them (0: separate kernels); the role of vLLM's all-reduce fusion pass |
| ``VENGINE_GRAMMAR_FILL_THREADS`` | 1 | threads filling a step's structured-output token bitmask (xgrammar's ``BatchGrammarMatcher``; more were slower on the H200) |
| ``VENGINE_TORCH_PROFILER_DIR`` | — | where ``EngineCore.profile`` windows write each rank's phase timings and torch.profiler trace when no directory is passed; vLLM's ``VLLM_TORCH_PROFILER_DIR`` |
| ``VENGINE_TP_SHM_BROADCAST`` | 1 | tensor parallelism: rank 0 hands each step to the other ranks of its host through a shared-memory queue (0: two gloo broadcasts over TCP) |
| ``VENGINE_FP8_SCALED_MM`` | 1 | FP8 W8A8 GEMMs with per-row scales (more than one token) through ``torch.nn.functional.scaled_mm`` on GPUs that have it (0: the Triton kernel of pyengine/ops/quant.py) |
| ``VENGINE_PDL`` | 1 | programmatic dependent launch of the decode path's Triton kernels on GPUs that have it (compute capability >= 9.0): a kernel starts while the one before it finishes, prefetching its weights (0: each kernel waits for the last; ``pyengine/ops/pdl.py``) |
| ``VENGINE_PDL_EXCLUDE`` | — | comma-separated names of kernels (``pyengine.ops.pdl.KERNELS``) launched without PDL (measuring one family with and without it) |
| ``VENGINE_DRAFT_CHAIN`` | 1 | 0: a draft model's steady-state proposal runs forward by forward instead of replaying one CUDA graph (``pyengine/spec_decode/draft_chain.py``) |
| ``VENGINE_TRITON_OPS_ON_CPU`` | 0 | 1 (with ``TRITON_INTERPRET=1``): run the triton ops through triton's CPU interpreter (tests) |
| ``VENGINE_API_KEY`` (alias ``VLLM_API_KEY``) | — | ``vengine serve``'s ``--api-key`` when the flag is absent |
| ``VENGINE_SERVER_DEV_MODE`` (alias ``VLLM_SERVER_DEV_MODE``) | 0 | 1 enables development endpoints (``POST /reset_prefix_cache``) |
| ``VENGINE_HTTP_TIMEOUT_KEEP_ALIVE`` (alias ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``) | 5 | ``vengine serve``'s ``--timeout-keep-alive`` when the flag is absent (seconds) |
| ``VENGINE_LOG_STATS_INTERVAL`` (alias ``VLLM_LOG_STATS_INTERVAL``) | 10 | seconds between two engine stats log lines (throughput, queue, KV use) |

Read by the C library (``capi/vengine_capi.c``, docs/capi.md): ``VENGINE_PYTHON`` (the
interpreter to embed), ``VENGINE_PYTHONPATH``, ``VENGINE_DELIVERY_THREADS``,
``VENGINE_DELIVERY_THREADS_MAX``, ``VENGINE_EXIT_TIMEOUT``.
"""
from __future__ import annotations

import os

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _raw(name: str, aliases: tuple[str, ...] = ()) -> str | None:
    for n in (name, *aliases):
        v = os.environ.get(n)
        if v is not None and v.strip():
            return v.strip()
    return None


def _flag(name: str, default: bool, aliases: tuple[str, ...] = ()) -> bool:
    """A boolean variable; ValueError naming it for a value that is neither."""
    v = _raw(name, aliases)
    if v is None:
        return default
    if v.lower() in _TRUE:
        return True
    if v.lower() in _FALSE:
        return False
    raise ValueError(f"{name}={v!r}: use 1 or 0.")


def enable_multiprocessing() -> bool | None:
    """``VENGINE_ENABLE_MULTIPROCESSING``; None when unset (the caller's default)."""
    return None if _raw("VENGINE_ENABLE_MULTIPROCESSING") is None else _flag("VENGINE_ENABLE_MULTIPROCESSING", True)


MULTIPROC_METHODS = ("fork", "forkserver", "spawn")


def multiproc_method() -> str | None:
    """``VENGINE_MULTIPROC_METHOD`` (lower case); None when unset (the caller chooses).
    ValueError naming it for another value."""
    v = _raw("VENGINE_MULTIPROC_METHOD")
    if v is None:
        return None
    if v.lower() not in MULTIPROC_METHODS:
        raise ValueError(f"VENGINE_MULTIPROC_METHOD={v!r}: use one of {', '.join(MULTIPROC_METHODS)}.")
    return v.lower()


def async_scheduling_allowed() -> bool:
    return _flag("VENGINE_ASYNC_SCHED", True)


def allow_long_max_model_len() -> bool:
    return _flag("VENGINE_ALLOW_LONG_MAX_MODEL_LEN", False)


def disable_triton_ops() -> bool:
    return _flag("VENGINE_DISABLE_TRITON_OPS", False)


def symm_mem_allreduce() -> bool:
    return _flag("VENGINE_SYMM_MEM_ALLREDUCE", False)


def fused_allreduce_rmsnorm() -> bool:
    return _flag("VENGINE_FUSED_ALLREDUCE_RMSNORM", True)


def default_symm_mem_allreduce_on() -> None:
    """``VENGINE_SYMM_MEM_ALLREDUCE=1`` unless set: called by the engine-core process's
    main (one engine per process), before it starts any tensor-parallel worker."""
    os.environ.setdefault("VENGINE_SYMM_MEM_ALLREDUCE", "1")


def grammar_fill_threads() -> int | None:
    """``VENGINE_GRAMMAR_FILL_THREADS``; None when unset. ValueError unless a positive integer."""
    v = _raw("VENGINE_GRAMMAR_FILL_THREADS")
    if v is None:
        return None
    if not v.isdigit() or int(v) < 1:
        raise ValueError(f"VENGINE_GRAMMAR_FILL_THREADS={v!r}: use a positive integer.")
    return int(v)


def torch_profiler_dir() -> str | None:
    return _raw("VENGINE_TORCH_PROFILER_DIR")


def tp_shm_broadcast() -> bool:
    return _flag("VENGINE_TP_SHM_BROADCAST", True)


def fp8_scaled_mm() -> bool:
    return _flag("VENGINE_FP8_SCALED_MM", True)


def pdl() -> bool:
    return _flag("VENGINE_PDL", True)


def pdl_exclude() -> tuple[str, ...]:
    """``VENGINE_PDL_EXCLUDE``: comma-separated PDL kernel names launched without it."""
    v = _raw("VENGINE_PDL_EXCLUDE")
    return tuple(x.strip() for x in v.split(",") if x.strip()) if v else ()


def draft_chain() -> bool:
    return _flag("VENGINE_DRAFT_CHAIN", True)


def triton_ops_on_cpu() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1" and _flag("VENGINE_TRITON_OPS_ON_CPU", False)


def api_key() -> str | None:
    return _raw("VENGINE_API_KEY", ("VLLM_API_KEY",))


def server_dev_mode() -> bool:
    return _flag("VENGINE_SERVER_DEV_MODE", False, ("VLLM_SERVER_DEV_MODE",))


def _seconds(name: str, aliases: tuple[str, ...], default: float) -> float:
    """A positive, finite number of seconds, else ``default`` when unset; ValueError
    naming the variable otherwise."""
    v = _raw(name, aliases)
    if v is None:
        return default
    try:
        seconds = float(v)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):  # also NaN
        raise ValueError(f"{name}={v!r}: use a positive number of seconds.")
    return seconds


def http_timeout_keep_alive(default: float) -> float:
    """``VENGINE_HTTP_TIMEOUT_KEEP_ALIVE`` (alias ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``) in
    seconds, else ``default``."""
    return _seconds("VENGINE_HTTP_TIMEOUT_KEEP_ALIVE", ("VLLM_HTTP_TIMEOUT_KEEP_ALIVE",), default)


def log_stats_interval() -> float:
    """``VENGINE_LOG_STATS_INTERVAL`` (alias ``VLLM_LOG_STATS_INTERVAL``) in seconds,
    default 10 as vLLM."""
    return _seconds("VENGINE_LOG_STATS_INTERVAL", ("VLLM_LOG_STATS_INTERVAL",), 10.0)
