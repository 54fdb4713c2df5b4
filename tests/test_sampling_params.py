"""SamplingParams: every field is range-checked once, here, for every front end (issue 12
kind 1, issue 16 kind 3): integers fit in 64 bits, floats are finite, documented limits."""
from __future__ import annotations

import math

import numpy as np
import pytest

from pyengine import SamplingParams
from pyengine.sampling_params import INT64_MAX, INT64_MIN, MAX_LOGPROBS, MAX_N, MAX_STOP_STRINGS

NAN, INF = math.nan, math.inf


@pytest.mark.parametrize("kwargs, message", [
    # the reported inputs: a seed past 64 bits killed the engine core, a huge n froze the server
    ({"seed": 2 ** 64}, "seed must be an integer in [-9223372036854775808, 9223372036854775807], got 18446744073709551616."),
    ({"seed": INT64_MIN - 1}, "seed must be an integer in"),
    ({"n": 10 ** 20}, f"n must be an integer in [1, {MAX_N}], got 100000000000000000000."),
    ({"n": MAX_N + 1}, "n must be an integer in [1, 128]"),
    ({"n": True}, "n must be an integer"),
    ({"logprobs": -1}, "logprobs must be an integer in [0, "),  # the most allowed is the engine's max_logprobs
    ({"top_k": 2 ** 64}, "top_k must be 0 or -1 (disabled)"),
    ({"top_k": -2}, "top_k must be 0 or -1 (disabled)"),
    ({"max_tokens": 2 ** 63}, "max_tokens must be an integer in [1, "),
    ({"min_tokens": 2 ** 63}, "min_tokens must be an integer in [0, "),
    ({"max_tokens": 3.0}, "max_tokens must be an integer"),
    # NaN / Infinity in every float field, one message each
    ({"temperature": NAN}, "temperature must be a finite number >= 0, got nan."),
    ({"temperature": INF}, "temperature must be a finite number >= 0, got inf."),
    ({"temperature": -INF}, "temperature must be a finite number >= 0, got -inf."),
    ({"top_p": NAN}, "top_p must be a finite number in (0, 1], got nan."),
    ({"top_p": INF}, "top_p must be a finite number in (0, 1]"),
    ({"min_p": NAN}, "min_p must be a finite number in [0, 1], got nan."),
    ({"presence_penalty": NAN}, "presence_penalty must be a finite number in [-2, 2], got nan."),
    ({"frequency_penalty": -INF}, "frequency_penalty must be a finite number in [-2, 2], got -inf."),
    ({"repetition_penalty": NAN}, "repetition_penalty must be a finite number > 0, got nan."),
    ({"repetition_penalty": INF}, "repetition_penalty must be a finite number > 0, got inf."),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be a finite number > 0"),
    # finite in float64 but not in the sampler's float32 (a probe's temperature 1e39 NaN'd the row)
    ({"temperature": 1e39}, "temperature must fit a float32 ([0, 3.40282e+38]), got 1e+39."),
    ({"repetition_penalty": 1e-46}, "repetition_penalty must fit a float32 ([1.17549e-38, 3.40282e+38]), got 1e-46."),
    ({"repetition_penalty": 1e-40}, "repetition_penalty must fit a float32"),  # float32-subnormal
    ({"repetition_penalty": 1e39}, "repetition_penalty must fit a float32"),
    ({"temperature": "1"}, "temperature must be a finite number"),
    ({"temperature": True}, "temperature must be a finite number"),
    # list sizes and lengths
    ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop must list at most 64 strings, got 65."),
    ({"stop": "y" * 1025}, "stop strings must be at most 1024 characters long"),
    ({"stop": 5}, "stop must be a string or a list of strings."),
    ({"stop_token_ids": list(range(1025))}, "stop_token_ids must list at most 1024 ids"),
    ({"stop_token_ids": [2 ** 64]}, "stop_token_ids must be a list of non-negative integers"),
    ({"stop_token_ids": 7}, "stop_token_ids must be a list of integers."),
    ({"ignore_eos": 1}, "ignore_eos must be a boolean"),
    ({"bad_words": "word"}, "bad_words must be a list of strings."),
    ({"bad_words": ["ok", 3]}, "bad_words must be a list of strings."),
    ({"bad_words": ["ok", "  "]}, "bad_words must not contain empty or whitespace-only words."),
    ({"bad_words": ["w"] * 129}, "bad_words must list at most 128 words, got 129."),
    ({"bad_words": ["w" * 1025]}, "bad_words must be at most 1024 characters long"),
    ({"allowed_token_ids": []}, "allowed_token_ids must not be empty."),
    ({"allowed_token_ids": [1, -2]}, "allowed_token_ids must be a list of non-negative integers"),
    ({"allowed_token_ids": 5}, "allowed_token_ids must be a list of token ids."),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens must be -1 or an integer in [1, "),
    ({"truncate_prompt_tokens": 1.5}, "truncate_prompt_tokens must be -1 or an integer"),
])
def test_out_of_range_fields_are_refused_naming_the_field(kwargs, message):
    with pytest.raises(ValueError) as ei:
        SamplingParams(**kwargs)
    assert str(ei.value).startswith(message), str(ei.value)


@pytest.mark.parametrize("kwargs", [
    {"seed": INT64_MAX}, {"seed": INT64_MIN}, {"seed": 0}, {"n": MAX_N, "temperature": 1.0},
    {"logprobs": 0}, {"logprobs": MAX_LOGPROBS}, {"top_k": -1}, {"top_k": 10 ** 12},
    {"temperature": 1e30}, {"temperature": 3.4e38}, {"repetition_penalty": 1e-30},
    {"repetition_penalty": 1.2e-38}, {"temperature": 1e-46}, {"presence_penalty": -2}, {"top_p": 1},
    {"stop": ["x"] * MAX_STOP_STRINGS}, {"stop": "y" * 1024}, {"max_tokens": None},
])
def test_boundary_values_are_accepted(kwargs):
    SamplingParams(**kwargs)


def test_numbers_are_normalized_to_builtin_types():
    sp = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3), seed=np.uint64(7), top_p=1)
    assert type(sp.temperature) is float and sp.temperature == 0.5
    assert type(sp.top_k) is int and type(sp.seed) is int and type(sp.top_p) is float
    assert sp.top_k == 3 and sp.seed == 7


def test_clone_revalidates():
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=1).clone(seed=2 ** 63)


def test_refusals_name_the_field():
    # vLLM's VLLMValidationError: front ends report ``parameter`` (HTTP: the error's param)
    from pyengine import VLLMValidationError
    for kwargs, field in (({"temperature": math.nan}, "temperature"), ({"seed": 2 ** 64}, "seed"),
                          ({"stop": ["x"] * 65}, "stop"), ({"n": 2, "temperature": 0}, "n"),
                          ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"), ({"ignore_eos": 1}, "ignore_eos")):
        with pytest.raises(VLLMValidationError) as ei:
            SamplingParams(**kwargs)
        assert ei.value.parameter == field


def test_unknown_attribute_set_later_is_refused():
    # the constructor refuses unknown names; so does an assignment after it (slots): a typo
    # such as ``temprature`` is an error, not an attribute the engine never reads
    sp = SamplingParams(temperature=0.5, max_tokens=10)
    with pytest.raises(AttributeError):
        sp.temprature = 0.0  # type: ignore[attr-defined]
    sp.temperature = 0.0  # a field may still be set
    assert sp.temperature == 0.0


def test_copies_keep_every_field():
    import copy
    import pickle

    sp = SamplingParams(temperature=0.7, top_k=5, stop=["x"], stop_token_ids=[3], seed=9, bad_words=["no"])
    sp.all_stop_token_ids |= {2}
    for other in (pickle.loads(pickle.dumps(sp)), copy.copy(sp), copy.deepcopy(sp), sp.clone()):
        assert other == sp and other.all_stop_token_ids == sp.all_stop_token_ids
        assert other.max_tokens_is_default == sp.max_tokens_is_default
