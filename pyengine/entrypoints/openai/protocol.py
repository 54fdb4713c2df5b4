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

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class Schema(BaseModel):
    """The base of every request schema: strict ("5" is not an int and 1 is not a bool;
    ints are still accepted for floats), unknown fields ignored."""
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(Schema):
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False


class _SamplingFields(Schema):
    """Fields shared by /v1/completions and /v1/chat/completions."""
    # kept in model_extra so the app can log what it ignored
    model_config = ConfigDict(strict=True, extra="allow")

    model: Optional[str] = None
    n: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: Optional[bool] = None
    min_tokens: Optional[int] = None
    include_stop_str_in_output: Optional[bool] = None
    skip_special_tokens: Optional[bool] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    priority: Optional[int] = None
    user: Optional[str] = None
    best_of: Optional[int] = None
    logit_bias: Optional[dict[str, float]] = None
    request_id: Optional[str] = None
    # Structured outputs (pyengine.entrypoints.structured_outputs maps and checks them):
    # OpenAI's response_format, vLLM's structured_outputs object and older guided_* fields.
    response_format: Optional[dict] = None
    structured_outputs: Optional[dict] = None
    guided_json: Optional[Union[str, dict]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    guided_decoding_backend: Optional[str] = None
    guided_whitespace_pattern: Optional[str] = None
    # vLLM's extra sampling parameters
    bad_words: Optional[list[str]] = None  # vLLM has it on chat only; vengine on both
    allowed_token_ids: Optional[list[int]] = None
    truncate_prompt_tokens: Optional[int] = None
    add_special_tokens: Optional[bool] = None  # default: True on completions, False on chat (vLLM's)
    return_tokens_as_token_ids: Optional[bool] = None
    cache_salt: Optional[str] = None  # the engine's prefix-cache salt (Processor.check_cache_salt)
    return_token_ids: Optional[bool] = None  # token_ids / prompt_token_ids in the response (ResponseBuilder)
    # vLLM fields vengine does not implement: refused unless unset (UNSUPPORTED_FIELDS)
    use_beam_search: Optional[bool] = None
    length_penalty: Optional[float] = None
    spaces_between_special_tokens: Optional[bool] = None
    prompt_logprobs: Optional[int] = None
    logits_processors: Optional[list[Any]] = None
    kv_transfer_params: Optional[dict] = None
    vllm_xargs: Optional[dict] = None
    max_repetition_pattern_size: Optional[int] = None
    min_repetition_pattern_size: Optional[int] = None
    repetition_min_count: Optional[int] = None

    def structured_output_fields(self) -> dict:
        """The fields that may ask for a constraint, as plain JSON values."""
        return {k: getattr(self, k) for k in STRUCTURED_OUTPUT_FIELDS}


STRUCTURED_OUTPUT_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
                            "guided_choice", "guided_grammar", "guided_decoding_backend",
                            "guided_whitespace_pattern")

PromptType = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(_SamplingFields):
    prompt: PromptType
    max_tokens: Optional[int] = None  # None: 16, like OpenAI's legacy completions
    logprobs: Optional[int] = None
    echo: Optional[bool] = False
    suffix: Optional[str] = None
    prompt_embeds: Optional[Any] = None  # refused (UNSUPPORTED_FIELDS)


class TextContentPart(Schema):
    type: Literal["text"]
    text: str


class FunctionCall(Schema):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Schema):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Schema):
    role: str
    content: Optional[Union[str, list[TextContentPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None  # an assistant's earlier calls
    tool_call_id: Optional[str] = None  # role "tool": the call this answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = None  # None: the rest of the context window
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    echo: Optional[bool] = False
    add_generation_prompt: Optional[bool] = True
    continue_final_message: Optional[bool] = False
    chat_template_kwargs: Optional[dict] = None
    tools: Optional[list[dict]] = None
    tool_choice: Optional[Union[str, dict]] = None
    parallel_tool_calls: Optional[bool] = None
    functions: Optional[list] = None  # OpenAI's deprecated form: refused (use tools)
    function_call: Optional[Union[str, dict]] = None
    reasoning_effort: Optional[str] = None  # passed to the chat template, as vLLM
    include_reasoning: Optional[bool] = None  # no reasoning parser: no reasoning content is returned either way
    documents: Optional[list[dict[str, str]]] = None  # passed to the chat template (RAG templates)
    # refused unless unset (UNSUPPORTED_FIELDS)
    chat_template: Optional[str] = None
    mm_processor_kwargs: Optional[dict] = None
    structural_tag: Optional[str] = None


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
