"""Pydantic models of the OpenAI request bodies this server accepts.

Every model forbids unknown keys, so a field we do not know is a 400 that names it. Fields that we
know but do not serve are declared too and refused in `request_params.py` with a message saying why
(rather than a generic "extra field"). Ranges follow OpenAI's documentation.
"""
from __future__ import annotations

from enum import Enum
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ------------------------------------------------------------------------------ messages


class TextPart(_Strict):
    """A text content part."""

    type: Literal["text"]
    text: str


class OtherPart(BaseModel):
    """An image, audio, file or refusal part: parsed so that its refusal can say why (`chat.py`)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["image_url", "input_audio", "file", "refusal"]


Content = Union[str, list[Annotated[Union[TextPart, OtherPart], Field(discriminator="type")]]]


class FunctionCall(_Strict):
    name: str
    arguments: str  # a JSON string, as OpenAI sends it


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Role(str, Enum):
    SYSTEM = "system"
    DEVELOPER = "developer"  # OpenAI's newer name for system
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"


class Message(_Strict):
    """One chat message. `name` is accepted and rendered only where the template uses it."""

    role: Role
    content: Optional[Content] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None  # assistant
    tool_call_id: Optional[str] = None  # tool
    refusal: Optional[str] = None  # assistant (echoed back by SDKs); must be null

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, TextPart))


# ------------------------------------------------------------------------------ tools


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None  # a JSON Schema; absent = no arguments ({})
    strict: Optional[bool] = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ToolChoiceMode(str, Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"


# ------------------------------------------------------------------------------ response_format


class JsonSchemaSpec(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: Optional[str] = None
    # `schema` shadows a BaseModel attribute, hence the alias
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormatText(_Strict):
    type: Literal["text"]


class ResponseFormatJsonObject(_Strict):
    type: Literal["json_object"]


class ResponseFormatJsonSchema(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Union[ResponseFormatText, ResponseFormatJsonObject, ResponseFormatJsonSchema]


class StreamOptions(_Strict):
    include_usage: Optional[bool] = None
    continuous_usage_stats: Optional[bool] = None  # vLLM: usage on every chunk


# ------------------------------------------------------------------------------ requests


class _Sampling(_Strict):
    """What chat and completions share: sampling, stop, n, streaming, guides, vLLM extras."""

    model: str
    frequency_penalty: Optional[float] = Field(default=None, ge=-2, le=2)
    presence_penalty: Optional[float] = Field(default=None, ge=-2, le=2)
    logit_bias: Optional[dict[str, float]] = None  # token id (as a string) -> bias in [-100, 100]
    max_tokens: Optional[int] = Field(default=None, ge=1)
    n: Optional[int] = Field(default=None, ge=1, le=16)
    seed: Optional[int] = Field(default=None, ge=-(2**63), lt=2**64)
    stop: Optional[Union[str, list[str]]] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    temperature: Optional[float] = Field(default=None, ge=0, le=2)
    top_p: Optional[float] = Field(default=None, gt=0, le=1)
    user: Optional[str] = None  # accepted: only logged by OpenAI; nothing here keys on it
    # vLLM extras (the engine has them)
    top_k: Optional[int] = Field(default=None, ge=-1)
    min_p: Optional[float] = Field(default=None, ge=0, le=1)
    min_tokens: Optional[int] = Field(default=None, ge=0)
    repetition_penalty: Optional[float] = Field(default=None, gt=0)
    ignore_eos: Optional[bool] = None
    stop_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    skip_special_tokens: Optional[bool] = None  # vLLM's default, true, only
    spaces_between_special_tokens: Optional[bool] = None  # vLLM's default, true, only
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    guided_decoding_backend: Optional[str] = None
    guided_whitespace_pattern: Optional[str] = None
    structured_outputs: Optional[dict[str, Any]] = None
    response_format: Optional[ResponseFormat] = Field(default=None, discriminator="type")
    # SpecGuide: draft tokens per step (0 turns speculation off), as the Triton input of that name
    num_draft_tokens: Optional[int] = Field(default=None, ge=0)
    # known OpenAI / vLLM fields that are refused (see request_params.REFUSED)
    best_of: Optional[int] = None
    service_tier: Optional[str] = None
    store: Optional[bool] = None
    metadata: Optional[dict[str, Any]] = None
    use_beam_search: Optional[bool] = None
    include_stop_str_in_output: Optional[bool] = None
    prompt_logprobs: Optional[int] = Field(default=None, ge=0, le=20)  # vLLM: the prompt's log probs, top N


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[Union[ToolChoiceMode, NamedToolChoice]] = None
    parallel_tool_calls: Optional[bool] = None
    # refused (see request_params.REFUSED)
    functions: Optional[list[Any]] = None
    function_call: Optional[Any] = None
    modalities: Optional[list[str]] = None
    audio: Optional[Any] = None
    prediction: Optional[Any] = None
    reasoning_effort: Optional[str] = None
    web_search_options: Optional[Any] = None
    verbosity: Optional[str] = None
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_generation_prompt: Optional[bool] = None
    continue_final_message: Optional[bool] = None


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]  # text, or token ids (sent as `input_ids`)
    max_tokens: Optional[int] = Field(default=None, ge=0)  # 0 (with echo): score the prompt only
    echo: Optional[bool] = None
    logprobs: Optional[int] = Field(default=None, ge=0, le=20)  # OpenAI caps it at 5, vLLM at 20
    suffix: Optional[str] = None  # refused


class LoadLoRAAdapterRequest(_Strict):
    """vLLM's /v1/load_lora_adapter body: the folder (under the model's `lora_root`) served as `lora_name`."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)
    load_inplace: bool = False  # replace the adapter served under lora_name


class UnloadLoRAAdapterRequest(_Strict):
    """vLLM's /v1/unload_lora_adapter body."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: Optional[int] = None  # vLLM's engine id: accepted, the name decides
