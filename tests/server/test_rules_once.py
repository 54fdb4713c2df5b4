"""Each request rule runs once per request (issue 24): the serving object runs the
Processor's rules, tokenizes, and hands the engine a processed request that nothing
checks again. Counted over HTTP on a completion, a chat, a response and a message, streamed
and not."""
from __future__ import annotations

import json
from collections import Counter

import pytest

from tests.server.conftest import MODEL_NAME
from tests.server.http_util import post

# The Processor's rules (and its tokenization), each once per single-prompt request.
COMMON = ("check_params", "check_logprobs", "check_priority", "check_stop_token_ids", "check_cache_salt",
          "check_prompt_text", "encode", "check_encoded", "finish_prompt", "check_prompt_length", "engine_request",
          "bad_words_token_ids", "check_allowed_token_ids", "validate_structured_outputs")
ONCE = {"/v1/completions": COMMON + ("check_prompt",), "/v1/chat/completions": COMMON + ("encode_prompt",)}
NEVER = ("process", "tokenize")  # the engine's own path: no rule again at admission


@pytest.fixture
def calls(engine, monkeypatch):
    """Counts of calls of the Processor's rules on the served engine."""
    counts: Counter = Counter()
    processor = engine.processor
    for name in set(ONCE["/v1/completions"] + ONCE["/v1/chat/completions"] + NEVER + BUILT_ON_CHAT):
        fn = getattr(processor, name)

        def counted(*a, _fn=fn, _name=name, **k):
            counts[_name] += 1
            return _fn(*a, **k)
        monkeypatch.setattr(processor, name, counted)
    return counts


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_each_rule_runs_once(server, calls, path, stream):
    body = {"model": MODEL_NAME, "max_tokens": 3, "temperature": 0, "stream": stream, "logprobs": 1,
            "stop_token_ids": [3], "priority": 0, "cache_salt": "s", "structured_outputs": {"regex": "[a-z ]+"}}
    if path == "/v1/completions":
        body["prompt"] = "Hello there"
    else:
        body.update(messages=[{"role": "user", "content": "Hello there"}], logprobs=True, top_logprobs=1)
    status, _, data = post(server.port, path, body)
    assert status == 200, data
    if stream:
        events = [line[6:] for line in data.decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and all("error" not in json.loads(e) for e in events[:-1])
    else:
        assert json.loads(data)["usage"]["completion_tokens"] >= 1
    assert {name: calls[name] for name in ONCE[path]} == {name: 1 for name in ONCE[path]}
    assert {name: calls[name] for name in NEVER} == {name: 0 for name in NEVER}


def test_the_count_sees_a_second_run(engine, calls):
    """The counter itself: the engine's own path (``Processor.process``) runs the rules
    again on a request the serving object already checked."""
    from pyengine import SamplingParams

    engine.processor.process("twice", [5, 6], SamplingParams(max_tokens=1))
    assert calls["check_logprobs"] == 1 and calls["process"] == 1


# The endpoints built on chat (a body without logprobs or a constraint): the chat rules
# once, through the same run as a chat completion.
BUILT_ON_CHAT = ("check_params", "check_priority", "check_stop_token_ids", "check_cache_salt", "encode_prompt",
                 "check_encoded", "finish_prompt", "check_prompt_length", "engine_request")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
def test_each_rule_runs_once_built_on_chat(server, calls, path, stream):
    if path == "/v1/responses":
        body = {"model": MODEL_NAME, "input": "Hello there", "max_output_tokens": 3, "temperature": 0}
    else:
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 3,
                "temperature": 0}
    body["stream"] = stream
    status, _, data = post(server.port, path, body)
    assert status == 200, data
    if stream:
        assert b"event: error" not in data and b'"type":"error"' not in data.replace(b" ", b"")
    else:
        assert json.loads(data)["usage"]["output_tokens"] >= 1
    assert {name: calls[name] for name in BUILT_ON_CHAT} == {name: 1 for name in BUILT_ON_CHAT}
    assert {name: calls[name] for name in NEVER} == {name: 0 for name in NEVER}
