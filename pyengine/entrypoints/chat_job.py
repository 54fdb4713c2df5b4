"""One chat request made ready for the engine, for the endpoints built on chat
(``/v1/responses``, ``/v1/messages``): ``prepare_chat(chat, ChatCompletionRequest)`` ->
``ChatJob`` (the engine inputs by the chat endpoint's own rules, ``OpenAIServingChat.inputs``,
its engine request, and the ``DeltaDriver`` over the ``ChatResponseBuilder`` whose chunks
and response these endpoints translate, ``ChatView``). The request then runs as a chat
completion does (``OpenAIServing.run(prepared, session, view)``). Mirrors how vLLM's
Responses and Anthropic serving objects reuse ``OpenAIServingChat``."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from pyengine.entrypoints.openai.protocol import ChatCompletionRequest
from pyengine.entrypoints.openai.serving_chat import ChatInputs, ChatResponseBuilder, OpenAIServingChat
from pyengine.entrypoints.openai.serving_engine import Chunk, DeltaDriver, Prepared
from pyengine.exceptions import VLLMValidationError


class ChatView(Protocol):
    """An endpoint built on chat, as ``OpenAIServing.run`` frames its answer: the whole
    ``response(chat_completion)``, or the stream's events of the chat chunks
    (``sse_events``), of a failure once streaming began (``sse_error``), and the last
    event (``sse_done``; empty: none)."""

    sse_done: str

    def response(self, chat_completion: dict) -> dict:
        ...

    def sse_events(self, chunks: Iterable[Chunk]) -> Iterator[str]:
        ...

    def sse_error(self, status: int, message: str) -> str:
        ...


@dataclass
class ChatJob:
    """``request``'s engine inputs and response driver (one choice, no logprobs; usage
    at the end of a stream), by the chat endpoint's serving object ``chat``; ``names``:
    the endpoint's names of the chat fields (``prepare_chat``)."""
    chat: OpenAIServingChat
    request: ChatCompletionRequest
    inputs: ChatInputs
    driver: DeltaDriver
    response_id: str
    names: Mapping[str, str] = field(default_factory=dict)

    @property
    def builder(self) -> ChatResponseBuilder:
        return self.driver.builder  # type: ignore[return-value]

    @property
    def prompt_tokens(self) -> int:
        return len(self.inputs.prompt_token_ids)

    def prepared(self, stream: bool, run: Callable = lambda fn: fn()) -> Prepared:
        """What ``OpenAIServing.run`` queues and drives: the engine request made
        (``Processor.engine_request``; raises VLLMValidationError as the chat endpoint does,
        naming the endpoint's field)."""
        chat = self.chat
        try:
            request = run(lambda: chat.engine_request(self.inputs, chat.engine_request_id(self.response_id)))
        except VLLMValidationError as e:
            raise e.renamed(self.names) from None
        return Prepared([request], self.driver, stream)


def prepare_chat(chat: OpenAIServingChat, req: ChatCompletionRequest, *, model: str, response_id: str,
                 run: Callable = lambda fn: fn(), names: Mapping[str, str] | None = None) -> ChatJob:
    """``req`` (built by an endpoint's conversion) as the chat endpoint would serve it
    (``chat``: its serving object, with the server's template, tool and reasoning
    parsers). Raises VLLMValidationError naming the endpoint's field (``names``: chat
    field -> the endpoint's, ``VLLMValidationError.renamed``), here and in
    ``ChatJob.prepared``."""
    names = names or {}
    try:
        inputs = chat.inputs(req, run)
    except VLLMValidationError as e:
        raise e.renamed(names) from None
    driver = chat.driver(req, inputs, response_id, model, include_usage=True, continuous_usage=False)
    return ChatJob(chat, req, inputs, driver, response_id, names)
