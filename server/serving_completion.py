"""``POST /v1/completions`` (the HTTP half of vllm/entrypoints/openai/serving_completion.py):
the request's rules and inputs, and its response objects, come from
``pyengine.entrypoints.openai.serving_completion``."""
from __future__ import annotations

import time
import uuid

from flask import Flask

from pyengine import prompt_text_for_echo
from pyengine.entrypoints.openai.protocol import CompletionRequest
from pyengine.entrypoints.openai.serving_completion import CompletionResponseBuilder, completion_inputs
from pyengine.entrypoints.openai.serving_engine import LogprobsFormatter

from .generation import GenerationJob, run_job
from .http import json_body


def register_completion_routes(app: Flask, st) -> None:
    """Add ``/v1/completions`` to ``app`` (``st``: its ``server.app.ServerState``)."""
    @app.post("/v1/completions")
    def completions():
        req = json_body(CompletionRequest)
        model = st.check_model(req.model)
        inputs = completion_inputs(st.engine.processor, req, run=st.bridge.run_blocking,
                                   max_sequences=st.cfg.max_sequences_per_request)
        echo = None
        if req.echo:
            echo = [text if text is not None else prompt_text_for_echo(st.tokenizer, ids)
                    for text, ids in inputs.prompts]
        n = inputs.sampling_params.n
        formatter = (LogprobsFormatter(st.tokenizer, req.logprobs, bool(req.return_tokens_as_token_ids))
                     if req.logprobs is not None else None)
        builder = CompletionResponseBuilder("cmpl-" + (req.request_id or uuid.uuid4().hex), model, int(time.time()),
                                            formatter,
                                            [len(echo[i // n]) for i in range(len(echo) * n)] if echo else None,
                                            [ids for _, ids in inputs.prompts] if req.return_token_ids else None, n)
        so = req.stream_options
        job = GenerationJob(st, builder, inputs.prompts, inputs.sampling_params, inputs.priority, echo_texts=echo,
                            include_usage=bool(so and so.include_usage),
                            continuous_usage=bool(so and so.continuous_usage_stats), cache_salt=inputs.cache_salt)
        return run_job(job, bool(req.stream))
