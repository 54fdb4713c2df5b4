"""Property-based fuzzing of the HTTP front end (issue 12): generated request bodies, valid
and hostile (NaN / Infinity, integers past 64 bits, huge n, wrong types, odd nesting,
unknown fields), thrown at /v1/completions and /v1/chat/completions. No response may be a
5xx (nor carry an in-band 5xx error event), and afterwards the engine is alive, idle and
holds no KV block.

Bounded for ``make test``: a small engine (max_model_len 128), ``VENGINE_FUZZ_EXAMPLES``
bodies (default 150), derandomized so CI runs the same bodies every time."""
from __future__ import annotations

import json
import math
import os
import time
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.server.conftest import MODEL_NAME, make_engine
from tests.server.http_util import get, post

EXAMPLES = int(os.environ.get("VENGINE_FUZZ_EXAMPLES", "150"))
C, CH = "/v1/completions", "/v1/chat/completions"

PAST_64_BITS = [2 ** 63, 2 ** 64, -2 ** 63 - 1, 10 ** 20]
BIG_INTS = [2 ** 63 - 1, -2 ** 63, -1, 0, 1, 20, 21, 128, 129]
ints = st.one_of(st.sampled_from(PAST_64_BITS), st.sampled_from(BIG_INTS), st.integers(-3, 70), st.integers())
floats = st.one_of(st.sampled_from([math.nan, math.inf, -math.inf]),
                   st.sampled_from([-0.0, 1e308, -1e308, 5e-324, 1e-6, 2.0, 2.5]),
                   st.floats(-5, 5), st.floats(allow_nan=True, allow_infinity=True))
texts = st.one_of(st.text(max_size=40), st.sampled_from(["", " ", "\x00", "def f():", "日本語", "😀" * 3]))
scalars = st.one_of(st.none(), st.booleans(), ints, floats, texts)
json_values = st.recursive(scalars, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                          st.dictionaries(st.text(max_size=8), kids, max_size=4)),
                           max_leaves=12)

token_lists = st.lists(st.one_of(st.integers(0, 500), st.sampled_from(BIG_INTS)), max_size=8)
prompts = st.one_of(texts, token_lists, st.lists(texts, max_size=3), st.lists(token_lists, max_size=3), json_values)
contents = st.one_of(texts, st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                                                             "text": texts}), max_size=3), json_values)
messages = st.one_of(
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", ""]),
                                    "content": contents}), max_size=3),
    json_values)

# Field -> strategy: mostly the right type (so validation gets past the schema and the
# engine's range checks are reached), sometimes anything at all.
# Numeric fields the engine range-checks: at least one is hostile in most bodies.
ENGINE_NUMERIC = ["n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                  "frequency_penalty", "repetition_penalty", "min_tokens", "logprobs", "top_logprobs"]
# In range but extreme: these pass validation and must not hurt the engine.
EDGE = {
    "seed": st.sampled_from([2 ** 63 - 1, -2 ** 63, 0]),
    "temperature": st.sampled_from([1e308, 5e-324, 1e-5, 2e-5, 100.0, 1.0]),
    "top_p": st.sampled_from([5e-324, 1e-9, 1.0]),
    "top_k": st.sampled_from([1, 2 ** 63 - 1, 10 ** 12, -1, 0]),
    "min_p": st.sampled_from([0.0, 1.0, 5e-324, 0.999]),
    "repetition_penalty": st.sampled_from([5e-324, 1e-30, 1e30, 1e308]),
    "presence_penalty": st.sampled_from([-2, 2, -2.0, 1.5]),
    "frequency_penalty": st.sampled_from([-2, 2, 0.5]),
    "n": st.sampled_from([1, 2, 128]),
    "min_tokens": st.sampled_from([0, 4, 8]),
    "logprobs": st.sampled_from([0, 20, True]),
    "top_logprobs": st.sampled_from([0, 20]),
}
SAMPLING = {
    "n": ints, "temperature": floats, "top_p": floats, "top_k": ints, "min_p": floats,
    "seed": ints, "presence_penalty": floats, "frequency_penalty": floats,
    "repetition_penalty": floats, "max_tokens": ints, "min_tokens": ints,
    "stop": st.one_of(texts, st.lists(texts, max_size=70)), "stop_token_ids": token_lists,
    "ignore_eos": st.booleans(), "logprobs": st.one_of(ints, st.booleans()), "priority": ints,
    "include_stop_str_in_output": st.booleans(), "skip_special_tokens": st.booleans(),
    "best_of": ints, "logit_bias": json_values, "user": texts, "echo": st.booleans(),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), json_values),
    "top_logprobs": ints, "max_completion_tokens": ints, "suffix": texts,
    "add_generation_prompt": st.booleans(), "continue_final_message": st.booleans(),
    "chat_template_kwargs": json_values, "model": st.sampled_from([MODEL_NAME, "nope", ""]),
}


valid_prompts = st.one_of(st.sampled_from(["def f():", "hello", "日本語 😀", "x"]),
                         st.lists(st.integers(1, 500), min_size=1, max_size=8))
valid_messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]),
                                                 "content": st.sampled_from(["hi", "Write code", ""])}),
                          min_size=1, max_size=2)


@st.composite
def bodies(draw):
    chat = draw(st.booleans())
    # (hypothesis draws the ends of an integer range more often: rare branches sit inside it)
    if draw(st.integers(0, 9)) not in (3, 6, 8):
        # mostly a valid request with one to three hostile fields: it reaches the engine's
        # range checks, and the engine itself when a value slips through
        body = {"model": MODEL_NAME, "max_tokens": draw(st.integers(1, 8))}
        body["messages" if chat else "prompt"] = draw(valid_messages if chat else valid_prompts)
        names = [draw(st.sampled_from(ENGINE_NUMERIC))]
        names += [n for n in draw(st.lists(st.sampled_from(sorted(SAMPLING)), max_size=2)) if n not in names]
    else:
        body = {"model": MODEL_NAME}
        body["messages" if chat else "prompt"] = draw(messages if chat else prompts)
        names = draw(st.lists(st.sampled_from(sorted(SAMPLING)), max_size=6, unique=True))
    for name in names:
        pick = draw(st.integers(0, 4))
        if pick in (1, 2) and name in EDGE:
            body[name] = draw(EDGE[name])
        else:
            body[name] = draw(st.one_of(SAMPLING[name], json_values) if pick == 3 else SAMPLING[name])
    if draw(st.integers(0, 9)) == 4:
        body[draw(st.text(min_size=1, max_size=10))] = draw(json_values)  # unknown field
    body["stream"] = draw(st.one_of(st.booleans(), st.just(None)))
    if draw(st.integers(0, 19)) == 7:
        body = draw(json_values)  # not even an object
    return (CH if chat else C), body


@pytest.fixture(scope="module")
def fuzz_server(llama_dir):
    from server import BackgroundServer, create_app

    engine = make_engine(llama_dir, max_model_len=128, num_gpu_blocks_override=2048, max_num_seqs=128)
    srv = BackgroundServer(create_app(engine, SimpleNamespace(served_model_name=[MODEL_NAME])), port=0).start()
    yield srv, engine
    srv.stop()
    engine.shutdown()


def _check_response(status, body: bytes, where):
    assert status < 500, (where, status, body[:500])
    if status == 200 and body.startswith(b"data: "):
        events = [line[6:] for line in body.split(b"\n") if line.startswith(b"data: ")]
        assert events and events[-1] == b"[DONE]", (where, body[-300:])
        for ev in events[:-1]:
            err = json.loads(ev).get("error")
            assert err is None or err["code"] < 500, (where, err)


@pytest.mark.timeout(900)
def test_generated_bodies_never_get_a_5xx_and_the_engine_survives(fuzz_server):
    srv, engine = fuzz_server
    seen = {"n": 0}

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(bodies())
    # the reported inputs always run, whatever the generator draws
    @example((C, {"model": MODEL_NAME, "prompt": "x", "seed": 2 ** 64}))
    @example((CH, {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "seed": 2 ** 64,
                   "stream": True}))
    @example((C, {"model": MODEL_NAME, "prompt": "x", "n": 10 ** 20}))
    @example((C, {"model": MODEL_NAME, "prompt": "x", "temperature": math.nan, "max_tokens": 2}))
    @example((CH, {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "top_p": math.inf}))
    def one(case):
        path, body = case
        raw = json.dumps(body, allow_nan=True)  # NaN / Infinity literals, as hostile clients send
        status, _, data = post(srv.port, path, raw, timeout=120)
        _check_response(status, data, (path, raw[:300]))
        seen[status] = seen.get(status, 0) + 1
        seen["n"] += 1

    one()
    assert seen["n"] >= min(EXAMPLES, 50)
    assert seen.get(200, 0) >= seen["n"] // 10, seen  # a good share reached the engine and ran
    # the engine is alive, idle and holds no KV block
    assert get(srv.port, "/health")[0] == 200 and not engine.errored
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        s = engine.get_stats()
        if s.num_running == s.num_waiting == 0 and s.num_free_blocks == s.num_gpu_blocks:
            break
        time.sleep(0.05)
    s = engine.get_stats()
    assert s.num_running == s.num_waiting == 0 and s.num_free_blocks == s.num_gpu_blocks, s
    status, _, data = post(srv.port, C, {"model": MODEL_NAME, "prompt": "def f():", "max_tokens": 4})
    assert status == 200, data
