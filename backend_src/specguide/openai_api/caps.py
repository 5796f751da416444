"""Counts one request may carry, checked before any work is done on it.

The body's bytes are capped first (`--max-body-bytes`, app.py), but 4 MiB hold a million
one-character prompts: each prompt is a task and a Triton gRPC stream of its own here, and each
stop string, stop token id, bad word and tool is work on the engine loop for every token. So the
counts a client picks are capped too, each by a server option (a 400 naming the field, the count,
the limit and the option).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from ..request import MAX_LOGIT_BIAS
from .errors import bad_request
from .schemas import ChatCompletionRequest, CompletionRequest

DEFAULT_MAX_CHOICES = 64  # lm-eval's batch of prompts (batch_size up to 64), or n up to 16 on 4 prompts


@dataclass(frozen=True)
class Caps:
    """Per-request count limits (the command line's --max-* options)."""

    max_choices: int = DEFAULT_MAX_CHOICES  # prompts x n: the choices of one answer
    max_stop: int = 64  # stop strings (OpenAI allows 4; lm-eval's `until` lists hold a few)
    max_stop_token_ids: int = 256  # vLLM's stop_token_ids (a model's end ids: a handful)
    max_bad_words: int = 256  # vLLM's bad_words
    max_tools: int = 128  # OpenAI's own limit on tools


def count_prompts(prompt: Union[str, list]) -> int:
    """How many prompts `prompt` holds, as completions_endpoint._prompts reads it (without its checks)."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return 1
    return len(prompt)


def _too_many(field: str, what: str, count: int, limit: int, option: str):
    return bad_request(f"{field} has {count} {what}; the limit is {limit} per request (this server's {option})",
                       field, "too_many")


def check(req: Union[ChatCompletionRequest, CompletionRequest], caps: Caps) -> None:
    """A 400 for the first count of `req` past its cap; nothing has been done with the request yet."""
    n = req.n or 1
    if isinstance(req, CompletionRequest):
        prompts = count_prompts(req.prompt)
        if prompts * n > caps.max_choices:
            field = "prompt" if prompts > 1 else "n"
            raise bad_request(f"{prompts} prompt(s) x n {n} = {prompts * n} choices; the limit is {caps.max_choices} "
                              "per request (this server's --max-choices-per-request): send the prompts in "
                              "several requests", field, "too_many")
    elif n > caps.max_choices:
        raise _too_many("n", "choices", n, caps.max_choices, "--max-choices-per-request")
    if isinstance(req.stop, list) and len(req.stop) > caps.max_stop:
        raise _too_many("stop", "strings", len(req.stop), caps.max_stop, "--max-stop-strings")
    if req.stop_token_ids is not None and len(req.stop_token_ids) > caps.max_stop_token_ids:
        raise _too_many("stop_token_ids", "ids", len(req.stop_token_ids), caps.max_stop_token_ids,
                        "--max-stop-token-ids")
    if req.bad_words is not None and len(req.bad_words) > caps.max_bad_words:
        raise _too_many("bad_words", "words", len(req.bad_words), caps.max_bad_words, "--max-bad-words")
    if req.logit_bias is not None and len(req.logit_bias) > MAX_LOGIT_BIAS:
        raise bad_request(f"logit_bias has {len(req.logit_bias)} entries; at most {MAX_LOGIT_BIAS} (the size of the "
                          "engine's bias table)", "logit_bias", "too_many")
    tools = getattr(req, "tools", None)
    if tools is not None and len(tools) > caps.max_tools:
        raise _too_many("tools", "tools", len(tools), caps.max_tools, "--max-tools")
