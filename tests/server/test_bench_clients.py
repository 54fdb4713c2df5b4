"""benchmarks/serve.py's two HTTP clients (issue 29): its own raw-socket client and the
aiohttp one shaped like ``vllm bench serve``'s stream the same requests from a running
server and count the same tokens; the aiohttp one's TTFT is taken at the first chunk."""
from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def serve_bench():
    spec = importlib.util.spec_from_file_location("serve_bench", REPO / "benchmarks" / "serve.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["serve_bench"] = mod  # (its dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("client", ["own", "aiohttp"])
def test_both_http_clients_stream_every_token(server, serve_bench, client):
    reqs = serve_bench.make_workload(6, 8, 5, 500, seed=3)
    run = serve_bench.HTTP_CLIENTS[client]
    results, seconds = run(f"http://127.0.0.1:{server.port}", reqs, None, "/v1/completions", 3, math.inf, 0, None)
    assert all(r.ok for r in results), [r.error for r in results]
    assert [r.output_tokens for r in results] == [5] * 6
    assert all(0 < r.ttft <= r.e2e and len(r.itls) <= 5 for r in results), [(r.ttft, r.e2e, len(r.itls)) for r in results]
    assert seconds > 0
