"""OpenAI request fields -> ``StructuredOutputsParams`` (mirrors the request-to-params part
of vllm/entrypoints/openai/protocol.py).

Accepted, on chat and completions requests (plain JSON values):
- ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``;
- vLLM's ``structured_outputs`` object (``StructuredOutputsParams``' fields);
- vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``
  (with ``guided_decoding_backend`` "xgrammar" or "auto", ``guided_whitespace_pattern``
  refused like ``structured_outputs.whitespace_pattern``).
At most one of these may constrain a request. Every refusal is a ``VLLMValidationError``
whose ``parameter`` names the request field.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from pyengine.exceptions import VLLMValidationError
from pyengine.sampling_params import StructuredOutputsParams

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
_BACKENDS = (None, "auto", "xgrammar")


def _response_format(rf: Any) -> dict | None:
    """``response_format`` -> StructuredOutputsParams keyword arguments, or None for text."""
    if not isinstance(rf, Mapping):
        raise VLLMValidationError("response_format must be an object with a 'type'.", parameter="response_format")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, Mapping):
            raise VLLMValidationError("response_format.json_schema must be an object with a 'schema'.",
                                      parameter="response_format.json_schema")
        schema = js.get("schema")
        if schema is None:
            raise VLLMValidationError("response_format.json_schema.schema is required.",
                                      parameter="response_format.json_schema.schema")
        return {"json": schema}
    raise VLLMValidationError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}.",
                              parameter="response_format.type")


def structured_outputs_from_request(body: Mapping[str, Any]) -> StructuredOutputsParams | None:
    """The constraint a request asks for, or None. ``body``: the request's fields (absent
    or None = not given). Raises VLLMValidationError naming the field."""
    found: list[tuple[str, dict]] = []
    rf = body.get("response_format")
    if rf is not None:
        kw = _response_format(rf)
        if kw is not None:
            found.append(("response_format", kw))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, Mapping):
            raise VLLMValidationError("structured_outputs must be an object.", parameter="structured_outputs")
        found.append(("structured_outputs", dict(so)))
    guided = {k: body.get(k) for k in GUIDED_FIELDS if body.get(k) is not None}
    if guided:
        found.append((", ".join(guided), {GUIDED_FIELDS[k]: v for k, v in guided.items()}))
    backend = body.get("guided_decoding_backend")
    if backend not in _BACKENDS:
        raise VLLMValidationError(f"guided_decoding_backend must be 'xgrammar' (vengine's only backend), got "
                                  f"{backend!r}.", parameter="guided_decoding_backend")
    if body.get("guided_whitespace_pattern") is not None:
        raise VLLMValidationError("guided_whitespace_pattern is not supported by the xgrammar backend.",
                                  parameter="guided_whitespace_pattern")
    if not found:
        return None
    if len(found) > 1:
        raise VLLMValidationError("Only one structured-output constraint per request: got "
                                  f"{' and '.join(name for name, _ in found)}.", parameter=found[1][0].split(",")[0])
    name, kw = found[0]
    try:
        return StructuredOutputsParams(**kw)
    except VLLMValidationError as e:
        if name == "structured_outputs":
            raise
        # the same message, with the request's own field name
        raise VLLMValidationError(str(e).replace("structured_outputs", name.split(",")[0]),
                                  parameter=name.split(",")[0]) from None
    except TypeError:  # an unknown field of the structured_outputs object
        valid = ", ".join(sorted(f.name for f in dataclasses.fields(StructuredOutputsParams)))
        unknown = ", ".join(sorted(set(kw) - {f.name for f in dataclasses.fields(StructuredOutputsParams)}))
        raise VLLMValidationError(f"Unknown {name} field(s): {unknown}. Valid fields: {valid}.",
                                  parameter=name) from None
