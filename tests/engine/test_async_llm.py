"""AsyncLLM: concurrency, abort, priority, async scheduling, engine death."""
from __future__ import annotations

import asyncio
import logging
import random
import threading
import time

import pytest

from pyengine import AsyncLLM, EngineArgs, EngineDeadError, RequestOutputKind, SamplingParams
from pyengine.engine.llm_engine import LLMEngine
from tests.helpers import fail_request_add, hf_greedy, prompt_token_ids


def make_engine(model_dir, multiprocess=None, **kw) -> AsyncLLM:
    """multiprocess=None: the default engine core (see pyengine/engine/core_client.py);
    tests that patch the engine's internals ask for the in-process one."""
    return AsyncLLM.from_engine_args(EngineArgs(model=str(model_dir), device="cpu", **kw), multiprocess)


def drain(collector, timeout=60):
    outs = []
    while True:
        out = collector.get(timeout=timeout)
        outs.append(out)
        if out.finished:
            return outs


def wait_idle(engine: AsyncLLM, timeout=10):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.get_stats()
        if s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_gpu_blocks:
            return s
        time.sleep(0.02)
    raise AssertionError(f"engine not idle: {engine.get_stats()}")


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return prompt_token_ids(tokenizer, 8, min_len=4, max_len=40, seed=3)


def test_100_concurrent_requests(llama_dir, tokenizer):
    engine = make_engine(llama_dir, max_num_seqs=32)
    try:
        ps = prompt_token_ids(tokenizer, 100, 2, 30, seed=5)
        sp = SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        collectors = [engine.add_request(f"r{i}", p, sp) for i, p in enumerate(ps)]
        results = {}
        def read(c):
            outs = drain(c)
            results[c.request_id] = outs
        threads = [threading.Thread(target=read, args=(c,)) for c in collectors]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(results) == 100
        for rid, outs in results.items():
            assert all(o.request_id == rid for o in outs)
            ids = [t for o in outs for c in o.outputs for t in c.token_ids]
            assert len(ids) == 10
            assert sum(o.finished for o in outs) == 1 and outs[-1].finished
            assert outs[-1].outputs[0].finish_reason == "length"
        wait_idle(engine)
    finally:
        engine.shutdown()


def test_model_without_tokenizer_is_refused_at_load(no_tokenizer_dir, llama_dir, tokenizer_dir):
    # issue 12: it loaded, then the first text prompt killed the engine core
    with pytest.raises(ValueError, match="cannot encode text .* no usable tokenizer files"):
        make_engine(no_tokenizer_dir)
    # a tokenizer that does not fit the model's vocabulary is refused too
    from pyengine.tokenizer import load_tokenizer
    cfg = EngineArgs(model=str(llama_dir), device="cpu").create_engine_config()
    small = cfg.replace(hf_config=type(cfg.hf_config)(**dict(cfg.hf_config.to_dict(), vocab_size=4)))
    with pytest.raises(ValueError, match="does not match the model"):
        load_tokenizer(small)
    assert load_tokenizer(cfg).encode("x")


def test_duplicate_and_bad_requests_rejected(llama_dir, prompts):
    engine = make_engine(llama_dir)
    try:
        c = engine.add_request("a", prompts[0], SamplingParams(max_tokens=50, ignore_eos=True))
        with pytest.raises(ValueError, match="already in use"):
            engine.add_request("a", prompts[1])
        with pytest.raises(ValueError, match="empty"):
            engine.add_request("b", "")
        t0 = time.monotonic()  # issue 16: refused by the character bound, not after tokenizing
        with pytest.raises(ValueError, match="it has 4194304 characters"):
            engine.add_request("b", "fox " * (1 << 20))
        assert time.monotonic() - t0 < 2.0
        assert drain(c)[-1].outputs[0].finish_reason == "length"
        wait_idle(engine)
    finally:
        engine.shutdown()


def test_abort_mid_stream_and_before_admission(llama_dir, prompts):
    engine = make_engine(llama_dir, max_num_seqs=1)
    try:
        sp = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        running = engine.add_request("running", prompts[0], sp)
        waiting = engine.add_request("waiting", prompts[1], sp)  # max_num_seqs=1: not admitted
        first = running.get(timeout=30)
        assert not first.finished
        engine.abort("waiting")
        engine.abort("running")
        engine.abort("running")  # idempotent
        engine.abort("no-such-request")
        for c in (running, waiting):
            last = drain(c)[-1]
            assert last.finished and last.outputs[0].finish_reason == "abort"
        assert len(drain(engine.add_request("after", prompts[2], SamplingParams(max_tokens=5, ignore_eos=True)))[-1]
                   .outputs[0].token_ids) == 5
        wait_idle(engine)
    finally:
        engine.shutdown()


def test_abort_storm(llama_dir, tokenizer):
    engine = make_engine(llama_dir, max_num_seqs=16, num_gpu_blocks_override=64, max_model_len=256)
    rng = random.Random(0)
    try:
        ps = prompt_token_ids(tokenizer, 120, 2, 60, seed=9)
        collectors, aborted_at = {}, {}  # request id -> when its first abort call returned
        for i, p in enumerate(ps):
            sp = SamplingParams(temperature=1.0, max_tokens=rng.randint(1, 30), ignore_eos=True,
                                output_kind=rng.choice(list(RequestOutputKind)))
            collectors[f"s{i}"] = engine.add_request(f"s{i}", p, sp)
            if rng.random() < 0.5:
                victim = f"s{rng.randint(0, i)}"
                engine.abort(victim)
                aborted_at.setdefault(victim, time.monotonic())
        n_aborted = 0
        for rid, c in collectors.items():
            last = drain(c)[-1]
            reason = last.outputs[0].finish_reason
            if rid not in aborted_at:
                assert reason == "length"
            elif reason == "abort":
                n_aborted += 1
            else:
                # finished before the abort: abort() ends a request still running at once,
                # so a "length" finish must be stamped (by the engine step) before it returned
                assert reason == "length" and last.metrics.finished_time <= aborted_at[rid], rid
        assert n_aborted > 0
        wait_idle(engine)
    finally:
        engine.shutdown()


def test_asyncio_generate_and_early_exit(llama_dir, prompts):
    engine = make_engine(llama_dir)

    async def main():
        texts = []
        async for out in engine.generate(prompts[0], SamplingParams(max_tokens=8, ignore_eos=True,
                                                                    output_kind=RequestOutputKind.DELTA), "g1"):
            texts.append(out)
        assert texts[-1].finished and sum(len(o.outputs[0].token_ids) for o in texts) == 8
        gen = engine.generate(prompts[1], SamplingParams(max_tokens=500, ignore_eos=True), "g2")
        async for _ in gen:
            break
        await gen.aclose()  # consumer leaves early: the request is aborted

        async def one(i):
            outs = [o async for o in engine.generate(prompts[i % len(prompts)],
                                                     SamplingParams(max_tokens=6, ignore_eos=True), f"c{i}")]
            return outs[-1].outputs[0].token_ids
        res = await asyncio.gather(*(one(i) for i in range(20)))
        assert all(len(r) == 6 for r in res)

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
        wait_idle(engine)
    finally:
        engine.shutdown()


def test_priority_order_with_one_seq(llama_dir, prompts):
    engine = make_engine(llama_dir, max_num_seqs=1, scheduling_policy="priority")
    try:
        blocker = engine.add_request("blocker", prompts[0], SamplingParams(max_tokens=60, ignore_eos=True))
        blocker.get(timeout=30)  # running, so the rest queue up behind it
        prios = [5, 1, 3, 1, 0, 5]
        cs = [engine.add_request(f"p{i}", prompts[1], SamplingParams(max_tokens=2, ignore_eos=True), priority=pr)
              for i, pr in enumerate(prios)]
        finals = [drain(c)[-1] for c in cs]
        drain(blocker)
        order = [f.request_id for f in sorted(finals, key=lambda f: f.metrics.first_token_time)]
        assert order == ["p4", "p1", "p3", "p2", "p0", "p5"]  # (priority, arrival)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("policy, expected_victim", [("priority", "low"), ("fcfs", "high")])
def test_preemption_victim_and_exactness(llama_dir, prompts, policy, expected_victim):
    cfg = EngineArgs(model=str(llama_dir), device="cpu", num_gpu_blocks_override=8, block_size=16,
                     max_model_len=128, scheduling_policy=policy, async_scheduling=False).create_engine_config()
    engine = LLMEngine(cfg)
    victims = []
    sched = engine.engine_core.scheduler
    orig = sched._preempt

    def record(r):
        running = list(sched.running)
        if policy == "priority":  # the victim is the lowest-priority (largest value) running request
            assert (r.priority, r.arrival_time) == max((x.priority, x.arrival_time) for x in running)
        else:  # the most recently admitted
            assert r is running[-1]
        victims.append(r.request_id.rsplit("-", 1)[0])  # core ids carry a unique suffix
        orig(r)
    sched._preempt = record
    p = [x[:20] + x[:20] for x in prompts[:3]]  # 40-token prompts: 3 blocks each
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    def prio(value):  # fcfs refuses priorities (Processor.check_priority): arrival order only
        return value if policy == "priority" else 0
    engine.add_request("low", p[0], sp, priority=prio(2))
    outs = {}
    for _ in range(3):
        outs.update({o.request_id: o for o in engine.step()})
    engine.add_request("high", p[1], sp, priority=prio(0))
    engine.add_request("mid", p[2], sp, priority=prio(1))
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert victims and victims[0] == expected_victim
    ref = hf_greedy(llama_dir, p, 40, ignore_eos=True)
    assert [outs[r].outputs[0].token_ids for r in ("low", "high", "mid")] == ref
    s = engine.get_stats()
    assert s.num_free_blocks == s.num_gpu_blocks


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_greedy_identical_sync_async_fcfs_priority(model_dirs, prompts, policy, async_scheduling, device):
    llama_dir = model_dirs["llama"]
    engine = AsyncLLM.from_engine_args(EngineArgs(
        model=str(llama_dir), device=device, dtype="float32", scheduling_policy=policy,
        async_scheduling=async_scheduling, max_num_batched_tokens=32, num_gpu_blocks_override=12,
        max_model_len=96, max_num_seqs=4))
    try:
        sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        cs = [engine.add_request(f"q{i}", p, sp, priority=i % 3 if policy == "priority" else 0)
              for i, p in enumerate(prompts)]
        got = [drain(c)[-1].outputs[0].token_ids for c in cs]
        assert got == hf_greedy(llama_dir, prompts, 30, ignore_eos=True)
        wait_idle(engine)
    finally:
        engine.shutdown()


def test_async_scheduling_switches(llama_dir, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="pyengine")
    assert EngineArgs(model=str(llama_dir), device="cpu").create_engine_config().async_scheduling
    assert not EngineArgs(model=str(llama_dir), device="cpu", async_scheduling=False).create_engine_config().async_scheduling
    monkeypatch.setenv("VENGINE_ASYNC_SCHED", "0")
    assert not EngineArgs(model=str(llama_dir), device="cpu").create_engine_config().async_scheduling
    engine = make_engine(llama_dir, multiprocess=False)  # its log lines land in caplog
    engine.shutdown()
    assert "Asynchronous scheduling is disabled" in caplog.text
    monkeypatch.delenv("VENGINE_ASYNC_SCHED")
    engine = make_engine(llama_dir, multiprocess=False)
    engine.shutdown()
    assert "Asynchronous scheduling is enabled" in caplog.text


@pytest.mark.timeout(120)
def test_one_failing_request_does_not_take_the_engine_down(llama_dir, prompts, monkeypatch):
    # issue 12: an exception while adding one request killed the engine for everyone
    fail_request_add(monkeypatch, prompts[1])
    engine = make_engine(llama_dir, multiprocess=False)  # the fault is patched into this process
    try:
        sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        good = engine.add_request("good", prompts[0], sp)
        first = good.get(timeout=30)
        bad = engine.add_request("bad", prompts[1], sp)
        last = drain(bad)[-1]
        assert last.finished and last.outputs[0].finish_reason == "error"
        assert "OverflowError: injected" in last.outputs[0].error
        outs = [first] + drain(good)
        assert sum(len(o.outputs[0].token_ids) for o in outs) == 40
        assert outs[-1].outputs[0].finish_reason == "length"
        assert not engine.errored
        asyncio.run(engine.check_health())
        wait_idle(engine)
    finally:
        engine.shutdown()


@pytest.mark.timeout(60)
def test_engine_death_reaches_every_stream(llama_dir, prompts):
    engine = make_engine(llama_dir, multiprocess=False, max_num_seqs=2)  # the fault is patched in
    try:
        runner = engine.engine_core.engine_core.model_runner
        calls = {"n": 0}
        orig = runner.execute_model

        def boom(*a, **k):
            calls["n"] += 1
            if calls["n"] > 5:
                raise RuntimeError("injected failure")
            return orig(*a, **k)
        runner.execute_model = boom
        seen = []
        listener_remove = engine.add_output_listener(lambda ids: seen.append(ids))
        cs = [engine.add_request(f"d{i}", p, SamplingParams(max_tokens=500, ignore_eos=True)) for i, p in enumerate(prompts)]
        t0 = time.monotonic()
        for c in cs:
            with pytest.raises(EngineDeadError, match="injected failure"):
                drain(c, timeout=5)
        assert time.monotonic() - t0 < 5
        assert engine.errored
        with pytest.raises(EngineDeadError, match="injected failure"):
            asyncio.run(engine.check_health())
        with pytest.raises(EngineDeadError):
            engine.add_request("late", prompts[0])
        assert seen  # listeners were told so gevent/C readers wake up
        listener_remove()
    finally:
        engine.shutdown()


@pytest.mark.timeout(120)
def test_aborted_id_is_free_at_once(llama_dir, prompts):
    # issue 12 kind 2: add_request("x") right after abort("x") raised "already in use"
    engine = make_engine(llama_dir)

    def tokens(outs):
        return [t for o in outs for t in o.outputs[0].token_ids]
    try:
        sp = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        ref = tokens(drain(engine.add_request("ref", prompts[1], sp.clone(max_tokens=5))))
        for n in (1, 2):
            old = engine.add_request("x", prompts[0], sp.clone(n=n, temperature=1.0 if n > 1 else 0.0))
            assert not old.get(timeout=30).finished
            engine.abort("x")
            new = engine.add_request("x", prompts[1], sp.clone(max_tokens=5))  # no "already in use"
            last = drain(old)[-1]
            assert last.finished and {c.finish_reason for c in last.outputs} == {"abort"}
            outs = drain(new)
            # the old request's late outputs never reach the new stream
            assert tokens(outs) == ref and outs[-1].outputs[0].finish_reason == "length"

        # a consumer that closes its generator frees the id too
        async def early_exit():
            gen = engine.generate(prompts[0], sp, "y")
            async for _ in gen:
                break
            await gen.aclose()
            return engine.add_request("y", prompts[1], sp.clone(max_tokens=5))
        assert tokens(drain(asyncio.run(early_exit()))) == ref
        wait_idle(engine)
    finally:
        engine.shutdown()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("multiprocess", [False, True])
def test_reset_prefix_cache_runs_on_the_engine_core(llama_dir, tokenizer, multiprocess):
    # issue 12 kind 4: vLLM's AsyncLLM.reset_prefix_cache(), through the client's utility call
    engine = make_engine(llama_dir, multiprocess=multiprocess, block_size=4)
    try:
        prompt = prompt_token_ids(tokenizer, 1, 40, 40, seed=17)[0]
        sp = SamplingParams(temperature=0, max_tokens=4)
        first = drain(engine.add_request("a", prompt, sp))[-1]
        assert drain(engine.add_request("b", prompt, sp))[-1].num_cached_tokens > 0
        busy = engine.add_request("busy", prompt, SamplingParams(max_tokens=500, ignore_eos=True,
                                                                 output_kind=RequestOutputKind.DELTA))
        busy.get(timeout=30)
        assert asyncio.run(engine.reset_prefix_cache()) is False  # blocks in use: nothing changes
        engine.abort("busy")
        wait_idle(engine)
        assert asyncio.run(engine.reset_prefix_cache()) is True
        again = drain(engine.add_request("c", prompt, sp))[-1]
        assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
    finally:
        engine.shutdown()
    with pytest.raises(EngineDeadError):
        asyncio.run(engine.reset_prefix_cache())


STATS_LINE = "Avg prompt throughput"


def _run_two(engine, prompts):
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for c in [engine.add_request(f"log{i}", p, sp) for i, p in enumerate(prompts[:2])]:
        drain(c)


def test_stats_request_and_startup_log_lines(llama_dir, prompts, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="pyengine")
    monkeypatch.setenv("VENGINE_LOG_STATS_INTERVAL", "0.2")
    engine = AsyncLLM.from_engine_args(EngineArgs(model=str(llama_dir), device="cpu", max_model_len=256,
                                                  num_gpu_blocks_override=32), multiprocess=False,
                                       log_requests=True)
    try:
        start = [r.getMessage() for r in caplog.records if "Engine core ready" in r.getMessage()]
        assert len(start) == 1
        for part in ("dtype float32", "device cpu", "max_model_len 256", "max_num_seqs 256",
                     "KV cache: 512 tokens (32 blocks of 16)", "maximum concurrency for 256-token requests: 2.00x"):
            assert part in start[0], (part, start[0])
        _run_two(engine, prompts)
        received = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Received request log")]
        assert len(received) == 2
        assert f"Received request log0: prompt: {len(prompts[0])} tokens, priority: 0, params: SamplingParams(" \
            in received[0] and "max_tokens=12" in received[0]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(
                r.levelno == logging.INFO and STATS_LINE in r.getMessage() and "generation throughput: 0.0 " not in
                r.getMessage() for r in caplog.records):
            time.sleep(0.05)
        busy = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and STATS_LINE in r.getMessage()
                and "generation throughput: 0.0 " not in r.getMessage()]
        assert busy, caplog.text
        assert "Running:" in busy[0] and "Waiting:" in busy[0] and "KV cache usage:" in busy[0]
        assert "Prefix cache hit rate:" in busy[0]
    finally:
        engine.shutdown()


def test_no_stats_or_request_lines_when_disabled(llama_dir, prompts, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG, logger="pyengine")
    monkeypatch.setenv("VENGINE_LOG_STATS_INTERVAL", "0.1")
    engine = make_engine(llama_dir, multiprocess=False, disable_log_stats=True)  # and log_requests off (default)
    output_thread = engine._output_thread.ident
    try:
        _run_two(engine, prompts)
        time.sleep(0.5)  # several intervals
    finally:
        engine.shutdown()
    # this engine's lines only: an engine another test of this worker left running logs its idle
    # stats line (DEBUG) every 10 s into the same process (a CI run caught one)
    assert not [r for r in caplog.records if r.thread == output_thread and STATS_LINE in r.getMessage()]
    assert "Received request" not in caplog.text
    assert "Engine core ready" in caplog.text  # the start-up line stays
