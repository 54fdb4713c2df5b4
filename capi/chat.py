"""OpenAI chat request JSON -> (prompt token ids, SamplingParams, priority, flags) for the
C ABI's ``vllm_chat`` / ``vllm_chat_stream``, through the OpenAI protocol layer the HTTP
server uses (``pyengine.entrypoints.openai``): the same schema, chat rendering and rules,
so the same bad request gets the same message. What ``vllm_chat`` cannot serve (tool
calling, logprobs, several choices) is refused, never ignored.

The response JSON comes from the same layer (``OpenAIServingChat.driver``, see capi/_impl.py);
the C side passes it on.
"""
from __future__ import annotations

from typing import NamedTuple

from pyengine.entrypoints.openai.protocol import ChatCompletionRequest
from pyengine.entrypoints.openai.serving_chat import ChatInputs, chat_inputs
from pyengine.entrypoints.openai.serving_engine import parse_request

# Chat request fields vllm_chat cannot honour (its response has one choice and no logprobs
# or tool calls): name -> values that mean "not used".
_REFUSED = {"tools": (None, []), "functions": (None, []), "tool_choice": (None, "none"),
            "function_call": (None, "none"), "logprobs": (None, False), "top_logprobs": (None, 0),
            "return_token_ids": (None, False)}
_TOOL_FIELDS = ("tools", "functions", "tool_choice", "function_call")
_UNKNOWN_REFUSED = ("audio", "prediction")


class ChatRequestError(ValueError):
    """A request ``vllm_chat`` cannot serve (-> VLLM_ERR_INVALID_ARGUMENT)."""


def _refuse_unsupported(req: ChatCompletionRequest, only: tuple[str, ...] | None = None) -> None:
    for name, unused in _REFUSED.items():
        if only is not None and name not in only:
            continue
        if getattr(req, name) not in unused:
            if name in _TOOL_FIELDS:
                raise ChatRequestError(f"request field {name!r} is not supported by vllm_chat: tool calling is "
                                       "served over HTTP (vengine serve --enable-auto-tool-choice "
                                       "--tool-call-parser hermes)")
            raise ChatRequestError(f"request field {name!r} is not supported by vllm_chat")
    if only is not None:
        return
    for name in _UNKNOWN_REFUSED:
        if (req.model_extra or {}).get(name) is not None:
            raise ChatRequestError(f"request field {name!r} is not supported by vengine")
    if any(m.tool_calls for m in req.messages):
        i = next(i for i, m in enumerate(req.messages) if m.tool_calls)
        raise ChatRequestError(f"messages[{i}].tool_calls is not supported by vllm_chat")


class ParsedChat(NamedTuple):
    prompt_token_ids: list
    sampling_params: object  # SamplingParams
    priority: int
    flags: int  # bit 0: stream_options.include_usage
    echo: str | None  # what the message starts with (echo, serving_chat.chat_echo)
    request_id: str | None  # the client's request_id (the response's "chatcmpl-<id>")
    cache_salt: str | None  # the prefix-cache salt
    request: ChatCompletionRequest  # the parsed request
    inputs: ChatInputs  # its checked inputs (the engine request and response driver are made of them; .reasoning: the split)


def parse_chat_request(raw: str, processor, output_kind, reasoning_parser: type | None = None) -> ParsedChat:
    """The request as ``vllm_chat`` serves it. ``processor``: the engine's input
    processing (``AsyncLLM.processor``); ``reasoning_parser``: the class
    ``vllm_model_params.reasoning_parser`` names (the response then carries
    ``reasoning_content``, and structured outputs apply after the reasoning). Raises the protocol layer's
    ``VLLMValidationError`` (the message every front end gives) or ``ChatRequestError``
    (what only vllm_chat refuses)."""
    req = parse_request(ChatCompletionRequest, raw)
    # Tools first: HTTP's message for tools without tool_choice names server flags
    # (--enable-auto-tool-choice) a C host cannot set.
    _refuse_unsupported(req, only=("tools", "functions"))
    # The engine's and the protocol's rules (the messages HTTP gives), then what only this
    # front end cannot serve.
    inputs = chat_inputs(processor, req, output_kind=output_kind, stream=True,  # the function decides
                         reasoning_parser=reasoning_parser)
    _refuse_unsupported(req)
    if inputs.sampling_params.n != 1:
        raise ChatRequestError(f"n must be 1 for vllm_chat (one choice per response), got {inputs.sampling_params.n}")
    so = req.stream_options
    flags = 1 if so is not None and so.include_usage else 0
    return ParsedChat(inputs.prompt_token_ids, inputs.sampling_params, inputs.priority, flags, inputs.echo,
                      req.request_id, inputs.cache_salt, req, inputs)
