"""``vengine serve``'s flags (mirrors vllm/entrypoints/openai/cli_args.py).

One flag set: the engine's flags are generated from ``AsyncEngineArgs``' fields
(``EngineArgs.add_cli_args``, pyengine/arg_utils.py) and the server's own from
``FrontendArgs``' fields in the same way, so the command line, the Python API and
``--help`` cannot disagree. vLLM spellings are accepted as they are (``--max_model_len``
is ``--max-model-len``); a vLLM flag that vengine cannot honour is refused with one line
naming it and why (``VLLM_FLAGS_NOT_SUPPORTED``), and one that changes nothing here is
accepted with a warning (``VLLM_FLAGS_IGNORED``).
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from pyengine import VERSION, envs
from pyengine.arg_utils import add_dataclass_args
from pyengine.config import AsyncEngineArgs
from pyengine.reasoning import ReasoningParserManager
from pyengine.tool_parsers import ToolParserManager

from .http import DEFAULT_MAX_BODY_BYTES
from .wsgi import (
    DEFAULT_MAX_CONCURRENT_STREAMS,
    DEFAULT_REQUEST_READ_TIMEOUT,
    DEFAULT_SHUTDOWN_TIMEOUT,
    DEFAULT_TIMEOUT_KEEP_ALIVE,
    RETRY_AFTER_S,
    ssl_args_from,
)

LogLevel = Literal["critical", "error", "warning", "info", "debug", "trace"]


@dataclass
class FrontendArgs:
    """The HTTP server's own options (vLLM's ``FrontendArgs``); each field is a flag."""
    host: str = "127.0.0.1"
    """Bind address."""
    port: int = 8000
    """Bind port (0: any free port)."""
    api_key: str | None = None
    """Require 'Authorization: Bearer KEY' (or Anthropic's 'x-api-key: KEY') on /v1/* (default: $VENGINE_API_KEY or
    $VLLM_API_KEY, else none)."""
    chat_template: str | None = None
    """Jinja chat template, or a file holding one (default: the tokenizer's)."""
    enable_auto_tool_choice: bool = False
    """Let the model decide to call tools (tool_choice "auto"); needs --tool-call-parser."""
    tool_call_parser: str | None = field(default=None, metadata={"choices": sorted(ToolParserManager.tool_parsers)})
    """How tool calls are read from the model's output (hermes: <tool_call>{...}</tool_call>,
    the Qwen/Hermes format). tool_choice "required" and named functions work without it."""
    reasoning_parser: str | None = field(default=None, metadata={
        "choices": ReasoningParserManager.list_registered()})
    """How the reasoning is read from a reasoning model's output (qwen3, deepseek_r1: between
    <think> and </think>): returned as reasoning_content (chat), reasoning items
    (/v1/responses), thinking blocks (/v1/messages); tool calls and structured outputs
    apply to the content after it. The tokenizer must have the think tokens."""
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    """CORS: origins allowed to call the API from a browser."""
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    """CORS: methods allowed."""
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    """CORS: request headers allowed."""
    allow_credentials: bool = False
    """CORS: allow credentials (cookies, Authorization) in cross-origin requests."""
    root_path: str | None = None
    """Path prefix the API is served under behind a proxy (e.g. /llm: /llm/v1/models);
    the plain paths keep working."""
    ssl_keyfile: str | None = None
    """Serve HTTPS with this private key file (PEM), with --ssl-certfile."""
    ssl_certfile: str | None = None
    """Serve HTTPS with this certificate chain file (PEM), with --ssl-keyfile."""
    ssl_ca_certs: str | None = None
    """CA certificates file to verify client certificates against (--ssl-cert-reqs)."""
    ssl_cert_reqs: int = 0
    """Client certificates: 0 not asked for, 1 optional, 2 required (Python's
    ssl.CERT_*)."""
    max_concurrent_streams: int = field(default=DEFAULT_MAX_CONCURRENT_STREAMS, metadata={"help": (
        "Most requests served at once (streams included; idle connections do not count, nor do /health, "
        f"/metrics, /version, /v1/models); one more gets 503 with Retry-After: {RETRY_AFTER_S}.")})
    timeout_keep_alive: float | None = field(default=None, metadata={"help": (
        "Close a connection that waits this many seconds for its next request (a fresh one for its first) "
        "(default: $VENGINE_HTTP_TIMEOUT_KEEP_ALIVE or $VLLM_HTTP_TIMEOUT_KEEP_ALIVE, else "
        f"{DEFAULT_TIMEOUT_KEEP_ALIVE:g}, as uvicorn and vLLM).")})
    request_read_timeout: float = DEFAULT_REQUEST_READ_TIMEOUT
    """Seconds a request's headers, and then its body, may take to arrive once its first
    byte came; later: 408 and the connection closes."""
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    """Larger request bodies get 413."""
    api_server_count: int | None = field(default=None, metadata={"help": (
        "Front-end (API server) processes sharing the engine process(es) and the port. Default: chosen from "
        "the host (auto_api_server_count): min(4 x data-parallel size, (CPU cores - engine processes) // 2), "
        "at least 1; 1 keeps one API server.")})
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT
    """On SIGTERM/SIGINT: seconds that requests in flight get to finish before they are
    cut (a stream then ends with an error event and [DONE]); new connections are refused
    at once. 0 cuts at once, as vLLM. A second signal cuts at once."""
    disable_access_log: bool = field(default=False, metadata={"flags": ("--disable-uvicorn-access-log",)})
    """Do not log each HTTP request."""
    log_level: LogLevel = field(default="info", metadata={"flags": ("--uvicorn-log-level",)})
    """Log level (trace is debug)."""


# vLLM flags that cannot apply here: flag -> (values that are vLLM's default and so change
# nothing, accepted; the reason the others are refused). A flag with no value (a switch)
# lists no values: given, it is refused; its --no- form is accepted.
VLLM_FLAGS_NOT_SUPPORTED: dict[str, tuple[tuple[str, ...], str]] = {
    "--pipeline-parallel-size": (("1",), "pipeline parallelism is not implemented (use --tensor-parallel-size)"),
    "--cpu-offload-gb": (("0",), "weight offloading is not implemented"),
    "--tokenizer-mode": (("auto", "hf"), "only Hugging Face tokenizers are supported"),
    "--revision": ((), "models load from a local directory (no Hugging Face Hub)"),
    "--code-revision": ((), "models load from a local directory (no Hugging Face Hub)"),
    "--tokenizer-revision": ((), "models load from a local directory (no Hugging Face Hub)"),
    "--download-dir": ((), "models load from a local directory (no Hugging Face Hub)"),
    "--hf-overrides": ((), "model config overrides are not supported (edit config.json)"),
    "--rope-scaling": ((), "model config overrides are not supported (edit config.json)"),
    "--rope-theta": ((), "model config overrides are not supported (edit config.json)"),
    "--distributed-executor-backend": (("mp", "uni"), "ranks are local processes (mp) only"),
    "--model-impl": (("auto", "vllm"), "vengine runs its own model implementations only"),
    "--runner": (("auto", "generate"), "only text generation is served"),
    "--task": (("auto", "generate"), "only text generation is served"),
    "--compilation-config": ((), "torch.compile is not used (CUDA graphs only; --enforce-eager)"),
    "--cuda-graph-sizes": ((), "CUDA graph batch sizes are not configurable"),
    "--max-seq-len-to-capture": ((), "CUDA graph sizes are not configurable"),
    "--preemption-mode": (("recompute",), "preemption is by recompute only"),
    "--num-scheduler-steps": (("1",), "multi-step scheduling is not implemented"),
    "--max-num-partial-prefills": (("1",), "concurrent partial prefills are not configurable"),
    "--lora-modules": ((), "LoRA adapters are not supported"),
    "--max-loras": ((), "LoRA adapters are not supported"),
    "--max-lora-rank": ((), "LoRA adapters are not supported"),
    "--limit-mm-per-prompt": ((), "multimodal inputs are not supported"),
    "--mm-processor-kwargs": ((), "multimodal inputs are not supported"),
    "--kv-transfer-config": ((), "KV transfer (disaggregated prefill) is not supported"),
    "--otlp-traces-endpoint": ((), "OpenTelemetry tracing is not supported"),
    "--config": ((), "a YAML config file is not supported (pass the flags)"),
    "--uds": ((), "serving on a Unix domain socket is not supported"),
    "--middleware": ((), "ASGI middleware does not apply to this WSGI server"),
    "--response-role": (("assistant",), "the response role is always assistant"),
    "--enable-lora": ((), "LoRA adapters are not supported"),
    "--enable-sleep-mode": ((), "sleep mode is not implemented"),
    "--enable-prompt-embeds": ((), "prompt embeddings are not supported"),
    "--skip-tokenizer-init": ((), "the engine always loads the tokenizer"),
    "--headless": ((), "the engine always runs with its API server"),
    "--return-tokens-as-token-ids": ((), "not implemented"),
}
VLLM_SWITCHES = {"--enable-lora", "--enable-sleep-mode",
             "--enable-prompt-embeds", "--skip-tokenizer-init", "--headless", "--return-tokens-as-token-ids"}
_MANY_VALUES = {"--lora-modules", "--cuda-graph-sizes"}
_SHORT = {"--pipeline-parallel-size": "-pp", "--compilation-config": "-O"}
# vLLM flags that change nothing here: accepted (a warning says so) -> why.
VLLM_FLAGS_IGNORED: dict[str, str] = {
    "--swap-space": "preemption recomputes; no CPU swap space is used",
    "--disable-frontend-multiprocessing": "the front end runs in this process (see --api-server-count)",
    "--disable-fastapi-docs": "there are no API docs pages",
    "--max-parallel-loading-workers": "weights load in one pass",
    "--disable-custom-all-reduce": "tensor parallelism uses NCCL's all-reduce",
}
_IGNORED_SWITCHES = {"--disable-frontend-multiprocessing", "--disable-fastapi-docs", "--disable-custom-all-reduce"}
IGNORED_FLAGS_ATTR = "ignored_vllm_flags"


class _VLLMFlag(argparse.Action):
    """A vLLM flag that does not apply: refused with its reason, unless its value is
    vLLM's default (or it is ignored here): then recorded and otherwise dropped."""

    def __init__(self, option_strings, dest, accept=(), reason="", ignored=False, **kw):
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                         help=argparse.SUPPRESS, **kw)
        self.accept, self.reason, self.ignored = accept, reason, ignored

    def __call__(self, parser, namespace, values, option_string=None):
        value = " ".join(values) if isinstance(values, list) else values
        negated = option_string.startswith("--no-")
        if not (self.ignored or negated or (value is not None and value in self.accept)):
            parser.error(f"{option_string} is a vLLM flag that vengine does not support: {self.reason}")
        if self.ignored:
            seen = getattr(namespace, IGNORED_FLAGS_ATTR, None) or []
            setattr(namespace, IGNORED_FLAGS_ATTR, seen + [f"{option_string} ({self.reason})"])


class ServeArgumentParser(argparse.ArgumentParser):
    """argparse with vLLM's command-line habits: ``--flag_name`` means ``--flag-name``,
    no abbreviated flags, and an error is one line (not the long usage text)."""

    def __init__(self, *args, **kw):
        kw.setdefault("allow_abbrev", False)
        super().__init__(*args, **kw)

    def parse_known_args(self, args=None, namespace=None):
        args = [_dashes(a) for a in (sys.argv[1:] if args is None else args)]
        return super().parse_known_args(args, namespace)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _dashes(arg: str) -> str:
    if not arg.startswith("--"):
        return arg
    name, eq, value = arg.partition("=")
    return name.replace("_", "-") + eq + value


def _add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    for flag, (accept, reason) in VLLM_FLAGS_NOT_SUPPORTED.items():
        names = [flag] + ([_SHORT[flag]] if flag in _SHORT else [])
        if flag in VLLM_SWITCHES:
            parser.add_argument(*names, "--no-" + flag[2:], action=_VLLMFlag, nargs=0, reason=reason)
        else:
            parser.add_argument(*names, action=_VLLMFlag, nargs="+" if flag in _MANY_VALUES else None,
                                accept=accept, reason=reason)
    for flag, reason in VLLM_FLAGS_IGNORED.items():
        parser.add_argument(flag, action=_VLLMFlag, nargs=0 if flag in _IGNORED_SWITCHES else None,
                            reason=reason, ignored=True)


def make_arg_parser() -> ServeArgumentParser:
    """The parser of ``vengine serve [MODEL] [flags]``: the model, the server's flags
    (``FrontendArgs``), the engine's (``AsyncEngineArgs``) and vLLM's that do not apply."""
    p = ServeArgumentParser(
        prog="vengine serve",
        description="Serve a model over an OpenAI-compatible HTTP API (completions, chat, SSE streaming). "
                    "Flags carry vllm serve's names.")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="Hugging Face model directory (same as --model); omitted: the built-in default model.")
    p.add_argument("--version", action="version", version=f"vengine {VERSION}")
    add_dataclass_args(p.add_argument_group("server", "The HTTP server's own flags."), FrontendArgs)
    AsyncEngineArgs.add_cli_args(p.add_argument_group(
        "engine", "The engine's flags: the fields of pyengine.EngineArgs (and AsyncEngineArgs)."))
    # vLLM's older spelling of the default: request logging off
    p.add_argument("--disable-log-requests", dest="enable_log_requests", action="store_false",
                   default=argparse.SUPPRESS, help="Do not log each request (the default; vLLM's deprecated flag).")
    _add_vllm_flags(p)
    p.set_defaults(**{IGNORED_FLAGS_ATTR: []})
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``vengine serve``'s namespace: every ``FrontendArgs`` and ``AsyncEngineArgs``
    field, ``model`` from the positional argument or ``--model``, ``api_key`` from the
    environment when not given. Exits (status 2, one line) on bad flags."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        argv = argv[1:]
    parser = make_arg_parser()
    args = parser.parse_args(argv)
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            parser.error(f"the model is given twice: {args.model_tag} and --model {args.model}")
        args.model = args.model_tag
    if args.api_key is None:
        args.api_key = envs.api_key()
    if args.timeout_keep_alive is None:
        try:
            args.timeout_keep_alive = envs.http_timeout_keep_alive(DEFAULT_TIMEOUT_KEEP_ALIVE)
        except ValueError as e:
            parser.error(str(e))
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        parser.error("--enable-auto-tool-choice requires --tool-call-parser")
    if args.max_concurrent_streams < 1:
        parser.error("--max-concurrent-streams must be >= 1")
    if args.api_server_count is None:
        args.api_server_count = auto_api_server_count(args.data_parallel_size, args.tensor_parallel_size)
    if args.api_server_count < 1:
        parser.error("--api-server-count must be >= 1")
    if args.max_request_body_bytes < 1:  # 0 was taken as the default before
        parser.error("--max-request-body-bytes must be >= 1")
    if not args.shutdown_timeout >= 0:  # also NaN
        parser.error("--shutdown-timeout must be >= 0")
    for flag in ("timeout_keep_alive", "request_read_timeout"):
        if not 0 < getattr(args, flag) < float("inf"):  # also NaN
            parser.error(f"--{flag.replace('_', '-')} must be a positive number of seconds")
    if args.ssl_cert_reqs not in (0, 1, 2):
        parser.error("--ssl-cert-reqs must be 0, 1 or 2")
    if args.root_path and not args.root_path.startswith("/"):
        parser.error(f"--root-path must start with '/', got {args.root_path!r}")
    try:
        ssl_args_from(args)
    except ValueError as e:
        parser.error(str(e))
    return args


# API servers per engine core that the default starts at most: on the H200 (16 cores; issue
# 29's table, Qwen3-0.6B shape, c=256), 1 API server reached 0.67-0.80x of offline throughput
# and 4 reached 0.81-0.84x, so one engine core feeds about 4 front ends' worth of work.
API_SERVERS_PER_ENGINE = 4
# Host cores each API server is given (its HTTP hub thread, plus tokenization/detokenization
# threads and the kernel's share of its sockets).
CORES_PER_API_SERVER = 2


def auto_api_server_count(data_parallel_size: int = 1, tensor_parallel_size: int = 1,
                          cpu_count: int | None = None) -> int:
    """The ``--api-server-count`` used when none is given: every engine-core process and
    tensor-parallel worker keeps one host core busy (dp x tp of them); of the cores left,
    each API server takes ``CORES_PER_API_SERVER``; at most ``API_SERVERS_PER_ENGINE`` per
    engine core, at least 1. ``cpu_count``: the cores this process may run on (default:
    ``os.sched_getaffinity``). On a 2-core machine: 1; on a 16-core one-GPU host: 4."""
    import os

    if cpu_count is None:
        try:
            cpu_count = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpu_count = os.cpu_count() or 1
    dp, tp = max(1, data_parallel_size or 1), max(1, tensor_parallel_size or 1)
    spare = cpu_count - dp * tp
    return max(1, min(API_SERVERS_PER_ENGINE * dp, spare // CORES_PER_API_SERVER))


def engine_args_from(args: argparse.Namespace) -> AsyncEngineArgs:
    """The engine arguments of a ``vengine serve`` namespace."""
    return AsyncEngineArgs.from_cli_args(args)

