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

from tests.server.conftest import MODEL_NAME, make_engine
from tests.server.http_util import SSEStream, spawn_server

REPO = Path(__file__).resolve().parents[2]
STEP_DELAY_S = 0.02  # a slow engine step, so that a long stream is surely in flight
SHUTDOWN_TIMEOUT_S = 5


def _slow_steps(engine, delay=STEP_DELAY_S):
    runner = engine.engine_core.engine_core.model_runner
    orig = runner.execute_model

    def slow(*a, **k):
        time.sleep(delay)
        return orig(*a, **k)
    runner.execute_model = slow


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
    _slow_steps(eng)
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


_SLOW_SITE = """
import sys, time
sys.path.insert(0, {root!r})
import pyengine.worker.model_runner as _mr
_orig = _mr.ModelRunner.execute_model
def _slow(self, *a, **k):
    time.sleep({delay})
    return _orig(self, *a, **k)
_mr.ModelRunner.execute_model = _slow
"""


@pytest.mark.timeout(180)
def test_sigterm_drains_then_exits_zero(llama_dir, tmp_path):
    # issue 12 kind 3: every stream was cut after 1 s with no terminal event and no [DONE]
    (tmp_path / "sitecustomize.py").write_text(_SLOW_SITE.format(root=str(REPO), delay=STEP_DELAY_S))
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
