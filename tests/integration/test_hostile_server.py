"""Issue 19: one hostile request must not slow anyone else. Against a second real tritonserver with
small limits (compile timeout 2 s, no schema property limit, so compile bombs reach the compiler):

- compile bombs time out and free their workers; a trivial regex guide from another client gets
  its first token before the bombs are even refused, and a running stream keeps flowing;
- a 5 MB prompt (gRPC; 3 MB over HTTP) is refused by bytes at once, without stalling a running stream;
- bad values get messages that name the field and the rule; tiny temperature is greedy;
- the server serves on after the hostile run (the stub's memory across it: bench/bench_hostile.py).
"""
from __future__ import annotations

import json
import queue
import threading
import time
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from client.common import _chunk_from_result, grpc_inputs

from .conftest import MODEL, Server, launch, repository_with, stop_and_check
from .helpers import B, I, S, raw_stream, tensor_inputs
from .test_resilience_server import PROMPT, http

SETTINGS = {"max_slots": "4", "guided_compile_timeout_s": "2", "guided_max_schema_properties": "0",
            "new_request_slots": "1"}
REGEX = "[0-9]{3}-[0-9]{4}"
GT, G = "guided_decoding_guide_type", "guided_decoding_guide"
N_BACKGROUND = 1200  # tokens of the stream that runs while big prompts are refused
N_VICTIM = 4000  # the most tokens of the stream that runs beside out-of-vocabulary ids (cancelled once they are refused)


@pytest.fixture(scope="module")
def hostile(tmp_path_factory) -> Server:
    root = tmp_path_factory.mktemp("hostile")
    repo = repository_with(root, SETTINGS)
    srv = launch(root / "server.log", repo)
    yield srv
    stop_and_check(srv)


class Stream:
    """One gRPC stream; every response's arrival time is kept (errors too)."""

    def __init__(self, server: Server, values: dict[str, Any]):
        self.times: list[float] = []
        self.server_ns: list[float] = []  # last_token_time_ns of each response (with return_perf_metrics)
        self.errors: list[str] = []
        self.t_error = 0.0
        self.ntokens = 0
        self.text = ""  # the streamed text, all of it
        self.done = threading.Event()
        self.t0 = time.perf_counter()
        self.client = grpcclient.InferenceServerClient(server.grpc)
        self.client.start_stream(callback=self._on)
        self.client.async_stream_infer(MODEL, grpc_inputs({"stream": True, **values}), enable_empty_final_response=True)

    def _on(self, result, error) -> None:
        now = time.perf_counter()
        if error is not None:
            self.errors.append(error.message())
            self.t_error = now
            self.done.set()
            return
        c = _chunk_from_result(result, now)
        self.text += c.text
        if c.token_ids:
            self.times.append(now)
            ns = result.as_numpy("last_token_time_ns")
            if ns is not None:
                self.server_ns.append(float(ns.reshape(-1)[0]))
            self.ntokens += len(c.token_ids)
        if c.final:
            self.done.set()

    def ttft(self) -> float:
        return self.times[0] - self.t0

    def max_gap(self, start: float, end: float) -> float:
        """The longest wait between tokens over [start, end], counting the last token before it and
        the first after it (a window shorter than one step still measures the step around it)."""
        before = [t for t in self.times if t < start][-1:]
        after = [t for t in self.times if t > end][:1]
        ts = before + [t for t in self.times if start <= t <= end] + after
        return max((b - a for a, b in zip(ts, ts[1:])), default=float("inf"))

    def max_server_gap(self) -> float:
        """The largest gap between the engine's token times (server clock), over the whole stream."""
        ts = self.server_ns
        return max((b - a for a, b in zip(ts, ts[1:])), default=float("inf")) / 1e9

    def cancel(self) -> "Stream":
        """End the stream from the client (the request is cancelled); what came before stays."""
        self.client.stop_stream(cancel_requests=True)
        self.client.close()
        return self

    def wait(self, timeout: float = 120) -> "Stream":
        assert self.done.wait(timeout), "no final response"
        self.client.stop_stream()
        self.client.close()
        return self


def long_stream(server: Server, tokens: int = 160) -> Stream:
    s = Stream(server, {"text_input": PROMPT, "max_tokens": tokens, "min_tokens": tokens})
    deadline = time.monotonic() + 120
    while len(s.times) < 3:
        assert time.monotonic() < deadline, "the background stream never started"
        time.sleep(0.01)
    return s


def bomb(tag: str, n: int = 3000) -> str:
    """n optional keys and any other key (closed to its declared keys it would compile at once)."""
    return json.dumps({"type": "object", "properties": {f"{tag}{i}": {"type": "integer"} for i in range(n)},
                       "additionalProperties": True})


def test_compile_bombs_neither_block_a_trivial_guide_nor_stall_a_stream(hostile):
    idle = Stream(hostile, {"text_input": "Phone:", "max_tokens": 8, GT: "regex", G: REGEX}).wait()
    assert not idle.errors, idle.errors
    background = long_stream(hostile)
    t_start = time.perf_counter()
    bombs = [Stream(hostile, {"text_input": "Fill it.", "max_tokens": 8, GT: "json_schema", G: bomb(t)})
             for t in ("a", "b")]
    time.sleep(0.3)
    trivial = Stream(hostile, {"text_input": "Phone:", "max_tokens": 8, GT: "regex", G: "[0-9]{2}-[0-9]{5}"})
    trivial.wait()
    for b in bombs:
        b.wait()
        assert b.errors and "grammar compilation timed out after 2 s" in b.errors[0], b.errors
    assert not trivial.errors, trivial.errors
    # orderings: the trivial guide's first token came before the bombs were even refused, and the
    # running stream kept streaming while they compiled (its step never waits on a compile); the
    # gaps themselves are timed by bench/bench_hostile.py
    assert trivial.times[0] < min(b.t_error for b in bombs)
    t_end = max(b.t_error for b in bombs)
    background.wait()
    during = [t for t in background.times if t_start < t < t_end]
    assert len(during) >= 3, f"the running stream sent {len(during)} responses while the bombs compiled"
    # the same bomb again is refused before any compile (it is remembered as too slow: no worker taken)
    again = Stream(hostile, {"text_input": "Fill it.", "max_tokens": 8, GT: "json_schema", G: bomb("a")}).wait()
    assert again.errors and "timed out before" in again.errors[0]
    # and a schema that needs a worker still compiles (the killed workers were replaced)
    ok = Stream(hostile, {"text_input": "Fill it.", "max_tokens": 24, GT: "json_schema", G: json.dumps(
        {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(100)}, "required": ["k0"]})}).wait()
    assert not ok.errors, ok.errors


def test_a_5mb_prompt_is_refused_at_once_without_stalling_a_stream(hostile):
    """5 MB over gRPC; 3 MB over HTTP (Triton 2.51's HTTP front end itself crashes on bodies past
    ~4 MB, whatever the model: triton-inference-server/server issue 5840; see docs/operations.md)."""
    # streaming before the big prompts, long enough to outlast them: 1200 tokens, as a stream's first
    # responses once reached the client more than a second after it began (CI on Zen 5, 2026-11-30: the
    # 400 tokens it had then all came in the 41 ms around the refusals)
    background = long_stream(hostile, N_BACKGROUND)
    t0 = time.perf_counter()
    big = Stream(hostile, {"text_input": "x" * 5_000_000, "max_tokens": 4}).wait()
    took_grpc = time.perf_counter() - t0
    status, body = http(hostile, f"models/{MODEL}/generate", {"text_input": "x" * 3_000_000, "max_tokens": 4})
    t1 = time.perf_counter()
    background.wait()
    assert big.errors and "text_input has 5000000 bytes" in big.errors[0] and "max_prompt_bytes" in big.errors[0]
    assert status == 400 and "text_input has 3000000 bytes" in body["error"], body
    # ordering: both were refused while the running stream was still streaming, and it kept going
    # after them (its gaps are timed by bench/bench_hostile.py)
    # the running stream finished whole (an error or a cut would end it early, whatever the timing)
    assert not background.errors and background.ntokens == N_BACKGROUND, (background.errors, background.ntokens)
    timing = dict(grpc=took_grpc, both=t1 - t0, stream=background.times[-1] - background.times[0],
                  responses=len(background.times), last_after_t0=background.times[-1] - t0)
    assert big.t_error < t1 < background.times[-1], timing
    assert any(t > t1 for t in background.times[:-1])


@pytest.mark.parametrize("sampling, words", [
    ({"stop": 5}, "stop must be a string or a list of strings, got a number"),
    ({"stop": {"x": 1}}, "stop must be a string or a list of strings, got an object"),
    ({"repetition_penalty": 1e-38}, "repetition_penalty must be in [0.01, 100]"),
])
def test_bad_sampling_values_get_exact_messages(hostile, sampling, words):
    status, body = http(hostile, f"models/{MODEL}/generate",
                        {"text_input": "Hi", "sampling_parameters": json.dumps(sampling)})
    assert status == 400 and words in body["error"], body


def test_deep_json_gets_a_depth_message(hostile):
    deep = '{"stop": ' + "[" * 10_000 + "]" * 10_000 + "}"
    status, body = http(hostile, f"models/{MODEL}/generate", {"text_input": "Hi", "sampling_parameters": deep})
    assert status == 400 and "nested 10001 levels deep" in body["error"] and "recursion" not in body["error"], body
    schema = '{"type": "object", "properties": {"a": ' * 600 + '{"type": "integer"}' + "}}" * 600
    status, body = http(hostile, f"models/{MODEL}/generate", {"text_input": "Hi", GT: "json_schema", G: schema})
    assert status == 400 and "nested 1201 levels deep" in body["error"], body


def test_tiny_temperature_is_greedy_and_a_huge_top_k_is_off(hostile):
    base = {"text_input": PROMPT, "max_tokens": 12, "exclude_input_in_output": True}
    _, greedy = http(hostile, f"models/{MODEL}/generate", {**base, "temperature": 0.0})
    _, tiny = http(hostile, f"models/{MODEL}/generate", {**base, "temperature": 1e-40, "seed": 3})
    assert tiny["text_output"] == greedy["text_output"]
    status, body = http(hostile, f"models/{MODEL}/generate",
                        {"text_input": "Hi", "max_tokens": 4, "sampling_parameters": json.dumps({"top_k": 1e30, "seed": 1})})
    assert status == 200 and body["text_output"], body


def test_an_id_outside_the_vocabulary_is_refused_at_intake_and_the_stream_beside_it_runs_on(hostile):
    """Issue 75, measured: `bad_words_list` [[[T, 999999], [2, -1]]] (T the first token the model
    writes for that prompt) passed intake; once T was written the next step banned token 999999,
    failed with an IndexError and ended every stream in it with `decode failed`. The same with
    `stop_token_ids` [999999] and min_tokens (stop ids are banned before min_tokens). Now each is
    INVALID_ARG naming the field and the value, before the engine sees it, and a stream running
    beside them writes what it writes alone."""
    attack_prompt = "<|im_start|>user\nSay hello.<|im_end|>\n<|im_start|>assistant\n"
    first = raw_stream(hostile, {"text_input": S(attack_prompt), "max_tokens": I(1), "stream": B(True)})
    assert first[0][1] is None, first[0][1].message()
    t = int(first[0][0].as_numpy("output_ids").reshape(-1)[0])
    victim = Stream(hostile, {"text_input": PROMPT, "max_tokens": N_VICTIM, "min_tokens": N_VICTIM})
    deadline = time.monotonic() + 120
    while len(victim.times) < 3:
        assert time.monotonic() < deadline, "the victim stream never started"
        time.sleep(0.01)
    words = np.array([[[t, 999999], [2, -1]]], np.int32)
    bad = raw_stream(hostile, {"text_input": S(attack_prompt), "max_tokens": I(16), "stream": B(True),
                               "bad_words_list": words})
    stop_ids = raw_stream(hostile, {"text_input": S(attack_prompt), "max_tokens": I(16), "stream": B(True),
                                    "sampling_parameters": S(json.dumps({"stop_token_ids": [999999], "min_tokens": 4,
                                                                         "temperature": 0}))})
    t_refused = time.perf_counter()
    while not victim.done.is_set() and not (victim.times and victim.times[-1] > t_refused):
        assert time.monotonic() < deadline, "the victim stream stalled"
        time.sleep(0.01)
    assert not victim.errors, victim.errors
    assert victim.times[-1] > t_refused  # the refusals came while the victim was still streaming
    victim.cancel()
    n, text = victim.ntokens, victim.text  # the callbacks have stopped
    for got, field in ((bad, "bad_words_list"), (stop_ids, "stop_token_ids")):
        assert len(got) == 1 and got[0][1] is not None, f"{field}: answered instead of refused"
        message = got[0][1].message()
        assert field in message and "999999 is out of range" in message and "vocabulary" in message, message
    solo = Stream(hostile, {"text_input": PROMPT, "max_tokens": n, "min_tokens": n}).wait()  # the victim's tokens alone
    assert not solo.errors and solo.ntokens == n, solo.errors
    assert solo.text.startswith(text) and len(text) >= len(solo.text) - 8, (text[-40:], solo.text[-40:])
    status, body = http(hostile, f"models/{MODEL}/generate", {"text_input": PROMPT, "max_tokens": 8})
    assert status == 200 and body["text_output"], body


def test_a_request_of_many_rows_leaves_a_slot_to_the_request_after_it(hostile):
    """Issue 75, found by the fuzzing run: a 64-row request (max_tokens 4,096 each) took every slot
    and a request sent after it waited minutes for one. Here 4 slots, new_request_slots 1: a 4-row
    request runs 3 rows at once and keeps the last slot for others, so that a request sent while
    its rows decode is answered before it (with every slot taken, it waited for the 4 rows to end)."""
    rows, n = 4, 300
    got: "queue.Queue" = queue.Queue()
    client = grpcclient.InferenceServerClient(hostile.grpc)
    client.start_stream(callback=lambda result, error: got.put((time.perf_counter(), result, error)))
    values = {"text_input": np.array([[PROMPT.encode()]] * rows, np.object_), "max_tokens": np.full((rows, 1), n, np.int32),
              "min_tokens": np.full((rows, 1), n, np.int32), "stream": np.full((rows, 1), True)}
    client.async_stream_infer(MODEL, tensor_inputs(values), enable_empty_final_response=True)
    tokens, arrivals = [0] * rows, []  # (time, batch tokens so far)
    try:
        t, result, error = got.get(timeout=120)  # the batch is decoding
        late = Stream(hostile, {"text_input": "Hi", "max_tokens": 4}).wait()
        while True:
            assert error is None, error.message()
            ids = result.as_numpy("output_ids")
            if ids is not None:
                tokens[int(result.as_numpy("batch_index").reshape(-1)[0])] += int((ids >= 0).sum())
                arrivals.append((t, sum(tokens)))
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
            t, result, error = got.get(timeout=120)
    finally:
        client.stop_stream()
        client.close()
    assert tokens == [n] * rows
    assert not late.errors and late.ntokens == 4, late.errors
    before = max(k for t, k in arrivals if t < late.times[-1])
    assert before < rows * n // 2, before  # answered while the batch's rows decode (it waited for all of them)


def test_the_server_serves_on_after_the_hostile_run(hostile):
    """Big prompts and bombs again and again leave a server that answers (the stub's memory
    across the same run is measured by bench/bench_hostile.py)."""
    for i in range(4):
        big = Stream(hostile, {"text_input": "y" * 5_000_000, "max_tokens": 4}).wait()
        assert big.errors and "max_prompt_bytes" in big.errors[0]
        Stream(hostile, {"text_input": "Fill it.", "max_tokens": 4, GT: "json_schema", G: bomb(f"m{i}", 1200)}).wait()
    status, body = http(hostile, f"models/{MODEL}/generate", {"text_input": PROMPT, "max_tokens": 8})
    assert status == 200 and body["text_output"], body
