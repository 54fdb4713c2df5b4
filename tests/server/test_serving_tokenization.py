"""POST /tokenize and /detokenize (server/serving_tokenization.py): vLLM's shapes, token ids
equal to the tokenizer's and to what the chat endpoint feeds the model, 400 / 404 errors."""
from __future__ import annotations

import json

import pytest

from tests.server.conftest import MODEL_NAME
from tests.server.http_util import post
from tests.server.test_errors import _check_envelope

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def f(x):"}]


def _ok(port, path, body):
    status, _, data = post(port, path, body)
    assert status == 200, data
    return json.loads(data)


def test_tokenize_prompt(server, tokenizer):
    prompt = "import os\nprint(os.sep)"
    got = _ok(server.port, "/tokenize", {"model": MODEL_NAME, "prompt": prompt})
    ids = tokenizer(prompt).input_ids  # special tokens added, as for a completion prompt
    assert got == {"count": len(ids), "max_model_len": 512, "tokens": ids, "token_strs": None}
    got = _ok(server.port, "/tokenize", {"prompt": prompt, "add_special_tokens": False, "return_token_strs": True})
    bare = tokenizer.encode(prompt, add_special_tokens=False)
    assert got["tokens"] == bare and got["token_strs"] == tokenizer.convert_ids_to_tokens(bare)
    assert _ok(server.port, "/tokenize", {"prompt": ""})["count"] == len(tokenizer("").input_ids)


def test_tokenize_messages_is_what_chat_feeds_the_model(server, client, tokenizer):
    got = _ok(server.port, "/tokenize", {"model": "alias", "messages": CHAT})
    text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert got["tokens"] == tokenizer.encode(text, add_special_tokens=False) and got["count"] == len(got["tokens"])
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=1)
    assert r.usage.prompt_tokens == got["count"]
    # the flags and a request template reach the renderer
    cont = CHAT + [{"role": "assistant", "content": "return"}]
    got = _ok(server.port, "/tokenize", {"messages": cont, "add_generation_prompt": False,
                                         "continue_final_message": True})
    assert tokenizer.decode(got["tokens"]).endswith("assistant\nreturn")
    got = _ok(server.port, "/tokenize", {"messages": CHAT, "chat_template": "{{ messages[1]['content'] }}!{{ x }}",
                                         "chat_template_kwargs": {"x": "y"}})
    assert got["tokens"] == tokenizer.encode("def f(x):!y", add_special_tokens=False)


def test_tokenize_messages_without_a_chat_template_is_refused(server, engine, monkeypatch):
    monkeypatch.setattr(engine.tokenizer, "chat_template", None)
    status, headers, body = post(server.port, "/tokenize", {"messages": CHAT})
    _check_envelope(status, headers, body, 400, "messages")
    assert "no chat template" in json.loads(body)["error"]["message"]


@pytest.mark.parametrize("body, param", [
    ({}, "prompt"), ({"prompt": 5}, "prompt"), ({"messages": []}, "messages"),
    ({"messages": [{"content": "x"}]}, "messages.0.role"),
    ({"messages": CHAT, "add_generation_prompt": True, "continue_final_message": True}, "messages"),
    ({"messages": CHAT, "chat_template": "{% if %}"}, "messages"),
])
def test_tokenize_bad_requests(server, body, param):
    _check_envelope(*post(server.port, "/tokenize", body), 400, param)


def test_detokenize(server, tokenizer):
    ids = tokenizer.encode("for i in range(3):\n    pass", add_special_tokens=False)
    assert _ok(server.port, "/detokenize", {"model": MODEL_NAME, "tokens": ids}) == {"prompt": tokenizer.decode(ids)}
    assert _ok(server.port, "/detokenize", {"tokens": []}) == {"prompt": ""}
    for bad in ([-1], [1 << 40]):
        _check_envelope(*post(server.port, "/detokenize", {"tokens": bad}), 400, "tokens")
    _check_envelope(*post(server.port, "/detokenize", {"tokens": "abc"}), 400, "tokens")


def test_unknown_model_is_404(server):
    _check_envelope(*post(server.port, "/tokenize", {"model": "nope", "prompt": "x"}), 404, "model")
    _check_envelope(*post(server.port, "/detokenize", {"model": "nope", "tokens": [1]}), 404, "model")
