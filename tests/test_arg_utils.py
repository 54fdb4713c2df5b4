"""pyengine.arg_utils: dataclass fields -> argparse flags, and back."""
from __future__ import annotations

import argparse
import dataclasses
import enum
import json
from dataclasses import dataclass, field
from typing import Literal

import pytest

from pyengine import EngineArgs
from pyengine.arg_utils import add_dataclass_args, attribute_docs, field_kwargs, flag_name, from_namespace
from pyengine.config import AsyncEngineArgs


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclass
class Sample:
    count: int = 3
    """How many."""
    ratio: float | None = None
    """A ratio; None: unset."""
    mode: Literal["a", "b"] = "a"
    """The mode."""
    color: Color = Color.RED
    """An enum."""
    switch: bool = False
    """A switch."""
    tri: bool | None = None
    """Unset, on or off."""
    names: str | list[str] | None = None
    """One or more names."""
    extra: dict | None = None
    """A JSON object."""
    hidden: int = field(default=0, metadata={"cli": False})
    short: int = field(default=1, metadata={"flags": ("-s",), "help": "From metadata."})


def _parse(argv):
    p = argparse.ArgumentParser()
    add_dataclass_args(p, Sample)
    return from_namespace(Sample, p.parse_args(argv))


def test_attribute_docstrings_are_the_help():
    docs = attribute_docs(Sample)
    assert docs["count"] == "How many." and docs["names"] == "One or more names."
    kw = field_kwargs(Sample)
    assert kw["short"]["help"] == "From metadata." and "hidden" not in kw


def test_types_become_flags():
    assert _parse([]) == Sample()
    got = _parse(["--count", "5", "--ratio", "0.5", "--mode", "b", "--color", "blue", "--switch",
                  "--no-tri", "--names", "x", "y", "--extra", '{"k": 1}', "-s", "9"])
    assert got == Sample(count=5, ratio=0.5, mode="b", color=Color.BLUE, switch=True, tri=False,
                         names=["x", "y"], extra={"k": 1}, short=9)
    assert _parse(["--ratio", "None", "--tri"]).ratio is None and _parse(["--tri"]).tri is True


@pytest.mark.parametrize("argv", [["--mode", "c"], ["--color", "green"], ["--count", "x"], ["--extra", "[1]"],
                                  ["--extra", "{"], ["--hidden", "1"]])
def test_bad_values_are_argparse_errors(argv):
    with pytest.raises(SystemExit):
        _parse(argv)


def test_every_engine_arg_is_a_documented_flag():
    kw = field_kwargs(AsyncEngineArgs)
    assert set(kw) == {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    assert not [name for name, k in kw.items() if not k["help"]], "fields without a docstring"


def test_engine_args_round_trip_through_the_command_line(tmp_path):
    # a non-default value for every field, spelled as flags, parses back to the same EngineArgs
    values = dict(model="m", tokenizer="t", dtype="bfloat16", device="cpu", max_model_len=128, max_num_seqs=8,
                  max_num_batched_tokens=64, block_size=32, num_gpu_blocks_override=10, kv_cache_memory_bytes=1 << 20,
                  gpu_memory_utilization=0.5, enable_prefix_caching=False, enable_chunked_prefill=False,
                  long_prefill_token_threshold=4, scheduling_policy="priority", seed=7, async_scheduling=False,
                  enforce_eager=True, attention_backend="triton", served_model_name=["a", "b"], load_format="dummy",
                  stream_interval=2, tensor_parallel_size=2, enable_expert_parallel=True, trust_remote_code=True,
                  generation_config="vllm",
                  override_generation_config={"temperature": 0.5}, max_logprobs=-1, disable_log_stats=True,
                  enable_log_requests=True, quantization="fp8", kv_cache_dtype="fp8", data_parallel_size=2,
                  kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq"},
                  speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert set(values) == {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    argv = []
    for name, v in values.items():
        if isinstance(v, bool):
            argv.append(flag_name(name) if v else "--no-" + flag_name(name)[2:])
        elif isinstance(v, list):
            argv += [flag_name(name), *v]
        elif isinstance(v, dict):
            argv += [flag_name(name), json.dumps(v)]
        else:
            argv += [flag_name(name), str(v)]
    p = argparse.ArgumentParser()
    AsyncEngineArgs.add_cli_args(p)
    assert AsyncEngineArgs.from_cli_args(p.parse_args(argv)) == AsyncEngineArgs(**values)
    # EngineArgs takes only its own fields from a namespace that has more
    assert EngineArgs.from_cli_args(p.parse_args(argv)) == EngineArgs(
        **{k: v for k, v in values.items() if k != "enable_log_requests"})


@pytest.mark.parametrize("text, value", [("32768", 32768), ("32k", 32000), ("32K", 32768), ("1.5k", 1500),
                                         ("25.6k", 25600), ("4G", 4 << 30), ("2m", 2_000_000)])
def test_sizes_may_have_a_suffix(text, value):
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    args = EngineArgs.from_cli_args(p.parse_args(["--max-model-len", text, "--kv-cache-memory-bytes", text]))
    assert args.max_model_len == value and args.kv_cache_memory_bytes == value
    assert EngineArgs.from_cli_args(p.parse_args(["--max-model-len", "None"])).max_model_len is None


@pytest.mark.parametrize("text", ["1.5", "1.0005k", "32x", "k"])
def test_bad_sizes_are_refused(text):
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    with pytest.raises(SystemExit):
        p.parse_args(["--max-model-len", text])
