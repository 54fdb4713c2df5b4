"""The Anthropic Messages API layer (mirrors vllm/entrypoints/anthropic/): the wire format
(``protocol``) and its mapping onto chat completions (``messages_utils``), for
``POST /v1/messages`` and ``POST /v1/messages/count_tokens``."""
