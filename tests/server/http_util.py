"""Raw HTTP/SSE helpers for the server tests (stdlib only: exact bytes and arrival times)."""
from __future__ import annotations

import contextlib
import http.client
import json
import socket
import time


def request(port: int, method: str, path: str, body=None, headers: dict | None = None,
            timeout: float = 60.0, cafile=None) -> tuple[int, dict, bytes]:
    """One request; ``body`` may be bytes/str (sent as is) or an object (sent as JSON).
    ``cafile``: over HTTPS, trusting that certificate file."""
    h = {"Content-Type": "application/json"}
    h.update(headers or {})
    if body is not None and not isinstance(body, (bytes, str)):
        body = json.dumps(body)
    if cafile is None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    else:
        import ssl
        conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=timeout,
                                           context=ssl.create_default_context(cafile=str(cafile)))
    try:
        conn.request(method, path, body=body, headers={k: v for k, v in h.items() if v is not None})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


def post(port: int, path: str, body, headers: dict | None = None, timeout: float = 60.0):
    status, hdrs, data = request(port, "POST", path, body, headers, timeout)
    return status, hdrs, data


def get(port: int, path: str, headers: dict | None = None):
    return request(port, "GET", path, None, headers)


def metrics(port: int) -> dict[str, float]:
    """Prometheus samples without labels' detail: ``{"vllm:num_requests_running": 0.0, ...}``."""
    status, _, data = get(port, "/metrics")
    assert status == 200
    out: dict[str, float] = {}
    for line in data.decode().splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, value = line.rsplit(" ", 1)
        name = name_labels.split("{", 1)[0]
        if name.endswith("_bucket"):
            continue
        out[name] = out.get(name, 0.0) + float(value)
    return out


class SSEStream:
    """A streaming POST on a raw socket: ``events()`` yields ``(arrival_time, data)``."""

    def __init__(self, port: int, path: str, body: dict, headers: dict | None = None,
                 rcvbuf: int | None = None, timeout: float = 120.0):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(timeout)
        self.sock.connect(("127.0.0.1", port))
        payload = json.dumps(body).encode()
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self.t_sent = time.monotonic()
        self.sock.sendall((f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                           f"Content-Length: {len(payload)}\r\n{extra}\r\n").encode() + payload)
        self.status: int | None = None
        self.headers = b""
        self._buf = b""

    def _recv(self) -> bool:
        d = self.sock.recv(65536)
        if not d:
            return False
        self._buf += d
        return True

    def read_headers(self) -> int:
        while b"\r\n\r\n" not in self._buf:
            if not self._recv():
                raise ConnectionError("closed before headers")
        self.headers, self._buf = self._buf.split(b"\r\n\r\n", 1)
        self.status = int(self.headers.split(b" ", 2)[1])
        return self.status

    def events(self):
        """Yield (monotonic arrival time, data string) per SSE event until [DONE] or EOF.
        Assumes chunked transfer encoding (what the server sends for streams)."""
        if self.status is None:
            self.read_headers()
        body = b""
        while True:
            # de-chunk what we have
            while True:
                i = self._buf.find(b"\r\n")
                if i < 0:
                    break
                size = int(self._buf[:i].split(b";")[0], 16)
                if len(self._buf) < i + 2 + size + 2:
                    break
                if size == 0:
                    self._buf = b""
                    break
                body += self._buf[i + 2:i + 2 + size]
                self._buf = self._buf[i + 2 + size + 2:]
            now = time.monotonic()
            while b"\n\n" in body:
                ev, body = body.split(b"\n\n", 1)
                assert ev.startswith(b"data: "), ev
                data = ev[6:].decode()
                yield now, data
                if data == "[DONE]":
                    return
            if not self._recv():
                return

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def collect_stream(port: int, path: str, body: dict, headers: dict | None = None):
    """Run a stream to the end: (status, [(t, parsed json or "[DONE]")], t_sent)."""
    s = SSEStream(port, path, body, headers)
    try:
        status = s.read_headers()
        evs = [(t, d if d == "[DONE]" else json.loads(d)) for t, d in s.events()]
        return status, evs, s.t_sent
    finally:
        s.close()


def completion_text(events) -> dict[int, str]:
    out: dict[int, str] = {}
    for _, e in events:
        if e == "[DONE]":
            continue
        for c in e.get("choices", []):
            t = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
            out[c["index"]] = out.get(c["index"], "") + (t or "")
    return out


def wait_until(pred, timeout: float = 10.0, interval: float = 0.02) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(interval)
    return pred()


def spawn_server(model_dir, name: str, *flags: str, env: dict | None = None, cwd=None, timeout: float = 120.0):
    """``python -m server serve MODEL --port 0 --device cpu --served-model-name NAME FLAGS``
    in a subprocess; returns ``(proc, port)`` once it says where it serves (the caller
    kills the process). Fails with its output if it exits or stays silent."""
    import re
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-m", "server", "serve", str(model_dir), "--port", "0", "--device", "cpu",
         "--served-model-name", name, *flags],
        cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, deadline = [], time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        lines.append(line)
        m = re.search(rf"serving {re.escape(name)} on https?://127\.0\.0\.1:(\d+)", line)
        if m:
            return proc, int(m.group(1))
    proc.kill()
    proc.wait()
    raise AssertionError("the server did not start:\n" + "".join(lines))


@contextlib.contextmanager
def served(model_dir, name: str, *flags: str, **kw):
    """``spawn_server``'s ``(proc, port)`` for a with-block that must end with a clean
    SIGTERM shutdown (exit status 0); the process is killed if anything fails."""
    import signal

    proc, port = spawn_server(model_dir, name, *flags, **kw)
    try:
        yield proc, port
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
