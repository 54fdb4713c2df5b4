"""Two ``vengine serve`` replicas behind vllm-router (issue 29; docs/deploy.md "Replicas
behind a router"), end to end on CPU with a tiny model:

- ``round_robin``: every request is served, by both replicas;
- SIGTERM to one replica in the middle of a stream of requests: no request fails (the
  replica drains what it has, its listening socket closes, the router sends the rest to
  the other one);
- ``kv_aware`` fed by each replica's KV events (``--kv-events-config``, ZMQ): a repeated
  long prefix goes to the replica that holds it; its prefix-cache hits rise, the other's
  do not.

vllm-router's kv_aware over HTTP workers tokenizes the prompt itself
(``VLLM_ROUTER_TOKENIZER``: the model directory), hashes the token blocks its own way and
learns which worker holds which tokens from the ``token_ids`` of the BlockStored events
(their ``block_hashes`` only key the removals), so the engine's hash function need not be
vLLM's."""
from __future__ import annotations

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

import pytest

from tests.server.http_util import get, metrics, post

REPO = Path(__file__).resolve().parents[2]
ROUTER = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))
pytestmark = pytest.mark.skipif(not Path(ROUTER).exists(), reason="vllm-router is not installed (test extra)")


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _wait_line(proc, text: str, timeout: float) -> None:
    lines = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if text in line:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # keep draining
            return
    raise AssertionError(f"no {text!r}:\n" + "".join(lines[-30:]))


def _replica(model_dir, port: int, kv_port: int):
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{kv_port}"}
    cmd = [sys.executable, "-m", "server", str(model_dir), "--port", str(port), "--device", "cpu",
           "--api-server-count", "1", "--num-gpu-blocks-override", "256", "--max-model-len", "512",
           "--disable-access-log", "--shutdown-timeout", "20", "--served-model-name", "tiny",
           "--kv-events-config", json.dumps(cfg)]
    # the engine on a thread of the replica (no engine process to start: a faster start-up)
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1", VENGINE_ENABLE_MULTIPROCESSING="0"))


def _router(model_dir, port: int, workers: list[str], policy: str, kv_sources=()):
    cmd = [ROUTER, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers, "--policy", policy,
           "--worker-startup-check-interval", "1", "--health-check-interval-secs", "1",
           "--log-level", "info"]
    for url, ep in kv_sources:
        cmd += ["--kv-event-source", f"{url}={ep}"]
    if kv_sources:
        cmd += ["--kv-event-block-size", "16", "--kv-event-model", "tiny"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, VLLM_ROUTER_TOKENIZER=str(model_dir)))


def _wait_http(port: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if get(port, "/health")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"nothing healthy on {port}")


def _stop(*procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()


def _complete(port: int, prompt: str, max_tokens: int = 4) -> int:
    status, _, raw = post(port, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                                    "temperature": 0}, timeout=60)
    return status


def _served(port: int) -> float:
    return metrics(port).get("vllm:request_success_total", 0.0)


def _hits(port: int) -> float:
    return metrics(port).get("vllm:prefix_cache_hits_total", 0.0)


@pytest.mark.timeout(240)
def test_replicas_behind_vllm_router(llama_dir):
    tiny_dir = llama_dir
    p0, p1, k0, k1, rport, kport = _free_ports(6)
    reps = [_replica(tiny_dir, p0, k0), _replica(tiny_dir, p1, k1)]
    router = None
    try:
        for r in reps:
            _wait_line(r, "vengine: serving", 180)
        urls = [f"http://127.0.0.1:{p0}", f"http://127.0.0.1:{p1}"]

        # kv_aware: a long prefix first sent to one replica is routed back to it
        router = _router(tiny_dir, kport, urls, "kv_aware",
                         [(urls[0], f"tcp://127.0.0.1:{k0}"), (urls[1], f"tcp://127.0.0.1:{k1}")])
        _wait_http(kport)
        time.sleep(1.0)  # the router's subscribers join the replicas' PUB sockets
        prefix = " ".join(["the quick brown fox jumps over the lazy dog"] * 12)
        before = [_served(p) for p in (p0, p1)]
        assert _complete(kport, prefix + " first") == 200
        first = [_served(p) - b for p, b in zip((p0, p1), before)]
        holder = first.index(1.0)
        other = 1 - holder
        time.sleep(0.5)  # its BlockStored events reach the router
        hits = [_hits(p) for p in (p0, p1)]
        for i in range(4):
            assert _complete(kport, prefix + f" again {i}") == 200
        gained = [_hits(p) - h for p, h in zip((p0, p1), hits)]
        assert gained[holder] >= 4 * 16 * 4 and gained[other] == 0, gained  # ~4 x its cached blocks
        _stop(router)

        # round_robin: every request served, by both
        router = _router(tiny_dir, rport, urls, "round_robin")
        _wait_http(rport)
        before = [_served(p) for p in (p0, p1)]
        statuses = [_complete(rport, f"hello {i}") for i in range(6)]
        assert statuses == [200] * 6
        served = [_served(p) - b for p, b in zip((p0, p1), before)]
        assert served == [3.0, 3.0], served

        # SIGTERM to one replica while requests flow: none fails
        results: list[int] = []

        def client():
            for i in range(16):
                results.append(_complete(rport, f"drain {i}", max_tokens=8))
        t = threading.Thread(target=client)
        t.start()
        time.sleep(0.5)
        reps[1].send_signal(signal.SIGTERM)
        t.join(120)
        assert results == [200] * 16, results
        assert reps[1].wait(60) == 0
    finally:
        _stop(*([router] if router is not None else []), *reps)
