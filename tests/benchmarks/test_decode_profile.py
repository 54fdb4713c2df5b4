"""benchmarks/decode_profile.py's trace analysis on synthetic CUDA traces shaped like a
batch-1 decode step under a CUDA graph (the kernel names the H200 traces show), so the
classes and roles are right before the one device run. No engine, no GPU."""
from __future__ import annotations

import gzip
import json

import pytest

from benchmarks import decode_profile as dp

DENSE_LAYER = ["_rms_norm_kernel", "_gemv_kernel", "_rope_cache_kernel", "_decode_split_kernel",
               "_decode_reduce_kernel", "_gemv_kernel", "_rms_norm_kernel", "_gemv_kernel", "_silu_and_mul_kernel",
               "_gemv_kernel"]
FP8_LAYER = ["_rms_norm_kernel", "_fp8_quant_kernel", "_fp8_gemv_kernel", "_rope_cache_kernel",
             "_decode_split_kernel", "_decode_reduce_kernel", "_fp8_quant_kernel", "_fp8_gemv_kernel",
             "_split_sum_kernel", "_rms_norm_kernel", "_fp8_quant_kernel", "_fp8_gemv_kernel",
             "_silu_and_mul_kernel", "_fp8_quant_kernel", "_fp8_gemv_kernel"]
MOE_LAYER = ["_rms_norm_kernel", "_gemv_kernel", "_rope_cache_kernel", "_decode_split_kernel",
             "_decode_reduce_kernel", "_gemv_kernel", "_rms_norm_kernel", "_gemv_kernel", "_topk_softmax_kernel",
             "_gemv_kernel", "_gemv_split_finish_kernel", "_gemv_down_sum_kernel"]
HEAD = ["Memcpy HtoD (Pageable -> Device)", "void at::native::indexSelectSmallIndex<c10::BFloat16, long>"]
TAIL = ["_rms_norm_kernel", "nvjet_sm90_tst_256x8_64x6_2x1_v_bz_TNT",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>>>",
        "Memcpy DtoH (Device -> Pinned)"]


def _trace(layer: list[str], layers: int, steps: int, dur: float = 2.0, gap: float = 1.0, lead: float = 10.0):
    """Events of ``steps`` decode steps (a marker after each, one before the first): every
    op ``dur`` us, ``gap`` us apart, ``lead`` us of idle after each marker."""
    events, t = [], 0.0

    def op(name, d):
        cat = "gpu_memcpy" if name.startswith("Memcpy") else "kernel"
        events.append({"ph": "X", "cat": cat, "name": name, "ts": t, "dur": d})

    op("void at::native::bitwise_not_kernel_cuda", 1.0)
    t += 1.0
    for _ in range(steps):
        t += lead
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": t - 5, "dur": 3})
        for name in HEAD + layer * layers + TAIL:
            op(name, dur)
            t += dur + gap
        t -= gap
        op("void at::native::bitwise_not_kernel_cuda", 1.0)
        t += 1.0
    return events


def test_dense_step_roles_and_times():
    layers, steps = 3, 4
    res = dp.analyze_cuda(_trace(DENSE_LAYER, layers, steps), layers)
    assert res["steps"] == steps
    per_step_ops = len(HEAD) + len(DENSE_LAYER) * layers + len(TAIL)
    assert res["gpu_ops_per_step"] == per_step_ops
    assert res["kernels_per_step"] == per_step_ops - 2  # two memcpys
    assert res["gpu_busy_us_per_step"] == pytest.approx(2.0 * per_step_ops)
    assert res["idle_inside_steps_us_per_step"] == pytest.approx(1.0 * (per_step_ops - 1))
    assert res["gaps_inside_per_step"] == per_step_ops - 1 and res["gap_inside_median_us"] == pytest.approx(1.0)
    assert res["idle_between_steps_us_per_step"] == pytest.approx(11.0)  # the marker + the lead
    assert res["wall_us_per_step"] == pytest.approx(res["gpu_busy_us_per_step"] + res["gpu_idle_us_per_step"])
    assert res["cuda_graph_launches_per_step"] == 1
    c = res["by_class"]
    for role in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        assert c[f"gemm:{role}"]["calls_per_step"] == layers, role
    assert c["gemm:lm_head"]["calls_per_step"] == 1
    assert c["norm"]["calls_per_step"] == 2 * layers + 1
    assert c["attention"]["calls_per_step"] == 2 * layers and c["rope"]["calls_per_step"] == layers
    assert c["act"]["calls_per_step"] == layers and c["sampling"]["calls_per_step"] == 1
    assert c["memcpy"]["calls_per_step"] == 2 and c["embedding"]["calls_per_step"] == 1
    assert "marker" not in c and "other" not in c
    g = res["by_group"]
    assert g["gemm"]["calls_per_step"] == 4 * layers + 1
    assert g["gemm"]["us_per_step"] == pytest.approx(2.0 * (4 * layers + 1))
    assert g["gemm"]["us_per_layer"] == pytest.approx(g["gemm"]["us_per_step"] / layers)
    # one row per (kernel, class), sorted by time; the GEMV rows split by role
    rows = res["kernels"]
    assert [r["us_per_step"] for r in rows] == sorted((r["us_per_step"] for r in rows), reverse=True)
    gemv = {r["class"] for r in rows if r["name"] == "_gemv_kernel"}
    assert gemv == {"gemm:qkv_proj", "gemm:o_proj", "gemm:gate_up_proj", "gemm:down_proj"}
    assert all(r["mean_us"] == pytest.approx(2.0) for r in rows)
    assert sum(r["share_of_busy"] for r in rows) == pytest.approx(1.0)


def test_fp8_quant_and_split_sum_take_the_gemv_role():
    res = dp.analyze_cuda(_trace(FP8_LAYER, 2, 3), 2)
    c = res["by_class"]
    for role in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        assert c[f"quant:{role}"]["calls_per_step"] == 2, role
    assert c["gemm:o_proj"]["calls_per_step"] == 4  # the GEMV and its split-K sum
    assert c["gemm:qkv_proj"]["calls_per_step"] == 2 and c["gemm:lm_head"]["calls_per_step"] == 1


def test_moe_step_router_and_experts():
    layers = 2
    res = dp.analyze_cuda(_trace(MOE_LAYER, layers, 3), layers)
    c = res["by_class"]
    assert c["gemm:qkv_proj"]["calls_per_step"] == layers and c["gemm:o_proj"]["calls_per_step"] == layers
    assert "gemm:gate_up_proj" not in c and "gemm:down_proj" not in c
    assert c["topk_router:router"]["calls_per_step"] == layers
    assert c["topk_router:topk"]["calls_per_step"] == layers
    assert c["moe_gemm:w13"]["calls_per_step"] == 2 * layers  # the partials and their finish
    assert c["moe_gemm:w2"]["calls_per_step"] == layers
    assert c["gemm:lm_head"]["calls_per_step"] == 1
    moe_gemv = [r for r in res["kernels"] if r["name"] == "_gemv_kernel" and r["group"] == "moe_gemm"]
    assert len(moe_gemv) == 1 and moe_gemv[0]["role"] == "w13"


def test_too_few_markers_is_an_error_not_a_crash(tmp_path):
    ev = [{"ph": "X", "cat": "kernel", "name": "_gemv_kernel", "ts": 0.0, "dur": 1.0}]
    assert "error" in dp.analyze_cuda(ev, 1)
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _trace(DENSE_LAYER, 1, 2)}, f)
    assert dp.analyze_trace(str(path), True, 2, 1)["steps"] == 2


def test_cpu_self_times_take_nested_ops_off():
    ev = [{"ph": "X", "cat": "cpu_op", "name": "aten::linear", "ts": 0.0, "dur": 10.0, "tid": 1},
          {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1.0, "dur": 6.0, "tid": 1},
          {"ph": "X", "cat": "cpu_op", "name": "aten::softmax", "ts": 20.0, "dur": 4.0, "tid": 1}]
    res = dp.analyze_cpu(ev, 2, 1)
    rows = {r["name"]: r for r in res["kernels"]}
    assert rows["aten::linear"]["us_per_step"] == pytest.approx(2.0) and rows["aten::mm"]["us_per_step"] == 3.0
    assert res["gpu_busy_us_per_step"] == pytest.approx(7.0)  # the top-level ops' union, per step
    assert res["by_group"]["gemm"]["calls_per_step"] == 1.0 and rows["aten::softmax"]["group"] == "sampling"


def test_markdown(tmp_path):
    res = dp.analyze_cuda(_trace(MOE_LAYER, 2, 3), 2)
    res.update(unprofiled={"wall_us_per_step": 1.0}, warnings=["w"])
    text = dp.report_md("t", res)
    assert "moe_gemm:w13" in text and "**warning**: w" in text and "graph launches/step 1.0" in text
    table = dp.compare_md({"a": res, "b": res, "bad": {"error": "x"}})
    assert "| group (us/step) | a | b |" in table and "moe_gemm" in table
