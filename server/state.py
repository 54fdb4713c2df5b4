"""One app's configuration and state (``ServerConfig``, ``ServerState``): what the routes
share, below them and below ``server.app`` that assembles them."""
from __future__ import annotations

from dataclasses import dataclass, field

from pyengine import envs
from pyengine.entrypoints.anthropic.serving_messages import ServingMessages
from pyengine.entrypoints.openai.serving_chat import OpenAIServingChat
from pyengine.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pyengine.entrypoints.openai.serving_models import OpenAIServingModels
from pyengine.entrypoints.openai.serving_responses import ServingResponses
from pyengine.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from pyengine.entrypoints.reasoning import load_reasoning_parser

from .bridge import GeventBridge, HTTPSession, RequestGroup
from .http import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_CONCURRENT_STREAMS
from .metrics import ServerMetrics


@dataclass
class ServerConfig:
    served_model_names: list[str]
    api_keys: list[str] = field(default_factory=list)
    chat_template: str | None = None
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    model_path: str = ""
    max_model_len: int = 0
    dev_mode: bool = False  # VENGINE_SERVER_DEV_MODE (vLLM's VLLM_SERVER_DEV_MODE): development endpoints (/reset_prefix_cache)
    tool_call_parser: str | None = None  # --tool-call-parser (pyengine.tool_parsers)
    enable_auto_tool_choice: bool = False  # --enable-auto-tool-choice
    reasoning_parser: str | None = None  # --reasoning-parser (pyengine.reasoning)
    reasoning_parser_cls: type | None = None  # its class, checked against the tokenizer at start-up
    # prompts × n in one request: at most the requests the server serves at once
    # (--max-concurrent-streams), so one request cannot queue more work than that many clients
    max_sequences_per_request: int = DEFAULT_MAX_CONCURRENT_STREAMS

    @classmethod
    def from_args(cls, engine, args) -> ServerConfig:
        ecfg = engine.config
        names = getattr(args, "served_model_name", None) if args is not None else None
        if isinstance(names, str):
            names = [names]
        if not names:
            names = [ecfg.served_model_name or "vengine"]
        api_key = getattr(args, "api_key", None) if args is not None else None
        keys = [api_key] if isinstance(api_key, str) and api_key else list(api_key or [])
        template = getattr(args, "chat_template", None) if args is not None else None
        if template and "{" not in template:  # a path, as vLLM's --chat-template takes either
            with open(template, encoding="utf-8") as f:
                template = f.read()
        return cls(served_model_names=list(names), api_keys=keys, chat_template=template,
                   max_request_body_bytes=int(getattr(args, "max_request_body_bytes", None)
                                              or DEFAULT_MAX_BODY_BYTES),
                   model_path=str(ecfg.model),
                   max_model_len=int(ecfg.max_model_len),
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
    """Everything one app instance owns: the engine, the bridge to its outputs, the
    metrics, one serving object per endpoint, and the shutdown drain's state."""

    def __init__(self, engine, cfg: ServerConfig):
        self.engine = engine
        self.cfg = cfg
        self.bridge = GeventBridge(engine)
        self.metrics = ServerMetrics(engine, cfg.served_model_names[0])
        self.models = OpenAIServingModels(cfg.served_model_names, cfg.model_path, cfg.max_model_len)
        self.completion = OpenAIServingCompletion(engine, self.models, cfg.max_sequences_per_request)
        self.chat = OpenAIServingChat(engine, self.models, chat_template=cfg.chat_template,
                                      tool_call_parser=cfg.tool_call_parser,
                                      enable_auto_tool_choice=cfg.enable_auto_tool_choice,
                                      reasoning_parser=cfg.reasoning_parser_cls)
        self.responses = ServingResponses(self.chat)  # /v1/responses, built on chat
        self.messages = ServingMessages(self.chat)  # /v1/messages, built on chat
        self.tokenization = OpenAIServingTokenization(engine, self.models, cfg.chat_template)
        # Shutdown drain (hub thread only): HTTP requests being served (admission and
        # tokenization included, until the response is closed), the generations among them
        # (jobs: RequestGroups), and whether new requests are refused (draining) or the
        # generations in flight were cut (cut_message).
        self.active_requests = 0
        self.jobs: set[RequestGroup] = set()
        self.draining = False
        self.cut_message: str | None = None

    def session(self, sock=None) -> HTTPSession:
        """The serving objects' ``Session`` of one HTTP request (``sock``: its client socket)."""
        return HTTPSession(self.bridge, self.engine, self.metrics, self.jobs, lambda: self.cut_message, sock)

    def begin_shutdown(self) -> None:
        """Refuse new requests (503); the ones in flight go on."""
        self.draining = True

    def cut_jobs(self, message: str) -> None:
        """End every request still in flight: its engine requests are aborted, a stream
        gets an error event then [DONE], a plain request a 503."""
        self.cut_message = message
        for group in list(self.jobs):
            group.cancel(message)

    def close(self) -> None:
        self.bridge.close()
        self.metrics.close()
