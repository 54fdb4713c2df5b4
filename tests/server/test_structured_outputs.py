"""Structured outputs over HTTP (the openai client against the live tiny-model server):
response_format json_object / json_schema on chat and completions, vLLM's
structured_outputs and guided_* fields, and 400s that name the problem."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tests.server.conftest import MODEL_NAME
from tests.server.http_util import collect_stream, completion_text, post
from tests.structured_output.schemas import SCHEMAS

MSGS = [{"role": "user", "content": "Give me the data as JSON."}]


def _compact(schema):
    """vLLM's structured_outputs object: the schema without whitespace between tokens
    (a random tiny model pads JSON with blanks otherwise)."""
    return {"structured_outputs": {"json": schema, "disable_any_whitespace": True}}


def test_chat_json_schemas(client):
    for i, schema in enumerate(SCHEMAS[2:5]):
        r = client.chat.completions.create(model=MODEL_NAME, messages=MSGS, temperature=0, max_tokens=200,
                                           extra_body=_compact(schema))
        c = r.choices[0]
        assert c.finish_reason == "stop", (i, c.message.content)
        jsonschema.validate(json.loads(c.message.content), schema)


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema_chat(client, stream):
    schema = SCHEMAS[4]
    rf = {"type": "json_schema", "json_schema": {"name": "color", "schema": schema, "strict": True}}
    kw = dict(model=MODEL_NAME, messages=MSGS, temperature=0, max_tokens=300, response_format=rf)
    if stream:
        text = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(stream=True, **kw)
                       if ch.choices)
    else:
        text = client.chat.completions.create(**kw).choices[0].message.content
    jsonschema.validate(json.loads(text), schema)


def test_response_format_on_completions_and_json_object(client):
    r = client.completions.create(model=MODEL_NAME, prompt="data = ", temperature=0, max_tokens=300,
                                  extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                      "name": "p", "schema": SCHEMAS[1]}}})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMAS[1])
    # (a free-form object from a random model may not end: this prompt's does)
    r = client.completions.create(model=MODEL_NAME, prompt="result", temperature=0, max_tokens=100,
                                  extra_body={"response_format": {"type": "json_object"},
                                              "structured_outputs": None})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].text), dict)
    r = client.completions.create(model=MODEL_NAME, prompt="x", temperature=0, max_tokens=5,
                                  extra_body={"response_format": {"type": "text"}})
    assert r.choices[0].finish_reason == "length"


def test_guided_fields_and_structured_outputs(client):
    cases = [({"guided_regex": r"[A-Z][a-z]{2,5} [0-9]{2}"}, lambda t: re.fullmatch(r"[A-Z][a-z]{2,5} [0-9]{2}", t)),
             ({"guided_choice": ["positive", "negative"]}, lambda t: t in ("positive", "negative")),
             ({"guided_grammar": 'root ::= "yes" | "no" | "maybe"'}, lambda t: t in ("yes", "no", "maybe")),
             ({"guided_json": SCHEMAS[9], "guided_decoding_backend": "xgrammar"},
              lambda t: jsonschema.validate(json.loads(t), SCHEMAS[9]) is None),
             ({"structured_outputs": {"choice": ["a b", "c"]}}, lambda t: t in ("a b", "c"))]
    for body, check in cases:
        r = client.chat.completions.create(model=MODEL_NAME, messages=MSGS, temperature=0, max_tokens=100,
                                           extra_body=body)
        assert check(r.choices[0].message.content), (body, r.choices[0].message.content)


def test_stream_and_n_under_constraints(server):
    body = {"model": MODEL_NAME, "prompt": "n = ", "max_tokens": 200, "n": 2, "temperature": 1.0, "seed": 3,
            "stream": True, **_compact(SCHEMAS[2])}
    status, events, _ = collect_stream(server.port, "/v1/completions", body)
    assert status == 200 and events[-1][1] == "[DONE]"
    texts = completion_text(events)
    assert sorted(texts) == [0, 1]
    for t in texts.values():
        jsonschema.validate(json.loads(t), SCHEMAS[2])


@pytest.mark.parametrize("body, param, needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "structured_outputs.json", 'Unsupported type "foo"'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "is required"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "must be 'text', 'json_object' or 'json_schema'"),
    ({"guided_regex": "(unclosed"}, "structured_outputs.regex", "Invalid regular expression"),
    ({"guided_grammar": "root ::= missing"}, "structured_outputs.grammar", 'Rule "missing" is not defined'),
    ({"guided_json": {"type": "array", "uniqueItems": True}}, "structured_outputs.json", "'uniqueItems' at #"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_json", "exactly one of"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
     "Only one structured-output constraint"),
    ({"structured_outputs": {"json": {}, "bogus": 1}}, "structured_outputs", "Unknown structured_outputs field"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", "not supported"),
    ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend", "xgrammar"),
    ({"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern", "not supported"),
])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_bad_constraints_are_400_naming_the_problem(server, body, param, needle, path):
    base = {"model": MODEL_NAME, "max_tokens": 4}
    base.update({"messages": MSGS} if "chat" in path else {"prompt": "hi"})
    status, _, data = post(server.port, path, {**base, **body})
    assert status == 400, data
    err = json.loads(data)["error"]
    assert needle in err["message"] and err["param"] == param, err
    # the server and engine go on
    status, _, _ = post(server.port, path, base)
    assert status == 200
