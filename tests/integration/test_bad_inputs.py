"""The bad-input matrix through the real server, over gRPC streaming, HTTP generate and HTTP
generate_stream: each bad request gets exactly one clear error (FINAL), nothing else is disturbed.

Codes: HTTP shows them as the status (INVALID_ARG = 400). gRPC stream errors carry only the
message in Triton 2.51 (`InferenceServerException.status()` is None), so there the message is
checked. Type errors in an HTTP JSON body are answered by Triton's own JSON parser (500, "Unable
to parse") before the model sees the request: recorded here as what the server does.
"""
from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import pytest

from client.common import GrpcStream, to_array

from .conftest import MODEL
from .helpers import raw_stream

GT, G = "guided_decoding_guide_type", "guided_decoding_guide"
OK_PROMPT = "Say something."


@dataclass
class Case:
    name: str
    values: dict[str, Any]  # JSON values; also the gRPC tensors unless `grpc` is given
    message: str  # part of the error message (gRPC and the model's HTTP errors)
    grpc: Optional[dict[str, np.ndarray]] = None  # raw tensors (dtypes, shapes, bytes)
    http_body: Optional[bytes] = None  # raw HTTP body
    http_status: int = 400
    http_message: Optional[str] = None  # when Triton's HTTP frontend words it differently
    extra: dict = field(default_factory=dict)


def S(v: bytes) -> np.ndarray:
    return np.array([[v]], dtype=np.object_)


CASES = [
    Case("unknown guide type", {GT: "xml", G: "<a/>"}, "guided_decoding_guide_type must be one of"),
    Case("schema not JSON", {GT: "json_schema", G: '{"type": "object", "properties": '}, "not valid JSON"),
    Case("schema of the wrong type", {GT: "json_schema", G: "[1, 2]"}, "json_schema must be a JSON object"),
    Case("schema with an unknown type", {GT: "json_schema", G: '{"type": "frobnicate"}'}, "invalid json_schema guide"),
    Case("invalid regex", {GT: "regex", G: "(ab"}, "invalid regex guide"),
    Case("invalid EBNF", {GT: "ebnf_grammar", G: 'root ::= "a" | '}, "invalid ebnf_grammar guide"),
    Case("EBNF without root", {GT: "ebnf_grammar", G: 'start ::= "a"'}, '"root"'),
    Case("guide type without guide", {GT: "regex"}, "guided_decoding_guide is required"),
    Case("guide without type", {G: "[0-9]+"}, "without guided_decoding_guide_type"),
    Case("max_tokens 0", {"max_tokens": 0}, "max_tokens must be a positive integer"),
    Case("max_tokens negative", {"max_tokens": -5}, "max_tokens must be a positive integer"),
    Case("max_tokens over the limit", {"max_tokens": 100000}, "exceeds the limit"),
    Case("empty prompt", {"text_input": ""}, "text_input is empty"),
    Case("prompt longer than the context", {"text_input": "hello " * 9000}, "max_seq_len"),  # 8,192 (the model's)
    Case("num_draft_tokens negative", {"num_draft_tokens": -1}, "num_draft_tokens"),
    Case("num_draft_tokens too large", {"num_draft_tokens": 99}, "num_draft_tokens"),
    Case("temperature negative", {"temperature": -0.5}, "temperature"),
    Case("top_p over 1", {"top_p": 1.5}, "top_p must be in (0, 1]"),
    Case("timeout_s negative", {"timeout_s": -1.0}, "timeout_s"),
    Case("sampling_parameters not JSON", {"sampling_parameters": "{oops"}, "not valid JSON"),
    Case("sampling_parameters not an object", {"sampling_parameters": "[1]"}, "must be a JSON object"),
    Case("wrong dtype", {"max_tokens": "many"}, "data-type is 'FP32', but model 'specguide' expects 'INT32'",
         grpc={"max_tokens": np.array([[4.0]], np.float32)}, http_status=500, http_message="Unable to parse"),
    Case("wrong shape", {"max_tokens": [4, 5]}, "unexpected shape for input 'max_tokens'",
         grpc={"max_tokens": np.array([[4, 5]], np.int32)}, http_message="batch size does not match"),
    Case("non-UTF-8 text_input", {}, "text_input is not valid UTF-8", grpc={"text_input": S(b"caf\xe9 \xff\xfe")},
         http_body=b'{"text_input": "caf\xe9 \xff\xfe", "max_tokens": 4}'),
]


def values_of(case: Case, stream: bool) -> dict[str, Any]:
    return {"text_input": OK_PROMPT, "max_tokens": 8, "stream": stream, **case.values}


def grpc_tensors(case: Case) -> dict[str, np.ndarray]:
    base = {k: v for k, v in values_of(case, True).items() if case.grpc is None or k not in case.grpc}
    tensors = {k: to_array(k, v) for k, v in base.items()}
    return {**tensors, **(case.grpc or {})}


def http_post(path: str, server, case: Case, stream: bool) -> tuple[int, str]:
    body = case.http_body or json.dumps(values_of(case, stream)).encode()
    try:
        with urllib.request.urlopen(f"http://{server.http}/v2/models/{MODEL}/{path}", data=body, timeout=120) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def error_of(body: str) -> str:
    body = body.strip()
    if body.startswith("data:"):
        body = body.split("\n")[0][len("data:"):]
    return json.loads(body)["error"]


def check(server, case: Case, protocol: str) -> None:
    if protocol == "grpc":
        got = raw_stream(server, grpc_tensors(case))
        assert len(got) == 1, "exactly one response"
        _, err, final = got[0]
        assert err is not None and final
        assert case.message in err.message(), err.message()
        assert "Traceback" not in err.message()
        return
    status, body = http_post("generate" if protocol == "http" else "generate_stream", server, case, protocol != "http")
    assert status == case.http_status, (status, body)
    message = error_of(body)
    assert (case.http_message or case.message) in message, message
    if protocol == "http-stream":
        assert body.count("data:") <= 1, "one event at most"


PROTOCOLS = ["grpc", "http", "http-stream"]


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_gets_one_clear_error(server, case, protocol):
    check(server, case, protocol)
    assert server.wait_metric("specguide_active_slots", 0.0) == 0.0
    assert server.wait_metric("specguide_queue_depth", 0.0) == 0.0


GOOD = {"text_input": "<|im_start|>user\nTell me about the sea.<|im_end|>\n<|im_start|>assistant\n",
        "max_tokens": 32, "stream": True, "exclude_input_in_output": True}


def stream_once(server) -> tuple[str, list[int], str]:
    s = GrpcStream(server.grpc)
    try:
        chunks = list(s.generate(GOOD, timeout=300))
    finally:
        s.close()
    assert all(c.error is None for c in chunks), chunks[-1].error
    assert chunks[-1].final and not any(c.final for c in chunks[:-1])
    return "".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids], chunks[-1].finish_reason


def test_the_whole_matrix_leaves_a_concurrent_stream_untouched(server):
    """Good greedy streams run back to back while every bad input is sent over every protocol:
    each equals the same request run alone, and nothing is left in a slot or the queue."""
    alone = stream_once(server)
    outputs: list = []
    done = threading.Event()

    def good_user():
        while not done.is_set() or not outputs:
            outputs.append(stream_once(server))

    t = threading.Thread(target=good_user)
    t.start()
    try:
        for protocol in PROTOCOLS:
            for case in CASES:
                check(server, case, protocol)
    finally:
        done.set()
        t.join(timeout=300)
    assert outputs and all(o == alone for o in outputs), (alone, outputs)
    assert server.wait_metric("specguide_active_slots", 0.0) == 0.0
    assert server.wait_metric("specguide_queue_depth", 0.0) == 0.0


UNFINISHABLE = json.dumps({"type": "array", "items": {"type": "string", "minLength": 20}, "minItems": 40})


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_grammar_that_cannot_finish_in_max_tokens_is_refused_or_ends_with_length(server, protocol):
    """By default a JSON answer must close within max_tokens (docs/guided.md "JSON (and regex) answers are complete
    within max_tokens"): a schema whose shortest document does not fit is refused up front, one
    clear INVALID_ARG naming both numbers. Opted out (structured_outputs.complete_within_budget
    false), it runs to max_tokens: "length"."""
    sp = {"max_tokens": 12, "structured_outputs": {"json": json.loads(UNFINISHABLE), "complete_within_budget": False}}
    refused = {"text_input": "List some words as JSON.", "max_tokens": 12, "exclude_input_in_output": True,
               GT: "json_schema", G: UNFINISHABLE}
    cut = {"text_input": "List some words as JSON.", "max_tokens": 12, "exclude_input_in_output": True,
           "sampling_parameters": json.dumps(sp)}
    want = "max_tokens 12 cannot hold a valid answer: the shortest one this guide accepts takes"
    if protocol == "grpc":
        s = GrpcStream(server.grpc)
        try:
            err = list(s.generate({**refused, "stream": True}, timeout=120))
            chunks = list(s.generate({**cut, "stream": True}, timeout=120))
        finally:
            s.close()
        assert err[-1].error and want in err[-1].error and err[-1].final, err[-1]
        assert chunks[-1].error is None and chunks[-1].final
        text, reason = "".join(c.text for c in chunks), chunks[-1].finish_reason
        n = sum(len(c.token_ids) for c in chunks)
    else:
        route, stream = ("generate" if protocol == "http" else "generate_stream"), protocol == "http-stream"
        status, body = http_post(route, server, Case("unfinishable", refused, ""), stream)
        assert want in (body if isinstance(body, str) else json.dumps(body)), (status, body)
        status, body = http_post(route, server, Case("unfinishable", cut, ""), stream)
        assert status == 200, body
        events = [json.loads(line[len("data:"):]) for line in body.split("\n\n") if line.startswith("data:")] \
            if stream else [json.loads(body)]
        text, reason = "".join(e["text_output"] for e in events), events[-1]["finish_reason"]
        n = sum(len(e["output_ids"]) if isinstance(e["output_ids"], list) else 1 for e in events)
    assert reason == "length" and n == 12
    assert text.startswith("["), text
