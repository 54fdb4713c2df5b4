"""``/v1/chat/completions`` (mirrors vllm/entrypoints/openai/serving_chat.py): requests ->
engine inputs (tools and ``tool_choice``, the structured-output
constraint, the conversation rendered with the chat template (transformers'
``apply_chat_template``, refused without a template, as vLLM) and encoded by the engine's
``Processor``, and the ``SamplingParams``), and outputs -> ``chat.completion`` objects and
``chat.completion.chunk`` chunks. Used by the HTTP server and by the C ABI's ``vllm_chat``
/ ``vllm_chat_stream``; every refusal is a ``VLLMValidationError``."""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pyengine.chat_utils import apply_hf_chat_template
from pyengine.engine.processor import ProcessedRequest
from pyengine.entrypoints.openai.protocol import ChatCompletionRequest
from pyengine.entrypoints.openai.serving_engine import (
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
from pyengine.entrypoints.reasoning import ChoiceReasoning, RequestReasoning
from pyengine.entrypoints.structured_outputs import structured_outputs_from_request
from pyengine.entrypoints.tool_calls import (
    ToolCallExtractor,
    ToolCallMode,
    messages_for_template,
    normalize_tools,
    resolve_tool_choice,
)
from pyengine.exceptions import VLLMValidationError
from pyengine.sampling_params import RequestOutputKind, SamplingParams
from pyengine.tool_parsers import ToolParserManager


def request_structured_outputs(req, mode: ToolCallMode | None = None):
    """The request's constraint (response_format / structured_outputs / guided_*), or the
    one its ``tool_choice`` imposes. Raises VLLMValidationError."""
    so = structured_outputs_from_request(req.structured_output_fields())
    if mode is not None and mode.structured_outputs is not None:
        if so is not None:
            raise VLLMValidationError(f"tool_choice {mode.kind!r} cannot be combined with response_format or "
                                      "structured outputs.", parameter="tool_choice")
        so = mode.structured_outputs
    return so


def chat_tool_mode(req: ChatCompletionRequest, tool_call_parser: str | None,
                   enable_auto_tool_choice: bool) -> tuple[list, ToolCallMode]:
    """(normalized tools, ToolCallMode) of a chat request. Raises VLLMValidationError."""
    for old in ("functions", "function_call"):
        if getattr(req, old) is not None:
            raise VLLMValidationError(f"{old} is not supported; use tools and tool_choice.", parameter=old)
    tools = normalize_tools(req.tools)
    mode = resolve_tool_choice(tools, req.tool_choice, req.parallel_tool_calls,
                               enable_auto_tool_choice and tool_call_parser is not None)
    return tools, mode


def template_messages(req: ChatCompletionRequest) -> list[dict]:
    """The request's messages as chat templates expect them (tool calls' arguments as
    objects; ``tool_call_id`` and ``name`` kept)."""
    msgs = []
    for m in req.messages:
        d: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        msgs.append(d)
    return messages_for_template(msgs)


def make_extractor(mode: ToolCallMode, tool_call_parser: str | None, tokenizer) -> ToolCallExtractor:
    """Per-choice content / tool-call extraction for ``mode``."""
    parser = ToolParserManager.get_tool_parser(tool_call_parser)(tokenizer) \
        if mode.kind == "auto" and tool_call_parser else None
    return ToolCallExtractor(mode, parser)


def render_chat_prompt(processor, req: ChatCompletionRequest, chat_template: str | None = None,
                       tools: list | None = None,
                       params: SamplingParams | None = None) -> tuple[str | None, list[int]]:
    """(prompt text, prompt token ids): the conversation rendered with ``chat_template``
    (else the tokenizer's; ``documents`` and ``reasoning_effort`` go to it over
    ``chat_template_kwargs``, as vLLM), encoded (special tokens added only with
    ``add_special_tokens``), then the engine's prompt rules under the name ``messages``:
    the cheap character bound before encoding, then at least one token, all in the
    vocabulary, leaving room for one generated token. With
    ``params.truncate_prompt_tokens`` the ids are cut on the left first (the text is then
    None). Raises VLLMValidationError."""
    kwargs = dict(req.chat_template_kwargs or {})
    for name in ("documents", "reasoning_effort"):
        if getattr(req, name) is not None:
            kwargs[name] = getattr(req, name)
    try:
        text = apply_hf_chat_template(
            processor.tokenizer, template_messages(req), chat_template,
            add_generation_prompt=bool(req.add_generation_prompt) and not req.continue_final_message,
            continue_final_message=bool(req.continue_final_message), tools=tools or None,
            chat_template_kwargs=kwargs or None)
    except VLLMValidationError:
        raise
    except ValueError as e:  # no template, reserved kwargs, the template failed on this input
        raise VLLMValidationError(str(e), parameter="messages") from None
    special = bool(req.add_special_tokens)
    if params is not None and params.truncate_prompt_tokens is not None:  # no character bound: it is cut
        ids = processor.check_encoded(processor.encode(text, add_special_tokens=special), "messages")
    else:
        ids = processor.check_encoded(processor.encode_prompt(text, add_special_tokens=special,
                                                              parameter="messages"), "messages")
    if params is None:
        processor.check_prompt_length(len(ids), "messages")
        return text, ids
    return processor.finish_prompt(text, ids, params, "messages")


def chat_echo(req: ChatCompletionRequest) -> str | None:
    """With ``echo``, the text each choice's message starts with (vLLM's): the final
    message's content when that message has the response's role (``assistant`` after a
    generation prompt; without one, as with ``continue_final_message``, the final
    message's own role), else None."""
    if not req.echo:
        return None
    last = req.messages[-1]
    role = "assistant" if req.add_generation_prompt and not req.continue_final_message else last.role
    return (last.text() or None) if last.role == role else None


@dataclass
class ChatInputs:
    """One chat request as the engine takes it."""
    text: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int
    tool_mode: ToolCallMode
    num_top_logprobs: int | None  # None: no logprobs
    echo: str | None = None  # what each choice's message starts with (chat_echo)
    cache_salt: str | None = None  # the engine prompt's "cache_salt"
    reasoning: RequestReasoning | None = None  # --reasoning-parser: the split of each choice
    # The request's names of the engine's fields where they differ (max_completion_tokens
    # for max_tokens): the engine request's refusals name the field the client sent.
    field_names: dict[str, str] | None = None


def chat_inputs(processor, req: ChatCompletionRequest, *, chat_template: str | None = None,
                tool_call_parser: str | None = None, enable_auto_tool_choice: bool = False,
                output_kind: RequestOutputKind = RequestOutputKind.DELTA, stream: bool | None = None,
                run: Callable = lambda fn: fn(), reasoning_parser: type | None = None) -> ChatInputs:
    """Every rule of a chat request, in the order the front ends report them (the
    request's own fields first, then the rendered prompt). ``run(fn)``: how to call the
    rendering and tokenization (the HTTP server runs them off its event loop); ``stream``:
    whether the response is streamed, where the front end decides it (the C ABI's two
    functions) rather than the request's ``stream`` field; ``reasoning_parser``: the
    ``--reasoning-parser`` class (``reasoning.load_reasoning_parser``): each choice is then
    split into reasoning and content, a structured-output constraint (tool_choice
    required / named included) applies to the content only, and ``thinking_token_budget``
    (vLLM's field; refused without a parser) bounds the reasoning. Raises
    VLLMValidationError naming the field the client sent (``max_completion_tokens``, when
    given, for the limit the engine calls ``max_tokens``)."""
    names = chat_field_names(req)
    try:
        inputs = _chat_inputs(processor, req, chat_template=chat_template, tool_call_parser=tool_call_parser,
                              enable_auto_tool_choice=enable_auto_tool_choice, output_kind=output_kind,
                              stream=stream, run=run, reasoning_parser=reasoning_parser)
    except VLLMValidationError as e:
        if names is None:
            raise
        raise e.renamed(names) from None
    inputs.field_names = names
    return inputs


def chat_field_names(req: ChatCompletionRequest) -> dict[str, str] | None:
    """The request's names of the engine's fields where they differ (``ChatInputs.field_names``)."""
    return {"max_tokens": "max_completion_tokens"} if req.max_completion_tokens is not None else None


def _chat_inputs(processor, req: ChatCompletionRequest, *, chat_template: str | None, tool_call_parser: str | None,
                 enable_auto_tool_choice: bool, output_kind: RequestOutputKind, stream: bool | None,
                 run: Callable, reasoning_parser: type | None) -> ChatInputs:
    check_stream_options(req, stream)
    refuse_unsupported(req)
    tools, mode = chat_tool_mode(req, tool_call_parser, enable_auto_tool_choice)
    constraint = request_structured_outputs(req, mode)
    if req.top_logprobs is not None and not req.logprobs:
        raise VLLMValidationError("top_logprobs requires logprobs to be true.", parameter="top_logprobs")
    num_top = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = to_sampling_params(processor, req, max_tokens=max_tokens, logprobs=num_top,
                                structured_outputs=constraint, output_kind=output_kind,
                                logprobs_param="top_logprobs")
    if req.thinking_token_budget is not None:
        if reasoning_parser is None:
            raise VLLMValidationError(
                "thinking_token_budget needs a reasoning parser to tell the model's reasoning from its answer, and "
                "none is configured (vengine serve --reasoning-parser; the C ABI's "
                "vllm_model_params.reasoning_parser).",
                parameter="thinking_token_budget", value=req.thinking_token_budget)
        params = params.clone(thinking_token_budget=req.thinking_token_budget)
    salt = processor.check_cache_salt(req.cache_salt)
    text, ids = run(lambda: render_chat_prompt(processor, req, chat_template, tools, params))
    reasoning = None
    if reasoning_parser is not None:
        reasoning = RequestReasoning(reasoning_parser, processor.tokenizer, req.chat_template_kwargs, ids,
                                     req.include_reasoning is not False)
        if params.structured_outputs is not None:
            params = params.clone(structured_outputs=reasoning.gate(params.structured_outputs))
        params = reasoning.budget(params)
    return ChatInputs(text, ids, params, req.priority or 0, mode, num_top, chat_echo(req), salt, reasoning)


# ---------------------------------------------------------------------------------------
# Responses


class ChatResponseBuilder(ResponseBuilder):
    """``chat.completion`` objects and ``chat.completion.chunk`` chunks (OpenAI's
    ``ChatCompletion`` / ``ChatCompletionChunk``), content and tool calls per choice from
    ``extractors`` (one ``ToolCallExtractor`` per choice). ``echo``: the text every
    choice's content starts with (``chat_echo``): its own chunk after the role, as vLLM.
    ``reasoning``: with a reasoning parser, the request's setup: each choice's output is
    split first (``reasoning_content`` and vLLM's ``reasoning`` alias, in the message and
    in the deltas), and only the content goes to its extractor."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, request_id: str, model: str, created: int, formatter: LogprobsFormatter | None,
                 extractors: list[ToolCallExtractor], echo: str | None = None,
                 prompt_token_ids: list[int] | None = None, reasoning: RequestReasoning | None = None):
        super().__init__(request_id, model, created, formatter,
                         None if prompt_token_ids is None else [prompt_token_ids])
        self.extractors = extractors
        self.echo = echo
        self.reasoning = reasoning
        self.splits: list[ChoiceReasoning] | None = (None if reasoning is None else
                                                        [reasoning.choice() for _ in extractors])
        self._whole_reasoning_tokens: int | None = None  # of the choices built by choice()

    @property
    def needs_token_ids(self) -> bool:
        """The whole response needs each choice's token ids (the reasoning split is by id)."""
        return self.reasoning is not None or self.return_token_ids

    @property
    def streams_token_ids(self) -> bool:
        """A delta of token ids without text still goes to ``delta_chunks`` (the reasoning
        split reads the ids: ``</think>`` may have no text)."""
        return self.splits is not None

    def reasoning_tokens(self) -> int:
        """Reasoning tokens streamed so far, over all choices (0 without a parser)."""
        return sum(sp.reasoning_tokens() for sp in self.splits or ())

    def _split_deltas(self, idx: int, text: str, token_ids, finish: str | None) -> list[dict]:
        """A choice's delta split by its reasoning parser: the reasoning delta, then the
        content's deltas from the extractor."""
        split, ext = self.splits[idx], self.extractors[idx]  # type: ignore[index] # called with a reasoning parser
        out: list[dict] = []
        pieces = [split.stream(text, token_ids)] + ([split.finish()] if finish is not None else [])
        for r, c in pieces:
            if r:
                out.append({"reasoning_content": r, "reasoning": r})
            if c:
                out += ext.stream(c)
        return out

    def first_chunks(self, num_choices: int) -> list[dict]:
        chunks = [self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                               "finish_reason": None}]) for i in range(num_choices)]
        if self.return_token_ids and chunks:  # vLLM: the prompt's ids with the first chunk
            chunks[0]["prompt_token_ids"] = self.prompt_token_ids[0]  # type: ignore[index] # set with return_token_ids
        if self.echo:
            chunks += [self.chunk([{"index": i, "delta": {"content": self.echo}, "logprobs": None,
                                    "finish_reason": None}]) for i in range(num_choices)]
        return chunks

    def delta_chunks(self, idx: int, ch: ChoiceState, text: str, token_ids, logprobs,
                     finish: str | None) -> list[dict]:
        lp = None
        if self.formatter is not None and token_ids:
            lp = self.formatter.chat_logprobs(token_ids, logprobs or [None] * len(token_ids))
        ext = self.extractors[idx]
        if self.splits is not None:
            deltas = self._split_deltas(idx, text, token_ids, finish) + (ext.finish() if finish is not None else [])
        else:
            deltas = ext.stream(text) + (ext.finish() if finish is not None else [])
            if not deltas and ext.plain:
                deltas = [{"content": text}]  # a token without text yet: vLLM's DeltaMessage(content="")
        if finish is not None:
            finish = ext.finish_reason(finish)
        # every delta but the last goes in a chunk of its own
        chunks = [self.chunk([{"index": idx, "delta": d, "logprobs": None, "finish_reason": None}])
                  for d in deltas[:-1]]
        ids = self.return_token_ids and len(token_ids) > 0
        if not deltas and finish is None and lp is None and not ids:
            return chunks  # held back (a tool call in progress)
        c = {"index": idx, "delta": deltas[-1] if deltas else {}, "logprobs": lp, "finish_reason": finish}
        if finish is not None:
            c["stop_reason"] = ch.stop_reason
        if self.return_token_ids:
            c["token_ids"] = list(token_ids)
        return chunks + [self.chunk([c])]

    def text_delta_template(self, idx: int) -> tuple[str, str] | None:
        return (self._template_of(idx) if self.formatter is None and self.extractors[idx].plain
                and not self.return_token_ids and self.splits is None else None)

    def choice(self, idx: int, ch: ChoiceState, token_ids: list, logprobs: list) -> dict:
        lp = self.formatter.chat_logprobs(token_ids, logprobs) if self.formatter is not None else None
        ext = self.extractors[idx]
        if self.splits is not None:
            reasoning, content = self.splits[idx].whole("".join(ch.text), token_ids)
            self._whole_reasoning_tokens = (self._whole_reasoning_tokens or 0) + \
                self.splits[idx].reasoning_tokens(token_ids)
            message = ext.message(content or "")
            if content is None and not message.get("tool_calls"):
                message["content"] = None
            message.update(reasoning_content=reasoning, reasoning=reasoning)
        else:
            message = ext.message("".join(ch.text))
        if self.echo:
            message["content"] = self.echo + (message.get("content") or "")
        c = {"index": idx, "message": message, "logprobs": lp,
             "finish_reason": ext.finish_reason(ch.finish_reason), "stop_reason": ch.stop_reason}
        if self.return_token_ids:
            c["token_ids"] = list(token_ids)
        return c

    def response(self, choices: list[dict], prompt_tokens: int, completion_tokens: int) -> dict:
        out = super().response(choices, prompt_tokens, completion_tokens)
        if self.splits is not None and self._whole_reasoning_tokens is not None:
            out["usage"]["completion_tokens_details"] = {"reasoning_tokens": self._whole_reasoning_tokens}
        if self.return_token_ids:  # vLLM: the prompt's ids at the top of a chat response
            out["prompt_token_ids"] = self.prompt_token_ids[0]  # type: ignore[index] # set with return_token_ids
        return out


# ---------------------------------------------------------------------------------------
# The endpoint


class OpenAIServingChat(OpenAIServing):
    """``/v1/chat/completions`` end to end (vLLM's ``OpenAIServingChat``): the request
    parsed, its rules run once and its prompt rendered (``chat_inputs``), its engine
    request made (``Processor.engine_request``) and queued through the front end's
    ``Session``; the answer is the ``chat.completion`` object, or the ``SSEStream`` of its
    chunks. ``chat_template``: the server's (``--chat-template``), else the tokenizer's;
    ``tool_call_parser`` / ``enable_auto_tool_choice``: ``--tool-call-parser`` /
    ``--enable-auto-tool-choice``; ``reasoning_parser``: the ``--reasoning-parser`` class
    (``reasoning.load_reasoning_parser``): each choice split into ``reasoning_content``
    and content. The C ABI's ``vllm_chat`` and the endpoints built on chat
    (``serving_responses``, ``anthropic.serving_messages``) use the same steps (``inputs``,
    ``engine_request``, ``driver``)."""

    def __init__(self, engine, models: OpenAIServingModels, *, chat_template: str | None = None,
                 tool_call_parser: str | None = None, enable_auto_tool_choice: bool = False,
                 reasoning_parser: type | None = None):
        super().__init__(engine, models)
        self.chat_template = chat_template
        self.tool_call_parser, self.enable_auto_tool_choice = tool_call_parser, enable_auto_tool_choice
        self.reasoning_parser = reasoning_parser

    def create_chat_completion(self, request: ChatCompletionRequest | str | bytes,
                               session: Session) -> dict | SSEStream:
        """Raises ``VLLMValidationError`` (a field refused), ``APIError`` (404: an
        unknown model) and what ``OpenAIServing.run`` raises."""
        return self.run(self.prepare(parse_request(ChatCompletionRequest, request), session.run_blocking), session)

    def prepare(self, req: ChatCompletionRequest, run: Callable = lambda fn: fn()) -> Prepared:
        model = self.check_model(req.model)
        inputs = self.inputs(req, run)
        response_id = "chatcmpl-" + (req.request_id or uuid.uuid4().hex)
        request = run(lambda: self.engine_request(inputs, self.engine_request_id(response_id)))
        driver = self.driver(req, inputs, response_id, model)
        return Prepared([request], driver, bool(req.stream))

    def inputs(self, req: ChatCompletionRequest, run: Callable = lambda fn: fn(),
               stream: bool | None = None) -> ChatInputs:
        """Every rule of the request and its rendered prompt (``chat_inputs``)."""
        return chat_inputs(self.processor, req, chat_template=self.chat_template,
                           tool_call_parser=self.tool_call_parser, enable_auto_tool_choice=self.enable_auto_tool_choice,
                           stream=stream, run=run, reasoning_parser=self.reasoning_parser)

    def engine_request(self, inputs: ChatInputs, request_id: str) -> ProcessedRequest:
        """The engine request of checked inputs (``Processor.engine_request``). Raises
        VLLMValidationError naming the field the client sent (``inputs.field_names``)."""
        try:
            return self.processor.engine_request(request_id, inputs.text, inputs.prompt_token_ids,
                                                 inputs.sampling_params, inputs.priority, inputs.cache_salt)
        except VLLMValidationError as e:
            if inputs.field_names is None:
                raise
            raise e.renamed(inputs.field_names) from None

    def driver(self, req: ChatCompletionRequest, inputs: ChatInputs, response_id: str, model: str, *,
               include_usage: bool | None = None, continuous_usage: bool | None = None,
               token_only_chunks: bool = True) -> DeltaDriver:
        """The response driver of one request (``include_usage`` / ``continuous_usage``:
        None takes the request's ``stream_options``)."""
        formatter = (LogprobsFormatter(self.tokenizer, inputs.num_top_logprobs, bool(req.return_tokens_as_token_ids))
                     if req.logprobs else None)
        n = inputs.sampling_params.n
        extractors = [make_extractor(inputs.tool_mode, self.tool_call_parser, self.tokenizer) for _ in range(n)]
        builder = ChatResponseBuilder(response_id, model, int(time.time()), formatter, extractors, inputs.echo,
                                      inputs.prompt_token_ids if req.return_token_ids else None, inputs.reasoning)
        so = req.stream_options
        if include_usage is None:
            include_usage = bool(so and so.include_usage)
        if continuous_usage is None:
            continuous_usage = bool(so and so.continuous_usage_stats)
        return DeltaDriver(builder, 1, n, len(inputs.prompt_token_ids), include_usage=include_usage,
                           continuous_usage=continuous_usage, token_only_chunks=token_only_chunks)
