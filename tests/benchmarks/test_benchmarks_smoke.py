"""Smoke tests of the benchmark scripts: each script's main() on the tiny shape on the CPU
with a handful of requests, so a broken script shows up in CI. The numbers are not checked
(the GPU runs are what count); the shapes of the JSON results are."""
from __future__ import annotations

import json

import pytest

from benchmarks import async_sched, common, gpu_idle, latency, preemption, throughput


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return common.make_model_dir("tiny", tmp_path_factory.mktemp("bench_tiny"))


def _cpu(tiny_dir, tmp_path, name):
    out = tmp_path / f"{name}.json"
    return ["--device", "cpu", "--shape", "tiny", "--model-dir", str(tiny_dir), "--json", str(out)], out


def test_make_model_dir_shapes(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    for shape, arch, layers in (("qwen3-0.6b", "Qwen3ForCausalLM", 28), ("llama-3.1-8b", "LlamaForCausalLM", 32)):
        d = common.make_model_dir(shape, tmp_path / shape)
        cfg = AutoConfig.from_pretrained(str(d))
        assert cfg.architectures == [arch] and cfg.num_hidden_layers == layers
        assert cfg.num_key_value_heads == 8 and cfg.head_dim == 128
        assert AutoTokenizer.from_pretrained(str(d)).eos_token == "</s>"
    q = AutoConfig.from_pretrained(str(tmp_path / "qwen3-0.6b"))
    assert (q.hidden_size, q.vocab_size, q.intermediate_size, q.tie_word_embeddings) == (1024, 151936, 3072, True)
    ll = AutoConfig.from_pretrained(str(tmp_path / "llama-3.1-8b"))
    assert (ll.hidden_size, ll.vocab_size, ll.intermediate_size) == (4096, 128256, 14336)
    assert ll.rope_parameters["rope_type"] == "llama3" and ll.rope_parameters["rope_theta"] == 500000.0


def test_helpers():
    start, end, busy, gaps = gpu_idle.busy_union([(0, 10), (5, 12), (20, 30), (29, 31), (40, 41)])
    assert (start, end, busy, gaps) == (0, 41, 24, [8, 9])
    table = common.md_table(["a", "b"], [[1, 2.5], ["x", None]])
    assert table.splitlines()[0] == "| a | b |" and "n/a" in table
    ps = common.random_prompts(5, 3, 7, vocab_size=100, seed=0)
    assert len(ps) == 5 and all(3 <= len(p) <= 7 and max(p) < 100 for p in ps)
    assert ps == common.random_prompts(5, 3, 7, vocab_size=100, seed=0)


def test_cuda_required_message(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="CUDA is not available"):
        throughput.main(["--shape", "tiny", "--num-requests", "1"])


def test_throughput_smoke(tiny_dir, tmp_path):
    args, out = _cpu(tiny_dir, tmp_path, "throughput")
    res = throughput.main(args + ["--num-requests", "3", "--min-len", "4", "--max-len", "12"])
    ours = res["results"]["ours"]
    assert ours["requests_short"] == 0 and ours["output_tokens"] > 0 and ours["output_tok_s"] > 0
    assert json.loads(out.read_text())["results"]["ours"]["output_tokens"] == ours["output_tokens"]


def test_latency_smoke(tiny_dir, tmp_path):
    args, out = _cpu(tiny_dir, tmp_path, "latency")
    res = latency.main(args + ["--batch-sizes", "1,2", "--input-len", "8", "--output-len", "6", "--iters", "1"])
    assert [r["batch"] for r in res["results"]] == [1, 2]
    assert all(r["tpot_ms"] > 0 for r in res["results"])
    assert out.is_file()


def test_gpu_idle_smoke(tiny_dir, tmp_path):
    args, out = _cpu(tiny_dir, tmp_path, "gpu_idle")
    res = gpu_idle.main(args + ["--batch", "2", "--input-len", "8", "--warmup-steps", "1", "--timed-steps", "3",
                                "--profile-steps", "2"])
    assert set(res["results"]) == {"on", "off"} and res["ratio_on_off_decode_tok_s"] > 0
    assert res["results"]["on"]["idle_fraction"] is None  # no profile on the CPU
    assert out.is_file()


def test_async_sched_smoke(tiny_dir, tmp_path):
    args, out = _cpu(tiny_dir, tmp_path, "async_sched")
    res = async_sched.main(args + ["--concurrency", "1,2", "--min-requests", "2", "--requests-per-client", "1",
                                   "--input-len", "8", "--output-len", "4"])
    for mode in ("on", "off"):
        levels = res["results"][mode]["levels"]
        assert [lv["concurrency"] for lv in levels] == [1, 2]
        assert all(lv["output_tokens"] == lv["requests"] * 4 for lv in levels)
    assert set(res["ratios"]) == {1, 2}
    assert out.is_file()


def test_host_overhead_smoke(tmp_path):
    from benchmarks import host_overhead

    out = tmp_path / "host.json"
    res = host_overhead.main(["--batch-sizes", "1,4", "--steps", "12", "--json", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert [r["batch"] for r in rows] == [1, 4] == [r["batch"] for r in res["results"]]
    assert all(r["schedule_ms"] > 0 and r["process_outputs_ms"] > 0 for r in rows)


def test_gpu_idle_split_between_and_inside_steps():
    # two steps: ops 0-10, 11-20 (1 us bubble), marker at 21-22, next step 30-40 with a 2 us bubble
    ops = [(0, 10), (11, 20), (30, 35), (37, 40)]
    between, inside = gpu_idle.split_idle(ops, [(21, 22)])
    assert (between, inside) == (10, 3)
    assert gpu_idle.split_idle(ops, []) == (0, 13)
    # a marker overlapping busy time (another stream) marks no gap
    assert gpu_idle.split_idle(ops, [(4, 6)]) == (0, 13)


def test_gpu_idle_window_between_first_and_last_marker():
    # an op queued before the profiler started (0-1), a 50 us profiler start-up gap, then
    # two steps separated by markers at 60-61, 80-81, 100-101
    ops = [(0, 1), (51, 59), (62, 70), (72, 79), (83, 99), (102, 110)]
    markers = [(60, 61), (80, 81), (100, 101)]
    clipped, win = gpu_idle.clip_to_markers(ops, markers)
    assert win == (60, 101)
    start, end, busy, _ = gpu_idle.busy_union(clipped)
    assert (start, end, busy) == (60, 101, 8 + 7 + 16)
    between, inside = gpu_idle.split_idle(clipped, markers)
    assert (between, inside) == (2 + 4 + 2, 2)
    assert gpu_idle.clip_to_markers(ops, markers[:1]) == (ops, None)
    top = gpu_idle.top_gaps(ops, markers, k=2)
    assert [(g["gap_us"], g["markers_before"]) for g in top] == [(50, 0), (4, 1)]


def test_tp_smoke(tmp_path):
    from benchmarks import tp

    out = tmp_path / "tp.json"
    res = tp.main(["--device", "cpu", "--latency-shape", "tiny", "--no-throughput", "--output-len", "4",
                   "--iters", "1", "--json", str(out)])
    t = res["summary"]["tpot_ms"]["tiny"]
    assert t[1] > 0 and t[2] > 0 and t["ratio"] == t[2] / t[1]
    assert res["runs"]["latency"]["tiny"][2]["results"][0]["tensor_parallel_size"] == 2
    assert json.loads(out.read_text())["summary"]["tpot_ms"]["tiny"]["2"] == t[2]


def test_tp_step_broadcast_smoke(tmp_path):
    from benchmarks import tp_step_broadcast

    res = tp_step_broadcast.main(["--iters", "2", "--json", str(tmp_path / "b.json")])
    assert set(res["results"]) == set(tp_step_broadcast.SCENARIOS)
    assert all(r["pack_us"] > 0 and "packed_us" in r and "shm_us" in r and "cbor2_total_us" in r for r in res["results"].values())


def test_preemption_smoke(tiny_dir, tmp_path):
    args, out = _cpu(tiny_dir, tmp_path, "preemption")
    res = preemption.main(args + ["--modes", "on", "--num-long", "2", "--long-tokens", "40", "--num-short", "4",
                                  "--short-tokens", "8", "--num-blocks", "6"])
    r = res["results"]["on"]
    assert r["preemptions_total"] > 0 and r["short_preemptions"]["max"] <= 1
    assert json.loads(out.read_text())["results"]["on"]["steps"] == r["steps"]


def test_structured_smoke(tiny_dir, tmp_path):
    from benchmarks import structured

    out = tmp_path / "structured.json"
    res = structured.main(["--smoke", "--model-dir", str(tiny_dir), "--json", str(out)])
    run = res["runs"]["json_schema"][0]
    n = res["args"]["num_prompts"]
    # every request ran to its token limit under the schema, and its ids are ones the
    # grammar accepts; the engine filled one bitmask row per constrained token
    assert run["full_length_requests"] == run["grammar_accepts_output"] == n
    assert run["grammar_bitmask_rows"] == run["output_tokens"] == n * res["args"]["output_len"]
    assert run["grammar_bitmask_us_per_row"] > 0
    free = res["runs"]["unconstrained"][0]
    assert free["grammar_bitmask_steps"] == 0 and free["full_length_requests"] == n
    assert res["ratio_json_schema_vs_unconstrained"] > 0
    assert json.loads(out.read_text())["summary"].keys() == {"unconstrained", "json_schema"}


def test_tp_profile_smoke(tmp_path):
    from benchmarks import tp_profile

    res = tp_profile.main(["--device", "cpu", "--shape", "tiny", "--model-dir", str(tmp_path / "m"), "--configs", "2",
                           "--warmup-steps", "2", "--timed-steps", "6", "--profile-steps", "3", "--max-model-len", "128",
                           "--trace-dir", str(tmp_path / "traces"), "--json", str(tmp_path / "p.json")])
    r = res["results"]["2"]
    assert r["tensor_parallel_size"] == 2 and r["timed"]["tokens"] == 6
    ph = r["timed"]["rank_phases"]
    # each rank timed its own phases in its own process, once per step
    assert set(ph["0"]) >= {"pack", "send", "prepare", "forward", "logits", "sample", "token_bcast"}
    assert set(ph["1"]) >= {"recv", "prepare", "forward", "logits", "token_bcast"}
    assert ph["1"]["forward"]["count"] == 6
    assert set(r["timed"]["rank0_engine_phases"]) >= {"schedule", "wait", "update", "output"}
    # both ranks wrote a trace with the phases as record_function ranges
    assert set(r["profiled"]) == {"0", "1"}
    assert r["profiled"]["1"]["host_phases_from_trace_ms"]["forward"] > 0
    assert sorted(p.name for p in (tmp_path / "traces" / "tp2").glob("*.trace.json.gz")) == \
        ["rank0-w1.trace.json.gz", "rank1-w1.trace.json.gz"]


def test_tp_profile_analyze_trace(tmp_path):
    from benchmarks import tp_profile

    def k(name, ts, dur, corr=None, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 7,
                "args": {} if corr is None else {"correlation": corr}}
    # three steps between four markers (-2, 20, 70, 90): step 1 = gemm 0-10, all-reduce 12-20
    # (waited for the peer); a 30 us gap the host caused (the graph launched in "forward" at
    # 45); step 2 = gemm 51-60, all-reduce 60-62, argmax 62-65; step 3 = one copy
    events = [k("bitwise_not_kernel", -2, 1), k("sm90_xmma_gemm_bf16", 0, 10), k("ncclDevKernel_AllReduce_Sum", 12, 8),
              k("bitwise_not_kernel", 20, 1), k("sm90_xmma_gemm_bf16", 51, 9, corr=5),
              k("ncclDevKernel_AllReduce_Sum", 60, 2), k("reduce_kernel<ArgMaxOps>", 62, 3),
              k("bitwise_not_kernel", 70, 1), k("Memcpy HtoD", 80, 2, cat="gpu_memcpy"), k("bitwise_not_kernel", 90, 1),
              k("cudaGraphLaunch", 45, 3, corr=5, cat="cuda_runtime"), k("forward", 40, 10, cat="user_annotation")]
    path = tmp_path / "t.json.gz"
    import gzip
    with gzip.open(path, "wt") as f:
        json.dump({"baseTimeNanoseconds": 1_000_000, "traceEvents": events}, f)
    a = tp_profile.analyze_trace(str(path), top_k=2)
    assert a["steps"] == 3 and a["window_us"] == 93  # marker -2 .. 91
    busy = 10 + 8 + 9 + 2 + 3 + 2
    assert a["gpu_busy_us_per_step"] == pytest.approx(busy / 3)
    assert a["by_class"]["all_reduce"]["count"] == 2 and a["by_class"]["all_reduce"]["min_us"] == 2
    assert a["by_class"]["all_reduce"]["beyond_fastest_per_step_us"] == pytest.approx(6 / 3)
    assert a["by_class"]["gemm"]["total_us"] == 19 and a["by_class"]["sampling"]["total_us"] == 3
    assert a["by_class"]["copy"]["total_us"] == 2 and "marker" not in [t["name"] for t in a["top_kernels"]]
    g = a["top_gaps"][0]  # 20 -> 51: between steps (marker 20-21 inside), launched by the graph in "forward"
    assert g["gap_us"] == 31 and g["between_steps"] and g["before"] == "ncclDevKernel_AllReduce_Sum"
    assert g["after"] == "sm90_xmma_gemm_bf16" and g["after_launch_phase"] == "forward"
    assert g["after_launch_lead_us"] == 6
    assert a["window_abs_us"] == [1000 - 2, 1000 + 91]
    assert tp_profile.kernel_class("ncclDevKernel_SendRecv") == "gather"
    assert tp_profile.kernel_class("ncclDevKernel_Broadcast_RING_LL") == "broadcast"
    assert tp_profile.kernel_class("one_shot_all_reduce_kernel") == "all_reduce"
    assert tp_profile.kernel_class("_decode_split_kernel") == "attention"
    assert tp_profile.kernel_class("_rope_cache_kernel") == "norm_rope_act"
    assert tp_profile.kernel_class("_rms_norm_kernel") == "norm_rope_act"


def test_host_overhead_quantile(tmp_path):
    """--quantile reports a quantile of the per-call times (greedy here); out of [0, 1] is refused."""
    from benchmarks import host_overhead

    res = host_overhead.main(["--batch-sizes", "4", "--steps", "12", "--temperature", "0", "--quantile", "0.5"])
    row = res["results"][0]
    assert row["batch"] == 4 and row["steps"] > 0
    assert all(row[f"{ph}_ms"] > 0 for ph in ("schedule", "_prepare_inputs", "metadata", "update_from_output",
                                                "process_outputs"))
    assert row["wall_ms_per_step"] >= row["schedule_ms"]
    with pytest.raises(SystemExit):
        host_overhead.main(["--batch-sizes", "1", "--quantile", "1.5"])
