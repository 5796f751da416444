"""The OpenAI-compatible server (specguide.openai_api) when things go wrong, against the real
stack: bad requests are 400s naming the field, API keys, an unreachable or restarted Triton, no key
beyond loopback, too many prompts, a client gone mid-stream, a full queue (429).

One OpenAI server process in front of the session's tritonserver (the `api` and `client`
fixtures, conftest.py); a second one with an API key and a third pointed at a port where nothing
listens, for the errors.
"""
from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from .conftest import ROOT, _free_ports, launch, repository_with, stop_and_check
from .openai_helpers import ASK, MODEL, WEATHER, Api, chat

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
