"""The two generation endpoints: a checked request -> Triton requests -> an answer or an SSE stream."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional, Union

from ..config import ReasoningMarkers
from . import guides, sampling
from .chat import ChatTemplate, render_chat
from .errors import ApiError, bad_request, unsupported
from .outputs import CompletionLogprobs, UsageCounter, chat_logprobs, finish_reason, merge, vllm_prompt_logprobs
from .reasoning import ReasoningSplitter, split_all
from .schemas import ChatCompletionRequest, CompletionRequest, ToolChoiceMode
from .tools import ToolCallParser, parse_all
from .triton_client import Delta, TritonClient, TritonRequest

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass
class Context:
    """What the handlers share: the Triton client, the chat template, the served name, limits."""

    client: Optional[TritonClient]
    template: Optional[ChatTemplate]
    model_name: str
    limits: sampling.Limits = field(default_factory=sampling.Limits)
    default_chat_max_tokens: int = 2048  # OpenAI: up to the context; the model's max_tokens_limit
    reasoning: Optional[ReasoningMarkers] = None  # the model's reasoning_markers: its thinking goes in reasoning_content


Answer = Union[dict[str, Any], AsyncIterator[str]]


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _primed(it: AsyncIterator[tuple[int, Delta]]) -> AsyncIterator[tuple[int, Delta]]:
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


async def _guarded(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """An error after the stream began (status 200 sent) is one SSE event with the OpenAI error body."""
    try:
        async for e in events:
            yield e
    except ApiError as e:
        yield _sse(e.body())
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


def _check_stream_options(req: Union[ChatCompletionRequest, CompletionRequest]) -> UsageInStream:
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")
    so = req.stream_options
    last = bool(so and so.include_usage)
    return UsageInStream(last, last and bool(so.continuous_usage_stats))


# ------------------------------------------------------------------------------ chat


async def chat(ctx: Context, req: ChatCompletionRequest) -> Answer:
    if ctx.template is None:
        raise unsupported("messages", "the model's chat template could not be found; use /v1/completions")
    usage_in = _check_stream_options(req)
    choice = guides.check_tool_choice(req)
    tools_on = choice != ToolChoiceMode.NONE
    guide = guides.resolve(req, choice)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    top = (req.top_logprobs or 0) if req.logprobs else None
    prompt = render_chat(ctx.template, req.messages, req.tools if tools_on else None, req.chat_template_kwargs)
    treq = sampling.build(req, prompt, guide, req.max_completion_tokens or req.max_tokens, ctx.default_chat_max_tokens,
                          top, ctx.limits)
    it = await _primed(merge([ctx.client.generate(treq)]))
    head = {"id": "chatcmpl-" + uuid.uuid4().hex, "created": int(time.time()), "model": ctx.model_name}
    if req.stream:
        return _guarded(_chat_stream(it, head, treq, top, tools_on, usage_in, ctx.reasoning))
    return await _chat_whole(it, head, treq, top, tools_on, ctx.reasoning, req.prompt_logprobs)


async def _chat_whole(it, head: dict, treq: TritonRequest, top: Optional[int], tools_on: bool,
                      markers: Optional[ReasoningMarkers], prompt_n: Optional[int]) -> dict[str, Any]:
    texts, docs, reasons = [""] * treq.n, [[] for _ in range(treq.n)], [None] * treq.n
    prompt_docs = None
    usage = UsageCounter()
    async for p, d in it:
        usage.add(p, d)
        prompt_docs = prompt_docs or d.prompt_logprobs
        texts[d.index] += d.text
        docs[d.index] += d.logprobs or []
        reasons[d.index] = d.finish_reason or reasons[d.index]
    choices = []
    for i in range(treq.n):
        thought, text = split_all(markers, treq.prompt, texts[i])
        content, calls = parse_all(text) if tools_on else (text, [])
        message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
        if markers is not None:
            message["reasoning_content"] = thought
        if calls:
            message["tool_calls"] = [c.to_openai() for c in calls]
        choices.append({"index": i, "message": message,
                        "logprobs": {"content": chat_logprobs(docs[i], top), "refusal": None} if top is not None else None,
                        "finish_reason": finish_reason(reasons[i], bool(calls))})
    answer = {**head, "object": "chat.completion", "choices": choices, "usage": usage.usage.to_openai()}
    if prompt_n is not None:  # vLLM's: once per answer (the choices share the prompt)
        answer["prompt_logprobs"] = vllm_prompt_logprobs(prompt_docs, prompt_n)
    return answer


async def _chat_stream(it, head: dict, treq: TritonRequest, top: Optional[int], tools_on: bool,
                       usage_in: UsageInStream, markers: Optional[ReasoningMarkers]) -> AsyncIterator[str]:
    usage = UsageCounter()
    parsers = [ToolCallParser() for _ in range(treq.n)]
    thinkers = [ReasoningSplitter(markers, treq.prompt) if markers else None for _ in range(treq.n)]
    started = set()

    def chunk(i: int, delta: dict, lp: Any = None, reason: Optional[str] = None) -> str:
        return _sse({**head, "object": "chat.completion.chunk",
                     "choices": [{"index": i, "delta": delta, "logprobs": lp, "finish_reason": reason}],
                     **usage_in.key(usage)})

    async for p, d in it:
        usage.add(p, d)
        i = d.index
        out = []  # this delta's events, sent together (one write, one wake-up of the client)
        if i not in started:
            started.add(i)
            out.append(chunk(i, {"role": "assistant", "content": ""}))
        delta: dict[str, Any] = {}
        text = d.text
        if thinkers[i] is not None:
            thought, text = thinkers[i].feed(text)
            thought += thinkers[i].finish() if d.finish_reason else ""
            if thought:
                delta["reasoning_content"] = thought
        if tools_on:
            parser = parsers[i]
            content, pieces = parser.feed(text)
            if d.finish_reason:
                rest, pieces = parser.finish(pieces)
                content += rest
            if pieces:
                delta["tool_calls"] = [c.to_openai() for c in pieces]
        else:
            content = text
        if content:
            delta["content"] = content
        lp = {"content": chat_logprobs(d.logprobs, top), "refusal": None} if top is not None and d.logprobs else None
        if delta or lp:
            out.append(chunk(i, delta, lp))
        if d.finish_reason:
            out.append(chunk(i, {}, None, finish_reason(d.finish_reason, bool(parsers[i].calls))))
        if out:
            yield "".join(out)
    tail = [_sse({**head, "object": "chat.completion.chunk", "choices": [], "usage": usage.usage.to_openai()})] \
        if usage_in.last else []
    yield "".join(tail + ["data: [DONE]\n\n"])


# ------------------------------------------------------------------------------ completions


async def complete(ctx: Context, req: CompletionRequest) -> Answer:
    usage_in = _check_stream_options(req)
    prompts = _prompts(req.prompt)
    guide = guides.resolve(req)
    treqs = [sampling.build(req, p, guide, req.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS, req.logprobs, ctx.limits)
             for p in prompts]
    if req.echo and (req.logprobs is not None or any(isinstance(p, list) for p in prompts)):
        for t in treqs:  # the model sends the prompt's tokens (and their log probs) back
            t.sampling["prompt_logprobs"] = max(req.logprobs or 0, req.prompt_logprobs or 0)
            t.prompt_logprobs = True
    it = await _primed(merge([ctx.client.generate(t) for t in treqs]))
    head = {"id": "cmpl-" + uuid.uuid4().hex, "created": int(time.time()), "model": ctx.model_name}
    n = treqs[0].n
    echo = [Echo(p) if req.echo else None for p in prompts]
    if req.stream:
        return _guarded(_complete_stream(it, head, n, echo, req.logprobs, usage_in))
    return await _complete_whole(it, head, n, echo, req.logprobs, req.prompt_logprobs)


def _prompts(prompt: Union[str, list[str], list[int], list[list[int]]]) -> list[Union[str, list[int]]]:
    """The request's prompts: strings, or token-id lists (one list of ints is one prompt, as OpenAI's)."""
    prompts = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else list(prompt)
    if not prompts or any(not p for p in prompts):
        raise bad_request("prompt must be a non-empty string, a non-empty list of token ids, or a list of either",
                          "prompt")
    if any(isinstance(p, list) and not all(0 <= t < 2**31 for t in p) for p in prompts):
        raise bad_request("token ids in prompt must be in [0, 2^31)", "prompt")
    return prompts


@dataclass
class Echo:
    """A completions prompt to echo: its text, or (token ids) the text of its tokens as the model
    decodes them (the `prompt_logprobs` output carries them, with their log probs)."""

    prompt: Union[str, list[int]]

    def text(self, d: Delta) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        return "".join(next(iter(doc.values()))["decoded_token"] for doc in d.prompt_logprobs or [])

    def logprobs(self, lp: CompletionLogprobs, d: Delta) -> Optional[dict[str, Any]]:
        """The prompt's entries added to the choice's log probs (once, from its first delta)."""
        return lp.add_prompt(d.prompt_logprobs) if d.prompt_logprobs else None


async def _complete_whole(it, head: dict, n: int, echo: list[Optional[Echo]], top: Optional[int],
                          prompt_n: Optional[int]) -> dict[str, Any]:
    total = len(echo) * n
    texts = [""] * total
    prompt_docs: list[Optional[list]] = [None] * total
    lps = [CompletionLogprobs(top) for _ in range(total)] if top is not None else None
    reasons: list[Optional[str]] = [None] * total
    started = set()
    usage = UsageCounter()
    async for p, d in it:
        usage.add(p, d)
        k = p * n + d.index
        if k not in started:
            started.add(k)
            prompt_docs[k] = d.prompt_logprobs
            if echo[p] is not None:
                texts[k] = echo[p].text(d)
                if lps is not None:
                    echo[p].logprobs(lps[k], d)
        texts[k] += d.text
        if lps is not None:
            lps[k].add(d.logprobs or [])
        reasons[k] = d.finish_reason or reasons[k]
    choices = [{"index": k, "text": texts[k], "logprobs": lps[k].to_openai() if lps else None,
                "finish_reason": finish_reason(reasons[k])} for k in range(total)]
    if prompt_n is not None:  # vLLM's, per choice
        for k, c in enumerate(choices):
            c["prompt_logprobs"] = vllm_prompt_logprobs(prompt_docs[k], prompt_n)
    return {**head, "object": "text_completion", "choices": choices, "usage": usage.usage.to_openai()}


async def _complete_stream(it, head: dict, n: int, echo: list[Optional[Echo]], top: Optional[int],
                           usage_in: UsageInStream) -> AsyncIterator[str]:
    usage = UsageCounter()
    lps: dict[int, CompletionLogprobs] = {}
    started = set()

    def chunk(k: int, text: str, lp: Any = None, reason: Optional[str] = None) -> str:
        return _sse({**head, "object": "text_completion",
                     "choices": [{"index": k, "text": text, "logprobs": lp, "finish_reason": reason}],
                     **usage_in.key(usage)})

    async for p, d in it:
        usage.add(p, d)
        k = p * n + d.index
        out = []  # this delta's events, sent together
        if k not in started:
            started.add(k)
            if echo[p] is not None:
                elp = echo[p].logprobs(lps.setdefault(k, CompletionLogprobs(top)), d) if top is not None else None
                out.append(chunk(k, echo[p].text(d), elp))
        lp = lps.setdefault(k, CompletionLogprobs(top)).add(d.logprobs or []) if top is not None else None
        if d.text or lp:
            out.append(chunk(k, d.text, lp))
        if d.finish_reason:
            out.append(chunk(k, "", None, finish_reason(d.finish_reason)))
        if out:
            yield "".join(out)
    tail = [_sse({**head, "object": "text_completion", "choices": [], "usage": usage.usage.to_openai()})] \
        if usage_in.last else []
    yield "".join(tail + ["data: [DONE]\n\n"])
