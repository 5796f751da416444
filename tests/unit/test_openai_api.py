"""specguide.openai_api without a server: tool-call parsing, guides, error mapping, prompts, requests."""
from __future__ import annotations

import json
from typing import Optional

import numpy as np
import pytest
from pydantic import ValidationError

from specguide.openai_api import guides, request_params
from specguide.openai_api.chat import ChatTemplate, render_chat
from specguide.openai_api.errors import ApiError, from_triton, from_validation
from specguide.openai_api.outputs import CompletionLogprobs, chat_logprobs, finish_reason
from specguide.openai_api.schemas import ChatCompletionRequest, CompletionRequest, Tool
from specguide.openai_api.tools import CALL_BEGIN, ToolCallParser, call_text, parse_all, tool_guide
from specguide.openai_api.triton_client import build_request, split_url

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "hi"}]


def chat_req(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "specguide", "messages": ASK, **kw})


# ------------------------------------------------------------------------------ tool calls


def _stream(parser: ToolCallParser, parts: list[str]) -> tuple[str, dict[int, list]]:
    """Feeds `parts`, then finishes: (content, the pieces of each call index)."""
    content, calls = "", {}
    for piece_list in [parser.feed(t) for t in parts] + [parser.finish()]:
        content += piece_list[0]
        for c in piece_list[1]:
            calls.setdefault(c.index, []).append(c)
    return content, calls


def test_tool_call_parser_holds_back_a_split_trigger_and_finds_calls():
    text = "Sure. " + call_text("get_weather", {"city": "Paris"}) + "\n" + call_text("get_weather", {"city": "Rome"})
    for cut in range(1, len(text)):  # every split point of two deltas
        p = ToolCallParser()
        content, calls = _stream(p, [text[:cut], text[cut:]])
        assert content == "Sure. " and CALL_BEGIN not in content
        assert [json.loads("".join(c.arguments for c in pieces))["city"] for pieces in calls.values()] == ["Paris", "Rome"]
        assert [c.arguments for c in p.calls] == ['{"city": "Paris"}', '{"city": "Rome"}']


def test_tool_call_arguments_stream_as_they_are_written():
    args = {"city": "Paris", "days": [1, 2], "opts": {"unit": "C"}}
    text = "x " + call_text("get_weather", args) + "\n" + call_text("f", {})
    p = ToolCallParser()
    content, calls = _stream(p, list(text))  # one character a delta, like tokens
    assert content == "x "
    first, *rest = calls[0]
    # the id and name go out once the head is complete, before the arguments are finished
    assert first.call is not None and first.call.name == "get_weather" and all(c.call is None for c in rest)
    assert len(rest) > 10 and json.loads("".join(c.arguments for c in calls[0])) == args
    assert "".join(c.arguments for c in calls[1]) == "{}" and calls[1][0].call.name == "f"
    assert [c.to_openai()["index"] for c in calls[1]] == [1] * len(calls[1])
    assert set(calls[0][0].to_openai()) == {"index", "id", "type", "function"}
    assert set(calls[0][1].to_openai()) == {"index", "function"}
    assert [c.name for c in p.calls] == ["get_weather", "f"]


def test_parse_all_content_only_calls_only_and_unfinished():
    assert parse_all("just text") == ("just text", [])
    content, calls = parse_all(call_text("f", {}))
    assert content is None and calls[0].name == "f" and calls[0].arguments == "{}" and calls[0].id.startswith("call_")
    content, calls = parse_all("Hi <tool_call>\n{\"name\": \"f\", \"argu")  # cut inside the head: dropped
    assert calls == [] and content == "Hi "
    p = ToolCallParser()  # streamed: the cut head never went out as content
    assert p.feed("Hi <tool_call>\n{\"na") == ("Hi ", []) and p.finish() == ("", [])
    # cut inside the arguments (max_tokens): the call keeps what was written, as a stream sent it
    head = '<tool_call>\n{"name": "f", "arguments": '
    for cut, args in ((head + '{"a": {"b": 1}}}\n</tool', '{"a": {"b": 1}}'), (head + '{"a": {"b": 1}', '{"a": {"b": 1}'),
                      (head + '{"a": {"b": 1}}', '{"a": {"b": 1}}'), (head + '{"a": {"b"', '{"a": {"b"')):
        content, calls = parse_all(cut)
        assert content is None and calls[0].name == "f" and calls[0].arguments == args, cut
    # another key order (only possible unguided): parsed whole, arguments as JSON
    content, calls = parse_all('<tool_call>\n{"arguments": {"a":1}, "name": "g"}\n</tool_call>')
    assert content is None and (calls[0].name, calls[0].arguments) == ("g", '{"a": 1}')


def test_tool_guides_compile_and_force_the_format():
    xgr = pytest.importorskip("xgrammar")
    tools = [Tool.model_validate(TOOL)]
    info = xgr.TokenizerInfo([chr(c) for c in range(32, 127)])
    compiler = xgr.GrammarCompiler(info)
    call = call_text("get_weather", {"city": "Paris"})
    for choice, text, ok in (("required", call, True), ("required", "Hello", False), ("auto", "Hi " + call, True),
                             ("auto", "Hello", True)):
        req = chat_req(tools=[TOOL], tool_choice=choice)
        tag = tool_guide(tools, guides.check_tool_choice(req), parallel=True)
        m = xgr.GrammarMatcher(compiler.compile_structural_tag(json.dumps(tag)))
        assert m.accept_string(text) == ok, (choice, text)
    assert tool_guide(tools, guides.check_tool_choice(chat_req(tools=[TOOL], tool_choice="none")), True) is None


# ------------------------------------------------------------------------------ guides


def test_one_guide_per_request_named_by_its_field():
    assert guides.resolve(chat_req()) is None
    g = guides.resolve(chat_req(response_format={"type": "json_schema", "json_schema": {
        "name": "p", "schema": {"type": "object"}, "strict": True}}))
    assert g.param == "response_format" and g.structured_outputs == {"json": {"type": "object"}, "strict": True}
    assert guides.resolve(chat_req(guided_regex="[a-z]+")).structured_outputs == {"regex": "[a-z]+"}
    with pytest.raises(ApiError) as e:
        guides.resolve(chat_req(guided_regex="a", guided_choice=["b"]))
    assert e.value.status == 400 and e.value.param == "guided_choice"
    with pytest.raises(ApiError) as e:
        guides.resolve(chat_req(guided_json="{not json"))
    assert e.value.param == "guided_json" and "not valid JSON" in e.value.message
    with pytest.raises(ApiError) as e:
        guides.check_tool_choice(chat_req(tool_choice="auto"))
    assert e.value.param == "tool_choice"
    tc = guides.check_tool_choice(chat_req(tools=[TOOL]))
    assert guides.resolve(chat_req(tools=[TOOL]), tc).param == "tool_choice"


# ------------------------------------------------------------------------------ errors


def test_triton_errors_map_to_openai_statuses():
    assert from_triton("INVALID_ARG", "bad", "response_format").status == 400
    assert from_triton("INVALID_ARG", "bad", "response_format").param == "response_format"
    assert from_triton("UNSUPPORTED", "no").status == 400
    assert from_triton("UNAVAILABLE", "the waiting queue is full (256 requests)").status == 429
    assert from_triton("UNAVAILABLE", "the engine is not running").status == 503
    assert from_triton("", "Request for unknown model: 'specguide' is not found").status == 503
    e = from_triton("INTERNAL", "boom", "response_format")
    assert e.status == 500 and e.param is None and e.body()["error"]["type"] == "server_error"


def _param(body: dict) -> ApiError:
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate(body)
    return from_validation(e.value, body)


def test_validation_errors_name_the_field():
    assert _param({"model": "m", "messages": ASK, "bogus": 1}).param == "bogus"
    assert _param({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}).param == "messages[0].role"


@pytest.mark.parametrize("extra, param", [
    # the labels pydantic puts in a union member's location (its type, a discriminator's tag) are left out
    ({"response_format": {"type": "json_schema", "json_schema": {"nam": "x"}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "jsn"}}, "response_format"),
    ({"tool_choice": {"type": "function"}}, "tool_choice.function"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"nme": "x"}}]}, "tools[0].function.name"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text"}]}]},
     "messages[0].content[1].text"),
    ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"n": "two"}, "n"),
])
def test_union_errors_name_the_field_as_sent(extra, param):
    e = _param({"model": "m", "messages": ASK, **extra})
    assert e.param == param and f"'{param}'" in e.body()["error"]["message"]


def test_non_text_content_parts_are_refused_saying_why():
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                     {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]})
    assert req.messages[1].text() == "What is this?"
    with pytest.raises(ApiError) as e:
        render_chat(None, req.messages, None)
    assert e.value.status == 400 and e.value.param == "messages[1].content[1].type"
    assert "'image_url' parts" in e.value.message and "text only" in e.value.message


# ------------------------------------------------------------------------------ requests


def test_sampling_fields_map_to_the_models_inputs():
    req = chat_req(temperature=0.5, top_p=0.9, min_p=0.05, seed=-1, stop="END", n=2, presence_penalty=1.0,
                   num_draft_tokens=0)
    t = request_params.build(req, "prompt", None, 10, 100, 3, request_params.Limits(2048))
    assert t.sampling == {"max_tokens": 10, "temperature": 0.5, "top_p": 0.9, "min_p": 0.05, "presence_penalty": 1.0,
                          "seed": 2**64 - 1, "stop": ["END"], "logprobs": 3}
    with pytest.raises(ValidationError):
        chat_req(min_p=1.5)
    biased = request_params.build(chat_req(logit_bias={"42": -100}, stop_token_ids=[7], bad_words=["no"]), "p", None,
                                  4, 100, None, request_params.Limits())
    assert (biased.sampling["logit_bias"], biased.sampling["stop_token_ids"], biased.sampling["bad_words"]) == \
        ({"42": -100}, [7], ["no"])
    for bad in ({"42": 101}, {"x": 1}):
        with pytest.raises(ApiError) as e:
            request_params.build(chat_req(logit_bias=bad), "p", None, 4, 100, None, request_params.Limits())
        assert e.value.status == 400 and e.value.param == "logit_bias"
    assert (t.n, t.num_draft_tokens, t.logprobs) == (2, 0, True)
    msg = build_request(t, "r1")
    assert {i.name for i in msg.inputs} >= {"text_input", "sampling_parameters", "num_return_sequences",
                                            "num_draft_tokens", "return_logprobs"}
    assert msg.parameters["specguide_error_output"].bool_param
    with pytest.raises(ApiError) as e:
        request_params.build(chat_req(max_completion_tokens=5000), "p", None, 5000, 100, None,
                             request_params.Limits(2048))
    assert e.value.param == "max_completion_tokens"
    with pytest.raises(ApiError) as e:
        request_params.build(CompletionRequest(model="m", prompt="x", best_of=3), "p", None, None, 16, None,
                             request_params.Limits())
    assert e.value.param == "best_of" and e.value.code == "unsupported_parameter"
    # vLLM's detokenizer options at their defaults (what vLLM clients send) pass; the others are refused
    request_params.build(chat_req(skip_special_tokens=True, spaces_between_special_tokens=True), "p", None, 4, 100,
                         None, request_params.Limits())
    with pytest.raises(ApiError) as e:
        request_params.build(chat_req(skip_special_tokens=False), "p", None, 4, 100, None, request_params.Limits())
    assert e.value.param == "skip_special_tokens" and e.value.code == "unsupported_parameter"


def test_logprobs_formats():
    docs = [{"5": {"logprob": -0.1, "rank": 1, "decoded_token": "a"}, "6": {"logprob": float("-inf"), "rank": 2,
                                                                             "decoded_token": "b"}}]
    (entry,) = chat_logprobs(docs, 2)
    assert entry["token"] == "a" and entry["bytes"] == [97] and entry["top_logprobs"][1]["logprob"] == -9999.0
    acc = CompletionLogprobs(1)
    part = acc.add(docs)
    assert part == acc.to_openai() == {"tokens": ["a"], "token_logprobs": [-0.1], "top_logprobs": [{"a": -0.1}],
                                       "text_offset": [0]}
    assert finish_reason("stop", tool_calls=True) == "tool_calls" and finish_reason("timeout") == "length"


def test_generic_tool_format_reaches_a_template_without_tools(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<e>"}))
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
    t = ChatTemplate(tmp_path)
    assert not t.supports_tools
    req = chat_req(tools=[TOOL], messages=[
        {"role": "developer", "content": "Be kind."}, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])
    text = render_chat(t, req.messages, req.tools)
    # chat_template_kwargs reach the template (Qwen3's enable_thinking); not the request's own fields
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}{% if not enable_thinking %}/no_think{% endif %}")
    assert render_chat(ChatTemplate(tmp_path), chat_req().messages, None, {"enable_thinking": False}) == "hi/no_think"
    assert render_chat(ChatTemplate(tmp_path), chat_req().messages, None, {"enable_thinking": True}) == "hi"
    with pytest.raises(ApiError) as e:
        render_chat(ChatTemplate(tmp_path), chat_req().messages, None, {"add_generation_prompt": False})
    assert e.value.param == "chat_template_kwargs"
    assert text.startswith("[system]Be kind.\n\nYou may call") and '"name": "get_weather"' in text
    assert '[assistant]<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>' in text
    assert "[tool]<tool_response>\nsunny\n</tool_response>" in text and text.endswith("[assistant]")


def test_reasoning_goes_in_reasoning_content_at_every_split():
    from specguide.config import ReasoningMarkers as Markers
    from specguide.openai_api.reasoning import ReasoningSplitter, split_all

    m = Markers.parse("<think>,</think>")
    assert Markers.parse("") is None and m == Markers("<think>", "</think>")
    text = "<think>Paris is in France.</think>\n\nParis."
    for cut in range(len(text) + 1):
        s = ReasoningSplitter(m, "prompt")
        r1, c1 = s.feed(text[:cut])
        r2, c2 = s.feed(text[cut:])
        assert (r1 + r2 + s.finish(), c1 + c2) == ("Paris is in France.", "Paris.")
    assert split_all(m, "...<think>\n", "thinking</think>answer") == ("thinking", "answer")
    assert split_all(m, "<think>\n\n</think>\n\n", "just the answer") == (None, "just the answer")  # thinking off
    assert split_all(m, "p", "never closed") == ("never closed", "")
    assert split_all(None, "p", "<think>x</think>y") == (None, "<think>x</think>y")


def test_an_error_mid_stream_is_one_sse_error_event():
    import asyncio

    from specguide.openai_api.handlers import guarded

    async def events():
        yield "data: 1\n\n"
        raise from_triton("INTERNAL", "the model produced non-finite logits")

    async def collect():
        return [e async for e in guarded(events())]

    got = asyncio.run(collect())
    assert got[0] == "data: 1\n\n" and json.loads(got[1][len("data: "):])["error"]["type"] == "server_error"


def test_triton_urls():
    assert split_url("127.0.0.1:8001") == ("127.0.0.1", 8001)
    assert split_url("triton.fleet.svc:9001") == ("triton.fleet.svc", 9001)
    assert split_url("[::1]:8001") == ("::1", 8001)
    for bad in ("localhost", "localhost:grpc", "http://x:80/"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            split_url(bad)


def test_a_stream_sends_each_deltas_events_in_one_write(tmp_path):
    """The role chunk goes with the first text, the finish chunk with the last, usage with [DONE]:
    one write (one wake-up of the client) per Triton response, and one to end."""
    import asyncio

    from specguide.openai_api import chat_endpoint, completions_endpoint, handlers
    from specguide.openai_api.triton_client import Delta

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<e>"}))
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")

    class Triton:
        async def generate(self, treq):
            yield Delta(0, "Hel", num_input_tokens=3, num_output_tokens=1)
            yield Delta(0, "lo", num_output_tokens=1)
            yield Delta(0, "!", finish_reason="stop", num_output_tokens=1)

    ctx = handlers.Context(client=Triton(), template=ChatTemplate(tmp_path), model_name="specguide")

    async def writes(call, req):
        return [w async for w in await call(ctx, req)]

    def events(write):
        return [json.loads(e[len("data: "):]) if e != "data: [DONE]" else e for e in write.split("\n\n") if e]

    got = [events(w) for w in asyncio.run(writes(chat_endpoint.chat, chat_req(
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})))]
    # vLLM's continuous_usage_stats: every chunk carries the counts so far
    assert [[e["usage"]["completion_tokens"] for e in w if e != "data: [DONE]"] for w in got] == [[1, 1], [2], [3, 3], [3]]
    got = [events(w) for w in asyncio.run(writes(chat_endpoint.chat, chat_req(stream=True, stream_options={"include_usage": True})))]
    assert all(e["usage"] is None for w in got[:3] for e in w)
    assert [[e["choices"][0]["delta"] for e in w] for w in got[:3]] == [
        [{"role": "assistant", "content": ""}, {"content": "Hel"}], [{"content": "lo"}], [{"content": "!"}, {}]]
    assert got[2][1]["choices"][0]["finish_reason"] == "stop"
    assert got[3][0]["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6} and got[3][1] == "data: [DONE]"
    assert len(got) == 4

    req = CompletionRequest.model_validate({"model": "specguide", "prompt": "Say", "stream": True, "echo": True})
    got = [events(w) for w in asyncio.run(writes(completions_endpoint.complete, req))]
    assert [[e["choices"][0]["text"] for e in w] for w in got[:3]] == [["Say", "Hel"], ["lo"], ["!", ""]]
    assert got[3] == ["data: [DONE]"] and len(got) == 4


def test_token_id_prompts_go_to_the_model_as_input_ids():
    from specguide.openai_api.completions_endpoint import _prompts

    assert _prompts("hi") == ["hi"] and _prompts(["a", "b"]) == ["a", "b"]
    assert _prompts(CompletionRequest(model="m", prompt=[1, 2, 3]).prompt) == [[1, 2, 3]]  # one prompt, as OpenAI's
    assert _prompts(CompletionRequest(model="m", prompt=[[1, 2], [3]]).prompt) == [[1, 2], [3]]
    for bad in ([], [[]], [""], [[1, -2]], [[2**31]]):
        with pytest.raises(ApiError) as e:
            _prompts(bad)
        assert e.value.status == 400 and e.value.param == "prompt"
    with pytest.raises(ValidationError):
        CompletionRequest(model="m", prompt=[1, "a"])
    t = request_params.build(CompletionRequest(model="m", prompt=[5, 6]), [5, 6], None, None, 16, None,
                             request_params.Limits())
    msg = build_request(t, "r1")
    names = [i.name for i in msg.inputs]
    assert "text_input" not in names
    tensor = msg.inputs[names.index("input_ids")]
    assert (tensor.datatype, list(tensor.shape)) == ("INT32", [1, 2])
    assert msg.raw_input_contents[names.index("input_ids")] == np.array([5, 6], np.int32).tobytes()


def test_an_event_stream_is_cancelled_when_its_client_goes_and_only_then():
    """EventStream sends each event as it comes; a disconnect mid-stream cancels the iteration where
    it waits (so the Triton call's reset runs) and the answer ends without an error; a disconnect
    that uvicorn reports after the last write changes nothing."""
    import asyncio

    from specguide.openai_api.event_stream import EventStream

    async def scenario(disconnect_after: Optional[int], n: int) -> tuple[list, list]:
        log: list = []
        sent: list = []
        gone = asyncio.Event()

        async def events():
            try:
                for i in range(n):
                    yield f"data: {i}\n\n"
                    await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                log.append("cancelled")
                raise
            finally:
                log.append("closed")

        async def receive():
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)
            if disconnect_after is None:  # uvicorn: once the answer is complete, receive() says disconnect
                if message.get("more_body") is False:
                    gone.set()
            elif len([m for m in sent if m.get("more_body")]) == disconnect_after:
                gone.set()

        await EventStream(events())({"type": "http"}, receive, send)
        # Python >= 3.11: the request's task is left as not being cancelled (uvicorn ends it normally)
        log.append(getattr(asyncio.current_task(), "cancelling", lambda: 0)())
        await asyncio.sleep(0.05)  # a late listener would act here
        return log, sent

    log, sent = asyncio.run(scenario(disconnect_after=2, n=50))
    assert log == ["cancelled", "closed", 0]
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in sent[0]["headers"]
    assert [m["body"] for m in sent[1:]] == [b"data: 0\n\n", b"data: 1\n\n"]  # nothing after the client left

    log, sent = asyncio.run(scenario(disconnect_after=None, n=3))
    assert log == ["closed", 0]
    assert [m["body"] for m in sent[1:]] == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n", b""]
    assert sent[-1]["more_body"] is False


def test_a_model_other_than_the_served_one_names_a_lora_adapter(tmp_path):
    """`model` naming an adapter reaches the engine as `lora_name` (the engine knows which it serves:
    a name it does not serve comes back as 404 model_not_found); /v1/models lists those config
    `lora_adapters` names, inline or in a file."""
    from specguide.openai_api.app import adapter_names

    t = request_params.build(chat_req(model="support"), "p", None, 4, 100, None, request_params.Limits(), "specguide")
    assert t.sampling["lora_name"] == "support"
    base = request_params.build(chat_req(), "p", None, 4, 100, None, request_params.Limits(), "specguide")
    assert "lora_name" not in base.sampling
    e = from_triton("INVALID_ARG", "LoRA adapter 'gpt-4o' is not loaded (adapters served: 'support')")
    assert (e.status, e.body()["error"]["code"], e.param) == (404, "model_not_found", "model")
    (tmp_path / "multi_lora.json").write_text('{"support": "/a", "legal": "/b"}')
    assert adapter_names(str(tmp_path / "multi_lora.json")) == ["support", "legal"]
    assert adapter_names('{"x": "/x"}') == ["x"]
    assert adapter_names("") == adapter_names(str(tmp_path / "missing.json")) == adapter_names("[1]") == []
