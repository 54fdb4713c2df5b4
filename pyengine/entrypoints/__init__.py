"""Helpers shared by the OpenAI-style front ends (the HTTP server and the C ABI's
``vllm_chat``), so both give the same answer: request fields -> structured-output
constraints, tool calling (mirrors the roles of vllm/entrypoints/openai/*)."""
