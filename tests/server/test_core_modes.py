"""The HTTP server gives the same greedy completions over the in-process and the
multi-process engine core (and both equal transformers' own greedy decoding)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tests.helpers import expected_text, hf_greedy, prompt_token_ids
from tests.server.conftest import make_engine
from tests.server.http_util import collect_stream, completion_text, post


@pytest.mark.timeout(300)
def test_http_greedy_identical_inproc_and_mp(llama_dir, tokenizer):
    from server import BackgroundServer, create_app

    prompts = prompt_token_ids(tokenizer, 4, min_len=4, max_len=30, seed=21)
    body = {"model": "m", "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    got = {}
    for mp in (False, True):
        engine = make_engine(llama_dir, multiprocess=mp)
        srv = BackgroundServer(create_app(engine, SimpleNamespace(served_model_name=["m"])), port=0).start()
        try:
            assert type(engine.engine_core).__name__ == ("MPClient" if mp else "InprocClient")
            plain, streamed = [], []
            for p in prompts:
                status, _, raw = post(srv.port, "/v1/completions", dict(body, prompt=p))
                assert status == 200
                plain.append(json.loads(raw)["choices"][0]["text"])
                st, events, _ = collect_stream(srv.port, "/v1/completions", dict(body, prompt=p, stream=True))
                assert st == 200
                streamed.append(completion_text(events)[0])
            got[mp] = (plain, streamed)
        finally:
            srv.stop()
            engine.shutdown()
    # as the engine detokenizes: special tokens skipped, no trailing incomplete character,
    # the prompt's incomplete last character counted as output
    ref = [expected_text(tokenizer, p, ids) for p, ids in zip(prompts, hf_greedy(llama_dir, prompts, 20, ignore_eos=True))]
    assert got[True] == got[False] == (ref, ref)
