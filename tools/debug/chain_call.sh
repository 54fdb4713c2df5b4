#!/usr/bin/env bash
# One device call: the chain's off-then-on check, then (passing) the speculative steps or
# (failing) the diagnosis. Not part of the suite.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH VENGINE_DRAFT_CHAIN=1
OUT=${OUT:-out}; mkdir -p "$OUT"
for v in off check_off; do timeout 60 python3 tools/debug/chain_debug.py $v 2>&1 | grep "OK\|FAILED" | head -2; done | tee "$OUT/debug.txt"
if grep -q "^off OK True" "$OUT/debug.txt"; then
  bash tools/h200_run.sh "$@"
  cp "$OUT/all.log" "$OUT/steps_all.log"
else
  for v in nocapture_off gc_off; do timeout 60 python3 tools/debug/chain_debug.py $v 2>&1 | grep "OK\|FAILED" | head -2; done | tee -a "$OUT/debug.txt"
  CUDA_LAUNCH_BLOCKING=1 timeout 90 python3 tools/debug/chain_debug.py off 2>&1 | grep -v "Writing model\|Assertion\|^frame" | grep -A60 "FAILED" | grep -v "^ *\^" | head -60 | tee -a "$OUT/debug.txt"
fi
