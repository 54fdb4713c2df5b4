"""Processor: request validation and fan-out into engine-core requests."""
from __future__ import annotations

import pytest

from pyengine import EngineArgs, SamplingParams
from pyengine.engine.processor import Processor


@pytest.fixture(scope="module")
def processor(llama_dir, tokenizer):
    cfg = EngineArgs(model=str(llama_dir), device="cpu", max_model_len=64).create_engine_config()
    return Processor(cfg, tokenizer)


def test_eos_and_stop_ids_resolved(processor, tokenizer):
    text, ids, params, reqs = processor.process("a", "def f(x):", SamplingParams(stop_token_ids=[7]))
    assert ids == tokenizer.encode("def f(x):") and text == "def f(x):"
    assert reqs[0].sampling_params.all_stop_token_ids == {7, tokenizer.eos_token_id}
    _, _, _, reqs = processor.process("b", [5, 6], SamplingParams(stop_token_ids=[7], ignore_eos=True))
    assert reqs[0].sampling_params.all_stop_token_ids == {7}


def test_user_params_not_mutated(processor):
    sp = SamplingParams(max_tokens=5)
    processor.process("c", [5, 6], sp)
    assert sp.all_stop_token_ids == set()


def test_max_tokens_resolution(processor):
    _, _, _, reqs = processor.process("d", [5] * 10, SamplingParams(max_tokens=None))
    assert reqs[0].max_tokens == 64 - 10
    _, _, _, reqs = processor.process("f", [5] * 10, SamplingParams(max_tokens=3))
    assert reqs[0].max_tokens == 3
    _, _, _, reqs = processor.process("e", [5] * 10, SamplingParams(max_tokens=54))
    assert reqs[0].max_tokens == 54


def test_default_max_tokens_capped_at_the_room_left(processor):
    # Issue 17: a 63-token prompt in a 64-token model with max_tokens not given gets the
    # default 16 lowered to the 1 token left, not an error.
    _, _, _, reqs = processor.process("g1", [5] * 63, SamplingParams())
    assert reqs[0].max_tokens == 1
    _, _, _, reqs = processor.process("g2", [5] * 40, SamplingParams(temperature=0.5))
    assert reqs[0].max_tokens == 16
    # also through clone() (LLM.generate clones the user's params) and with n > 1
    _, _, _, reqs = processor.process("g3", [5] * 60, SamplingParams(n=2, seed=1).clone(seed=3))
    assert [r.max_tokens for r in reqs] == [4, 4]


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=16), SamplingParams(max_tokens=500),
                                    SamplingParams().clone(max_tokens=16)])
def test_explicit_max_tokens_that_does_not_fit_refused(processor, params):
    from pyengine import VLLMValidationError

    with pytest.raises(VLLMValidationError) as ei:
        processor.process("h1", [5] * 63, params)
    n = params.max_tokens
    assert str(ei.value).startswith(f"This model's maximum context length is 64 tokens. However, you requested "
                                    f"{63 + n} tokens (63 in the prompt, {n} in the completion).")
    assert ei.value.parameter == "max_tokens" and ei.value.value == n


def test_max_tokens_default_flag():
    assert SamplingParams().max_tokens_is_default
    assert SamplingParams(temperature=0).clone(seed=4).max_tokens_is_default
    assert not SamplingParams(max_tokens=16).max_tokens_is_default
    assert not SamplingParams().clone(max_tokens=16).max_tokens_is_default
    sp = SamplingParams()
    sp.max_tokens = 100  # set after construction: given
    assert not sp.max_tokens_is_default


def test_n_fans_out_with_distinct_seeds(processor):
    _, _, _, reqs = processor.process("g", [5, 6], SamplingParams(n=3, seed=10, temperature=1.0))
    assert [r.request_id.rsplit("-", 1)[0] for r in reqs] == ["0_g", "1_g", "2_g"]
    assert len({r.request_id.rsplit("-", 1)[1] for r in reqs}) == 1
    assert [r.sampling_params.seed for r in reqs] == [10, 11, 12]
    assert all(r.sampling_params.n == 1 for r in reqs)


def test_core_request_ids_unique_per_request(processor):
    # an aborted id may be reused at once while its core request is still in flight
    a = processor.process("same", [5], None)[3][0].request_id
    b = processor.process("same", [5], None)[3][0].request_id
    assert a != b and a.startswith("same-") and b.startswith("same-")


def test_child_seeds_wrap_inside_the_seed_range(processor):
    from pyengine.sampling_params import INT64_MAX, INT64_MIN
    _, _, _, reqs = processor.process("s", [5], SamplingParams(n=3, seed=INT64_MAX - 1, temperature=1.0))
    assert [r.sampling_params.seed for r in reqs] == [INT64_MAX - 1, INT64_MAX, INT64_MIN]


def test_text_encoding_outside_the_model_vocabulary_is_refused(llama_dir, tokenizer):
    # a tokenizer larger than the model: refused at the door, not an IndexError in the model
    cfg = EngineArgs(model=str(llama_dir), device="cpu", max_model_len=64).create_engine_config()
    small = Processor(cfg.replace(hf_config=type(cfg.hf_config)(**dict(cfg.hf_config.to_dict(), vocab_size=3))),
                      tokenizer)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        small.process("v", "def f(x): return x", None)


@pytest.mark.parametrize("prompt, params, priority, match", [
    ("", None, 0, "empty"),
    ([5] * 64, None, 0, "too long"),
    ([-1], None, 0, "vocabulary"),
    ([True], None, 0, "integers"),
    ({"text": "x"}, None, 0, "prompt_token_ids"),
    ("x", {"max_tokens": 3}, 0, "SamplingParams"),
    ("x", SamplingParams(stop_token_ids=[10**6]), 0, "stop_token_ids"),
    ("x", None, "high", "priority"),
    ("x", None, 2 ** 63, "priority must be an integer in"),
    ("x", None, True, "priority"),
])
def test_rejections(processor, prompt, params, priority, match):
    with pytest.raises(ValueError, match=match):
        processor.process("h", prompt, params, priority)
