#!/usr/bin/env bash
# Tensor parallelism on the 2-GPU H200 machine (device kind nvidia-h200-x2), one device
# call, under 10 minutes: the TP GPU tests (fp32 TP=2 vs transformers, bf16 TP=2 vs TP=1,
# a killed NCCL worker), then benchmarks/tp.py (batch-1 TPOT of the Llama-3.1-8B shape and
# offline throughput on nano-vllm's workload, TP=2 vs TP=1) and the step-broadcast
# measurement. Results land in $OUT: tp.log (every step's tail), tp.json,
# tp_step_broadcast.json, and the whole log of any step that failed.
#
#   run on the device with `.whl` carried (../shared/tools/device-wheels.sh):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site:$PWD && bash tools/tp_h200x2.sh [STEP ...]
# STEP: gpu_tp tp tp_step_broadcast (default: all)
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# No NVLink multicast (NVLS) on these machines; NCCL's own warnings go to the logs.
export NCCL_NVLS_ENABLE=0
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
LOG="$OUT/tp.log"
WANT=" ${*:-gpu_tp tp tp_step_broadcast} "
step() {  # step SECONDS NAME CMD...
  local t=$1 name=$2; shift 2
  [[ "$WANT" == *" $name "* ]] || return 0
  echo "=== $name: $* (limit ${t}s)" | tee -a "$LOG"
  local start=$SECONDS
  timeout -k 10 "$t" "$@" > "$OUT/.$name.log" 2>&1
  local rc=$?
  tail -n 30 "$OUT/.$name.log" | grep -v "Writing model shards\|Loading weights" >> "$LOG"
  echo "=== $name rc=$rc in $((SECONDS - start))s" | tee -a "$LOG"
  if [[ $rc != 0 ]]; then mv "$OUT/.$name.log" "$OUT/$name.log"; else rm -f "$OUT/.$name.log"; fi
}
{ nvidia-smi -L; nvidia-smi topo -m; python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"; } >> "$LOG" 2>&1
step 240 gpu_tp python3 -m pytest -q -m gpu tests/executor -p no:cacheprovider --tb=short --durations=10 -o faulthandler_timeout=200
step 300 tp python3 benchmarks/tp.py --timeout 120 --json "$OUT/tp.json"
step 45 tp_step_broadcast python3 benchmarks/tp_step_broadcast.py --json "$OUT/tp_step_broadcast.json"
