"""A client that leaves mid-stream, mid-prefill, or while its request is being admitted:
the engine request is aborted promptly and running requests and KV usage return to
baseline. The engine is paced (``STEP_S`` a step), so a request left running would go on
far longer than the bounds: with ``AsyncLLM.abort`` a no-op every test here fails."""
from __future__ import annotations

import json
import socket
import time
from types import SimpleNamespace

import pytest

from tests.server.conftest import MODEL_NAME, make_engine, serve_app, slow_steps
from tests.server.http_util import SSEStream, metrics, wait_until

STEP_S = 0.025  # per engine step: MAX_TOKENS tokens take MAX_TOKENS * STEP_S = 10 s at least
MAX_TOKENS = 400
ABORTED_WITHIN_S = 2.0  # a fifth of that


def _idle(engine) -> bool:
    """Nothing left: by the stats, and, for an in-process engine, by the front end's output
    processor and the engine core's scheduler themselves (the stats are as of the last
    step: while a first step over new requests runs, they still say idle)."""
    st = engine.get_stats()
    if st.num_running or st.num_waiting or st.kv_cache_usage != 0.0:
        return False
    core = getattr(engine.engine_core, "engine_core", None)
    if core is None:
        return True
    return engine.output_processor.get_num_unfinished_requests() == 0 and not core.scheduler.has_unfinished_requests()


def _metrics_idle(port) -> bool:
    m = metrics(port)
    return (m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
            and m["vllm:kv_cache_usage_perc"] == 0.0)


def _raw_send(port, body: dict, path="/v1/completions") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    payload = json.dumps(body).encode()
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return s


@pytest.fixture(scope="module")
def paced(llama_dir):
    """An in-process engine (so its steps can be paced), ``STEP_S`` a step, served."""
    eng = make_engine(llama_dir, multiprocess=False)
    slow_steps(eng, STEP_S)
    for srv in serve_app(eng, served_model_name=[MODEL_NAME]):
        yield SimpleNamespace(engine=eng, server=srv)
    eng.shutdown()


def test_disconnect_mid_stream(paced):
    engine, server = paced.engine, paced.server
    assert wait_until(lambda: _idle(engine), 30)
    aborts = metrics(server.port).get("vllm:request_success_total", 0.0)
    s = SSEStream(server.port, "/v1/completions",
                  {"model": MODEL_NAME, "prompt": "while True:", "max_tokens": MAX_TOKENS, "temperature": 0,
                   "ignore_eos": True, "stream": True})
    for n, _ in enumerate(s.events(), 1):
        if n == 3:
            break
    assert engine.get_stats().num_running + engine.get_stats().num_waiting == 1
    t0 = time.monotonic()
    s.close()
    assert wait_until(lambda: _idle(engine), ABORTED_WITHIN_S)
    took = time.monotonic() - t0
    assert took < ABORTED_WITHIN_S, took  # MAX_TOKENS tokens take 5 times longer
    assert wait_until(lambda: _metrics_idle(server.port), 5)
    assert metrics(server.port)["vllm:request_success_total"] == aborts + 1


def test_disconnect_non_stream(paced):
    engine, server = paced.engine, paced.server
    assert wait_until(lambda: _idle(engine), 30)
    s = _raw_send(server.port, {"model": MODEL_NAME, "prompt": "x = [", "max_tokens": MAX_TOKENS,
                                "temperature": 0, "ignore_eos": True})
    assert wait_until(lambda: engine.get_stats().num_running == 1, 10)
    time.sleep(0.1)
    s.close()
    assert wait_until(lambda: _idle(engine), ABORTED_WITHIN_S)


@pytest.fixture(scope="module")
def slow_prefill(llama_dir):
    """An engine whose prefill of a long prompt takes many steps (1-token budget, no
    prefix cache so a repeated prompt is prefilled again)."""
    from server import BackgroundServer, create_app

    eng = make_engine(llama_dir, max_model_len=1024, max_num_batched_tokens=1, enable_prefix_caching=False)
    srv = BackgroundServer(create_app(eng, SimpleNamespace(served_model_name=[MODEL_NAME])), port=0).start()
    yield SimpleNamespace(engine=eng, port=srv.port)
    srv.stop()
    eng.shutdown()


def test_disconnect_during_long_prefill(slow_prefill):
    eng, port = slow_prefill.engine, slow_prefill.port
    prompt = [10 + i % 480 for i in range(990)]  # ~990 prefill steps of 1 token
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4, "stream": True, "ignore_eos": True}
    # control: how long this prefill takes when the client stays
    t0 = time.monotonic()
    s = SSEStream(port, "/v1/completions", body)
    s.read_headers()
    next(iter(s.events()))
    prefill_s = time.monotonic() - t0
    s.close()
    assert wait_until(lambda: _idle(eng), 10)
    assert prefill_s > 0.4, f"prefill too fast ({prefill_s:.2f} s) to test a disconnect during it"

    notes: list = []  # (time, request ids with output) as the engine reports them
    unsubscribe = eng.add_output_listener(lambda ids: notes.append((time.monotonic(), list(ids))))
    try:
        s = _raw_send(port, body)
        time.sleep(prefill_s / 8)  # well inside the prefill even if the box got faster since the control
        s.settimeout(0.01)
        with pytest.raises(socket.timeout):  # nothing was sent yet: still in prefill
            s.recv(1)
        t_close = time.monotonic()
        s.close()
        assert wait_until(lambda: notes, prefill_s * 3)
        time.sleep(prefill_s)  # had it not been aborted, tokens would come in this window
    finally:
        unsubscribe()
    ids = {rid for _, batch in notes for rid in batch}
    assert len(ids) == 1, notes
    # exactly one output (the abort), promptly, long before the prefill would have ended
    assert len(notes) == 1, notes
    assert notes[0][0] - t_close < prefill_s / 2, (notes[0][0] - t_close, prefill_s)
    assert wait_until(lambda: _idle(eng), 5)
    assert wait_until(lambda: _metrics_idle(port), 5)


@pytest.mark.parametrize("linger_rst", [False, True])
def test_disconnect_racing_admission(paced, linger_rst):
    """Close right after sending (FIN or RST): whether the abort lands before, during or
    after admission, nothing is left running and no KV block leaks."""
    engine, server = paced.engine, paced.server
    assert wait_until(lambda: _idle(engine), 30)
    for i in range(25):
        s = _raw_send(server.port, {"model": MODEL_NAME, "prompt": f"import sys{i}", "max_tokens": MAX_TOKENS,
                                    "ignore_eos": True, "stream": bool(i % 2)})
        if linger_rst:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        if i % 3 == 0:
            time.sleep(0.005 * (i % 5))
        s.close()
    # the 25 requests would run together for MAX_TOKENS steps (10 s at least) had they
    # been left running; a step of 25 on this loaded 2-core box can take a second
    assert wait_until(lambda: _idle(engine), MAX_TOKENS * STEP_S / 2), engine.get_stats()
    assert wait_until(lambda: _metrics_idle(server.port), 5)
