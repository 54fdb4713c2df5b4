"""``POST /v1/messages`` and ``/v1/messages/count_tokens``, Anthropic's Messages API (the
HTTP half of vllm/entrypoints/anthropic/api_server.py): the request, its rules, engine
inputs, ``Message`` and event stream come from
``pyengine.entrypoints.anthropic.serving_messages`` (built on the chat endpoint's). Every
error on these paths (the API key, a refused field, an unknown model, ...) has
Anthropic's error body."""
from __future__ import annotations

import json

from flask import Flask, Response, request

from pyengine.entrypoints.anthropic.serving_messages import ServingMessages, error_body

from .generation import GenerationJob, run_job
from .http import json_response
from .serving_responses import chat_settings, json_bytes


def register_messages_routes(app: Flask, st) -> None:
    """Add ``/v1/messages`` and ``/v1/messages/count_tokens`` to ``app`` (``st``: its
    ``server.state.ServerState``)."""
    serving = ServingMessages(chat_settings(st))

    @app.post("/v1/messages")
    def messages():
        req = serving.parse(json_bytes())
        job = serving.prepare(req, model=st.check_model(req.model), run=st.bridge.run_blocking)
        c = job.chat
        gen = GenerationJob(st, c.builder, c.prompts, c.inputs.sampling_params, c.inputs.priority,
                            include_usage=True, cache_salt=c.inputs.cache_salt)
        return run_job(gen, job.stream, job)

    @app.post("/v1/messages/count_tokens")
    def count_tokens():
        return json_response(serving.count_tokens(json_bytes(), model_of=st.check_model,
                                                   run=st.bridge.run_blocking))

    @app.after_request
    def _anthropic_errors(resp: Response):
        # The app answers errors with OpenAI's body; on these paths, Anthropic's.
        if resp.status_code >= 400 and request.path.startswith("/v1/messages") and resp.is_json:
            try:
                message = json.loads(resp.get_data())["error"]["message"]
            except (ValueError, KeyError, TypeError):
                return resp
            resp.set_data(json.dumps(error_body(resp.status_code, message)))
        return resp
