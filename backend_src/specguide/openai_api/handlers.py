"""What the two generation endpoints (chat_endpoint, completions_endpoint) share: their context, the
answer types, and the SSE stream's plumbing (first delta awaited, errors mid-stream, usage)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional, Union

from ..config import ReasoningMarkers
from . import request_params
from .caps import Caps
from .chat import ChatTemplate
from .errors import ApiError, bad_request
from .outputs import UsageCounter
from .schemas import ChatCompletionRequest, CompletionRequest
from .triton_client import Delta, TritonClient


@dataclass
class Context:
    """What the handlers share: the Triton client, the chat template, the served name, limits."""

    client: Optional[TritonClient]
    template: Optional[ChatTemplate]
    model_name: str
    limits: request_params.Limits = field(default_factory=request_params.Limits)
    default_chat_max_tokens: int = 2048  # OpenAI: up to the context; the model's max_tokens_limit
    reasoning: Optional[ReasoningMarkers] = None  # the model's reasoning_markers: its thinking goes in reasoning_content
    caps: Caps = field(default_factory=Caps)  # counts per request (the --max-* options)
    adapters: list[str] = field(default_factory=list)  # the LoRA adapters config `lora_adapters` names (/v1/models)


Answer = Union[dict[str, Any], AsyncIterator[str]]


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def primed(it: AsyncIterator[tuple[int, Delta]]) -> AsyncIterator[tuple[int, Delta]]:
    """Waits for the first delta now, so that an error before it is an HTTP error status."""
    try:
        first = await it.__anext__()
    except StopAsyncIteration:
        first = None

    async def rest() -> AsyncIterator[tuple[int, Delta]]:
        try:
            if first is not None:
                yield first
                async for x in it:
                    yield x
        finally:
            await it.aclose()
    return rest()


async def guarded(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """An error after the stream began (status 200 sent) is one SSE event with the OpenAI error body."""
    try:
        async for e in events:
            yield e
    except ApiError as e:
        yield sse(e.body())
    finally:
        await events.aclose()


@dataclass
class UsageInStream:
    """stream_options: `usage` on the last chunk (include_usage); with vLLM's continuous_usage_stats
    also on every chunk, counted so far (as vLLM: only together with include_usage)."""

    last: bool = False
    every: bool = False

    def key(self, counter: UsageCounter) -> dict[str, Any]:
        """The `usage` key of a content chunk: absent, null, or the counts so far."""
        if not self.last:
            return {}
        return {"usage": counter.usage.to_openai() if self.every else None}


def check_stream_options(req: Union[ChatCompletionRequest, CompletionRequest]) -> UsageInStream:
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")
    so = req.stream_options
    last = bool(so and so.include_usage)
    return UsageInStream(last, last and bool(so.continuous_usage_stats))
