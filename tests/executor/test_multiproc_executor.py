"""Tensor parallelism end to end (pyengine/executor/multiproc_executor.py and the parallel
layers): TP=2 over gloo, two processes, tiny fp32 models. Greedy tokens must equal TP=1
and transformers with chunked prefill, preemption and async (and sync) scheduling; a
dead worker ends every request with EngineDeadError; a dead rank 0 takes its worker down.

Each TP=2 engine spawns a process (seconds on a small box), so the cases are few and
each one covers several features."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from pyengine import LLM, EngineDeadError, SamplingParams
from tests.helpers import build_tiny_model, hf_greedy, prompt_token_ids

MAX_TOKENS = 16
# Small steps and a tiny KV cache: prompts are prefilled in chunks and requests preempted.
STRESS = {"max_num_batched_tokens": 16, "num_gpu_blocks_override": 8, "max_model_len": 128}


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return prompt_token_ids(tokenizer, 6, min_len=4, max_len=40, seed=3)


@pytest.fixture(scope="module")
def kv1_dir(tmp_path_factory, tokenizer_dir):
    # One KV head (< 2 ranks: replicated) and a vocabulary of 515 rows, which splits into
    # 258 + 257 (the last rank's range padded).
    return build_tiny_model(tmp_path_factory.mktemp("qwen3_kv1"), "qwen3", tokenizer_dir, seed=4,
                            num_key_value_heads=1, vocab_size=515)


def _greedy(model_dir, prompts, device="cpu", logprobs=None, shm=None, **kw):
    """Greedy token ids (and logprobs); ``shm``: assert that rank 0 hands the steps over
    through the shared-memory queue (True) or gloo (False)."""
    llm = LLM(str(model_dir), device=device, **kw)
    try:
        if shm is not None:
            assert (llm.llm_engine.engine_core.model_executor.driver.tp.mq is not None) == shm
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, detokenize=False,
                                                    logprobs=logprobs), use_tqdm=False)
        stats = llm.llm_engine.get_stats()
    finally:
        llm.shutdown()
    if logprobs:
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], stats
    return [o.outputs[0].token_ids for o in outs], stats


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family,async_sched,shm", [("llama", True, True), ("qwen2", True, True), ("qwen3", True, True),
                                                    ("qwen3_kv1", False, False)])
def test_tp2_greedy_matches_tp1_and_transformers(family, async_sched, shm, model_dirs, kv1_dir, prompts, monkeypatch):
    # shm: rank 0 sends the steps through the shared-memory queue (the default), else gloo
    monkeypatch.setenv("VENGINE_TP_SHM_BROADCAST", "1" if shm else "0")  # the worker inherits it
    model_dir = kv1_dir if family == "qwen3_kv1" else model_dirs[family]
    ref = hf_greedy(model_dir, prompts, MAX_TOKENS)
    tp1, _ = _greedy(model_dir, prompts, async_scheduling=async_sched, **STRESS)
    tp2, stats = _greedy(model_dir, prompts, tensor_parallel_size=2, async_scheduling=async_sched, shm=shm, **STRESS)
    assert tp2 == tp1 == ref
    assert stats.num_preemptions > 0
    assert stats.num_free_blocks == stats.num_gpu_blocks  # no KV block leaked


@pytest.mark.timeout(300)
def test_second_tp_engine_after_del_and_gc(llama_dir, prompts):
    """vLLM's way to free an engine, ``del llm`` and ``gc.collect()`` without shutdown
    (notebooks, test suites), frees its process group and workers: a second TP=2 engine in
    this process starts and gives the same tokens."""
    import gc

    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, detokenize=False)
    got = []
    for _ in range(2):
        llm = LLM(str(llama_dir), device="cpu", tensor_parallel_size=2, num_gpu_blocks_override=64)
        worker = llm.llm_engine.engine_core.model_executor.workers[0].proc
        got.append([o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)])
        del llm
        gc.collect()
        assert not torch.distributed.is_initialized()
        assert not worker.is_alive()
    assert got[0] == got[1] == hf_greedy(llama_dir, prompts, MAX_TOKENS)


# ---- GPU (2 GPUs, NCCL, CUDA graphs and triton kernels): tools/tp_h200x2.sh --------------
needs_two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                    reason="needs 2 GPUs")
GPU = {"max_num_seqs": 16, **STRESS}  # few CUDA graphs to capture; decode steps replay them


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_tp2_gpu_fp32_matches_transformers(family, model_dirs, prompts):
    ref = hf_greedy(model_dirs[family], prompts, MAX_TOKENS)
    tp2, stats = _greedy(model_dirs[family], prompts, "cuda", dtype="float32", tensor_parallel_size=2, **GPU)
    assert tp2 == ref
    assert stats.num_preemptions > 0 and stats.num_free_blocks == stats.num_gpu_blocks


# bf16 sums come out rounded differently when split over two ranks (bf16 logits near 10
# are 1/16 apart), so a greedy choice between two near-equal logits may flip; anywhere
# else the tokens must be the same.
NEAR_TIE = 0.2  # top-2 logprob gap (TP=1) under which a flip is accepted


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_tp2_gpu_bf16_matches_tp1(family, model_dirs, prompts):
    tp1, _ = _greedy(model_dirs[family], prompts, "cuda", logprobs=2, dtype="bfloat16", **GPU)
    tp2, _ = _greedy(model_dirs[family], prompts, "cuda", dtype="bfloat16", tensor_parallel_size=2, **GPU)
    same = total = 0
    for (toks1, lps1), toks2 in zip(tp1, tp2):
        total += len(toks1)
        for i, (a, b) in enumerate(zip(toks1, toks2)):
            if a != b:
                top = sorted((lp.logprob for lp in lps1[i].values()), reverse=True)
                assert top[0] - top[1] < NEAR_TIE, f"TP=2 diverged at token {i} without a near tie: {toks1} vs {toks2}"
                break
            same += 1
        else:
            assert len(toks1) == len(toks2)
    assert same >= 0.5 * total, f"only {same} of {total} tokens identical"


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.timeout(180)
@pytest.mark.parametrize("symm_mem", [False, True])
def test_killed_worker_gpu(llama_dir, prompts, symm_mem, monkeypatch):
    # symm_mem: rank 0's GPU may be spinning in the fused all-reduce for a peer that is gone
    monkeypatch.setenv("VENGINE_SYMM_MEM_ALLREDUCE", "1" if symm_mem else "0")
    _kill_worker_and_check(llama_dir, prompts, "cuda", True, limit_s=10)


@pytest.mark.timeout(120)
def test_bad_checkpoint_raises_and_leaves_no_worker(llama_dir, tmp_path):
    import multiprocessing
    import shutil

    from safetensors.torch import load_file, save_file

    d = tmp_path / "m"
    shutil.copytree(llama_dir, d)
    f = next(d.glob("*.safetensors"))
    sd = load_file(str(f))
    del sd["model.layers.1.mlp.down_proj.weight"]
    save_file(sd, str(f), metadata={"format": "pt"})
    before = set(multiprocessing.active_children())  # an earlier test's engine of this worker may live on
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        LLM(str(d), device="cpu", tensor_parallel_size=2)
    assert not set(multiprocessing.active_children()) - before
    # the process group is gone too: a next tensor-parallel engine starts
    got, _ = _greedy(llama_dir, [[5, 6, 7]], tensor_parallel_size=2)
    assert got[0]


def _drain(collector, timeout: float):
    deadline = time.monotonic() + timeout
    while True:
        out = collector.get(timeout=max(0.01, deadline - time.monotonic()))
        if out.finished:
            return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("multiprocess", [False, True], ids=["inproc_core", "mp_core"])
def test_killed_worker_ends_every_request_with_engine_dead_error(llama_dir, prompts, multiprocess):
    _kill_worker_and_check(llama_dir, prompts, "cpu", multiprocess, limit_s=5)


def _spawned_children(pid: int) -> list[int]:
    """Processes that ``pid`` started with multiprocessing's spawn (the TP workers)."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            stat, cmd = (d / "stat").read_text(), (d / "cmdline").read_bytes()
        except OSError:
            continue
        if stat.rsplit(")", 1)[1].split()[1] == str(pid) and b"spawn_main" in cmd:
            out.append(int(d.name))
    return out


def _kill_worker_and_check(llama_dir, prompts, device, multiprocess, limit_s, **engine_kw):
    from pyengine import AsyncLLM, EngineArgs

    engine = AsyncLLM.from_engine_args(EngineArgs(model=str(llama_dir), device=device, tensor_parallel_size=2,
                                                  max_num_seqs=16, gpu_memory_utilization=0.3, **engine_kw),
                                       multiprocess=multiprocess)
    try:
        if multiprocess:  # rank 0 lives in the engine-core process
            (worker_pid,) = _spawned_children(engine.engine_core.pid)
        else:
            worker_pid = engine.engine_core.engine_core.model_executor.workers[0].proc.pid
        sp = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
        cs = [engine.add_request(f"k{i}", p, sp) for i, p in enumerate(prompts)]
        first = cs[0].get(timeout=60)  # the engine is stepping
        assert not first.finished
        t0 = time.monotonic()
        os.kill(worker_pid, signal.SIGKILL)
        for c in cs:
            with pytest.raises(EngineDeadError, match="rank 1"):
                _drain(c, timeout=limit_s)
        assert time.monotonic() - t0 < limit_s
        assert engine.errored
        with pytest.raises(EngineDeadError):
            engine.add_request("late", prompts[0])
    finally:
        t0 = time.monotonic()
        engine.shutdown()
        assert time.monotonic() - t0 < 10


_RANK0 = textwrap.dedent("""
    import sys, time
    from pyengine import LLM, SamplingParams
    if __name__ == "__main__":
        llm = LLM(sys.argv[1], device="cpu", tensor_parallel_size=2)
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
        print(llm.llm_engine.engine_core.model_executor.workers[0].proc.pid, flush=True)
        time.sleep(600)
""")


@pytest.mark.timeout(120)
def test_worker_exits_when_rank0_process_dies(llama_dir, tmp_path):
    script = tmp_path / "rank0.py"
    script.write_text(_RANK0)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, str(script), str(llama_dir)], stdout=subprocess.PIPE, env=env, text=True)
    try:
        worker_pid = int(proc.stdout.readline())
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _alive(worker_pid):
            time.sleep(0.1)
        assert not _alive(worker_pid), "the worker outlived rank 0"
    finally:
        proc.kill()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its dead parent's reaper) counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
