"""The xgrammar backend: front-end validation (errors name the field and the problem),
compilation against a tokenizer, and the CPU bitmask fill + apply."""
from __future__ import annotations

import json

import pytest
import torch

from pyengine import StructuredOutputsParams
from pyengine.exceptions import VLLMValidationError
from pyengine.structured_output.backend_xgrammar import (
    XgrammarBackend,
    apply_token_bitmask,
    choice_as_grammar,
    unsupported_json_schema_feature,
    validate_structured_outputs,
)


def test_params_need_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one of json, regex, choice, grammar, json_object .got none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got json, regex"):
        StructuredOutputsParams(json={}, regex="a")
    with pytest.raises(ValueError, match="choice must be a non-empty list of non-empty strings"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="regex must be a non-empty string") as e:
        StructuredOutputsParams(regex=3)
    assert e.value.parameter == "structured_outputs.regex"
    assert StructuredOutputsParams(json_object=True).kind == "json_object"


def test_valid_schema_is_normalized_to_compact_text():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    so = validate_structured_outputs(StructuredOutputsParams(json=schema))
    assert json.loads(so.json) == schema and " " not in so.json
    assert validate_structured_outputs(StructuredOutputsParams(json=json.dumps(schema))).json == so.json


@pytest.mark.parametrize("kw, param, needle", [
    (dict(json="{not json"), "json", "structured_outputs.json is not valid JSON"),
    (dict(json="[1, 2]"), "json", "must be a JSON schema object, got list"),
    (dict(json={"type": "foo"}), "json", 'Invalid JSON schema: Unsupported type "foo"'),
    (dict(json={"type": "integer", "minimum": 5, "maximum": 1}), "json", "Invalid range"),
    (dict(json={"$ref": "#/$defs/missing"}), "json", "Invalid JSON schema"),
    (dict(json={"type": "array", "uniqueItems": True}), "json", "'uniqueItems' at # .array item uniqueness."),
    (dict(json={"type": "object", "properties": {"a": {"type": "number", "multipleOf": 0.5}}}), "json",
     "'multipleOf' at #/properties/a is supported for integers only"),
    (dict(json={"type": "object", "properties": {"d": {"type": "string", "format": "color"}}}), "json",
     "string format 'color' at #/properties/d is not supported"),
    (dict(json={"type": "string", "pattern": "a+", "maxLength": 3}), "json", "'pattern' or 'format' together with"),
    (dict(json={"allOf": [{"type": "integer"}, {"minimum": 1}]}), "json", "'allOf' with more than one schema"),
    (dict(json={"type": "integer", "not": {"const": 1}}), "json", "'not' at #"),
    (dict(regex="a(b"), "regex", "Invalid regular expression: .*parenthesis"),
    (dict(regex="a\x00"), "regex", "NUL"),
    (dict(grammar="root ::= foo"), "grammar", 'Invalid grammar .*Rule "foo" is not defined'),
    (dict(grammar="start: 'a'"), "grammar", "Invalid grammar"),
    (dict(structural_tag='{"a": 1}'), "structural_tag", "structural_tag is not supported"),
    (dict(json_object=True, whitespace_pattern=r"\s*"), "whitespace_pattern", "use disable_any_whitespace"),
])
def test_invalid_constraints_name_field_and_problem(kw, param, needle):
    with pytest.raises(VLLMValidationError, match=needle) as e:
        validate_structured_outputs(StructuredOutputsParams(**kw))
    assert e.value.parameter == f"structured_outputs.{param}"
    assert "/project/cpp" not in str(e.value)  # xgrammar's log prefix is stripped


def test_unsupported_features_are_found_anywhere_but_in_values():
    assert unsupported_json_schema_feature({"properties": {"not": {"type": "integer"}}}) is None  # a property name
    assert unsupported_json_schema_feature({"enum": [{"uniqueItems": 1}]}) is None  # a value
    assert "at #/$defs/x/items/0" in unsupported_json_schema_feature(
        {"$defs": {"x": {"items": [{"type": "array", "contains": {}}]}}})


def test_choice_grammar_escapes_quotes_and_backslashes():
    assert choice_as_grammar(['a"b', "c\\d", "e\nf"]) == r'root ::= "a\"b" | "c\\d" | "e\nf"'


@pytest.fixture(scope="module")
def backend(tokenizer):
    return XgrammarBackend(tokenizer, len(tokenizer) + 7, [tokenizer.eos_token_id], max_threads=1)


def _walk(backend, tokenizer, so, pick):
    """Generate with the matcher only: at each step fill + apply the bitmask to random
    logits and take ``pick(masked logits)``; returns the text."""
    g = backend.new_grammar(backend.compile(validate_structured_outputs(so)))
    bitmask = backend.allocate_token_bitmask(2)
    gen = torch.Generator().manual_seed(0)
    toks = []
    for _ in range(200):
        logits = torch.randn(2, backend.vocab_size, generator=gen)
        before = logits.clone()
        g.fill_bitmask(bitmask, 1)
        apply_token_bitmask(logits, bitmask, [1])
        assert torch.equal(logits[0], before[0])  # rows not listed are untouched
        allowed = torch.isfinite(logits[1])
        assert allowed.any() and not allowed[len(tokenizer):].any()  # ids past the tokenizer never
        tok = pick(logits[1])
        assert g.accept_token(tok)
        if g.is_terminated():
            assert tok == tokenizer.eos_token_id
            return tokenizer.decode(toks)
        toks.append(tok)
    raise AssertionError("the grammar did not finish")


def test_bitmask_walk_follows_regex_and_choice(backend, tokenizer):
    import re

    text = _walk(backend, tokenizer, StructuredOutputsParams(regex=r"[0-9]{2}-[a-c]{1,3}"), lambda x: int(x.argmax()))
    assert re.fullmatch(r"[0-9]{2}-[a-c]{1,3}", text)
    text = _walk(backend, tokenizer, StructuredOutputsParams(choice=["yes", 'say "no"']), lambda x: int(x.argmax()))
    assert text in ("yes", 'say "no"')


def test_bitmask_walk_gives_schema_valid_json(backend, tokenizer):
    import jsonschema

    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 4},
                                              "n": {"type": "integer", "minimum": 3, "maximum": 7}},
              "required": ["s", "n"]}
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        # sample among the allowed tokens, so the walk visits raw bytes a greedy walk never does
        text = _walk(backend, tokenizer, StructuredOutputsParams(json=schema, disable_any_whitespace=True),
                     lambda x, gen=gen: int(torch.multinomial(torch.softmax(x, -1), 1, generator=gen)))
        jsonschema.validate(json.loads(text), schema)  # strict JSON: no raw control characters


def test_compiler_caches_a_schema(backend):
    so = validate_structured_outputs(StructuredOutputsParams(json={"type": "object", "properties": {"q": {}}}))
    backend.compile(so)
    size = backend.compiler.get_cache_size_bytes()
    backend.compile(so)
    assert backend.compiler.get_cache_size_bytes() == size > 0


@pytest.mark.parametrize("n,threads", [(3, 1), (12, 1), (12, 2)])
def test_fill_bitmasks_matches_one_row_at_a_time(tokenizer, n, threads):
    """A step's rows filled together (one xgrammar call, on one or more threads) give the
    bitmask each grammar fills alone, in its own row; other rows untouched."""
    b = XgrammarBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id], max_threads=1, fill_threads=threads)
    compiled = b.compile(validate_structured_outputs(StructuredOutputsParams(
        json={"type": "array", "minItems": 20, "items": {"type": "object", "properties": {"k": {"type": "string"}}}})))
    gen = torch.Generator().manual_seed(0)
    grammars = []
    for i in range(n):  # each grammar i tokens into the output, at a different place
        g = b.new_grammar(compiled)
        one = b.allocate_token_bitmask(1)
        for _ in range(i):
            g.fill_bitmask(one, 0)
            logits = torch.randn(1, b.vocab_size, generator=gen)
            apply_token_bitmask(logits, one, [0])
            logits[0, tokenizer.eos_token_id] = -float("inf")  # not finished: it fills nothing then
            assert g.accept_token(int(logits[0].argmax()))
        grammars.append(g)
    rows = [2 * i + 1 for i in range(n)]
    together = b.allocate_token_bitmask(2 * n + 1)
    together.fill_(7)
    b.fill_bitmasks(grammars, together, rows)
    alone = b.allocate_token_bitmask(2 * n + 1)
    alone.fill_(7)
    for g, r in zip(grammars, rows):
        g.fill_bitmask(alone, r)
    assert torch.equal(together, alone)
    assert (together[0::2] == 7).all()  # rows not listed are untouched
    assert len({tuple(together[r].tolist()) for r in rows}) > 1  # the states differ


def test_accept_tokens_matches_one_at_a_time(backend, tokenizer):
    """One batched call advances each grammar as its own accept_token would: a token the
    grammar forbids is refused (that grammar unchanged), a terminated grammar takes anything."""
    compiled = backend.compile(validate_structured_outputs(StructuredOutputsParams(regex=r"ab+")))
    a_id = tokenizer.convert_tokens_to_ids("a")
    b_id = tokenizer.convert_tokens_to_ids("b")
    ga, gb, done = (backend.new_grammar(compiled) for _ in range(3))
    assert done.accept_token(a_id) and done.accept_token(b_id) and done.accept_token(tokenizer.eos_token_id)
    assert done.is_terminated()
    assert backend.accept_tokens([ga, gb, done], [a_id, b_id, b_id]) == [True, False, True]
    assert (ga.num_processed_tokens, gb.num_processed_tokens) == (1, 0)
    assert gb.accept_token(a_id)  # the refused token left gb where it was
    assert backend.accept_tokens([ga, gb], [b_id, b_id]) == [True, True]
