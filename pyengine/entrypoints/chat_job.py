"""One chat request made ready for the engine, for the endpoints built on chat
(``/v1/responses``, ``/v1/messages``): ``ChatSettings`` (what the server was started with)
and ``prepare_chat(settings, ChatCompletionRequest)`` -> ``ChatJob`` (the engine inputs by
``serving_chat.chat_inputs``, the chat endpoint's own rules and the engine's ``Processor``,
and the ``ChatResponseBuilder`` whose chunks and response these endpoints translate).
Mirrors how vLLM's Responses and Anthropic serving objects reuse ``OpenAIServingChat``."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

from pyengine.entrypoints.openai.protocol import ChatCompletionRequest
from pyengine.entrypoints.openai.serving_chat import ChatInputs, ChatResponseBuilder, chat_inputs, make_extractor
from pyengine.sampling_params import RequestOutputKind


@dataclass
class ChatSettings:
    """The server's chat settings: the engine's ``processor``, ``--chat-template`` text,
    ``--tool-call-parser``, ``--enable-auto-tool-choice`` and the ``--reasoning-parser``
    class (``reasoning.load_reasoning_parser``)."""
    processor: object
    chat_template: Optional[str] = None
    tool_call_parser: Optional[str] = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: Optional[type] = None


@dataclass
class ChatJob:
    """``request``'s engine inputs and response builder (one choice, no logprobs)."""
    request: ChatCompletionRequest
    inputs: ChatInputs
    builder: ChatResponseBuilder

    @property
    def prompts(self) -> list[tuple[Optional[str], list[int]]]:
        return [(self.inputs.text, self.inputs.prompt_token_ids)]

    @property
    def prompt_tokens(self) -> int:
        return len(self.inputs.prompt_token_ids)


def prepare_chat(settings: ChatSettings, req: ChatCompletionRequest, *, model: str, response_id: str,
                 run: Callable = lambda fn: fn(), output_kind: RequestOutputKind = RequestOutputKind.DELTA
                 ) -> ChatJob:
    """``req`` (built by an endpoint's conversion) as the chat endpoint would serve it.
    Raises VLLMValidationError naming the chat field (the caller renames it)."""
    inputs = chat_inputs(settings.processor, req, chat_template=settings.chat_template,
                         tool_call_parser=settings.tool_call_parser,
                         enable_auto_tool_choice=settings.enable_auto_tool_choice, output_kind=output_kind,
                         run=run, reasoning_parser=settings.reasoning_parser)
    tok = settings.processor.tokenizer
    extractors = [make_extractor(inputs.tool_mode, settings.tool_call_parser, tok)
                  for _ in range(inputs.sampling_params.n)]
    builder = ChatResponseBuilder(response_id, model, int(time.time()), None, extractors, inputs.echo,
                                  reasoning=inputs.reasoning)
    return ChatJob(req, inputs, builder)
