"""Triton deltas -> OpenAI objects: log probs in both formats, usage, finish reasons, streams merged."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

from .triton_client import Delta

# the engine's finish reasons -> OpenAI's (a time limit is a length limit to an OpenAI client)
FINISH = {"stop": "stop", "length": "length", "timeout": "length"}


def finish_reason(reason: Optional[str], tool_calls: bool = False) -> Optional[str]:
    if reason is None:
        return None
    out = FINISH.get(reason, reason)
    return "tool_calls" if tool_calls and out == "stop" else out


MIN_LOGPROB = -9999.0  # what OpenAI and vLLM send for an impossible token (JSON has no -inf)


def _entries(doc: dict[str, dict], n: int) -> tuple[dict, list[dict]]:
    """One token's vLLM entry -> (the sampled token's, the top n by rank), log probs made finite
    (a token the grammar masks has log prob -inf)."""
    items = [{**e, "logprob": max(float(e["logprob"]), MIN_LOGPROB)} for e in doc.values()]
    top = sorted((e for e in items if e["rank"] <= n), key=lambda e: e["rank"])[:n]
    return items[0], top


def chat_logprobs(docs: list[dict[str, dict]], n: int) -> list[dict[str, Any]]:
    """vLLM per-token docs -> chat `logprobs.content` entries."""
    out = []
    for doc in docs:
        tok, top = _entries(doc, n)
        out.append({"token": tok["decoded_token"], "logprob": tok["logprob"],
                    "bytes": list(tok["decoded_token"].encode("utf-8")),
                    "top_logprobs": [{"token": e["decoded_token"], "logprob": e["logprob"],
                                      "bytes": list(e["decoded_token"].encode("utf-8"))} for e in top]})
    return out


def vllm_prompt_logprobs(docs: Optional[list[dict[str, dict]]], n: int) -> Optional[list[Optional[dict]]]:
    """vLLM's `prompt_logprobs`: None for the first prompt token, then per token {id: {logprob, rank,
    decoded_token}} with the token itself and the top n (log probs made finite)."""
    if docs is None:
        return None
    out: list[Optional[dict]] = [None]
    for doc in docs[1:]:
        keep = [(k, e) for i, (k, e) in enumerate(doc.items()) if i == 0 or e["rank"] <= n]
        out.append({k: {**e, "logprob": max(float(e["logprob"]), MIN_LOGPROB)} for k, e in keep})
    return out


@dataclass
class CompletionLogprobs:
    """The legacy completions `logprobs` object, accumulated."""

    n: int
    offset: int = 0

    def __post_init__(self) -> None:
        self.tokens: list[str] = []
        self.token_logprobs: list[Optional[float]] = []
        self.top_logprobs: list[Optional[dict[str, float]]] = []
        self.text_offset: list[int] = []

    def add(self, docs: list[dict[str, dict]]) -> dict[str, Any]:
        """Add these tokens; returns the object for just them (a stream chunk's)."""
        part = CompletionLogprobs(self.n, self.offset)
        for doc in docs:
            tok, top = _entries(doc, self.n)
            for target in (self, part):
                target.tokens.append(tok["decoded_token"])
                target.token_logprobs.append(tok["logprob"])
                target.top_logprobs.append({e["decoded_token"]: e["logprob"] for e in top})
                target.text_offset.append(self.offset)
            self.offset += len(tok["decoded_token"])
        return part.to_openai()

    def add_prompt(self, docs: list[dict[str, dict]]) -> dict[str, Any]:
        """Add the prompt's tokens (echo), each the first key of its doc; the first token has no log
        prob (null, as OpenAI's). Returns the object for just them."""
        part = CompletionLogprobs(self.n, self.offset)
        for doc in docs:
            first = next(iter(doc.values()))
            if first["logprob"] is None:
                text, lp, top = first["decoded_token"], None, None
            else:
                tok, best = _entries(doc, self.n)
                text, lp, top = tok["decoded_token"], tok["logprob"], {e["decoded_token"]: e["logprob"] for e in best}
            for target in (self, part):
                target.tokens.append(text)
                target.token_logprobs.append(lp)
                target.top_logprobs.append(top)
                target.text_offset.append(self.offset)
            self.offset += len(text)
        return part.to_openai()

    def to_openai(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
                "text_offset": self.text_offset}


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def to_openai(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


class UsageCounter:
    """Counts a request's tokens from its deltas (each prompt counted once, whatever n is)."""

    def __init__(self) -> None:
        self.usage = Usage()
        self._prompts: set[int] = set()

    def add(self, prompt: int, d: Delta) -> None:
        if d.num_input_tokens is not None and prompt not in self._prompts:
            self._prompts.add(prompt)
            self.usage.prompt_tokens += d.num_input_tokens
        self.usage.completion_tokens += d.num_output_tokens


async def merge(streams: list[AsyncIterator[Delta]]) -> AsyncIterator[tuple[int, Delta]]:
    """(prompt index, delta) from several prompts' streams as they arrive; the first error wins and
    closing this iterator closes (cancels) every stream."""
    if len(streams) == 1:
        async for d in streams[0]:
            yield 0, d
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int, s: AsyncIterator[Delta]) -> None:
        try:
            async for d in s:
                await queue.put((i, d))
        except Exception as e:  # handed to the consumer
            await queue.put((i, e))
        finally:
            await queue.put((i, end))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is end:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
