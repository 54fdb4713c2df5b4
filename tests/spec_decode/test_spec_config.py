"""speculative_config (pyengine.config.SpeculativeConfig): vLLM's keys, every bad value
refused with ValueError naming it, the command line's --speculative-config, async
scheduling kept on (by default and when asked for) with every method."""
from __future__ import annotations

import json
import logging

import pytest

from pyengine import EngineArgs
from pyengine.config import SpeculativeConfig
from tests.helpers import build_tiny_eagle3, build_tiny_model

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


def _cfg(llama_dir, spec, **kw):
    return EngineArgs(model=str(llama_dir), device="cpu", speculative_config=spec, **kw).create_engine_config()


def test_ngram_defaults_and_async_on(llama_dir, caplog, monkeypatch):
    monkeypatch.delenv("VENGINE_ASYNC_SCHED", raising=False)
    with caplog.at_level(logging.INFO, logger="pyengine.config"):
        c = _cfg(llama_dir, NGRAM, async_scheduling=True)
    s = c.speculative_config
    assert (s.method, s.num_speculative_tokens, s.prompt_lookup_min, s.prompt_lookup_max) == ("ngram", 3, 5, 5)
    assert s.disable_by_batch_size is None and not s.uses_draft_kv
    assert c.async_scheduling is True
    assert "turns asynchronous scheduling off" not in caplog.text
    assert "with asynchronous scheduling" in caplog.text
    assert _cfg(llama_dir, NGRAM).async_scheduling is True  # the default too
    assert _cfg(llama_dir, NGRAM, async_scheduling=False).async_scheduling is False
    assert _cfg(llama_dir, None).speculative_config is None
    c = _cfg(llama_dir, {**NGRAM, "disable_by_batch_size": 8}, async_scheduling=True)
    assert c.async_scheduling is True
    s = _cfg(llama_dir, {**NGRAM, "prompt_lookup_max": 4}).speculative_config
    assert (s.prompt_lookup_min, s.prompt_lookup_max) == (4, 4)


@pytest.mark.parametrize("spec,match", [
    ({**NGRAM, "speculative_model": "x"}, "unknown key"),
    ({"method": "mtp", "num_speculative_tokens": 1}, "method must be one of"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 99}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({**NGRAM, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({**NGRAM, "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({**NGRAM, "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ({**NGRAM, "model": "/x"}, "takes no model"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "/nonexistent"}, "needs model"),
    ({"method": "eagle3", "num_speculative_tokens": 2}, "needs model"),
    ("ngram", "must be a dict"),
])
def test_bad_values_are_refused(llama_dir, spec, match):
    with pytest.raises(ValueError, match=match):
        _cfg(llama_dir, spec)


def test_draft_models_checked(llama_dir, tmp_path, tokenizer_dir):
    other_vocab = build_tiny_model(tmp_path / "v", "llama", tokenizer_dir, vocab_size=600, num_hidden_layers=1)
    with pytest.raises(ValueError, match="vocab_size"):
        _cfg(llama_dir, {"method": "draft_model", "model": str(other_vocab), "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="not an EAGLE-3 head"):
        _cfg(llama_dir, {"method": "eagle3", "model": str(llama_dir), "num_speculative_tokens": 2})
    eagle = build_tiny_eagle3(tmp_path / "e", llama_dir)
    with pytest.raises(ValueError, match="use method 'eagle3'"):
        _cfg(llama_dir, {"method": "draft_model", "model": str(eagle), "num_speculative_tokens": 2})
    s = _cfg(llama_dir, {"model": str(llama_dir), "num_speculative_tokens": 2}).speculative_config
    assert s.method == "draft_model" and s.uses_draft_kv  # a model without a method: a draft model
    s = _cfg(llama_dir, {"method": "eagle3", "model": str(eagle), "num_speculative_tokens": 2}).speculative_config
    assert s.draft_hf_config.architectures == ["LlamaForCausalLMEagle3"]
    # tensor parallelism: the draft model is sharded as the target is, so it must split too
    assert _cfg(llama_dir, NGRAM, tensor_parallel_size=2).speculative_config.method == "ngram"
    assert _cfg(llama_dir, {"method": "eagle3", "model": str(eagle), "num_speculative_tokens": 2},
                tensor_parallel_size=2).tensor_parallel_size == 2
    odd = build_tiny_model(tmp_path / "odd", "llama", tokenizer_dir, num_hidden_layers=1, intermediate_size=129)
    _cfg(llama_dir, {"method": "draft_model", "model": str(odd), "num_speculative_tokens": 2})  # one rank: fine
    with pytest.raises(ValueError, match=r"draft model is sharded.*intermediate_size \(129\)"):
        _cfg(llama_dir, {"method": "draft_model", "model": str(odd), "num_speculative_tokens": 2},
             tensor_parallel_size=2)


def test_from_dict_passes_a_config_through(llama_dir):
    s = SpeculativeConfig("ngram", 2)
    assert SpeculativeConfig.from_dict(s, None) is s


def test_cli_flag(llama_dir):
    from server.cli_args import engine_args_from, parse_args

    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    args = parse_args([str(llama_dir), "--speculative-config", json.dumps(spec)])
    ea = engine_args_from(args)
    assert ea.speculative_config == spec
    assert ea.create_engine_config().speculative_config.num_speculative_tokens == 4
    with pytest.raises(SystemExit):
        parse_args([str(llama_dir), "--speculative-config", "[1]"])
