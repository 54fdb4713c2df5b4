"""The real entry point: ``python -m server MODEL`` on a free port, then SIGTERM; and a
clear error without a usable model."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.http_util import get, post, request, served

REPO = Path(__file__).resolve().parents[2]


def _env():
    return dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def test_help_lists_vllm_flags():
    out = subprocess.run([sys.executable, "-m", "server", "--help"], cwd=REPO, env=_env(), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0
    for flag in ("--host", "--port", "--served-model-name", "--max-model-len", "--max-num-seqs",
                 "--max-num-batched-tokens", "--block-size", "--gpu-memory-utilization",
                 "--enable-prefix-caching", "--no-enable-prefix-caching", "--scheduling-policy",
                 "--no-async-scheduling", "--api-key", "--dtype", "--device", "--max-concurrent-streams",
                 "--tensor-parallel-size", "--shutdown-timeout", "--long-prefill-token-threshold",
                 "--timeout-keep-alive", "--request-read-timeout", "--max-request-body-bytes"):
        assert flag in out.stdout, flag


def _expected_flags() -> set[str]:
    """Every flag the dataclasses' fields give (--x and, for a switch, --no-x; aliases)."""
    import dataclasses
    import typing

    from pyengine.arg_utils import flag_name
    from pyengine.config import AsyncEngineArgs
    from server.cli_args import FrontendArgs

    out = {"--help", "--version", "--disable-log-requests"}  # argparse's, and vLLM's old spelling
    for cls in (FrontendArgs, AsyncEngineArgs):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            names = [flag_name(f.name)] + [a for a in f.metadata.get("flags", ()) if a.startswith("--")]
            switch = bool in (typing.get_args(hints[f.name]) or (hints[f.name],))
            for n in names:
                out |= {n, "--no-" + n[2:]} if switch else {n}
    return out


def test_help_lists_exactly_the_dataclass_fields():
    # One flag set: --help shows one flag per EngineArgs / AsyncEngineArgs / FrontendArgs field
    # and nothing written by hand besides --help, --version and --disable-log-requests.
    import re

    out = subprocess.run([sys.executable, "-m", "server", "serve", "--help"], cwd=REPO, env=_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    shown = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", out.stdout))
    assert shown == _expected_flags()
    assert "-tp" in out.stdout


def test_version():
    from pyengine import __version__

    out = subprocess.run([sys.executable, "-m", "server", "--version"], cwd=REPO, env=_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"vengine {__version__}"


def test_vllm_spellings_are_accepted():
    from server.cli_args import parse_args

    args = parse_args(["serve", "m", "--max_model_len", "64", "--no-enable-prefix-caching",
                       "-tp", "2", "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log",
                       "--disable-log-requests", "--disable-log-stats", "--max-logprobs", "7",
                       "--generation-config", "vllm", "--trust-remote-code", "--served-model-name", "a", "b",
                       "--enable-log-requests"])
    assert (args.max_model_len, args.enable_prefix_caching, args.tensor_parallel_size) == (64, False, 2)
    assert args.log_level == "warning" and args.disable_access_log and args.disable_log_stats
    assert args.enable_log_requests and args.max_logprobs == 7 and args.generation_config == "vllm"
    assert args.trust_remote_code and args.served_model_name == ["a", "b"]
    assert not parse_args(["m", "--enable-log-requests", "--disable-log-requests"]).enable_log_requests
    assert parse_args(["m"]).enable_log_requests  # a request log line unless disabled


def test_vllm_flags_that_cannot_apply_are_one_line_errors(capsys):
    from server.cli_args import VLLM_FLAGS_IGNORED, VLLM_FLAGS_NOT_SUPPORTED, VLLM_SWITCHES, parse_args

    for flag, (accepted, reason) in VLLM_FLAGS_NOT_SUPPORTED.items():
        with pytest.raises(SystemExit) as ei:
            parse_args(["m", flag] if flag in VLLM_SWITCHES else ["m", flag, "x"])
        assert ei.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert err.startswith(f"vengine serve: error: {flag} is a vLLM flag that vengine does not support: {reason}")
        for value in accepted:  # vLLM's default value changes nothing: accepted
            parse_args(["m", flag, value])
    parse_args(["m", "--no-enable-lora", "-pp", "1", "--kv-cache-dtype", "auto"])
    args = parse_args(["m", "--swap-space", "16", "--disable-frontend-multiprocessing"])
    assert [w.split()[0] for w in args.ignored_vllm_flags] == ["--swap-space", "--disable-frontend-multiprocessing"]
    assert set(VLLM_FLAGS_IGNORED) >= {"--swap-space"}
    with pytest.raises(SystemExit):  # a typo is still argparse's own error, on one line
        parse_args(["m", "--max-modle-len", "5"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unrecognized arguments: --max-modle-len" in err


def test_flags_reach_the_engine_args():
    from server.cli import engine_args_from, parse_args

    args = parse_args(["serve", "m", "--long-prefill-token-threshold", "32", "--shutdown-timeout", "7.5"])
    assert engine_args_from(args).long_prefill_token_threshold == 32 and args.shutdown_timeout == 7.5
    for bad in (["--shutdown-timeout", "-1"], ["--shutdown-timeout", "nan"]):
        with pytest.raises(SystemExit):
            parse_args(["m", *bad])


def test_connection_limit_flags(monkeypatch):
    # issue 16 kind 1: the timeouts and the request cap, with uvicorn's/vLLM's names and defaults
    from server.cli import parse_args
    from server.wsgi import ConnectionLimits

    for v in ("VENGINE_HTTP_TIMEOUT_KEEP_ALIVE", "VLLM_HTTP_TIMEOUT_KEEP_ALIVE"):
        monkeypatch.delenv(v, raising=False)
    args = parse_args(["m"])
    assert (args.timeout_keep_alive, args.request_read_timeout, args.max_concurrent_streams) == (5.0, 60.0, 1024)
    monkeypatch.setenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "7")  # vLLM's variable, as an alias
    assert parse_args(["m"]).timeout_keep_alive == 7.0
    monkeypatch.setenv("VENGINE_HTTP_TIMEOUT_KEEP_ALIVE", "9.5")
    assert parse_args(["m"]).timeout_keep_alive == 9.5
    args = parse_args(["m", "--timeout-keep-alive", "2", "--request-read-timeout", "3", "--max-concurrent-streams", "4"])
    assert ConnectionLimits.from_args(args) == ConnectionLimits(max_concurrent_streams=4, timeout_keep_alive=2.0,
                                                                request_read_timeout=3.0)
    for bad in (["--timeout-keep-alive", "0"], ["--timeout-keep-alive", "nan"], ["--request-read-timeout", "-1"],
                ["--request-read-timeout", "inf"], ["--max-concurrent-streams", "0"],
                ["--max-request-body-bytes", "0"], ["--max-request-body-bytes", "-5"]):
        with pytest.raises(SystemExit):
            parse_args(["m", *bad])
    monkeypatch.setenv("VENGINE_HTTP_TIMEOUT_KEEP_ALIVE", "soon")
    with pytest.raises(SystemExit):
        parse_args(["m"])


@pytest.mark.parametrize("tp", [1, 2])
def test_serve_subprocess(llama_dir, tp):
    # --enable-log-requests reaches AsyncLLM(log_requests=True): one log line per request
    with served(llama_dir, "cli-model", "--max-model-len", "256", "--num-gpu-blocks-override", "256",
                "--max-concurrent-streams", "8", "--disable-access-log", "--enable-log-requests",
                "--tensor-parallel-size", str(tp), env=_env(), cwd=REPO) as (proc, port):
        assert get(port, "/health")[0] == 200
        status, _, body = post(port, "/v1/completions", {"model": "cli-model", "prompt": "hi", "max_tokens": 3})
        assert status == 200, body
    assert "Received request cmpl-" in proc.stdout.read()


def test_serve_with_a_reasoning_parser(reasoning_dir, llama_dir):
    """``vengine serve --reasoning-parser qwen3`` (issue 28): the flag reaches the app (the
    thinking comes apart from the answer, over the official SDK); a model whose tokenizer
    lacks the think tokens stops the command with one line (status 2)."""
    import openai

    with served(reasoning_dir, "qwen3-cli", "--reasoning-parser", "qwen3", "--max-model-len", "256",
                "--num-gpu-blocks-override", "64", "--disable-access-log", env=_env(), cwd=REPO) as (_, port):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        r = client.chat.completions.create(model="qwen3-cli", messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=16, temperature=0)
        m = r.choices[0].message.model_dump()
        assert (m["reasoning_content"], m["content"]) == ("Hmm", "\n\nOK")
    out = subprocess.run([sys.executable, "-m", "server", str(llama_dir), "--port", "0", "--device", "cpu",
                          "--reasoning-parser", "qwen3"], cwd=REPO, env=_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    (line,) = [ln for ln in out.stderr.splitlines() if ln.startswith("vengine serve:")]
    assert "<think>" in line


def test_bad_model_dir_is_a_clear_error(tmp_path):
    out = subprocess.run([sys.executable, "-m", "server", str(tmp_path / "nope"), "--port", "0"],
                         cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "cannot load" in out.stderr and "nope" in out.stderr


def test_model_without_tokenizer_exits_with_the_reason(no_tokenizer_dir):
    out = subprocess.run([sys.executable, "-m", "server", str(no_tokenizer_dir), "--port", "0", "--device", "cpu"],
                         cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "cannot load" in out.stderr and "cannot encode text" in out.stderr


def test_default_model_when_missing():
    from pyengine.config import DEFAULT_MODEL_DIR

    if (DEFAULT_MODEL_DIR / "config.json").is_file():
        pytest.skip("the built-in default model exists")
    out = subprocess.run([sys.executable, "-m", "server", "--port", "0"], cwd=REPO, env=_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "built-in default model" in out.stderr


def test_max_model_len_past_the_models_length_is_a_clear_error(llama_dir):
    # Issue 17: --max-model-len 2048 on a model whose max_position_embeddings is 1024 started,
    # and the first sequence past position 1024 killed the engine.
    env = {k: v for k, v in _env().items() if k != "VENGINE_ALLOW_LONG_MAX_MODEL_LEN"}
    out = subprocess.run([sys.executable, "-m", "server", str(llama_dir), "--port", "0", "--device", "cpu",
                          "--max-model-len", "2048"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "max_model_len=2048" in out.stderr and "max_position_embeddings=1024" in out.stderr
    assert "VENGINE_ALLOW_LONG_MAX_MODEL_LEN=1" in out.stderr


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_vllm_style_launch_line_serves(llama_greedy_dir, tmp_path):
    # A launch script written for `vllm serve`, on the tiny CPU model whose
    # generation_config.json recommends greedy sampling and 3 new tokens.
    from tests.helpers import self_signed_cert

    key, cert = self_signed_cert(tmp_path)
    with served(
        llama_greedy_dir, "vllm-style",
        "--host", "127.0.0.1", "--tensor-parallel-size", "1", "--trust-remote-code", "--generation-config", "auto",
        "--disable-log-requests", "--disable-log-stats", "--max-logprobs", "5", "--allowed-origins", "*",
        "--allowed-methods", "*", "--allowed-headers", "*", "--root-path", "/llm", "--ssl-keyfile", str(key),
        "--ssl-certfile", str(cert), "--uvicorn-log-level", "warning", "--api-key", "sk-test", "--dtype", "float32",
        "--max-model-len", "256", "--num-gpu-blocks-override", "256", "--max_num_seqs", "8", "--swap-space", "4",
        "--gpu-memory-utilization", "0.9", "--enforce-eager", "--disable-uvicorn-access-log",
        "--kv-cache-dtype", "auto", env=_env(), cwd=REPO) as (_, port):
        auth = {"Authorization": "Bearer sk-test"}
        # a browser's preflight: answered, without the key
        status, hdrs, _ = request(port, "OPTIONS", "/llm/v1/chat/completions", cafile=cert, headers={
            "Origin": "http://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type", "Content-Type": None})
        assert status == 200 and hdrs["Access-Control-Allow-Origin"] == "*"
        # requests that set no sampling fields take the generation config's (greedy, 3 tokens)
        chat = {"model": "vllm-style", "messages": [{"role": "user", "content": "hello"}]}
        status, _, data = request(port, "POST", "/llm/v1/chat/completions", chat, auth, cafile=cert)
        assert status == 200, data
        out = json.loads(data)
        assert out["usage"]["completion_tokens"] == 3 and out["choices"][0]["finish_reason"] == "length"
        status, _, again = request(port, "POST", "/llm/v1/chat/completions", dict(chat, temperature=0, max_tokens=3),
                                   auth, cafile=cert)
        assert json.loads(again)["choices"][0]["message"] == out["choices"][0]["message"]
        status, _, data = request(port, "POST", "/llm/v1/completions",
                                  {"model": "vllm-style", "prompt": "hi", "ignore_eos": True}, auth, cafile=cert)
        assert json.loads(data)["usage"]["completion_tokens"] == 3  # min(OpenAI's 16, the model's 3)
        # --max-logprobs is the engine's limit
        status, _, data = request(port, "POST", "/v1/completions",
                                  {"model": "vllm-style", "prompt": "hi", "logprobs": 6}, auth, cafile=cert)
        assert status == 400 and "logprobs must be at most 5" in json.loads(data)["error"]["message"]
        assert request(port, "GET", "/v1/models", cafile=cert)[0] == 401
