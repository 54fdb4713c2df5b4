"""``vengine serve --data-parallel-size 2`` (issue 29): one endpoint over two engine-core
processes. Both cores serve (their per-core metrics, vLLM's ``engine="i"`` label), the
greedy completions equal one core's (transformers'), with one API server and with two; a
core killed fails only its requests and /health names it; SIGTERM stops everything."""
from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

from tests.helpers import hf_greedy, live_children, process_gone, prompt_token_ids
from tests.server.http_util import get, post
from tests.server.test_api_server_count import _engine_text, _start


def per_engine(port: int, name: str) -> dict[str, float]:
    """{engine label: value} of one metric."""
    status, _, data = get(port, "/metrics")
    assert status == 200
    out: dict[str, float] = {}
    for line in data.decode().splitlines():
        m = re.match(rf'{re.escape(name)}\{{(.*)\}} (\S+)$', line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            out[labels["engine"]] = out.get(labels["engine"], 0.0) + float(m.group(2))
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("api_servers", ["2"])  # (one API server: the test below)
def test_data_parallel_serve_uses_both_cores_token_identical(llama_dir, tokenizer, api_servers):
    proc, port, _ = _start(llama_dir, "--data-parallel-size", "2", "--api-server-count", api_servers,
                           "--shutdown-timeout", "5")
    try:
        procs = live_children(proc.pid, recursive=True)
        prompts = prompt_token_ids(tokenizer, 6, min_len=4, max_len=30, seed=41)
        texts = []
        for p in prompts:
            status, _, raw = post(port, "/v1/completions", {"prompt": p, "max_tokens": 12, "temperature": 0,
                                                            "ignore_eos": True})
            assert status == 200, raw
            texts.append(json.loads(raw)["choices"][0]["text"])
        assert texts == [_engine_text(tokenizer, p, ids)
                         for p, ids in zip(prompts, hf_greedy(llama_dir, prompts, 12, ignore_eos=True))]
        # both engine cores admitted requests (each queried its own prefix cache)
        queries = per_engine(port, "vllm:prefix_cache_queries_total")
        assert set(queries) == {"0", "1"} and all(v > 0 for v in queries.values()), queries
        blocks = per_engine(port, "vllm:num_gpu_blocks")
        assert set(blocks) == {"0", "1"}
        assert get(port, "/health")[0] == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        deadline = time.monotonic() + 20
        while not all(process_gone(p) for p in procs) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(process_gone(p) for p in procs)
    finally:
        proc.kill()


@pytest.mark.timeout(300)
def test_a_dead_engine_core_is_reported_and_the_other_serves(llama_dir, tokenizer):
    proc, port, lines = _start(llama_dir, "--data-parallel-size", "2", "--api-server-count", "1")
    try:
        pids = [int(m) for m in re.findall(r"Engine core running in process (\d+)", "".join(lines))]
        assert len(pids) == 2, "".join(lines[-30:])
        victim = pids[1]
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while get(port, "/health")[0] == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        status, _, body = get(port, "/health")
        assert status == 503 and b"Engine core(s) dead: engine " in body
        prompts = prompt_token_ids(tokenizer, 3, min_len=4, max_len=20, seed=43)
        texts = []
        for p in prompts:  # the live core serves every new request, as one core would
            status, _, raw = post(port, "/v1/completions", {"prompt": p, "max_tokens": 6, "temperature": 0,
                                                            "ignore_eos": True})
            assert status == 200, raw
            texts.append(json.loads(raw)["choices"][0]["text"])
        assert texts == [_engine_text(tokenizer, p, ids)
                         for p, ids in zip(prompts, hf_greedy(llama_dir, prompts, 6, ignore_eos=True))]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        finally:
            proc.kill()
