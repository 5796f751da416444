"""The OpenAI server's limits (issue 75): counts capped before any work, large bodies handled off the
event loop, Triton request ids no one can guess, no key-less listening beyond loopback, and no
internal address in what a client is told. The app is driven as ASGI with a Triton client stand-in."""
from __future__ import annotations

import asyncio
import json
import re
import socket
from typing import Any, Optional

import pytest

from specguide.openai_api import app as app_module
from specguide.openai_api import request_params
from specguide.openai_api.app import INLINE_BODY_BYTES, Settings, create_app
from specguide.openai_api.caps import Caps
from specguide.openai_api.cli import caps_of, is_loopback, parse_args
from specguide.openai_api.triton_client import Delta, TritonClient, TritonRequest, new_request_id

MODEL = "specguide"


class FakeTriton:
    """Counts the Triton requests the server would send; each answers one token."""

    def __init__(self, ready: bool = True):
        self.sent: list[TritonRequest] = []
        self._ready = ready

    async def generate(self, treq: TritonRequest):
        self.sent.append(treq)
        for i in range(treq.n):
            yield Delta(i, "x", finish_reason="length", num_input_tokens=1, num_output_tokens=1)

    async def ready(self) -> bool:
        return self._ready

    async def close(self) -> None:
        pass


def call(app: Any, method: str, path: str, body: Optional[dict] = None, raw: bytes = b"") -> tuple[int, Any]:
    """One HTTP request through the ASGI app (`body` as JSON, or `raw` bytes): (status, JSON body)."""
    raw = json.dumps(body).encode() if body is not None else raw
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
             "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 9000)}
    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    data = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(data)


def server(caps: Caps = Caps(), ready: bool = True) -> tuple[Any, FakeTriton]:
    triton = FakeTriton(ready)
    return create_app(Settings(triton_url="10.11.12.13:8001", triton_model="internal-model", caps=caps), triton), triton


# ------------------------------------------------------------------------------ counts


def test_twenty_thousand_prompts_are_refused_before_any_triton_request():
    """The attack: 20,000 one-character prompts would be 20,000 gRPC streams."""
    app, triton = server()
    status, got = call(app, "POST", "/v1/completions", {"model": MODEL, "prompt": ["a"] * 20000, "max_tokens": 1})
    assert status == 400, got
    err = got["error"]
    assert err["param"] == "prompt" and err["code"] == "too_many"
    assert "20000" in err["message"] and "64" in err["message"] and "--max-choices-per-request" in err["message"]
    assert triton.sent == []


def test_prompts_times_n_are_capped_and_the_cap_itself_is_served():
    app, triton = server()
    status, got = call(app, "POST", "/v1/completions", {"model": MODEL, "prompt": ["a"] * 5, "n": 16, "max_tokens": 1})
    assert status == 400 and "80 choices" in got["error"]["message"] and triton.sent == []
    # token-id prompts count the same way (a list of ints is one prompt)
    status, got = call(app, "POST", "/v1/completions", {"model": MODEL, "prompt": [[1]] * 65, "max_tokens": 1})
    assert status == 400 and got["error"]["param"] == "prompt" and triton.sent == []
    status, got = call(app, "POST", "/v1/completions", {"model": MODEL, "prompt": [1] * 500, "n": 2, "max_tokens": 1})
    assert status == 200 and len(triton.sent) == 1
    triton.sent.clear()
    status, got = call(app, "POST", "/v1/completions", {"model": MODEL, "prompt": ["a"] * 4, "n": 16, "max_tokens": 1})
    assert status == 200, got
    assert len(got["choices"]) == 64 and len(triton.sent) == 4
    triton.sent.clear()
    app, triton = server(Caps(max_choices=3))
    status, got = call(app, "POST", "/v1/chat/completions", {"model": MODEL, "n": 4, "messages": [
        {"role": "user", "content": "hi"}]})
    assert status == 400 and got["error"]["param"] == "n" and "limit is 3" in got["error"]["message"]
    status, got = call(app, "POST", "/v1/completions", {"model": MODEL, "prompt": "a", "n": 4, "max_tokens": 1})
    assert status == 400 and got["error"]["param"] == "n" and triton.sent == []


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("field, value, flag", [
    ("stop", ["s"] * 65, "--max-stop-strings"),
    ("stop_token_ids", [1] * 257, "--max-stop-token-ids"),
    ("bad_words", ["w"] * 257, "--max-bad-words"),
    ("tools", [TOOL] * 129, "--max-tools"),
    ("logit_bias", {str(i): 1 for i in range(301)}, None),
])
def test_counts_past_their_caps_are_400_naming_the_field_and_the_option(field, value, flag):
    app, triton = server()
    # chat without a template: the count is checked first, before anything else reads the request
    status, got = call(app, "POST", "/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": "hi"}], field: value})
    assert status == 400, got
    assert got["error"]["param"] == field and got["error"]["code"] == "too_many", got
    assert str(len(value)) in got["error"]["message"] and (flag is None or flag in got["error"]["message"])
    assert triton.sent == []


def test_counts_at_their_caps_pass_the_check():
    from specguide.openai_api import caps
    from specguide.openai_api.schemas import ChatCompletionRequest

    req = ChatCompletionRequest.model_validate({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                "stop": ["s"] * 64, "stop_token_ids": [1] * 256,
                                                "bad_words": ["w"] * 256, "tools": [TOOL] * 128, "n": 16,
                                                "logit_bias": {str(i): 1 for i in range(300)}})
    caps.check(req, Caps())  # no error
    with pytest.raises(Exception) as e:
        caps.check(req, Caps(max_stop=63))
    assert "--max-stop-strings" in str(e.value)


def test_cap_options_reach_the_server():
    c = caps_of(parse_args(["--max-choices-per-request", "8", "--max-stop-strings", "4", "--max-tools", "2",
                            "--max-stop-token-ids", "3", "--max-bad-words", "5"]))
    assert c == Caps(max_choices=8, max_stop=4, max_stop_token_ids=3, max_bad_words=5, max_tools=2)
    assert caps_of(parse_args([])) == Caps()
    with pytest.raises(SystemExit):
        parse_args(["--max-choices-per-request", "0"])


# ------------------------------------------------------------------------------ off the event loop


def _on_loop() -> bool:
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False


def test_a_large_body_is_parsed_and_prepared_off_the_event_loop(monkeypatch):
    """The depth scan, json.loads, validation and the Triton requests' building of a body past
    INLINE_BODY_BYTES run in a worker thread; a small body's stay in the loop (no thread hop)."""
    seen: dict[str, list[bool]] = {"depth": [], "build": []}
    depth, build = app_module.json_depth, request_params.build

    def recording_depth(text: str) -> int:
        seen["depth"].append(_on_loop())
        return depth(text)

    def recording_build(*a, **kw):
        seen["build"].append(_on_loop())
        return build(*a, **kw)

    monkeypatch.setattr(app_module, "json_depth", recording_depth)
    monkeypatch.setattr(request_params, "build", recording_build)
    app, triton = server()
    big = {"model": MODEL, "prompt": "a" * (INLINE_BODY_BYTES + 1), "max_tokens": 1}
    status, got = call(app, "POST", "/v1/completions", big)
    assert status == 200, got
    assert seen == {"depth": [False], "build": [False]}
    status, _ = call(app, "POST", "/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 1})
    assert status == 200 and seen == {"depth": [False, True], "build": [False, True]}
    # a refusal from the worker thread is the same OpenAI error
    status, got = call(app, "POST", "/v1/completions", {**big, "temperature": 9})
    assert status == 400 and got["error"]["param"] == "temperature"


def test_a_body_of_escaped_quotes_is_refused_at_once():
    """The issue's hostile text (an unterminated string of escaped quotes), 4 x its 48 KB, as a body:
    a scan that restarts at each quote is quadratic in it (7 s at 48 KB); the app's is one pass and
    answers that the body is not JSON. A deep body is still refused before parsing."""
    app, triton = server()
    raw = ('{"model": "specguide", "prompt": "' + '\\"' * (24000 * 4)).encode()
    status, got = call(app, "POST", "/v1/completions", raw=raw)
    assert status == 400 and "not valid JSON" in got["error"]["message"] and triton.sent == []
    deep = {"model": MODEL, "prompt": "a", "metadata": json.loads("[" * 100 + "]" * 100)}
    status, got = call(app, "POST", "/v1/completions", deep)
    assert status == 400 and "nests deeper than 80" in got["error"]["message"]


# ------------------------------------------------------------------------------ request ids


def test_triton_request_ids_are_unguessable():
    ids = [new_request_id() for _ in range(256)]
    assert all(re.fullmatch(r"oai-[0-9a-f]{32}", i) for i in ids), ids[:3]
    assert len(set(ids)) == len(ids)
    values = [int(i[4:], 16) for i in ids]
    assert all(abs(a - b) > 2**64 for a, b in zip(values, values[1:]))  # not counted up from each other
    for bit in range(128):  # every one of the 128 bits varies: random, not a counter or a clock
        assert len({(v >> bit) & 1 for v in values}) == 2, bit


def test_the_triton_client_sends_those_ids():
    from tritonclient.grpc import service_pb2

    sent: list[str] = []

    class Call:
        async def send_message(self, msg, end=False):
            sent.append(msg.id)

        def __aiter__(self):
            return self._responses()

        async def _responses(self):
            r = service_pb2.ModelStreamInferResponse()
            r.infer_response.parameters["triton_final_response"].bool_param = True
            yield r

        async def recv_trailing_metadata(self):
            return None

    class Request:
        async def __aenter__(self):
            return Call()

        async def __aexit__(self, *exc):
            return False

    class Channel:
        def request(self, *a, **kw):
            return Request()

        def close(self):
            pass

    async def two():
        client = TritonClient("127.0.0.1:1")
        client._channel.close()
        client._channel = Channel()
        for _ in range(2):
            assert [d async for d in client.generate(TritonRequest("hi", {"max_tokens": 1}))] == []

    asyncio.run(two())
    assert len(sent) == 2 and sent[0] != sent[1]
    assert all(re.fullmatch(r"oai-[0-9a-f]{32}", i) for i in sent), sent


# ------------------------------------------------------------------------------ no internal address


def test_health_reveals_no_internal_address():
    app, _ = server(ready=False)
    status, got = call(app, "GET", "/health")
    assert status == 503 and got["error"]["type"] == "service_unavailable_error"
    text = json.dumps(got)
    assert "10.11.12.13" not in text and "8001" not in text and "internal-model" not in text
    app, _ = server(ready=True)
    assert call(app, "GET", "/health") == (200, {"status": "ok"})


def test_an_unreachable_triton_is_503_without_its_address():
    with socket.socket() as s:  # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def ask():
        client = TritonClient(f"127.0.0.1:{port}")
        try:
            async for _ in client.generate(TritonRequest("hi", {"max_tokens": 1})):
                pass
        finally:
            await client.close()

    with pytest.raises(app_module.ApiError) as e:
        asyncio.run(ask())
    assert e.value.status == 503 and "not reachable" in e.value.message
    assert "127.0.0.1" not in e.value.message and str(port) not in e.value.message


# ------------------------------------------------------------------------------ secure by default


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.5", "[::]", "api.example.com"])
def test_no_key_beyond_loopback_is_refused_unless_allowed(host, monkeypatch, capsys):
    monkeypatch.delenv("SPECGUIDE_API_KEY", raising=False)
    with pytest.raises(SystemExit) as e:
        parse_args(["--host", host])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"refusing to listen on {host} without an API key" in err
    assert "SPECGUIDE_API_KEY" in err and "--api-key" in err and "--allow-no-key" in err
    assert parse_args(["--host", host, "--allow-no-key"]).api_key is None
    assert parse_args(["--host", host, "--api-key", "k"]).api_key == "k"
    monkeypatch.setenv("SPECGUIDE_API_KEY", "from-env")
    assert parse_args(["--host", host]).api_key == "from-env"
    monkeypatch.setenv("SPECGUIDE_API_KEY", "")  # an empty key is no key
    with pytest.raises(SystemExit):
        parse_args(["--host", host])


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
def test_loopback_needs_no_key(host, monkeypatch):
    monkeypatch.delenv("SPECGUIDE_API_KEY", raising=False)
    assert is_loopback(host)
    assert parse_args(["--host", host]).api_key is None
    assert parse_args([]).host == "127.0.0.1"  # the default


def test_max_tokens_limit_follows_the_models_context_when_max_seq_len_is_0(tmp_path):
    """max_seq_len 0 (the served default) is the model's whole context, as the engine resolves it:
    not the 2,048 the server assumed before; a setting wins, and 2,048 stays where nothing says."""
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
    assert app_module.max_tokens_limit({"max_seq_len": "0", "max_tokens_limit": "0"}, tmp_path) == 8192
    assert app_module.max_tokens_limit({"max_seq_len": "4096"}, tmp_path) == 4096
    assert app_module.max_tokens_limit({"max_seq_len": "0", "max_tokens_limit": "1000"}, tmp_path) == 1000
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 32768}}))
    assert app_module.max_tokens_limit({}, tmp_path) == 32768  # a multimodal checkpoint's text model
    assert app_module.max_tokens_limit({}, tmp_path / "absent") == 2048
