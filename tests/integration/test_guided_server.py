"""Guided decoding through the real tritonserver: TensorRT-LLM guide tensors, vLLM `sampling_parameters`,
bad guides (one clean error, the server keeps serving) and guided next to unguided requests.

All greedy with small max_tokens; the prompts ask for what the guide allows, so each guided
request ends by the grammar (finish_reason "stop") well before max_tokens.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import jsonschema
import pytest

from client.common import GrpcStream, chat_prompt, http_generate, http_generate_stream, load_tokenizer

from .conftest import MODEL, ROOT
from .helpers import B, I, S, raw_stream

SCHEMA_FILE = ROOT / "client" / "examples" / "person.schema.json"  # the README's example
SCHEMA = json.loads(SCHEMA_FILE.read_text())
PERSON = "Describe a person as a JSON object with the fields name, age and city."
JSON_MAX_TOKENS = 128
GT, G = "guided_decoding_guide_type", "guided_decoding_guide"
PHONE = "[0-9]{3}-[0-9]{4}"
CAPITAL_EBNF = '''root ::= city " is the capital of " country
city ::= "London" | "Paris" | "Berlin" | "Rome"
country ::= "England" | "France" | "Germany" | "Italy"'''


@pytest.fixture(scope="module")
def chat(server):
    tok = load_tokenizer()  # the default model's tokenizer (converted by the server fixture's setup)
    return lambda user: chat_prompt(tok, user)


def json_values(chat, **extra) -> dict:
    return {"text_input": chat(PERSON), "max_tokens": JSON_MAX_TOKENS, "exclude_input_in_output": True,
            "guided_decoding_guide_type": "json_schema", "guided_decoding_guide": json.dumps(SCHEMA), **extra}


def grpc_generate(server, values: dict) -> list:
    s = GrpcStream(server.grpc)
    try:
        return list(s.generate(values, timeout=300))
    finally:
        s.close()


def check_stream(chunks) -> tuple[str, list[int]]:
    """A well-formed stream: no error, FINAL on the last response only, finish_reason only there."""
    assert all(c.error is None for c in chunks), chunks[-1].error
    assert chunks[-1].final and not any(c.final for c in chunks[:-1])
    assert all(c.finish_reason == "" for c in chunks[:-1])
    return "".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids]


def valid_person(text: str) -> dict:
    obj = json.loads(text)
    jsonschema.validate(obj, SCHEMA)
    return obj


# ----------------------------------------------------------------------------- (a) json_schema


def test_json_schema_over_grpc_streaming_parses_and_validates(server, chat):
    chunks = grpc_generate(server, json_values(chat, stream=True))
    text, ids = check_stream(chunks)
    assert len(chunks) > 1, "streamed in more than one response"
    assert chunks[-1].finish_reason == "stop", f"ended by the grammar, not max_tokens: {text!r}"
    assert 0 < len(ids) < JSON_MAX_TOKENS
    valid_person(text)


def test_json_schema_over_http_generate_parses_validates_and_equals_grpc(server, chat):
    c = http_generate(json_values(chat), server.http)
    assert c.error is None and c.final and c.finish_reason == "stop", c
    valid_person(c.text)
    grpc_text, grpc_ids = check_stream(grpc_generate(server, json_values(chat, stream=True)))
    assert (c.text, c.token_ids) == (grpc_text, grpc_ids)  # greedy: the same output on both protocols


def test_ebnf_grammar_tensor_output_is_in_the_language(server, chat):
    c = http_generate({"text_input": chat("Name a European capital city and its country."), "max_tokens": 24,
                       "exclude_input_in_output": True, "guided_decoding_guide_type": "ebnf_grammar",
                       "guided_decoding_guide": CAPITAL_EBNF}, server.http)
    assert c.error is None and c.finish_reason == "stop", c
    assert re.fullmatch(r"(London|Paris|Berlin|Rome) is the capital of (England|France|Germany|Italy)", c.text), c.text


def test_cli_guide_file_example_from_the_readme(server):
    r = subprocess.run([sys.executable, "-m", "client.cli", "--chat", PERSON, "--url", server.grpc,
                        "--guide-type", "json_schema", "--guide-file", str(SCHEMA_FILE),
                        "--max-tokens", str(JSON_MAX_TOKENS), "--stats"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    valid_person(r.stdout)
    assert "finish_reason=stop" in r.stderr


# ----------------------------------------------------------------------------- (b) vLLM sampling_parameters


def test_vllm_structured_outputs_choice(server, chat):
    sp = {"max_tokens": 8, "temperature": 0, "structured_outputs": {"choice": ["yes", "no"]}}
    chunks = grpc_generate(server, {"text_input": chat("Is water wet? Answer yes or no."),
                                    "sampling_parameters": json.dumps(sp), "stream": True})
    text, _ = check_stream(chunks)
    assert text in ("yes", "no") and chunks[-1].finish_reason == "stop", text


def test_vllm_guided_decoding_regex(server, chat):
    sp = {"max_tokens": 16, "temperature": 0, "guided_decoding": {"regex": PHONE}}
    chunks = list(http_generate_stream({"text_input": chat("Give me a phone number in the form 555-0123."),
                                        "sampling_parameters": json.dumps(sp), "stream": True}, server.http))
    text, _ = check_stream(chunks)
    assert re.fullmatch(PHONE, text) and chunks[-1].finish_reason == "stop", text


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_vllm_json_schema_with_a_backend_over_http_and_grpc(server, chat, backend):
    """`structured_outputs.backend` picks the grammar backend; both transports give the same
    schema-valid object, ended by the grammar; an unknown backend is refused, naming it."""
    sp = {"max_tokens": JSON_MAX_TOKENS, "temperature": 0, "structured_outputs": {"json": SCHEMA, "backend": backend}}
    values = {"text_input": chat(PERSON), "exclude_input_in_output": True, "sampling_parameters": json.dumps(sp)}
    one = http_generate(values, server.http)
    assert one.error is None and one.finish_reason == "stop", (one.error, one.text)
    jsonschema.validate(json.loads(one.text), SCHEMA)
    text, _ = check_stream(grpc_generate(server, {**values, "stream": True}))
    assert text == one.text
    bad = dict(sp, structured_outputs={"json": SCHEMA, "backend": "outlines"})
    err = http_generate({**values, "sampling_parameters": json.dumps(bad)}, server.http)
    assert err.error and "unknown guided backend 'outlines'" in err.error


def test_guide_notes_name_the_keywords_left_to_the_value_check_over_grpc_and_http(server, chat):
    """A schema with `uniqueItems` compiles (checked when the array closes); the last response says so
    in `guide_notes`, on gRPC and on HTTP /generate; the output is valid, uniqueItems included."""
    props = dict(SCHEMA["properties"], tags={"type": "array", "items": {"type": "string"}, "uniqueItems": True})
    schema = dict(SCHEMA, properties=props)
    got = raw_stream(server, {"text_input": S(chat(PERSON)), "max_tokens": I(JSON_MAX_TOKENS), "stream": B(True),
                              "exclude_input_in_output": B(True), GT: S("json_schema"), G: S(json.dumps(schema))})
    assert all(err is None for _, err, _ in got), got[-1][1]
    note = "checked when its value closes: uniqueItems at /properties/tags"
    last = got[-1][0]
    assert [n.decode() for n in last.as_numpy("guide_notes")] == [note]
    assert all(r.as_numpy("guide_notes") is None for r, _, _ in got[:-1])
    text = "".join(r.as_numpy("text_output")[0].decode() for r, _, _ in got)
    jsonschema.validate(json.loads(text), schema)
    body = json.dumps({"text_input": chat(PERSON), "max_tokens": JSON_MAX_TOKENS, "exclude_input_in_output": True,
                       GT: "json_schema", G: json.dumps(schema)}).encode()
    req = urllib.request.Request(f"http://{server.http}/v2/models/{MODEL}/generate", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        out = json.loads(r.read())
    assert out["guide_notes"] in ([note], note) and out["text_output"] == text


def test_served_defaults_close_a_json_answer_within_max_tokens_and_forbid_undeclared_keys(server, chat):
    """Issue 33, as served: a schema silent on additionalProperties gets only its declared keys, and
    an answer longer than max_tokens still ends valid with finish_reason "stop" (guide_notes says the
    budget closed it) over HTTP /generate and gRPC streaming alike; opting out (vLLM
    structured_outputs.complete_within_budget false) gives the cut-off answer, "length"."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "story": {"type": "string"},
                                               "age": {"type": "integer"}}, "required": ["name", "story", "age"]}
    ask = chat("Describe a person as JSON with the fields name, a long story of their life, and age.")
    values = {"text_input": ask, "max_tokens": 24, "exclude_input_in_output": True, GT: "json_schema",
              G: json.dumps(schema)}
    body = json.dumps(values).encode()
    req = urllib.request.Request(f"http://{server.http}/v2/models/{MODEL}/generate", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        out = json.loads(r.read())
    assert out["finish_reason"] in ("stop", ["stop"]), out
    doc = json.loads(out["text_output"])
    jsonschema.validate(doc, dict(schema, additionalProperties=False))  # declared keys only
    notes = out["guide_notes"] if isinstance(out["guide_notes"], list) else [out["guide_notes"]]
    assert any(n.startswith("closed by the budget: max_tokens 24") for n in notes), notes
    text, _ = check_stream(grpc_generate(server, dict(values, stream=True)))
    assert text == out["text_output"]
    sp = {"max_tokens": 24, "temperature": 0,
          "structured_outputs": {"json": schema, "complete_within_budget": False}}
    cut = http_generate({"text_input": ask, "exclude_input_in_output": True, "sampling_parameters": json.dumps(sp)},
                        server.http)
    assert cut.error is None and cut.finish_reason == "length"
    with pytest.raises(ValueError):
        json.loads(cut.text)


# ----------------------------------------------------------------------------- (c) bad guides

BAD_GUIDES = [
    # refused when the request is mapped (io / guided.params)
    ({GT: S("xml"), G: S("<a/>")}, "guided_decoding_guide_type must be one of", "rejected"),
    ({GT: S("json_schema"), G: S('{"type": "object", "properties": ')}, "json_schema guide is not valid JSON", "rejected"),
    ({GT: S("regex")}, "guided_decoding_guide is required", "rejected"),
    ({"sampling_parameters": S(json.dumps({"structured_outputs": {"regexp": "[0-9]+"}}))}, "unknown key(s)", "rejected"),
    # found by the grammar compiler after submit (an INVALID_ARG error event)
    ({GT: S("regex"), G: S("(ab")}, "invalid regex guide", "error"),
    ({GT: S("ebnf_grammar"), G: S('start ::= "a" | "b"')}, '"root"', "error"),
    ({GT: S("json_schema"), G: S('{"type": "object", "properties": {"a": {"type": "frobnicate"}}}')},
     "invalid json_schema guide", "error"),
    ({"sampling_parameters": S(json.dumps({"guided_decoding": {"regex": "[0-9"}}))}, "invalid regex guide", "error"),
]


@pytest.mark.parametrize("inputs,message,counted_as", BAD_GUIDES, ids=[m for _, m, _ in BAD_GUIDES])
def test_bad_guide_gets_one_clean_error_and_the_server_keeps_serving(server, inputs, message, counted_as):
    # gRPC stream errors carry only the message; the code shows on HTTP (below) and in the unit tests
    before = server.metric("specguide_requests_total", finish_reason=counted_as)
    got = raw_stream(server, {"text_input": S("Say something."), "max_tokens": I(8), "stream": B(True), **inputs})
    assert len(got) == 1, "exactly one response"
    _, err, final = got[0]
    assert err is not None and final
    assert message in err.message(), err.message()
    assert "Traceback" not in err.message()
    assert server.wait_metric("specguide_requests_total", before + 1, finish_reason=counted_as) == before + 1
    assert server.wait_metric("specguide_active_slots", 0.0) == 0.0
    assert server.wait_metric("specguide_queue_depth", 0.0) == 0.0
    # the server still serves guided requests
    c = http_generate({"text_input": "Pick one:", "max_tokens": 4, "exclude_input_in_output": True,
                       "guided_decoding_guide_type": "choice", "guided_decoding_guide": '["a", "b"]'}, server.http)
    assert c.error is None and c.text in ("a", "b") and c.finish_reason == "stop", c


@pytest.mark.parametrize("guide_type,guide,message", [
    ("regex", "(ab", "invalid regex guide"),  # found by the compiler after submit
    ("json_schema", "{oops", "not valid JSON"),  # found while mapping the request
])
def test_bad_guide_over_http_generate_is_400(server, guide_type, guide, message):
    body = json.dumps({"text_input": "hi", "max_tokens": 4, GT: guide_type, G: guide}).encode()
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"http://{server.http}/v2/models/{MODEL}/generate", data=body, timeout=60)
    assert e.value.code == 400  # (Triton 2.51 answers every Python-model error with 400; see docs/operations.md)
    assert message in json.loads(e.value.read())["error"]


# ----------------------------------------------------------------------------- (d) guided next to unguided


PEOPLE = ["Alice, 30, from Paris", "Bob, 41, from Rome"]


def test_guided_and_unguided_requests_run_together(server, chat):
    """Two guided (json_schema) and two unguided streams at once: each equals its output alone."""
    requests = {}
    for i, who in enumerate(PEOPLE):
        requests[f"guided{i}"] = {**json_values(chat, stream=True), "text_input": chat(f"Describe {who} as JSON.")}
        # NOTE: long enough to still run when the last of the four streams starts (24 tokens took ~0.1 s)
        requests[f"unguided{i}"] = {"text_input": chat(f"Tell me about {who}."), "max_tokens": 64 + i, "stream": True}
    alone = {name: check_stream(grpc_generate(server, v)) for name, v in requests.items()}
    results: dict[str, list] = {}

    def user(name, values):
        results[name] = grpc_generate(server, values)

    threads = [threading.Thread(target=user, args=item) for item in requests.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert set(results) == set(requests)
    firsts, lasts = [c[0].t for c in results.values()], [c[-1].t for c in results.values()]
    assert max(firsts) < min(lasts), "the requests overlapped in time"
    together = {name: check_stream(chunks) for name, chunks in results.items()}
    for name in requests:
        assert together[name] == alone[name], name  # greedy: each output is untouched by the others
    for name in ("guided0", "guided1"):
        assert results[name][-1].finish_reason == "stop", together[name][0]
        valid_person(together[name][0])
    assert server.wait_metric("specguide_active_slots", 0.0) == 0.0
