"""server/metrics.py over HTTP: vLLM's request-phase and per-step histograms on /metrics
after a few requests, with values that add up."""
from __future__ import annotations

import time

import pytest

from tests.server.conftest import MODEL_NAME
from tests.server.http_util import metrics, wait_until

MAX_TOKENS = 6
PROMPTS = ["import os\nimport sys\n", "class Foo(object):\n    def bar(self, x):", "x = [i for i in range(3)]"]
PHASES = ("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds")


def _delta(after, before, name):
    return after.get(name, 0.0) - before.get(name, 0.0)


def test_request_phase_and_iteration_histograms(server, client):
    assert wait_until(lambda: metrics(server.port)["vllm:num_requests_running"] == 0)
    before = metrics(server.port)
    prompt_tokens = 0
    for p in PROMPTS:  # one at a time: each engine step then belongs to one request
        r = client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == MAX_TOKENS
        prompt_tokens += r.usage.prompt_tokens
    n = len(PROMPTS)
    # Per step: the prompt (less its prefix-cache hits) in one step, then one token for each
    # of the MAX_TOKENS - 1 decode steps. Steps are recorded right after the outputs went out.
    hits = lambda m: _delta(m, before, "vllm:prefix_cache_hits_total")  # noqa: E731
    expected_steps = n * MAX_TOKENS
    assert wait_until(lambda: _delta(metrics(server.port), before, "vllm:iteration_tokens_total_count")
                      >= expected_steps)
    after = metrics(server.port)
    assert _delta(after, before, "vllm:iteration_tokens_total_count") == expected_steps
    assert _delta(after, before, "vllm:iteration_tokens_total_sum") == \
        prompt_tokens - hits(after) + n * (MAX_TOKENS - 1)

    # per output token: one sample per token after the first, the same gaps as the ITL
    assert _delta(after, before, "vllm:time_per_output_token_seconds_count") == n * (MAX_TOKENS - 1)
    tpot_sum = _delta(after, before, "vllm:time_per_output_token_seconds_sum")
    assert tpot_sum > 0
    assert tpot_sum == pytest.approx(_delta(after, before, "vllm:inter_token_latency_seconds_sum"))

    # one sample per request and phase; queue + prefill + decode is the whole request
    for name in PHASES:
        assert _delta(after, before, name + "_count") == n, name
    queue, prefill, decode = (_delta(after, before, name + "_sum") for name in PHASES)
    assert queue >= 0 and prefill > 0 and decode > 0
    e2e = _delta(after, before, "vllm:e2e_request_latency_seconds_sum")
    assert queue + prefill + decode == pytest.approx(e2e, abs=1e-6 * n)
    ttft = _delta(after, before, "vllm:time_to_first_token_seconds_sum")
    assert queue + prefill == pytest.approx(ttft, abs=1e-6 * n)


def test_histogram_buckets_are_vllms(server):
    from tests.server.http_util import get

    text = get(server.port, "/metrics")[2].decode()

    def les(name):
        return [line.split('le="', 1)[1].split('"', 1)[0] for line in text.splitlines()
                if line.startswith(name + "_bucket{")]
    assert les("vllm:iteration_tokens_total") == ["1.0", "8.0", "16.0", "32.0", "64.0", "128.0", "256.0", "512.0",
                                                  "1024.0", "2048.0", "4096.0", "8192.0", "16384.0", "+Inf"]
    assert les("vllm:time_per_output_token_seconds")[:3] == ["0.01", "0.025", "0.05"]
    for name in PHASES:
        assert les(name)[0] == "0.3" and les(name)[-2] == "7680.0", name


def test_observe_many_equals_repeated_observe():
    """``BatchedHistogram.observe_many(v, n)`` renders as ``n`` calls of a prometheus_client
    ``Histogram``'s ``observe(v)`` do, bucket bounds included (a value equal to a bound
    counts in that bucket)."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from server.metrics import BatchedHistogram, observe_many

    buckets = (0.01, 0.025, 0.05, 1.0)
    regs = [CollectorRegistry(auto_describe=False) for _ in range(2)]
    many = BatchedHistogram("h", "doc", {"m": "x"}, buckets, regs[0])
    loop = Histogram("h", "doc", ["m"], buckets=buckets, registry=regs[1]).labels("x")
    for v, n in ((0.0, 3), (0.01, 2), (0.02, 5), (0.05, 1), (0.5, 4), (7.0, 6)):
        observe_many(many, v, n)
        for _ in range(n):
            loop.observe(v)

    def samples(r, kind):
        return sorted((s.name, tuple(sorted(s.labels.items())), s.value)
                      for m in r.collect() for s in m.samples if s.name.endswith(kind))
    assert samples(regs[0], "_bucket") == samples(regs[1], "_bucket")
    assert samples(regs[0], "_count") == samples(regs[1], "_count")
    assert samples(regs[0], "_sum")[0][2] == pytest.approx(samples(regs[1], "_sum")[0][2])
    assert b'h_bucket{le="0.01",m="x"} 5.0' in generate_latest(regs[0])


def _labelled(port, name: str, **labels) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    from tests.server.http_util import get

    want = [f'{k}="{v}"' for k, v in labels.items()]
    total = 0.0
    for line in get(port, "/metrics")[2].decode().splitlines():
        if line.startswith(name + "{") and all(w in line.split("}", 1)[0] for w in want):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _tokens(port, body) -> int:
    """The prompt tokens the server makes of a request body (its /tokenize)."""
    import json

    from tests.server.http_util import post

    status, _, data = post(port, "/tokenize", {k: body[k] for k in ("model", "prompt", "messages") if k in body})
    assert status == 200, data
    return json.loads(data)["count"]


def _leave(port, path, body) -> None:
    """Send ``body``, read a little of the answer (three stream events; nothing of a
    plain one, whose request is then running), and leave."""
    import json
    import socket

    from tests.server.http_util import SSEStream

    if body.get("stream"):
        s = SSEStream(port, path, body)
        try:
            assert s.read_headers() == 200
            events = s.events()
            for _ in range(3):
                next(events)
        finally:
            s.close()
        return
    with socket.create_connection(("127.0.0.1", port)) as s:
        payload = json.dumps(body).encode()
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        assert wait_until(lambda: metrics(port)["vllm:num_requests_running"] == 1, 10)


@pytest.fixture(scope="module")
def slow_server(llama_dir):
    """An in-process engine whose steps take 20 ms more (400 tokens: 8 s), so a request
    is surely still running when its client leaves, served."""
    from tests.server.conftest import make_engine, serve_app, slow_steps

    engine = make_engine(llama_dir, multiprocess=False)
    slow_steps(engine, 0.02)
    yield from serve_app(engine, served_model_name=[MODEL_NAME])
    engine.shutdown()


def test_requests_left_mid_way_count_their_prompt_tokens_and_each_abort(slow_server):
    server = slow_server
    # issue 23: streams left after a few chunks added no prompt tokens to
    # vllm:prompt_tokens_total, and request_success_total{finished_reason="abort"} fell short
    common = {"model": MODEL_NAME, "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    left = [("/v1/completions", dict(common, prompt=f"def left_{i}(x):", stream=True)) for i in range(3)]
    left += [("/v1/chat/completions", dict(common, messages=[{"role": "user", "content": "stay"}], stream=True)),
             ("/v1/completions", dict(common, prompt="x = [", stream=False))]
    prompt_tokens = sum(_tokens(server.port, body) for _, body in left)
    assert wait_until(lambda: metrics(server.port)["vllm:num_requests_running"] == 0)
    before = metrics(server.port)
    aborts = _labelled(server.port, "vllm:request_success_total", finished_reason="abort")
    for path, body in left:
        _leave(server.port, path, body)

    def settled():
        m = metrics(server.port)
        return m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"] == 0 and \
            _delta(m, before, "vllm:request_success_total") >= len(left)
    assert wait_until(settled, 10)
    time.sleep(0.2)  # nothing more comes
    after = metrics(server.port)
    assert _labelled(server.port, "vllm:request_success_total", finished_reason="abort") - aborts == len(left)
    assert _delta(after, before, "vllm:request_success_total") == len(left)
    assert _delta(after, before, "vllm:prompt_tokens_total") == prompt_tokens
    assert _delta(after, before, "vllm:request_prompt_tokens_sum") == prompt_tokens
    assert _delta(after, before, "vllm:request_prompt_tokens_count") == len(left)
