"""benchmarks/quant.py on the tiny shape on CPU: every part's code path (the engines with
FP8 at load, dummy GPTQ INT4 weights and the FP8 KV cache; the kernel and attention parts
under the triton interpreter), so the H200 run works the first time. Numbers unchecked."""
from __future__ import annotations

import json
import os

import pytest

from benchmarks import common, quant


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return common.make_model_dir("tiny", tmp_path_factory.mktemp("bench_quant_tiny"))


def _args(tiny_dir, out, *extra):
    return [str(out), "--device", "cpu", "--shape", "tiny", "--model-dir", str(tiny_dir), "--group-size", "32",
            *extra]


def test_engine_parts(tiny_dir, tmp_path):
    res = quant.main(_args(tiny_dir, tmp_path, "--parts", "tpot,throughput,kv", "--output-len", "4", "--iters", "1",
                           "--num-requests", "3", "--min-len", "4", "--max-len", "12"))
    e = res["engines"]
    assert set(e) == {"bf16", "fp8", "w4a16", "fp8_kv"}
    assert e["fp8"]["quantization"] == "fp8" and e["w4a16"]["quantization"] == "gptq"
    assert all(e[v]["tpot_ms"] > 0 for v in ("bf16", "fp8", "w4a16"))
    assert e["fp8"]["throughput"]["output_tokens"] > 0
    assert e["fp8_kv"]["kv"]["kv_cache_dtype"] == "fp8"
    # float32 on CPU: an FP8 block is a quarter of the model dtype's (bf16 on the GPU: half)
    assert e["fp8_kv"]["kv"]["bytes_per_block"] * 4 == e["bf16"]["kv"]["bytes_per_block"]
    saved = json.loads((tmp_path / "quant.json").read_text())
    assert set(saved["ratios"]) == set(quant.TARGETS)


def test_throughput_with_the_fp8_kv_cache(tiny_dir, tmp_path):
    res = quant.main(_args(tiny_dir, tmp_path, "--parts", "throughput", "--throughput-fp8-kv",
                           "--num-requests", "3", "--min-len", "4", "--max-len", "12"))
    e = res["engines"]
    assert set(e) == {"bf16", "fp8", "fp8_fp8kv"}
    assert e["fp8_fp8kv"]["quantization"] == "fp8" and e["fp8_fp8kv"]["throughput"]["output_tokens"] > 0
    assert e["fp8_fp8kv"]["kv_cache_dtype"] == "fp8" and e["fp8"]["kv_cache_dtype"] != "fp8"
    assert res["ratios"]["throughput_fp8_fp8kv_over_bf16"] > 0 and res["ratios"]["throughput_fp8_over_bf16"] > 0
    runs = e["bf16"]["throughput"]["runs_output_tok_s"]  # --throughput-repeats 2 (default): the best reported
    assert len(runs) == 2 and e["bf16"]["throughput"]["output_tok_s"] == max(runs)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="set TRITON_INTERPRET=1")
def test_kernel_parts(tiny_dir, tmp_path):
    res = quant.main(_args(tiny_dir, tmp_path, "--parts", "kernels,attention", "--sweep"))
    assert [r["layer"] for r in res["kernels"]["rows"]] == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    assert all(r["sweep"]["fp8_gemv_best"] in r["sweep"]["fp8_gemv_us"] for r in res["kernels"]["rows"])
    assert res["attention"]["rows"][0]["fp8_us"] > 0


def test_profile_part(tiny_dir, tmp_path):
    """``--parts profile``: bf16, FP8 and W4A16 engines, batch-1 decode steps under
    torch.profiler each (CPU ops as rows here); alone it writes quant_profile.json."""
    res = quant.main(_args(tiny_dir, tmp_path, "--parts", "profile", "--profile-steps", "5", "--profile-warmup-steps",
                           "2", "--profile-timed-steps", "3"))
    prof = res["profile"]
    assert set(prof) == {"bf16", "fp8", "w4a16"}
    for r in prof.values():
        assert "error" not in r and r["device"] == "cpu" and r["steps"] == 5, r
        rows = r["kernels"]
        assert rows and all(x["name"].startswith("aten::") and x["calls_per_step"] > 0 for x in rows)
        assert "gemm" in r["by_group"] and r["gpu_busy_us_per_step"] > 0 and r["unprofiled"]["wall_us_per_step"] > 0
    assert prof["fp8"]["quantization"] == "fp8" and prof["w4a16"]["quantization"] == "gptq"
    assert set(res["profile_ratios"]) == {"fp8_over_bf16", "w4a16_over_bf16"}
    assert (tmp_path / "quant_profile.json").is_file() and not (tmp_path / "quant.json").exists()


def test_layer_shapes_option():
    """``--layer-shapes``: the kernels part's layers by name and (N, K), refused unless NAME=NxK."""
    import argparse

    args = quant.build_parser().parse_args(["out", "--layer-shapes", "qkv_proj=5120x2048, o_proj=2048x4096"])
    assert args.layer_shapes == {"qkv_proj": (5120, 2048), "o_proj": (2048, 4096)}
    assert quant.build_parser().parse_args(["out"]).layer_shapes is None
    for bad in ("qkv_proj=5120", "=64x64", "a=0x64", "a=64xb", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            quant._parse_layer_shapes(bad)
