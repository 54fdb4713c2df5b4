"""RequestOutputCollector (single slot, DELTA merge, threads, asyncio, errors) and
OutputProcessor (n > 1 fan-in, stop strings, FINAL_ONLY, duplicates) with a real tokenizer."""
import asyncio
import threading
import time

import pytest

from pyengine.engine.output_processor import OutputProcessor, RequestOutputCollector
from pyengine.exceptions import EngineDeadError
from pyengine.messages import EngineCoreOutput, EngineCoreRequest, LogprobsEntry
from pyengine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pyengine.sampling_params import RequestOutputKind, SamplingParams

DELTA, CUMULATIVE, FINAL_ONLY = RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY


def ro(text, ids, finished=False, finish_reason=None, index=0, logprobs=None, rid="r", extra=()):
    outs = [CompletionOutput(index, text, list(ids), None, logprobs, finish_reason, None)]
    outs += list(extra)
    return RequestOutput(rid, "prompt", [1, 2], outs, finished, RequestMetrics(0.0), 0)


# ---- RequestOutputCollector ----------------------------------------------------------

def test_put_never_blocks_without_reader():
    c = RequestOutputCollector("r", DELTA)
    done = threading.Event()

    def producer():
        for i in range(2000):
            c.put(ro(str(i), [i]))
        c.put(ro("end", [], finished=True, finish_reason="stop"))
        done.set()

    t = threading.Thread(target=producer, daemon=True)
    t.start()
    assert done.wait(5), "put blocked with no reader"
    out = c.get(timeout=1)
    assert out.finished
    assert out.outputs[0].token_ids == list(range(2000))
    assert out.outputs[0].text == "".join(str(i) for i in range(2000)) + "end"
    assert c.finished


def test_delta_merge_when_reader_lags():
    c = RequestOutputCollector("r", DELTA)
    lp1, lp2, lp3 = {5: Logprob(-0.5, 1)}, {6: Logprob(-0.6, 1)}, {7: Logprob(-0.7, 2)}
    c.put(ro("Hel", [5], logprobs=[lp1]))
    c.put(ro("lo", [6], logprobs=[lp2]))
    c.put(ro(" world", [7], finished=True, finish_reason="length", logprobs=[lp3]))
    out = c.get_nowait()
    (co,) = out.outputs
    assert co.text == "Hello world"
    assert co.token_ids == [5, 6, 7]
    assert co.logprobs == [lp1, lp2, lp3]
    assert co.finish_reason == "length"
    assert out.finished is True
    assert c.finished
    assert c.get_nowait() is None


def test_delta_merge_keeps_unfinished_state_of_newer():
    c = RequestOutputCollector("r", DELTA)
    c.put(ro("a", [1]))
    c.put(ro("b", [2]))
    out = c.get_nowait()
    assert out.outputs[0].text == "ab" and out.outputs[0].finish_reason is None
    assert not out.finished and not c.finished
    assert c.get_nowait() is None


def test_delta_merge_n2_children():
    c = RequestOutputCollector("r", DELTA)
    c.put(ro("a", [1], index=0))
    c.put(ro("x", [9], index=1))
    c.put(ro("b", [2], index=0, extra=[CompletionOutput(1, "y", [8], None, None, "stop", None)]))
    out = c.get_nowait()
    assert [(o.index, o.text, o.token_ids, o.finish_reason) for o in out.outputs] == [
        (0, "ab", [1, 2], None), (1, "xy", [9, 8], "stop")]


def test_no_loss_across_threads():
    c = RequestOutputCollector("r", DELTA)
    N = 3000
    texts = [f"<{i}>" for i in range(N)]

    def producer():
        for i, t in enumerate(texts):
            c.put(ro(t, [i], finished=i == N - 1, finish_reason="length" if i == N - 1 else None))
            if i % 97 == 0:
                time.sleep(0.0005)

    t = threading.Thread(target=producer)
    t.start()
    got_text, got_ids, n_outputs = [], [], 0
    for out in c:  # iteration stops after the final output
        n_outputs += 1
        got_text.append(out.outputs[0].text)
        got_ids += out.outputs[0].token_ids
    t.join()
    assert "".join(got_text) == "".join(texts)
    assert got_ids == list(range(N))
    assert out.finished and out.outputs[0].finish_reason == "length"
    assert 1 <= n_outputs <= N
    assert c.finished
    assert c.get_nowait() is None


def test_cumulative_replaces():
    c = RequestOutputCollector("r", CUMULATIVE)
    c.put(ro("Hel", [5]))
    c.put(ro("Hello", [5, 6]))
    out = c.get_nowait()
    assert out.outputs[0].text == "Hello" and out.outputs[0].token_ids == [5, 6]
    c.put(ro("Hello!", [5, 6, 7], finished=True, finish_reason="stop"))
    out = c.get(timeout=1)
    assert out.outputs[0].text == "Hello!" and out.finished


def test_final_output_exactly_once_and_iteration_stops():
    c = RequestOutputCollector("r", DELTA)
    outs = []

    def producer():
        for i in range(5):
            c.put(ro(str(i), [i]))
            time.sleep(0.002)
        c.put(ro("!", [99], finished=True, finish_reason="stop"))

    t = threading.Thread(target=producer)
    t.start()
    for out in c:
        outs.append(out)
    t.join()
    assert sum(o.finished for o in outs) == 1
    assert outs[-1].finished
    assert all(not o.finished for o in outs[:-1])
    assert list(c) == []  # already finished: iteration yields nothing more
    assert "".join(o.outputs[0].text for o in outs) == "01234!"


def test_exception_raised_to_every_later_get():
    c = RequestOutputCollector("r", DELTA)
    c.put(ro("a", [1]))
    err = EngineDeadError("engine died")
    c.put(err)
    for _ in range(3):
        with pytest.raises(EngineDeadError):
            c.get(timeout=1)
        with pytest.raises(EngineDeadError):
            c.get_nowait()
    c.put(ro("b", [2], finished=True))  # nothing replaces the error
    with pytest.raises(EngineDeadError):
        c.get(timeout=1)
    with pytest.raises(EngineDeadError):
        next(iter(c))


def test_exception_wakes_blocked_reader():
    c = RequestOutputCollector("r", DELTA)
    errors = []

    def reader():
        try:
            c.get(timeout=5)
        except EngineDeadError as e:
            errors.append(e)

    t = threading.Thread(target=reader)
    t.start()
    time.sleep(0.05)
    c.put(EngineDeadError("x"))
    t.join(5)
    assert not t.is_alive() and len(errors) == 1


def test_get_timeout():
    c = RequestOutputCollector("r", DELTA)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        c.get(timeout=0.05)
    assert time.monotonic() - t0 >= 0.04
    assert c.get_nowait() is None


def test_get_async_with_producer_thread():
    c = RequestOutputCollector("r", DELTA)
    N = 200

    def producer():
        for i in range(N):
            c.put(ro(f"{i},", [i], finished=i == N - 1))
            if i % 10 == 0:
                time.sleep(0.001)

    async def consume():
        t = threading.Thread(target=producer)
        t.start()
        texts = []
        while True:
            out = await asyncio.wait_for(c.get_async(), 5)
            texts.append(out.outputs[0].text)
            if out.finished:
                break
        t.join()
        return "".join(texts)

    assert asyncio.run(consume()) == "".join(f"{i}," for i in range(N))
    assert c.finished


def test_get_async_raises_engine_dead():
    c = RequestOutputCollector("r", DELTA)

    async def consume():
        threading.Timer(0.02, c.put, args=(EngineDeadError("dead"),)).start()
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(c.get_async(), 5)

    asyncio.run(consume())


def test_put_after_cancelled_get_async_on_closed_loop():
    c = RequestOutputCollector("r", DELTA)

    async def give_up():
        with pytest.raises((asyncio.TimeoutError, TimeoutError)):
            await asyncio.wait_for(c.get_async(), 0.02)

    asyncio.run(give_up())  # the loop is closed now
    c.put(ro("x", [1], finished=True, finish_reason="abort"))  # must not raise
    assert c.get_nowait().outputs[0].finish_reason == "abort"


# ---- OutputProcessor ---------------------------------------------------------------

PROMPT = "def f(x):"


def enc(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def add(op, tokenizer, rid, params, prompt=PROMPT):
    ids = enc(tokenizer, prompt)
    if params.n == 1:
        core = [EngineCoreRequest(rid, ids, params, params.max_tokens or 16, 1.0)]
    else:
        core = [EngineCoreRequest(f"{i}_{rid}", ids, params.clone(n=1), params.max_tokens or 16, 1.0)
                for i in range(params.n)]
    coll = RequestOutputCollector(rid, params.output_kind)
    op.add_request(rid, prompt, ids, params, core, coll)
    return coll, [r.request_id for r in core]


def test_n2_fan_in_one_output_per_step(tokenizer):
    op = OutputProcessor(tokenizer)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=3)
    coll, (c0, c1) = add(op, tokenizer, "req", params)
    a = enc(tokenizer, " return the value")
    b = enc(tokenizer, " of x and")
    assert len(a) >= 2 and len(b) >= 2

    deliveries, aborts = op.process_outputs([EngineCoreOutput(c0, [a[0]]), EngineCoreOutput(c1, [b[0]])], 2.0)
    assert aborts == []
    assert len(deliveries) == 1
    col, out = deliveries[0]
    assert col is coll and out.request_id == "req"
    assert [o.index for o in out.outputs] == [0, 1]
    assert not out.finished
    assert out.outputs[0].token_ids == [a[0]] and out.outputs[1].token_ids == [b[0]]

    deliveries, _ = op.process_outputs(
        [EngineCoreOutput(c0, a[1:], finish_reason="length"), EngineCoreOutput(c1, [b[1]])], 3.0)
    assert len(deliveries) == 1
    out = deliveries[0][1]
    assert not out.finished
    assert out.outputs[0].finish_reason == "length" and out.outputs[1].finish_reason is None
    assert out.outputs[0].text == tokenizer.decode(a)
    assert op.has_request("req")
    assert op.core_ids("req") == [c1]

    deliveries, _ = op.process_outputs([EngineCoreOutput(c1, b[2:], finish_reason="length")], 4.0)
    assert len(deliveries) == 1
    out = deliveries[0][1]
    assert out.finished
    assert [o.finish_reason for o in out.outputs] == ["length", "length"]
    assert out.outputs[0].text == tokenizer.decode(a)
    assert out.outputs[1].text == tokenizer.decode(b)
    assert out.outputs[1].token_ids == b
    assert out.metrics.first_token_time == 2.0 and out.metrics.finished_time == 4.0
    assert not op.has_request("req") and op.get_num_unfinished_requests() == 0


def test_n2_delta_fan_in(tokenizer):
    op = OutputProcessor(tokenizer)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=3, output_kind=DELTA)
    coll, (c0, c1) = add(op, tokenizer, "req", params)
    a = enc(tokenizer, " return the value")
    b = enc(tokenizer, " of x")
    steps = [[EngineCoreOutput(c0, [a[0]]), EngineCoreOutput(c1, [b[0]])],
             [EngineCoreOutput(c0, [a[1]])],
             [EngineCoreOutput(c1, b[1:], finish_reason="stop", stop_reason=None)],
             [EngineCoreOutput(c0, a[2:], finish_reason="length")]]
    texts = {0: "", 1: ""}
    finished = []
    for i, s in enumerate(steps):
        deliveries, _ = op.process_outputs(s, float(i))
        assert len(deliveries) == 1
        out = deliveries[0][1]
        finished.append(out.finished)
        for o in out.outputs:
            texts[o.index] += o.text
    assert finished == [False, False, False, True]
    # a "stop" finish means the last token is a stop token: kept in ids, not detokenized
    assert texts == {0: tokenizer.decode(a), 1: tokenizer.decode(b[:-1])}


def test_stop_string_finishes_and_returns_core_id_to_abort(tokenizer):
    op = OutputProcessor(tokenizer)
    params = SamplingParams(stop=["value"], max_tokens=20)
    coll, (core_id,) = add(op, tokenizer, "req", params)
    toks = enc(tokenizer, " return the value of x")
    outs, aborts_all = [], []
    for i, t in enumerate(toks):
        deliveries, aborts = op.process_outputs([EngineCoreOutput(core_id, [t])], float(i))
        aborts_all += aborts
        outs += [o for _, o in deliveries]
        if outs and outs[-1].finished:
            break
    assert aborts_all == [core_id]
    final = outs[-1]
    assert final.finished
    (co,) = final.outputs
    assert co.finish_reason == "stop" and co.stop_reason == "value"
    assert co.text == " return the "
    assert "value" not in "".join(o.outputs[0].text for o in outs)
    assert not op.has_request("req")
    # late outputs of the aborted core request are ignored
    deliveries, aborts = op.process_outputs([EngineCoreOutput(core_id, [toks[-1]])], 99.0)
    assert deliveries == [] and aborts == []
    deliveries, aborts = op.process_outputs([EngineCoreOutput(core_id, [], finish_reason="abort")], 99.0)
    assert deliveries == [] and aborts == []


def test_stop_string_on_final_token_not_aborted(tokenizer):
    op = OutputProcessor(tokenizer)
    params = SamplingParams(stop=["the"], max_tokens=2)
    coll, (core_id,) = add(op, tokenizer, "req", params)
    toks = enc(tokenizer, " return the")
    assert len(toks) == 2
    op.process_outputs([EngineCoreOutput(core_id, [toks[0]])], 0.0)
    deliveries, aborts = op.process_outputs([EngineCoreOutput(core_id, [toks[1]], finish_reason="length")], 1.0)
    assert aborts == []  # the core already finished it
    out = deliveries[0][1]
    assert out.finished and out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == "the"
    assert out.outputs[0].text == " return "


def test_final_only_yields_exactly_one_output(tokenizer):
    op = OutputProcessor(tokenizer)
    params = SamplingParams(max_tokens=3, output_kind=FINAL_ONLY)
    coll, (core_id,) = add(op, tokenizer, "req", params)
    toks = enc(tokenizer, " return the value")
    all_deliveries = []
    for i, t in enumerate(toks):
        fr = "length" if i == len(toks) - 1 else None
        deliveries, _ = op.process_outputs([EngineCoreOutput(core_id, [t], finish_reason=fr)], float(i))
        all_deliveries += deliveries
    assert len(all_deliveries) == 1
    col, out = all_deliveries[0]
    col.put(out)
    got = list(coll)
    assert len(got) == 1 and got[0].finished
    assert got[0].outputs[0].text == " return the value"
    assert got[0].outputs[0].token_ids == toks
    assert got[0].outputs[0].finish_reason == "length"


def test_abort_output_finishes_request(tokenizer):
    op = OutputProcessor(tokenizer)
    coll, (core_id,) = add(op, tokenizer, "req", SamplingParams(max_tokens=10, output_kind=DELTA))
    toks = enc(tokenizer, " return")
    op.process_outputs([EngineCoreOutput(core_id, toks)], 0.0)
    deliveries, aborts = op.process_outputs([EngineCoreOutput(core_id, [], finish_reason="abort")], 1.0)
    assert aborts == []
    out = deliveries[0][1]
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert not op.has_request("req")


def test_logprobs_and_cached_tokens(tokenizer):
    op = OutputProcessor(tokenizer)
    coll, (core_id,) = add(op, tokenizer, "req", SamplingParams(max_tokens=2, logprobs=1))
    t1, t2 = enc(tokenizer, " return the")
    op.process_outputs([EngineCoreOutput(core_id, [t1], [LogprobsEntry([t1, t2], [-0.5, -1.5], 1)],
                                         num_cached_tokens=4)], 0.0)
    deliveries, _ = op.process_outputs([EngineCoreOutput(core_id, [t2], [LogprobsEntry([t2, t1], [-0.25, -0.3], 1)],
                                                         finish_reason="length")], 1.0)
    out = deliveries[0][1]
    co = out.outputs[0]
    assert out.num_cached_tokens == 4
    assert co.cumulative_logprob == pytest.approx(-0.75)
    assert len(co.logprobs) == 2
    assert co.logprobs[0][t1].logprob == -0.5 and co.logprobs[0][t1].rank == 1
    assert co.logprobs[0][t2].rank == 1  # the top-1 entry
    assert co.logprobs[1][t2].decoded_token == tokenizer.decode([t2])


def test_duplicate_request_id_rejected(tokenizer):
    op = OutputProcessor(tokenizer)
    add(op, tokenizer, "req", SamplingParams())
    with pytest.raises(ValueError):
        add(op, tokenizer, "req", SamplingParams())
    # a core id already used by another request is a duplicate too
    ids = enc(tokenizer, PROMPT)
    with pytest.raises(ValueError):
        op.add_request("other", PROMPT, ids, SamplingParams(),
                       [EngineCoreRequest("req", ids, SamplingParams(), 16, 0.0)], None)
    assert not op.has_request("other")
    assert op.get_num_unfinished_requests() == 1


@pytest.mark.parametrize("kind", [DELTA, CUMULATIVE])
def test_stream_interval_coalesces_deltas(tokenizer, kind):
    """stream_interval=3: the first token at once, then every third token, the end at once;
    concatenated, the text and ids are the same as with stream_interval=1."""
    toks = enc(tokenizer, " return the value of x and the rest of it all")[:8]
    assert len(toks) == 8
    got = {}
    for interval in (1, 3):
        op = OutputProcessor(tokenizer, stream_interval=interval)
        coll, (core_id,) = add(op, tokenizer, "req", SamplingParams(max_tokens=8, output_kind=kind))
        outs = []
        for i, t in enumerate(toks):
            fin = "length" if i == len(toks) - 1 else None
            deliveries, _ = op.process_outputs([EngineCoreOutput(core_id, [t], finish_reason=fin)], float(i))
            outs.append([o for _, o in deliveries])
        got[interval] = outs
    sizes = [len(d[0].outputs[0].token_ids) if d else 0 for d in got[3]]
    if kind == DELTA:
        assert sizes == [1, 0, 0, 3, 0, 0, 3, 1]
        text = "".join(d[0].outputs[0].text for d in got[3] if d)
        assert text == "".join(d[0].outputs[0].text for d in got[1]) == tokenizer.decode(toks)
        assert [t for d in got[3] if d for t in d[0].outputs[0].token_ids] == toks
    else:
        assert sizes == [1, 0, 0, 4, 0, 0, 7, 8]
        assert got[3][-1][0].outputs[0].text == got[1][-1][0].outputs[0].text == tokenizer.decode(toks)
    assert [bool(d) for d in got[1]] == [True] * 8


def test_asyncio_readers_woken_once_per_loop(monkeypatch):
    """Many asyncio readers of one loop are woken with a single call_soon_threadsafe."""
    from pyengine.engine.output_processor import wake_asyncio_readers

    async def main():
        loop = asyncio.get_running_loop()
        calls = []
        orig = loop.call_soon_threadsafe
        monkeypatch.setattr(loop, "call_soon_threadsafe", lambda *a: (calls.append(a), orig(*a))[1])
        cs = [RequestOutputCollector(f"r{i}", DELTA) for i in range(50)]
        tasks = [asyncio.ensure_future(c.get_async()) for c in cs]
        await asyncio.sleep(0.05)  # every reader waits

        def produce():
            waiters = [c.put(ro(str(i), [i], rid=c.request_id), wake_asyncio=False) for i, c in enumerate(cs)]
            wake_asyncio_readers([w for w in waiters if w is not None])
        t = threading.Thread(target=produce)
        t.start()
        outs = await asyncio.wait_for(asyncio.gather(*tasks), 5)
        t.join()
        assert [o.outputs[0].token_ids for o in outs] == [[i] for i in range(50)]
        assert len(calls) == 1
    asyncio.run(main())


@pytest.mark.parametrize("kind", [DELTA, CUMULATIVE, FINAL_ONLY])
def test_abort_ends_the_request_here_and_frees_its_id(tokenizer, kind):
    op = OutputProcessor(tokenizer)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=3, output_kind=kind)
    coll, (c0, c1) = add(op, tokenizer, "req", params)
    a = enc(tokenizer, " return the value")
    op.process_outputs([EngineCoreOutput(c0, a[:3], finish_reason="length"), EngineCoreOutput(c1, a[:1])], 2.0)
    core_ids, deliveries = op.abort_requests(["req", "unknown"], 3.0)
    assert core_ids == [c1]  # only the unfinished completion is still in the engine core
    (col, out), = deliveries
    assert col is coll and out.finished and out.metrics.finished_time == 3.0
    reasons = {o.index: o.finish_reason for o in out.outputs}
    assert reasons[1] == "abort" and (kind == DELTA or reasons[0] == "length")
    if kind == FINAL_ONLY:
        assert out.outputs[1].text == tokenizer.decode(a[:1])
    assert not op.has_request("req") and op.core_ids("req") == []
    # the id is free again; the old core request's late outputs are ignored
    coll2, _ = add(op, tokenizer, "req", SamplingParams(max_tokens=3, output_kind=kind))
    assert op.process_outputs([EngineCoreOutput(c1, a[1:2], finish_reason="abort")], 4.0) == ([], [])
    assert op.abort_requests(["req"], 5.0)[0] == ["req"]


def test_iteration_stats_count_computed_prompt_and_generated_tokens(tokenizer):
    from pyengine.metrics import IterationStats

    op = OutputProcessor(tokenizer)
    _, (a,) = add(op, tokenizer, "a", SamplingParams(max_tokens=8))
    _, (b,) = add(op, tokenizer, "b", SamplingParams(max_tokens=8), prompt="import os\nimport sys")
    plen_a, plen_b = len(enc(tokenizer, PROMPT)), len(enc(tokenizer, "import os\nimport sys"))
    it = IterationStats()
    # a's first token (4 of its prompt tokens came from the prefix cache); b still prefilling
    op.process_outputs([EngineCoreOutput(a, [5], num_cached_tokens=4)], 1.0, it)
    assert (it.num_prompt_tokens, it.num_generation_tokens) == (plen_a - 4, 1)
    it = IterationStats()
    op.process_outputs([EngineCoreOutput(a, [6, 7]), EngineCoreOutput(b, [8])], 2.0, it)
    assert (it.num_prompt_tokens, it.num_generation_tokens) == (plen_b, 3)
    it = IterationStats()
    op.process_outputs([EngineCoreOutput(a, [], finish_reason="abort")], 3.0, it)
    assert (it.num_prompt_tokens, it.num_generation_tokens) == (0, 0)


def _stream(op, tokenizer, params, steps, prompt):
    """Every (collector, RequestOutput) of one request fed ``steps`` (lists of token ids,
    the last one finishing it), as (text, token_ids, finished, metrics fields)."""
    _, (cid,) = add(op, tokenizer, "s", params, prompt)
    seen = []
    for k, ids in enumerate(steps):
        last = k == len(steps) - 1
        deliveries, _ = op.process_outputs(
            [EngineCoreOutput(cid, list(ids), finish_reason="length" if last else None,
                              first_scheduled_time=1.5 if k == 0 else None)], 2.0 + k)
        for _, out in deliveries:
            (c,) = out.outputs
            m = out.metrics
            seen.append((c.index, c.text, c.token_ids, c.finish_reason, c.cumulative_logprob, c.logprobs,
                         out.finished, out.prompt, out.prompt_token_ids, out.num_cached_tokens,
                         (m.arrival_time, m.first_token_time, m.last_token_time, m.finished_time,
                          m.first_scheduled_time)))
    return seen


@pytest.mark.parametrize("prompt", [PROMPT, "naïve caf\u00e9 \u4f60"])
def test_streamed_fast_path_equals_general_path(tokenizer, prompt):
    """The one-token step of a streamed n=1 request (OutputProcessor's fast path) gives
    the RequestOutputs the general path gives, multi-byte characters split over tokens
    included (a step whose token completes no character has empty text)."""
    params = SamplingParams(max_tokens=64, output_kind=DELTA)
    ids = enc(tokenizer, " le caf\u00e9 \u4f60\u597d \U0001f600 ok, done.")
    steps = [[t] for t in ids]
    fast_op = OutputProcessor(tokenizer)
    fast = _stream(fast_op, tokenizer, params, steps, prompt)
    slow_op = OutputProcessor(tokenizer)
    orig = slow_op.add_request

    def add_slow(*a, **kw):
        orig(*a, **kw)
        for c in slow_op.children.values():
            c.fast = False
    slow_op.add_request = add_slow
    slow = _stream(slow_op, tokenizer, params, steps, prompt)
    assert fast == slow
    assert "".join(s[1] for s in fast) == tokenizer.decode(ids)
    assert any(s[1] == "" for s in fast)  # a byte-level token inside a character
    assert fast_op.get_num_unfinished_requests() == 0


def test_fast_path_only_for_streamed_single_completions(tokenizer):
    op = OutputProcessor(tokenizer)
    cases = {"delta": (SamplingParams(output_kind=DELTA), True),
             "cumulative": (SamplingParams(output_kind=CUMULATIVE), False),
             "final": (SamplingParams(output_kind=FINAL_ONLY), False),
             "stop": (SamplingParams(output_kind=DELTA, stop=["x"]), False),
             "logprobs": (SamplingParams(output_kind=DELTA, logprobs=1), False),
             "n2": (SamplingParams(output_kind=DELTA, n=2, temperature=1.0), False)}
    for rid, (params, fast) in cases.items():
        add(op, tokenizer, rid, params)
        assert all(c.fast == fast for c in op.parents[rid].children), rid
    op2 = OutputProcessor(tokenizer, stream_interval=2)
    add(op2, tokenizer, "r", SamplingParams(output_kind=DELTA))
    assert not op2.parents["r"].children[0].fast
