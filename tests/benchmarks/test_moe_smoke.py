"""benchmarks/moe.py's code paths on the CPU (``--cpu-smoke``: the tiny MoE shape, Triton
kernels under the interpreter), in a subprocess since TRITON_INTERPRET must be set
before triton is imported. The numbers are not checked; the JSON's shape and the sweep's
tile table are."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _require_triton() -> None:
    """triton is a test dependency on Linux (setup.py): there its absence fails."""
    if not sys.platform.startswith("linux") and importlib.util.find_spec("triton") is None:
        pytest.skip("triton is a test dependency on Linux only")
    import triton  # noqa: F401


def _run(*args, tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    env.pop("VENGINE_TRITON_OPS_ON_CPU", None)
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "moe.py"), "--cpu-smoke", "--out-dir",
                           str(tmp_path), *args], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.timeout(900)
def test_moe_benchmark_cpu_smoke(tmp_path):
    _require_triton()
    _run(tmp_path=tmp_path)
    res = json.loads((tmp_path / "moe_tiny.json").read_text())["results"]
    assert all("error" not in res[s] for s in ("kernels", "loading", "engine")), res
    rows = res["kernels"]["rows"]
    assert [r["m"] for r in rows] == [1, 40]
    assert rows[0]["tile_config"].get("small_batch") and "BLOCK_SIZE_M" in rows[1]["tile_config"]
    assert all(r["max_abs_diff_vs_fp32_loop"] < 1e-4 for r in rows)
    assert res["loading"]["checkpoint_mb"] > 0 and res["loading"]["load_s"] > 0
    eng = res["engine"]
    assert eng["batch1"]["tpot_ms"] > 0 and eng["batch1"]["floor_ms"] > 0
    assert eng["serving_workload"]["requests_short"] == 0 and eng["nano_vllm_workload"]["output_tokens"] > 0


@pytest.mark.timeout(900)
def test_moe_sweep_cpu_smoke_writes_a_loadable_table(tmp_path):
    _require_triton()
    _run("--sweep", tmp_path=tmp_path)
    from pyengine.layers.fused_moe import fused_moe

    table = fused_moe.load_tile_configs(8, 32, "cpu-interpreter", tmp_path / "configs")
    # each M's fastest path under the interpreter on a loaded machine is timing, not code: any
    # entry is a whole config of one of the two paths
    assert set(table) == {1, 40}
    assert all(cfg.get("small_batch") or "BLOCK_SIZE_M" in cfg for cfg in table.values()), table
    assert not list(fused_moe.CONFIG_DIR.glob("*cpu-interpreter*"))  # the smoke run never writes the repository's
    sweep = json.loads((tmp_path / "moe_sweep_tiny.json").read_text())["results"]["sweep"]
    assert sweep["32"]["written"].endswith("E=8,N=32,device_name=cpu-interpreter.json")
    # the GEMV path's split-K tiles are among the candidates, timed (they ran) for both passes
    assert {e.get("path") for e in sweep["32"]["log"]} >= {"gemv", "grouped"}  # both paths were candidates
    split = [e for e in sweep["32"]["log"] if e.get("path") == "gemv" and e.get("config", {}).get("SPLIT_K", 1) > 1]
    assert {e["pass"] for e in split} == {"w13", "w2"} and all(e["us"] < float("inf") for e in split)


def _check_profile(prof: dict, steps: int) -> None:
    """A CPU profile part's result: CPU ops (``aten::``) as its rows, per step."""
    assert "error" not in prof, prof
    assert prof["device"] == "cpu" and prof["steps"] == steps and prof["num_layers"] == 2
    rows = prof["kernels"]
    assert rows and all(r["name"].startswith("aten::") and r["calls_per_step"] > 0 for r in rows)
    assert [r["us_per_step"] for r in rows] == sorted((r["us_per_step"] for r in rows), reverse=True)
    assert {"gemm", "embedding"} <= set(prof["by_group"]) and prof["kernels_per_step"] > 0
    assert prof["gpu_busy_us_per_step"] > 0 and prof["wall_us_per_step"] >= prof["gpu_busy_us_per_step"]
    assert prof["unprofiled"]["wall_us_per_step"] > 0 and "forward" in prof["host_phases_us_per_step"]


@pytest.mark.timeout(300)
def test_moe_profile_cpu_smoke(tmp_path):
    """``--sections profile`` on the CPU (no triton needed): the engine section's engine,
    its batch-1 decode steps under torch.profiler; alone it writes moe_profile_tiny.json."""
    from benchmarks import moe

    moe.main(["--cpu-smoke", "--sections", "profile", "--out-dir", str(tmp_path), "--trace-dir",
              str(tmp_path / "trace")])
    res = json.loads((tmp_path / "moe_profile_tiny.json").read_text())["results"]
    assert set(res) == {"profile"} and not (tmp_path / "moe_tiny.json").exists()
    prof = res["profile"]
    _check_profile(prof, 6)
    assert prof["engine_args"]["max_num_seqs"] == 8 and prof["floor_us"] > 0
    assert list((tmp_path / "trace").glob("*.trace.json.gz"))


@pytest.mark.timeout(600)
def test_moe_benchmark_fp8_engine_cpu_smoke(tmp_path):
    """``--quantization fp8``: its own result file, the engine quantized at load, the floor
    counting a byte a quantized weight (below the bf16 floor of the same shape)."""
    _require_triton()
    _run("--sections", "engine", "--quantization", "fp8", tmp_path=tmp_path)
    payload = json.loads((tmp_path / "moe_fp8_tiny.json").read_text())
    eng = payload["results"]["engine"]
    assert "error" not in eng, eng
    assert eng["engine_args"]["quantization"] == "fp8" and eng["batch1"]["tpot_ms"] > 0
    from benchmarks.moe import moe_config, step_bytes

    cfg = moe_config("tiny")
    ctx = eng["batch1"]["input_len"] + eng["batch1"]["output_len"] // 2
    assert eng["batch1"]["bytes_per_step"]["experts"] < step_bytes(cfg, 4, 1, ctx)["experts"] / 3


@pytest.mark.timeout(600)
def test_moe_benchmark_gptq_engine_cpu_smoke(tmp_path):
    """``--quantization gptq``: a GPTQ W4A16 model directory of random valid weights, its own
    result file, the floor counting half a byte a quantized weight plus its group's scale."""
    _require_triton()
    _run("--sections", "engine", "--quantization", "gptq", tmp_path=tmp_path)
    eng = json.loads((tmp_path / "moe_gptq_tiny.json").read_text())["results"]["engine"]
    assert "error" not in eng, eng
    assert "quantization" not in eng["engine_args"] and eng["batch1"]["tpot_ms"] > 0
    from benchmarks.moe import moe_config, step_bytes

    cfg = moe_config("tiny")
    ctx = eng["batch1"]["input_len"] + eng["batch1"]["output_len"] // 2
    fp32 = step_bytes(cfg, 4, 1, ctx)["experts"]
    # 4 of 32 bits, plus a float32 scale per 16 weights (the tiny shape's groups): 6 of 32
    assert eng["batch1"]["bytes_per_step"]["experts"] == pytest.approx(fp32 * 6 / 32)
