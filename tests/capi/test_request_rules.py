"""Rules once (issue 13): the same bad request gets the same error text from the Python API
(``AsyncLLM.add_request`` with ``SamplingParams``), HTTP (400, OpenAI's error body) and
the C ABI (``VLLM_ERR_INVALID_ARGUMENT`` and ``vllm_last_error()``).

Each row is a chat request (HTTP ``/v1/chat/completions``, C ``vllm_chat``; Python: the
prompt "hi" with the same fields as SamplingParams) or a completions prompt (HTTP
``/v1/completions``, C ``vllm_complete`` / ``vllm_complete_tokens``, Python the same
prompt). One engine configuration everywhere: the C harness's (the tiny llama's
1024-token context, fcfs).
"""
from __future__ import annotations

import json
import math
import re
from types import SimpleNamespace

import pytest

from tests.capi.test_capi import _run, _unescape
from tests.server.http_util import post

INVALID_ARGUMENT = 1
MAX_TOKENS = 4
HI = [{"role": "user", "content": "hi"}]
LONG_IDS = [5] * 1100  # past the 1024-token context

# (id, kind, request fields, SamplingParams fields or None for the same, priority, HTTP param)
# kind: "chat" (fields of a chat request), "prompt" (a text prompt), "tokens" (token ids)
ROWS = [
    ("temperature_nan", "chat", {"temperature": math.nan}, None, 0, "temperature"),
    ("temperature_negative", "chat", {"temperature": -1}, None, 0, "temperature"),
    ("top_p_zero", "chat", {"top_p": 0}, None, 0, "top_p"),
    ("top_k_negative", "chat", {"top_k": -2}, None, 0, "top_k"),
    ("min_p_over_one", "chat", {"min_p": 2}, None, 0, "min_p"),
    ("presence_penalty_big", "chat", {"presence_penalty": 3}, None, 0, "presence_penalty"),
    ("repetition_penalty_zero", "chat", {"repetition_penalty": 0}, None, 0, "repetition_penalty"),
    # finite, but not in the sampler's float32 (C's float already turns these into inf / 0)
    ("temperature_past_float32", "chat", {"temperature": 1e39}, None, 0, "temperature"),
    ("repetition_penalty_below_float32", "chat", {"repetition_penalty": 1e-46}, None, 0, "repetition_penalty"),
    ("n_zero", "chat", {"n": 0}, None, 0, "n"),
    ("seed_past_64_bits", "chat", {"seed": 2 ** 64}, None, 0, "seed"),
    ("min_tokens_over_max", "chat", {"min_tokens": 10}, None, 0, "min_tokens"),
    ("stop_too_many", "chat", {"stop": ["x"] * 65}, None, 0, "stop"),
    ("stop_too_long", "chat", {"stop": "y" * 1025}, None, 0, "stop"),
    ("logprobs_over_max", "chat", {"logprobs": True, "top_logprobs": 21}, {"logprobs": 21}, 0, "top_logprobs"),
    ("logit_bias", "chat", {"logit_bias": {"5": 1.0}}, None, 0, "logit_bias"),
    ("stop_token_out_of_vocab", "chat", {"stop_token_ids": [10 ** 6]}, None, 0, "stop_token_ids"),
    ("priority_under_fcfs", "chat", {"priority": 3}, {}, 3, "priority"),
    ("two_structured_constraints", "chat", {"structured_outputs": {"regex": "a+", "choice": ["x"]}}, None, 0,
     "structured_outputs"),
    ("invalid_json_schema", "chat", {"structured_outputs": {"json": {"type": "nope"}}}, None, 0,
     "structured_outputs.json"),
    ("invalid_regex", "chat", {"structured_outputs": {"regex": "(unclosed"}}, None, 0, "structured_outputs.regex"),
    ("bad_words_blank", "chat", {"bad_words": ["ok", " "]}, None, 0, "bad_words"),
    ("allowed_token_id_out_of_vocab", "chat", {"allowed_token_ids": [3, 10 ** 6]}, None, 0, "allowed_token_ids"),
    ("allowed_token_ids_empty", "chat", {"allowed_token_ids": []}, None, 0, "allowed_token_ids"),
    ("max_tokens_over_context", "prompt", {"prompt": "hello", "max_tokens": 5000}, None, 0, "max_tokens"),
    ("prompt_too_long", "tokens", {"prompt": LONG_IDS}, None, 0, "prompt"),
    ("token_id_out_of_vocab", "tokens", {"prompt": [1, 2, 10 ** 6]}, None, 0, "prompt"),
    ("empty_prompt", "prompt", {"prompt": ""}, None, 0, "prompt"),
]


@pytest.fixture(scope="module")
def engine(llama_dir):
    from pyengine import AsyncLLM, EngineArgs

    eng = AsyncLLM.from_engine_args(EngineArgs(model=str(llama_dir), max_num_seqs=16,
                                               kv_cache_memory_bytes=16 << 20))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    from server import BackgroundServer, create_app

    srv = BackgroundServer(create_app(engine, SimpleNamespace()), port=0).start()
    yield srv
    srv.stop()


def _python_error(engine, i, kind, fields, sp_fields, priority) -> str:
    from pyengine import SamplingParams

    fields = dict(fields)
    prompt = fields.pop("prompt", "hi")
    if sp_fields is None:
        sp_fields = {k: v for k, v in fields.items() if k != "priority"}
    sp_fields = dict(sp_fields)
    sp_fields.setdefault("max_tokens", MAX_TOKENS)
    with pytest.raises(ValueError) as ei:
        engine.add_request(f"rules-{i}", prompt, SamplingParams(**sp_fields), priority=priority)
    return str(ei.value)


def _http_body(kind, fields):
    if kind == "chat":
        return "/v1/chat/completions", {"messages": HI, "max_tokens": MAX_TOKENS, **fields}
    return "/v1/completions", {"max_tokens": MAX_TOKENS, **fields}


def _c_arg(kind, fields) -> str:
    if kind == "chat":
        return "chat:" + json.dumps({"messages": HI, "max_tokens": MAX_TOKENS, **fields})
    max_tokens = fields.get("max_tokens", MAX_TOKENS)
    if kind == "tokens":
        return f"tokens:{max_tokens}:" + ",".join(map(str, fields["prompt"]))
    return f"prompt:{max_tokens}:{fields['prompt']}"


@pytest.fixture(scope="module")
def c_errors(capi_test_bin, capi_lib, llama_dir):
    """(status, vllm_last_error()) of each row through the C ABI, in one C process."""
    proc = _run(capi_test_bin, capi_lib, "reject", llama_dir, *[_c_arg(r[1], r[2]) for r in ROWS], timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    out = {}
    for i in range(len(ROWS)):
        status = int(re.search(rf"^STATUS_{i} (-?\d+)$", proc.stdout, re.M).group(1))
        out[i] = (status, _unescape(re.search(rf"^ERROR_{i} (.*)$", proc.stdout, re.M).group(1)))
    return out


def test_table_is_large_enough():
    assert len(ROWS) >= 15


@pytest.mark.parametrize("i", range(len(ROWS)), ids=[r[0] for r in ROWS])
def test_same_error_everywhere(engine, server, c_errors, i):
    _, kind, fields, sp_fields, priority, param = ROWS[i]
    py = _python_error(engine, i, kind, fields, sp_fields, priority)
    path, body = _http_body(kind, fields)
    status, _, data = post(server.port, path, body)
    assert status == 400, data
    err = json.loads(data)["error"]
    assert (err["message"], err["param"], err["type"]) == (py, param, "BadRequestError")
    assert c_errors[i] == (INVALID_ARGUMENT, py)
