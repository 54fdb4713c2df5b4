"""``POST /v1/messages`` and ``/v1/messages/count_tokens`` (mirrors
vllm/entrypoints/anthropic/serving.py): the request parsed and checked
(``anthropic.protocol``), mapped onto a chat request
(``messages_utils.messages_to_chat_request``) that goes through the chat endpoint's
rules, template and engine ``Processor`` (``chat_job.prepare_chat``), and the chat
builder's result or chunks translated back: the ``Message``, or Anthropic's event stream
(``messages_utils.MessagesStreamState``) as SSE text.

As for ``serving_responses``: ``ServingMessages.create_message(body, session)`` parses,
checks the model, ``prepare``s a ``MessagesJob`` (``chat`` to run; ``response`` /
``sse_events`` / ``sse_error``; no ``[DONE]``) and runs it as the chat endpoint does
(``OpenAIServing.run`` with the job as its view); ``count_tokens(body, run=...)`` ->
``{"input_tokens": N}``. Errors are to be answered with ``error_body`` (Anthropic's)."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from pyengine.entrypoints.anthropic.messages_utils import (
    ANTHROPIC_PARAMS,
    MessagesStreamState,
    chat_to_message,
    messages_to_chat_request,
    random_id,
    sse,
)
from pyengine.entrypoints.anthropic.protocol import (
    CountTokensRequest,
    MessagesRequest,
    check_messages_request,
    count_tokens_response,
    error_body,
)
from pyengine.entrypoints.chat_job import ChatJob, prepare_chat
from pyengine.entrypoints.openai.serving_chat import OpenAIServingChat
from pyengine.entrypoints.openai.serving_engine import Session, SSEStream, parse_request
from pyengine.entrypoints.openai.serving_responses import chat_request_of, chunk_dict

__all__ = ["ServingMessages", "MessagesJob", "error_body"]


class MessagesJob:
    """One ``/v1/messages`` request made ready: ``chat`` (the engine inputs and the chat
    builder) and the translation of its result."""

    sse_done = ""

    def __init__(self, req: MessagesRequest, chat: ChatJob, model: str, message_id: str):
        self.req, self.chat, self.model, self.id = req, chat, model, message_id

    @property
    def stream(self) -> bool:
        return bool(self.req.stream)

    def response(self, chat_completion: dict) -> dict:
        """The ``Message`` of the finished chat result."""
        return chat_to_message(self.req, chat_completion, message_id=self.id)

    def sse_events(self, chunks: Iterable) -> Iterator[str]:
        """The SSE stream of ``chunks`` (the chat builder's stream chunks, ending with the
        usage chunk): ``message_start`` … ``message_stop``."""
        st = MessagesStreamState(self.req, self.model, self.chat.prompt_tokens, message_id=self.id)
        for ev in st.start():
            yield sse(ev)
        finish, stop_reason, completion_tokens = None, None, 0
        for chunk in chunks:
            chunk = chunk_dict(chunk)
            for c in chunk.get("choices") or ():
                for ev in st.chat_delta(c.get("delta") or {}):
                    yield sse(ev)
                if c.get("finish_reason"):
                    finish, stop_reason = c["finish_reason"], c.get("stop_reason")
            if chunk.get("usage"):
                completion_tokens = chunk["usage"]["completion_tokens"]
        for ev in st.finish(finish, completion_tokens, stop_reason,
                            reasoning_tokens=self.chat.builder.reasoning_tokens()):
            yield sse(ev)

    @staticmethod
    def sse_error(status: int, message: str) -> str:
        """Anthropic's ``error`` event of a failure after the stream began."""
        return sse(error_body(status, message))


class ServingMessages:
    """The ``/v1/messages`` endpoints over the server's chat serving object ``chat``."""

    def __init__(self, chat: OpenAIServingChat):
        self.chat = chat

    def create_message(self, raw, session: Session) -> dict | SSEStream:
        """The ``Message``, or the ``SSEStream`` of its events. Raises
        ``VLLMValidationError``, ``APIError`` (404: an unknown model) and what
        ``OpenAIServing.run`` raises."""
        req = self.parse(raw)
        job = self.prepare(req, model=self.chat.check_model(req.model), run=session.run_blocking)
        return self.chat.run(job.chat.prepared(job.stream, session.run_blocking), session, job)

    @staticmethod
    def parse(raw, schema=MessagesRequest):
        """The JSON body as a checked ``MessagesRequest`` (or ``CountTokensRequest``):
        unknown and unsupported fields refused. Raises VLLMValidationError."""
        req = parse_request(schema, raw)
        check_messages_request(req)
        return req

    def _chat(self, req, model: str, message_id: str, run: Callable) -> ChatJob:
        creq = chat_request_of(messages_to_chat_request(req), ANTHROPIC_PARAMS)
        return prepare_chat(self.chat, creq, model=model, response_id=message_id, run=run, names=ANTHROPIC_PARAMS)

    def prepare(self, req: MessagesRequest, *, model: str, run: Callable = lambda fn: fn()) -> MessagesJob:
        """The engine inputs of ``req`` by the chat endpoint's rules. Raises
        VLLMValidationError naming the Messages field."""
        message_id = "msg_" + (req.request_id or random_id()[4:])
        return MessagesJob(req, self._chat(req, model, message_id, run), model, message_id)

    def count_tokens(self, raw, *, run: Callable = lambda fn: fn()) -> dict:
        """``/v1/messages/count_tokens``: the prompt's token count as ``/v1/messages``
        would render it. Raises VLLMValidationError, ``APIError`` (404: an unknown model)."""
        req = self.parse(raw, CountTokensRequest)
        model = self.chat.check_model(req.model)
        return count_tokens_response(self._chat(req, model, random_id(), run).prompt_tokens)
