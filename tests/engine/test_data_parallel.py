"""Data parallelism (issue 29): ``data_parallel_size=N`` runs N engine-core processes,
each with its own scheduler and KV cache, behind one front end (``DPClient``,
pyengine/engine/core_client.py). Requests go to the least-loaded core, aborts to the
owning one, stats come per core; greedy output equals one core's and transformers'; a
core that dies fails only its own requests."""
from __future__ import annotations

import os
import signal
import time

import pytest

from pyengine import LLM, AsyncLLM, EngineArgs, EngineDeadError, RequestOutputKind, SamplingParams
from pyengine.engine.core_client import DPClient, data_parallel_devices
from pyengine.metrics.stats import SchedulerStats, combine_scheduler_stats
from tests.engine.test_async_llm import drain, wait_idle
from tests.helpers import hf_greedy, prompt_token_ids


def dp_args(model_dir, **kw) -> EngineArgs:
    args = dict(model=str(model_dir), device="cpu", dtype="float32", num_gpu_blocks_override=64,
                max_model_len=192, max_num_seqs=8, data_parallel_size=2)
    args.update(kw)
    return EngineArgs(**args)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return prompt_token_ids(tokenizer, 6, min_len=4, max_len=30, seed=29)


@pytest.fixture(scope="module")
def dp_engine(qwen3_dir):
    engine = AsyncLLM.from_engine_args(dp_args(qwen3_dir), multiprocess=True)
    yield engine
    engine.shutdown()


def test_two_cores_serve_token_identical_to_one_and_to_transformers(dp_engine, qwen3_dir, prompts):
    assert isinstance(dp_engine.engine_core, DPClient) and dp_engine.engine_core.engine_count() == 2
    pids = {c.pid for c in dp_engine.engine_core.clients}
    assert len(pids) == 2 and os.getpid() not in pids  # two engine-core processes
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    placed0 = list(dp_engine.engine_core.num_placed)
    cs = [dp_engine.add_request(f"g{i}", p, sp) for i, p in enumerate(prompts)]
    got = [[t for o in drain(c) for t in o.outputs[0].token_ids] for c in cs]
    wait_idle(dp_engine)
    placed = [a - b for a, b in zip(dp_engine.engine_core.num_placed, placed0)]
    assert sum(placed) == len(prompts) and min(placed) >= 2  # both cores used, balanced
    assert got == hf_greedy(qwen3_dir, prompts, 12, ignore_eos=True)
    # each core's stats: the requests it admitted queried its own prefix cache
    per = dp_engine.get_stats_per_engine()
    assert [s.engine_index for s in per] == [0, 1]
    assert all(s.prefix_cache_queries > 0 for s in per)
    total = dp_engine.get_stats()
    assert total.prefix_cache_queries == sum(s.prefix_cache_queries for s in per)
    assert total.num_gpu_blocks == sum(s.num_gpu_blocks for s in per)


def test_least_loaded_placement_and_abort_on_the_owning_core(dp_engine, prompts, monkeypatch):
    core = dp_engine.engine_core
    added, aborted = {}, []
    for i, c in enumerate(core.clients):
        def add(r, i=i, orig=c.add_request):
            added[r.request_id] = i
            orig(r)

        def abort(ids, i=i, orig=c.abort_requests):
            aborted.append((i, list(ids)))
            orig(ids)
        monkeypatch.setattr(c, "add_request", add)
        monkeypatch.setattr(c, "abort_requests", abort)
    long = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    placed0 = list(core.num_placed)
    cs = [dp_engine.add_request(f"a{i}", prompts[i], long) for i in range(4)]
    # four requests at once: two per core (each placement went to the emptier core)
    assert [a - b for a, b in zip(core.num_placed, placed0)] == [2, 2]
    assert sorted(added.values()) == [0, 0, 1, 1]
    dp_engine.abort(["a0", "a1", "a2", "a3"])
    for c in cs:
        outs = drain(c)
        assert outs[-1].outputs[0].finish_reason in ("abort", "length")
    # each abort went to the core that owned the request (finished ones to none)
    assert aborted and all(added[rid] == i for i, ids in aborted for rid in ids)
    deadline = time.monotonic() + 10  # the cores' own terminal outputs come after the front end's
    while (core.in_flight != [0, 0] or core.owner) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert core.in_flight == [0, 0] and not core.owner
    # the aborts reached both cores: nothing runs or waits anywhere, every block is free
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        per = dp_engine.get_stats_per_engine()
        if all(s.num_running == s.num_waiting == 0 and s.num_free_blocks == s.num_gpu_blocks for s in per):
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"not idle: {dp_engine.get_stats_per_engine()}")


def test_reset_prefix_cache_reaches_every_core(dp_engine):
    import asyncio
    assert asyncio.run(dp_engine.reset_prefix_cache()) is True


def test_llm_data_parallel_generate_equals_one_core(qwen3_dir, prompts):
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(str(qwen3_dir), device="cpu", dtype="float32", num_gpu_blocks_override=64, max_model_len=128,
              data_parallel_size=2)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        placed = llm.llm_engine.engine_core.num_placed
        per = llm.llm_engine.get_stats_per_engine()
        assert llm.reset_prefix_cache()
    finally:
        llm.shutdown()
    assert min(placed) >= 2 and sum(placed) == len(prompts)
    assert all(s.prefix_cache_queries > 0 for s in per)
    assert got == hf_greedy(qwen3_dir, prompts, 8, ignore_eos=True)


def slow_dp_engine(model_dir) -> AsyncLLM:
    """Two engine cores whose every step takes 20 ms more (tests/engine/mp_targets.py)."""
    from pyengine.engine.core_client import MPClient
    from tests.engine.mp_targets import run_with_slow_steps

    config = dp_args(model_dir).create_engine_config()
    clients = []
    for r in range(2):
        ends = tuple(e for c in clients for e in c.parent_ends())
        clients.append(MPClient(config.replace(data_parallel_rank=r), target=run_with_slow_steps,
                                close_in_child=ends))
    return AsyncLLM(config, client=DPClient(clients))


def test_a_dead_core_fails_only_its_own_requests(qwen3_dir, prompts):
    engine = slow_dp_engine(qwen3_dir)
    try:
        core = engine.engine_core
        long = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        cs = [engine.add_request(f"d{i}", prompts[i], long) for i in range(4)]
        owner = {rid.split("-")[0]: i for rid, i in core.owner.items()}  # engine ids: "<id>-<n>"
        victims = [i for i in range(4) if owner[f"d{i}"] == 1]
        assert 0 < len(victims) < 4
        os.kill(core.clients[1].pid, signal.SIGKILL)
        for i, c in enumerate(cs):
            outs = drain(c)
            reason = outs[-1].outputs[0].finish_reason
            if i in victims:
                assert reason == "error"
            else:
                assert reason == "length" and len([t for o in outs for t in o.outputs[0].token_ids]) == 120
        assert list(engine.dead_engines()) == [1] and "killed by SIGKILL" in engine.dead_engines()[1]
        assert not engine.errored
        # new requests all go to the live core and are served
        short = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        outs = [drain(engine.add_request(f"n{i}", prompts[i], short))[-1] for i in range(3)]
        assert all(o.outputs[0].finish_reason == "length" for o in outs)
        assert core.num_placed[1] == len(victims)
        # the last core's death is the engine's
        os.kill(core.clients[0].pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not engine.errored and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.errored
        with pytest.raises(EngineDeadError):
            engine.add_request("late", prompts[0], short)
    finally:
        engine.shutdown()


def test_config_and_devices(qwen3_dir):
    with pytest.raises(ValueError, match="data_parallel_size must be a positive integer"):
        dp_args(qwen3_dir, data_parallel_size=0).create_engine_config()
    cfg = dp_args(qwen3_dir, data_parallel_size=3).create_engine_config()
    assert cfg.data_parallel_size == 3 and cfg.data_parallel_rank == 0
    assert data_parallel_devices(cfg, 1) is None  # CPU: the environment is kept


def test_data_parallel_devices_slices_the_visible_gpus(qwen3_dir, monkeypatch):
    import torch
    cfg = dp_args(qwen3_dir).create_engine_config().replace(device=torch.device("cuda"), tensor_parallel_size=2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert [data_parallel_devices(cfg, r) for r in (0, 1)] == ["4,5", "6,7"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    with pytest.raises(ValueError, match="rank 1 needs devices 2..3"):
        data_parallel_devices(cfg, 1)


def test_combine_scheduler_stats():
    a = SchedulerStats(num_running=2, num_waiting=1, kv_cache_usage=0.5, num_gpu_blocks=10, prefix_cache_hits=3)
    b = SchedulerStats(num_running=1, kv_cache_usage=0.0, num_gpu_blocks=30, prefix_cache_hits=4, engine_index=1)
    c = combine_scheduler_stats([a, b])
    assert (c.num_running, c.num_waiting, c.num_gpu_blocks, c.prefix_cache_hits) == (3, 1, 40, 7)
    assert c.kv_cache_usage == pytest.approx(5 / 40)
    assert combine_scheduler_stats([a]) is a
