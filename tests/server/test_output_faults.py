"""Issue 23's most severe report: one request's detokenization error killed the output
handler and every later request got 503. Served here on the tiny Llama with the
SentencePiece-style tokenizer (byte-fallback tokens in its greedy output), and with a
fault injected into one request's output processing."""
from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest

from tests.server.conftest import make_engine
from tests.server.http_util import collect_stream, completion_text, get, post

PROMPT = "The quick brown fox, however, didn't jump; instead it said: \"Hello!\""


@pytest.fixture(scope="module")
def sp_server(llama_sp_dir):
    from server import BackgroundServer, create_app

    engine = make_engine(llama_sp_dir, multiprocess=False)  # a fault is patched into its processor
    srv = BackgroundServer(create_app(engine, SimpleNamespace(served_model_name=["m"])), port=0).start()
    yield engine, srv
    srv.stop()
    engine.shutdown()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("seed", [None, 7])
def test_sentencepiece_model_serves_stream_and_non_stream_alike(sp_server, llama_sp_dir, seed):
    from transformers import AutoTokenizer

    from pyengine import LLM, SamplingParams
    from pyengine.engine.detokenizer import DecoderTraits

    _, srv = sp_server
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 48, "temperature": 0 if seed is None else 1.0}
    if seed is not None:
        body["seed"] = seed
    status, _, raw = post(srv.port, "/v1/completions", body)
    assert status == 200, raw
    whole = json.loads(raw)["choices"][0]["text"]
    _, events, _ = collect_stream(srv.port, "/v1/completions", dict(body, stream=True))
    assert completion_text(events)[0] == whole
    assert get(srv.port, "/health")[0] == 200
    if seed is None:  # the engine's own text is the tokenizer's decode of its tokens
        tok = AutoTokenizer.from_pretrained(str(llama_sp_dir))
        llm = LLM(str(llama_sp_dir), device="cpu", max_model_len=512, num_gpu_blocks_override=512)
        try:
            out = llm.generate([PROMPT], SamplingParams(max_tokens=48, temperature=0))[0].outputs[0]
        finally:
            llm.shutdown()
        assert set(out.token_ids) & DecoderTraits.of(tok).byte_fallback_ids  # the case that broke
        prompt_ids = tok.encode(PROMPT)
        assert out.text == whole
        full = tok.decode(prompt_ids + out.token_ids, skip_special_tokens=True)
        assert full == tok.decode(prompt_ids, skip_special_tokens=True) + whole


@pytest.mark.timeout(180)
def test_output_fault_ends_one_request_and_the_others_go_on(sp_server, monkeypatch):
    """A detokenizer that raises for one request: that request ends with an error (an
    error event in its stream, a 500 without a stream), the engine stays healthy and the
    streams beside it finish whole."""
    from pyengine.engine import detokenizer

    _, srv = sp_server
    poison = "POISON"
    orig_init = detokenizer.IncrementalDetokenizer.__init__

    def init(self, tokenizer, prompt_token_ids, params, *a, **k):
        orig_init(self, tokenizer, prompt_token_ids, params, *a, **k)
        self._poisoned = tokenizer is not None and tokenizer.decode(list(prompt_token_ids)).endswith(poison)

    orig_update = detokenizer.IncrementalDetokenizer.update
    fast_update = detokenizer.FastIncrementalDetokenizer.update

    def failing(orig):
        def update(self, new_token_ids, *a, **k):
            if getattr(self, "_poisoned", False) and len(self.output_token_ids) >= 3:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
            return orig(self, new_token_ids, *a, **k)
        return update

    def failing_step(self, token_id):
        if getattr(self, "_poisoned", False):
            return None  # the general path, where update() fails
        return orig_step(self, token_id)

    orig_step = detokenizer.FastIncrementalDetokenizer.step_delta
    monkeypatch.setattr(detokenizer.IncrementalDetokenizer, "__init__", init)
    monkeypatch.setattr(detokenizer.IncrementalDetokenizer, "update", failing(orig_update))
    monkeypatch.setattr(detokenizer.FastIncrementalDetokenizer, "update", failing(fast_update))
    monkeypatch.setattr(detokenizer.FastIncrementalDetokenizer, "step_delta", failing_step)

    good = {"model": "m", "prompt": "def main():", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    status, _, raw = post(srv.port, "/v1/completions", good)
    expected = json.loads(raw)["choices"][0]["text"]
    results, errors = {}, []

    def run(i):
        try:
            results[i] = completion_text(collect_stream(srv.port, "/v1/completions", dict(good, stream=True))[1])[0]
        except Exception as e:  # noqa: BLE001 - reported by the assert below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    bad = dict(good, prompt="x = " + poison)
    _, events, _ = collect_stream(srv.port, "/v1/completions", dict(bad, stream=True))
    status, _, raw = post(srv.port, "/v1/completions", bad)
    for t in threads:
        t.join(120)
    assert not errors and all(results[i] == expected for i in range(4))
    err = [e for _, e in events if isinstance(e, dict) and "error" in e]
    assert err and "Output processing failed" in err[0]["error"]["message"]
    assert status == 500 and "Output processing failed" in json.loads(raw)["error"]["message"]
    assert get(srv.port, "/health")[0] == 200
    status, _, raw = post(srv.port, "/v1/completions", good)
    assert status == 200 and json.loads(raw)["choices"][0]["text"] == expected
