#!/usr/bin/env bash
# curl calls against `vengine serve` (default http://127.0.0.1:8000; set BASE / API_KEY to change).
set -euo pipefail
BASE=${BASE:-http://127.0.0.1:8000}
AUTH=()
if [[ -n "${API_KEY:-}" ]]; then AUTH=(-H "Authorization: Bearer ${API_KEY}"); fi

curl -s "$BASE/health" -o /dev/null -w 'health: %{http_code}\n'
curl -s "${AUTH[@]}" "$BASE/v1/models"; echo

# completion (non-streaming)
curl -s "${AUTH[@]}" "$BASE/v1/completions" -H 'Content-Type: application/json' \
  -d '{"prompt": "def fibonacci(n):", "max_tokens": 32, "temperature": 0}'; echo

# chat, streamed as server-sent events (-N: no buffering)
curl -sN "${AUTH[@]}" "$BASE/v1/chat/completions" -H 'Content-Type: application/json' \
  -d '{"messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 16, "stream": true,
       "stream_options": {"include_usage": true}}'

curl -s "$BASE/metrics" | grep -E '^vllm:(num_requests_running|kv_cache_usage_perc|generation_tokens_total)'
