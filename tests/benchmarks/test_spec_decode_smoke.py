"""benchmarks/spec_decode.py on CPU, tiny: every part's code path (the code-editing prompts,
ngram and draft-model on/off at batch 1, throughput with the cutoff), so the H200 run works
the first time. Numbers unchecked; greedy on/off identity is checked."""
from __future__ import annotations

import json

from benchmarks import spec_decode
from pyengine.config import DEFAULT_MODEL_DIR
from tests.helpers import build_tiny_model


def test_code_edit_prompts():
    ps = spec_decode.code_edit_prompts(5)
    assert len(ps) == 5 and all("renamed to" in p and p.rstrip().endswith(":") for p in ps)


def test_smoke(tmp_path):
    # tiny random models with the built-in model's tokenizer (its vocabulary): a code model and a target
    model = build_tiny_model(tmp_path / "model", "qwen3", DEFAULT_MODEL_DIR, seed=2, num_hidden_layers=1)
    target = build_tiny_model(tmp_path / "target", "qwen3", DEFAULT_MODEL_DIR, seed=3)
    out = tmp_path / "spec.json"
    res = spec_decode.main(["--device", "cpu", "--parts", "ngram,draft,throughput", "--target", str(target),
                            "--model", str(model), "--lookup-min", "1", "--threads", "1",
                            "--num-prompts", "1", "--output-len", "5", "--streams", "2", "--cutoff", "2", "--repeats", "1",
                            "--rounds", "2", "--k", "3", "--draft-k", "2", "--max-model-len", "512", "--json", str(out)])
    for part in ("ngram", "draft"):
        r = res[part]
        assert r["greedy_identical"], part
        assert r["off"]["drafts"] == 0 and r["speedup"] > 0 and r["speedup_median"] > 0
        assert len(r["off"]["tpot_runs_ms"]) == len(r["on"]["tpot_runs_ms"]) == 2
    assert res["draft"]["on"]["drafts"] > 0  # (a random model's output rarely repeats its prompt: no ngram check)
    assert res["draft"]["target_params"] > res["draft"]["draft_params"] > 0
    assert res["throughput"]["on"]["output_tokens"] == res["throughput"]["off"]["output_tokens"] == 10
    assert res["throughput"]["ratio_on_off_paired"] > 0 and len(res["throughput"]["pair_ratios"]) == 1
    assert json.loads(out.read_text())["benchmark"] == "spec_decode"


def test_host_batch_smoke(tmp_path):
    """The host_batch part (model stubbed, both prompt kinds): off and cut off give the
    same tokens, and with at least --cutoff requests running the steady steps draft nothing."""
    model = build_tiny_model(tmp_path / "model", "qwen3", DEFAULT_MODEL_DIR, seed=2, num_hidden_layers=1)
    for prompts in ("code", "random"):
        res = spec_decode.main(["--device", "cpu", "--parts", "host_batch", "--model", str(model), "--threads", "1",
                                "--num-prompts", "2", "--output-len", "6", "--streams", "6", "--cutoff", "3",
                                "--host-prompt-len", "8", "--host-repeats", "1", "--host-alternations", "1",
                                "--host-kv-blocks", "256", "--host-batch-prompts", prompts, "--max-model-len", "512"])
        r = res["host_batch"]
        assert r["tokens_identical"], prompts
        assert r["off"]["steady_steps"] > 0 and r["cutoff"]["steady_steps"] > 0
        assert r["off"]["spec_num_drafts"] == 0


def test_host_smoke(tmp_path):
    """The host part (model stubbed): every mode replays the recorded tokens; the stubbed
    draft model, through the draft chain, has every draft accepted."""
    model = build_tiny_model(tmp_path / "model", "qwen3", DEFAULT_MODEL_DIR, seed=2, num_hidden_layers=1)
    res = spec_decode.main(["--device", "cpu", "--parts", "host", "--model", str(model), "--threads", "1",
                            "--num-prompts", "1", "--output-len", "12", "--host-repeats", "1", "--draft-k", "3",
                            "--max-model-len", "512"])
    rows = res["host"]
    assert {"plain_async", "plain_sync", "ngram", "ngram_async", "draft_async"} <= set(rows)
    assert all(r["tokens_identical"] for name, r in rows.items() if name != "spec_config")
    assert rows["draft_async"]["draft_acceptance_rate"] == 1.0
