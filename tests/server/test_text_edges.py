"""Text at the edges, over HTTP, with the scripted model (tests.helpers.build_scripted_model,
which emits a fixed token sequence): logprob ``text_offset`` when stop-string hold-back
releases text, and a UTF-8 character whose bytes span the prompt/completion boundary."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tests.helpers import EMOJI
from tests.server.http_util import collect_stream, completion_text, post

NAME = "scripted"


@pytest.fixture(scope="module")
def scripted_server(scripted_dir):
    from server import BackgroundServer, create_app
    from tests.server.conftest import make_engine

    engine = make_engine(scripted_dir, max_model_len=64, num_gpu_blocks_override=64)
    srv = BackgroundServer(create_app(engine, SimpleNamespace(served_model_name=[NAME])), port=0).start()
    yield srv
    srv.stop()
    engine.shutdown()


def _both(port, body):
    """(non-streamed choice, streamed chunks' choices) of one completions request."""
    status, _, data = post(port, "/v1/completions", dict(body, stream=False))
    assert status == 200, data
    status, events, _ = collect_stream(port, "/v1/completions", dict(body, stream=True))
    assert status == 200 and events[-1][1] == "[DONE]"
    chunks = [c for _, e in events[:-1] for c in e["choices"]]
    return json.loads(data)["choices"][0], chunks, events


def test_text_offset_when_held_back_text_is_released(scripted_server):
    # Issue 17: tokens DEF, G, HI (then EOS) with stop ["DEFGX"]: "DEF" and "DEFG" are held
    # back (they could begin the stop string) and released with HI. Streamed text_offset
    # was [0,0,0,6]; non-streamed [0,3,4,6].
    body = {"model": NAME, "prompt": "A", "max_tokens": 8, "temperature": 0, "stop": ["DEFGX"], "logprobs": 0}
    full, chunks, _ = _both(scripted_server.port, body)
    assert full["text"] == "DEFGHI" and full["finish_reason"] == "stop"
    assert full["logprobs"]["tokens"] == ["DEF", "G", "HI", "</s>"]
    assert full["logprobs"]["text_offset"] == [0, 3, 4, 6]
    streamed = {k: [x for c in chunks if c["logprobs"] for x in c["logprobs"][k]] for k in full["logprobs"]}
    assert streamed == full["logprobs"]  # identical once concatenated
    assert "".join(c["text"] for c in chunks) == "DEFGHI"


@pytest.mark.parametrize("echo", [False, True])
def test_character_spanning_prompt_and_completion(scripted_server, scripted_tokenizer, echo):
    # Issue 17: a token-id prompt ending in the first two bytes of a 4-byte emoji, the
    # completion starting with its last two: the emoji appeared nowhere, with or without echo.
    prompt = scripted_tokenizer.encode("ok" + EMOJI, add_special_tokens=False)[:-2]
    body = {"model": NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0, "echo": echo}
    full, chunks, events = _both(scripted_server.port, body)
    want = ("ok" if echo else "") + EMOJI + "!"
    assert full["text"] == want
    assert completion_text(events)[0] == want
    texts = [c["text"] for c in chunks if c["text"]]
    if echo:  # the echoed prompt comes first, without the emoji's first bytes
        assert texts[0].startswith("ok")
        texts[0] = texts[0][2:]
    assert next(t for t in texts if t).startswith(EMOJI)  # whole, in the first completion delta
    assert full["finish_reason"] == "stop"
