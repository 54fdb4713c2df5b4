"""The openai client against a live server on the tiny CPU model: completions and chat,
stream and non-stream, n > 1, include_usage, logprobs, stop strings, batch prompts."""
from __future__ import annotations

import pytest

from tests.server.conftest import MODEL_NAME
from tests.server.http_util import get, metrics

PROMPT = "def main(args):\n    return"


def _stream_text(chunks, chat: bool):
    texts, finish, usage, roles = {}, {}, None, {}
    for ch in chunks:
        if ch.usage is not None and not ch.choices:
            usage = ch.usage
            continue
        for c in ch.choices:
            if chat:
                if c.delta.role:
                    roles[c.index] = c.delta.role
                t = c.delta.content or ""
            else:
                t = c.text or ""
            texts[c.index] = texts.get(c.index, "") + t
            if c.finish_reason is not None:
                assert c.index not in finish, "finish_reason sent twice"
                finish[c.index] = c.finish_reason
    return texts, finish, usage, roles


def test_models_health_version(server, client):
    models = client.models.list()
    ids = [m.id for m in models.data]
    assert ids == [MODEL_NAME, "alias"]
    assert get(server.port, "/health")[0] == 200
    status, _, body = get(server.port, "/version")
    assert status == 200 and b"version" in body


def test_completion_stream_equals_non_stream(client):
    full = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert full.object == "text_completion"
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 24
    assert full.usage.total_tokens == full.usage.prompt_tokens + 24
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    texts, finish, usage, _ = _stream_text(chunks, chat=False)
    assert texts == {0: full.choices[0].text}
    assert finish == {0: "length"}
    # the usage chunk is last, with no choices, and agrees with the non-streamed usage
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert usage.prompt_tokens == full.usage.prompt_tokens
    assert usage.completion_tokens == full.usage.completion_tokens == 24
    # finish_reason rides on the last content chunk
    content = [c for c in chunks if c.choices]
    assert content[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert len({c.id for c in chunks}) == 1


def test_chat_stream_equals_non_stream(client):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi"}]
    full = client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=20, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert full.object == "chat.completion"
    msg = full.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str) and msg.content
    assert full.usage.completion_tokens == 20
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=20,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    texts, finish, usage, roles = _stream_text(chunks, chat=True)
    assert texts == {0: msg.content}
    assert roles == {0: "assistant"}
    assert finish == {0: "length"}
    assert (usage.prompt_tokens, usage.completion_tokens) == (full.usage.prompt_tokens, 20)


def test_max_completion_tokens(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}],
                                       max_completion_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5


@pytest.mark.parametrize("stream", [False, True])
def test_n_greater_than_one(client, stream):
    kw = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=1.0, n=3, seed=7,
              extra_body={"ignore_eos": True})
    if stream:
        chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        texts, finish, usage, _ = _stream_text(chunks, chat=False)
        assert sorted(texts) == [0, 1, 2] and finish == {0: "length", 1: "length", 2: "length"}
        assert usage.completion_tokens == 36
    else:
        r = client.completions.create(**kw)
        assert sorted(c.index for c in r.choices) == [0, 1, 2]
        assert all(c.finish_reason == "length" for c in r.choices)
        assert r.usage.completion_tokens == 36


def test_chat_n_stream(client):
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hello"}], max_tokens=6, n=2,
        temperature=0.9, stream=True, extra_body={"ignore_eos": True}))
    texts, finish, _, roles = _stream_text(chunks, chat=True)
    assert roles == {0: "assistant", 1: "assistant"}
    assert finish == {0: "length", 1: "length"}


def test_batch_prompts_and_token_ids(client, engine):
    ids = engine.tokenizer(PROMPT).input_ids
    r = client.completions.create(model=MODEL_NAME, prompt=[PROMPT, "import os"], max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    r_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert r_ids.choices[0].text == r.choices[0].text
    assert r.usage.prompt_tokens == len(ids) + len(engine.tokenizer("import os").input_ids)


def test_stop_string(client):
    base = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[len(base) // 2: len(base) // 2 + 2]
    assert stop.strip(), base
    cut = base[: base.index(stop)]
    for stream in (False, True):
        if stream:
            chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0,
                                                    stop=[stop], stream=True, extra_body={"ignore_eos": True}))
            texts, finish, _, _ = _stream_text(chunks, chat=False)
            assert texts[0] == cut and finish[0] == "stop"
        else:
            r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0,
                                          stop=[stop], extra_body={"ignore_eos": True})
            assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"


def test_logprobs(client):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(1 <= len(t) <= 2 for t in lp.top_logprobs)
    c = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4, temperature=0, logprobs=True, top_logprobs=3,
                                       extra_body={"ignore_eos": True})
    content = c.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        # greedy: the sampled token is the most likely one
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4, temperature=0, logprobs=True, top_logprobs=3,
                                                 stream=True, extra_body={"ignore_eos": True}))
    streamed = [i for ch in chunks for c in ch.choices if c.logprobs for i in c.logprobs.content]
    assert [i.token for i in streamed] == [i.token for i in content]


def test_echo(client):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, echo=True,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text.startswith(PROMPT) and len(r.choices[0].text) > len(PROMPT)


def test_metrics_names_and_counts(server, client):
    before = metrics(server.port)
    client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=7, temperature=0,
                              extra_body={"ignore_eos": True})
    after = metrics(server.port)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
        assert name in after, name
    assert after["vllm:generation_tokens_total"] - before.get("vllm:generation_tokens_total", 0) == 7
    assert after["vllm:time_to_first_token_seconds_count"] - before.get("vllm:time_to_first_token_seconds_count", 0) == 1
    assert after["vllm:e2e_request_latency_seconds_count"] - before.get("vllm:e2e_request_latency_seconds_count", 0) == 1
    assert after["vllm:inter_token_latency_seconds_count"] - before.get("vllm:inter_token_latency_seconds_count", 0) == 6
    assert after["vllm:prompt_tokens_total"] > before.get("vllm:prompt_tokens_total", 0)
