"""One app's configuration and state (``ServerConfig``, ``ServerState``): what the routes
share, below them and below ``server.app`` that assembles them."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from pyengine import envs
from pyengine.entrypoints.reasoning import load_reasoning_parser

from .bridge import GeventBridge
from .http import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_CONCURRENT_STREAMS, APIError
from .metrics import ServerMetrics


@dataclass
class ServerConfig:
    served_model_names: list[str]
    api_keys: list[str] = field(default_factory=list)
    chat_template: Optional[str] = None
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    model_path: str = ""
    max_model_len: int = 0
    dev_mode: bool = False  # VENGINE_SERVER_DEV_MODE (vLLM's VLLM_SERVER_DEV_MODE): development endpoints (/reset_prefix_cache)
    tool_call_parser: Optional[str] = None  # --tool-call-parser (pyengine.tool_parsers)
    enable_auto_tool_choice: bool = False  # --enable-auto-tool-choice
    reasoning_parser: Optional[str] = None  # --reasoning-parser (pyengine.reasoning)
    reasoning_parser_cls: Optional[type] = None  # its class, checked against the tokenizer at start-up
    # prompts × n in one request: at most the requests the server serves at once
    # (--max-concurrent-streams), so one request cannot queue more work than that many clients
    max_sequences_per_request: int = DEFAULT_MAX_CONCURRENT_STREAMS

    @classmethod
    def from_args(cls, engine, args) -> "ServerConfig":
        ecfg = getattr(engine, "config", None)
        names = getattr(args, "served_model_name", None) if args is not None else None
        if isinstance(names, str):
            names = [names]
        if not names:
            names = [getattr(ecfg, "served_model_name", None) or "vengine"]
        api_key = getattr(args, "api_key", None) if args is not None else None
        keys = [api_key] if isinstance(api_key, str) and api_key else list(api_key or [])
        template = getattr(args, "chat_template", None) if args is not None else None
        if template and "{" not in template:  # a path, as vLLM's --chat-template takes either
            with open(template, encoding="utf-8") as f:
                template = f.read()
        return cls(served_model_names=list(names), api_keys=keys, chat_template=template,
                   max_request_body_bytes=int(getattr(args, "max_request_body_bytes", None)
                                              or DEFAULT_MAX_BODY_BYTES),
                   model_path=str(getattr(ecfg, "model", "")),
                   max_model_len=int(getattr(ecfg, "max_model_len", 0) or 0),
                   tool_call_parser=getattr(args, "tool_call_parser", None) if args is not None else None,
                   enable_auto_tool_choice=bool(getattr(args, "enable_auto_tool_choice", False)),
                   reasoning_parser=getattr(args, "reasoning_parser", None) if args is not None else None,
                   reasoning_parser_cls=load_reasoning_parser(
                       getattr(args, "reasoning_parser", None) if args is not None else None,
                       getattr(engine, "tokenizer", None)),
                   max_sequences_per_request=int(getattr(args, "max_concurrent_streams", None)
                                                 or DEFAULT_MAX_CONCURRENT_STREAMS),
                   dev_mode=envs.server_dev_mode())


class ServerState:
    """Everything one app instance owns."""

    def __init__(self, engine, cfg: ServerConfig):
        self.engine = engine
        self.cfg = cfg
        self.tokenizer = engine.tokenizer
        self.bridge = GeventBridge(engine)
        self.metrics = ServerMetrics(engine, cfg.served_model_names[0])
        self.created = int(time.time())
        # Shutdown drain (hub thread only): HTTP requests being served (admission and
        # tokenization included, until the response is closed), the generations among them
        # (jobs), and whether new requests are refused (draining) or the generations in
        # flight were cut (cut_message).
        self.active_requests = 0
        self.jobs: set = set()
        self.draining = False
        self.cut_message: Optional[str] = None

    def begin_shutdown(self) -> None:
        """Refuse new requests (503); the ones in flight go on."""
        self.draining = True

    def cut_jobs(self, message: str) -> None:
        """End every request still in flight: its engine requests are aborted, a stream
        gets an error event then [DONE], a plain request a 503."""
        self.cut_message = message
        for job in list(self.jobs):
            job.cut(message)

    def close(self) -> None:
        self.bridge.close()
        self.metrics.close()

    def check_model(self, model: Optional[str]) -> str:
        """The served name a request's ``model`` names (None: the first). Raises
        ``APIError`` 404 for a name this server does not serve."""
        if model is None:
            return self.cfg.served_model_names[0]
        if model not in self.cfg.served_model_names:
            raise APIError(404, f"The model `{model}` does not exist.", "model")
        return model

    def tokenize(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each text (the engine's ``Processor.encode``), computed on a
        threadpool thread: the Rust tokenizer releases the GIL, so a long prompt does not
        stall the hub (other streams)."""
        encode = self.engine.processor.encode
        return self.bridge.run_blocking(lambda: [encode(t, add_special_tokens) for t in texts])
