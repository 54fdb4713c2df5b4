"""The OpenAI protocol layer shared by every OpenAI-style front end (the HTTP server in
``server/`` and the C ABI's ``vllm_chat`` / ``vllm_chat_stream``), mirroring
vllm/entrypoints/openai/: request schemas (``protocol``), what both endpoints share
(``serving_engine``), chat (``serving_chat``) and completions (``serving_completion``);
the Responses API's wire format (``protocol_responses``) and its mapping onto chat
(``responses_utils``).
Every refusal is a ``VLLMValidationError`` whose message is the one each front end gives
and whose ``parameter`` names the request field."""
