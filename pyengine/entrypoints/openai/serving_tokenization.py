"""``/tokenize`` and ``/detokenize`` (mirrors vllm/entrypoints/openai/serving_tokenization.py
and vLLM's request / response shapes).

``/tokenize`` takes a ``prompt`` (encoded with the tokenizer's special tokens unless
``add_special_tokens`` is false) or chat ``messages`` (rendered with the chat template, as
``pyengine.chat_utils`` renders for ``LLM.chat``: refused when there is no template;
special tokens not added again unless ``add_special_tokens``), and answers
``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs`` with
``return_token_strs``). ``/detokenize`` takes ``tokens`` and answers ``{"prompt"}``; ids
outside the vocabulary are a 400. Both check ``model`` like the generation endpoints.
"""
from __future__ import annotations

import json
from collections.abc import Callable

from pydantic import ConfigDict, Field

from pyengine.chat_utils import apply_hf_chat_template, parse_chat_messages
from pyengine.entrypoints.openai.protocol import ChatMessage, Schema
from pyengine.entrypoints.openai.serving_engine import parse_request
from pyengine.entrypoints.openai.serving_models import OpenAIServingModels
from pyengine.exceptions import VLLMValidationError


class _Request(Schema):
    # unknown fields are logged as ignored, as on the generation endpoints
    model_config = ConfigDict(strict=True, extra="allow")


class TokenizeCompletionRequest(_Request):
    model: str | None = None
    prompt: str
    add_special_tokens: bool | None = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Request):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    add_special_tokens: bool | None = False  # the template has them
    return_token_strs: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None
    tools: list[dict] | None = None


class TokenizeRequest:
    """Either schema, chosen by whether the body has ``messages`` (so a validation error
    names the fields of the one the client meant)."""

    @staticmethod
    def model_validate_json(body: bytes):
        try:
            obj = json.loads(body)
        except ValueError:
            obj = None  # the schema's own parse reports the bad JSON
        schema = TokenizeChatRequest if isinstance(obj, dict) and "messages" in obj else TokenizeCompletionRequest
        return schema.model_validate_json(body)


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class OpenAIServingTokenization:
    """``/tokenize`` and ``/detokenize`` end to end: parsed, ``model`` checked, the text
    rendered (chat messages) and encoded through ``run`` (a front end's way to run
    blocking work; the HTTP server: off its event loop), the answer object.
    ``chat_template``: the server's (``--chat-template``)."""

    def __init__(self, engine, models: OpenAIServingModels, chat_template: str | None = None):
        self.processor, self.tokenizer = engine.processor, engine.tokenizer
        self.models, self.chat_template = models, chat_template

    def create_tokenize(self, request: TokenizeCompletionRequest | TokenizeChatRequest | str | bytes,
                        run: Callable = lambda fn: fn()) -> dict:
        """``{"count", "max_model_len", "tokens", "token_strs"}``. Raises
        ``VLLMValidationError`` and ``APIError`` (404: an unknown model)."""
        req = parse_request(TokenizeRequest, request) if isinstance(request, (str, bytes)) else request
        self.models.check_model(req.model)
        if isinstance(req, TokenizeChatRequest):
            try:
                text = run(lambda: self._chat_text(req))  # off the hub, as the tokenizer
            except ValueError as e:
                raise VLLMValidationError(str(e), parameter="messages") from None
        else:
            text = req.prompt
        # no length bound here (the count is the answer, as vLLM's), but never on the hub
        encode, special = self.processor.encode, bool(req.add_special_tokens)
        ids = run(lambda: encode(text, special))
        return {"count": len(ids), "max_model_len": self.models.max_model_len, "tokens": ids,
                "token_strs": self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None}

    def create_detokenize(self, request: DetokenizeRequest | str | bytes) -> dict:
        """``{"prompt"}``. Raises ``VLLMValidationError`` (ids outside the vocabulary) and
        ``APIError`` (404: an unknown model)."""
        req = parse_request(DetokenizeRequest, request)
        self.models.check_model(req.model)
        self.processor.check_token_ids(req.tokens, "tokens")
        return {"prompt": self.tokenizer.decode(req.tokens)}

    def _chat_text(self, req: TokenizeChatRequest) -> str:
        """These messages rendered by the chat template (the request's, else the server's
        --chat-template, else the tokenizer's), as ``LLM.chat`` renders them. Raises
        ValueError (no template, bad messages, template error)."""
        conversation = parse_chat_messages([m.model_dump(exclude_none=True) for m in req.messages])
        return apply_hf_chat_template(
            self.tokenizer, conversation, req.chat_template or self.chat_template,
            add_generation_prompt=bool(req.add_generation_prompt),
            continue_final_message=bool(req.continue_final_message), tools=req.tools,
            chat_template_kwargs=req.chat_template_kwargs)
