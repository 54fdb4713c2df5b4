#!/usr/bin/env bash
# Tensor parallelism on the 2-GPU H200 machine (device kind nvidia-h200-x2), one device
# call, under 10 minutes: the tools/h200_run.sh steps
#   gpu_tp             TP GPU tests: fp32 TP=2 vs transformers, bf16 TP=2 vs TP=1, a killed NCCL worker
#   gpu_tp_spec        the same with speculative decoding (ngram, the target as its own draft, EAGLE-3);
#                      not in the default set (10 minutes): `bash tools/tp_h200x2.sh gpu_tp_spec`
#   tp                 benchmarks/tp.py: batch-1 TPOT of the Llama-3.1-8B shape and offline throughput
#                      on nano-vllm's workload (Qwen3-0.6B and Llama-3.1-8B shapes), TP=2 vs TP=1
#   tp_step_broadcast  benchmarks/tp_step_broadcast.py: how a step's inputs reach the other ranks
#   tp_profile         benchmarks/tp_profile.py: where a batch-1 decode step's time goes at TP=1, TP=2 (NCCL)
#                      and TP=2 (VENGINE_SYMM_MEM_ALLREDUCE=1): GPU busy/idle and gaps per rank, kernel
#                      classes, host phases per rank; traces in tp_profile_traces.tar (not in the default set)
# Results land in $OUT: all.log (every step's tail), tp.json, tp_step_broadcast.json, and the
# whole log of any step that failed. NCCL_NVLS_ENABLE=0 (no NVLink multicast).
#
#   run on the device with `.whl` carried (../shared/tools/device-wheels.sh):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site:$PWD && bash tools/tp_h200x2.sh [STEP ...]
exec bash "$(dirname "$0")/h200_run.sh" ${*:-gpu_tp tp tp_step_broadcast}
