"""Request fields that were accepted with 200 and ignored (issue 23 item 2), over HTTP on
both endpoints, with async scheduling on (the session engine, its core in a process of its
own) and off: bad_words, allowed_token_ids, return_tokens_as_token_ids, truncate_prompt_tokens,
request_id, chat echo with continue_final_message; max_completion_tokens on /v1/completions
and the vLLM fields vengine lacks are refused with a 400 naming them."""
from __future__ import annotations

import json

import pytest

from tests.helpers import banned_at, find_bad_word
from tests.server.conftest import MODEL_NAME, make_engine, serve_app
from tests.server.http_util import collect_stream, completion_text, post

PROMPTS = ["def main():", "import os\nimport sys\n", "class Foo(object):", "for i in range(10):",
           "    return self.", "if __name__ =="]


@pytest.fixture(scope="module")
def sync_engine(llama_dir):
    eng = make_engine(llama_dir, async_scheduling=False)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def sync_server(sync_engine):
    yield from serve_app(sync_engine, served_model_name=[MODEL_NAME])


@pytest.fixture(params=["async", "sync"])
def served(request, engine, server, sync_engine, sync_server):
    """(engine, server) with async scheduling on (the session's) and off."""
    assert engine.config.async_scheduling and not sync_engine.config.async_scheduling
    return (engine, server) if request.param == "async" else (sync_engine, sync_server)


def _call(port, endpoint, prompt, **fields):
    """One greedy request; returns (status, body, generated token ids)."""
    if endpoint == "chat":
        path = "/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": prompt}], "logprobs": True, "top_logprobs": 0}
    else:
        path, body = "/v1/completions", {"prompt": prompt, "logprobs": 0}
    body.update(model=MODEL_NAME, temperature=0, max_tokens=24, ignore_eos=True, return_tokens_as_token_ids=True,
                **fields)
    status, _, raw = post(port, path, body)
    out = json.loads(raw)
    if status != 200:
        return status, out, None
    lp = out["choices"][0]["logprobs"]
    toks = [c["token"] for c in lp["content"]] if endpoint == "chat" else lp["tokens"]
    assert all(t.startswith("token_id:") for t in toks), toks[:3]
    return status, out, [int(t.split(":", 1)[1]) for t in toks]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bad_words(served, endpoint):
    engine, srv = served
    base = [_call(srv.port, endpoint, p)[2] for p in PROMPTS]
    for length in (1, 2):
        n, word, seqs = find_bad_word(engine.tokenizer, engine.processor, base, length)
        status, body, got = _call(srv.port, endpoint, PROMPTS[n], bad_words=[word])
        assert status == 200, body
        i = banned_at(base[n], seqs)
        assert got[:i] == base[n][:i] and got[i] != base[n][i], (word, seqs)
        assert banned_at(got, seqs) is None, (word, seqs, got)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_allowed_token_ids(served, endpoint):
    _, srv = served
    allowed = [40, 41, 300, 301]
    status, body, got = _call(srv.port, endpoint, PROMPTS[0], allowed_token_ids=allowed)
    assert status == 200 and len(got) == 24 and set(got) <= set(allowed), (body, got)
    status, body, _ = _call(srv.port, endpoint, PROMPTS[0], allowed_token_ids=[10 ** 7])
    assert status == 400 and body["error"]["param"] == "allowed_token_ids", body


def test_truncate_prompt_tokens(server):
    long = [30 + i % 400 for i in range(600)]  # longer than the server's max_model_len (512)
    status, _, raw = post(server.port, "/v1/completions", {"model": MODEL_NAME, "prompt": long, "max_tokens": 4,
                                                          "temperature": 0, "truncate_prompt_tokens": 10})
    body = json.loads(raw)
    assert status == 200 and body["usage"]["prompt_tokens"] == 10, body
    status, _, raw = post(server.port, "/v1/completions", {"model": MODEL_NAME, "prompt": long[-10:], "max_tokens": 4,
                                                          "temperature": 0})
    assert json.loads(raw)["choices"][0]["text"] == body["choices"][0]["text"]
    status, _, raw = post(server.port, "/v1/chat/completions", {
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "def main(): pass " * 200}], "max_tokens": 2,
        "truncate_prompt_tokens": 32})
    assert status == 200 and json.loads(raw)["usage"]["prompt_tokens"] == 32
    status, _, raw = post(server.port, "/v1/completions", {"model": MODEL_NAME, "prompt": long, "max_tokens": 4,
                                                          "truncate_prompt_tokens": 600})
    assert status == 400 and json.loads(raw)["error"]["param"] == "truncate_prompt_tokens"


def test_cache_salt_separates_prefix_caches(engine, server):
    """vLLM's cache_salt: a prompt's cached prefix is shared only by requests with the same
    salt (the engine's prefix-cache hits, in tokens: its stats come with the outputs, before
    the response). Chat's salt rides the same way (tests/entrypoints)."""
    prompt = [7 + (i * 37) % 450 for i in range(70)]  # 4 full blocks, not sent by any other test

    def hits_after(**fields):
        before = engine.get_stats().prefix_cache_hits
        status, _, raw = post(server.port, "/v1/completions", dict(model=MODEL_NAME, prompt=prompt, max_tokens=1,
                                                                 **fields))
        assert status == 200, raw
        return engine.get_stats().prefix_cache_hits - before

    assert hits_after(cache_salt="tenant-a") == 0
    assert hits_after(cache_salt="tenant-b") == 0  # the same tokens, another salt: nothing shared
    assert hits_after() == 0  # nor without one
    assert hits_after(cache_salt="tenant-a") >= 64
    assert hits_after() >= 64


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_return_token_ids(engine, server, endpoint):
    """vLLM's return_token_ids: the choice's token_ids (each chunk's delta when streamed)
    and the prompt's ids (in the first chunk when streamed)."""
    _, ref, ids = _call(server.port, endpoint, PROMPTS[0])  # the generated ids, through logprobs
    _, body, _ = _call(server.port, endpoint, PROMPTS[0], return_token_ids=True)
    choice = body["choices"][0]
    if endpoint == "chat":
        prompt_ids = body["prompt_token_ids"]
        text = engine.tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[0]}],
                                                    add_generation_prompt=True, tokenize=False)
        assert prompt_ids == engine.tokenizer.encode(text, add_special_tokens=False)
        assert choice["message"]["content"] == ref["choices"][0]["message"]["content"]
    else:
        prompt_ids = choice["prompt_token_ids"]
        assert prompt_ids == engine.tokenizer.encode(PROMPTS[0]) and choice["text"] == ref["choices"][0]["text"]
    assert choice["token_ids"] == ids and len(prompt_ids) == body["usage"]["prompt_tokens"]
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    req = {"model": MODEL_NAME, "temperature": 0, "max_tokens": 24, "ignore_eos": True, "return_token_ids": True,
           "stream": True}
    req.update({"messages": [{"role": "user", "content": PROMPTS[0]}]} if endpoint == "chat" else
               {"prompt": PROMPTS[0]})
    status, events, _ = collect_stream(server.port, path, req)
    chunks = [e for _, e in events[:-1]]
    assert status == 200 and events[-1][1] == "[DONE]"
    firsts = [c for e in chunks for c in e["choices"] if "prompt_token_ids" in c]
    if endpoint == "chat":
        assert chunks[0]["prompt_token_ids"] == prompt_ids and not firsts
    else:
        assert [c["prompt_token_ids"] for c in firsts] == [prompt_ids] and "token_ids" in chunks[0]["choices"][0]
    assert [t for e in chunks for c in e["choices"] for t in c.get("token_ids", [])] == ids
    assert completion_text(events)[0] == (ref["choices"][0]["message"]["content"] if endpoint == "chat"
                                          else ref["choices"][0]["text"])


def test_request_id_is_the_response_id(server):
    for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": [
            {"role": "user", "content": "x"}]})):
        ids = []
        for _ in range(2):  # the same id twice: each request still runs
            status, _, raw = post(server.port, path, dict(body, model=MODEL_NAME, max_tokens=2, request_id="abc-1"))
            assert status == 200
            ids.append(json.loads(raw)["id"])
        assert ids == [("chatcmpl-" if "chat" in path else "cmpl-") + "abc-1"] * 2


@pytest.mark.parametrize("stream", [False, True])
def test_chat_echo_with_continue_final_message(served, stream):
    """vLLM: the final assistant message's content, then the continuation."""
    _, srv = served
    msgs = [{"role": "user", "content": "write a loop"}, {"role": "assistant", "content": "for i in"}]
    base = {"model": MODEL_NAME, "messages": msgs, "continue_final_message": True, "add_generation_prompt": False,
            "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    status, _, raw = post(srv.port, "/v1/chat/completions", base)
    continuation = json.loads(raw)["choices"][0]["message"]["content"]
    assert status == 200 and continuation
    if stream:
        status, events, _ = collect_stream(srv.port, "/v1/chat/completions", dict(base, echo=True, stream=True))
        assert status == 200 and events[-1][1] == "[DONE]"
        deltas = [c["delta"] for _, e in events[:-1] for c in e["choices"]]
        assert deltas[0] == {"role": "assistant", "content": ""} and deltas[1] == {"content": "for i in"}
        content = completion_text(events)[0]
    else:
        status, _, raw = post(srv.port, "/v1/chat/completions", dict(base, echo=True))
        assert status == 200
        content = json.loads(raw)["choices"][0]["message"]["content"]
    assert content == "for i in" + continuation


@pytest.mark.parametrize("path, fields, param", [
    ("/v1/completions", {"prompt": "x", "max_completion_tokens": 40}, "max_completion_tokens"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "use_beam_search": True},
     "use_beam_search"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"},
     "chat_template"),
    ("/v1/completions", {"prompt": "x", "cache_salt": ""}, "cache_salt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "cache_salt": ""}, "cache_salt"),
])
def test_fields_that_cannot_be_honoured_are_refused(server, path, fields, param):
    status, _, raw = post(server.port, path, dict(fields, model=MODEL_NAME, max_tokens=2))
    err = json.loads(raw)["error"]
    assert status == 400 and err["param"] == param and param in err["message"], err
