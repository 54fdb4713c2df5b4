"""The real entry point: ``python -m server MODEL`` on a free port, then SIGTERM; and a
clear error without a usable model."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.http_util import get, post, spawn_server

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
                ["--request-read-timeout", "inf"], ["--max-concurrent-streams", "0"]):
        with pytest.raises(SystemExit):
            parse_args(["m", *bad])
    monkeypatch.setenv("VENGINE_HTTP_TIMEOUT_KEEP_ALIVE", "soon")
    with pytest.raises(SystemExit):
        parse_args(["m"])


@pytest.mark.parametrize("tp", [1, 2])
def test_serve_subprocess(llama_dir, tp):
    proc, port = spawn_server(llama_dir, "cli-model", "--max-model-len", "256", "--num-gpu-blocks-override", "256",
                              "--max-concurrent-streams", "8", "--disable-access-log",
                              "--tensor-parallel-size", str(tp), env=_env(), cwd=REPO)
    try:
        assert get(port, "/health")[0] == 200
        status, _, body = post(port, "/v1/completions", {"model": "cli-model", "prompt": "hi", "max_tokens": 3})
        assert status == 200, body
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


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
