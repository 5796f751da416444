"""POST /v1/chat/completions: messages rendered by the chat template -> one Triton request -> an
answer or an SSE stream (tool calls and reasoning split out of the text)."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

from ..config import ReasoningMarkers
from . import caps, guides, request_params
from .chat import render_chat
from .errors import bad_request, unsupported
from .handlers import Answer, Context, UsageInStream, check_stream_options, guarded, primed, sse
from .outputs import UsageCounter, chat_logprobs, finish_reason, merge, vllm_prompt_logprobs
from .reasoning import ReasoningSplitter, split_all
from .schemas import ChatCompletionRequest, ToolChoiceMode
from .tools import ToolCallParser, parse_all
from .triton_client import TritonRequest


@dataclass
class ChatPlan:
    """A checked chat request, ready to send: the Triton request and how to answer."""

    treq: TritonRequest
    top: Optional[int]
    tools_on: bool
    usage_in: UsageInStream
    prompt_n: Optional[int]
    stream: bool


def prepare(ctx: Context, req: ChatCompletionRequest) -> ChatPlan:
    """Counts, guide, prompt and sampling checked and built: no I/O (app.py runs it off the event loop
    for a large body)."""
    caps.check(req, ctx.caps)
    if ctx.template is None:
        raise unsupported("messages", "the model's chat template could not be found; use /v1/completions")
    usage_in = check_stream_options(req)
    choice = guides.check_tool_choice(req)
    tools_on = choice != ToolChoiceMode.NONE
    guide = guides.resolve(req, choice)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    top = (req.top_logprobs or 0) if req.logprobs else None
    prompt = render_chat(ctx.template, req.messages, req.tools if tools_on else None, req.chat_template_kwargs)
    treq = request_params.build(req, prompt, guide, req.max_completion_tokens or req.max_tokens,
                                ctx.default_chat_max_tokens, top, ctx.limits, ctx.model_name)
    return ChatPlan(treq, top, tools_on, usage_in, req.prompt_logprobs, bool(req.stream))


async def run(ctx: Context, plan: ChatPlan) -> Answer:
    """Sends the plan's request to Triton: the answer, or its SSE stream."""
    it = await primed(merge([ctx.client.generate(plan.treq)]))
    head = {"id": "chatcmpl-" + uuid.uuid4().hex, "created": int(time.time()),
            "model": plan.treq.sampling.get("lora_name", ctx.model_name)}  # an adapter's name, as vLLM answers
    if plan.stream:
        return guarded(_chat_stream(it, head, plan.treq, plan.top, plan.tools_on, plan.usage_in, ctx.reasoning))
    return await _chat_whole(it, head, plan.treq, plan.top, plan.tools_on, ctx.reasoning, plan.prompt_n)


async def chat(ctx: Context, req: ChatCompletionRequest) -> Answer:
    return await run(ctx, prepare(ctx, req))


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
        return sse({**head, "object": "chat.completion.chunk",
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
    tail = [sse({**head, "object": "chat.completion.chunk", "choices": [], "usage": usage.usage.to_openai()})] \
        if usage_in.last else []
    yield "".join(tail + ["data: [DONE]\n\n"])
