"""``POST /v1/chat/completions`` (the HTTP half of vllm/entrypoints/openai/serving_chat.py):
the request's rules and inputs (chat template, tools, structured outputs), and its
response objects and chunks, come from ``pyengine.entrypoints.openai.serving_chat``, as
the C ABI's ``vllm_chat`` gets them."""
from __future__ import annotations

import time
import uuid

from flask import Flask

from pyengine.entrypoints.openai.protocol import ChatCompletionRequest
from pyengine.entrypoints.openai.serving_chat import ChatResponseBuilder, chat_inputs, make_extractor
from pyengine.entrypoints.openai.serving_engine import LogprobsFormatter

from .generation import GenerationJob, run_job
from .http import json_body


def register_chat_routes(app: Flask, st) -> None:
    """Add ``/v1/chat/completions`` to ``app`` (``st``: its ``server.app.ServerState``)."""
    cfg = st.cfg

    @app.post("/v1/chat/completions")
    def chat_completions():
        req = json_body(ChatCompletionRequest)
        model = st.check_model(req.model)
        inputs = chat_inputs(st.engine.processor, req, chat_template=cfg.chat_template,
                             tool_call_parser=cfg.tool_call_parser, enable_auto_tool_choice=cfg.enable_auto_tool_choice,
                             run=st.bridge.run_blocking, reasoning_parser=cfg.reasoning_parser_cls)
        n = inputs.sampling_params.n
        formatter = (LogprobsFormatter(st.tokenizer, inputs.num_top_logprobs, bool(req.return_tokens_as_token_ids))
                     if req.logprobs else None)
        extractors = [make_extractor(inputs.tool_mode, cfg.tool_call_parser, st.tokenizer) for _ in range(n)]
        builder = ChatResponseBuilder("chatcmpl-" + (req.request_id or uuid.uuid4().hex), model, int(time.time()),
                                      formatter, extractors, inputs.echo,
                                      inputs.prompt_token_ids if req.return_token_ids else None, inputs.reasoning)
        so = req.stream_options
        job = GenerationJob(st, builder, [(inputs.text, inputs.prompt_token_ids)], inputs.sampling_params,
                            inputs.priority, include_usage=bool(so and so.include_usage),
                            continuous_usage=bool(so and so.continuous_usage_stats), cache_salt=inputs.cache_salt)
        return run_job(job, bool(req.stream))
