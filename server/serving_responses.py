"""``POST /v1/responses`` (the HTTP half of vllm/entrypoints/openai/serving_responses.py):
the request, its rules, engine inputs, ``Response`` object and event stream come from
``pyengine.entrypoints.openai.serving_responses`` (built on the chat endpoint's)."""
from __future__ import annotations

from flask import Flask, request

from pyengine.entrypoints.chat_job import ChatSettings
from pyengine.entrypoints.openai.serving_responses import ServingResponses

from .generation import GenerationJob, run_job
from .http import APIError


def chat_settings(st) -> ChatSettings:
    """The server's chat settings (``st``: its ``ServerState``)."""
    cfg = st.cfg
    return ChatSettings(st.engine.processor, cfg.chat_template, cfg.tool_call_parser, cfg.enable_auto_tool_choice,
                        cfg.reasoning_parser_cls)


def json_bytes() -> bytes:
    """The request's JSON body, unparsed (400 for another content type, 413 past the limit):
    the endpoint's serving object parses and checks it."""
    if request.mimetype != "application/json":
        raise APIError(400, f"Content-Type must be application/json, got {request.mimetype or 'none'!r}.")
    return request.get_data(cache=False)


def register_responses_routes(app: Flask, st) -> None:
    """Add ``/v1/responses`` to ``app`` (``st``: its ``server.state.ServerState``)."""
    serving = ServingResponses(chat_settings(st))

    @app.post("/v1/responses")
    def responses():
        req = serving.parse(json_bytes())
        job = serving.prepare(req, model=st.check_model(req.model), run=st.bridge.run_blocking)
        c = job.chat
        gen = GenerationJob(st, c.builder, c.prompts, c.inputs.sampling_params, c.inputs.priority,
                            include_usage=True, cache_salt=c.inputs.cache_salt)
        return run_job(gen, job.stream, job)
