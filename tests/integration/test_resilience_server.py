"""Overload, cancellation at every stage, time limits, injected faults, unload and an engine crash,
against a second real tritonserver: two slots, a queue of two, explicit model control and
SPECGUIDE_FAULT_INJECTION=1 (faults arrive as the request parameter `specguide_fault`).

The tests run in file order: the engine crash and the stuck engine come last (the engine comes back
by itself).

Codes: the engine's errors carry UNAVAILABLE / INTERNAL (checked in tests/unit/test_triton_responses.py
and test_triton_adapter.py), but Triton 2.51 shows none of them to clients: gRPC stream errors
carry only the message, and HTTP generate answers every error a Python model sends with 400. So
the messages are checked."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Optional

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from client.common import Chunk, _chunk_from_result, grpc_inputs
from specguide.engine import faults

from .conftest import MODEL, ROOT, Server, launch, repository_with, stop_and_check
from .test_conformance import _stream

SETTINGS = {"max_slots": "2", "max_queue": "2", "prefill_chunk": "16", "engine_stall_s": "5"}
PROMPT = "<|im_start|>user\nTell me a long story about the sea.<|im_end|>\n<|im_start|>assistant\n"
PHONE = "[0-9]{3}-[0-9]{4} and [0-9]{3}-[0-9]{4}"
GT, G = "guided_decoding_guide_type", "guided_decoding_guide"


@pytest.fixture(scope="module")
def aux(tmp_path_factory) -> Server:
    root = tmp_path_factory.mktemp("aux")
    repo = repository_with(root, SETTINGS)
    srv = launch(root / "server.log", repo, ("--model-control-mode=explicit", f"--load-model={MODEL}",
                                             "--load-model=specguide_vllm"),
                 env={faults.ENV: "1"})
    yield srv
    stop_and_check(srv, allow_tracebacks=True)  # the injected faults are logged with their tracebacks


class Live:
    """One request on its own gRPC stream, its responses collected in the background."""

    def __init__(self, server: Server, values: dict[str, Any], fault: Optional[str] = None):
        self.chunks: list[Chunk] = []
        self.first, self.done = threading.Event(), threading.Event()
        self.client = grpcclient.InferenceServerClient(server.grpc)
        self.client.start_stream(callback=self._on)
        self.client.async_stream_infer(MODEL, grpc_inputs({"stream": True, **values}), enable_empty_final_response=True,
                                       parameters={"specguide_fault": fault} if fault else None)

    def _on(self, result, error) -> None:
        c = Chunk(final=True, error=error.message()) if error is not None else _chunk_from_result(result, time.perf_counter())
        self.chunks.append(c)
        self.first.set()
        if c.final:
            self.done.set()

    def wait_first(self) -> "Live":
        assert self.first.wait(120), "no response"
        return self

    def result(self) -> tuple[str, list[int], Chunk]:
        assert self.done.wait(300), "no final response"
        self.close()
        return "".join(c.text for c in self.chunks), [t for c in self.chunks for t in c.token_ids], self.chunks[-1]

    def cancel(self) -> None:
        self.client.stop_stream(cancel_requests=True)
        self.client.close()

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def http(server: Server, path: str, body: Optional[dict] = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else b""
    url = f"http://{server.http}/v2/{path}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, method="POST"), timeout=300) as r:
            raw = r.read().decode()
            return r.status, json.loads(raw) if raw else {}
    except urllib.error.HTTPError as e:
        raw = e.read().decode().strip()
        if raw.startswith("data:"):
            raw = raw[len("data:"):]
        return e.code, json.loads(raw) if raw else {}


def generate(server: Server, fault: Optional[str] = None, **values) -> tuple[int, dict]:
    body = {"text_input": PROMPT, "max_tokens": 8, "exclude_input_in_output": True, **values}
    if fault:
        body["specguide_fault"] = fault  # an unmatched key becomes a request parameter
    return http(server, f"models/{MODEL}/generate", body)


def model_ready(server: Server) -> bool:
    try:
        with urllib.request.urlopen(f"http://{server.http}/v2/models/{MODEL}/ready", timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def settle(server: Server) -> None:
    assert server.wait_metric("specguide_active_slots", 0.0, timeout=15) == 0.0
    assert server.wait_metric("specguide_queue_depth", 0.0, timeout=15) == 0.0


def cancellations(server: Server) -> dict[str, float]:
    return {s: server.metric("specguide_cancellations_total", stage=s) for s in ("queued", "compiling", "prefill", "decode")}


def wait_counts(server: Server, expected: dict[str, float]) -> dict[str, float]:
    deadline = time.monotonic() + 15
    while (got := cancellations(server)) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return got


def alone(server: Server, values: dict) -> tuple[str, list[int]]:
    text, ids, last = Live(server, values).result()
    assert last.error is None, last.error
    return text, ids


# ------------------------------------------------------------------------------------- readiness


def unload(server: Server) -> None:
    assert http(server, f"repository/models/{MODEL}/unload")[0] == 200
    deadline = time.monotonic() + 60
    while model_ready(server):
        assert time.monotonic() < deadline, "still ready after unload"
        time.sleep(0.05)


def load_and_check_ready_after_warmup(server: Server) -> None:
    """Load the model; it must turn ready only after initialize() logged the finished warm-up."""
    before = _ready_lines(server)
    loader = threading.Thread(target=http, args=(server, f"repository/models/{MODEL}/load"))
    loader.start()
    deadline = time.monotonic() + 300
    while not model_ready(server):
        assert time.monotonic() < deadline, "not ready after load"
        time.sleep(0.02)
    loader.join(timeout=300)
    time.sleep(0.5)  # the backend's log lines arrive through the stub
    lines = _ready_lines(server)
    assert len(lines) == len(before) + 1 and "warmed up in" in lines[-1], lines[-1:]
    assert re.search(r"drafter (hybrid with the trained draft head|grammar|ngram|head with the trained draft head)",
                     lines[-1]), lines[-1]
    # NOTE: the engine's warm-up line is written by initialize() before it returns, and Triton marks
    # the model ready only after initialize() returns: this load's one new line is the proof (the
    # server's own stamp on it arrives through the stub a few ms late, so comparing clocks would
    # test the machine's load, not the order)
    assert server.wait_metric("specguide_engine_alive", 1.0, model=MODEL) == 1.0


def _ready_lines(server: Server) -> list[str]:
    return [ln for ln in server.log.read_text(errors="replace").splitlines() if "specguide: engine ready" in ln]


# -------------------------------------------------------------------------------------- overload


def test_a_full_queue_answers_unavailable_at_once(aux):
    before = cancellations(aux)
    # NOTE: long enough to be still decoding when cancelled below (a fast CPU wrote 400 tokens first)
    running = [Live(aux, {"text_input": PROMPT, "max_tokens": 1800}).wait_first() for _ in range(2)]
    queued = [Live(aux, {"text_input": PROMPT, "max_tokens": 4}) for _ in range(2)]
    assert aux.wait_metric("specguide_queue_depth", 2.0) == 2.0
    status, body = generate(aux)
    assert status == 400 and "queue is full" in body["error"], body  # UNAVAILABLE (shown as 400, see above)
    status, body = http(aux, f"models/{MODEL}/generate_stream", {"text_input": PROMPT, "stream": True})
    assert status == 400 and "queue is full" in body["error"], body
    _, _, last = Live(aux, {"text_input": PROMPT}).result()
    assert last.final and "queue is full" in last.error
    assert not any(r.done.is_set() for r in running + queued), "refused while the others still run"
    for r in queued:  # first, so that no slot frees up before they are cancelled
        r.cancel()
    expected = {**before, "queued": before["queued"] + 2}
    assert wait_counts(aux, expected) == expected
    for r in running:
        r.cancel()
    settle(aux)
    expected = {**expected, "decode": before["decode"] + 2}
    assert wait_counts(aux, expected) == expected
    assert generate(aux)[0] == 200


# ---------------------------------------------------------------------------------- cancellation


CLIENT = """
import sys
from client.common import GrpcStream
s = GrpcStream(sys.argv[1])
for c in s.generate({"text_input": sys.argv[2], "max_tokens": 2000, "stream": True}):  # decoding when killed
    print("chunk", flush=True)
"""


def test_cancel_while_compiling_in_prefill_and_when_the_client_goes_away(aux):
    before = cancellations(aux)
    compiling = Live(aux, {"text_input": PROMPT, GT: "regex", G: PHONE}, fault="compile_delay:60")
    prefill = Live(aux, {"text_input": "word " * 400}, fault="prefill_delay:0.3")
    time.sleep(1.0)
    assert aux.metric("specguide_active_slots") == 1.0  # the prefill holds a slot; the compile does not
    compiling.cancel()
    prefill.cancel()
    gone = subprocess.Popen([sys.executable, "-c", CLIENT, aux.grpc, PROMPT], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert gone.stdout.readline().strip() == "chunk"
    gone.kill()  # the client goes away mid-decode, without cancelling
    gone.wait()
    settle(aux)
    expected = {**before, "compiling": before["compiling"] + 1, "prefill": before["prefill"] + 1,
                "decode": before["decode"] + 1}
    assert wait_counts(aux, expected) == expected
    status, body = generate(aux, **{GT: "regex", G: PHONE, "max_tokens": 24})
    assert status == 200 and re.fullmatch(PHONE, body["text_output"]), body


# ------------------------------------------------------------------------------------ time limit


def test_time_limit_ends_with_timeout_and_the_text_so_far(aux):
    before = aux.metric("specguide_requests_total", finish_reason="timeout")
    # NOTE: 1000 tokens in 0.5 s would take 2000 tokens/s, several times any CPU here (a fast one
    # wrote the old limit, 400, in under 1 s: `length`, not `timeout`); the story runs longer
    text, ids, last = Live(aux, {"text_input": PROMPT, "max_tokens": 1000, "timeout_s": 0.5}).result()
    assert last.error is None and last.finish_reason == "timeout" and 0 < len(ids) < 1000 and text
    status, body = generate(aux, max_tokens=1000, timeout_s=0.5)
    assert status == 200 and body["finish_reason"] == "timeout" and body["text_output"]
    assert aux.wait_metric("specguide_requests_total", before + 2, finish_reason="timeout") == before + 2
    settle(aux)


# -------------------------------------------------------------------------------- injected faults


def test_a_fault_in_one_request_fails_only_that_request(aux):
    good = {"text_input": PROMPT, "max_tokens": 24}
    reference = alone(aux, good)
    g = Live(aux, good)
    nan = Live(aux, {"text_input": PROMPT, "max_tokens": 24}, fault="nan_logits")
    matcher = Live(aux, {"text_input": PROMPT, "max_tokens": 24, GT: "regex", G: PHONE}, fault="matcher_error")
    text, ids, last = g.result()
    assert (text, ids) == reference and last.finish_reason == "length"
    assert "non-finite logits" in nan.result()[2].error
    assert "injected matcher fault" in matcher.result()[2].error
    status, body = generate(aux, fault="nan_logits")
    assert status == 400 and "non-finite logits" in body["error"], body  # INTERNAL (shown as 400)
    # through the vLLM proxy, after responses went out (Triton 2.51 loses such a BLS error response:
    # it travels as the output specguide_error)
    got = _stream(aux, "specguide_vllm", {"text_input": np.array([PROMPT.encode()], np.object_),
                                          "stream": np.array([True]),
                                          "sampling_parameters": np.array([b'{"max_tokens": 24}'], np.object_)},
                  parameters={"specguide_fault": "nan_logits"})
    assert got[0][0] is not None and got[-1][1] is not None, got  # a token, then the error
    assert got[-1][1].message() == "Error generating stream: the model produced non-finite logits (NaN/inf) for this request"
    settle(aux)
    assert aux.metric("specguide_engine_alive", model=MODEL) == 1.0
    assert alone(aux, good) == reference


# ------------------------------------------------------------------------------------- lifecycle


def test_unload_drains_in_flight_requests_and_the_reload_is_ready_after_warmup(aux):
    values = {"text_input": PROMPT, "max_tokens": 40}
    reference = alone(aux, values)
    streams = [Live(aux, values).wait_first() for _ in range(2)]
    unload(aux)
    for s in streams:
        text, ids, last = s.result()
        assert last.error is None and last.finish_reason == "length" and (text, ids) == reference
    assert generate(aux)[0] != 200
    load_and_check_ready_after_warmup(aux)
    assert generate(aux)[0] == 200


def test_an_engine_loop_crash_fails_in_flight_and_new_requests_with_unavailable_then_restarts(aux):
    """The engine loop thread dies (an exception it does not handle): its process ends and a new one starts."""
    values = {"text_input": PROMPT, "max_tokens": 12}
    reference = alone(aux, values)
    restarts = aux.metric("specguide_engine_restarts_total", model=MODEL)
    running = Live(aux, {"text_input": PROMPT, "max_tokens": 400}).wait_first()
    crash = Live(aux, {"text_input": PROMPT, "max_tokens": 4}, fault="crash_engine")
    for live in (running, crash):
        last = live.result()[2]
        assert last.final and "engine stopped" in last.error, last
    status, body = generate(aux)
    assert status == 400 and "a new engine is starting" in body["error"], body  # UNAVAILABLE at once, no hang
    assert aux.wait_metric("specguide_engine_alive", 0.0, model=MODEL) == 0.0
    # nobody reloads the model: the engine comes back by itself, answering as before
    assert aux.wait_metric("specguide_engine_restarts_total", restarts + 1, timeout=120, model=MODEL) == restarts + 1
    assert aux.wait_metric("specguide_engine_alive", 1.0, model=MODEL) == 1.0
    assert alone(aux, values) == reference
    assert generate(aux)[0] == 200


def test_a_stuck_engine_is_restarted_by_the_watchdog_and_its_clients_told(aux):
    """The engine loop blocks (an injected 10-minute sleep as it takes a request): past
    engine_stall_s (5 s here) the stub kills the engine process; every request it held ends with
    the cause, the restart is counted, and the new engine answers as the old one did."""
    values = {"text_input": PROMPT, "max_tokens": 12}
    reference = alone(aux, values)
    restarts = aux.metric("specguide_engine_restarts_total", model=MODEL)
    running = Live(aux, {"text_input": PROMPT, "max_tokens": 400}).wait_first()
    stuck = Live(aux, {"text_input": PROMPT, "max_tokens": 4}, fault="stall_engine:600")
    for live in (running, stuck):
        last = live.result()[2]
        assert last.final and "the engine was stuck" in last.error and "engine_stall_s 5" in last.error, last
    assert aux.wait_metric("specguide_engine_restarts_total", restarts + 1, timeout=120, model=MODEL) == restarts + 1
    assert aux.wait_metric("specguide_engine_alive", 1.0, model=MODEL) == 1.0
    assert alone(aux, values) == reference
    assert "the engine was stuck" in aux.log.read_text(errors="replace")
