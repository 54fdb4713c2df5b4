"""Bad input: each case gets its documented status and OpenAI's error envelope, streamed
requests included (a plain JSON error, not SSE), and the next good request succeeds."""
from __future__ import annotations

import json

import pytest

from tests.server.conftest import API_KEY, MODEL_NAME
from tests.server.http_util import get, post, request

C, CH = "/v1/completions", "/v1/chat/completions"
OK_C = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 3}
OK_CH = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def c(**kw):
    d = dict(OK_C)
    d.update(kw)
    return d


def ch(**kw):
    d = dict(OK_CH)
    d.update(kw)
    return d


# (id, path, body (obj | raw bytes), extra headers, expected status, expected param or None)
CASES = [
    # wrong types
    ("max_tokens_str", C, c(max_tokens="5"), {}, 400, "max_tokens"),
    ("temperature_str", C, c(temperature="hot"), {}, 400, "temperature"),
    ("stream_int", C, c(stream=1), {}, 400, "stream"),
    ("prompt_number", C, c(prompt=5), {}, 400, "prompt"),
    ("prompt_mixed", C, c(prompt=["a", 1]), {}, 400, "prompt"),
    ("stop_int", C, c(stop=3), {}, 400, "stop"),
    ("messages_str", CH, ch(messages="hi"), {}, 400, "messages"),
    ("message_no_role", CH, ch(messages=[{"content": "hi"}]), {}, 400, None),
    ("logprobs_int_chat", CH, ch(logprobs=1), {}, 400, "logprobs"),
    ("body_is_list", C, [1, 2], {}, 400, None),
    ("missing_prompt", C, {"model": MODEL_NAME}, {}, 400, "prompt"),
    # out of range
    ("temperature_neg", C, c(temperature=-1), {}, 400, "temperature"),
    ("top_p_zero", C, c(top_p=0), {}, 400, "top_p"),
    ("top_p_big", C, c(top_p=1.5), {}, 400, "top_p"),
    ("top_k_neg", C, c(top_k=-2), {}, 400, "top_k"),
    ("min_p_big", C, c(min_p=2), {}, 400, "min_p"),
    ("n_zero", C, c(n=0), {}, 400, "n"),
    ("max_tokens_zero", C, c(max_tokens=0), {}, 400, "max_tokens"),
    ("max_tokens_neg", CH, ch(max_tokens=-1), {}, 400, "max_tokens"),
    ("presence_big", C, c(presence_penalty=3), {}, 400, "presence_penalty"),
    ("rep_zero", C, c(repetition_penalty=0), {}, 400, "repetition_penalty"),
    ("logprobs_big", C, c(logprobs=21), {}, 400, "logprobs"),
    ("min_tokens_gt_max", C, c(min_tokens=10, max_tokens=2), {}, 400, "min_tokens"),
    ("n_greedy", C, c(n=2, temperature=0), {}, 400, "n"),
    ("token_id_oov", C, c(prompt=[1, 2, 10 ** 6]), {}, 400, "prompt"),
    ("stop_token_oov", C, c(stop_token_ids=[10 ** 6]), {}, 400, "stop_token_ids"),
    ("top_logprobs_without_logprobs", CH, ch(top_logprobs=2), {}, 400, "top_logprobs"),
    ("stream_options_without_stream", C, c(stream_options={"include_usage": True}), {}, 400, "stream_options"),
    ("priority_on_fcfs", C, c(priority=5), {}, 400, "priority"),
    ("logit_bias", C, c(logit_bias={"5": 1.0}), {}, 400, "logit_bias"),
    # issue 12 kind 1 / issue 16 kind 3: range-checked at the door, one message per field
    ("seed_past_64_bits", C, c(seed=2 ** 64), {}, 400, "seed"),
    ("seed_past_64_bits_chat", CH, ch(seed=2 ** 64), {}, 400, "seed"),
    ("seed_below_int64", C, c(seed=-2 ** 63 - 1), {}, 400, "seed"),
    ("n_huge", C, c(n=10 ** 20, temperature=1), {}, 400, "n"),
    ("n_over_limit_chat", CH, ch(n=129, temperature=1), {}, 400, "n"),
    ("temperature_nan", C, c(temperature=float("nan")), {}, 400, "temperature"),
    ("temperature_inf_chat", CH, ch(temperature=float("inf")), {}, 400, "temperature"),
    ("top_p_nan", C, c(top_p=float("nan")), {}, 400, "top_p"),
    ("min_p_inf", CH, ch(min_p=float("inf")), {}, 400, "min_p"),
    ("presence_neg_inf", C, c(presence_penalty=float("-inf")), {}, 400, "presence_penalty"),
    ("frequency_nan", CH, ch(frequency_penalty=float("nan")), {}, 400, "frequency_penalty"),
    ("repetition_inf", C, c(repetition_penalty=float("inf")), {}, 400, "repetition_penalty"),
    ("top_k_past_64_bits", C, c(top_k=2 ** 64), {}, 400, "top_k"),
    ("top_logprobs_over_limit", CH, ch(logprobs=True, top_logprobs=21), {}, 400, "top_logprobs"),
    ("too_many_stop_strings", C, c(stop=["x"] * 65), {}, 400, "stop"),
    ("stop_string_too_long", CH, ch(stop="y" * 1025), {}, 400, "stop"),
    ("min_tokens_past_64_bits", CH, ch(min_tokens=2 ** 64), {}, 400, "min_tokens"),
    # bad JSON, content type, empty
    ("bad_json", C, b'{"prompt": "x",', {}, 400, None),
    ("empty_body", C, b"", {}, 400, None),
    ("text_plain", C, json.dumps(OK_C).encode(), {"Content-Type": "text/plain"}, 400, None),
    ("no_content_type", C, json.dumps(OK_C).encode(), {"Content-Type": None}, 400, None),
    ("empty_prompt", C, c(prompt=""), {}, 400, "prompt"),
    ("empty_prompt_list", C, c(prompt=[]), {}, 400, "prompt"),
    ("empty_prompt_in_list", C, c(prompt=["ok", ""]), {}, 400, "prompt"),
    ("empty_messages", CH, ch(messages=[]), {}, 400, "messages"),
    # too long for the model (max_model_len 512 in these tests)
    ("prompt_too_long", C, c(prompt=[5] * 600), {}, 400, "prompt"),
    ("prompt_plus_max_tokens_too_long", C, c(prompt=[5] * 500, max_tokens=100), {}, 400, "max_tokens"),
    ("chat_max_tokens_too_long", CH, ch(max_tokens=5000), {}, 400, "max_tokens"),
    # unknown model
    ("unknown_model", C, c(model="gpt-9"), {}, 404, "model"),
    ("unknown_model_chat", CH, ch(model="gpt-9"), {}, 404, "model"),
]


def _check_envelope(status, headers, body, expected_status, param=None):
    assert status == expected_status, body
    assert headers.get("Content-Type", "").startswith("application/json")
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert err["code"] == expected_status
    if param is not None:
        assert err["param"] == param, err


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", CASES, ids=[x[0] for x in CASES])
def test_bad_input(server, case, stream):
    _, path, body, headers, expected, param = case
    if stream and isinstance(body, dict) and "stream" not in body:
        body = dict(body, stream=True)
        if case[0] == "stream_options_without_stream":
            pytest.skip("valid when streaming")
    status, hdrs, data = post(server.port, path, body, headers)
    _check_envelope(status, hdrs, data, expected, param)
    # the server keeps serving
    good = OK_CH if path == CH else OK_C
    status, _, data = post(server.port, path, good)
    assert status == 200, data


def test_nan_message_is_the_engines(server):
    # the same words as the Python API and the C ABI (issue 16 kind 3)
    from pyengine import SamplingParams
    with pytest.raises(ValueError) as ei:
        SamplingParams(temperature=float("nan"))
    status, _, data = post(server.port, C, c(temperature=float("nan")))
    assert status == 400 and json.loads(data)["error"]["message"] == str(ei.value)


def test_unknown_route_and_method(server):
    _check_envelope(*get(server.port, "/v1/nope"), 404)
    _check_envelope(*get(server.port, C), 405)


def test_api_key(keyed_server):
    port = keyed_server.port
    _check_envelope(*post(port, C, OK_C), 401)
    _check_envelope(*post(port, C, OK_C, {"Authorization": "Bearer wrong"}), 401)
    _check_envelope(*get(port, "/v1/models"), 401)
    assert post(port, C, OK_C, {"Authorization": f"Bearer {API_KEY}"})[0] == 200
    # the scheme is case-insensitive (RFC 9110); the key is not
    for header in (f"bearer {API_KEY}", f"BEARER {API_KEY}", f"  Bearer   {API_KEY} "):
        assert post(port, C, OK_C, {"Authorization": header})[0] == 200, header
    for header in (f"Bearer {API_KEY.upper()}", f"Basic {API_KEY}", API_KEY, f"Bearer{API_KEY}", "Bearer"):
        _check_envelope(*post(port, C, OK_C, {"Authorization": header}), 401)
    assert get(port, "/v1/models", {"Authorization": f"Bearer {API_KEY}"})[0] == 200
    # health and metrics stay open
    assert get(port, "/health")[0] == 200
    assert get(port, "/metrics")[0] == 200


def test_api_key_with_openai_client(keyed_server):
    import openai

    bad = openai.OpenAI(base_url=keyed_server.base_url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2)
    good = openai.OpenAI(base_url=keyed_server.base_url + "/v1", api_key=API_KEY, max_retries=0)
    assert good.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2).choices[0].text is not None


def test_oversized_body(keyed_server):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    big = c(prompt="x " * 5000)
    _check_envelope(*post(keyed_server.port, C, big, auth), 413)
    assert post(keyed_server.port, C, OK_C, auth)[0] == 200


def test_openai_client_sees_bad_request(client):
    import openai

    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2, temperature=-3)
    assert ei.value.status_code == 400
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def test_request_method_head_health(server):
    status, _, _ = request(server.port, "GET", "/health")
    assert status == 200


def test_unknown_fields_ignored_and_logged(server, caplog):
    caplog.set_level("WARNING", logger="server")
    status, _, data = post(server.port, C, c(bogus_field=1, another={"x": 1}))
    assert status == 200, data
    assert "present in the request but ignored: ['another', 'bogus_field']" in caplog.text
    caplog.clear()
    assert post(server.port, CH, ch(bogus_field=1))[0] == 200
    assert "['bogus_field']" in caplog.text
    caplog.clear()
    assert post(server.port, C, OK_C)[0] == 200
    assert "ignored" not in caplog.text


def test_reset_prefix_cache_dev_endpoint(engine, server, monkeypatch):
    # vLLM's dev endpoint, only with VLLM_SERVER_DEV_MODE=1: 200 when reset, 409 while busy
    from types import SimpleNamespace

    from server import BackgroundServer, create_app
    from tests.server.http_util import SSEStream, wait_until
    assert post(server.port, "/reset_prefix_cache", b"")[0] == 404
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    srv = BackgroundServer(create_app(engine, SimpleNamespace(served_model_name=[MODEL_NAME])), port=0).start()
    try:
        def idle():
            s = engine.get_stats()
            return s.num_running == s.num_waiting == 0 and s.num_free_blocks == s.num_gpu_blocks
        assert wait_until(idle, 30)
        status, _, body = post(srv.port, "/reset_prefix_cache", b"")
        assert status == 200 and json.loads(body) == {"success": True}
        stream = SSEStream(srv.port, C, c(max_tokens=400, ignore_eos=True, stream=True))
        next(stream.events())
        _check_envelope(*post(srv.port, "/reset_prefix_cache", b""), 409)
        stream.close()
        assert wait_until(idle, 30)
        assert post(srv.port, "/reset_prefix_cache", b"")[0] == 200
    finally:
        srv.stop()




R = "/v1/responses"


# A refusal names the field the client sent, in its param and its message: chat's
# max_completion_tokens, the Responses API's max_output_tokens (the engine's max_tokens).
@pytest.mark.parametrize("path, body, param", [
    (CH, ch(max_tokens=None, max_completion_tokens=-1), "max_completion_tokens"),
    (CH, ch(max_tokens=None, max_completion_tokens=5000), "max_completion_tokens"),  # past max_model_len
    (CH, ch(max_tokens=None, max_completion_tokens=2, min_tokens=3), "min_tokens"),
    (R, {"model": MODEL_NAME, "input": "hi", "max_output_tokens": -1}, "max_output_tokens"),
    (R, {"model": MODEL_NAME, "input": "hi", "max_output_tokens": 5000}, "max_output_tokens"),
    (R, {"model": MODEL_NAME, "input": "hi", "max_output_tokens": 2, "min_tokens": 3}, "min_tokens"),
], ids=["chat_neg", "chat_too_long", "chat_min_tokens", "responses_neg", "responses_too_long",
        "responses_min_tokens"])
def test_refusal_names_the_field_sent(server, path, body, param):
    status, hdrs, data = post(server.port, path, body)
    _check_envelope(status, hdrs, data, 400, param)
    sent = "max_output_tokens" if path == R else "max_completion_tokens"
    message = json.loads(data)["error"]["message"]
    assert sent in message and "max_tokens" not in message, message


@pytest.fixture(scope="module")
def default_model_server():
    """The built-in default model served (what ``vengine serve`` serves with no model)."""
    from pyengine.config import DEFAULT_MODEL_DIR
    from tests.server.conftest import make_engine, serve_app

    engine = make_engine(DEFAULT_MODEL_DIR, num_gpu_blocks_override=256)
    yield from serve_app(engine, served_model_name=[MODEL_NAME])
    engine.shutdown()


# Refused in the serving object's preparation, which runs on gevent's threadpool: the error
# is raised again in the handler's greenlet, so gevent prints no traceback for a client's
# mistake (the server's stderr stays quiet).
QUIET_400S = [
    ("max_tokens_huge", C, c(max_tokens=10 ** 9), "max_tokens"),
    ("max_completion_tokens_huge", CH, ch(max_tokens=None, max_completion_tokens=10 ** 9), "max_completion_tokens"),
    ("empty_chat_content", CH, ch(messages=[{"role": "user", "content": ""}]), "messages"),
    ("max_output_tokens_huge", "/v1/responses", {"model": MODEL_NAME, "input": "hi", "max_output_tokens": 10 ** 9},
     "max_output_tokens"),
]


@pytest.mark.parametrize("case", QUIET_400S, ids=[x[0] for x in QUIET_400S])
def test_client_error_prints_no_traceback(default_model_server, capfd, case):
    _, path, body, param = case
    port = default_model_server.port
    capfd.readouterr()
    status, hdrs, data = post(port, path, body)
    _check_envelope(status, hdrs, data, 400, param)
    assert post(port, C, OK_C)[0] == 200  # still serving
    err = capfd.readouterr().err
    assert "Traceback" not in err and "failed with" not in err, err
