"""The thinking budget over HTTP (``vengine serve --reasoning-parser``) on the scripted
reasoning model that thinks ``Hmm`` forever unless the engine forces ``</think>``: chat's
``thinking_token_budget`` (vLLM's field) and Anthropic's ``thinking.budget_tokens``, through
the official SDKs, streamed and not: the thinking holds exactly the budget and the answer
follows. Refused (400): a budget on a server without ``--reasoning-parser``, on
``/v1/completions``, and Anthropic budgets Anthropic itself refuses (its error body)."""
from __future__ import annotations

import anthropic
import openai
import pytest

from tests.server.conftest import make_engine, serve_app

MODEL = "thinker"
ASK = [{"role": "user", "content": "Hi"}]
ANTHROPIC_MIN = 1024


@pytest.fixture(scope="module")
def engine(thinking_loop_dir):
    eng = make_engine(thinking_loop_dir, max_model_len=1280)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def servers(engine):
    gens = {"qwen3": serve_app(engine, served_model_name=[MODEL], reasoning_parser="qwen3"),
            "r1": serve_app(engine, served_model_name=[MODEL], reasoning_parser="deepseek_r1"),
            "plain": serve_app(engine, served_model_name=[MODEL])}
    srvs = {name: next(g) for name, g in gens.items()}
    yield srvs
    for g in gens.values():
        g.close()


def oai(srv):
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def anth(srv):
    return anthropic.Anthropic(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=300)


def chat(srv, stream, **kw):
    """(reasoning, content, reasoning tokens or None, finish reason) of one chat request."""
    c = oai(srv)
    if not stream:
        r = c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=64, **kw)
        m = r.choices[0].message.model_dump()
        return (m["reasoning_content"], m["content"], r.usage.completion_tokens_details.reasoning_tokens,
                r.choices[0].finish_reason)
    reasoning, content, finish = [], [], None
    for ch in c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=64, stream=True, **kw):
        for choice in ch.choices:
            d = choice.delta.model_dump()
            assert not (d.get("reasoning_content") and content), "reasoning after the content began"
            reasoning.append(d.get("reasoning_content") or "")
            if d.get("content"):
                content.append(d["content"])
            finish = choice.finish_reason or finish
    return "".join(reasoning) or None, "".join(content) or None, None, finish


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parser", ["qwen3", "r1"])
def test_chat_thinking_token_budget(servers, parser, stream):
    for budget in (0, 1, 5):
        reasoning, content, n, finish = chat(servers[parser], stream, extra_body={"thinking_token_budget": budget})
        assert (reasoning, content, finish) == ("Hmm" * budget or None, "\n\nOK", "stop"), budget
        assert n in (None, budget)
    # no budget: the model thinks until max_tokens
    reasoning, content, _, finish = chat(servers[parser], stream)
    assert (reasoning, content, finish) == ("Hmm" * 63, None, "length")


def test_chat_budget_without_thinking_and_refusals(servers):
    # enable_thinking false: the output is the answer at once, there is no reasoning to bound
    off = chat(servers["qwen3"], False, extra_body={"thinking_token_budget": 2,
                                                    "chat_template_kwargs": {"enable_thinking": False}})
    assert off[:2] == (None, "OK")
    c = oai(servers["plain"])
    with pytest.raises(openai.BadRequestError) as ei:
        c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, extra_body={"thinking_token_budget": 4})
    assert ei.value.body["param"] == "thinking_token_budget" and "--reasoning-parser" in ei.value.body["message"]
    for srv in (servers["plain"], servers["qwen3"]):
        with pytest.raises(openai.BadRequestError) as ei:
            oai(srv).completions.create(model=MODEL, prompt="Hi", max_tokens=8, extra_body={"thinking_token_budget": 4})
        assert ei.value.body["param"] == "thinking_token_budget"
    for bad, param in ((-1, "thinking_token_budget"), ("5", "thinking_token_budget")):
        with pytest.raises(openai.BadRequestError) as ei:
            oai(servers["qwen3"]).chat.completions.create(model=MODEL, messages=ASK, max_tokens=8,
                                                          extra_body={"thinking_token_budget": bad})
        assert ei.value.body["param"] == param
    # a budget that may force </think> where the request forbids it
    with pytest.raises(openai.BadRequestError) as ei:
        oai(servers["qwen3"]).chat.completions.create(model=MODEL, messages=ASK, max_tokens=8,
                                                      extra_body={"thinking_token_budget": 4, "bad_words": ["</think>"]})
    assert ei.value.body["param"] == "bad_words"


@pytest.mark.parametrize("stream", [False, True])
def test_messages_budget_tokens(servers, stream):
    """Anthropic's least budget (1024): the thinking block holds exactly 1024 tokens
    (``Hmm`` each), then the text answer; max_tokens leaves room for it."""
    kw = dict(model=MODEL, max_tokens=ANTHROPIC_MIN + 16, messages=ASK,
              thinking={"type": "enabled", "budget_tokens": ANTHROPIC_MIN})
    c = anth(servers["qwen3"])
    if stream:
        with c.messages.stream(**kw) as s:
            thinking = "".join(e.delta.thinking for e in s
                               if e.type == "content_block_delta" and e.delta.type == "thinking_delta")
            m = s.get_final_message()
        assert thinking == "Hmm" * ANTHROPIC_MIN
    else:
        m = c.messages.create(**kw)
    assert [b.type for b in m.content] == ["thinking", "text"], m
    assert m.content[0].thinking == "Hmm" * ANTHROPIC_MIN and m.content[1].text == "\n\nOK"
    assert m.stop_reason == "end_turn" and m.usage.output_tokens == ANTHROPIC_MIN + 5  # tags, "\n\n", OK, EOS


@pytest.mark.parametrize("max_tokens,budget,message", [
    (2048, 1000, "thinking.enabled.budget_tokens: Input should be greater than or equal to 1024"),
    (1024, 1024, "`max_tokens` must be greater than `thinking.budget_tokens`."),
])
def test_messages_budget_refused_as_anthropic_does(servers, max_tokens, budget, message):
    with pytest.raises(anthropic.BadRequestError) as ei:
        anth(servers["qwen3"]).messages.create(model=MODEL, max_tokens=max_tokens, messages=ASK,
                                               thinking={"type": "enabled", "budget_tokens": budget})
    err = ei.value.body
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert err["error"]["message"].startswith(message), err


def test_messages_budget_needs_a_reasoning_parser(servers):
    c = anth(servers["plain"])
    with pytest.raises(anthropic.BadRequestError) as ei:
        c.messages.create(model=MODEL, max_tokens=2048, messages=ASK,
                          thinking={"type": "enabled", "budget_tokens": ANTHROPIC_MIN})
    err = ei.value.body["error"]
    assert err["type"] == "invalid_request_error" and "--reasoning-parser" in err["message"], err
    # counting tokens generates nothing: no parser needed
    n = c.messages.count_tokens(model=MODEL, messages=ASK, thinking={"type": "enabled", "budget_tokens": 2048})
    assert n.input_tokens > 0
