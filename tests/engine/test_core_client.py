"""The engine-core clients (pyengine/engine/core_client.py): the multi-process core gives
the same tokens as the in-process one, and its process boundary fails cleanly (engine
process killed or failing, front end killed, start-up errors, shutdown, start/stop
cycles without leaking processes, file descriptors or KV blocks)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pyengine import AsyncLLM, EngineArgs, EngineDeadError, RequestOutputKind, SamplingParams
from pyengine.engine import core_client
from tests.engine.test_async_llm import drain, wait_idle
from tests.helpers import hf_greedy, live_children, prompt_token_ids
from tests.helpers import process_gone as gone

REPO = Path(__file__).resolve().parents[2]


def mp_engine(model_dir, **kw) -> AsyncLLM:
    args = dict(model=str(model_dir), device="cpu", num_gpu_blocks_override=256, max_model_len=256)
    args.update(kw)
    return AsyncLLM.from_engine_args(EngineArgs(**args), multiprocess=True)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return prompt_token_ids(tokenizer, 6, min_len=4, max_len=40, seed=11)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_mp_and_inproc_cores_are_token_identical(model_dirs, prompts, async_scheduling, device):
    qwen3 = model_dirs["qwen3"]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    got = {}
    for mp in (True, False):
        engine = AsyncLLM.from_engine_args(EngineArgs(
            model=str(qwen3), device=device, dtype="float32", async_scheduling=async_scheduling,
            max_num_batched_tokens=32,
            num_gpu_blocks_override=12, max_model_len=96, max_num_seqs=4), multiprocess=mp)
        try:
            assert (type(engine.engine_core).__name__ == "MPClient") == mp
            cs = [engine.add_request(f"q{i}", p, sp) for i, p in enumerate(prompts)]
            got[mp] = [[t for o in drain(c) for t in o.outputs[0].token_ids] for c in cs]
            wait_idle(engine)
        finally:
            engine.shutdown()
    assert got[True] == got[False] == hf_greedy(qwen3, prompts, 24, ignore_eos=True)


def test_stats_and_utility_calls_are_messages(llama_dir, prompts):
    engine = mp_engine(llama_dir)
    try:
        s0 = engine.get_stats()  # from the core's ready message, before any step
        assert s0.num_gpu_blocks == s0.num_free_blocks > 0 and s0.num_steps == 0
        drain(engine.add_request("a", prompts[0], SamplingParams(max_tokens=4, ignore_eos=True)))
        s = engine.engine_core.call_utility("get_stats")
        assert s.num_steps >= 4 and s.num_free_blocks == s.num_gpu_blocks
        with pytest.raises(ValueError, match="unknown utility method"):
            engine.engine_core.call_utility("shutdown")  # not on the allow-list
    finally:
        engine.shutdown()


def test_ctrl_c_leaves_the_shutdown_to_the_front_end(llama_dir, prompts):
    """Ctrl-C signals the whole process group: the engine process ignores SIGINT (no
    KeyboardInterrupt traceback of a "dying" loop) and keeps serving until its front end
    shuts it down."""
    engine = mp_engine(llama_dir)
    pid = engine.engine_core.pid
    try:
        os.kill(pid, signal.SIGINT)
        time.sleep(0.5)
        assert not gone(pid) and not engine.errored
        out = drain(engine.add_request("after", prompts[0], SamplingParams(max_tokens=4)))
        assert len(out[-1].outputs[0].token_ids) == 4
    finally:
        engine.shutdown()
    assert gone(pid)


@pytest.mark.timeout(60)
def test_engine_process_killed_ends_every_request_within_2s(llama_dir, prompts):
    engine = mp_engine(llama_dir, max_num_seqs=2)
    pid = engine.engine_core.pid
    try:
        sp = SamplingParams(max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        cs = [engine.add_request(f"k{i}", p, sp) for i, p in enumerate(prompts)]
        cs[0].get(timeout=30)  # streaming
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        for c in cs:
            with pytest.raises(EngineDeadError, match="killed by SIGKILL"):
                drain(c, timeout=5)
        assert time.monotonic() - t0 < 2.0
        assert engine.errored
        with pytest.raises(EngineDeadError):
            engine.add_request("late", prompts[0])
    finally:
        engine.shutdown()
    assert gone(pid)


@pytest.mark.timeout(60)
def test_step_failure_in_engine_process_reaches_every_request(llama_dir, prompts, monkeypatch):
    from tests.engine import mp_targets

    monkeypatch.setattr(core_client, "run_engine_core", mp_targets.run_with_faulty_step)
    engine = mp_engine(llama_dir, max_num_seqs=2)
    pid = engine.engine_core.pid
    try:
        cs = [engine.add_request(f"f{i}", p, SamplingParams(max_tokens=100, ignore_eos=True))
              for i, p in enumerate(prompts)]
        for c in cs:
            with pytest.raises(EngineDeadError, match="injected failure in the engine process"):
                drain(c, timeout=10)
        engine.engine_core.proc.join(10)
        assert engine.engine_core.proc.exitcode == 1
    finally:
        engine.shutdown()
    assert gone(pid)


def test_start_up_error_carries_the_engine_process_message(llama_dir, tmp_path):
    bad = tmp_path / "no-weights"
    bad.mkdir()
    for f in llama_dir.iterdir():  # config and tokenizer, but no *.safetensors
        if not f.name.endswith(".safetensors"):
            (bad / f.name).write_bytes(f.read_bytes())
    with pytest.raises((ValueError, RuntimeError), match="safetensors"):
        mp_engine(bad)
    proc = subprocess.run([sys.executable, "-m", "server", str(bad), "--port", "0", "--device", "cpu"],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, VENGINE_ENABLE_MULTIPROCESSING="1"))
    assert proc.returncode != 0 and "safetensors" in proc.stderr


@pytest.mark.timeout(120)
def test_front_end_killed_engine_process_exits(llama_dir, tmp_path):
    script = tmp_path / "front.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        from pyengine import AsyncLLM, EngineArgs, SamplingParams
        if __name__ == "__main__":
            e = AsyncLLM.from_engine_args(EngineArgs(model={str(llama_dir)!r}, device="cpu",
                                                     num_gpu_blocks_override=256), multiprocess=True)
            e.add_request("busy", [5, 6, 7], SamplingParams(max_tokens=None, ignore_eos=True))
            print(e.engine_core.pid, flush=True)
            time.sleep(120)
    """))
    front = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        pid = int(front.stdout.readline())
        assert not gone(pid)
        front.kill()  # no clean-up runs in the front end
        front.wait()
        deadline = time.monotonic() + 20
        while not gone(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gone(pid), "the engine process outlived its front end"
    finally:
        front.kill()


@pytest.mark.timeout(600)
def test_start_stop_cycles_leak_nothing(llama_dir):
    # 8 cycles: the checks are exact (every process gone, the same children, at most 2 fds
    # more), so a leak of one process or fd a cycle shows as surely as at 100
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    mp_engine(llama_dir).shutdown()  # the forkserver is up: it stays, as a child of this process
    children = live_children(os.getpid())
    fds = len(os.listdir("/proc/self/fd"))
    pids = set()
    for i in range(8):
        engine = mp_engine(llama_dir)
        pids.add(engine.engine_core.pid)
        out = drain(engine.add_request(f"c{i}", [5, 6, 7, 8], sp))[-1]
        assert len(out.outputs[0].token_ids) == 3
        wait_idle(engine)  # every KV block is free again
        engine.shutdown()
        assert engine.engine_core.proc._closed if hasattr(engine.engine_core.proc, "_closed") else True
    assert len(pids) == 8 and all(gone(p) for p in pids)
    assert live_children(os.getpid()) == children
    assert len(os.listdir("/proc/self/fd")) <= fds + 2


@pytest.mark.timeout(180)
def test_one_engine_process_serves_several_front_ends(llama_dir, prompts):
    """The shape of --api-server-count: one engine process, two front ends attached to it.
    Each gets exactly its own requests' outputs (token-identical to a lone engine); a
    utility call is answered to its caller; one front end leaving aborts only its
    requests; the last one leaving ends the engine process."""
    from pyengine.engine.core_client import MPClient, start_engine_core_process

    cfg = EngineArgs(model=str(llama_dir), device="cpu", num_gpu_blocks_override=256,
                     max_model_len=1024).create_engine_config()
    proc, conns = start_engine_core_process(cfg, 2)
    fronts = [AsyncLLM(cfg, client=MPClient.attach(c)) for c in conns]
    try:
        sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        cs = [fronts[i % 2].add_request(f"r{i}", p, sp) for i, p in enumerate(prompts)]
        got = [[t for o in drain(c) for t in o.outputs[0].token_ids] for c in cs]
        assert got == hf_greedy(llama_dir, prompts, 12, ignore_eos=True)
        assert fronts[1].engine_core.call_utility("get_stats").num_running == 0
        long = fronts[0].add_request("long", prompts[0], SamplingParams(max_tokens=None, ignore_eos=True,
                                                                        output_kind=RequestOutputKind.DELTA))
        long.get(timeout=30)
        fronts[1].shutdown()  # leaves: the engine goes on for the other front end
        assert proc.is_alive()
        after = drain(fronts[0].add_request("after", prompts[1], sp))
        assert sum(len(o.outputs[0].token_ids) for o in after) == 12
        fronts[0].abort("long")
        assert drain(long)[-1].outputs[0].finish_reason == "abort"
        wait_idle(fronts[0])
    finally:
        for f in fronts:
            f.shutdown()
    proc.join(20)
    assert proc.exitcode == 0
