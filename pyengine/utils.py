"""Small process-level helpers."""
from __future__ import annotations

import gc
import inspect
import os
import signal
import sys
import threading

import torch  # loaded before the thread count below (numpy's BLAS pool starts with it)


def freeze_gc_heap() -> None:
    """Collect, then move every object alive now (modules, the model, the tokenizer) into
    the garbage collector's permanent generation, so later collections scan only what
    serving allocates. Serving allocates several objects per token, and full collections
    over the start-up heap (hundreds of thousands of objects with torch and transformers
    loaded) were half the output handler's time on the H200 (docs/benchmarks.md). Mirrors
    vLLM's ``freeze_gc_heap`` after engine start-up."""
    gc.collect()
    gc.freeze()


def unfreeze_gc_heap() -> None:
    """Undo ``freeze_gc_heap`` when an engine shuts down, so what it leaves behind in
    reference cycles can be collected (a process may build many engines, as tests do)."""
    gc.unfreeze()


# ---- starting engine processes (the engine core, tensor-parallel workers) ----------------
# How each start method treats the caller's main module: ``spawn`` and ``forkserver``
# children re-run it (as ``__mp_main__``) before their target, so a script that creates an
# engine outside ``if __name__ == "__main__":`` would create one again in every child;
# ``fork`` children are copies and re-run nothing, but a copy is only sound when this
# process has not loaded the CUDA driver and runs no other threads (a lock held by one, or torch's
# OpenMP pool, which hangs a forked child's first parallel op, stays broken in the copy).
# So, as vLLM does, fork where that re-run would happen and fork is sound; elsewhere the
# configured method, and a child that meets an unguarded main exits with this status,
# which the parent turns into one line naming the guard.
UNGUARDED_MAIN_EXIT_CODE = 78


def _os_thread_count() -> int | None:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # no procfs: threads cannot be counted
        return None


def _native_threads() -> int | None:
    """Threads of this process that Python does not know of (BLAS and OpenMP pools...)."""
    n = _os_thread_count()
    return None if n is None else n - threading.active_count()


# The pools that importing torch (and numpy's OpenBLAS, fork-safe) starts: more than these
# later means a pool started since, e.g. torch's OpenMP threads after a CPU op (one started
# before pyengine was imported passes for one of these). A constant.
_NATIVE_THREADS_AT_IMPORT = _native_threads()


def main_module_rerun_by_spawn() -> bool:
    """Whether ``spawn`` / ``forkserver`` children would re-run this process's main module:
    it is a script file or a ``python -m`` module (not a package's ``__main__``, which
    multiprocessing skips, nor an interactive session or an embedding without one)."""
    main = sys.modules.get("__main__")
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name is not None:
        return not (name == "__main__" or name.endswith(".__main__"))
    return getattr(main, "__file__", None) is not None


def _cuda_driver_loaded() -> bool:
    """Whether the CUDA driver library is mapped into this process: a CUDA runtime call
    loaded it and ran ``cuInit`` (``torch.cuda.is_available()`` does, unless
    ``PYTORCH_NVML_BASED_CUDA_CHECK=1``), after which CUDA fails in a forked child even
    though torch's own context is not initialised."""
    try:
        with open("/proc/self/maps") as f:
            return any("libcuda.so" in line for line in f)
    except OSError:
        return False


def fork_unsafe_reason() -> str | None:
    """Why forking this process now would be unsound (a short phrase), or None."""
    if torch.cuda.is_initialized():
        return "CUDA is initialised in this process"
    if _cuda_driver_loaded():
        return "the CUDA driver is loaded in this process"
    others = [t.name for t in threading.enumerate() if t is not threading.current_thread()
              and not getattr(t, "fork_safe", False)]
    if others:
        return f"other threads run in this process ({', '.join(others[:3])})"
    native = _native_threads()
    if native is None or _NATIVE_THREADS_AT_IMPORT is None:
        return "its threads cannot be counted"
    if native > _NATIVE_THREADS_AT_IMPORT:
        return "a native thread pool runs in this process (torch's CPU threads, after a CPU op)"
    return None


def mark_fork_safe(thread: threading.Thread) -> threading.Thread:
    """Mark ``thread`` as one that a fork may leave behind (it holds no lock the child
    needs: e.g. it only waits on a pipe), so ``fork_unsafe_reason`` ignores it."""
    thread.fork_safe = True
    return thread


def _reimported_main() -> str | None:
    """While this process, a multiprocessing child, re-runs its parent's main module (a
    ``<module>`` frame named ``__mp_main__`` is on the stack: spawn's preparation), that
    module's file; else None."""
    f = inspect.currentframe()
    while f is not None:
        if f.f_code.co_name == "<module>" and f.f_globals.get("__name__") == "__mp_main__":
            return str(f.f_globals.get("__file__") or f.f_code.co_filename)
        f = f.f_back
    return None


def choose_start_method(configured: str | None, fallback: str, prefer_fork: bool = True) -> tuple[str, str]:
    """The ``multiprocessing`` start method for an engine process, and a note for the
    error if its child meets an unguarded main (why fork was not used).

    ``configured``: the method the user set (``VENGINE_MULTIPROC_METHOD``), or None;
    ``fallback``: the method when fork is not chosen. With ``prefer_fork``, fork when the
    main module would be re-run and fork is sound.

    Called in a child that is re-running its parent's main module (the engine created by
    that module's top-level code, with no guard), prints one line to stderr and exits the
    child with ``UNGUARDED_MAIN_EXIT_CODE`` (multiprocessing would refuse the start there
    anyway, with a long traceback and status 1)."""
    rerun = _reimported_main()
    if rerun is not None:
        print(f"vengine: this new process re-ran the main module {rerun}, whose top-level code starts an "
              f"engine again; put that code under `if __name__ == \"__main__\":`", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(UNGUARDED_MAIN_EXIT_CODE)
    if configured is not None:
        return configured, f"VENGINE_MULTIPROC_METHOD={configured}"
    if not prefer_fork or not main_module_rerun_by_spawn():
        return fallback, ""
    why = fork_unsafe_reason()
    return ("fork", "") if why is None else (fallback, f"fork was not used: {why}")


def unguarded_main_message(what: str, method: str, note: str) -> str:
    """One line: ``what`` (e.g. "the engine core process") stopped because the start
    method ``method`` re-ran an unguarded main module; ``note`` from ``choose_start_method``."""
    main = sys.modules.get("__main__")
    where = getattr(main, "__file__", None) or getattr(getattr(main, "__spec__", None), "name", "?")
    return (f"{what} could not start: multiprocessing's {method!r} start re-runs the main module ({where}) in the "
            f"new process, and its top-level code creates an engine again; put that code under "
            f"`if __name__ == \"__main__\":`" + (f" ({note})" if note else ""))


def run_forked(close: list, target, *args) -> None:
    """Target of a forked process: close the copies of the parent's ends (connections,
    pipes: objects with ``close()`` or fds) it inherited, so that the parent's death is
    seen as end of input; drop the parent's SIGINT / SIGTERM handlers (the child is an
    engine process, not a copy of the caller's program: a forkserver child has the
    defaults too); then ``target(*args)``."""
    for c in close:
        try:
            os.close(c) if isinstance(c, int) else c.close()
        except OSError:
            pass
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    target(*args)
