#!/usr/bin/env bash
# One device call: the chain's off-then-on check (tools/debug/chain_variants.sh), then,
# passing, the h200_run.sh steps named as arguments. Not part of the suite.
OUT=${OUT:-out}
bash "$(dirname "$0")/chain_variants.sh" off check_off
if grep -q "^off OK True" "$OUT/variants.txt"; then
  export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
  bash tools/h200_run.sh "$@"
fi
