"""Structured outputs with xgrammar (mirrors vllm/v1/structured_output/backend_xgrammar.py).

xgrammar is vLLM's and SGLang's default grammar engine: JSON schemas, regular expressions
and EBNF grammars are compiled against the tokenizer's vocabulary once (the compiler
caches them by their text), and a ``GrammarMatcher`` per request fills a token bitmask
(int32 ``[B, ceil(V / 32)]``, bit ``j`` of a row set = token ``j`` allowed) in C++, on the
host. The bitmask is applied to the logits on their own device (a triton kernel on CUDA,
C++ on CPU).

Two halves:
- front end (``validate_structured_outputs``): parses the constraint without a tokenizer,
  refuses what xgrammar would silently ignore, and returns the normalized parameters
  the engine compiles; every error is a ``VLLMValidationError`` naming the field.
- engine core (``XgrammarBackend``, ``XgrammarGrammar``): compiles and matches.
"""
from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable
from typing import Any

import torch

from pyengine.exceptions import VLLMValidationError
from pyengine.sampling_params import StructuredOutputsParams

# String formats xgrammar's JSON-schema converter turns into a grammar; any other format
# would be dropped (the output then need not have it), so it is refused.
STRING_FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname",
                            "uuid", "uri", "uri-reference", "uri-template", "json-pointer",
                            "relative-json-pointer"})
# Keywords xgrammar 0.2 ignores (the output would not honour them): refused wherever they
# appear. (keyword -> why, for the message)
_UNSUPPORTED_KEYWORDS = {
    "uniqueItems": "array item uniqueness", "contains": "array 'contains'", "minContains": "array 'contains'",
    "maxContains": "array 'contains'", "maxProperties": "a maximum property count",
    "propertyNames": "property-name schemas", "dependentRequired": "dependent requirements",
    "dependentSchemas": "dependent schemas", "dependencies": "dependencies", "not": "negated schemas",
    "if": "conditional schemas", "then": "conditional schemas", "else": "conditional schemas",
}
# Keywords whose value is a map of name -> subschema (the names are not keywords).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
# JSON allows any whitespace between tokens (as vLLM's default), but at most this many
# characters in one place: enough for any pretty-printing (a newline plus 31 columns of
# indentation), and a model stuck emitting blanks cannot run to max_tokens (OpenAI's JSON
# mode warns about that failure; vLLM's unbounded default shows it).
MAX_JSON_WHITESPACE = 32
# xgrammar 0.2's character class for strings with minLength/maxLength (EBNF text), and the
# JSON string character it should be (no control characters, no quote, no backslash).
_XGR_BOUNDED_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\]'
_EBNF_CACHE_SIZE = 1024
_XGR_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


def _xgr():
    """xgrammar, imported on first use (it loads a native library)."""
    import xgrammar
    return xgrammar


def _clean(err: BaseException) -> str:
    """xgrammar's C++ error text without its log prefix (time, source file, line)."""
    lines = [_XGR_LOG_PREFIX.sub("", ln).strip() for ln in str(err).splitlines()]
    return "; ".join(ln for ln in lines if ln) or type(err).__name__


def _types(schema: dict) -> set:
    t = schema.get("type")
    return {t} if isinstance(t, str) else {x for x in t if isinstance(x, str)} if isinstance(t, list) else set()


def unsupported_json_schema_feature(schema: Any, path: str = "#") -> str | None:
    """The first JSON-schema feature in ``schema`` that xgrammar would not enforce, as a
    message naming its location (a JSON pointer), or None."""
    if not isinstance(schema, dict):
        return None
    for kw, what in _UNSUPPORTED_KEYWORDS.items():
        if kw in schema:
            return f"'{kw}' at {path} ({what}) is not supported"
    types = _types(schema)
    if "multipleOf" in schema and "integer" not in types:
        return f"'multipleOf' at {path} is supported for integers only"
    if "string" in types or "format" in schema or "pattern" in schema:
        fmt = schema.get("format")
        if fmt is not None and fmt not in STRING_FORMATS:
            return f"string format {fmt!r} at {path} is not supported (supported: {', '.join(sorted(STRING_FORMATS))})"
        if ("pattern" in schema or fmt is not None) and ("minLength" in schema or "maxLength" in schema):
            return f"'pattern' or 'format' together with 'minLength'/'maxLength' at {path} is not supported"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return f"'allOf' with more than one schema at {path} is not supported"
    if isinstance(schema.get("patternProperties"), dict) and (
            "properties" in schema or len(schema["patternProperties"]) > 1):
        return f"'patternProperties' with more than one pattern or next to 'properties' at {path} is not supported"
    for key, value in schema.items():
        sub = f"{path}/{key}"
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, s in value.items():
                found = unsupported_json_schema_feature(s, f"{sub}/{name}")
                if found:
                    return found
        elif key in ("enum", "const", "default", "examples"):
            continue  # values, not schemas
        elif isinstance(value, dict):
            found = unsupported_json_schema_feature(value, sub)
            if found:
                return found
        elif isinstance(value, list):
            for i, s in enumerate(value):
                found = unsupported_json_schema_feature(s, f"{sub}/{i}")
                if found:
                    return found
    return None


def choice_as_grammar(choices: Iterable[str]) -> str:
    """An EBNF grammar whose root is exactly one of ``choices`` (JSON string literals are
    xgrammar's EBNF string syntax)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _refuse(field: str, message: str, value: Any = None):
    raise VLLMValidationError(message, parameter=f"structured_outputs.{field}", value=value)


def validate_structured_outputs(so: StructuredOutputsParams) -> StructuredOutputsParams:
    """Check that the engine can honour ``so`` and return it normalized for the engine
    core: a ``json`` schema as compact JSON text (the compiler's cache key). Parses the
    schema / regex / grammar with xgrammar (no tokenizer needed, ~0.1 ms for typical
    sizes); compiling against the vocabulary happens engine-side.

    Raises:
        VLLMValidationError: naming the field (``structured_outputs.json``, ``.regex``,
            ``.choice``, ``.grammar``, ``.structural_tag``, ``.whitespace_pattern``) and the
            problem (invalid JSON, unsupported schema keyword with its JSON pointer,
            xgrammar's parse error).
    """
    xgr = _xgr()
    if so.structural_tag is not None:
        _refuse("structural_tag", "structured_outputs.structural_tag is not supported by vengine.")
    if so.whitespace_pattern is not None:
        _refuse("whitespace_pattern", "structured_outputs.whitespace_pattern is not supported by the xgrammar "
                                      "backend; use disable_any_whitespace.")
    kind = so.kind
    try:
        if kind == "json":
            schema = so.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    _refuse("json", f"structured_outputs.json is not valid JSON: {e}")
            if not isinstance(schema, dict):
                _refuse("json", f"structured_outputs.json must be a JSON schema object, got {type(schema).__name__}.")
            bad = unsupported_json_schema_feature(schema)
            if bad:
                _refuse("json", f"The JSON schema is not supported: {bad}.")
            try:
                text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
            except (TypeError, ValueError) as e:
                _refuse("json", f"structured_outputs.json is not JSON-serializable: {e}")
            try:
                xgr.Grammar.from_json_schema(text, any_whitespace=not so.disable_any_whitespace)
            except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError variants
                _refuse("json", f"Invalid JSON schema: {_clean(e)}")
            return dataclasses.replace(so, json=text)
        if kind == "regex":
            if "\x00" in so.regex:
                _refuse("regex", "structured_outputs.regex must not contain a NUL character.")
            try:
                xgr.Grammar.from_regex(so.regex)
            except Exception as e:  # noqa: BLE001
                _refuse("regex", f"Invalid regular expression: {_clean(e)}")
        elif kind == "choice":
            try:
                xgr.Grammar.from_ebnf(choice_as_grammar(so.choice))
            except Exception as e:  # noqa: BLE001
                _refuse("choice", f"Invalid choice list: {_clean(e)}")
        elif kind == "grammar":
            try:
                xgr.Grammar.from_ebnf(so.grammar)
            except Exception as e:  # noqa: BLE001
                _refuse("grammar", f"Invalid grammar (EBNF with a 'root' rule expected): {_clean(e)}")
    except RecursionError:
        _refuse(kind, f"structured_outputs.{kind} is nested too deeply.")
    return so


def default_fill_threads() -> int:
    """Threads filling a step's bitmask: ``VENGINE_GRAMMAR_FILL_THREADS`` if set, else 1.
    Measured on the H200 (64 rows, 152k vocabulary, docs/benchmarks.md): one thread fills
    in 0.21 ms, two in 0.40, four in 0.38, eight in 0.66 — the rows are cheap, and handing
    them to a thread pool costs more than it saves."""
    from pyengine import envs

    n = envs.grammar_fill_threads()
    return 1 if n is None else n


class XgrammarGrammar:
    """One request's grammar state: an ``xgrammar.GrammarMatcher``.

    ``accept_token`` advances it by one sampled token (False if the grammar rejects it);
    ``fill_bitmask(bitmask, row)`` writes the allowed next tokens into one row of an int32
    ``[B, ceil(V / 32)]`` host tensor; once the grammar accepted a stop token it is
    terminated and fills nothing (the request is finished anyway)."""

    __slots__ = ("matcher", "num_processed_tokens")

    def __init__(self, matcher):
        self.matcher = matcher
        self.num_processed_tokens = 0

    def accept_token(self, token: int) -> bool:
        if self.matcher.is_terminated():
            return True
        if not self.matcher.accept_token(token):
            return False
        self.num_processed_tokens += 1
        return True

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)


class XgrammarBackend:
    """Compiles constraints against one tokenizer (engine side).

    ``tokenizer``: the model's transformers tokenizer; ``vocab_size``: the logits' width V
    (may exceed the tokenizer's: the extra ids are never allowed); ``stop_token_ids``: the
    ids that end a completed grammar (the model's EOS ids). Compiled grammars are cached by
    the compiler (keyed by the constraint's text), so each distinct schema compiles once.
    ``max_threads``: the compiler's threads; ``fill_threads``: threads filling a step's
    bitmask (None: ``default_fill_threads()``).
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Iterable[int], max_threads: int = 4,
                 fill_threads: int | None = None):
        xgr = _xgr()
        self.vocab_size = vocab_size
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids) or None)
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads, cache_enabled=True)
        self._ebnf_cache: dict = {}  # (schema text, any_whitespace) -> EBNF text (see _json_schema_ebnf)
        self.fill_threads = default_fill_threads() if fill_threads is None else fill_threads
        self._batch_matcher = None  # xgrammar.BatchGrammarMatcher, built on the first fill

    def compile(self, so: StructuredOutputsParams):
        """An ``xgrammar.CompiledGrammar`` for validated, normalized params (see
        ``validate_structured_outputs``). Raises ValueError if xgrammar refuses it."""
        kind, ws = so.kind, not so.disable_any_whitespace
        try:
            if kind == "json":
                return self.compiler.compile_grammar(self._json_schema_ebnf(so.json, ws))
            if kind == "json_object":
                return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=ws,
                                                         max_whitespace_cnt=MAX_JSON_WHITESPACE if ws else None)
            if kind == "regex":
                return self.compiler.compile_regex(so.regex)
            if kind == "choice":
                return self.compiler.compile_grammar(choice_as_grammar(so.choice))
            if kind == "grammar":
                return self.compiler.compile_grammar(so.grammar)
        except Exception as e:  # noqa: BLE001 - reported as this request's error
            raise ValueError(f"Compiling structured_outputs.{kind} failed: {_clean(e)}") from None
        raise ValueError(f"structured_outputs.{kind} is not supported by vengine.")

    def _json_schema_ebnf(self, schema: str, any_whitespace: bool) -> str:
        """The EBNF grammar of a JSON schema, with xgrammar 0.2's length-bounded string
        character class fixed: it lets raw control characters (U+0000-U+001F) into a string
        with minLength/maxLength, which JSON forbids. Remembered per schema text."""
        key = (schema, any_whitespace)
        text = self._ebnf_cache.get(key)
        if text is None:
            grammar = _xgr().Grammar.from_json_schema(
                schema, any_whitespace=any_whitespace, max_whitespace_cnt=MAX_JSON_WHITESPACE if any_whitespace else None)
            text = str(grammar).replace(_XGR_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR)
            if len(self._ebnf_cache) >= _EBNF_CACHE_SIZE:
                self._ebnf_cache.pop(next(iter(self._ebnf_cache)))
            self._ebnf_cache[key] = text
        return text

    def fill_bitmasks(self, grammars: list[XgrammarGrammar], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Write ``grammars[i]``'s allowed next tokens into row ``rows[i]`` of ``bitmask``
        (int32 [>= max(rows) + 1, ceil(V / 32)], host), in one call into xgrammar's
        ``BatchGrammarMatcher`` on ``fill_threads`` threads (one call, not one per row: the
        fill sits on the engine's critical path, and a call per row costs ~5× more on one
        thread, docs/benchmarks.md)."""
        if self._batch_matcher is None:
            self._batch_matcher = _xgr().BatchGrammarMatcher(max(1, self.fill_threads))
        self._batch_matcher.batch_fill_next_token_bitmask([g.matcher for g in grammars], bitmask, rows)

    @staticmethod
    def accept_tokens(grammars: list[XgrammarGrammar], tokens: list[int]) -> list[bool]:
        """``[g.accept_token(t) for g, t in zip(grammars, tokens)]`` in one call into
        xgrammar (this sits between a step's tokens landing and the next bitmask fill)."""
        ok = [True] * len(grammars)
        idx = [i for i, g in enumerate(grammars) if not g.matcher.is_terminated()]
        if not idx:
            return ok
        got = _xgr().BatchGrammarMatcher.batch_accept_token([grammars[i].matcher for i in idx],
                                                            [tokens[i] for i in idx])
        for i, accepted in zip(idx, got):
            if accepted:
                grammars[i].num_processed_tokens += 1
            else:
                ok[i] = False
        return ok

    def new_grammar(self, compiled) -> XgrammarGrammar:
        return XgrammarGrammar(_xgr().GrammarMatcher(compiled))

    def allocate_token_bitmask(self, rows: int, pin: bool = False) -> torch.Tensor:
        """int32 [rows, ceil(V / 32)] host tensor (pinned for a CUDA copy when ``pin``)."""
        bm = _xgr().allocate_token_bitmask(rows, self.vocab_size)
        return bm.pin_memory() if pin else bm


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """In place: ``logits[r, j] = -inf`` for every row ``r`` in ``rows`` and token ``j``
    whose bit in ``bitmask[r]`` is 0. ``logits``: float32 [B, V] on any device;
    ``bitmask``: int32 [B, ceil(V / 32)] on the logits' device (rows not in ``rows`` are
    not read). xgrammar's kernel: triton on CUDA, C++ on CPU."""
    # every row constrained (the common case): no index list (on CUDA a host-to-device copy)
    every = len(rows) == logits.shape[0] and rows == list(range(len(rows)))
    _xgr().apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=None if every else rows)
