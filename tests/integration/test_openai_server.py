"""The OpenAI-compatible server (specguide.openai_api) against the real stack, with the official `openai` SDK.

One OpenAI server process in front of the session's tritonserver (free ports, 127.0.0.1); a
second one with an API key and a third pointed at a port where nothing listens, for the errors.
"""
from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from .conftest import ROOT, _free_ports, launch, repository_with, stop_and_check

MODEL = "specguide"
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Api:
    """One OpenAI server process."""

    def __init__(self, triton_grpc: str, log: Path, *extra: str):
        self.port = _free_ports(1)[0]
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = {**os.environ, "SPECGUIDE_API_KEY": ""}
        with open(log, "wb") as f:
            self.proc = subprocess.Popen([sys.executable, "-m", "specguide.openai_api", "--triton-url", triton_grpc,
                                          "--port", str(self.port), *extra], stdout=f, stderr=subprocess.STDOUT,
                                         env=env, cwd=ROOT)
        deadline = time.monotonic() + 60
        while not self._up():
            assert self.proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)

    def _up(self) -> bool:
        try:
            with urllib.request.urlopen(self.base + "/v1/models", timeout=2):
                return True
        except urllib.error.HTTPError:
            return True  # answering (e.g. 401)
        except OSError:
            return False

    def client(self, key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key=key, max_retries=0, timeout=300)

    def post(self, path: str, body: bytes, headers: Optional[dict] = None) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        data = r.read()
        conn.close()
        return r.status, json.loads(data)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def api(server, tmp_path_factory):
    a = Api(server.grpc, tmp_path_factory.mktemp("openai") / "api.log")
    deadline = time.monotonic() + 60  # the server reads the model's settings from Triton once it answers
    while "configured from Triton" not in a.log.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    yield a
    a.stop()
    assert "Traceback" not in a.log.read_text(), a.log.read_text()[-3000:]


@pytest.fixture(scope="module")
def client(api):
    return api.client()


def chat(client, **kw):
    return client.chat.completions.create(model=MODEL, **{"messages": ASK, "max_tokens": 24, "temperature": 0, **kw})


# ------------------------------------------------------------------------------ basics


def test_models_and_health(api, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    with urllib.request.urlopen(api.base + "/health") as r:
        assert json.loads(r.read()) == {"status": "ok"}


def test_the_start_up_heap_is_frozen_out_of_full_collections(api):
    """FastAPI, pydantic's schemas, the gRPC client: walked by no full collection while streams wait (heap.py)."""
    frozen = re.search(r"start-up heap frozen: (\d+) objects", api.log.read_text())
    assert frozen and int(frozen.group(1)) > 50000, api.log.read_text()[-2000:]


def test_chat_whole_and_streamed_agree_with_usage(client):
    whole = chat(client, messages=[{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": [{"type": "text", "text": "Name a color."}]}])
    c = whole.choices[0]
    assert c.message.role == "assistant" and c.message.content and c.finish_reason in ("stop", "length")
    u = whole.usage
    assert u.prompt_tokens > 0 and 0 < u.completion_tokens <= 24 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    chunks = list(chat(client, messages=[{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "Name a color."}],
                       stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == c.message.content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == [c.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == u.model_dump()
    assert all(ch.usage is None for ch in chunks[:-1])


def test_completions_prompts_n_echo_and_logprobs(client):
    r = client.completions.create(model=MODEL, prompt=["The capital of France is", "1, 2, 3,"], max_tokens=6,
                                  n=2, temperature=0.8, seed=11, logprobs=3)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:
        lp = c.logprobs
        assert "".join(lp.tokens) == c.text and len(lp.token_logprobs) == len(lp.tokens) == len(lp.top_logprobs)
        assert all(len(t) <= 3 for t in lp.top_logprobs) and all(v <= 0 for v in lp.token_logprobs)
    assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in r.choices)
    e = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0, echo=True)
    assert e.choices[0].text.startswith("The capital of France is") and len(e.choices[0].text) > 24
    s = list(client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0,
                                       echo=True, stream=True))
    assert "".join(ch.choices[0].text for ch in s) == e.choices[0].text


def test_token_id_prompts(client):
    """`prompt` as token ids (one list, or a list of lists: what lm-eval's local-completions sends)
    answers as the same text does, echoed as the model's text of them; ids outside the vocabulary are
    the model's 400."""
    from specguide.util.paths import cache_dir
    from specguide.tokenizer import TokenizerFile

    tok = TokenizerFile(cache_dir() / "models" / "smollm2-135m-instruct")
    kw = dict(model=MODEL, max_tokens=6, temperature=0)
    want = [client.completions.create(prompt=p, **kw) for p in ("The capital of France is", "1, 2, 3,")]
    ids = [tok.encode(p) for p in ("The capital of France is", "1, 2, 3,")]
    one = client.completions.create(prompt=ids[0], **kw)
    assert one.choices[0].text == want[0].choices[0].text
    assert one.usage.prompt_tokens == want[0].usage.prompt_tokens == len(ids[0])
    both = client.completions.create(prompt=ids, **kw)
    assert [c.text for c in both.choices] == [w.choices[0].text for w in want]
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(prompt=ids[1], stream=True, **kw))
    assert streamed == want[1].choices[0].text
    echoed = client.completions.create(prompt=ids[0], echo=True, **kw).choices[0].text
    assert echoed == "The capital of France is" + want[0].choices[0].text
    with pytest.raises(openai.BadRequestError, match="out of range"):
        client.completions.create(prompt=[1, 10**8], **kw)
    # logit_bias by token id: +100 all but forces a token at every position
    zebra = tok.encode(" zebra")[0]
    r = chat(client, max_tokens=4, logit_bias={str(zebra): 100})
    assert r.choices[0].message.content == " zebra" * 4


def test_vllm_extras_stop_token_ids_bad_words_and_continuous_usage(client):
    from specguide.util.paths import cache_dir
    from specguide.tokenizer import TokenizerFile

    tok = TokenizerFile(cache_dir() / "models" / "smollm2-135m-instruct")
    kw = dict(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=10, temperature=0)
    base = client.completions.create(**kw).choices[0]
    comma = tok.encode(",")[0]
    r = client.completions.create(**kw, extra_body={"stop_token_ids": [comma]}).choices[0]
    # vLLM's rule: a stop token that is not a special token stays in the text
    assert r.finish_reason == "stop" and r.text == base.text[:base.text.index(",") + 1]
    word = base.text.split(",")[1]  # " 6": the answer writes it; banned, it does not
    r = client.completions.create(**kw, extra_body={"bad_words": [word]}).choices[0]
    assert word + "," not in r.text and r.text != base.text
    chunks = list(client.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [ch.usage.completion_tokens for ch in chunks]
    assert counts == sorted(counts) and counts[-1] == 10 and all(ch.usage is not None for ch in chunks)


def test_echo_with_logprobs_scores_the_prompt(client, server):
    """What lm-eval's loglikelihood requests send (token ids, echo, logprobs 1, max_tokens 1): every
    prompt token's log prob (null for the first) and top entry, then the generated one's; the same
    numbers streamed, and as the model's prompt_logprobs over Triton; text prompts alike."""
    from specguide.util.paths import cache_dir
    from specguide.tokenizer import TokenizerFile

    tok = TokenizerFile(cache_dir() / "models" / "smollm2-135m-instruct")
    text = "The capital of France is Paris"
    ids = tok.encode(text)
    kw = dict(model=MODEL, echo=True, logprobs=1, max_tokens=1, temperature=0)
    r = client.completions.create(prompt=ids, **kw).choices[0]
    lp = r.logprobs
    assert r.text.startswith(text) and len(lp.tokens) == len(ids) + 1 == len(lp.token_logprobs)
    assert "".join(lp.tokens) == r.text and lp.text_offset[0] == 0
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert all(len(t) >= 1 for t in lp.top_logprobs[1:])
    assert lp.token_logprobs[-1] == max(lp.top_logprobs[-1].values())  # greedy: the generated token is the top one
    same = client.completions.create(prompt=text, **kw).choices[0].logprobs
    assert same.tokens == lp.tokens and same.token_logprobs == lp.token_logprobs
    streamed = list(client.completions.create(prompt=ids, stream=True, **kw))
    assert [v for ch in streamed if ch.choices and ch.choices[0].logprobs
            for v in ch.choices[0].logprobs.token_logprobs] == lp.token_logprobs
    # max_tokens 0 with echo scores the prompt alone (OpenAI's legacy API), whole or streamed
    for stream in (False, True):
        got = client.completions.create(prompt=ids, **{**kw, "max_tokens": 0}, stream=stream,
                                        **({"stream_options": {"include_usage": True}} if stream else {}))
        chunks = list(got) if stream else [got]
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text
        assert [v for ch in chunks if ch.choices and ch.choices[0].logprobs
                for v in ch.choices[0].logprobs.token_logprobs] == lp.token_logprobs[:-1]
        assert chunks[-1].usage.completion_tokens == 0 and chunks[-1].usage.prompt_tokens == len(ids)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=ids, max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
    # vLLM's prompt_logprobs: per choice (completions), once per answer (chat); whole answers only
    v = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0,
                                  extra_body={"prompt_logprobs": 2}).model_dump()["choices"][0]["prompt_logprobs"]
    assert v[0] is None and len(v) == len(ids)
    assert [v[j][str(ids[j])]["logprob"] for j in range(1, len(ids))] == pytest.approx(lp.token_logprobs[1:len(ids)], abs=1e-5)
    assert all(2 <= len(e) <= 3 for e in v[1:])  # the token and the top 2
    c = chat(client, max_tokens=2, extra_body={"prompt_logprobs": 0}).model_dump()
    assert c["prompt_logprobs"][0] is None and len(c["prompt_logprobs"]) == c["usage"]["prompt_tokens"]
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, max_tokens=2, stream=True, extra_body={"prompt_logprobs": 0})
    assert e.value.body["param"] == "prompt_logprobs"
    # over Triton: specguide's prompt_logprobs output
    got = _grpc_stream_prompt_logprobs(server, text)
    assert [None] + [float(next(iter(e.values()))["logprob"]) for e in got[1:]] == \
        pytest.approx([None] + lp.token_logprobs[1:len(ids)], abs=1e-4)


def _grpc_stream_prompt_logprobs(server, text: str) -> list:
    import numpy as np
    import tritonclient.grpc as grpcclient

    results = []
    c = grpcclient.InferenceServerClient(server.grpc)
    c.start_stream(callback=lambda result, error: results.append((result, error)))
    try:
        inputs = []
        for name, value, dtype in (("text_input", [[text.encode()]], "BYTES"), ("stream", [[True]], "BOOL"),
                                   ("max_tokens", [[1]], "INT32"),
                                   ("sampling_parameters", [[json.dumps({"prompt_logprobs": 0, "temperature": 0}).encode()]],
                                    "BYTES")):
            arr = np.array(value, dtype=object if dtype == "BYTES" else (np.bool_ if dtype == "BOOL" else np.int32))
            t = grpcclient.InferInput(name, arr.shape, dtype)
            t.set_data_from_numpy(arr)
            inputs.append(t)
        c.async_stream_infer("specguide", inputs, outputs=[grpcclient.InferRequestedOutput("prompt_logprobs")],
                             enable_empty_final_response=True)
        deadline = time.monotonic() + 120
        while not any(r is not None and r.get_response().parameters["triton_final_response"].bool_param
                      for r, _ in results) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        c.stop_stream()
        c.close()
    assert all(e is None for _, e in results), results
    docs = [r.as_numpy("prompt_logprobs") for r, _ in results if r.as_numpy("prompt_logprobs") is not None]
    assert len(docs) == 1  # once
    return json.loads(docs[0].reshape(-1)[0])


def test_n_and_seeds(client):
    kw = dict(messages=[{"role": "user", "content": "Write a word."}], temperature=1.0, max_tokens=8)
    a, b = chat(client, seed=5, n=2, **kw), chat(client, seed=5, n=2, **kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]  # reproducible
    # vLLM's min_p: 1 keeps only the likeliest token, so temperature 1 answers as greedy does
    kw["max_tokens"] = 16
    greedy = chat(client, **{**kw, "temperature": 0}).choices[0].message.content
    assert [c.message.content for c in chat(client, seed=5, n=2, extra_body={"min_p": 1.0}, **kw).choices] == [greedy] * 2


def test_stop_strings_are_cut(client):
    base = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0).choices[0].text
    word = base.strip().split(",")[1].strip()  # a number the model writes
    r = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[word, "zzz"])
    assert r.choices[0].finish_reason == "stop" and word not in r.choices[0].text
    assert base.startswith(r.choices[0].text)


def test_logprobs_identical_with_speculation_on_and_off(client):
    kw = dict(messages=[{"role": "user", "content": "Describe a person as JSON."}], max_tokens=24, logprobs=True,
              top_logprobs=2, response_format={"type": "json_object"})
    on = chat(client, **kw).choices[0]
    off = chat(client, extra_body={"num_draft_tokens": 0}, **kw).choices[0]
    assert on.message.content == off.message.content
    assert [t.model_dump() for t in on.logprobs.content] == [t.model_dump() for t in off.logprobs.content]
    assert "".join(t.token for t in on.logprobs.content) == on.message.content
    assert all(len(t.top_logprobs) == 2 for t in on.logprobs.content)


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


# ------------------------------------------------------------------------------ errors


@pytest.mark.parametrize("body, param", [
    ({"messages": ASK, "tempratur": 1}, "tempratur"),
    ({"messages": ASK, "temperature": 5}, "temperature"),
    ({"messages": ASK, "max_tokens": 10**6}, "max_tokens"),
    ({"messages": ASK, "n": 0}, "n"),
    ({"messages": ASK, "logit_bias": {"5": 101}}, "logit_bias"),
    ({"messages": ASK, "logit_bias": {"five": 1}}, "logit_bias"),
    ({"messages": ASK, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "video", "video": "x"}]}]}, "messages[0].content[0]"),
    ({"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"messages": ASK, "guided_regex": "(ab"}, "guided_regex"),
    ({"messages": ASK, "guided_choice": ["a"], "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": ASK, "tool_choice": "required"}, "tool_choice"),
    ({"messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"messages": ASK, "stream_options": {"include_usage": True}}, "stream_options"),
    ({}, "messages"),
])
def test_bad_requests_are_400_naming_the_field(api, body, param):
    status, got = api.post("/v1/chat/completions", json.dumps({"model": MODEL, **body}).encode())
    assert status == 400, got
    assert got["error"]["type"] == "invalid_request_error" and got["error"]["param"] == param and got["error"]["message"]


def test_sdk_errors_unknown_model_body_caps(api, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=ASK)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", suffix="y")
    assert e.value.body["param"] == "suffix"
    status, got = api.post("/v1/completions", b"[" * 200 + b"]" * 200)
    assert status == 400 and "nests deeper" in got["error"]["message"]
    status, got = api.post("/v1/completions", b" " * (5 << 20))
    assert status == 413 and "limit" in got["error"]["message"]
    status, got = api.post("/v1/completions", b"{not json")
    assert status == 400 and "not valid JSON" in got["error"]["message"]


def test_api_key_and_unavailable_triton(server, tmp_path):
    keyed = Api(server.grpc, tmp_path / "keyed.log", "--api-key", "s3cret")
    dead_url = f"127.0.0.1:{_free_ports(1)[0]}"
    dead = Api(dead_url, tmp_path / "dead.log")
    try:
        with pytest.raises(openai.AuthenticationError):
            keyed.client("wrong").models.list()
        with pytest.raises(urllib.error.HTTPError) as h:  # no key at all
            urllib.request.urlopen(keyed.base + "/v1/models")
        assert h.value.code == 401 and json.loads(h.value.read())["error"]["type"] == "authentication_error"
        with urllib.request.urlopen(keyed.base + "/health") as r:  # health needs no key
            assert r.status == 200
        assert [m.id for m in keyed.client("s3cret").models.list().data] == [MODEL]
        with pytest.raises(openai.InternalServerError) as e:
            dead.client().completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert e.value.status_code == 503 and "not reachable" in e.value.body["message"]
        dead_port = dead_url.rsplit(":", 1)[1]
        assert dead_port not in e.value.body["message"]  # the back end's address stays in the log
        with pytest.raises(urllib.error.HTTPError) as h:
            urllib.request.urlopen(dead.base + "/health")
        assert h.value.code == 503
        said = h.value.read().decode()
        assert dead_port not in said and "127.0.0.1" not in said and json.loads(said)["error"]["message"]
    finally:
        keyed.stop()
        dead.stop()


def test_no_key_beyond_loopback_refuses_to_start():
    """Secure by default: on a non-loopback address without a key the server exits at once, saying
    what to do, and never listens; --allow-no-key starts it (/v1/models answers without Triton)."""
    port, triton_port = _free_ports(2)
    env = {k: v for k, v in os.environ.items() if k != "SPECGUIDE_API_KEY"}
    cmd = [sys.executable, "-m", "specguide.openai_api", "--triton-url", f"127.0.0.1:{triton_port}", "--host", "0.0.0.0",
           "--port", str(port)]
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "refusing to listen on 0.0.0.0 without an API key" in r.stderr and "--allow-no-key" in r.stderr
    assert "SPECGUIDE_API_KEY" in r.stderr
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
    proc = subprocess.Popen(cmd + ["--allow-no-key"], env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as resp:
                    assert json.loads(resp.read())["data"][0]["id"] == MODEL
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_twenty_thousand_prompts_are_refused_before_triton_sees_one(api, server):
    """The measured attack (one gRPC stream per prompt stalled other streams 30 s): a 400 naming the
    limit, and not one of the prompts reaches Triton; a request within the limit is served."""
    before = server.metric("nv_inference_request_success", model=MODEL)
    body = {"model": MODEL, "prompt": ["a"] * 20000, "max_tokens": 1}
    status, got = api.post("/v1/completions", json.dumps(body).encode())
    assert status == 400 and got["error"]["param"] == "prompt", got
    assert "20000" in got["error"]["message"] and "--max-choices-per-request" in got["error"]["message"]
    status, got = api.post("/v1/completions", json.dumps({**body, "prompt": ["a"] * 3, "n": 2}).encode())
    assert status == 200 and len(got["choices"]) == 6
    # the 3 prompts of the second request, and nothing of the first
    assert server.wait_metric("nv_inference_request_success", before + 3, timeout=60, model=MODEL) == before + 3


def test_serves_again_once_a_restarted_triton_is_back(tmp_path):
    """Triton stops and comes back on the same port (a fleet restarts it): meanwhile answers are 503,
    then the same OpenAI server process serves again, and the stopped Triton was not held up."""
    srv = launch(tmp_path / "first.log", ROOT / "model_repository")
    api = Api(srv.grpc, tmp_path / "api.log")
    try:
        before = chat(api.client(), max_tokens=6).choices[0].message.content
        with api.client().chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, temperature=0,
                                                    stream=True) as s:
            assert "".join(c.choices[0].delta.content or "" for c in s if c.choices) == before
        t0 = time.monotonic()
        stop_and_check(srv)  # while the OpenAI server keeps its connection to it
        assert time.monotonic() - t0 < 50, "tritonserver waited on the OpenAI server's connection"
        with pytest.raises(openai.InternalServerError) as e:
            chat(api.client(), max_tokens=6)
        assert e.value.status_code == 503 and "not reachable" in e.value.body["message"]
        srv = launch(tmp_path / "second.log", ROOT / "model_repository",
                     env={"TRITON_GRPC_PORT": srv.grpc.rsplit(":", 1)[1]})
        assert chat(api.client(), max_tokens=6).choices[0].message.content == before
    finally:
        api.stop()
        stop_and_check(srv)
    assert "Traceback" not in api.log.read_text(), api.log.read_text()[-3000:]


def test_client_disconnect_mid_stream_frees_the_slot(api, server):
    before = server.metric("specguide_cancellations_total", stage="decode")
    conn = http.client.HTTPConnection("127.0.0.1", api.port, timeout=300)
    body = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 1500, "ignore_eos": True, "stream": True,
            "temperature": 0}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    got = b""
    while got.count(b"data:") < 3:  # generating
        got += r.read1(4096)
    assert server.wait_metric("specguide_active_slots", 1.0, timeout=60) == 1.0
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    assert server.wait_metric("specguide_cancellations_total", before + 1, timeout=60, stage="decode") == before + 1
    assert server.wait_metric("specguide_active_slots", 0.0, timeout=60) == 0.0


def _stream_chunks(api: Api, n: int):
    """A long streamed completion: the open connection once `n` chunks came (None if refused: status, body)."""
    conn = http.client.HTTPConnection("127.0.0.1", api.port, timeout=300)
    body = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 1500, "ignore_eos": True, "stream": True,
            "temperature": 0}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        return None, (r.status, json.loads(r.read()))
    got = b""
    while got.count(b"data:") < n:
        got += r.read1(4096)
    return conn, None


def test_full_queue_is_429_and_the_rest_carries_on(tmp_path):
    """One slot, a queue of one: a third request is 429 rate_limit_error (retry later), not a fault."""
    srv = launch(tmp_path / "server.log", repository_with(tmp_path, {"max_slots": "1", "max_queue": "1"}))
    api = Api(srv.grpc, tmp_path / "api.log")
    try:
        running, err = _stream_chunks(api, 2)
        assert err is None
        queued: dict = {}
        t = threading.Thread(target=lambda: queued.update(zip(("conn", "err"), _stream_chunks(api, 1))))
        t.start()
        assert srv.wait_metric("specguide_queue_depth", 1.0, timeout=60) == 1.0
        with pytest.raises(openai.RateLimitError) as e:
            api.client().completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert e.value.body["type"] == "rate_limit_error" and "queue is full" in e.value.body["message"]
        running.sock.close()  # frees the slot: the queued one runs
        running.close()
        t.join(timeout=120)
        assert queued.get("err") is None and queued.get("conn") is not None
        queued["conn"].sock.close()
        queued["conn"].close()
        assert srv.wait_metric("specguide_active_slots", 0.0, timeout=60) == 0.0
    finally:
        api.stop()
        stop_and_check(srv)
