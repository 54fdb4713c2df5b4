"""Structured outputs through the engine (LLM / AsyncLLM on a tiny random model): every
constrained output parses and validates; async scheduling on and off give the same
tokens; unconstrained neighbours keep their greedy tokens; preemption, aborts and
compile failures leave the grammar state and the KV cache consistent."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pyengine import LLM, SamplingParams, StructuredOutputsParams
from tests.structured_output.schemas import SCHEMAS

MAX_TOKENS = 200


def _so(**kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kw)


def _greedy(so=None, max_tokens=MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=so, **kw)


def _prompts(n):
    return [f"case {i}: the answer is " for i in range(n)]


def _assert_no_leak(llm: LLM) -> None:
    stats = llm.llm_engine.get_stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_gpu_blocks, "KV blocks leaked"


@pytest.fixture(scope="module")
def llms(qwen2_dir):
    """The same model with async scheduling on and off."""
    engines = {mode: LLM(str(qwen2_dir), device="cpu", async_scheduling=mode) for mode in (True, False)}
    yield engines
    for e in engines.values():
        e.shutdown()


def test_json_schemas_validate_and_async_matches_sync(llms):
    params = [_greedy(_so(json=s, disable_any_whitespace=True)) for s in SCHEMAS]
    assert len(params) >= 20
    tokens = {}
    for mode, llm in llms.items():
        before = llm.llm_engine.get_stats()
        outs = llm.generate(_prompts(len(SCHEMAS)), params, use_tqdm=False)
        after = llm.llm_engine.get_stats()
        # one bitmask row per constrained token sampled (the stop token included)
        assert after.grammar_bitmask_rows - before.grammar_bitmask_rows == sum(len(o.outputs[0].token_ids)
                                                                               for o in outs)
        steps = after.grammar_bitmask_steps - before.grammar_bitmask_steps
        assert max(len(o.outputs[0].token_ids) for o in outs) <= steps <= after.num_steps - before.num_steps
        assert after.grammar_bitmask_time_s > before.grammar_bitmask_time_s
        for schema, out in zip(SCHEMAS, outs):
            c = out.outputs[0]
            assert c.finish_reason == "stop", (schema, c.text)
            jsonschema.validate(json.loads(c.text), schema)
        tokens[mode] = [o.outputs[0].token_ids for o in outs]
        _assert_no_leak(llm)
    assert tokens[True] == tokens[False]


@pytest.mark.gpu
def test_json_schemas_on_cuda(qwen2_dir):
    """The device path: the bitmask copied from pinned host buffers and applied by
    xgrammar's triton kernel, CUDA graphs, deferred sampling under async scheduling, and
    (24 constrained rows, from 8 on) the threaded batch fill."""
    params = [_greedy(_so(json=s, disable_any_whitespace=True)) for s in SCHEMAS]
    tokens = {}
    for mode in (True, False):
        llm = LLM(str(qwen2_dir), device="cuda", dtype="float32", max_num_seqs=32, async_scheduling=mode)
        try:
            outs = llm.generate(_prompts(len(SCHEMAS)), params, use_tqdm=False)
            done = 0
            for schema, out in zip(SCHEMAS, outs):
                c = out.outputs[0]
                # CUDA's float32 logits may steer a greedy walk into an unbounded integer
                # that the CPU's did not take: that one may run out of tokens
                if c.finish_reason == "length":
                    assert len(c.token_ids) == MAX_TOKENS
                    continue
                assert c.finish_reason == "stop", (schema, c.text)
                jsonschema.validate(json.loads(c.text), schema)
                done += 1
            assert done >= len(SCHEMAS) - 4
            tokens[mode] = [o.outputs[0].token_ids for o in outs]
            _assert_no_leak(llm)
        finally:
            llm.shutdown()
    assert tokens[True] == tokens[False]


def test_any_whitespace_json(llms):
    """vLLM's default (whitespace allowed between JSON tokens), bounded per gap."""
    schemas = [SCHEMAS[1], SCHEMAS[6], SCHEMAS[17]]
    outs = llms[True].generate(_prompts(3), [_greedy(_so(json=s), max_tokens=400) for s in schemas], use_tqdm=False)
    for schema, out in zip(schemas, outs):
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    # A free-form object from a random model can go on for ever: these prompts end (greedy).
    outs = llms[True].generate([_prompts(6)[i] for i in (0, 3, 5)], _greedy(_so(json_object=True)), use_tqdm=False)
    for out in outs:
        assert out.outputs[0].finish_reason == "stop" and isinstance(json.loads(out.outputs[0].text), dict)


def test_regex_choice_and_grammar(llms):
    grammar = 'root ::= "(" num ("," num)* ")"\nnum ::= [1-9] [0-9]?'
    cases = [(_so(regex=r"[a-z]{2,6}@[a-z]{3}\.(com|org)"), lambda t: re.fullmatch(r"[a-z]{2,6}@[a-z]{3}\.(com|org)", t)),
             (_so(regex=r"-?[0-9]{1,4}"), lambda t: re.fullmatch(r"-?[0-9]{1,4}", t)),
             (_so(choice=["red", "green", 'say "blue"']), lambda t: t in ("red", "green", 'say "blue"')),
             (_so(grammar=grammar), lambda t: re.fullmatch(r"\([1-9][0-9]?(,[1-9][0-9]?)*\)", t))]
    outs = llms[True].generate(_prompts(len(cases)), [_greedy(so) for so, _ in cases], use_tqdm=False)
    for (so, check), out in zip(cases, outs):
        c = out.outputs[0]
        if so.kind == "grammar" and c.finish_reason == "length":  # an unbounded list: a valid prefix
            assert re.fullmatch(r"\([1-9][0-9]?(,[1-9][0-9]?)*,?", c.text), c.text
            continue
        assert c.finish_reason == "stop" and check(c.text), (so, c.text)


@pytest.mark.parametrize("mode", [True, False])
def test_unconstrained_neighbours_keep_their_greedy_tokens(llms, mode):
    llm = llms[mode]
    plain = _prompts(4)
    alone = [o.outputs[0].token_ids for o in llm.generate(plain, _greedy(max_tokens=24), use_tqdm=False)]
    mixed_prompts = [p for pair in zip(plain, _prompts(8)[4:]) for p in pair]
    mixed_params = [p for s in SCHEMAS[:4] for p in (_greedy(max_tokens=24), _greedy(_so(json=s)))]
    outs = llm.generate(mixed_prompts, mixed_params, use_tqdm=False)
    assert [outs[i].outputs[0].token_ids for i in range(0, 8, 2)] == alone


def test_seeded_sampling_under_constraints_async_on_off_identical(llms):
    params = [SamplingParams(temperature=0.9, seed=11 + i, max_tokens=MAX_TOKENS,
                             structured_outputs=_so(json=s, disable_any_whitespace=True))
              for i, s in enumerate(SCHEMAS[:6])]
    got = {}
    for mode, llm in llms.items():
        outs = llm.generate(_prompts(6), params, use_tqdm=False)
        for s, o in zip(SCHEMAS, outs):
            if o.outputs[0].finish_reason == "stop":
                jsonschema.validate(json.loads(o.outputs[0].text), s)
        got[mode] = [o.outputs[0].token_ids for o in outs]
    assert got[True] == got[False]


def test_n_children_each_follow_the_grammar(llms):
    sp = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=MAX_TOKENS,
                        structured_outputs=_so(json=SCHEMAS[4], disable_any_whitespace=True))
    out = llms[True].generate(["pick: "], sp, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    for c in out.outputs:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), SCHEMAS[4])


@pytest.mark.parametrize("mode", [True, False])
def test_preemption_keeps_grammar_state(qwen2_dir, llms, mode):
    schemas = SCHEMAS[5:13]
    params = [_greedy(_so(json=s, disable_any_whitespace=True), max_tokens=100) for s in schemas]
    ref = [o.outputs[0].token_ids for o in llms[mode].generate(_prompts(8), params, use_tqdm=False)]
    llm = LLM(str(qwen2_dir), device="cpu", async_scheduling=mode, num_gpu_blocks_override=8, max_model_len=128,
              max_num_batched_tokens=64)
    try:
        # every grammar compiled first (the compiler caches them): all 8 requests then compete for
        # the 8 blocks at once, instead of entering one by one as their grammars compile (a
        # loaded CI machine ran them so and never preempted)
        warm = [_greedy(_so(json=s, disable_any_whitespace=True), max_tokens=1) for s in schemas]
        llm.generate(_prompts(8), warm, use_tqdm=False)
        before = llm.llm_engine.get_stats().num_preemptions
        outs = llm.generate(_prompts(8), params, use_tqdm=False)
        assert llm.llm_engine.get_stats().num_preemptions > before
        assert [o.outputs[0].token_ids for o in outs] == ref
        _assert_no_leak(llm)
    finally:
        llm.shutdown()


def test_invalid_constraint_is_a_value_error_and_the_engine_goes_on(llms):
    llm = llms[True]
    with pytest.raises(ValueError, match="'uniqueItems' at #/properties/t"):
        llm.generate(["a"], _greedy(_so(json={"type": "object", "properties": {"t": {"type": "array",
                                                                                     "uniqueItems": True}}})),
                     use_tqdm=False)
    with pytest.raises(ValueError, match="Invalid regular expression"):
        llm.generate(["a"], _greedy(_so(regex="(")), use_tqdm=False)
    out = llm.generate(["a"], _greedy(_so(choice=["ok"])), use_tqdm=False)[0]
    assert out.outputs[0].text == "ok"
    _assert_no_leak(llm)


def test_compile_failure_ends_only_that_request(qwen2_dir, monkeypatch):
    from pyengine.structured_output.backend_xgrammar import XgrammarBackend

    orig = XgrammarBackend.compile

    def compile_(self, so):
        if so.kind == "regex":
            raise ValueError("boom in compile")
        return orig(self, so)

    monkeypatch.setattr(XgrammarBackend, "compile", compile_)
    llm = LLM(str(qwen2_dir), device="cpu")
    try:
        outs = llm.generate(_prompts(3), [_greedy(_so(regex="a+"), max_tokens=4), _greedy(max_tokens=4),
                                          _greedy(_so(choice=["x"]))], use_tqdm=False)
        assert outs[0].outputs[0].finish_reason == "error" and "boom in compile" in outs[0].outputs[0].error
        assert len(outs[1].outputs[0].token_ids) == 4 and outs[2].outputs[0].text == "x"
        _assert_no_leak(llm)
    finally:
        llm.shutdown()


def test_abort_while_compiling_and_while_running(qwen2_dir):
    """An aborted constrained request (grammar still compiling, or running) leaves no
    grammar or KV block behind; the async engine (multi-process: the params cross the
    cbor2 codec and the engine process compiles) serves the next one."""
    import threading

    from pyengine import AsyncLLM, EngineArgs
    from tests.engine.test_async_llm import drain

    eng = AsyncLLM.from_engine_args(EngineArgs(model=str(qwen2_dir), device="cpu"), multiprocess=True)
    try:
        schema = SCHEMAS[11]
        sp = _greedy(_so(json=schema, disable_any_whitespace=True))
        col = eng.add_request("a", "first: ", sp)
        eng.abort("a")  # most likely still compiling (the backend loads on first use)
        assert drain(col)[-1].outputs[0].finish_reason == "abort"
        col = eng.add_request("b", "second: ", sp)
        first = col.get(timeout=60)
        assert not first.finished
        eng.abort("b")
        assert drain(col)[-1].finished
        outs = drain(eng.add_request("c", "third: ", sp))
        text = outs[-1].outputs[0].text  # cumulative
        assert outs[-1].outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(text), schema)
        done = threading.Event()
        for _ in range(100):
            stats = eng.get_stats()
            if stats.num_running == 0 and stats.num_free_blocks == stats.num_gpu_blocks:
                done.set()
                break
            done.wait(0.05)
        assert done.is_set(), "KV blocks leaked"
    finally:
        eng.shutdown()

