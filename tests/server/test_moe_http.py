"""An MoE model through the whole serving stack: ``vengine serve`` (its own process, the
engine core in another, expert parallelism over two ranks from the command-line flag)
answers /v1/completions with transformers' greedy text, plain and streamed."""
from __future__ import annotations

import json

import pytest

from tests.helpers import build_tiny_model, expected_text, hf_greedy, prompt_token_ids
from tests.server.http_util import collect_stream, completion_text, post, served


@pytest.mark.timeout(600)
def test_served_moe_with_expert_parallel_matches_transformers(tmp_path, tokenizer_dir, tokenizer):
    d = build_tiny_model(tmp_path / "qwen3_moe", "qwen3_moe", tokenizer_dir, seed=31, norm_topk_prob=False)
    prompts = prompt_token_ids(tokenizer, 3, min_len=4, max_len=24, seed=31)
    ref = [expected_text(tokenizer, p, ids) for p, ids in zip(prompts, hf_greedy(d, prompts, 12, ignore_eos=True))]
    body = {"model": "moe", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    with served(d, "moe", "--tensor-parallel-size", "2", "--enable-expert-parallel", "--max-model-len", "256",
                "--num-gpu-blocks-override", "64") as (_, port):
        plain, streamed = [], []
        for p in prompts:
            status, _, raw = post(port, "/v1/completions", dict(body, prompt=p))
            assert status == 200, raw
            plain.append(json.loads(raw)["choices"][0]["text"])
            status, events, _ = collect_stream(port, "/v1/completions", dict(body, prompt=p, stream=True))
            assert status == 200
            streamed.append(completion_text(events)[0])
    assert plain == streamed == ref
