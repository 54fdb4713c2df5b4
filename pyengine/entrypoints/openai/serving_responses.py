"""``POST /v1/responses`` (mirrors vllm/entrypoints/openai/serving_responses.py, its simple
non-harmony path): the request parsed and checked (``protocol_responses``), mapped onto a
chat request (``responses_utils.responses_to_chat_request``) that goes through the chat
endpoint's rules, template and engine ``Processor`` (``chat_job.prepare_chat``), and the
chat builder's result or chunks translated back: the ``Response`` object, or the typed
event stream (``responses_utils.ResponsesStreamState``) as SSE text.

``ServingResponses.create_response(body, session)`` does it end to end as the chat
endpoint does (``OpenAIServingChat``'s steps, run by ``OpenAIServing.run``): parse, model
check, ``prepare`` -> a ``ResponsesJob`` (its ``chat``: the engine inputs and the chat
driver, with usage at the end of a stream), the engine request, then the job as the run's
view (``chat_job.ChatView``): ``job.response(chat_completion)`` or
``job.sse_events(chat_chunks)`` (``sse_error`` for a failure once streaming began;
``sse_done`` is empty: this stream has no ``[DONE]``)."""
from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator, Mapping

from pydantic import ValidationError

from pyengine.entrypoints.chat_job import ChatJob, prepare_chat
from pyengine.entrypoints.openai.protocol import ChatCompletionRequest
from pyengine.entrypoints.openai.protocol_responses import ResponsesRequest, check_responses_request, error_event, random_id
from pyengine.entrypoints.openai.responses_utils import (
    RESPONSES_PARAMS,
    ResponsesStreamState,
    chat_to_response,
    responses_to_chat_request,
    sse,
)
from pyengine.entrypoints.openai.serving_chat import OpenAIServingChat
from pyengine.entrypoints.openai.serving_engine import Session, SSEStream, parse_request, validation_error


def chat_request_of(body: dict, names: Mapping[str, str]) -> ChatCompletionRequest:
    """A converted body as a ``ChatCompletionRequest``; a refusal names the endpoint's
    own field (``names``: chat field -> the endpoint's, ``VLLMValidationError.renamed``)."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise validation_error(e).renamed(names) from None


def chunk_dict(chunk) -> dict:
    """A chat chunk as the chat builder gives it: a dict, or its JSON text (the fast path)."""
    return json.loads(chunk) if type(chunk) is str else chunk


class ResponsesJob:
    """One ``/v1/responses`` request made ready: ``chat`` (the engine inputs and the chat
    builder) and the translation of its result."""

    sse_done = ""

    def __init__(self, req: ResponsesRequest, chat: ChatJob, model: str, response_id: str):
        self.req, self.chat, self.model, self.id = req, chat, model, response_id
        self.created_at = time.time()

    @property
    def stream(self) -> bool:
        return bool(self.req.stream)

    def response(self, chat_completion: dict) -> dict:
        """The ``Response`` of the finished chat result (``chat.builder``'s response)."""
        return chat_to_response(self.req, chat_completion, response_id=self.id, created_at=self.created_at)

    def sse_events(self, chunks: Iterable) -> Iterator[str]:
        """The SSE stream of ``chunks`` (the chat builder's stream chunks, ending with the
        usage chunk): ``response.created`` … ``response.completed``."""
        st = ResponsesStreamState(self.req, self.model, self.chat.prompt_tokens, response_id=self.id,
                                  created_at=self.created_at)
        for ev in st.start():
            yield sse(ev)
        finish, completion_tokens = None, 0
        for chunk in chunks:
            chunk = chunk_dict(chunk)
            for c in chunk.get("choices") or ():
                for ev in st.chat_delta(c.get("delta") or {}):
                    yield sse(ev)
                finish = c.get("finish_reason") or finish
            if chunk.get("usage"):
                completion_tokens = chunk["usage"]["completion_tokens"]
        for ev in st.finish(finish, completion_tokens, reasoning_tokens=self.chat.builder.reasoning_tokens()):
            yield sse(ev)

    def sse_error(self, status: int, message: str) -> str:
        """The ``error`` event of a failure after the stream began."""
        ev = dict(error_event(message, code=str(status)), sequence_number=0)
        return sse(ev)


class ServingResponses:
    """The ``/v1/responses`` endpoint over the server's chat serving object ``chat``."""

    request_schema = ResponsesRequest

    def __init__(self, chat: OpenAIServingChat):
        self.chat = chat

    def create_response(self, raw, session: Session) -> dict | SSEStream:
        """The ``Response`` object, or the ``SSEStream`` of its events. Raises
        ``VLLMValidationError`` (a field refused), ``APIError`` (404: an unknown model) and
        what ``OpenAIServing.run`` raises."""
        req = self.parse(raw)
        job = self.prepare(req, model=self.chat.check_model(req.model), run=session.run_blocking)
        return self.chat.run(job.chat.prepared(job.stream, session.run_blocking), session, job)

    @staticmethod
    def parse(raw) -> ResponsesRequest:
        """The JSON body (``str`` / ``bytes``) as a checked ``ResponsesRequest``: unknown
        and unsupported fields (``store``, ``previous_response_id``, hosted tools, ...)
        refused. Raises VLLMValidationError."""
        req = parse_request(ResponsesRequest, raw)
        check_responses_request(req)
        return req

    def prepare(self, req: ResponsesRequest, *, model: str, run: Callable = lambda fn: fn()) -> ResponsesJob:
        """The engine inputs of ``req`` by the chat endpoint's rules. Raises
        VLLMValidationError naming the Responses field."""
        response_id = "resp_" + (req.request_id or random_id("resp")[5:])
        creq = chat_request_of(responses_to_chat_request(req), RESPONSES_PARAMS)
        chat = prepare_chat(self.chat, creq, model=model, response_id=response_id, run=run, names=RESPONSES_PARAMS)
        return ResponsesJob(req, chat, model, response_id)
