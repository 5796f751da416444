"""Bodies for the OpenAI server's /v1/completions and /v1/chat/completions (`openai_case`): every
field sane (`openai_sane`) or hostile (`openai_hostile`): n, many prompts, messages, stop lists,
tools, logit_bias, response_format, guides, streams; now and then a body that is not JSON."""
from __future__ import annotations

import json
from typing import Any, Optional

from hypothesis import strategies as st

from .case import Case
from .guides import SAMPLES, hostile_grammars, hostile_regexes, hostile_schemas
from .primitives import cheap, escaped_quotes, ints32, json_scalars, json_values, lengths, nested, token_ids
from .sampling import VLLM_KEYS, structured_outputs, vllm_hostile, vllm_sane
from .triton_tensors import SANE_PROMPTS

def _tool(name: Any, params: Any) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": params}}


schemas_any = st.one_of(st.sampled_from([json.loads(t) for g, t in SAMPLES if g == "json_schema"]),
                        hostile_schemas.map(lambda t: _maybe_json(t)), json_values)


def _maybe_json(t: str) -> Any:
    try:
        return json.loads(t)
    except (ValueError, RecursionError):
        return t


tools = st.one_of(
    st.lists(st.builds(_tool, st.one_of(st.sampled_from(["get_weather", "f", "a" * 64, "a" * 65, "bad name", ""]),
                                        json_scalars), schemas_any), max_size=3),
    st.builds(lambda n: [_tool(f"t{i}", {"type": "object"}) for i in range(n)], st.sampled_from([100, 2000])),
    json_values,
)
messages = st.one_of(
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "developer", "tool", "x"]),
                                    "content": st.one_of(st.text(max_size=24), st.none(), st.just(""),
                                                         st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                                         "text": st.text(max_size=8)}),
                                                                  max_size=2), json_values)}),
             min_size=0, max_size=3),
    st.builds(lambda n: [{"role": "user", "content": "hi"}] * n, st.sampled_from([200, 5000])),
    st.builds(lambda n: [{"role": "user", "content": "w " * n}], st.sampled_from([1000, 20000])),
    json_values,
)
prompts = st.one_of(
    st.text(max_size=24), st.sampled_from(["", "Hi", "<|im_start|>", "x" * 40000]),
    st.lists(st.text(max_size=8), max_size=4), st.lists(token_ids, max_size=6),
    st.lists(st.lists(token_ids, max_size=4), max_size=3),
    st.builds(lambda n: ["a"] * n, st.sampled_from([16, 64, 512])),
    json_values,
)


SANE_SCHEMAS = [json.loads(t) for g, t in SAMPLES if g == "json_schema"][:12]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def openai_sane(f: str, chat: bool) -> st.SearchStrategy[Any]:
    """A value the OpenAI server accepts for field `f` (cheap: at most 8 tokens)."""
    if f in VLLM_KEYS and f not in ("logprobs", "n", "best_of", "prompt_logprobs", "structured_outputs"):
        return vllm_sane(f)
    sane: dict[str, st.SearchStrategy[Any]] = {
        "n": st.integers(1, 3), "best_of": st.none(), "prompt_logprobs": st.integers(0, 3),
        "logprobs": st.booleans() if chat else st.integers(0, 5), "top_logprobs": st.integers(0, 5),
        "response_format": st.one_of(st.sampled_from([{"type": "text"}, {"type": "json_object"}]), st.builds(
            lambda s: {"type": "json_schema", "json_schema": {"name": "out", "schema": s}}, st.sampled_from(SANE_SCHEMAS))),
        "guided_json": st.sampled_from(SANE_SCHEMAS), "guided_regex": st.sampled_from(["[0-9]{3}", "(yes|no)"]),
        "guided_choice": st.just(["yes", "no"]), "guided_grammar": st.just('root ::= "yes" | "no"'),
        "structured_outputs": structured_outputs(hostile=False), "echo": st.booleans(), "stream": st.booleans(),
        "stream_options": st.just({"include_usage": True}), "num_draft_tokens": st.integers(0, 4), "user": st.just("u1"),
        "tools": st.just([WEATHER]), "tool_choice": st.sampled_from(["auto", "none", "required"]),
        "parallel_tool_calls": st.booleans(), "max_completion_tokens": st.integers(1, 8),
    }
    return sane.get(f, json_scalars)


def openai_hostile(f: str) -> st.SearchStrategy[Any]:
    if f == "n":
        return st.one_of(st.sampled_from([16, 17, 0, -1, 10**6]), json_scalars)
    if f in ("stop", "logit_bias", "stop_token_ids", "bad_words", "temperature", "top_p", "min_p", "frequency_penalty",
             "presence_penalty", "repetition_penalty", "structured_outputs"):
        return vllm_hostile(f)
    if f == "response_format":
        return st.one_of(st.just({"type": "x"}), st.builds(
            lambda s, n: {"type": "json_schema", "json_schema": {"name": n, "schema": s}}, schemas_any,
            st.sampled_from(["out", "", "a b", "x" * 65])), json_values)
    if f == "guided_json":
        return schemas_any
    if f == "guided_regex":
        return hostile_regexes
    if f == "guided_grammar":
        return hostile_grammars
    if f == "guided_choice":
        return st.one_of(st.lists(st.text(max_size=6), max_size=4), json_values,
                         st.builds(lambda n: [f"c{i}" for i in range(n)], st.sampled_from([1000, 100_000])))
    if f == "tools":
        return tools
    if f == "tool_choice":
        return st.one_of(st.just({"type": "function", "function": {"name": "nope"}}), json_values)
    if f in ("top_k", "seed", "min_tokens", "logprobs", "top_logprobs", "prompt_logprobs", "num_draft_tokens",
             "best_of", "max_completion_tokens"):
        return st.one_of(ints32, st.integers(-(2**70), 2**70), json_scalars).map(cheap)
    return json_values


@st.composite
def openai_case(draw, chat: Optional[bool] = None) -> Case:
    """A /v1/completions or /v1/chat/completions body: every field sane (two thirds) or hostile, now
    and then a body that is not a JSON object at all."""
    chat = draw(st.booleans()) if chat is None else chat
    path = "/v1/chat/completions" if chat else "/v1/completions"
    target = "openai_chat" if chat else "openai_completions"
    if draw(st.integers(0, 19)) == 0:
        body = draw(st.one_of(st.sampled_from([b"", b"{", b"[]", b"null", b"\xff\xfe", nested(100).encode(),
                                               nested(100_000, "object").encode(), escaped_quotes(24000).encode(),
                                               b'{"model": "specguide", "prompt": "a", "max_tokens": 1e999}']),
                              st.binary(max_size=32)))
        return Case(target, path=path, body=body)
    d: dict[str, Any] = {"model": draw(st.sampled_from(["specguide"] * 30 + ["", "gpt-4", "specguide_vllm", None]))}
    hostile = st.sampled_from([False, False, True])
    if chat:
        d["messages"] = draw(messages) if draw(hostile) else [{"role": "user", "content": draw(
            st.sampled_from([p.decode() for p in SANE_PROMPTS]))}]
    else:
        d["prompt"] = draw(prompts) if draw(hostile) else draw(st.sampled_from([p.decode() for p in SANE_PROMPTS]))
    # (null is OpenAI's "as many as fit": up to max_seq_len here; sent as 8)
    d["max_tokens"] = cheap(draw(st.one_of(lengths, json_scalars.filter(lambda v: v is not None)))) \
        if draw(hostile) else draw(st.integers(1, 8))
    fields = ["n", "stop", "logit_bias", "response_format", "temperature", "top_p", "top_k", "min_p", "seed",
              "frequency_penalty", "presence_penalty", "repetition_penalty", "min_tokens", "stop_token_ids",
              "bad_words", "ignore_eos", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
              "structured_outputs", "logprobs", "echo", "stream", "stream_options", "num_draft_tokens", "best_of",
              "user", "prompt_logprobs", "suffix", "extra_field", "include_stop_str_in_output"]
    if chat:
        fields += ["tools", "tool_choice", "parallel_tool_calls", "top_logprobs", "max_completion_tokens",
                   "chat_template_kwargs", "functions", "reasoning_effort"]
    for f in draw(st.lists(st.sampled_from(fields), max_size=5, unique=True)):
        d[f] = draw(openai_hostile(f)) if draw(hostile) else draw(openai_sane(f, chat))
    if "max_completion_tokens" in d:
        d["max_completion_tokens"] = cheap(d["max_completion_tokens"]) if d["max_completion_tokens"] is not None else 8
    stream = d.get("stream") is True
    return Case(target, path=path, body=json.dumps(d, allow_nan=True).encode("utf-8", "surrogatepass"), stream=stream)
