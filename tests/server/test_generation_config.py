"""The server takes a request's unset sampling fields from the engine's defaults
(--generation-config / --override-generation-config), as vLLM's server does: the
generation config's max_new_tokens bounds an absent max_tokens (a completion's is OpenAI's
16 at most), an explicit max_tokens is the request's."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tests.server.conftest import make_engine
from tests.server.http_util import post

NAME = "gen-config"


@pytest.fixture(scope="module")
def port(llama_dir):
    from server import BackgroundServer, create_app

    engine = make_engine(llama_dir, override_generation_config={"temperature": 0.0, "max_new_tokens": 40})
    srv = BackgroundServer(create_app(engine, SimpleNamespace(served_model_name=[NAME])), port=0).start()
    yield srv.port
    srv.stop()
    engine.shutdown()


def _tokens(port, path, body) -> tuple[int, str]:
    status, _, data = post(port, path, dict(body, model=NAME, ignore_eos=True))
    assert status == 200, data
    out = json.loads(data)
    choice = out["choices"][0]
    return out["usage"]["completion_tokens"], choice.get("text", (choice.get("message") or {}).get("content"))


def test_absent_max_tokens_follows_the_generation_config(port):
    chat = {"messages": [{"role": "user", "content": "tell me"}]}
    assert _tokens(port, "/v1/chat/completions", chat)[0] == 40
    assert _tokens(port, "/v1/chat/completions", dict(chat, max_tokens=50))[0] == 50
    assert _tokens(port, "/v1/completions", {"prompt": "tell me"})[0] == 16  # OpenAI's default, under 40
    assert _tokens(port, "/v1/completions", {"prompt": "tell me", "max_tokens": 45})[0] == 45


def test_absent_temperature_follows_the_generation_config(port):
    # temperature 0 by default: the same text every time, equal to an explicit greedy request
    body = {"prompt": "once upon", "max_tokens": 12}
    texts = {_tokens(port, "/v1/completions", dict(body, seed=s))[1] for s in range(3)}
    assert texts == {_tokens(port, "/v1/completions", dict(body, temperature=0))[1]}
    # a request's own field wins: temperature 1 with different seeds differs
    sampled = {_tokens(port, "/v1/completions", dict(body, temperature=1.0, seed=s))[1] for s in range(4)}
    assert len(sampled) > 1
