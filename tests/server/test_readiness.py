"""Readiness (issue 29): ``/health`` is 503 while the server loads and while it drains, so a
readiness probe or a router stops sending before a replica is ready or after it began to
go away.

- ``vengine serve`` binds its port before the engine loads and answers on it meanwhile
  (``server.loading``): ``/health`` 503 ``{"status": "loading"}``, ``/version`` 200, every
  other path 503 with OpenAI's error body and ``Retry-After``; then 200, on the same port,
  with no refused connection in between (the socket stays bound through the hand-over).
  The load of the tiny model is not made slower: what a start costs (the model, the
  tokenizer, the engine's set-up; seconds here, and more than the 10 ms between probes on
  any machine) is the window the test probes in.
- SIGTERM with a stream in flight and ``--shutdown-timeout``: ``/health`` on an open
  connection (a router's pooled one) answers 503 ``{"status": "draining"}`` while the
  stream finishes; new connections are refused.

(``--api-server-count N``: tests/server/test_api_server_count.py probes the supervisor's
loading answer.)"""
from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers import SLOW_STEP_SITECUSTOMIZE
from tests.server.conftest import MODEL_NAME
from tests.server.http_util import SSEStream, get, request

REPO = Path(__file__).resolve().parents[2]
PROBE_INTERVAL_S = 0.01


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _probe(port: int):
    """One fresh-connection ``GET /health``: ``(status, body, headers)``, or None when the
    connection is refused or reset (a listening socket closed with the connection still in
    its accept queue resets it: as refused, nobody served it)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/health")
        r = conn.getresponse()
        return r.status, r.read(), dict(r.getheaders())
    except (ConnectionRefusedError, ConnectionResetError):
        return None
    finally:
        conn.close()


def _spawn(model_dir, port: int, *flags: str, env: dict | None = None):
    # the engine on a thread of the server (VENGINE_ENABLE_MULTIPROCESSING=0): a start of
    # seconds, not tens of them, on a loaded 2-core box; the loading window is the same code
    cmd = [sys.executable, "-m", "server", str(model_dir), "--port", str(port), "--device", "cpu",
           "--api-server-count", "1", "--served-model-name", MODEL_NAME, "--max-model-len", "512",
           "--num-gpu-blocks-override", "256", "--disable-access-log", *flags]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(env or os.environ, PYTHONUNBUFFERED="1", VENGINE_ENABLE_MULTIPROCESSING="0"))


def _drain_output(proc, lines: list[str]) -> threading.Thread:
    t = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    t.start()
    return t


def _while_loading(port: int) -> dict:
    """What the other paths answer while /health says loading."""
    out = {}
    for method, path, body in (("GET", "/v1/models", None), ("GET", "/metrics", None), ("GET", "/version", None),
                               ("POST", "/v1/completions", {"model": MODEL_NAME, "prompt": "hi"}),
                               ("GET", "/", None)):
        out[path] = request(port, method, path, body, timeout=30)
    return out


@pytest.mark.timeout(120)
def test_health_is_503_while_loading_then_200(llama_dir):
    port = _free_port()
    proc = _spawn(llama_dir, port)
    lines: list[str] = []
    reader = _drain_output(proc, lines)
    try:
        seen, others = [], None  # seen: one entry per change of answer (None: refused)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None:
            got = _probe(port)
            status = None if got is None else got[0]
            if not seen or seen[-1][0] != status:
                seen.append((status, got))
            if status == 503 and others is None:
                others = _while_loading(port)
            if status == 200:
                break
            time.sleep(PROBE_INTERVAL_S)
        statuses = [s for s, _ in seen]
        # refused until the port is bound, then 503 until the engine is ready, then 200:
        # never refused once bound (the hand-over keeps the socket), never 503 after 200
        assert statuses in ([None, 503, 200], [503, 200]), (statuses, "".join(lines[-30:]))
        _, (_, body, headers) = seen[statuses.index(503)]
        assert json.loads(body) == {"status": "loading"}
        assert headers["Retry-After"] == "5" and headers["Connection"] == "close"
        assert others is not None
        for path in ("/v1/models", "/metrics", "/v1/completions", "/"):
            status, hdrs, data = others[path]
            assert status == 503 and hdrs["Retry-After"] == "5", (path, status, data)
            err = json.loads(data)["error"]
            assert err["code"] == 503 and "loading" in err["message"], (path, err)
        assert others["/version"][0] == 200 and "version" in json.loads(others["/version"][2])
        # ready: the app proper on the same port
        assert get(port, "/v1/models")[0] == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        reader.join(10)
        out = "".join(lines)
        assert f"vengine: loading {llama_dir}; http://127.0.0.1:{port} answers 503 until it is ready" in out
        assert out.index("vengine: loading") < out.index(f"vengine: serving {MODEL_NAME} on")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(120)
def test_engine_start_failure_still_exits_non_zero(no_tokenizer_dir):
    # the port answered 503 while the engine tried to start; the failure (a model whose
    # tokenizer cannot encode text) ends the process with its reason and status 2, as before
    proc = _spawn(no_tokenizer_dir, 0)
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 2, out
    assert "vengine: loading" in out and "vengine serve: cannot load" in out and "cannot encode text" in out
    assert "vengine: serving" not in out


STEP_DELAY_S = 0.02  # a slow engine step (patched in by sitecustomize), so the stream surely runs


def _await_serving(proc, lines: list[str], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if "vengine: serving" in line:
            return
    raise AssertionError("the server did not start:\n" + "".join(lines[-30:]))


@pytest.mark.timeout(120)
def test_health_is_503_draining_while_a_stream_finishes(llama_dir, tmp_path):
    (tmp_path / "sitecustomize.py").write_text(SLOW_STEP_SITECUSTOMIZE.format(root=str(REPO), delay=STEP_DELAY_S))
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}")
    port = _free_port()
    proc = _spawn(llama_dir, port, "--shutdown-timeout", "30", env=env)
    lines: list[str] = []
    try:
        _await_serving(proc, lines)
        reader = _drain_output(proc, lines)
        pooled = http.client.HTTPConnection("127.0.0.1", port, timeout=30)  # a router's kept connection
        pooled.request("GET", "/health")
        r = pooled.getresponse()
        assert (r.status, r.read(), r.will_close) == (200, b"", False)
        sock = pooled.sock
        stream = SSEStream(port, "/v1/completions", {"model": MODEL_NAME, "prompt": "def main():", "max_tokens": 150,
                                                     "temperature": 0, "ignore_eos": True, "stream": True})
        events = stream.events()
        assert "choices" in json.loads(next(events)[1])
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while _probe(port) is not None and time.monotonic() < deadline:  # the drain began
            time.sleep(PROBE_INTERVAL_S)
        assert _probe(port) is None, "new connections are refused while draining"
        assert pooled.sock is sock  # the kept connection, not a new one
        pooled.request("GET", "/health")
        r = pooled.getresponse()
        assert r.status == 503 and json.loads(r.read()) == {"status": "draining"} and r.will_close
        pooled.close()
        assert proc.poll() is None  # still draining: the stream has not finished
        rest = [d for _, d in events]
        stream.close()
        assert rest[-1] == "[DONE]", rest[-3:]
        finals = [c["finish_reason"] for d in rest[:-1] for c in json.loads(d)["choices"] if c.get("finish_reason")]
        assert finals == ["length"]  # it finished, not cut
        assert proc.wait(30) == 0
        reader.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --- in process: the loading app, and the hand-over on one socket ---


def test_loading_app_answers_and_the_socket_outlives_it(engine):
    from server import BackgroundServer, create_app
    from server.loading import answering_while_loading
    from server.wsgi import bind_listener

    args = SimpleNamespace(host="127.0.0.1", root_path="/llm", served_model_name=[MODEL_NAME])
    listener = bind_listener("127.0.0.1", 0)
    port = listener.getsockname()[1]
    with answering_while_loading(args, listener, None, "a model") as srv:
        assert srv.port == port
        for path in ("/health", "/llm/health"):  # --root-path, as the app proper
            status, hdrs, body = request(port, "GET", path)
            assert (status, json.loads(body)) == (503, {"status": "loading"}), path
        status, hdrs, body = request(port, "HEAD", "/health")
        assert status == 503 and hdrs["Retry-After"] == "5"
        status, _, body = request(port, "DELETE", "/no/such/path")
        assert status == 503 and json.loads(body)["error"]["type"] == "ServiceUnavailableError"
        assert request(port, "GET", "/llm/version")[0] == 200
    # the loading server is gone, the socket still listens: a connection made now waits
    # in the backlog for the server that follows, and is answered by it
    waiting = socket.create_connection(("127.0.0.1", port), timeout=30)
    waiting.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    with BackgroundServer(create_app(engine, args), listener=listener):
        data = b""
        while chunk := waiting.recv(65536):
            data += chunk
        waiting.close()
        assert data.startswith(b"HTTP/1.1 200"), data[:200]



def test_loading_server_answers_what_it_accepted_before_it_stops():
    # the hand-over: a request the loading server accepted (here, its headers half sent)
    # when it is told to stop gets its 503 rather than a reset connection
    from server.loading import answering_while_loading
    from server.wsgi import bind_listener

    args = SimpleNamespace(host="127.0.0.1")
    listener = bind_listener("127.0.0.1", 0)
    port = listener.getsockname()[1]
    try:
        with answering_while_loading(args, listener, None, "a model") as srv:
            client = socket.create_connection(("127.0.0.1", port), timeout=30)
            client.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            time.sleep(0.5)  # accepted by now (an idle hub accepts at once)
            stopper = threading.Thread(target=srv.stop)
            stopper.start()
            time.sleep(0.3)  # stopping: it accepts no more and waits for what it took
            client.sendall(b"\r\n")
            data = b""
            while chunk := client.recv(65536):
                data += chunk
            client.close()
            stopper.join(30)
            assert not stopper.is_alive()
        assert data.startswith(b"HTTP/1.1 503") and b'"loading"' in data, data[:300]
    finally:
        listener.close()

@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_loading_answers_over_https(tmp_path):
    # --ssl-keyfile/--ssl-certfile: a probe over HTTPS gets the loading answer too
    from server.loading import answering_while_loading
    from server.wsgi import bind_listener, ssl_args_from
    from tests.helpers import self_signed_cert

    key, cert = self_signed_cert(tmp_path)
    args = SimpleNamespace(host="127.0.0.1", ssl_keyfile=str(key), ssl_certfile=str(cert))
    listener = bind_listener("127.0.0.1", 0)
    with answering_while_loading(args, listener, ssl_args_from(args), "a model") as srv:
        status, _, body = request(srv.port, "GET", "/health", cafile=cert)
        assert (status, json.loads(body)) == (503, {"status": "loading"})
    listener.close()
