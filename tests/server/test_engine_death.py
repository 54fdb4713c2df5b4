"""Engine death seen through HTTP: /health turns 503, requests fail with an OpenAI error
body (in-stream as a data: error event then [DONE]), nothing hangs."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tests.server.conftest import make_engine
from tests.server.http_util import get, post


@pytest.mark.timeout(120)
def test_engine_death_health_503_and_errors(llama_dir):
    from server import BackgroundServer, create_app

    engine = make_engine(llama_dir, multiprocess=False)  # the fault is patched into the runner
    srv = BackgroundServer(create_app(engine, SimpleNamespace(served_model_name=["m"])), port=0).start()
    try:
        assert get(srv.port, "/health")[0] == 200
        runner = engine.engine_core.engine_core.model_runner
        orig = runner.execute_model
        calls = {"n": 0}

        def boom(*a, **k):
            calls["n"] += 1
            if calls["n"] > 3:
                raise RuntimeError("injected GPU fault")
            return orig(*a, **k)
        runner.execute_model = boom
        status, _, body = post(srv.port, "/v1/completions",
                               {"model": "m", "prompt": "def f():", "max_tokens": 64, "stream": True,
                                "ignore_eos": True}, timeout=30)
        assert status == 200  # the stream had started: the error comes as an event
        events = [line[len(b"data: "):] for line in body.split(b"\n") if line.startswith(b"data: ")]
        assert events[-1] == b"[DONE]"
        err = json.loads(events[-2])
        assert "error" in err and "injected GPU fault" in err["error"]["message"]
        status, _, body = get(srv.port, "/health")
        assert status == 503 and "error" in json.loads(body)
        status, _, body = post(srv.port, "/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 4})
        assert status >= 500 and set(json.loads(body)["error"]) >= {"message", "type", "param", "code"}
    finally:
        srv.stop()
        engine.shutdown()
