"""Request schemas of the OpenAI-compatible API (pydantic, strict JSON types).

Unknown top-level fields are ignored and logged (as vLLM does); a JSON ``null`` means
"use the default".
Type errors, bad JSON and missing required fields surface as ``pydantic.ValidationError``,
which the app turns into HTTP 400 with OpenAI's error envelope.
"""
from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class _Schema(BaseModel):
    # strict: "5" is not an int and 1 is not a bool (ints are still accepted for floats).
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Schema):
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False


class _SamplingFields(_Schema):
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


PromptType = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(_SamplingFields):
    prompt: PromptType
    max_tokens: Optional[int] = None  # None: 16, like OpenAI's legacy completions
    logprobs: Optional[int] = None
    echo: Optional[bool] = False
    suffix: Optional[str] = None


class TextContentPart(_Schema):
    type: Literal["text"]
    text: str


class ChatMessage(_Schema):
    role: str
    content: Optional[Union[str, list[TextContentPart]]] = None
    name: Optional[str] = None

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
