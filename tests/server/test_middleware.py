"""server.middleware (CORS, --root-path) and HTTPS (server.wsgi.ssl_args_from): real
browser-style preflight requests and TLS connections against the app over the tiny
CPU model."""
from __future__ import annotations

import http.client
import json
import shutil
from types import SimpleNamespace

import pytest

from tests.server.conftest import API_KEY, MODEL_NAME
from tests.server.http_util import SSEStream, get, post, request

ORIGIN = "http://playground.example"


def _serve(engine, **args):
    from server import BackgroundServer, create_app

    app = create_app(engine, SimpleNamespace(served_model_name=[MODEL_NAME], **args))
    return BackgroundServer(app, port=0).start()


@pytest.fixture(scope="module")
def cors_server(engine):
    """vLLM's CORS defaults, an API key and a root path."""
    srv = _serve(engine, api_key=API_KEY, root_path="/llm")
    yield srv
    srv.stop()


def _preflight(port, path, origin=ORIGIN, headers="authorization, content-type"):
    return request(port, "OPTIONS", path, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": headers,
        "Content-Type": None})


def test_preflight_is_answered_without_the_api_key(cors_server):
    status, hdrs, _ = _preflight(cors_server.port, "/v1/chat/completions")
    assert status == 200, hdrs
    assert hdrs["Access-Control-Allow-Origin"] == "*"
    assert "POST" in hdrs["Access-Control-Allow-Methods"]
    allowed = {h.strip().lower() for h in hdrs["Access-Control-Allow-Headers"].split(",")}
    assert {"authorization", "content-type"} <= allowed
    assert int(hdrs["Access-Control-Max-Age"]) > 0


def test_cross_origin_requests_carry_the_cors_headers(cors_server):
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
    status, hdrs, _ = post(cors_server.port, "/v1/completions", body, headers={"Origin": ORIGIN})
    assert status == 401 and hdrs["Access-Control-Allow-Origin"] == "*"  # the browser may read the error
    status, hdrs, data = post(cors_server.port, "/v1/completions", body,
                              headers={"Origin": ORIGIN, "Authorization": f"Bearer {API_KEY}"})
    assert status == 200, data
    assert hdrs["Access-Control-Allow-Origin"] == "*"


def test_allowed_origins_and_credentials(engine):
    srv = _serve(engine, allowed_origins=[ORIGIN], allowed_methods=["post"], allowed_headers=["content-type"],
                 allow_credentials=True)
    try:
        status, hdrs, _ = _preflight(srv.port, "/v1/completions", headers="content-type")
        assert status == 200
        assert hdrs["Access-Control-Allow-Origin"] == ORIGIN and hdrs["Access-Control-Allow-Credentials"] == "true"
        assert hdrs["Access-Control-Allow-Methods"] == "POST"
        status, hdrs, _ = _preflight(srv.port, "/v1/completions", origin="http://elsewhere.example")
        assert "Access-Control-Allow-Origin" not in hdrs  # the browser refuses the call
    finally:
        srv.stop()


def test_root_path_serves_the_api_under_the_prefix_too(cors_server):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    for path in ("/llm/v1/models", "/v1/models"):
        status, _, data = get(cors_server.port, path, headers=auth)
        assert status == 200, (path, data)
        assert json.loads(data)["data"][0]["id"] == MODEL_NAME
    assert get(cors_server.port, "/llm/v1/models")[0] == 401  # the key is still required under it
    assert get(cors_server.port, "/llm/health")[0] == 200
    assert get(cors_server.port, "/llmx/v1/models", headers=auth)[0] == 404


def test_bad_root_path_is_refused(engine):
    from server import create_app

    with pytest.raises(ValueError, match="--root-path must start with '/'"):
        create_app(engine, SimpleNamespace(served_model_name=[MODEL_NAME], root_path="llm"))


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_https_with_a_self_signed_certificate(engine, tmp_path):
    from server import BackgroundServer, create_app
    from server.wsgi import ssl_args_from
    from tests.helpers import self_signed_cert

    key, cert = self_signed_cert(tmp_path)
    ssl_args = ssl_args_from(SimpleNamespace(ssl_keyfile=str(key), ssl_certfile=str(cert)))
    app = create_app(engine, SimpleNamespace(served_model_name=[MODEL_NAME]))
    srv = BackgroundServer(app, port=0, ssl_args=ssl_args).start()
    try:
        assert srv.base_url.startswith("https://")
        status, _, data = request(srv.port, "POST", "/v1/completions", {
            "model": MODEL_NAME, "prompt": "hello", "max_tokens": 4, "temperature": 0, "stream": True}, cafile=cert)
        assert status == 200 and data.decode().rstrip().endswith("data: [DONE]"), data
        # plain HTTP on the TLS port gets no API answer
        with pytest.raises((ConnectionError, http.client.HTTPException, OSError)):
            s = SSEStream(srv.port, "/v1/completions", {"model": MODEL_NAME, "prompt": "x"}, timeout=10)
            try:
                assert s.read_headers() != 200
            finally:
                s.close()
    finally:
        srv.stop()


@pytest.mark.parametrize("args, match", [
    ({"ssl_keyfile": "k.pem"}, "needs both --ssl-keyfile and --ssl-certfile"),
    ({"ssl_keyfile": "/nonexistent/k.pem", "ssl_certfile": "/nonexistent/c.pem"}, "--ssl-keyfile: no such file"),
])
def test_ssl_arguments_checked(args, match):
    from server.wsgi import ssl_args_from

    with pytest.raises(ValueError, match=match):
        ssl_args_from(SimpleNamespace(**args))


def test_unreadable_certificate_is_refused(tmp_path):
    from server.wsgi import ssl_args_from

    (tmp_path / "k.pem").write_text("not a key")
    (tmp_path / "c.pem").write_text("not a certificate")
    with pytest.raises(ValueError, match="cannot use --ssl-keyfile"):
        ssl_args_from(SimpleNamespace(ssl_keyfile=str(tmp_path / "k.pem"), ssl_certfile=str(tmp_path / "c.pem")))


# --- --max-request-body-bytes for a body without Content-Length (Transfer-Encoding: chunked) ---

BODY_LIMIT = 4096


@pytest.fixture(scope="module")
def limited_server(engine):
    srv = _serve(engine, max_request_body_bytes=BODY_LIMIT)
    yield srv
    srv.stop()


def _chunked_head(path="/v1/completions") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n").encode()


def _chunks(payload: bytes, size: int = 1000) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(payload[i:i + size]), payload[i:i + size])
                    for i in range(0, len(payload), size))


def _read_response(sock):
    """One Content-Length response from ``sock``: (status, headers, body)."""
    import re

    data = b""
    while True:
        head, sep, body = data.partition(b"\r\n\r\n")
        if sep:
            m = re.search(rb"(?i)content-length: *(\d+)", head)
            if m and len(body) >= int(m.group(1)):
                lines = head.decode("latin-1").split("\r\n")
                headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
                return int(lines[0].split()[1]), headers, body[:int(m.group(1))]
        chunk = sock.recv(65536)
        assert chunk, f"closed before a full response: {data!r}"
        data += chunk


def _small() -> bytes:
    return json.dumps({"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1}).encode()


@pytest.mark.parametrize("payload", [
    # valid JSON up to the limit: cut there and parsed, it was served (200)
    _small() + b" " * (3 * BODY_LIMIT),
    json.dumps({"model": MODEL_NAME, "prompt": "x " * BODY_LIMIT, "max_tokens": 1}).encode(),
    _small() + b" " * (BODY_LIMIT + 1 - len(_small())),  # one byte over
], ids=["json-then-spaces", "long-prompt", "one-byte-over"])
def test_chunked_body_over_the_limit_is_413(limited_server, payload):
    import socket

    assert len(payload) > BODY_LIMIT
    with socket.create_connection(("127.0.0.1", limited_server.port), timeout=30) as s:
        s.sendall(_chunked_head() + _chunks(payload) + b"0\r\n\r\n")
        status, _, body = _read_response(s)
        assert status == 413, body
        err = json.loads(body)["error"]
        assert err["code"] == 413 and f"limit: {BODY_LIMIT} bytes" in err["message"]
        # the connection goes on (the rest of the body was read out, as for a Content-Length one)
        s.sendall(_chunked_head() + _chunks(_small()) + b"0\r\n\r\n")
        assert _read_response(s)[0] == 200


def test_chunked_body_at_the_limit_is_served(limited_server):
    import socket

    payload = _small() + b" " * (BODY_LIMIT - len(_small()))
    assert len(payload) == BODY_LIMIT
    with socket.create_connection(("127.0.0.1", limited_server.port), timeout=30) as s:
        s.sendall(_chunked_head() + _chunks(payload) + b"0\r\n\r\n")
        status, _, body = _read_response(s)
        assert status == 200, body


def test_chunked_body_is_cut_at_the_limit_not_read_to_its_end(limited_server):
    # the body never ends: the 413 comes once the limit is passed, without waiting for the rest
    import socket
    import time

    with socket.create_connection(("127.0.0.1", limited_server.port), timeout=30) as s:
        s.sendall(_chunked_head() + _chunks(_small() + b" " * (2 * BODY_LIMIT)))
        t0 = time.monotonic()
        status, headers, body = _read_response(s)
        assert status == 413, body
        assert time.monotonic() - t0 < 5
