"""Front-end input processing: validates a request and turns it into EngineCoreRequests
(mirrors vllm/v1/engine/processor.py). Runs on the caller's thread, so bad input is a
ValueError there and nothing reaches the engine."""
from __future__ import annotations

import collections
import itertools
import json
import time
from typing import Any, Optional

from pyengine.config import EngineConfig
from pyengine.engine.messages import EngineCoreRequest
from pyengine.exceptions import VLLMValidationError
from pyengine.sampling_params import INT64_MAX, INT64_MIN, SamplingParams, StructuredOutputsParams

PromptType = Any  # str | list[int] | {"prompt": str} | {"prompt_token_ids": list[int]}
# Validated structured-output constraints remembered per Processor (a client usually sends
# one schema many times).
_SO_CACHE_SIZE = 256


def eos_token_ids(config: EngineConfig, tokenizer) -> set[int]:
    """EOS ids from generation_config.json (may list several), else the config / tokenizer."""
    ids: set[int] = set()
    try:
        from transformers import GenerationConfig
        eos = GenerationConfig.from_pretrained(config.model).eos_token_id
    except Exception:  # no generation_config.json
        eos = None
    if eos is None:
        eos = getattr(config.hf_config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(int(e) for e in eos)
    return ids


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{index}_{request_id}"


def child_seed(seed: Optional[int], index: int) -> Optional[int]:
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
            return hit
        checked = validate_structured_outputs(so)
        if key is not None:
            self._so_cache[key] = checked
            if len(self._so_cache) > _SO_CACHE_SIZE:
                self._so_cache.popitem(last=False)
        return checked

    def tokenize(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        """Returns (prompt text or None, prompt token ids). Raises ValueError."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("A prompt dict needs a 'prompt' or 'prompt_token_ids' key.")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("The prompt cannot be empty.")
            # verbose=False: the length check below reports over-long prompts itself.
            ids = self.tokenizer.encode(prompt, verbose=False)
            if not ids:
                raise ValueError("The prompt encodes to no tokens.")
            if max(ids) >= self.vocab_size or min(ids) < 0:
                # a tokenizer larger than the model's vocabulary: refused here, not in the model
                raise ValueError(f"The prompt encodes to token id {max(ids)}, outside the model's "
                                 f"vocabulary (size {self.vocab_size}); the tokenizer does not match the model.")
            return prompt, ids
        if isinstance(prompt, (list, tuple)):
            if not prompt:
                raise ValueError("The prompt cannot be empty.")
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise ValueError("Prompt token ids must be integers.")
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"Prompt token id {bad[0]} is out of vocabulary (size {self.vocab_size}).")
            return None, list(prompt)
        raise ValueError(f"A prompt must be a string or a list of token ids, got {type(prompt).__name__}.")

    def _resolve_max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """The request's token limit. Not given (``None``, or the default 16 left as is):
        capped at the room the prompt leaves. Given and larger than that room: refused
        (as vLLM's OpenAI server does), with the numbers the user needs."""
        max_len = self.config.max_model_len
        room = max_len - num_prompt_tokens
        if params.max_tokens is None:
            return room
        if params.max_tokens_is_default:
            return min(params.max_tokens, room)
        if params.max_tokens > room:
            raise VLLMValidationError(
                f"This model's maximum context length is {max_len} tokens. However, you requested "
                f"{num_prompt_tokens + params.max_tokens} tokens ({num_prompt_tokens} in the prompt, "
                f"{params.max_tokens} in the completion). Please reduce the length of the prompt or "
                f"max_tokens.", parameter="max_tokens", value=params.max_tokens)
        return params.max_tokens

    def process(self, request_id: str, prompt: PromptType, params: Optional[SamplingParams],
                priority: int = 0, arrival_time: Optional[float] = None
                ) -> tuple[Optional[str], list[int], SamplingParams, list[EngineCoreRequest]]:
        """Validate one user request; returns (prompt text, prompt ids, params, core
        requests: one per each of the n completions). Raises ValueError."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string.")
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}.")
        if not isinstance(priority, int) or isinstance(priority, bool) or not INT64_MIN <= priority <= INT64_MAX:
            raise VLLMValidationError(f"priority must be an integer in [{INT64_MIN}, {INT64_MAX}], got {priority!r}.",
                                      parameter="priority", value=priority)
        text, ids = self.tokenize(prompt)
        max_len = self.config.max_model_len
        if len(ids) >= max_len:
            raise ValueError(f"The prompt ({len(ids)} tokens) is too long: the maximum model length is "
                             f"{max_len} tokens, including at least one generated token.")
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids contains {bad[0]}, outside the vocabulary (size {self.vocab_size}).")
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        changes = {"all_stop_token_ids": stop_ids}
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
                                               max_tokens, arrival, priority))
        return text, ids, params, core_reqs
