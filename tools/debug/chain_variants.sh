#!/usr/bin/env bash
# One device call: chain_debug.py under the variants named as arguments (ws0_* runs with
# cuBLAS workspaces off), one line each. Not part of the suite.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH VENGINE_DRAFT_CHAIN=1
OUT=${OUT:-out}; mkdir -p "$OUT"
for v in "$@"; do
  if [[ $v == ws0_* ]]; then env CUBLAS_WORKSPACE_CONFIG=:0:0 CUBLASLT_WORKSPACE_SIZE=0 timeout 60 python3 tools/debug/chain_debug.py "${v#ws0_}" 2>&1 | grep "OK\|FAILED" | sed "s/^/ws0 /" | head -3
  else timeout 60 python3 tools/debug/chain_debug.py "$v" 2>&1 | grep "OK\|FAILED\|BAD\|after shutdown" | cut -c1-1500 | head -5; fi
done | tee "$OUT/variants.txt"
