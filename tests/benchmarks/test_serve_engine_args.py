"""benchmarks/serve.py gives every front end the same engine arguments: the server's flags
parse to the offline/asyncllm children's ``EngineArgs``, and the C host's
``vllm_model_params`` (the C driver's argv) resolve to the same engine config, its
``max_model_len`` included (the C driver used to leave it at the model's own, 40,960 for
Qwen3, where the others got the suite's 1,024)."""
from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

from benchmarks import common

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def serve_bench():
    spec = importlib.util.spec_from_file_location("serve_bench", REPO / "benchmarks" / "serve.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["serve_bench"] = mod  # (its dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return common.make_model_dir("tiny", tmp_path_factory.mktemp("serve_tiny"))


def _spec(serve_bench, tiny_dir, *flags):
    a = serve_bench.build_parser().parse_args(["--device", "cpu", *flags])
    return serve_bench._child_spec(a, "capi", "inproc", str(tiny_dir))


@pytest.mark.parametrize("flags", [(), ("--no-async-scheduling", "--stream-interval", "4", "--seed", "7",
                                       "--max-model-len", "256", "--max-num-seqs", "8")])
def test_server_flags_are_the_engine_kwargs(serve_bench, tiny_dir, flags):
    from pyengine import EngineArgs
    from server.cli_args import engine_args_from, parse_args

    spec = _spec(serve_bench, tiny_dir, *flags)
    assert repr(serve_bench._serve_args(spec)) in serve_bench._serve_cmd(spec)[-1]
    got = engine_args_from(parse_args(serve_bench._serve_args(spec)))
    want = EngineArgs(**serve_bench._engine_kwargs(spec))
    names = [f.name for f in dataclasses.fields(EngineArgs)]  # (the server's are AsyncEngineArgs: a few more)
    assert {n: getattr(got, n) for n in names} == {n: getattr(want, n) for n in names}
    assert got.max_model_len == (256 if flags else 1024)


def test_capi_params_carry_max_model_len_and_device(serve_bench, tiny_dir):
    spec = _spec(serve_bench, tiny_dir, "--max-model-len", "512", "--max-num-seqs", "16", "--no-async-scheduling")
    argv, env, capi_kw = serve_bench.capi_engine_params(spec)
    assert argv == [str(tiny_dir), "16", "512", "1"]  # model, max_num_seqs, max_model_len, device (1: cpu)
    assert env == {"VENGINE_ASYNC_SCHED": "0"}
    assert capi_kw["max_model_len"] == 512 and capi_kw["async_scheduling"] is False
    serve_bench.check_capi_engine_config(spec)  # the same resolved config as the others'


def test_capi_refuses_what_it_cannot_carry(serve_bench, tiny_dir):
    # vllm_model_params has no seed or dtype field: a run that sets them otherwise than the
    # engine's defaults is refused for the C host, not run with other arguments
    with pytest.raises(ValueError, match=r"seed=0 \(others: 7\)"):
        serve_bench.check_capi_engine_config(_spec(serve_bench, tiny_dir, "--seed", "7"))
    with pytest.raises(ValueError, match="dtype"):
        serve_bench.check_capi_engine_config(_spec(serve_bench, tiny_dir, "--dtype", "bfloat16"))


def test_capi_driver_runs_with_the_runs_max_model_len(serve_bench, tiny_dir, monkeypatch):
    # The C driver itself: within max_model_len the level runs; past it (16 + 8 > 20) the
    # engine refuses the requests, which it would not with the model's own length
    serve_bench.ensure_weights(tiny_dir, "cpu", "float32", 0)
    monkeypatch.setenv(serve_bench.CORE_ENV, "0")  # (the engine loop on a thread: a quicker start)
    spec = _spec(serve_bench, tiny_dir, "--concurrency", "2", "--num-prompts", "2", "--input-len", "16",
                 "--output-len", "8", "--max-model-len", "64", "--max-num-seqs", "4")
    out = serve_bench.child_capi(spec)
    assert out["levels"]["2"]["completed"] == 2
    spec["max_model_len"] = 20
    with pytest.raises(RuntimeError, match="maximum context length is 20 tokens"):
        serve_bench.child_capi(spec)
