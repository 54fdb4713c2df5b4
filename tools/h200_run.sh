#!/usr/bin/env bash
# Everything this project measures on the H200, in one device call (device time is scarce):
# the GPU test suite, then every benchmark. Results land in $OUT (the device tool's folder):
# all.log (every command's tail) plus one JSON per benchmark — 8 files at most come back.
#
#   run this on the device with `.whl` carried (`bash ../shared/tools/device-wheels.sh flask-cors xgrammar
#   apache-tvm-ffi jsonschema jsonschema-specifications referencing rpds-py attrs pyzmq anthropic docstring-parser py-spy
#   msgspec opentelemetry-api`, and
#   compressed-tensors loguru with `pip download --no-deps --only-binary=:all: --python-version 3.12`: the image lacks those too):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site:$PWD && bash tools/h200_run.sh [STEP ...]
# STEP: moe_bf16_vs_int int4_sweep_moe_attn gpu_intmoe_shape int_moe_ab gpu_intmoe_k int_tiles_ab moe_int_profile_nopdl moe_profile_nopdl quant_profile_nopdl gpu_loader moe_int_profile gpu_intmoe moe_int_bench gpu_fp8moe moe_fp8_bench gpu_seeded fp8kv_throughput gpu_int4 gpu_half2 gpu_int_stream int4_sweep tpot_after tpot_pdl_ex int4_forms fp8_sweep half2_profile quant_tpot moe_profile quant_profile pdl_quant pdl_moe pdl_variants pdl_bench pdl_throughput gpu_spec spec_diag spec_diag_draft spec_bench spec_host spec_bench_draft spec_bench_draft_deep spec_bench_draft_long gpufix_tests gpufix_quant_kernels moe_quick_sweep gemv_sweep gpufix_moe_kernels gpu_moe moe_sweep moe_bench gpu_quant quant_bench gpu_ops gpu_e2e gpu_mp throughput throughput_async throughput_noasync latency gpu_idle gpu_idle_b256
#       async_sched attention serve_before serve_mp serve_inproc serve_final_mp serve_final_inproc gpu_quick
#       serve_final2 structured gpu_structured serve_default perfreg_after perfreg_before perfreg_after_256
#       house_after house_before house_after2 diag_after diag_before idle_after idle_before capi_after capi_before gpu_all gpu_core gpu_qm gpu_qm2
# serve_before runs the serving suite on the code of .bench_before/ (an ignored copy of an older
# commit with today's benchmarks/ laid over it; carry it): the "before" of a serving change.
# (default: all), and on a 2-GPU machine gpu_tp gpu_tp_spec tp tp_step_broadcast tp_profile (tools/tp_h200x2.sh).
# A device call is capped at 10 minutes: split the steps over two calls
# (e.g. `gpu_ops gpu_e2e latency gpu_idle attention` then the rest).
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1
# No NVLink multicast (NVLS) on these machines; NCCL's own warnings go to the logs.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
LOG="$OUT/all.log"
WANT=" ${*:-gpu_ops gpu_e2e throughput throughput_noasync latency gpu_idle async_sched attention} "
step() {  # step SECONDS NAME CMD...
  local t=$1 name=$2; shift 2
  [[ "$WANT" == *" $name "* ]] || return 0
  echo "=== $name: $* (limit ${t}s)" | tee -a "$LOG"
  local start=$SECONDS
  timeout "$t" "$@" > "$OUT/.$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/.$name.log" | grep -v "Writing model shards\|Loading weights" >> "$LOG"
  echo "=== $name rc=$rc in $((SECONDS - start))s" | tee -a "$LOG"
  # a failing step's log comes back whole (8 files at most come back); the rest only as the tail above
  if [[ $rc != 0 ]]; then mv "$OUT/.$name.log" "$OUT/$name.log"; else rm -f "$OUT/.$name.log"; fi
}
{ nvidia-smi -L; python3 -c "import torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())"; } >> "$LOG" 2>&1
# INT4 / INT8 MoE experts (issue 26 on MoE; first GPU run 2026-12-07, fourth session: tests pass on an H100): their kernels against the
# dequantized weights, the models token-exact in float32, then the Qwen3-30B-A3B shape as a GPTQ W4A16 checkpoint
# (random valid weights) next to bf16 in one call, the card's bandwidth for the floor
step 420 gpu_intmoe python3 -m pytest -q -m gpu tests/layers/fused_moe/test_fused_moe_int.py tests/quantization/test_kernel_path.py tests/ops/test_pdl.py tests/models/test_loader.py -k "int or moe or test_loader" -p no:cacheprovider --tb=short --durations=8 -o faulthandler_timeout=200
step 480 moe_int_bench bash -c 'BW=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && echo 4.8 || echo 3.35); for q in none gptq; do python3 benchmarks/moe.py --sections engine --nano-requests 0 --bandwidth-tbs $BW $([ $q = gptq ] && echo --quantization gptq) --out-dir "$0" || exit 1; done' "$OUT"
# FP8 MoE experts (issues 25, 26): their kernels and models on the GPU (dequantized-weight references, float32
# token-exact), then the Qwen3-30B-A3B shape's engine in bf16 and quantized at load (batch-1 TPOT against the
# floor of the bytes a step reads, the serving workload), each in a process of its own, the card's bandwidth for the floor
step 420 gpu_fp8moe python3 -m pytest -q -m gpu tests/layers/fused_moe tests/models/test_moe.py tests/quantization/test_kernel_path.py tests/quantization/test_moe_quant.py -k "moe or fp8" -p no:cacheprovider --tb=short --durations=8 -o faulthandler_timeout=200
step 480 moe_fp8_bench bash -c 'BW=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && echo 4.8 || echo 3.35); for q in none fp8; do python3 benchmarks/moe.py --sections engine --nano-requests 0 --bandwidth-tbs $BW $([ $q = fp8 ] && echo --quantization fp8) --out-dir "$0" || exit 1; done' "$OUT"
# kernels first (fast, and a failure there explains any end-to-end failure), then token-exactness
# every GPU test in one process (the 2-GPU ones skip on one GPU); about 400 s
# the same without the quantization and MoE kernel tests (their own steps: gpufix_tests, gpu_quant, gpu_moe): the engine,
# runner, attention, fused ops, speculative decoding, front ends; about 450 s
step 500 gpu_core python3 -m pytest -q -m gpu tests --ignore=tests/ops/test_quant_ops.py --ignore=tests/layers/fused_moe --ignore=tests/quantization --ignore=tests/models/test_moe.py -p no:cacheprovider --tb=short --durations=15 -o faulthandler_timeout=200 --continue-on-collection-errors
# the rest of the GPU suite: the quantization and MoE kernels and models (12-02: test_quant_ops alone took the first 300 s: two steps, a call each)
step 360 gpu_qm python3 -m pytest -q -m gpu tests/ops/test_quant_ops.py -p no:cacheprovider --tb=short --durations=10 -o faulthandler_timeout=200
step 360 gpu_qm2 python3 -m pytest -q -m gpu tests/quantization tests/layers/fused_moe tests/models/test_moe.py -p no:cacheprovider --tb=short --durations=10 -o faulthandler_timeout=200
step 430 gpu_all python3 -m pytest -q -m gpu tests -p no:cacheprovider --tb=short --durations=15 -o faulthandler_timeout=200 --continue-on-collection-errors
step 120 gpu_ops python3 -m pytest -q -m gpu tests/ops tests/attention tests/worker -p no:cacheprovider --tb=short --durations=5 -o faulthandler_timeout=100
step 270 gpu_e2e python3 -m pytest -q -m gpu tests/test_llm.py tests/engine -p no:cacheprovider --tb=short --durations=10 -o faulthandler_timeout=100
step 150 gpu_mp python3 -m pytest -q -m gpu tests/engine/test_core_client.py -p no:cacheprovider --tb=short -o faulthandler_timeout=100
SERVE="benchmarks/serve.py --suite --model-dir /tmp/q06 --profile 256"
step 230 serve_before bash -c "cd .bench_before && python3 $SERVE --cores inproc --frontends offline,asyncllm,http --concurrency 64,256 --json $OUT/serve_before.json"
step 330 serve_mp python3 $SERVE --cores mp --json "$OUT/serve_mp.json"
step 330 serve_inproc python3 $SERVE --cores inproc --frontends asyncllm,http,capi --json "$OUT/serve_inproc.json"
# the final serving run: every front end on the engine process (with profiles), the thread core
# for the default decision, then a quick GPU correctness pass (one config per family + MP identity)
step 400 serve_final_mp python3 $SERVE --profile-seconds 3 --cores mp --frontends offline,asyncllm,http,http-x4,capi --json "$OUT/serve_mp.json"
# issue 29: the default vengine serve (automatic --api-server-count) against offline at c=256 with both
# clients (this file's and the aiohttp one shaped like vllm bench serve's); target >= 0.85x, TTFT p50 <= 250 ms
step 420 serve_default python3 $SERVE --cores mp --concurrency 256 --frontends offline,http,http-aio,http-auto,http-aio-x4 --json "$OUT/serve_default.json"
# the 12-02 regression check (docs/benchmarks.md, "Host time before and after the house, fields,
# spec and DP merges"): 11-30's suite shape (levels 1,64,256, engine process) for offline, AsyncLLM
# and the C ABI on this checkout and on .bench_before/ (here a plain checkout of 89ee766, its own
# benchmarks/), then this checkout at c=256 alone (serve_b's shape: the run's shape against the code).
# About 4 + 4 + 3 minutes: perfreg_after perfreg_before in one call, perfreg_after_256 in another.
SERVE_AB="benchmarks/serve.py --suite --model-dir /tmp/q06 --profile 0 --cores mp --frontends offline,asyncllm,capi"
step 290 perfreg_after python3 $SERVE_AB --json "$OUT/perfreg_after.json"
step 290 perfreg_before bash -c "cd .bench_before && python3 $SERVE_AB --json $OUT/perfreg_before.json"
step 220 perfreg_after_256 python3 $SERVE_AB --concurrency 256 --json "$OUT/perfreg_after_256.json"
# issue 24's last check: every front end (one API server for HTTP, as on both codes) at c=256 on
# this checkout, then on .bench_before/ (git archive 692c422, today's benchmarks/ laid over it), then
# this checkout again: after / before with the drift between the two "after" passes beside it
# HOUSE_REPEATS=N: each level N times on one engine, the median kept (one pass of a front end moves by
# 10-20% between runs on this machine: 12-02's diag_* against house_* of the same code)
SERVE_HOUSE="benchmarks/serve.py --suite --model-dir /tmp/q06 --profile 0 --cores mp --frontends offline,asyncllm,http,capi --concurrency 256 --repeats ${HOUSE_REPEATS:-1}"
step 300 house_after python3 $SERVE_HOUSE --json "$OUT/house_after.json"
step 300 house_before bash -c "cd .bench_before && python3 $SERVE_HOUSE --json $OUT/house_before.json"
step 300 house_after2 python3 $SERVE_HOUSE --json "$OUT/house_after2.json"
# the C ABI alone, after then before, HOUSE_REPEATS runs on one engine each (its spread at c=256 is the widest)
SERVE_CAPI="benchmarks/serve.py --suite --model-dir /tmp/q06 --profile 0 --cores mp --frontends capi --concurrency 256 --repeats ${HOUSE_REPEATS:-1}"
step 120 capi_after python3 $SERVE_CAPI --json "$OUT/capi_after.json"
step 120 capi_before bash -c "cd .bench_before && python3 $SERVE_CAPI --json $OUT/capi_before.json"
# where issue 24's c=256 gap goes, on this checkout and on .bench_before/: the offline closed loop and
# AsyncLLM once more under py-spy (front end and engine core), then the decode steps at batch 256 under
# torch's profiler (GPU idle between / inside steps, busy time and the kernels per step)
SERVE_DIAG="benchmarks/serve.py --suite --model-dir /tmp/q06 --profile 256 --profile-seconds 3 --cores mp --frontends offline,asyncllm --concurrency 256"
step 150 diag_after python3 $SERVE_DIAG --json "$OUT/diag_after.json"
step 150 diag_before bash -c "cd .bench_before && python3 $SERVE_DIAG --json $OUT/diag_before.json"
step 100 idle_after python3 benchmarks/gpu_idle.py --batch 256 --modes on --json "$OUT/idle_after.json"
step 100 idle_before bash -c "cd .bench_before && python3 benchmarks/gpu_idle.py --batch 256 --modes on --json $OUT/idle_before.json"
step 150 serve_final_inproc python3 $SERVE --cores inproc --frontends asyncllm,http --concurrency 64,256 --profile 0 --json "$OUT/serve_inproc.json"
# the second session's final run: every front end against both ceilings (LLM.generate, and the
# closed-loop offline rate at each concurrency), then structured outputs (issue 15)
step 420 serve_final2 python3 $SERVE --profile-seconds 3 --cores mp --frontends offline,asyncllm,http,http-x4,capi --json "$OUT/serve_final2.json"
step 150 structured python3 benchmarks/structured.py --model-dir /tmp/q06 --json "$OUT/structured.json"
step 120 gpu_structured python3 -m pytest -q -m gpu tests/structured_output -p no:cacheprovider --tb=short -o faulthandler_timeout=100
step 110 gpu_quick python3 -m pytest -q -m gpu tests/test_llm.py tests/engine/test_core_client.py -k "default or identical" -p no:cacheprovider --tb=short -o faulthandler_timeout=100
# mixture of experts (issue 25): the kernels and models on the GPU, the tile sweep (its JSON
# configs copied back), then the Qwen3-30B-A3B-shape benchmark on the swept tiles
step 200 gpu_moe python3 -m pytest -q -m gpu tests/layers/fused_moe tests/models/test_moe.py -p no:cacheprovider --tb=short --durations=5 -o faulthandler_timeout=180
step 150 moe_sweep bash -c "python3 benchmarks/moe.py --sweep --sweep-n 768 --sweep-budget-s 100 --out-dir $OUT && tar -cf $OUT/moe_configs.tar -C pyengine/layers/fused_moe configs"
step 330 moe_bench python3 benchmarks/moe.py --out-dir "$OUT"
# the GPU fixes of MoE and quantization in one short call (< 4 min): their GPU tests (TP=2 ones
# skip on one GPU), then the kernel parts of the two benchmarks only (needs .whl: compressed-tensors, loguru)
step 170 gpufix_tests python3 -m pytest -q -m gpu tests/layers/fused_moe tests/models/test_moe.py tests/ops/test_quant_ops.py tests/ops/test_smem.py tests/quantization/test_kernel_path.py -p no:cacheprovider --tb=short --durations=5 -o faulthandler_timeout=150
step 45 gpufix_quant_kernels python3 benchmarks/quant.py "$OUT" --parts kernels
# issue 25's quick tile sweep (M 1, 16, 256, 4096 against the defaults, M 1 with SPLIT_K; about 60 s), its table merged into the
# shipped one and copied back; gpufix_moe_kernels then measures the layer on it
step 90 moe_quick_sweep bash -c "python3 benchmarks/moe.py --sweep --sweep-quick --out-dir $OUT && tar -cf $OUT/moe_configs.tar -C pyengine/layers/fused_moe configs"
# issue 26's batch-1 GEMVs: default configs checked against their dequantized references and
# timed in CUDA graphs, then the launch-config sweep (~78 compiles: split-K, prefetch, the CUDA-core FP8 kernel (fma) too;
# its unrolled K = 14336 builds take longer); its table comes back in
# $OUT/gemv_configs.tar (the device tool drops file names with ',' or '=': commit it to pyengine/ops/configs/)
step 240 gemv_sweep bash -c "python3 benchmarks/quant.py $OUT/sweep --parts kernels --sweep --gemm-m 0 && tar -cf $OUT/gemv_configs.tar -C pyengine/ops configs"
step 60 gpufix_moe_kernels python3 benchmarks/moe.py --out-dir "$OUT" --sections kernels --kernel-m 1,16,256,4096 --repeats 2
# where a batch-1 decode step's time goes, kernel by kernel (issues 25 and 26; benchmarks/decode_profile.py): the
# TPOT runs' engines (the real shapes, CUDA graphs as served), 20 decode steps under torch.profiler each; per kernel,
# per class (GEMV by layer role, attention, norm, MoE, sampling, ...), GPU busy vs wall, kernels per step. The JSON
# plus one tar of the chrome traces each (4 files). Both in one call: ~45 s (MoE: 30B-A3B engine start-up ~20 s) and
# ~65 s (bf16, FP8, W4A16 8B engines; quant_profile.json is rewritten after each)
# (PROF_TAR TAR DIR CMD...: runs CMD, then tars /tmp/vengine_prof/DIR into TAR unless over 15 MB: a file over 16 MiB would not come back)
PROF_TAR='t=$1 d=$2; shift 2; "$@"; rc=$?; tar -cf "$t" -C /tmp/vengine_prof "$d" && [ $(stat -c%s "$t") -gt 15000000 ] && rm -f "$t"; exit $rc'
step 90 moe_profile bash -c "$PROF_TAR" _ "$OUT/moe_profile_traces.tar" moe python3 benchmarks/moe.py --sections profile --out-dir "$OUT" --trace-dir /tmp/vengine_prof/moe
# the GPTQ W4A16 Qwen3-30B-A3B shape's batch-1 step, kernel by kernel (the INT GEMVs' share; issue 26 on MoE)
step 120 moe_int_profile bash -c "$PROF_TAR" _ "$OUT/moe_int_profile_traces.tar" moeint python3 benchmarks/moe.py --sections profile --quantization gptq --out-dir "$OUT" --trace-dir /tmp/vengine_prof/moeint
# int4 experts' GEMV-path tiles at batch 1 (issue 26 on MoE): the GPTQ Qwen3-30B-A3B engine (TPOT, serving) on the
# tiles in use, then benchmarks/moe.py --sections int_tiles (each pass's candidates, the best pair whole against the
# default and bf16; a faster pair written as this GPU's dtype=int4_w4a16 table, which comes back in
# $OUT/int_tiles_configs.tar), then the engine again on it, each in a process of its own
# the INT4 experts' GEMV kernels, before / after a kernel change: the GPTQ engine's batch-1 TPOT on .bench_before/
# (the older code, today's benchmarks/ over it) and on this checkout at the default tiles, then int_tiles' sweep on
# this checkout's kernels and the engine (TPOT and the serving workload) on the table it writes, into $OUT/before,
# $OUT/new_default, $OUT/after
step 580 int_moe_ab bash -c 'BW=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && echo 4.8 || echo 3.35); e="--sections engine --nano-requests 0 --quantization gptq --bandwidth-tbs $BW"; \
  (cd .bench_before && python3 benchmarks/moe.py $e --serve-requests 0 --out-dir "$0/before"); python3 benchmarks/moe.py $e --serve-requests 0 --out-dir "$0/new_default" \
  && python3 benchmarks/moe.py --sections int_tiles --sweep-budget-s 110 --bandwidth-tbs $BW --out-dir "$0" && tar -cf "$0/int_tiles_configs.tar" -C pyengine/layers/fused_moe configs \
  && python3 benchmarks/moe.py $e --out-dir "$0/after"' "$OUT"
# the INT experts' kernel tests alone on the GPU (the Qwen3-30B-A3B shape, CUDA-graph replay)
step 100 gpu_intmoe_k python3 -m pytest -q -m gpu tests/layers/fused_moe/test_fused_moe_int.py -p no:cacheprovider --tb=short
# batch-1 TPOT of the Qwen3-30B-A3B shape, bf16 then GPTQ W4A16, in one call (into $OUT/bf16, $OUT/gptq); then the INT
# experts' GPU tests at the real shape and under CUDA-graph replay alone
step 90 gpu_intmoe_shape python3 -m pytest -q -m gpu tests/layers/fused_moe/test_fused_moe_int.py -k "qwen3_30b_a3b_shape or cuda_graph_replay" -p no:cacheprovider --tb=short
step 170 moe_bf16_vs_int bash -c 'BW=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && echo 4.8 || echo 3.35); e="--sections engine --nano-requests 0 --serve-requests 0 --bandwidth-tbs $BW"; \
  python3 benchmarks/moe.py $e --out-dir "$0/bf16" && python3 benchmarks/moe.py $e --quantization gptq --out-dir "$0/gptq"' "$OUT"
step 560 int_tiles_ab bash -c 'BW=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && echo 4.8 || echo 3.35); e="--sections engine --nano-requests 0 --quantization gptq --bandwidth-tbs $BW"; python3 benchmarks/moe.py $e --out-dir "$0/before" && python3 benchmarks/moe.py --sections int_tiles --sweep-budget-s 150 --bandwidth-tbs $BW --out-dir "$0" && tar -cf "$0/int_tiles_configs.tar" -C pyengine/layers/fused_moe configs && python3 benchmarks/moe.py $e --out-dir "$0/after"' "$OUT"
# the GPTQ engine's batch-1 step kernel by kernel without PDL (with PDL a kernel's time includes its wait for the last)
step 120 moe_int_profile_nopdl bash -c 'VENGINE_PDL=0 python3 benchmarks/moe.py --sections profile --quantization gptq --out-dir "$0/nopdl"' "$OUT"
# the same for the bf16 MoE engine, and the dense 8B shape's profile (bf16, FP8, W4A16) without PDL
step 120 moe_profile_nopdl bash -c 'VENGINE_PDL=0 python3 benchmarks/moe.py --sections profile --out-dir "$0/nopdl"' "$OUT"
step 150 quant_profile_nopdl bash -c 'VENGINE_PDL=0 python3 benchmarks/quant.py "$0/nopdl" --parts profile' "$OUT"
# the load-memory tests alone (a quantized checkpoint's peak against the float model's size)
step 120 gpu_loader python3 -m pytest -q -m gpu tests/models/test_loader.py -p no:cacheprovider --tb=short
step 120 quant_profile bash -c "$PROF_TAR" _ "$OUT/quant_profile_traces.tar" quant python3 benchmarks/quant.py "$OUT" --parts profile --trace-dir /tmp/vengine_prof/quant
# programmatic dependent launch (pyengine/ops/pdl.py) off, then on, each engine in a process of its own: the 8B decode
# profile (bf16, FP8, W4A16; ~65 s a pass) and the Qwen3-30B-A3B one (~80 s a pass), into $OUT/pdl0 and $OUT/pdl1
step 170 pdl_quant bash -c 'for v in 0 1; do VENGINE_PDL=$v python3 benchmarks/quant.py "$0/pdl$v" --parts profile || exit 1; done' "$OUT"
step 200 pdl_moe bash -c 'for v in 0 1; do VENGINE_PDL=$v python3 benchmarks/moe.py --sections profile --out-dir "$0/pdl$v" || exit 1; done' "$OUT"
# one kernel family at a time without PDL: PDL_VARIANTS="PDL:EXCLUDE:VARIANTS ..." (VENGINE_PDL, VENGINE_PDL_EXCLUDE,
# benchmarks/quant.py --profile-variants), each in its own process, into $OUT/pdlv<i>/quant_profile.json
# the issue benchmarks' engine figures with PDL on (the default) and off, each in its own process: MoE's batch-1 TPOT and
# throughputs (issue 25), the 8B shape's TPOT and throughput bf16 / FP8 / W4A16 (issue 26)
step 330 pdl_bench bash -c 'for v in 1 0; do VENGINE_PDL=$v python3 benchmarks/moe.py --sections engine --out-dir "$0/pdl$v" \
  && VENGINE_PDL=$v python3 benchmarks/quant.py "$0/pdl$v" --parts tpot,throughput || exit 1; done' "$OUT"
# offline throughput (256 in flight) alone, PDL on then off, its own processes (bf16 and FP8 8B engines)
step 200 pdl_throughput bash -c 'for v in 1 0; do VENGINE_PDL=$v python3 benchmarks/quant.py "$0/pdl$v" --parts throughput || exit 1; done' "$OUT"
step 400 pdl_variants bash -c 'i=0; for spec in ${PDL_VARIANTS:-0::fp8 1::fp8}; do IFS=: read -r v ex pv <<< "$spec"; \
  VENGINE_PDL=$v VENGINE_PDL_EXCLUDE=$ex python3 benchmarks/quant.py "$0/pdlv$i" --parts profile --profile-variants "${pv//+/,}" \
  | tail -3; echo "variant $i: VENGINE_PDL=$v VENGINE_PDL_EXCLUDE=$ex ($pv)"; i=$((i+1)); done' "$OUT"
# quantization (issue 26): kernels vs their dequantized references, the quantized tiny models, then the 8B-shape benchmark
step 200 gpu_quant python3 -m pytest -q -m gpu tests/quantization tests/ops/test_quant_ops.py -p no:cacheprovider --tb=short --durations=5 -o faulthandler_timeout=180
step 360 quant_bench python3 benchmarks/quant.py "$OUT"
# the packed-int GEMV's GPU tests alone (the f16x2 path among them), and the 8B shape's batch-1 TPOT alone (bf16, FP8,
# W4A16 engines; ~90 s) on the GEMV table in the package (after gemv_sweep in the same call: the one it wrote)
step 150 gpu_int4 python3 -m pytest -q -m gpu tests/ops/test_quant_ops.py -k "int_gemv or int4_gemv or int_linear" -p no:cacheprovider --tb=short -o faulthandler_timeout=140
step 200 quant_tpot python3 benchmarks/quant.py "$OUT" --parts tpot
# FP8 throughput at 256 in flight: bf16, FP8 weights, FP8 weights + FP8 KV cache (issue 26)
step 420 fp8kv_throughput python3 benchmarks/quant.py "$OUT/fp8kv" --parts throughput --throughput-fp8-kv
# seeded rows' draws (the Triton hash kernel against torch's, the sampler with no host sync), then
# seeded sampling with speculation equal to without on the GPU engine
step 200 gpu_seeded python3 -m pytest -q -m gpu tests/ops/test_fused_ops.py tests/worker/test_sampler.py tests/spec_decode/test_spec_gpu.py -k "seeded or no_host_sync" -p no:cacheprovider --tb=short -o faulthandler_timeout=190
step 200 gpu_half2 python3 -m pytest -q -m gpu tests/ops/test_quant_ops.py -k "half2 or persistent" -p no:cacheprovider --tb=short -o faulthandler_timeout=190
# the int4 GEMV configs alone, each kernel timed without PDL (a graph of back-to-back GEMVs with PDL overlaps one
# GEMV's start with the previous one's end, which a decode step's GEMVs, after a norm or attention, do not see)
step 150 gpu_int_stream python3 -m pytest -q -m gpu tests/ops/test_quant_ops.py -k "persistent or layouts" -p no:cacheprovider --tb=short -o faulthandler_timeout=140
# the FP8 GEMV configs alone (the persistent ones among them), PDL off as int4_sweep
step 240 fp8_sweep bash -c "VENGINE_PDL=0 python3 benchmarks/quant.py $OUT/sweep8 --parts kernels --sweep --sweep-kinds fp8 --gemm-m 0 && tar -cf $OUT/gemv_configs.tar -C pyengine/ops configs"
# the int4 GEMV configs at Qwen3-30B-A3B's attention shapes (PDL off, as int4_sweep), merged into the GPU's table
step 200 int4_sweep_moe_attn bash -c "VENGINE_PDL=0 python3 benchmarks/quant.py $OUT/sweep_moe_attn --parts kernels --sweep --sweep-kinds int4 --gemm-m 0 --layer-shapes qkv_proj=5120x2048,o_proj=2048x4096 && tar -cf $OUT/gemv_configs.tar -C pyengine/ops configs"
step 240 int4_sweep bash -c "VENGINE_PDL=0 python3 benchmarks/quant.py $OUT/sweep --parts kernels --sweep --sweep-kinds int4 --gemm-m 0 && tar -cf $OUT/gemv_configs.tar -C pyengine/ops configs"
# the GEMVs on the shipped table without PDL, the int4 one also on its scales' and zeros' other forms
# (w4a16_gemv_forms: symmetric, no zeros tensor; scales row-major): $OUT/forms
step 120 int4_forms bash -c "VENGINE_PDL=0 python3 benchmarks/quant.py $OUT/forms --parts kernels --gemm-m 0"
# batch-1 TPOT (bf16, FP8, W4A16) after int4_sweep (on the table it wrote), PDL on then off: $OUT/tpot<v>
step 200 tpot_after bash -c 'for v in 1 0; do VENGINE_PDL=$v python3 benchmarks/quant.py "$0/tpot$v" --parts tpot | tail -9 || exit 1; done' "$OUT"
# batch-1 TPOT with PDL on but the named int GEMVs launched without it: $OUT/ex<i> (TPOT_EX, default: the persistent
# kernel alone, then both int GEMV kernels)
step 150 tpot_pdl_ex bash -c 'i=0; for ex in ${TPOT_EX:-int_gemv_stream int_gemv,int_gemv_stream}; do VENGINE_PDL_EXCLUDE=$ex \
  python3 benchmarks/quant.py "$0/ex$i" --parts tpot | grep -A3 "^| variant"; echo "ex$i: VENGINE_PDL_EXCLUDE=$ex"; i=$((i+1)); done' "$OUT"
# the W4A16 8B decode step per kernel on the shipped GEMV table (f16x2 int4 GEMVs) and on
# benchmarks/results/2026-12-04c-h200/gemv_table_no_half2.json (the float32 ones), PDL on then off: $OUT/h2<on|off>_pdl<v>
T="pyengine/ops/configs/gemv,device_name=NVIDIA_H200.json"
step 200 half2_profile bash -c 'cp "$1" /tmp/gemv_shipped.json; for h in on off; do [ $h = off ] && cp "$2" "$1"; \
  for v in 1 0; do VENGINE_PDL=$v python3 benchmarks/quant.py "$0/h2${h}_pdl$v" --parts profile --profile-variants w4a16 \
  | tail -2 || exit 1; done; done; cp /tmp/gemv_shipped.json "$1"' "$OUT" "$T" benchmarks/results/2026-12-04c-h200/gemv_table_no_half2.json
# speculative decoding (issue 27): on == off on CUDA for each proposer; then the benchmark: ngram on
# code-editing prompts with the built-in model and throughput at 256 streams with the cutoff, and (its own
# step: it trains the >= 50M target with tools/train_default_model.py first) the draft-model pair
step 200 gpu_spec python3 -m pytest -q -m gpu tests/spec_decode -p no:cacheprovider --tb=short -o faulthandler_timeout=180
# batch-1 diagnosis: speculation off vs on under the profiler (kernels, graph launches, host phases per step), then
# ngram on/off with the diverging prompts' logprob margins (~60 s)
step 150 spec_diag bash -c "$PROF_TAR" _ "$OUT/spec_profile_traces.tar" spec python3 benchmarks/spec_decode.py --parts profile,ngram --trace-dir /tmp/vengine_prof/spec --json "$OUT/spec_diag.json"
step 150 spec_diag_draft bash -c "$PROF_TAR" _ "$OUT/spec_draft_profile_traces.tar" specd python3 benchmarks/spec_decode.py --parts profile --profile-method draft_model --trace-dir /tmp/vengine_prof/specd --json "$OUT/spec_diag_draft.json"
step 300 spec_bench python3 benchmarks/spec_decode.py --parts ngram,throughput --k-sweep 10,12 --rounds 5 --repeats 12 --json "$OUT/spec_decode.json"
# where a batch-1 step's time goes (plain async / sync decode vs ngram verify and draftless steps), with a
# teacher-forced stub for the model (host time only) and with the real model (the difference: the device's share)
step 300 spec_host python3 benchmarks/spec_decode.py --parts host --host-repeats 2 --host-profile "$OUT/spec_host" --json "$OUT/spec_host.json"
# the 16-layer 54.5M target (0.77x, then 0.86x with the device drafts and the short-query attention, 2026-12-03); the
# deep one: 48 layers, 81M parameters, six times the draft's depth as a 70B target is of a 1B draft (both are
# launch-bound at batch 1, so depth, not width, sets what a forward costs; 1.03x but AL 2.98 after 4.5 min of training)
step 560 spec_bench_draft python3 benchmarks/spec_decode.py --parts draft --train-minutes 3.5 --draft-k-sweep 3 --rounds 4 --json "$OUT/spec_decode_draft.json"
step 560 spec_bench_draft_deep python3 benchmarks/spec_decode.py --parts draft --train-minutes 4.5 --target-layers 48 --target-hidden 384 --target-intermediate 1024 --draft-k-sweep 5,6 --rounds 3 --json "$OUT/spec_decode_draft_deep.json"
# the same pair with the target trained longer (6.5 min budget, 8 min deadline) and its layers compiled: a call of its own
step 590 spec_bench_draft_long python3 benchmarks/spec_decode.py --parts draft --train-minutes 6.5 --train-compile --target-layers 48 --target-hidden 384 --target-intermediate 1024 --draft-k-sweep 5 --rounds 3 --json "$OUT/spec_decode_draft_long.json"
step 330 throughput python3 benchmarks/throughput.py --peer transformers --peer-timeout 240 --json "$OUT/throughput.json"
step 120 throughput_async python3 benchmarks/throughput.py --json "$OUT/throughput_async.json"
step 120 throughput_noasync python3 benchmarks/throughput.py --no-async-scheduling --json "$OUT/throughput_noasync.json"
step 180 latency python3 benchmarks/latency.py --json "$OUT/latency.json"
step 120 gpu_idle python3 benchmarks/gpu_idle.py --json "$OUT/gpu_idle.json"
step 120 gpu_idle_b256 python3 benchmarks/gpu_idle.py --batch 256 --json "$OUT/gpu_idle_b256.json"
step 240 async_sched python3 benchmarks/async_sched.py --json "$OUT/async_sched.json"
step 120 attention python3 benchmarks/attention_kernels.py --verbose --json "$OUT/attention.json"
# tensor parallelism, 2 GPUs: TP GPU tests (fp32 vs transformers, bf16 vs TP=1, killed NCCL worker),
# the same with speculative decoding (gpu_tp_spec), TPOT / throughput TP=2 vs TP=1 (each run its own process), how the step reaches the other ranks
step 270 gpu_tp python3 -m pytest -q -m gpu tests/distributed tests/executor --ignore=tests/executor/test_spec_decode_tp.py -p no:cacheprovider --tb=short --durations=10 -o faulthandler_timeout=200
step 300 gpu_tp_spec python3 -m pytest -q -m gpu tests/executor/test_spec_decode_tp.py -p no:cacheprovider --tb=short --durations=10 -o faulthandler_timeout=200
step 300 tp python3 benchmarks/tp.py --timeout 100 --throughput-shapes llama-3.1-8b --json "$OUT/tp.json"
# the fused all-reduce + residual add + RMSNorm kernel (pyengine/distributed/all_reduce_norm.py): its test,
# its cost per call against NCCL and torch's one-shot (each + the norm), and the decode profile with it on and off
step 150 ar_norm_test python3 -m pytest -q -m gpu tests/distributed/test_all_reduce_norm.py -p no:cacheprovider --tb=short -o faulthandler_timeout=120
step 120 ar_norm_bench python3 benchmarks/all_reduce_norm.py --json "$OUT/all_reduce_norm.json"
step 240 gemv python3 benchmarks/gemv.py --sweep --json "$OUT/gemv.json"
step 330 tp_profile_fused python3 benchmarks/tp_profile.py --timeout 95 --configs 1,2,2-symm-mem --json "$OUT/tp_profile_fused.json"
step 45 tp_step_broadcast python3 benchmarks/tp_step_broadcast.py --json "$OUT/tp_step_broadcast.json"
# where a TP decode step's time goes (TP=1, TP=2 over NCCL, TP=2 with VENGINE_SYMM_MEM_ALLREDUCE=1, and that with the
# steps over gloo instead of the shared-memory ring; each its own
# process): per-rank GPU busy/idle, gaps, kernel classes, host phases; the chrome traces come back as one tar
# (a file over 16 MiB would not come back: then only the two TP=2 NCCL / symmetric-memory configs' traces)
step 400 tp_profile bash -c "python3 benchmarks/tp_profile.py --timeout 95 --trace-dir /tmp/tp_profile \
  --json '$OUT/tp_profile.json'; rc=\$?; T='$OUT/tp_profile_traces.tar'; tar -cf \$T -C /tmp tp_profile; \
  [ \$(stat -c%s \$T) -gt 15000000 ] && tar -cf \$T -C /tmp tp_profile/tp2 tp_profile/tp2-symm-mem; exit \$rc"
