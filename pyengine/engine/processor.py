"""Front-end input processing: validates a request and turns it into EngineCoreRequests
(mirrors vllm/v1/engine/processor.py). Runs on the caller's thread, so bad input is a
ValueError there and nothing reaches the engine."""
from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import time
from dataclasses import dataclass
from typing import Any

from pyengine.config import EngineConfig, SchedulingPolicy
from pyengine.exceptions import VLLMValidationError
from pyengine.messages import EngineCoreRequest
from pyengine.sampling_params import INT64_MAX, INT64_MIN, SamplingParams, StructuredOutputsParams
from pyengine.tokenizer import eos_token_ids

# str | list[int] | {"prompt": str} | {"prompt_token_ids": list[int]}; a dict may add
# "cache_salt": str (vLLM's prefix-cache salt)
PromptType = Any
# Validated structured-output constraints remembered per Processor (a client usually sends
# one schema many times).
_SO_CACHE_SIZE = 256


# Normalizers (tokenizers' JSON "type") that keep every input character, and those that may
# compose several into one: canonical composition (NFC, NFKC) makes one character of at
# most 4 code points (a base and three marks, e.g. U+1F8F), Hangul syllables of 3.
_NORMALIZERS_KEEPING = frozenset({"NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"})
_NORMALIZERS_COMPOSING = frozenset({"NFC", "NFKC"})
_COMPOSITION_FACTOR = 4
_PRE_TOKENIZERS_KEEPING = frozenset({"ByteLevel", "Metaspace", "Digits", "UnicodeScripts"})


def _component(obj) -> dict | None:
    return None if obj is None else json.loads(obj.__getstate__())


def _normalizer_factor(node: dict | None) -> float | None:
    """Most input characters one normalized character can stand for; None: unbounded
    (a normalizer that may drop characters: Strip, StripAccents, Precompiled, ...)."""
    if node is None:
        return 1.0
    kind = node.get("type")
    if kind == "Sequence":
        factor = 1.0
        for child in node.get("normalizers", []):
            f = _normalizer_factor(child)
            if f is None:
                return None
            factor *= f
        return factor
    if kind in _NORMALIZERS_KEEPING:
        return 1.0
    if kind in _NORMALIZERS_COMPOSING:
        return float(_COMPOSITION_FACTOR)
    if kind == "Replace":
        pattern, content = node.get("pattern", {}), node.get("content", "")
        if "String" in pattern and content:
            return max(1.0, len(pattern["String"]) / len(content))
    return None


def _has_type(node, kind: str) -> bool:
    if isinstance(node, dict):
        return node.get("type") == kind or any(_has_type(v, kind) for v in node.values())
    if isinstance(node, list):
        return any(_has_type(v, kind) for v in node)
    return False


def _pre_tokenizer_keeps(node: dict | None) -> bool:
    """Whether the pre-tokenizer keeps every character (splits without removing any)."""
    if node is None:
        return True
    kind = node.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_keeps(child) for child in node.get("pretokenizers", []))
    if kind in ("Split", "Punctuation"):
        return node.get("behavior") != "Removed"
    return kind in _PRE_TOKENIZERS_KEEPING


def max_chars_per_token(tokenizer) -> float | None:
    """An upper bound on the prompt characters one token of ``tokenizer`` can cover, or
    ``None`` where no bound holds (a slow tokenizer; a normalizer, pre-tokenizer or
    added token that may drop or absorb characters; unknown text fused into one token).

    A token covers at most its vocabulary string's length in characters (byte-level
    symbols stand for one byte each, SentencePiece's "▁" for one space), times the
    normalizer's composition factor. So a text of C characters has at least
    C / bound tokens: a prompt longer than ``max_model_len`` times the bound cannot fit,
    and is refused before it is tokenized."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        factor = _normalizer_factor(_component(backend.normalizer))
        pre = _component(backend.pre_tokenizer)
        model = backend.model
        added = backend.get_added_tokens_decoder().values()
        vocab = backend.get_vocab(with_added_tokens=True)
    except Exception:  # noqa: BLE001 - an unfamiliar backend: no bound, tokenization decides
        return None
    if factor is None or not _pre_tokenizer_keeps(pre) or not vocab:
        return None
    if any(t.lstrip or t.rstrip for t in added):  # such a token swallows the whitespace next to it
        return None
    kind = type(model).__name__
    if kind == "BPE":
        from tokenizers import pre_tokenizers
        byte_level = _has_type(pre, "ByteLevel") and set(pre_tokenizers.ByteLevel.alphabet()) <= vocab.keys()
        # Unknown characters: one byte token each (byte fallback, or a byte-level alphabet),
        # one unknown token each, or (fused, or no unknown token: dropped) unbounded.
        if not (model.byte_fallback or byte_level or (model.unk_token is not None and not model.fuse_unk)):
            return None
    elif kind == "Unigram":
        if not model.byte_fallback:  # unknown runs become one token
            return None
    else:  # WordPiece (an unknown word is one token), WordLevel
        return None
    return max(len(t) for t in vocab) * factor


@dataclass
class ProcessedRequest:
    """One user request as the engine queues it (``Processor.process``, or a front end's
    own steps ending in ``Processor.engine_request``): every request rule has run once.
    ``params``: the request's, with the fields the rules derive (all stop token ids, bad
    words' token ids, allowed token ids sorted, the structured-output constraint
    normalized); ``core_requests``: one ``EngineCoreRequest`` per each of the ``n``
    completions, whose ids carry a unique suffix."""
    request_id: str
    prompt_text: str | None  # None for a token-id prompt, or once truncation cut the text's ids
    prompt_token_ids: list[int]
    params: SamplingParams
    core_requests: list[EngineCoreRequest]
    priority: int = 0


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{index}_{request_id}"


def child_seed(seed: int | None, index: int) -> int | None:
    """Seed of the index-th of n completions: seed + index, wrapped into int64 (the
    seed range) so that a seed at the top of the range stays valid."""
    if seed is None:
        return None
    return (seed + index - INT64_MIN) % (1 << 64) + INT64_MIN


class Processor:
    def __init__(self, config: EngineConfig, tokenizer):
        # Suffix that makes every engine-core request id unique (as vLLM does): an aborted
        # request's id is free again at once while its core request may still be in flight.
        self._counter = itertools.count()
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = config.hf_config.vocab_size
        self.eos_token_ids = eos_token_ids(config, tokenizer)
        self._so_cache: collections.OrderedDict = collections.OrderedDict()
        # Longest text prompt that could fit (None: no cheap bound for this tokenizer).
        per_token = max_chars_per_token(tokenizer)
        self.max_prompt_chars: int | None = (
            None if per_token is None else int((config.max_model_len - 1) * per_token))
        # --generation-config: the defaults of requests that do not set these fields
        self.default_sampling_fields = config.get_diff_sampling_param()
        # its max_new_tokens caps every request that gives no max_tokens of its own
        self.default_max_tokens: int | None = self.default_sampling_fields.get("max_tokens")
        self.max_logprobs = min(config.max_logprobs, self.vocab_size)

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling parameters of a request that sets none: vLLM's neutral defaults
        overridden by the generation config (``--generation-config``), as vLLM's
        ``LLM.get_default_sampling_params``. A ``max_tokens`` from the generation config
        counts as not given (capped at the room the prompt leaves, never refused)."""
        fields = self.default_sampling_fields
        return SamplingParams.with_defaults(**fields) if fields else SamplingParams()

    def validate_structured_outputs(self, so: StructuredOutputsParams) -> StructuredOutputsParams:
        """``so`` checked and normalized (a JSON schema as its JSON text) by the xgrammar
        backend (``pyengine.structured_output.backend_xgrammar``). Raises
        VLLMValidationError naming the field and the problem."""
        from pyengine.structured_output.backend_xgrammar import validate_structured_outputs

        value = getattr(so, so.kind)
        try:
            key = (so.kind, value if isinstance(value, (str, bool)) else json.dumps(value, sort_keys=True),
                   so.disable_any_whitespace, so.disable_additional_properties, so.whitespace_pattern)
        except (TypeError, ValueError):
            key = None  # not JSON-serializable: validation reports it
        hit = self._so_cache.get(key) if key is not None else None
        if hit is not None:
            self._so_cache.move_to_end(key)
            checked = hit
        else:
            checked = validate_structured_outputs(so)
            if key is not None:
                self._so_cache[key] = checked
                if len(self._so_cache) > _SO_CACHE_SIZE:
                    self._so_cache.popitem(last=False)
        gate = {"reasoning_end_token_id": so.reasoning_end_token_id,
                "reasoning_start_token_id": so.reasoning_start_token_id}
        vocab = self.vocab_size
        for name, tid in gate.items():
            if tid is not None and tid >= vocab:
                raise VLLMValidationError(f"structured_outputs.{name} {tid} is not in the vocabulary (size {vocab}).",
                                          parameter=f"structured_outputs.{name}")
        if any(getattr(checked, k) != v for k, v in gate.items()):  # the cache is keyed by the constraint only
            checked = dataclasses.replace(checked, **gate)
        return checked

    def check_prompt_text(self, text: str, parameter: str = "prompt") -> None:
        """The cheap bound, before a text prompt is tokenized: more characters than
        ``max_prompt_chars`` cannot encode to fewer than ``max_model_len`` tokens
        (``max_chars_per_token``). Raises ``VLLMValidationError`` naming ``parameter``."""
        limit = self.max_prompt_chars
        if limit is not None and len(text) > limit:
            raise VLLMValidationError(
                f"The prompt is too long: it has {len(text)} characters, and this model's maximum "
                f"context length of {self.config.max_model_len} tokens holds at most {limit} characters "
                f"with this tokenizer. Please shorten the prompt.", parameter=parameter, value=len(text))

    def check_prompt_length(self, num_tokens: int, parameter: str = "prompt") -> None:
        """A prompt of ``num_tokens`` tokens must leave room for one generated token in
        ``max_model_len``. Raises ``VLLMValidationError`` naming ``parameter``."""
        max_len = self.config.max_model_len
        if num_tokens >= max_len:
            raise VLLMValidationError(
                f"This model's maximum context length is {max_len} tokens. However, your prompt has "
                f"{num_tokens} tokens; it must be shorter than that to leave room for at least one "
                f"generated token.", parameter=parameter, value=num_tokens)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``tokenizer(text).input_ids``, through the Rust tokenizer directly where the
        tokenizer is in transformers' default state (no truncation or padding set): that
        skips transformers' per-token Python work, so almost all the time is spent with
        the GIL released (a 4 MB prompt holds it for tens of ms instead of hundreds)."""
        tok = self.tokenizer
        backend = getattr(tok, "backend_tokenizer", None)
        if (backend is not None and backend.truncation is None and backend.padding is None
                and getattr(backend, "encode_special_tokens", False) == bool(getattr(tok, "split_special_tokens", False))):
            encode = getattr(backend, "encode_batch_fast", backend.encode_batch)  # _fast: no offsets
            return encode([text], add_special_tokens=add_special_tokens)[0].ids
        # verbose=False: the length check reports over-long prompts itself.
        return tok.encode(text, add_special_tokens=add_special_tokens, verbose=False)

    def encode_prompt(self, text: str, add_special_tokens: bool = True, parameter: str = "prompt") -> list[int]:
        """A text prompt's token ids: ``check_prompt_text`` (the cheap bound, naming
        ``parameter``), then ``encode``. Raises ``VLLMValidationError``."""
        self.check_prompt_text(text, parameter)
        return self.encode(text, add_special_tokens)

    def check_token_ids(self, ids, parameter: str = "prompt") -> list[int]:
        """``ids`` as a list of ints, each a token id of the model's vocabulary. Raises
        ``VLLMValidationError`` naming ``parameter``."""
        ids = list(ids)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise VLLMValidationError(f"{parameter} must be a list of token ids (integers).", parameter=parameter)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise VLLMValidationError(f"Token id {bad[0]} in {parameter} is out of vocabulary (valid ids: "
                                      f"0..{self.vocab_size - 1}).", parameter=parameter, value=bad[0])
        return ids

    def check_prompt(self, prompt: PromptType, parameter: str = "prompt", truncated: bool = False) -> None:
        """The rules a prompt must meet that need no tokenization: not empty, token ids in
        the vocabulary and leaving room for one generated token, text under the cheap
        character bound (``check_prompt_text``). Front ends run it on every prompt of a
        request before tokenizing any. ``truncated``: the request truncates its prompt
        (``truncate_prompt_tokens``), so the length rules wait for ``truncate_prompt``.
        Raises ``VLLMValidationError`` naming ``parameter``."""
        if isinstance(prompt, dict):
            prompt = prompt.get("prompt_token_ids", prompt.get("prompt"))
        if isinstance(prompt, (str, list, tuple)) and not prompt:
            raise VLLMValidationError("The prompt cannot be empty.", parameter=parameter)
        if isinstance(prompt, str):
            if not truncated:
                self.check_prompt_text(prompt, parameter)
        elif isinstance(prompt, (list, tuple)):
            self.check_token_ids(prompt, parameter)
            if not truncated:
                self.check_prompt_length(len(prompt), parameter)

    def truncate_prompt(self, ids: list[int], params: SamplingParams) -> list[int]:
        """``ids`` cut to their last ``params.truncate_prompt_tokens`` tokens (vLLM's left
        truncation); -1 keeps as many as fit next to a given ``max_tokens`` (at least one
        generated token). A value larger than that room is refused
        (``VLLMValidationError``, parameter ``truncate_prompt_tokens``). None: ``ids``."""
        k = params.truncate_prompt_tokens
        if k is None:
            return ids
        given = params.max_tokens if params.max_tokens is not None and not params.max_tokens_is_default else 0
        room = self.config.max_model_len - max(given, 1)
        if k == -1:
            k = max(room, 1)  # room < 1: the max_tokens check refuses the request
        elif k > room:
            raise VLLMValidationError(
                f"truncate_prompt_tokens={k} cannot be greater than max_model_len - max_tokens = {room} "
                f"(max_model_len {self.config.max_model_len}, max_tokens {max(given, 1)}). Please request a "
                "smaller truncation size.", parameter="truncate_prompt_tokens", value=k)
        return ids[-k:] if len(ids) > k else ids

    def bad_words_token_ids(self, bad_words: list[str] | None) -> list[list[int]] | None:
        """``bad_words`` tokenized as vLLM's ``SamplingParams.update_from_tokenizer``: each
        word (left-stripped) without special tokens, then with a leading space, the latter
        kept only when it is another token sequence of the same length (a separate
        mid-text word token). Raises ``VLLMValidationError`` (parameter ``bad_words``) for
        a word that encodes to nothing or outside the model's vocabulary."""
        if not bad_words:
            return None
        out: list[list[int]] = []
        for word in bad_words:
            plain = self.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.encode(" " + word.lstrip(), add_special_tokens=False)
            if not plain:
                raise VLLMValidationError(f"bad_words: {word!r} encodes to no tokens.", parameter="bad_words")
            out.append(plain)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                out.append(spaced)
        bad = [t for ids in out for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise VLLMValidationError(f"bad_words encode to token id {bad[0]}, outside the model's vocabulary "
                                      f"(size {self.vocab_size}).", parameter="bad_words")
        return out

    def check_allowed_token_ids(self, params: SamplingParams) -> list[int] | None:
        """``params.allowed_token_ids`` in the vocabulary, sorted without duplicates (None
        when unset). Raises ``VLLMValidationError`` (parameter ``allowed_token_ids``)."""
        if params.allowed_token_ids is None:
            return None
        return sorted(set(self.check_token_ids(params.allowed_token_ids, "allowed_token_ids")))

    def check_thinking_budget(self, params: SamplingParams, allowed: list[int] | None,
                              bad_words: list[list[int]] | None) -> None:
        """A ``thinking_token_budget`` the engine can honour: its end tag
        (``thinking_end_token_id``) given, the tags in the vocabulary, and the end tag neither
        left out of ``allowed_token_ids`` nor banned by ``bad_words`` (the budget would force a
        token the request forbids). Raises ``VLLMValidationError``."""
        if params.thinking_token_budget is None:
            return
        end = params.thinking_end_token_id
        if end is None:
            raise VLLMValidationError(
                "thinking_token_budget needs thinking_end_token_id, the token that ends the reasoning (the "
                "server sets it from --reasoning-parser).", parameter="thinking_token_budget")
        for name in ("thinking_start_token_id", "thinking_end_token_id"):
            tid = getattr(params, name)
            if tid is not None and tid >= self.vocab_size:
                raise VLLMValidationError(f"{name} {tid} is not in the vocabulary (size {self.vocab_size}).",
                                          parameter=name)
        if allowed is not None and end not in allowed:
            raise VLLMValidationError(f"allowed_token_ids must include the reasoning's end token ({end}) with "
                                      "thinking_token_budget, which may force it.", parameter="allowed_token_ids")
        if any(w[-1] == end for w in bad_words or ()):
            raise VLLMValidationError(f"bad_words may not ban the reasoning's end token ({end}) with "
                                      "thinking_token_budget, which may force it.", parameter="bad_words")

    def check_encoded(self, ids: list[int], parameter: str = "prompt") -> list[int]:
        """A text prompt's token ids: at least one, all in the model's vocabulary (a
        tokenizer larger than the model's vocabulary is refused here, not in the model).
        Raises ``VLLMValidationError`` naming ``parameter``."""
        if not ids:
            raise VLLMValidationError("The prompt encodes to no tokens.", parameter=parameter)
        if max(ids) >= self.vocab_size or min(ids) < 0:
            raise VLLMValidationError(f"The prompt encodes to token id {max(ids)}, outside the model's "
                                      f"vocabulary (size {self.vocab_size}); the tokenizer does not match the "
                                      "model.", parameter=parameter)
        return ids

    def tokenize(self, prompt: PromptType, parameter: str = "prompt",
                 add_special_tokens: bool = True, truncated: bool = False) -> tuple[str | None, list[int]]:
        """Returns (prompt text or None, prompt token ids): ``check_prompt`` (``truncated``:
        see there), then the text encoded and ``check_encoded``. Raises ValueError
        (``VLLMValidationError`` naming ``parameter``)."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise VLLMValidationError("A prompt dict needs a 'prompt' or 'prompt_token_ids' key.",
                                          parameter=parameter)
        if not isinstance(prompt, (str, list, tuple)):
            raise VLLMValidationError(f"A prompt must be a string or a list of token ids, got {type(prompt).__name__}.",
                                      parameter=parameter)
        self.check_prompt(prompt, parameter, truncated)
        if isinstance(prompt, str):
            return prompt, self.check_encoded(self.encode(prompt, add_special_tokens), parameter)
        return None, list(prompt)

    @staticmethod
    def check_cache_salt(salt) -> str | None:
        """A prompt's ``cache_salt``: None, or a non-empty string (vLLM's rule). Raises
        ``VLLMValidationError`` (parameter ``cache_salt``)."""
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise VLLMValidationError("cache_salt must be a non-empty string if provided.", parameter="cache_salt")
        return salt

    def check_priority(self, priority) -> None:
        """A 64-bit integer; other than 0 only under the priority scheduling policy (under
        fcfs it would be silently meaningless). Raises ``VLLMValidationError``."""
        if not isinstance(priority, int) or isinstance(priority, bool) or not INT64_MIN <= priority <= INT64_MAX:
            raise VLLMValidationError(f"priority must be an integer in [{INT64_MIN}, {INT64_MAX}], got {priority!r}.",
                                      parameter="priority", value=priority)
        if priority != 0 and self.config.scheduling_policy != SchedulingPolicy.PRIORITY:
            raise VLLMValidationError(f"priority is only supported with the priority scheduling policy "
                                      f"(--scheduling-policy priority); this engine uses "
                                      f"{SchedulingPolicy(self.config.scheduling_policy).value!r}, got priority={priority}.",
                                      parameter="priority", value=priority)

    def check_logprobs(self, params: SamplingParams, parameter: str = "logprobs") -> None:
        """``params.logprobs`` at most the engine's ``max_logprobs``. Raises
        ``VLLMValidationError`` naming ``parameter`` (chat's ``top_logprobs``)."""
        if params.logprobs is not None and params.logprobs > self.max_logprobs:
            raise VLLMValidationError(
                f"logprobs must be at most {self.max_logprobs} (the engine's max_logprobs), got {params.logprobs}.",
                parameter=parameter, value=params.logprobs)

    def check_stop_token_ids(self, params: SamplingParams) -> None:
        """``params.stop_token_ids`` in the vocabulary. Raises ``VLLMValidationError``."""
        self.check_token_ids(params.stop_token_ids, "stop_token_ids")

    def _resolve_max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """The request's token limit. Not given (``None``, or the default left as is):
        capped at the room the prompt leaves and at the generation config's
        ``max_new_tokens``. Given and larger than that room: refused (as vLLM's OpenAI
        server does), with the numbers the user needs."""
        max_len = self.config.max_model_len
        room = max_len - num_prompt_tokens
        cap = room if self.default_max_tokens is None else min(room, self.default_max_tokens)
        if params.max_tokens is None:
            return cap
        if params.max_tokens_is_default:
            return min(params.max_tokens, cap)
        if params.max_tokens > room:
            raise VLLMValidationError(
                f"This model's maximum context length is {max_len} tokens. However, you requested "
                f"{num_prompt_tokens + params.max_tokens} tokens ({num_prompt_tokens} in the prompt, "
                f"{params.max_tokens} in the completion). Please reduce the length of the prompt or "
                f"max_tokens.", parameter="max_tokens", value=params.max_tokens)
        return params.max_tokens

    def check_params(self, params: SamplingParams, priority: int = 0, logprobs_param: str = "logprobs") -> None:
        """The request rules that need no prompt: logprobs under ``max_logprobs``
        (``logprobs_param``: the request's name for the count, chat's
        ``top_logprobs``), the priority against the scheduling policy, the stop token ids
        in the vocabulary. Raises ``VLLMValidationError``."""
        self.check_logprobs(params, logprobs_param)
        self.check_priority(priority)
        self.check_stop_token_ids(params)

    def finish_prompt(self, text: str | None, ids: list[int], params: SamplingParams, parameter: str = "prompt",
                      length_checked: bool = False) -> tuple[str | None, list[int]]:
        """A tokenized prompt's last rules: cut to ``params.truncate_prompt_tokens`` (the
        text is then None), then the length rule (``check_prompt_length``), unless
        ``length_checked`` (``check_prompt`` checked an untruncated token-id prompt).
        Returns (text or None, ids). Raises ``VLLMValidationError`` naming ``parameter``."""
        if params.truncate_prompt_tokens is not None:
            cut = self.truncate_prompt(ids, params)
            if len(cut) != len(ids):
                text, ids = None, cut  # the text no longer matches the prompt
            length_checked = False
        if not length_checked:
            self.check_prompt_length(len(ids), parameter)
        return text, ids

    def engine_request(self, request_id: str, text: str | None, ids: list[int], params: SamplingParams,
                       priority: int = 0, cache_salt: str | None = None,
                       arrival_time: float | None = None) -> ProcessedRequest:
        """The engine request of a prompt that passed its rules (``check_prompt`` /
        ``tokenize``, ``finish_prompt``) and of params that passed ``check_params``: the
        derived sampling fields (stop token ids with the EOS ids unless ``ignore_eos``,
        bad words tokenized, allowed token ids, the thinking budget checked, the
        structured-output constraint validated), ``max_tokens`` resolved against the
        prompt's length, and one ``EngineCoreRequest`` per completion (``arrival_time``:
        ``time.monotonic()`` seconds, now if None). Raises ``VLLMValidationError`` (bad
        words, allowed token ids, thinking budget, structured outputs, ``max_tokens``)."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string.")
        stop_ids = set(params.stop_token_ids)  # type: ignore[arg-type] # a list after __post_init__
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        changes: dict[str, Any] = {"all_stop_token_ids": stop_ids,
                                   "bad_words_token_ids": self.bad_words_token_ids(params.bad_words),
                                   "allowed_token_ids": self.check_allowed_token_ids(params)}
        self.check_thinking_budget(params, changes["allowed_token_ids"], changes["bad_words_token_ids"])
        if params.structured_outputs is not None:
            changes["structured_outputs"] = self.validate_structured_outputs(params.structured_outputs)
        params = params.clone(**changes)
        max_tokens = self._resolve_max_tokens(len(ids), params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        suffix = f"-{next(self._counter)}"
        core_reqs = []
        for i in range(params.n):
            child = params if params.n == 1 else params.clone(n=1, seed=child_seed(params.seed, i))
            core_reqs.append(EngineCoreRequest(child_request_id(request_id, i, params.n) + suffix, ids, child,
                                               max_tokens, arrival, priority, cache_salt))
        return ProcessedRequest(request_id, text, ids, params, core_reqs, priority)

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams | None,
                priority: int = 0, arrival_time: float | None = None) -> ProcessedRequest:
        """Validate one user request (every rule once: ``check_params``, the cache salt,
        ``tokenize``, ``finish_prompt``, ``engine_request``). Raises ValueError
        (``VLLMValidationError`` naming the field for a rule)."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string.")
        if params is None:
            params = self.get_default_sampling_params()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}.")
        self.check_params(params, priority)
        salt = self.check_cache_salt(prompt.get("cache_salt") if isinstance(prompt, dict) else None)
        truncated = params.truncate_prompt_tokens is not None
        text, ids = self.tokenize(prompt, truncated=truncated)
        text, ids = self.finish_prompt(text, ids, params, length_checked=text is None and not truncated)
        return self.engine_request(request_id, text, ids, params, priority, salt, arrival_time)
