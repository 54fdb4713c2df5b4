"""Context-length defaults over HTTP (issue 17 kind 4) and priority at the seat cap (kind 1),
each on its own engine: ``--max-model-len 256``; ``--max-num-seqs 2 --scheduling-policy
priority``."""
from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest

from tests.server.http_util import SSEStream, post

NAME = "tiny-llama"


def _serve(model_dir, **engine_kw):
    from server import BackgroundServer, create_app
    from tests.server.conftest import make_engine

    engine = make_engine(model_dir, **engine_kw)
    return engine, BackgroundServer(create_app(engine, SimpleNamespace(served_model_name=[NAME])), port=0).start()


@pytest.fixture(scope="module")
def server_256(llama_dir):
    engine, srv = _serve(llama_dir, max_model_len=256, num_gpu_blocks_override=64)
    yield srv
    srv.stop()
    engine.shutdown()


def _chat_messages_of_length(tokenizer, n):
    """Messages whose chat-template rendering (what the server feeds) is ``n`` tokens."""
    def length(content):
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)
        return len(tokenizer(text, add_special_tokens=False).input_ids)
    words = ""
    while length(words + " x") < n:
        words += " x"
    for tail in ("", "y", "yy", "yyy", ".", ".."):
        if length(words + tail) == n:
            return [{"role": "user", "content": words + tail}]
    raise AssertionError(f"no message renders to exactly {n} tokens")


@pytest.mark.parametrize("stream", [False, True])
def test_default_max_tokens_capped_at_the_room_left(server_256, stream):
    # Issue 17: a 255-token prompt with max_model_len 256 and no max_tokens got a 400 "you
    # requested 271 tokens (255 in the prompt, 16 in the completion)". The default is capped.
    body = {"model": NAME, "prompt": [5] * 255, "temperature": 0, "ignore_eos": True, "stream": stream}
    status, _, data = post(server_256.port, "/v1/completions", body)
    assert status == 200, data
    if not stream:
        out = json.loads(data)
        assert out["usage"] == {"prompt_tokens": 255, "completion_tokens": 1, "total_tokens": 256}
        assert out["choices"][0]["finish_reason"] == "length"


def test_default_max_tokens_below_the_room_is_16(server_256):
    status, _, data = post(server_256.port, "/v1/completions",
                           {"model": NAME, "prompt": [5] * 100, "temperature": 0, "ignore_eos": True})
    assert status == 200 and json.loads(data)["usage"]["completion_tokens"] == 16


def test_chat_without_max_tokens_gets_the_room_left(server_256, tokenizer):
    msgs = _chat_messages_of_length(tokenizer, 250)
    status, _, data = post(server_256.port, "/v1/chat/completions",
                           {"model": NAME, "messages": msgs, "temperature": 0, "ignore_eos": True})
    assert status == 200, data
    assert json.loads(data)["usage"] == {"prompt_tokens": 250, "completion_tokens": 6, "total_tokens": 256}


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": [5] * 255, "max_tokens": 16}),
    ("/v1/chat/completions", None),
])
@pytest.mark.parametrize("stream", [False, True])
def test_explicit_max_tokens_that_does_not_fit_is_400(server_256, tokenizer, path, body, stream):
    if body is None:
        body = {"messages": _chat_messages_of_length(tokenizer, 255), "max_tokens": 16}
    status, _, data = post(server_256.port, path, dict(body, model=NAME, stream=stream))
    assert status == 400, data
    err = json.loads(data)["error"]
    assert err["param"] == "max_tokens"
    assert err["message"].startswith("This model's maximum context length is 256 tokens. However, you "
                                     "requested 271 tokens (255 in the prompt, 16 in the completion).")


def test_priority_request_preempts_at_the_seat_cap(llama_dir):
    # Issue 17: --max-num-seqs 2 --scheduling-policy priority, two running
    # {"max_tokens":1000,"priority":10,"ignore_eos":true}, then {"prompt":"urgent",
    # "max_tokens":16,"priority":0}: its first token came only after a low request
    # finished. Now it preempts one, so it is done while both low ones still stream.
    engine, srv = _serve(llama_dir, max_model_len=1024, num_gpu_blocks_override=256, max_num_seqs=2,
                         scheduling_policy="priority")
    lows = []
    try:
        for i in range(2):
            s = SSEStream(srv.port, "/v1/completions",
                          {"model": NAME, "prompt": f"low {i}", "max_tokens": 1000, "priority": 10,
                           "ignore_eos": True, "temperature": 0, "stream": True})
            assert s.read_headers() == 200
            ev = s.events()
            next(ev)  # streaming: running
            lows.append((s, ev))
        status, _, data = post(srv.port, "/v1/completions",
                               {"model": NAME, "prompt": "urgent", "max_tokens": 16, "priority": 0,
                                "ignore_eos": True, "temperature": 0}, timeout=120)
        assert status == 200, data
        assert json.loads(data)["usage"]["completion_tokens"] == 16
        stats = engine.get_stats()
        assert stats.num_preemptions >= 1
        assert stats.num_running + stats.num_waiting == 2  # both low requests still unfinished
    finally:
        for s, _ in lows:
            s.close()
        srv.stop()
        engine.shutdown()
