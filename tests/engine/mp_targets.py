"""Engine-core process mains for tests of the multi-process client: importable by the
engine process (they are passed to ``MPClient`` by reference), each patches one thing
and then runs the real ``run_engine_core``."""
from __future__ import annotations

from pyengine.engine.core_proc import run_engine_core


def run_with_faulty_step(config, conn, log_level):
    """The model runner raises from its sixth step on (a CUDA error, say)."""
    from pyengine.worker.model_runner import ModelRunner

    orig = ModelRunner.execute_model
    calls = {"n": 0}

    def boom(self, *a, **k):
        calls["n"] += 1
        if calls["n"] > 5:
            raise RuntimeError("injected failure in the engine process")
        return orig(self, *a, **k)
    ModelRunner.execute_model = boom
    run_engine_core(config, conn, log_level)


def run_with_slow_steps(config, conn, log_level):
    """Every model step takes 20 ms more: long requests are surely still running when the
    test looks at them."""
    import time

    from pyengine.worker.model_runner import ModelRunner

    orig = ModelRunner.execute_model

    def slow(self, *a, **k):
        time.sleep(0.02)
        return orig(self, *a, **k)
    ModelRunner.execute_model = slow
    run_engine_core(config, conn, log_level)
