"""The OpenAI-compatible server's structured outputs and tool calls (specguide.openai_api) against
the real stack, with the official `openai` SDK: JSON schemas (strict or not, a pydantic model),
vLLM's guided extras, forced, parallel, streamed, automatic and refused tool calls.

One OpenAI server process in front of the session's tritonserver: the `api` and `client`
fixtures (conftest.py).
"""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from .openai_helpers import ASK, MODEL, TIME, WEATHER, chat

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


# ------------------------------------------------------------------------------ structured outputs


class Person(BaseModel):
    name: str
    age: int


def test_parse_with_a_pydantic_model(client):
    r = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Describe a person."}],
                                      response_format=Person, max_tokens=48, temperature=0)
    assert isinstance(r.choices[0].message.parsed, Person)


@pytest.mark.parametrize("strict", [True, False])
def test_json_schema_strict_and_not(client, strict):
    r = chat(client, messages=[{"role": "user", "content": "Describe a person."}], max_tokens=48,
             response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": strict}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_json_object_and_vllm_extras(client):
    r = chat(client, response_format={"type": "json_object"}, max_tokens=48)
    json.loads(r.choices[0].message.content)
    r = chat(client, extra_body={"guided_choice": ["sunny", "rainy"]})
    assert r.choices[0].message.content in ("sunny", "rainy")
    r = chat(client, extra_body={"guided_regex": "[0-9]{2} degrees"})
    assert r.choices[0].message.content.endswith(" degrees") and r.choices[0].message.content[:2].isdigit()
    r = chat(client, extra_body={"guided_json": PERSON}, max_tokens=48)
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    r = chat(client, extra_body={"guided_grammar": 'root ::= "yes" | "no"'})
    assert r.choices[0].message.content in ("yes", "no")
    r = chat(client, extra_body={"structured_outputs": {"choice": ["a", "b"]}})
    assert r.choices[0].message.content in ("a", "b")


# ------------------------------------------------------------------------------ tools


def _check_calls(message, names):
    assert message.tool_calls
    for call in message.tool_calls:
        assert call.type == "function" and call.id and call.function.name in names
        schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
        jsonschema.validate(json.loads(call.function.arguments), schema)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls(client, choice):
    r = chat(client, tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=False, max_tokens=64)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    _check_calls(c.message, ["get_time"] if isinstance(choice, dict) else ["get_weather", "get_time"])
    assert len(c.message.tool_calls) == 1


def test_parallel_required_calls_end_whole_within_max_tokens(client):
    """`required` with parallel calls (OpenAI's default): the default model writes call after call
    until max_tokens. The token budget ends the answer after the last call another could not follow,
    so it ends with `tool_calls` and every call whole and valid, not with `length` and a cut call."""
    kw = dict(messages=[{"role": "user", "content": "Weather and time in Paris, Rome, Oslo and Lima?"}],
              tools=[WEATHER, TIME], tool_choice="required", max_tokens=160, temperature=0)
    whole = chat(client, **kw)
    with client.chat.completions.stream(model=MODEL, **kw) as s:
        streamed = s.get_final_completion()
    for r in (whole, streamed):
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and not c.message.content, c  # (a stream's first delta has "")
        assert len(c.message.tool_calls) >= 2
        _check_calls(c.message, ["get_weather", "get_time"])
    assert [t.function.arguments for t in streamed.choices[0].message.tool_calls] == \
        [t.function.arguments for t in whole.choices[0].message.tool_calls]
    assert whole.usage.completion_tokens < 160
    with pytest.raises(openai.BadRequestError, match="max_tokens 8 cannot hold a valid answer"):
        chat(client, **{**kw, "max_tokens": 8})  # not even the shortest call fits: refused, not cut


def test_tool_call_streamed_deltas_accumulate(client):
    kw = dict(messages=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_tokens=64,
              temperature=0)
    whole = client.chat.completions.create(model=MODEL, **kw).choices[0].message.tool_calls[0]
    with client.chat.completions.stream(model=MODEL, **kw) as s:
        final = s.get_final_completion()
    got = final.choices[0]
    assert got.finish_reason == "tool_calls"
    assert (got.message.tool_calls[0].function.name, got.message.tool_calls[0].function.arguments) == \
        (whole.function.name, whole.function.arguments)
    # the raw chunks: the id and name first, then the arguments as they are written (not one piece)
    calls = [c for chunk in client.chat.completions.create(model=MODEL, stream=True, **kw)
             for choice in chunk.choices for c in choice.delta.tool_calls or []]
    assert calls[0].id.startswith("call_")
    assert calls[0].function.name == whole.function.name and all(c.id is None for c in calls[1:])
    assert len(calls) > 2 and "".join(c.function.arguments or "" for c in calls) == whole.function.arguments


def test_tool_choice_auto_and_none(client):
    prompt = [{"role": "user", "content": "Call get_weather for Paris in C now."}]
    r = chat(client, messages=prompt, tools=[WEATHER], tool_choice="auto", max_tokens=64).choices[0]
    if r.message.tool_calls:  # the model chose to call: the arguments hold to the schema
        _check_calls(r.message, ["get_weather"])
        assert r.finish_reason == "tool_calls"
    else:
        assert r.message.content and "<tool_call>" not in r.message.content
    r = chat(client, messages=prompt, tools=[WEATHER], tool_choice="none").choices[0]
    assert not r.message.tool_calls and r.finish_reason in ("stop", "length")
    # a conversation that carries a call and its result renders (the generic format in the prompt)
    history = prompt + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C and sunny"}]
    r = chat(client, messages=history, tools=[WEATHER], tool_choice="none").choices[0]
    assert r.message.content
