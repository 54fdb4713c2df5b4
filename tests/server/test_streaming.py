"""Streaming is real: the first chunk arrives long before generation ends and chunks are
spread over the generation (arrival times on a raw socket), at concurrency 1 and 32."""
from __future__ import annotations

import threading

import pytest

from tests.server.conftest import MODEL_NAME
from tests.server.http_util import collect_stream

MAX_TOKENS = 32
# At concurrency 32 on a 2-core box, admitting 32 streams takes a fixed slice of time and
# a lagging reader gets several tokens per delivery (the collector merges them): a longer
# generation keeps both checks about streaming, not about that fixed cost.
MAX_TOKENS_32 = 128


def _check_spread(status, events, t_sent, max_tokens, min_deliveries=None):
    assert status == 200
    assert events[-1][1] == "[DONE]"
    content = [(t, e) for t, e in events[:-1] if e["choices"] and e["choices"][0].get("text")]
    assert content, events
    t_first, t_end = content[0][0], events[-1][0]
    total = t_end - t_sent
    # the first token is out well before the end (a server that buffers the response sends
    # it with the last one; 0.75, not 0.5: admitting 32 streams on a loaded 2-core box can
    # take a good part of the stream's time) ...
    assert t_first - t_sent < 0.75 * total, (t_first - t_sent, total)
    # ... and the rest comes in many separate deliveries, none holding most of the stream
    times = sorted({round(t, 4) for t, _ in content})
    assert len(times) >= (min_deliveries or max_tokens // 4), len(times)
    # deliveries land in at least 3 of the 4 quarters between first chunk and end
    span = max(t_end - t_first, 1e-9)
    quarters = {min(3, int(4 * (t - t_first) / span)) for t in times}
    assert len(quarters) >= 3, (quarters, [round(t - t_sent, 3) for t in times], total)
    n_tokens = sum(1 for _, e in content)
    assert n_tokens <= max_tokens


def _body(i=0, max_tokens=MAX_TOKENS):
    return {"model": MODEL_NAME, "prompt": f"class Foo{i}:\n    def", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}


def test_stream_timing_concurrency_1(server):
    status, events, t_sent = collect_stream(server.port, "/v1/completions", _body())
    _check_spread(status, events, t_sent, MAX_TOKENS)


def test_stream_timing_concurrency_32(server):
    results = [None] * 32
    barrier = threading.Barrier(32)

    def run(i):
        barrier.wait()
        results[i] = collect_stream(server.port, "/v1/completions", _body(i, MAX_TOKENS_32))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for r in results:
        assert r is not None
        _check_spread(*r, MAX_TOKENS_32, min_deliveries=MAX_TOKENS_32 // 8)


def test_chat_stream_role_chunk_first(server):
    status, events, t_sent = collect_stream(
        server.port, "/v1/chat/completions",
        {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16,
         "temperature": 0, "ignore_eos": True, "stream": True})
    assert status == 200
    first = events[0][1]
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    # the role chunk goes out at once, before the first generated token
    assert events[0][0] <= events[1][0]
    assert events[-1][1] == "[DONE]"
    assert events[-2][1]["choices"][0]["finish_reason"] == "length"



FORCED = "\u65e5\u672c\u8a9e"  # three 3-byte characters: one byte token each here, 2 of 3 showing no text


@pytest.fixture(scope="module")
def paced_server(llama_dir):
    """An in-process engine 30 ms a step, served: the reader keeps up with every step,
    so no two deltas are merged and every token has its own chunk."""
    from tests.server.conftest import make_engine, serve_app, slow_steps

    engine = make_engine(llama_dir, multiprocess=False)
    slow_steps(engine, 0.03)
    yield from serve_app(engine, served_model_name=[MODEL_NAME])
    engine.shutdown()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("logprobs", [False, True])
def test_a_token_without_text_still_gets_its_chunk(paced_server, path, logprobs):
    # issue 23: a delta whose text is empty (a token that completes no character yet, a
    # special token not shown) was not sent; vLLM sends a chunk whenever there are new
    # token ids, with text "" (time to first token; token_ids / logprobs consumers)
    chat = path.endswith("chat/completions")
    body = {"model": MODEL_NAME, "max_tokens": 32, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "structured_outputs": {"regex": FORCED}}
    if chat:
        body.update(messages=[{"role": "user", "content": "hi"}], logprobs=logprobs)
    else:
        body.update(prompt="hi", **({"logprobs": 0} if logprobs else {}))
    status, events, _ = collect_stream(paced_server.port, path, body)
    assert status == 200, events
    assert events[-1][1] == "[DONE]"
    usage = events[-2][1]["usage"]
    chunks = [e["choices"][0] for _, e in events[:-1] if e["choices"]]
    if chat:
        assert chunks[0]["delta"] == {"role": "assistant", "content": ""}
        chunks = chunks[1:]
    texts = [c["delta"].get("content") if chat else c["text"] for c in chunks]
    assert None not in texts, chunks  # chat: {"content": ""}, as vLLM's delta, not {}
    assert "".join(texts) == FORCED and chunks[-1]["finish_reason"] == "stop", chunks
    # 9 byte tokens and the end of sequence, one chunk each: 6 bytes and the end show no text
    assert usage["completion_tokens"] == len(FORCED.encode()) + 1
    assert len(chunks) == usage["completion_tokens"], texts
    assert texts.count("") == 7, texts
    if logprobs:
        assert [len(c["logprobs"]["content"] if chat else c["logprobs"]["tokens"]) for c in chunks] == \
            [1] * len(chunks)
