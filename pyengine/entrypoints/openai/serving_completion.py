"""``/v1/completions`` (mirrors vllm/entrypoints/openai/serving_completion.py): requests ->
engine inputs (the prompts checked and tokenized by the engine's ``Processor``, the
``SamplingParams``), and outputs -> ``text_completion`` objects and chunks. Every refusal
is a ``VLLMValidationError``."""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from pyengine.engine.detokenizer import prompt_text_for_echo
from pyengine.entrypoints.openai.protocol import CompletionRequest
from pyengine.entrypoints.openai.serving_chat import request_structured_outputs
from pyengine.entrypoints.openai.serving_engine import (
    ENGINE_DEFAULT,
    ChoiceState,
    DeltaDriver,
    LogprobsFormatter,
    OpenAIServing,
    Prepared,
    ResponseBuilder,
    Session,
    SSEStream,
    check_stream_options,
    parse_request,
    refuse_unsupported,
    to_sampling_params,
)
from pyengine.entrypoints.openai.serving_models import OpenAIServingModels
from pyengine.exceptions import VLLMValidationError
from pyengine.sampling_params import RequestOutputKind, SamplingParams

# Chat-only tool fields: on /v1/completions they could only be ignored, so they are refused.
CHAT_TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls", "functions", "function_call")


def refuse_tool_fields(req: CompletionRequest) -> None:
    """A completions request carrying tool fields (unknown there: pydantic's model_extra),
    or chat's ``max_completion_tokens`` (vLLM's CompletionRequest does not know it and
    would silently give 16 tokens; OpenAI's legacy completions refuse it), or
    ``thinking_token_budget`` (vLLM takes it here too; without a reasoning parser on this
    path it could only be ignored). Raises VLLMValidationError."""
    extra = req.model_extra or {}
    for name in CHAT_TOOL_FIELDS:
        if extra.get(name) is not None:
            raise VLLMValidationError(f"{name} is not supported by /v1/completions; tool calling is served by "
                                      "/v1/chat/completions.", parameter=name)
    if extra.get("thinking_token_budget") is not None:
        raise VLLMValidationError("thinking_token_budget is not supported by /v1/completions (no reasoning parser "
                                  "reads its output); it is served by /v1/chat/completions with --reasoning-parser.",
                                  parameter="thinking_token_budget")
    if extra.get("max_completion_tokens") is not None:
        raise VLLMValidationError("max_completion_tokens is a /v1/chat/completions field; /v1/completions takes "
                                  "max_tokens.", parameter="max_completion_tokens")


def completion_prompts(processor, req: CompletionRequest, run: Callable = lambda fn: fn(), n: int = 1,
                       max_sequences: int | None = None,
                       params: SamplingParams | None = None) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) of each prompt. The rules that need no tokenization run
    on every prompt first (``Processor.check_prompt``), then the texts are tokenized
    together through ``run(fn)`` (with special tokens unless ``add_special_tokens`` is
    false), then, given ``params``, ``Processor.finish_prompt`` (``truncate_prompt_tokens``
    cuts on the left, the text is then None; the length rule). ``max_sequences``: the most prompts × ``n`` one request
    may ask for (None: no bound). Raises VLLMValidationError."""
    p = req.prompt
    if isinstance(p, str) or (p and isinstance(p[0], int)):
        items: list = [p]
    else:
        items = list(p)
    if not items:
        raise VLLMValidationError("The prompt cannot be empty.", parameter="prompt")
    if max_sequences is not None and len(items) * n > max_sequences:
        # one request would otherwise queue any number of sequences ahead of every later client
        raise VLLMValidationError(f"The request asks for {len(items) * n} sequences ({len(items)} prompts × n={n}); "
                                  f"at most {max_sequences} per request.", parameter="prompt")
    truncated = params is not None and params.truncate_prompt_tokens is not None
    special = req.add_special_tokens is not False
    for item in items:
        processor.check_prompt(item, "prompt", truncated)
    texts = [item for item in items if isinstance(item, str)]
    encoded = iter(run(lambda: [processor.check_encoded(processor.encode(t, special)) for t in texts]) if texts else [])
    prompts: list[tuple[str | None, list[int]]] = [
        (item, next(encoded)) if isinstance(item, str) else (None, list(item)) for item in items]
    if params is not None:  # truncation, then the length rule where check_prompt did not apply it
        prompts = [processor.finish_prompt(text, ids, params, length_checked=text is None and not truncated)
                   for text, ids in prompts]
    return prompts


@dataclass
class CompletionInputs:
    """One completions request as the engine takes it."""
    prompts: list[tuple[str | None, list[int]]]
    sampling_params: SamplingParams
    priority: int
    cache_salt: str | None = None  # the engine prompt's "cache_salt"


def completion_inputs(processor, req: CompletionRequest, *, output_kind: RequestOutputKind = RequestOutputKind.DELTA,
                      run: Callable = lambda fn: fn(), max_sequences: int | None = None) -> CompletionInputs:
    """Every rule of a completions request (``max_sequences``: see ``completion_prompts``).
    Raises VLLMValidationError."""
    check_stream_options(req)
    if req.suffix:
        raise VLLMValidationError("suffix is not supported.", parameter="suffix")
    refuse_tool_fields(req)
    refuse_unsupported(req)
    if req.echo and req.logprobs is not None:
        raise VLLMValidationError("echo together with logprobs is not supported (no prompt logprobs).",
                                  parameter="echo")
    params = to_sampling_params(processor, req, max_tokens=ENGINE_DEFAULT if req.max_tokens is None else req.max_tokens,
                                logprobs=req.logprobs, structured_outputs=request_structured_outputs(req),
                                output_kind=output_kind)
    salt = processor.check_cache_salt(req.cache_salt)
    prompts = completion_prompts(processor, req, run, params.n, max_sequences, params)
    return CompletionInputs(prompts, params, req.priority or 0, salt)


# ---------------------------------------------------------------------------------------
# Responses


class CompletionResponseBuilder(ResponseBuilder):
    """``text_completion`` objects and chunks (OpenAI's ``Completion``). ``echo_lens``:
    per choice, the characters of the echoed prompt its text starts with (logprobs'
    ``text_offset`` counts them), or None without echo."""

    object_name = chunk_object_name = "text_completion"

    def __init__(self, request_id: str, model: str, created: int, formatter: LogprobsFormatter | None,
                 echo_lens: list[int] | None = None, prompt_token_ids: list[list[int]] | None = None,
                 n: int = 1):
        super().__init__(request_id, model, created, formatter, prompt_token_ids)
        self.echo_lens = echo_lens
        self.n = n  # choices per prompt (choice idx // n is its prompt)

    def delta_chunks(self, idx: int, ch: ChoiceState, text: str, token_ids, logprobs,
                     finish: str | None) -> list[dict]:
        lp = None
        if self.formatter is not None and token_ids:
            lp = self.formatter.completion_logprobs(ch, token_ids, logprobs or [None] * len(token_ids), ch.offset)
        c = {"index": idx, "text": text, "logprobs": lp, "finish_reason": finish}
        if finish is not None:
            c["stop_reason"] = ch.stop_reason
        if self.return_token_ids:  # vLLM: the prompt's ids in the choice's first chunk
            if not ch.started:
                c["prompt_token_ids"] = self.prompt_token_ids[idx // self.n]  # type: ignore[index] # set with return_token_ids
            c["token_ids"] = list(token_ids)
        ch.started = True
        return [self.chunk([c])]

    def text_delta_template(self, idx: int) -> tuple[str, str] | None:
        return self._template_of(idx) if self.formatter is None and not self.return_token_ids else None

    def choice(self, idx: int, ch: ChoiceState, token_ids: list, logprobs: list) -> dict:
        lp = None
        if self.formatter is not None:
            start = self.echo_lens[idx] if self.echo_lens is not None else 0
            lp = self.formatter.completion_logprobs(ch, token_ids, logprobs, start)
        c = {"index": idx, "text": "".join(ch.text), "logprobs": lp, "finish_reason": ch.finish_reason,
             "stop_reason": ch.stop_reason}
        if self.return_token_ids:
            c["prompt_token_ids"] = self.prompt_token_ids[idx // self.n]  # type: ignore[index] # set with return_token_ids
            c["token_ids"] = list(token_ids)
        return c


# ---------------------------------------------------------------------------------------
# The endpoint


class OpenAIServingCompletion(OpenAIServing):
    """``/v1/completions`` end to end (vLLM's ``OpenAIServingCompletion``): the request
    parsed, its rules run once (``completion_inputs``), its prompts tokenized, its engine
    requests made (``Processor.engine_request``) and queued through the front end's
    ``Session``; the answer is the ``text_completion`` object, or the ``SSEStream`` of its
    chunks. ``max_sequences``: the most prompts × n one request may ask for."""

    def __init__(self, engine, models: OpenAIServingModels, max_sequences: int | None = None):
        super().__init__(engine, models)
        self.max_sequences = max_sequences

    def create_completion(self, request: CompletionRequest | str | bytes,
                          session: Session) -> dict | SSEStream:
        """Raises ``VLLMValidationError`` (a field refused), ``APIError`` (404: an
        unknown model) and what ``OpenAIServing.run`` raises."""
        return self.run(self.prepare(parse_request(CompletionRequest, request), session.run_blocking), session)

    def prepare(self, req: CompletionRequest, run: Callable = lambda fn: fn()) -> Prepared:
        """The checked request's engine requests and response driver (``run(fn)``: how
        tokenization runs)."""
        model = self.check_model(req.model)
        processor = self.processor
        inputs = completion_inputs(processor, req, run=run, max_sequences=self.max_sequences)
        echo = None
        if req.echo:
            echo = [text if text is not None else prompt_text_for_echo(self.tokenizer, ids)
                    for text, ids in inputs.prompts]
        params = inputs.sampling_params
        n = params.n
        formatter = (LogprobsFormatter(self.tokenizer, req.logprobs, bool(req.return_tokens_as_token_ids))
                     if req.logprobs is not None else None)
        response_id = "cmpl-" + (req.request_id or uuid.uuid4().hex)
        builder = CompletionResponseBuilder(response_id, model, int(time.time()), formatter,
                                            [len(echo[i // n]) for i in range(len(echo) * n)] if echo else None,
                                            [ids for _, ids in inputs.prompts] if req.return_token_ids else None, n)
        engine_id = self.engine_request_id(response_id)
        requests = run(lambda: [processor.engine_request(f"{engine_id}-{i}", text, ids, params, inputs.priority,
                                                         inputs.cache_salt)
                                for i, (text, ids) in enumerate(inputs.prompts)])
        so = req.stream_options
        driver = DeltaDriver(builder, len(inputs.prompts), n, sum(len(ids) for _, ids in inputs.prompts),
                             echo_texts=echo, include_usage=bool(so and so.include_usage),
                             continuous_usage=bool(so and so.continuous_usage_stats))
        return Prepared(requests, driver, bool(req.stream))
