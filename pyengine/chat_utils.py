"""Chat rendering with the tokenizer's chat template (mirrors vllm/entrypoints/chat_utils.py):
OpenAI-style messages -> the prompt text a chat model was trained on.

As vLLM does, a tokenizer without a chat template is refused unless a template is given:
there is no generic fallback format (a guessed one silently degrades the model's answers).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def parse_chat_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """One conversation (OpenAI-style messages: dicts with ``role`` and ``content``, the
    content a string, ``None``, or a list of ``{"type": "text", "text": ...}`` parts) ->
    the message dicts a chat template renders, text parts joined with ``"\\n"`` (vLLM's
    "string" content format). Other keys (``name``, ``tool_calls``, ...) pass through.

    Raises ValueError for an empty conversation, a message without a string ``role``,
    or a content part that is not text."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("A conversation must be a non-empty list of messages ({'role': ..., 'content': ...}).")
    conversation = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise ValueError(f"Message {i} must be a dict with a string 'role', got {msg!r}.")
        content = msg.get("content")
        if isinstance(content, (list, tuple)):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(f"Message {i}: only text content parts ({{'type': 'text', 'text': ...}}) are "
                                     f"supported, got {part!r}.")
                texts.append(part["text"])
            msg = {**msg, "content": "\n".join(texts)}
        elif content is not None and not isinstance(content, str):
            raise ValueError(f"Message {i}: content must be a string, a list of text parts or None, "
                             f"got {type(content).__name__}.")
        conversation.append(dict(msg))
    return conversation


def resolve_chat_template(tokenizer, chat_template: str | None) -> str:
    """``chat_template`` (a Jinja template string) when given, else the tokenizer's.
    Raises ValueError when there is neither."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("The tokenizer has no chat template and none was given: pass a chat template "
                         "(LLM.chat(..., chat_template=...), vengine serve --chat-template), or use the "
                         "completions API with a prompt you format yourself.")
    return template


def apply_hf_chat_template(tokenizer, conversation: list[dict[str, Any]], chat_template: str | None = None, *,
                           add_generation_prompt: bool = True, continue_final_message: bool = False,
                           tools: list[dict[str, Any]] | None = None,
                           chat_template_kwargs: dict[str, Any] | None = None) -> str:
    """Render ``conversation`` (from ``parse_chat_messages``) with transformers'
    ``apply_chat_template``. ``add_generation_prompt``: open the assistant's turn;
    ``continue_final_message``: leave the last message open, for the model to continue
    (the two exclude each other); ``tools`` and ``chat_template_kwargs`` go to the
    template. Returns the prompt text; its special tokens are in it, so encode it with
    ``add_special_tokens=False``.

    Raises ValueError: no template, both flags, or the template failed on this input."""
    if add_generation_prompt and continue_final_message:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true: set "
                         "add_generation_prompt=False to continue the final message.")
    template = resolve_chat_template(tokenizer, chat_template)
    kwargs = dict(chat_template_kwargs or {})
    for reserved in ("conversation", "tokenize", "chat_template"):
        if reserved in kwargs:
            raise ValueError(f"chat_template_kwargs may not set {reserved!r}.")
    if tools is not None:
        kwargs["tools"] = tools
    try:
        text = tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, **kwargs)
    except Exception as e:  # noqa: BLE001 - a template that fails on this input is the input's problem
        raise ValueError(f"Cannot apply the chat template: {type(e).__name__}: {e}") from e
    return text if isinstance(text, str) else str(text)
