"""How engine processes start (pyengine/utils.py ``choose_start_method``, used by the
engine-core client and the tensor-parallel executor): a script that creates an engine at
module level, without ``if __name__ == "__main__":``, works where forking is sound (as
vLLM's users expect: vLLM forks its engine process when the parent holds no CUDA context),
and where it is not, fails with one line that names the guard instead of "the engine
core process died unexpectedly". Each case is a real script file run in a subprocess."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers import hf_greedy

REPO = Path(__file__).resolve().parents[2]
PROMPT = [5, 6, 7, 8, 9]
MAX_TOKENS = 6

# No guard: every statement runs at import, as in a quick script or a notebook export.
UNGUARDED = textwrap.dedent("""
    import json, sys, threading, time
    from pyengine import AsyncLLM, LLM, EngineArgs, SamplingParams, RequestOutputKind
    print("top-level code", flush=True)
    model, kind, threads = sys.argv[1], sys.argv[2], sys.argv[3]
    if threads == "thread":  # a thread of the user's: forking this process is not sound
        threading.Thread(target=time.sleep, args=(300,), name="user-thread", daemon=True).start()
    sp = SamplingParams(temperature=0, max_tokens=%(max_tokens)d, ignore_eos=True,
                        output_kind=RequestOutputKind.FINAL_ONLY)
    if kind == "async":
        engine = AsyncLLM.from_engine_args(EngineArgs(model=model, device="cpu", num_gpu_blocks_override=64,
                                                      max_model_len=256), multiprocess=True)
        method = engine.engine_core.start_method
        ids = engine.add_request("r", %(prompt)r, sp).get(timeout=120).outputs[0].token_ids
        engine.shutdown()
    else:
        llm = LLM(model, device="cpu", tensor_parallel_size=2, num_gpu_blocks_override=64, max_model_len=256)
        method = llm.llm_engine.engine_core.model_executor.workers[0].start_method
        ids = llm.generate([%(prompt)r], sp, use_tqdm=False)[0].outputs[0].token_ids
        llm.shutdown()
    print("result", method, json.dumps(list(ids)), flush=True)
""") % {"max_tokens": MAX_TOKENS, "prompt": PROMPT}


def _run(script: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.pop("VENGINE_MULTIPROC_METHOD", None)
    env.pop("VENGINE_ENABLE_MULTIPROCESSING", None)
    return subprocess.run([sys.executable, str(script), *args], cwd=script.parent, env=env, capture_output=True,
                          text=True, timeout=240)


@pytest.fixture(scope="module")
def unguarded_script(tmp_path_factory):
    script = tmp_path_factory.mktemp("unguarded") / "generate.py"
    script.write_text(UNGUARDED)
    return script


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["async", "llm_tp2"])
def test_unguarded_script_works_by_fork(kind, unguarded_script, llama_dir):
    """An AsyncLLM's engine-core process, and an LLM's tensor-parallel worker, started from
    an unguarded script's top level: forked, so the script runs once and generates."""
    out = _run(unguarded_script, str(llama_dir), kind, "none")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("top-level code") == 1  # nothing re-ran the script
    (line,) = [ln for ln in out.stdout.splitlines() if ln.startswith("result ")]
    _, method, ids = line.split(" ", 2)
    assert method == "fork"
    assert json.loads(ids) == hf_greedy(llama_dir, [PROMPT], MAX_TOKENS, ignore_eos=True)[0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind,what", [("async", "The engine core process"),
                                       ("llm_tp2", "tensor-parallel worker rank 1")])
def test_unguarded_script_where_fork_is_unsound_fails_with_one_line_naming_the_guard(kind, what, unguarded_script,
                                                                                      llama_dir):
    """With another thread running, the process is started by forkserver / spawn, which
    re-run the script in the child: the start fails with one line that says so."""
    out = _run(unguarded_script, str(llama_dir), kind, "thread")
    assert out.returncode != 0
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("RuntimeError: ")]
    assert errors, out.stderr[-3000:]
    msg = errors[-1]
    assert msg.startswith(f"RuntimeError: {what} could not start: ")
    assert 'put that code under `if __name__ == "__main__":`' in msg
    assert str(unguarded_script) in msg and "other threads run in this process (user-thread)" in msg
    assert "died unexpectedly" not in out.stderr
    assert "result" not in out.stdout


# In a fresh interpreter: the test process itself may hold other tests' threads and pools.
CHOOSER = textwrap.dedent("""
    import threading, time
    import torch
    from pyengine import utils

    def main_rerun(value):
        utils.main_module_rerun_by_spawn = lambda: value

    assert utils.fork_unsafe_reason() is None  # main thread only, no CUDA, no pool yet
    assert utils.choose_start_method("spawn", "forkserver") == ("spawn", "VENGINE_MULTIPROC_METHOD=spawn")
    main_rerun(False)
    assert utils.choose_start_method(None, "forkserver") == ("forkserver", "")  # nothing to gain by forking
    main_rerun(True)
    assert utils.choose_start_method(None, "forkserver") == ("fork", "")
    assert utils.choose_start_method(None, "forkserver", prefer_fork=False) == ("forkserver", "")
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, name="busy-helper", daemon=True)
    t.start()
    method, note = utils.choose_start_method(None, "forkserver")
    assert method == "forkserver" and note == "fork was not used: other threads run in this process (busy-helper)"
    utils.mark_fork_safe(t)  # e.g. a reader blocked on its pipe
    assert utils.choose_start_method(None, "forkserver") == ("fork", "")
    stop.set()
    t.join()
    if torch.get_num_threads() > 1:  # torch's OpenMP pool starts: a forked child would hang in it
        a = torch.randn(512, 512)
        for _ in range(3):
            a @ a
        assert "native thread pool" in utils.fork_unsafe_reason()
    print("ok")
""")


def test_choose_start_method(tmp_path):
    script = tmp_path / "chooser.py"
    script.write_text(CHOOSER)
    out = _run(script)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
