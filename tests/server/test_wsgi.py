"""The gevent WSGI layer: the shutdown drain (``--shutdown-timeout``, as vLLM: new
connections refused, requests in flight finish or are cut with an error event and
[DONE], exit 0) and HTTP/1.0 keep-alive streams that end."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers import SLOW_STEP_SITECUSTOMIZE
from tests.server.conftest import MODEL_NAME, make_engine, slow_steps
from tests.server.http_util import SSEStream, spawn_server

REPO = Path(__file__).resolve().parents[2]
STEP_DELAY_S = 0.02  # a slow engine step, so that a long stream is surely in flight
SHUTDOWN_TIMEOUT_S = 5


def _stream_body(max_tokens):
    return {"model": MODEL_NAME, "prompt": "def main():", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}


def _refused(port) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        return False
    except OSError:
        return True


@pytest.fixture(scope="module")
def slow_engine(llama_dir):
    eng = make_engine(llama_dir, multiprocess=False)  # the slow step is patched into this process
    slow_steps(eng, STEP_DELAY_S)
    yield eng
    eng.shutdown()


def _serve(engine, shutdown_timeout):
    from server import BackgroundServer, create_app
    app = create_app(engine, SimpleNamespace(served_model_name=[MODEL_NAME]))
    return BackgroundServer(app, port=0, shutdown_timeout=shutdown_timeout).start()


@pytest.mark.timeout(120)
def test_drain_lets_streams_finish_and_refuses_new_connections(slow_engine):
    srv = _serve(slow_engine, shutdown_timeout=60)
    s = SSEStream(srv.port, "/v1/completions", _stream_body(60))
    events = s.events()
    first = next(events)[1]
    assert "choices" in json.loads(first)
    stopper = threading.Thread(target=srv.stop)
    stopper.start()
    assert _wait(lambda: _refused(srv.port), 10), "new connections must be refused during the drain"
    rest = [d for _, d in events]
    s.close()
    assert rest[-1] == "[DONE]"
    finals = [c for d in rest[:-1] for c in json.loads(d)["choices"] if c.get("finish_reason")]
    assert [c["finish_reason"] for c in finals] == ["length"]
    stopper.join(30)
    assert not stopper.is_alive()


@pytest.mark.timeout(120)
def test_drain_timeout_cuts_streams_with_an_error_event_and_done(slow_engine):
    srv = _serve(slow_engine, shutdown_timeout=0.5)
    s = SSEStream(srv.port, "/v1/completions", _stream_body(500))  # ~10 s of steps
    events = s.events()
    next(events)
    t0 = time.monotonic()
    stopper = threading.Thread(target=srv.stop)
    stopper.start()
    rest = [d for _, d in events]
    took = time.monotonic() - t0
    s.close()
    assert rest[-1] == "[DONE]", rest[-3:]
    err = json.loads(rest[-2])["error"]
    assert err["code"] == 503 and "shutting down" in err["message"]
    assert took < 5, took  # cut after the 0.5 s drain, not after the stream's ~10 s
    stopper.join(30)
    assert not stopper.is_alive()
    assert _wait(lambda: (lambda st: st.num_running + st.num_waiting == 0)(slow_engine.get_stats()), 10)


def _wait(pred, timeout):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


def test_http10_keep_alive_stream_ends(server):
    # issue 12: the reply said keep-alive with neither a length nor chunking: it never ended
    for stream in (True, False):
        payload = json.dumps({"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4, "stream": stream}).encode()
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        try:
            sock.sendall(b"POST /v1/completions HTTP/1.0\r\nConnection: keep-alive\r\n"
                         b"Content-Type: application/json\r\n"
                         + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
            data = b""
            while True:
                if stream:
                    chunk = sock.recv(65536)  # must reach EOF: the server closes
                    if not chunk:
                        break
                    data += chunk
                else:
                    data += sock.recv(65536)
                    head, _, body = data.partition(b"\r\n\r\n")
                    m = re.search(rb"(?i)content-length: *(\d+)", head)
                    if m and len(body) >= int(m.group(1)):
                        break
        finally:
            sock.close()
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.0 200") or head.startswith(b"HTTP/1.1 200"), head
        assert b"chunked" not in head.lower()
        if stream:
            assert b"connection: close" in head.lower()
            assert body.rstrip().endswith(b"data: [DONE]")
        else:  # a length: the connection may stay open
            assert b"connection: keep-alive" in head.lower()
            assert json.loads(body)["choices"]




@pytest.mark.timeout(180)
def test_sigterm_drains_then_exits_zero(llama_dir, tmp_path):
    # issue 12 kind 3: every stream was cut after 1 s with no terminal event and no [DONE]
    (tmp_path / "sitecustomize.py").write_text(SLOW_STEP_SITECUSTOMIZE.format(root=str(REPO), delay=STEP_DELAY_S))
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}")
    proc, port = spawn_server(llama_dir, MODEL_NAME, "--max-model-len", "512", "--num-gpu-blocks-override", "256",
                              "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S), "--disable-access-log", env=env, cwd=REPO)
    try:
        results, started = {}, {"long": threading.Event(), "short": threading.Event()}

        def run(name, body):
            st = SSEStream(port, "/v1/completions", body)
            try:
                status = st.read_headers()
                events = []
                for _, d in st.events():
                    events.append(d if d == "[DONE]" else json.loads(d))
                    started[name].set()
                results[name] = (status, events)
            finally:
                st.close()
                started[name].set()
        long = threading.Thread(target=run, args=("long", _stream_body(450)))  # >= 9 s of steps
        long.start()
        assert started["long"].wait(60)
        short = threading.Thread(target=run, args=("short", _stream_body(10)))  # ~0.2 s, slower when loaded
        short.start()
        assert started["short"].wait(60)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert _wait(lambda: _refused(port), 10)
        short.join(60)
        long.join(60)
        assert proc.wait(60) == 0
        took = time.monotonic() - t0
        # the short stream finished inside the drain ...
        status, events = results["short"]
        assert status == 200 and events[-1] == "[DONE]"
        assert [c["finish_reason"] for e in events[:-1] for c in e["choices"] if c.get("finish_reason")] == ["length"]
        # ... the long one was cut when it ran out, with an error event then [DONE]
        status, events = results["long"]
        assert status == 200 and events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == 503 and "shutting down" in events[-2]["error"]["message"]
        assert all("choices" in e for e in events[:-2])
        assert took < SHUTDOWN_TIMEOUT_S + 20, took
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --- connection handling (issue 16 kind 1): timeouts, and a cap on requests, not sockets ---

def _serve_limited(engine, **limits):
    from server import BackgroundServer, create_app
    app = create_app(engine, SimpleNamespace(served_model_name=[MODEL_NAME]))
    return BackgroundServer(app, port=0, **limits).start()


def _connect(port, timeout=30.0):
    return socket.create_connection(("127.0.0.1", port), timeout=timeout)


def _read_to_eof(sock) -> bytes:
    """Everything until the server closes (a reset counts as closed)."""
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


def _response(data: bytes):
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def _one_request(sock, raw: bytes):
    """Send ``raw`` on a kept-alive connection and read one Content-Length response."""
    sock.sendall(raw)
    data = b""
    while True:
        head, sep, body = data.partition(b"\r\n\r\n")
        if sep:
            m = re.search(rb"(?i)content-length: *(\d+)", head)
            if m and len(body) >= int(m.group(1)):
                return _response(data)
        chunk = sock.recv(65536)
        assert chunk, f"closed before a full response: {data!r}"
        data += chunk


_HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
_PARTIAL_HEADERS = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"


def _completion_request(body: dict) -> bytes:
    payload = json.dumps(body).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)


def _partial_body() -> bytes:
    # announces 1000 body bytes, sends 10: it holds a request slot while the body is awaited
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n{\"prompt\":")


@pytest.mark.timeout(120)
def test_idle_and_half_open_sockets_at_the_cap_do_not_stop_health(engine):
    # issue 16: with --max-concurrent-streams 4, four silent connections made /health hang
    cap = 4
    srv = _serve_limited(engine, max_concurrent_streams=cap, timeout_keep_alive=60, request_read_timeout=60)
    socks = []
    try:
        for _ in range(3 * cap):
            socks.append(_connect(srv.port))  # silent
        for _ in range(cap):
            s = _connect(srv.port)
            s.sendall(_PARTIAL_HEADERS)  # headers never finished
            socks.append(s)
        t0 = time.monotonic()
        with _connect(srv.port, timeout=5) as s:
            status, _, _ = _one_request(s, _HEALTH)
            assert status == 200
        with _connect(srv.port, timeout=5) as s:
            status, _, body = _one_request(s, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            assert status == 200 and b"vllm:num_requests_running" in body
        assert time.monotonic() - t0 < 5
        # idle sockets hold no request slot: a completion is served
        with _connect(srv.port) as s:
            status, _, body = _one_request(s, _completion_request({"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}))
            assert status == 200, body
        # requests that hold every slot (bodies still awaited) still leave /health and /metrics
        for _ in range(cap):
            s = _connect(srv.port)
            s.sendall(_partial_body())
            socks.append(s)
        time.sleep(0.3)
        with _connect(srv.port, timeout=5) as s:
            assert _one_request(s, _HEALTH)[0] == 200
            assert _one_request(s, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")[0] == 200
    finally:
        for s in socks:
            s.close()
        srv.stop()


@pytest.mark.timeout(120)
def test_request_over_the_cap_gets_a_prompt_503_with_retry_after(slow_engine):
    # issue 16: connections over the cap sat in the accept queue for minutes
    srv = _serve_limited(slow_engine, max_concurrent_streams=2, timeout_keep_alive=60, request_read_timeout=60)
    streams = []
    try:
        for _ in range(2):
            st = SSEStream(srv.port, "/v1/completions", _stream_body(400))  # ~8 s of 20 ms steps
            next(st.events())  # in flight
            streams.append(st)
        for path, body in (("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}),
                           ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]})):
            payload = json.dumps(body).encode()
            t0 = time.monotonic()
            with _connect(srv.port) as s:
                status, headers, data = _one_request(
                    s, f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
            took = time.monotonic() - t0
            assert status == 503 and took < 1.0, (status, took)
            assert int(headers["retry-after"]) >= 1
            err = json.loads(data)["error"]
            assert err["code"] == 503 and err["type"] == "ServiceUnavailableError" and err["param"] is None
            assert "--max-concurrent-streams" in err["message"]
        with _connect(srv.port, timeout=5) as s:  # the cap does not stop these
            assert _one_request(s, _HEALTH)[0] == 200
            assert _one_request(s, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")[0] == 200
        for st in streams:  # the clients leave: their slots come back
            st.close()

        def served():
            with _connect(srv.port) as s:
                return _one_request(s, _completion_request({"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1}))[0] == 200
        assert _wait(served, 30)
    finally:
        for st in streams:
            st.close()
        srv.stop()


@pytest.mark.timeout(120)
def test_slow_body_gets_408_and_is_closed_after_the_read_timeout(engine):
    srv = _serve_limited(engine, max_concurrent_streams=1, timeout_keep_alive=60, request_read_timeout=1.0)
    try:
        with _connect(srv.port) as s:
            s.sendall(_partial_body())
            t0 = time.monotonic()
            data = _read_to_eof(s)
            took = time.monotonic() - t0
        status, headers, body = _response(data)
        assert status == 408 and 0.8 <= took < 5, (status, took)
        assert headers["connection"] == "close"
        err = json.loads(body)["error"]
        assert err["code"] == 408 and "--request-read-timeout" in err["message"]
        # its slot is free again (the cap is 1)
        with _connect(srv.port) as s:
            status, _, body = _one_request(s, _completion_request({"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1}))
            assert status == 200, body
    finally:
        srv.stop()


@pytest.mark.timeout(120)
def test_slow_headers_are_cut_at_the_read_timeout_even_while_bytes_trickle(engine):
    srv = _serve_limited(engine, timeout_keep_alive=60, request_read_timeout=1.0)
    try:
        with _connect(srv.port) as s:
            s.sendall(_PARTIAL_HEADERS)
            t0 = time.monotonic()
            data = b""
            while time.monotonic() - t0 < 10:  # one header byte every 0.1 s, never a blank line
                try:
                    s.sendall(b"X")
                except OSError:
                    break
                s.settimeout(0.1)
                try:
                    chunk = s.recv(65536)
                except TimeoutError:
                    continue
                except ConnectionResetError:
                    break
                if not chunk:
                    break
                data += chunk
            took = time.monotonic() - t0
        assert 0.8 <= took < 5, took
        assert data.startswith(b"HTTP/1.1 408"), data
    finally:
        srv.stop()


@pytest.mark.timeout(120)
def test_idle_connections_are_closed_after_timeout_keep_alive(engine):
    srv = _serve_limited(engine, timeout_keep_alive=1.0, request_read_timeout=60)
    try:
        with _connect(srv.port) as s:  # a fresh connection that says nothing
            t0 = time.monotonic()
            assert _read_to_eof(s) == b""
            assert 0.8 <= time.monotonic() - t0 < 5
        with _connect(srv.port) as s:  # keep-alive: a request in time is served on the same connection ...
            assert _one_request(s, _HEALTH)[0] == 200
            time.sleep(0.3)
            assert _one_request(s, _HEALTH)[0] == 200
            t0 = time.monotonic()  # ... and then the idle connection is closed
            assert _read_to_eof(s) == b""
            assert 0.8 <= time.monotonic() - t0 < 5
    finally:
        srv.stop()
