"""One request that fails inside the engine (vLLM's per-request error path): HTTP 500,
or, once its stream began, an error event then [DONE]; the other streams go on and the
server stays healthy."""
from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest

from tests.helpers import fail_request_add, fail_request_allocation
from tests.server.conftest import MODEL_NAME, make_engine
from tests.server.http_util import collect_stream, completion_text, get, post

# Prompts (token ids) that the injected failures below pick out.
FAIL_AT_ADD = [7, 7, 7, 7, 13]
FAIL_WHILE_RUNNING = [7, 7, 7, 7, 14]


@pytest.fixture
def failing_engine(llama_dir, monkeypatch):
    from server import BackgroundServer, create_app

    fail_request_add(monkeypatch, FAIL_AT_ADD)
    engine = make_engine(llama_dir, multiprocess=False)  # the faults are patched into this process
    fail_request_allocation(monkeypatch, engine.engine_core.engine_core, FAIL_WHILE_RUNNING, after_tokens=4)
    srv = BackgroundServer(create_app(engine, SimpleNamespace(served_model_name=[MODEL_NAME])), port=0).start()
    yield srv
    srv.stop()
    engine.shutdown()


@pytest.mark.timeout(120)
def test_failing_request_gets_500_others_go_on(failing_engine):
    port = failing_engine.port
    long = {"model": MODEL_NAME, "prompt": "def main():", "max_tokens": 60, "ignore_eos": True,
            "temperature": 0, "stream": True}
    result = {}
    t = threading.Thread(target=lambda: result.update(r=collect_stream(port, "/v1/completions", long)))
    t.start()
    status, _, body = post(port, "/v1/completions", {"model": MODEL_NAME, "prompt": FAIL_AT_ADD, "max_tokens": 5})
    assert status == 500, body
    err = json.loads(body)["error"]
    assert err["code"] == 500 and "failed inside the engine" in err["message"] and "OverflowError" in err["message"]
    # streamed: some text, then an error event and [DONE]
    status, events, _ = collect_stream(port, "/v1/completions", {
        "model": MODEL_NAME, "prompt": FAIL_WHILE_RUNNING, "max_tokens": 30, "ignore_eos": True, "stream": True})
    assert status == 200 and events[-1][1] == "[DONE]"
    assert "injected: block table corrupted" in events[-2][1]["error"]["message"]
    assert events[-2][1]["error"]["code"] == 500
    assert all("error" not in e for _, e in events[:-2])
    t.join(120)
    status, events, _ = result["r"]
    assert status == 200 and events[-1][1] == "[DONE]"
    finals = [c for _, e in events[:-1] for c in e["choices"] if c.get("finish_reason")]
    assert [c["finish_reason"] for c in finals] == ["length"] and completion_text(events)[0]
    assert get(port, "/health")[0] == 200
    status, _, body = post(port, "/v1/chat/completions", {"model": MODEL_NAME, "max_tokens": 3,
                                                          "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200, body
