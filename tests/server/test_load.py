"""Load: 256 concurrent streaming clients all complete with the right text; a client that
does not read (its socket buffers fill, the server's writes block) delays no one."""
from __future__ import annotations

import json
import threading
import time

from tests.server.conftest import MODEL_NAME
from tests.server.http_util import SSEStream, completion_text, post

N_CLIENTS = 256
PROMPTS = [f"def f{i}(x):\n    return" for i in range(8)]


def _expected(port, prompt, max_tokens, **extra):
    status, _, body = post(port, "/v1/completions", {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                                                      "temperature": 0, "ignore_eos": True, **extra})
    assert status == 200, body
    return json.loads(body)["choices"][0]["text"]


def _stream(port, prompt, max_tokens, out, i, barrier=None):
    if barrier is not None:
        barrier.wait()
    s = SSEStream(port, "/v1/completions", {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                                             "temperature": 0, "ignore_eos": True, "stream": True})
    try:
        status = s.read_headers()
        evs = [(t, d if d == "[DONE]" else json.loads(d)) for t, d in s.events()]
        out[i] = (status, evs, time.monotonic() - s.t_sent)
    except Exception as e:  # noqa: BLE001 - reported by the assertions
        out[i] = ("error", repr(e), 0.0)
    finally:
        s.close()


def test_256_concurrent_streams(server):
    expected = {p: _expected(server.port, p, 8) for p in PROMPTS}
    out = [None] * N_CLIENTS
    barrier = threading.Barrier(N_CLIENTS)
    threads = [threading.Thread(target=_stream, args=(server.port, PROMPTS[i % len(PROMPTS)], 8, out, i, barrier))
               for i in range(N_CLIENTS)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    elapsed = time.monotonic() - t0
    bad = [(i, r) for i, r in enumerate(out) if r is None or r[0] != 200]
    assert not bad, bad[:3]
    for i, (_status, evs, _) in enumerate(out):
        assert evs[-1][1] == "[DONE]"
        assert completion_text(evs) == {0: expected[PROMPTS[i % len(PROMPTS)]]}, i
    assert elapsed < 90, elapsed


def _run_batch(port, n, max_tokens):
    out = [None] * n
    threads = [threading.Thread(target=_stream, args=(port, PROMPTS[i % len(PROMPTS)], max_tokens, out, i))
               for i in range(n)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out, time.monotonic() - t0


def test_slow_reader_does_not_delay_others(server):
    # baseline: 16 short streams alone
    base_out, base_s = _run_batch(server.port, 16, 16)
    assert all(r[0] == 200 for r in base_out)
    # a client with a tiny receive window asks for a long, bulky stream (top-20 logprobs
    # per token) and reads nothing: the server's writes to it block quickly
    slow_body = {"model": MODEL_NAME, "prompt": "import", "max_tokens": 300, "temperature": 0,
                 "ignore_eos": True, "stream": True, "logprobs": 20}
    slow = SSEStream(server.port, "/v1/completions", slow_body, rcvbuf=4096)
    try:
        time.sleep(0.3)
        out, took = _run_batch(server.port, 16, 16)
        assert all(r[0] == 200 for r in out), out
        for _status, evs, _ in out:
            assert evs[-1][1] == "[DONE]"
        # generous: the dev box is shared; a stalled writer would hold them for the whole run
        assert took < 3 * base_s + 5.0, (took, base_s)
        # the slow client still gets its whole stream, in order, once it reads
        slow.read_headers()
        evs = [json.loads(d) for _, d in slow.events() if d != "[DONE]"]
        text = "".join(e["choices"][0]["text"] for e in evs)
        n_tokens = sum(len(e["choices"][0]["logprobs"]["tokens"]) for e in evs)
        assert n_tokens == 300
        assert evs[-1]["choices"][0]["finish_reason"] == "length"
        assert text == _expected(server.port, "import", 300)
    finally:
        slow.close()
