"""Request schemas of the OpenAI-compatible API (pydantic, strict JSON types), with every
field of vLLM's ``CompletionRequest`` / ``ChatCompletionRequest``
(vllm/entrypoints/openai/protocol.py). A field vengine does not implement is declared too,
and refused with a 400 naming it when it asks for something (``UNSUPPORTED_FIELDS``,
checked by ``serving_engine.refuse_unsupported``); only names vLLM does not know are
ignored and logged, as vLLM does. A JSON ``null`` means "use the default".
Type errors, bad JSON and missing required fields surface as ``pydantic.ValidationError``,
which the app turns into HTTP 400 with OpenAI's error envelope.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Schema(BaseModel):
    """The base of every request schema: strict ("5" is not an int and 1 is not a bool;
    ints are still accepted for floats), unknown fields ignored."""
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(Schema):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _SamplingFields(Schema):
    """Fields shared by /v1/completions and /v1/chat/completions."""
    # kept in model_extra so the app can log what it ignored
    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    priority: int | None = None
    user: str | None = None
    best_of: int | None = None
    logit_bias: dict[str, float] | None = None
    request_id: str | None = None
    # Structured outputs (pyengine.entrypoints.structured_outputs maps and checks them):
    # OpenAI's response_format, vLLM's structured_outputs object and older guided_* fields.
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    # vLLM's extra sampling parameters
    bad_words: list[str] | None = None  # vLLM has it on chat only; vengine on both
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool | None = None  # default: True on completions, False on chat (vLLM's)
    return_tokens_as_token_ids: bool | None = None
    cache_salt: str | None = None  # the engine's prefix-cache salt (Processor.check_cache_salt)
    return_token_ids: bool | None = None  # token_ids / prompt_token_ids in the response (ResponseBuilder)
    # vLLM fields vengine does not implement: refused unless unset (UNSUPPORTED_FIELDS)
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    spaces_between_special_tokens: bool | None = None
    prompt_logprobs: int | None = None
    logits_processors: list[Any] | None = None
    kv_transfer_params: dict | None = None
    vllm_xargs: dict | None = None
    max_repetition_pattern_size: int | None = None
    min_repetition_pattern_size: int | None = None
    repetition_min_count: int | None = None

    def structured_output_fields(self) -> dict:
        """The fields that may ask for a constraint, as plain JSON values."""
        return {k: getattr(self, k) for k in STRUCTURED_OUTPUT_FIELDS}


STRUCTURED_OUTPUT_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
                            "guided_choice", "guided_grammar", "guided_decoding_backend",
                            "guided_whitespace_pattern")

PromptType = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_SamplingFields):
    prompt: PromptType
    max_tokens: int | None = None  # None: 16, like OpenAI's legacy completions
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    prompt_embeds: Any | None = None  # refused (UNSUPPORTED_FIELDS)


class TextContentPart(Schema):
    type: Literal["text"]
    text: str


class FunctionCall(Schema):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Schema):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Schema):
    role: str
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # role "tool": the call this answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: the rest of the context window
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    echo: bool | None = False
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    functions: list | None = None  # OpenAI's deprecated form: refused (use tools)
    function_call: str | dict | None = None
    reasoning_effort: str | None = None  # passed to the chat template, as vLLM
    include_reasoning: bool | None = None  # no reasoning parser: no reasoning content is returned either way
    # vLLM's: at most this many reasoning tokens, then the end token is forced (needs --reasoning-parser)
    thinking_token_budget: int | None = None
    documents: list[dict[str, str]] | None = None  # passed to the chat template (RAG templates)
    # refused unless unset (UNSUPPORTED_FIELDS)
    chat_template: str | None = None
    mm_processor_kwargs: dict | None = None
    structural_tag: str | None = None


# vLLM request fields vengine does not implement: name -> (the values that ask for nothing,
# why it is refused). Any other value is a 400 naming the field: never accepted and ignored.
UNSUPPORTED_FIELDS: dict[str, tuple[tuple, str]] = {
    "use_beam_search": ((None, False), "beam search is not supported"),
    "length_penalty": ((None, 1, 1.0), "it applies to beam search, which is not supported"),
    "spaces_between_special_tokens": ((None, True), "special tokens are always joined with spaces "
                                                    "(the tokenizer's decode)"),
    "prompt_logprobs": ((None,), "prompt logprobs are not supported"),
    "logits_processors": ((None, []), "custom logits processors are not supported"),
    "kv_transfer_params": ((None, {}), "KV transfer (disaggregated serving) is not supported"),
    "vllm_xargs": ((None, {}), "no extension reads extra request arguments"),
    "max_repetition_pattern_size": ((None, 0), "repetition detection is not supported"),
    "min_repetition_pattern_size": ((None, 0), "repetition detection is not supported"),
    "repetition_min_count": ((None, 0), "repetition detection is not supported"),
    "prompt_embeds": ((None, [], b"", ""), "prompt embeddings are not supported"),
    "chat_template": ((None,), "a chat template sent with the request is not trusted (vLLM refuses it too, "
                               "without --trust-request-chat-template); start the server with --chat-template"),
    "mm_processor_kwargs": ((None, {}), "multimodal inputs are not supported"),
    "structural_tag": ((None,), "structural tags are not supported"),
}
