"""OpenAI chat request -> (prompt token ids, SamplingParams, priority, flags) for the C ABI.

A small schema of our own (front ends do not import ``server``). The response JSON is
written on the C side (capi/vengine_capi.c), off the engine threads.
"""
from __future__ import annotations

import json
from typing import Any

from pyengine.entrypoints.structured_outputs import structured_outputs_from_request
from pyengine.exceptions import VLLMValidationError

# Fields of an OpenAI chat request for features vengine does not have: refused, never
# ignored. (name -> value that means "not used")
_REFUSED = {
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none"),
    "function_call": (None, "none"),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "logit_bias": (None, {}),
    "audio": (None,),
    "prediction": (None,),
}
# Keys of chat_template_kwargs that would replace what the renderer supplies.
_RESERVED_TEMPLATE_KWARGS = ("messages", "conversation", "tools", "chat_template", "tokenize")


class ChatRequestError(ValueError):
    """A malformed or unsupported chat request (-> VLLM_ERR_INVALID_ARGUMENT)."""


def _content_text(content: Any, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ChatRequestError(f"messages[{i}].content: only text parts are supported, got {kind!r}")
            parts.append(part["text"])
        return "".join(parts)
    raise ChatRequestError(f"messages[{i}].content must be a string or a list of text parts")


def parse_chat_request(raw: str, processor, sampling_params_cls, output_kind):
    """Returns ``(prompt_token_ids, sampling_params, priority, flags)``; flags bit 0:
    ``stream_options.include_usage``. ``processor``: the engine's input processing
    (``AsyncLLM.processor``), whose tokenizer renders and encodes the chat and whose
    cheap character bound refuses an over-long rendering before it is tokenized. Raises
    ``ChatRequestError``, or the engine's ``ValueError`` unchanged (its message is the one
    every front end gives)."""
    tokenizer = processor.tokenizer
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise ChatRequestError(f"request_json is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ChatRequestError("request_json must be a JSON object")
    for name, unused in _REFUSED.items():
        if name in body and body[name] not in unused:
            if name in ("tools", "functions", "tool_choice", "function_call"):
                raise ChatRequestError(f"request field {name!r} is not supported by vllm_chat: tool calling is "
                                       "served over HTTP (vengine serve --enable-auto-tool-choice "
                                       "--tool-call-parser hermes)")
            raise ChatRequestError(f"request field {name!r} is not supported by vengine")
    n = body.get("n", 1)
    if n not in (None, 1):
        raise ChatRequestError(f"n must be 1, got {n!r}")

    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ChatRequestError("'messages' must be a non-empty list")
    msgs = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ChatRequestError(f"messages[{i}] must be an object with a string 'role'")
        if m.get("tool_calls"):
            raise ChatRequestError(f"messages[{i}].tool_calls is not supported by vengine")
        msgs.append({"role": m["role"], "content": _content_text(m.get("content"), i)})

    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ChatRequestError("chat_template_kwargs must be an object")
    for k in _RESERVED_TEMPLATE_KWARGS:
        if k in kwargs:
            raise ChatRequestError(f"chat_template_kwargs may not set {k!r}")
    add_gen = body.get("add_generation_prompt", True)
    if getattr(tokenizer, "chat_template", None):
        try:
            text = tokenizer.apply_chat_template(msgs, add_generation_prompt=bool(add_gen),
                                                 tokenize=False, **kwargs)
        except Exception as e:  # template errors (raise_exception, bad kwargs, ...)
            raise ChatRequestError(f"chat template failed: {e}") from None
    else:  # no template: a plain "<role>: <content>" join
        text = "".join(f"{m['role']}: {m['content']}\n" for m in msgs) + ("assistant:" if add_gen else "")
        if getattr(tokenizer, "bos_token", None):
            text = tokenizer.bos_token + text
    prompt_ids = processor.encode_prompt(text, add_special_tokens=False, parameter="messages")
    if not prompt_ids:
        raise ChatRequestError("the rendered chat prompt is empty")

    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    stop = body.get("stop")
    try:  # response_format, structured_outputs, guided_*: the HTTP server's rules
        structured = structured_outputs_from_request(body)
    except VLLMValidationError as e:
        raise ChatRequestError(str(e)) from None
    sp_kwargs = dict(output_kind=output_kind, max_tokens=max_tokens, stop=stop, structured_outputs=structured)
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "ignore_eos", "min_tokens",
                 "stop_token_ids", "skip_special_tokens", "include_stop_str_in_output"):
        if body.get(name) is not None:
            sp_kwargs[name] = body[name]
    try:
        params = sampling_params_cls(**sp_kwargs)
    except ValueError:
        raise  # the engine's own message, unprefixed (as HTTP and Python get it)
    except TypeError as e:
        raise ChatRequestError(str(e)) from None
    priority = body.get("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ChatRequestError(f"priority must be an integer, got {priority!r}")
    flags = 0
    so = body.get("stream_options")
    if isinstance(so, dict) and so.get("include_usage"):
        flags |= 1
    return prompt_ids, params, priority, flags
