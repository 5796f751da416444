"""POST /v1/completions: prompts (text or token ids) -> one Triton request each -> an answer or an SSE
stream (echo, the legacy log probs object, vLLM's prompt_logprobs)."""
from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional, Union

from . import caps, guides, request_params
from .errors import bad_request
from .handlers import Answer, Context, UsageInStream, check_stream_options, guarded, primed, sse
from .outputs import CompletionLogprobs, UsageCounter, finish_reason, merge, vllm_prompt_logprobs
from .schemas import CompletionRequest
from .triton_client import Delta, TritonRequest

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass
class CompletionPlan:
    """A checked completions request, ready to send: one Triton request per prompt, and how to answer."""

    treqs: list[TritonRequest]
    echo: list[Optional["Echo"]]
    top: Optional[int]  # the legacy logprobs: N
    prompt_n: Optional[int]
    scoring: bool
    usage_in: UsageInStream
    stream: bool


def prepare(ctx: Context, req: CompletionRequest) -> CompletionPlan:
    """Counts, prompts, guide and sampling checked and built: no I/O (app.py runs it off the event
    loop for a large body)."""
    caps.check(req, ctx.caps)  # before anything else: a million prompts fit in the body
    usage_in = check_stream_options(req)
    prompts = _prompts(req.prompt)
    guide = guides.resolve(req)
    scoring = req.max_tokens == 0  # the prompt scored, nothing generated (OpenAI's legacy echo + max_tokens 0)
    if scoring and not req.echo:
        raise bad_request("max_tokens 0 scores the prompt: it needs echo: true", "max_tokens")
    treqs = [request_params.build(req, p, guide, 1 if scoring else req.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS,
                                  req.logprobs, ctx.limits, ctx.model_name) for p in prompts]
    if req.echo and (req.logprobs is not None or any(isinstance(p, list) for p in prompts)):
        for t in treqs:  # the model sends the prompt's tokens (and their log probs) back
            t.sampling["prompt_logprobs"] = max(req.logprobs or 0, req.prompt_logprobs or 0)
            t.prompt_logprobs = True
    echo = [Echo(p) if req.echo else None for p in prompts]
    return CompletionPlan(treqs, echo, req.logprobs, req.prompt_logprobs, scoring, usage_in, bool(req.stream))


async def run(ctx: Context, plan: CompletionPlan) -> Answer:
    """Sends the plan's requests to Triton: the answer, or its SSE stream."""
    it = await primed(merge([ctx.client.generate(t) for t in plan.treqs]))
    head = {"id": "cmpl-" + uuid.uuid4().hex, "created": int(time.time()),
            "model": plan.treqs[0].sampling.get("lora_name", ctx.model_name)}  # an adapter's name, as vLLM answers
    n = plan.treqs[0].n
    if plan.stream:
        return guarded(_complete_stream(it, head, n, plan.echo, plan.top, plan.usage_in, plan.scoring))
    return await _complete_whole(it, head, n, plan.echo, plan.top, plan.prompt_n, plan.scoring)


async def complete(ctx: Context, req: CompletionRequest) -> Answer:
    return await run(ctx, prepare(ctx, req))


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


def _unsaid(d: Delta) -> Delta:
    """A scoring request's delta without the one token the model had to generate."""
    return dataclasses.replace(d, text="", logprobs=None, num_output_tokens=0)


async def _complete_whole(it, head: dict, n: int, echo: list[Optional[Echo]], top: Optional[int],
                          prompt_n: Optional[int], scoring: bool) -> dict[str, Any]:
    total = len(echo) * n
    texts = [""] * total
    prompt_docs: list[Optional[list]] = [None] * total
    lps = [CompletionLogprobs(top) for _ in range(total)] if top is not None else None
    reasons: list[Optional[str]] = [None] * total
    started = set()
    usage = UsageCounter()
    async for p, d in it:
        d = _unsaid(d) if scoring else d
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
                           usage_in: UsageInStream, scoring: bool) -> AsyncIterator[str]:
    usage = UsageCounter()
    lps: dict[int, CompletionLogprobs] = {}
    started = set()

    def chunk(k: int, text: str, lp: Any = None, reason: Optional[str] = None) -> str:
        return sse({**head, "object": "text_completion",
                     "choices": [{"index": k, "text": text, "logprobs": lp, "finish_reason": reason}],
                     **usage_in.key(usage)})

    async for p, d in it:
        d = _unsaid(d) if scoring else d
        usage.add(p, d)
        k = p * n + d.index
        out = []  # this delta's events, sent together
        if k not in started:
            started.add(k)
            if echo[p] is not None:
                elp = echo[p].logprobs(lps.setdefault(k, CompletionLogprobs(top)), d) if top is not None else None
                out.append(chunk(k, echo[p].text(d), elp))
        lp = lps.setdefault(k, CompletionLogprobs(top)).add(d.logprobs) if top is not None and d.logprobs else None
        if d.text or lp:
            out.append(chunk(k, d.text, lp))
        if d.finish_reason:
            out.append(chunk(k, "", None, finish_reason(d.finish_reason)))
        if out:
            yield "".join(out)
    tail = [sse({**head, "object": "text_completion", "choices": [], "usage": usage.usage.to_openai()})] \
        if usage_in.last else []
    yield "".join(tail + ["data: [DONE]\n\n"])
