"""The fuzzing suite's driver (issue 75): send a drawn `Case`, judge its answer, watch a victim stream.

Shared by tests/integration/test_fuzz_server.py (a bounded run in `make test`) and bench/bench_fuzz.py
(the long run). What counts:

- **ok**: a valid answer. Triton streams: responses up to one with the FINAL flag, each with a
  `text_output` (the empty final response excepted); `infer`: a result with `text_output`; HTTP
  `generate`: 200 and a JSON object with `text_output`; `generate_stream`: events of such objects;
  OpenAI: 200 with `choices`, or an event stream of chunks that ends with `data: [DONE]`.
- **refused**: a clear error: Triton's or ours, with a message that names no internal failure
  (INTERNAL_TEXT below). Triton: judged by the message alone, as Triton 2.51 loses the code of an
  error a Python model sends (gRPC streams carry none, gRPC `infer` says INTERNAL, HTTP says 400:
  docs/known-issues.md); HTTP: 4xx; OpenAI: 4xx and an OpenAI error object. A queue that is full
  for the request's own size is such an error too.
- **upstream**: Triton 2.51's HTTP front end's own 500 for a body its JSON parser cannot read (not
  JSON, not an object, a wrongly typed value, a key with a NUL in it), before any model code runs
  (TRITON_HTTP_500; docs/known-issues.md, server issue 8762): a clear message with the wrong status,
  counted apart and not a finding here.
- **internal**: an error whose message says the server failed (a Python exception's name, a
  traceback, "the server log has the details", a dead engine or stub, a lost connection), any other
  HTTP 5xx, or a connection that fails.
- **hang**: no final answer within the request timeout.
- **malformed**: an answer that is neither (a 200 without text, an event stream cut short, a body
  that is not JSON).

A victim is harmed when its text differs from its solo run, it gets an error, or it does not finish.
"""
from __future__ import annotations

import http.client
import json
import multiprocessing
import queue
import re
import os
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from client.common import _chunk_from_result, grpc_inputs

from .conftest import MODEL, Server
from .fuzz_strategies import Case

OK, REFUSED, UPSTREAM, INTERNAL, HANG, MALFORMED = "ok", "refused", "upstream", "internal", "hang", "malformed"
GOOD = (OK, REFUSED, UPSTREAM)
REQUEST_TIMEOUT_S = 180.0
# what an error names when the server, not the request, failed
INTERNAL_TEXT = re.compile(
    r"Traceback|server log has the details|internal error|\b(?:[A-Z][a-z]+)+(?:Error|Exception)\b|Stub process|"
    r"not healthy|Failed to process the request|engine is not running|engine (?:died|exited|crashed|is down)|"
    r"not reachable|Connection lost|Socket closed|Broken pipe|core dumped|Segmentation fault|out of memory|"
    r"engine was stuck|was killed|new engine is starting|engine restart")
# Triton 2.51's HTTP front end answers these with 500 (server issue 8762), no model code involved
TRITON_HTTP_500 = re.compile(r"^(?:failed to parse the request JSON buffer|Unable to parse |attempt to get members for "
                             r"non-object$|parameter key '[^']*' was not found in the JSON$)")
HEARTBEAT_S = 0.01  # the victims' process's heartbeat: a sleep this long ...
OWN_STALL_S = 0.1  # ... that overruns by this much is a stall of the process itself (reported, not the server's)
VICTIM_PROMPT = "<|im_start|>user\nTell me a long story about the sea.<|im_end|>\n<|im_start|>assistant\n"


@dataclass
class Outcome:
    verdict: str
    detail: str = ""  # the error message, or what was wrong with the answer
    t0: float = 0.0
    t1: float = 0.0
    status: str = ""  # gRPC status / HTTP status

    def error_class(self) -> str:
        """A short class for counting: the verdict and the message's first words, numbers and quotes cut."""
        text = re.sub(r"'[^']*'|\"[^\"]*\"|\d+(\.\d+)?(e[+-]?\d+)?", "#", self.detail)
        text = re.sub(r"\s+", " ", text).strip()[:90]
        return f"{self.verdict} {self.status} {text}".strip()


def _judge_error(message: str, status: str = "") -> Outcome:
    if INTERNAL_TEXT.search(message or ""):
        return Outcome(INTERNAL, message, status=status)
    if not (message or "").strip():
        return Outcome(MALFORMED, "an error without a message", status=status)
    return Outcome(REFUSED, message, status=status)


def _inputs(tensors: dict[str, np.ndarray]) -> list:
    out = []
    for name, arr in tensors.items():
        t = grpcclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


def send_stream(server: Server, case: Case, timeout: float = REQUEST_TIMEOUT_S) -> Outcome:
    """A decoupled name over one gRPC stream: responses up to FINAL, or an error. A hang is `timeout`
    seconds without a response (a stream that keeps answering is working, as HTTP's socket timeout)."""
    client = grpcclient.InferenceServerClient(server.grpc)
    q: "queue.Queue[Any]" = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    cancel = False
    try:
        client.async_stream_infer(case.target, _inputs(case.tensors), request_id=case.request_id,
                                  enable_empty_final_response=True)
        n = 0
        while True:
            try:
                result, error = q.get(timeout=timeout)
            except queue.Empty:
                cancel = True
                return Outcome(HANG, f"no response in {timeout:.0f} s (after {n} responses)")
            if error is not None:
                return _judge_error(error.message(), str(error.status() or ""))
            resp = result.get_response()
            final = "triton_final_response" in resp.parameters and resp.parameters["triton_final_response"].bool_param
            names = {o.name for o in resp.outputs}
            if names and "text_output" not in names:
                return Outcome(MALFORMED, f"a response without text_output: {sorted(names)}")
            n += 1
            if final:
                return Outcome(OK, f"{n} responses")
    finally:
        client.stop_stream(cancel_requests=cancel)
        client.close()


def send_infer(server: Server, case: Case, timeout: float = REQUEST_TIMEOUT_S) -> Outcome:
    """specguide_unary: one ModelInfer."""
    client = grpcclient.InferenceServerClient(server.grpc)
    try:
        result = client.infer(case.target, _inputs(case.tensors), request_id=case.request_id, client_timeout=timeout)
    except InferenceServerException as e:
        if "Deadline Exceeded" in (e.message() or "") or str(e.status()) == "StatusCode.DEADLINE_EXCEEDED":
            return Outcome(HANG, f"no response in {timeout:.0f} s")
        return _judge_error(e.message(), str(e.status() or ""))
    finally:
        client.close()
    if result.as_numpy("text_output") is None:
        return Outcome(MALFORMED, "a result without text_output")
    return Outcome(OK)


def _post(host: str, path: str, body: bytes, timeout: float) -> tuple[int, bytes]:
    h, _, port = host.split("://")[-1].rpartition(":")
    conn = http.client.HTTPConnection(h, int(port), timeout=timeout)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _events(data: bytes) -> list[bytes]:
    return [line[len(b"data:"):].strip() for line in data.split(b"\n") if line.startswith(b"data:")]


def send_http(server: Server, case: Case, timeout: float = REQUEST_TIMEOUT_S) -> Outcome:
    """Triton's HTTP generate / generate_stream."""
    try:
        status, data = _post(server.http, case.path, case.body, timeout)
    except TimeoutError:
        return Outcome(HANG, f"no answer in {timeout:.0f} s")
    except (ConnectionError, http.client.HTTPException, OSError) as e:
        return Outcome(INTERNAL, f"connection failed: {type(e).__name__}: {e}")
    if status != 200:
        try:
            message = json.loads(data.decode().removeprefix("data:").strip()).get("error", "")
        except (ValueError, AttributeError):
            return Outcome(MALFORMED, f"HTTP {status} with a body that is not a JSON error: {data[:200]!r}", status=str(status))
        out = _judge_error(str(message), str(status))
        if status == 500 and TRITON_HTTP_500.match(str(message)):
            out.verdict = UPSTREAM
        elif status >= 500:
            out.verdict = INTERNAL
        return out
    objs = _events(data) if case.stream else [data]
    if not objs:
        return Outcome(MALFORMED, f"200 without events: {data[:200]!r}", status="200")
    for raw in objs:
        try:
            obj = json.loads(raw)
        except ValueError:
            return Outcome(MALFORMED, f"200 with a body that is not JSON: {raw[:200]!r}", status="200")
        if not isinstance(obj, dict):
            return Outcome(MALFORMED, f"200 with {type(obj).__name__}", status="200")
        if "error" in obj:
            return _judge_error(str(obj["error"]), "200")
        if "text_output" not in obj:
            return Outcome(MALFORMED, f"200 without text_output: {sorted(obj)[:10]}", status="200")
    return Outcome(OK, status="200")


def send_openai(base: str, case: Case, timeout: float = REQUEST_TIMEOUT_S) -> Outcome:
    """The OpenAI server: 200 with choices (or a whole event stream), or 4xx with an OpenAI error."""
    try:
        status, data = _post(base, case.path, case.body, timeout)
    except TimeoutError:
        return Outcome(HANG, f"no answer in {timeout:.0f} s")
    except (ConnectionError, http.client.HTTPException, OSError) as e:
        return Outcome(INTERNAL, f"connection failed: {type(e).__name__}: {e}")
    if status != 200:
        try:
            err = json.loads(data)["error"]
            message = err["message"]
        except (ValueError, KeyError, TypeError):
            return Outcome(MALFORMED, f"HTTP {status} without an OpenAI error: {data[:200]!r}", status=str(status))
        out = _judge_error(str(message), str(status))
        if status >= 500:
            out.verdict = INTERNAL
        return out
    if case.stream and data.lstrip().startswith(b"data:"):
        events = _events(data)
        if not events or events[-1] != b"[DONE]":
            return Outcome(MALFORMED, f"an event stream without [DONE]: ...{data[-200:]!r}", status="200")
        for raw in events[:-1]:
            try:
                obj = json.loads(raw)
            except ValueError:
                return Outcome(MALFORMED, f"an event that is not JSON: {raw[:200]!r}", status="200")
            if isinstance(obj, dict) and "error" in obj:
                return _judge_error(str(obj["error"].get("message", obj["error"])), "200")
        return Outcome(OK, status="200")
    try:
        obj = json.loads(data)
    except ValueError:
        return Outcome(MALFORMED, f"200 with a body that is not JSON: {data[:200]!r}", status="200")
    if not isinstance(obj, dict) or not isinstance(obj.get("choices"), list):
        return Outcome(MALFORMED, f"200 without choices: {data[:200]!r}", status="200")
    return Outcome(OK, status="200")


def send(server: Server, openai_base: str, case: Case, timeout: float = REQUEST_TIMEOUT_S) -> Outcome:
    """Send one case and judge its answer; the outcome carries its own start and end time."""
    t0 = time.perf_counter()
    try:
        if case.target == "specguide_unary":
            out = send_infer(server, case, timeout)
        elif case.target.startswith("specguide"):
            out = send_stream(server, case, timeout)
        elif case.target == "http":
            out = send_http(server, case, timeout)
        else:
            out = send_openai(openai_base, case, timeout)
    except InferenceServerException as e:  # refused by the client library before it was sent
        out = Outcome(REFUSED, f"client: {e.message()}", status="client")
    out.t0, out.t1 = t0, time.perf_counter()
    return out


# ------------------------------------------------------------------------------ the victim


@dataclass
class VictimRun:
    """One victim stream: its token ids, text, arrival times and error."""

    ids: list[int] = field(default_factory=list)
    text: str = ""
    times: list[float] = field(default_factory=list)
    # per chunk: seconds from the engine's last token time (return_perf_metrics) to its arrival here
    lags: list[Optional[float]] = field(default_factory=list)
    error: str = ""
    final: bool = False
    t0: float = 0.0


def victim_stream(server: Server, tokens: int, timeout: float = 600.0, run: Optional[VictimRun] = None,
                  abandon: Optional[threading.Event] = None, on_chunk=None) -> VictimRun:
    """One greedy stream of VICTIM_PROMPT on `specguide`, `tokens` long (EOS suppressed), into `run`;
    cancelled when `abandon` is set; `on_chunk(ids, text, arrival)` for each chunk with tokens."""
    run = run if run is not None else VictimRun()
    run.t0 = time.perf_counter()
    done = threading.Event()

    def on(result, error) -> None:
        now, wall = time.perf_counter(), time.time_ns()
        if error is not None:
            run.error = error.message()
            done.set()
            return
        c = _chunk_from_result(result, now)
        if c.token_ids:
            made = result.as_numpy("last_token_time_ns")
            lag = (wall - int(made.reshape(-1)[0])) / 1e9 if made is not None and made.size else None
            run.ids += c.token_ids
            run.text += c.text
            run.times.append(now)
            run.lags.append(lag)
            if on_chunk is not None:
                on_chunk(c.token_ids, c.text, now, lag)
        if c.final:
            run.final = True
            done.set()

    client = grpcclient.InferenceServerClient(server.grpc)
    client.start_stream(callback=on)
    client.async_stream_infer(MODEL, grpc_inputs({"text_input": VICTIM_PROMPT, "max_tokens": tokens,
                                                  "min_tokens": tokens, "stream": True, "temperature": 0.0,
                                                  "return_perf_metrics": True}),
                              request_id="victim", enable_empty_final_response=True)
    deadline = time.monotonic() + timeout
    while not done.wait(0.5) and time.monotonic() < deadline and not (abandon and abandon.is_set()):
        pass
    if not done.is_set():
        run.error = run.error or ("abandoned" if abandon and abandon.is_set() else f"no final response in {timeout:.0f} s")
    client.stop_stream(cancel_requests=not done.is_set())
    client.close()
    return run


def _victim_process(grpc_url: str, tokens: int, conn) -> None:
    """The victims' process: one victim stream after another, each chunk sent to the parent with its
    arrival time; after each run it waits for "go" ("stop": exit; "abandon" also cancels a run)."""
    import types

    try:  # a session (and so a scheduler autogroup) of its own: the client may yield its own (bench_fuzz)
        os.setsid()
    except OSError:
        pass
    server = types.SimpleNamespace(grpc=grpc_url)
    abandon, stop = threading.Event(), threading.Event()
    outbox: queue.Queue = queue.Queue()

    def send(msg) -> None:  # NOTE: never blocks the stream's callbacks (a busy parent fills the pipe)
        outbox.put(msg)

    def post() -> None:
        while (msg := outbox.get()) is not None:
            try:
                conn.send(msg)
            except (EOFError, OSError):
                return

    poster = threading.Thread(target=post, daemon=True)
    poster.start()

    def heartbeat() -> None:  # this process's own stalls: a wait it made itself is not the server's
        while True:
            t0 = time.perf_counter()
            time.sleep(HEARTBEAT_S)
            t1 = time.perf_counter()
            if t1 - t0 >= HEARTBEAT_S + OWN_STALL_S:
                send(("stall", t0 + HEARTBEAT_S, t1))

    threading.Thread(target=heartbeat, daemon=True).start()

    def listen() -> None:
        while not abandon.is_set():
            try:
                cmd = conn.recv()
            except (EOFError, OSError):
                cmd = "abandon"
            if cmd == "go":
                go.set()
            elif cmd == "stop":
                stop.set()
                go.set()
            else:
                stop.set()
                abandon.set()
                go.set()

    go = threading.Event()
    threading.Thread(target=listen, daemon=True).start()
    while not stop.is_set():
        run = VictimRun()
        send(("start", time.perf_counter()))
        victim_stream(server, tokens, run=run, abandon=abandon,
                      on_chunk=lambda ids, text, now, lag: send(("chunk", ids, text, now, lag)))
        send(("end", "abandoned" if abandon.is_set() else run.error, run.final))
        if abandon.is_set():
            break
        go.wait()
        go.clear()
    outbox.put(None)  # what is queued goes out first
    poster.join(30)


class Victims:
    """Victim streams one after another in a process of their own while hostile requests run; each
    is compared with the solo run (`solo`, taken before any hostile request). NOTE: a process, not a
    thread: the client's own work (drawing a 200 KB case, reading a 64-row answer) holds this
    process's GIL, and a victim thread's arrival times would count that as the server's gap. The
    child stamps each chunk with time.perf_counter (CLOCK_MONOTONIC: one clock for both processes)."""

    def __init__(self, server: Server, tokens: int):
        self.server, self.tokens = server, tokens
        self.solo = victim_stream(server, tokens)
        assert not self.solo.error and self.solo.final and len(self.solo.ids) == tokens, self.solo
        self.runs: list[VictimRun] = []
        self.stalls: list[tuple[float, float]] = []  # (start, end) of each of the victims' process's own stalls
        self._current: Optional[VictimRun] = None
        self._stopping = False
        ctx = multiprocessing.get_context("spawn")  # (no fork: gRPC's threads)
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_victim_process, args=(server.grpc, tokens, child), name="victims", daemon=True)
        self._thread = threading.Thread(target=self._receive, name="victims", daemon=True)

    def start(self) -> "Victims":
        self._proc.start()
        self._thread.start()
        deadline = time.monotonic() + 120
        while not (self.runs or (self._current and self._current.times)):  # the first victim is streaming
            assert time.monotonic() < deadline, "the victim never started"
            time.sleep(0.01)
        return self

    def _receive(self) -> None:
        """The child's messages into `runs`; after each run: settle the server if it failed, then go on."""
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                return
            kind = msg[0]
            if kind == "start":
                self._current = VictimRun(t0=msg[1])
            elif kind == "chunk" and self._current is not None:
                _, ids, text, now, lag = msg
                self._current.ids += ids
                self._current.text += text
                self._current.times.append(now)
                self._current.lags.append(lag)
            elif kind == "stall":
                self.stalls.append((msg[1], msg[2]))
            elif kind == "end" and self._current is not None:
                run, self._current = self._current, None
                run.error, run.final = msg[1], msg[2]
                if run.error == "abandoned":
                    return
                self.runs.append(run)
                if run.error:  # the engine may be restarting: the next victim waits for it
                    settle(self.server)
                if self._stopping:
                    return
                self._conn.send("go")

    def stop(self, abandon: bool = False) -> list[VictimRun]:
        """Stop after the running victim (checked like the others), or (abandon) cancel it unchecked."""
        self._stopping = True
        self._conn.send("abandon" if abandon else "stop")
        self._thread.join(timeout=900)
        self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.kill()
        return self.runs

    def progress(self) -> str:
        current = self._current
        return f"{len(self.runs)} done" + (f", the current one at {len(current.ids)} tokens" if current else "")

    def harmed(self) -> list[tuple[int, VictimRun, str]]:
        """(index, run, why) of each victim whose answer is not the solo run's."""
        out = []
        for i, r in enumerate(self.runs):
            if r.error or not r.final:
                out.append((i, r, f"error: {r.error or 'no final response'}"))
            elif r.ids != self.solo.ids:
                k = next((j for j, (a, b) in enumerate(zip(r.ids, self.solo.ids)) if a != b), min(len(r.ids), len(self.solo.ids)))
                out.append((i, r, f"differs from the solo run at token {k} of {len(r.ids)}: {r.text[max(0, k - 20):k + 40]!r}"
                                  f" vs {self.solo.text[max(0, k - 20):k + 40]!r}"))
        return out

    def when_harmed(self, run: VictimRun) -> float:
        """When a harmed victim went wrong: its first differing token's arrival, or its last token (error)."""
        if not run.error and run.final:
            k = next((j for j, (a, b) in enumerate(zip(run.ids, self.solo.ids)) if a != b), len(run.times) - 1)
            return run.times[min(k, len(run.times) - 1)] if run.times else run.t0
        return run.times[-1] if run.times else run.t0

    def own_stall(self, t0: float, t1: float) -> float:
        """How long the victims' own process stood still within [t0, t1] (its heartbeat overslept: the
        machine did not run it, as a client on the server's cores can be starved); 0 when it did not."""
        return max((min(b, t1) - max(a, t0) for a, b in list(self.stalls) if a < t1 and b > t0), default=0.0)

    def gap(self, t0: float, t1: float) -> Optional[float]:
        """The longest wait between a victim's tokens over [t0, t1] (counting the last token before and
        the first after); None when no victim streamed through the window."""
        best = None
        current = self._current
        for r in list(self.runs) + ([current] if current is not None else []):
            ts = r.times
            if not ts or ts[-1] < t0 or ts[0] > t1:
                continue
            before = [t for t in ts if t < t0][-1:]
            after = [t for t in ts if t > t1][:1]
            window = before + [t for t in ts if t0 <= t <= t1] + after
            gaps = [b - a for a, b in zip(window, window[1:])]
            if gaps:
                best = max(best or 0.0, max(gaps))
        return best


# ------------------------------------------------------------------------------ health


def engine_state(server: Server) -> dict[str, Any]:
    """What must not change across a hostile run: the server process, stub and engine pids, restart counts."""
    return {"server_alive": server.proc.poll() is None, "stubs": server.stubs(), "engine": server.engine_pid(),
            "engine_restarts": server.metric("specguide_engine_restarts_total"),
            "server_restarts": server.metric("specguide_server_restarts_total")}


def settle(server: Server, timeout: float = 300.0) -> bool:
    """Wait until the engine serves (specguide_engine_alive 1: a restarting engine comes back); False if not."""
    return server.wait_metric("specguide_engine_alive", 1.0, timeout=timeout) == 1.0


def healthy(server: Server, openai_base: str) -> list[str]:
    """What is wrong with the server after a hostile run ([] if nothing): readiness of the three
    names, and one normal request through each of them and the OpenAI server."""
    problems = []
    for model in ("specguide", "specguide_unary", "specguide_vllm"):
        try:
            with urllib.request.urlopen(f"http://{server.http}/v2/models/{model}/ready", timeout=10) as r:
                if r.status != 200:
                    problems.append(f"{model} not ready: HTTP {r.status}")
        except (urllib.error.URLError, OSError) as e:
            problems.append(f"{model} not ready: {e}")
    normal = {"specguide": Case("specguide", {"text_input": np.array([[b"The capital of France is"]], dtype=object),
                                              "max_tokens": np.array([[4]], dtype=np.int32)}),
              "specguide_unary": Case("specguide_unary", {"text_input": np.array([[b"Hi"]], dtype=object),
                                                          "max_tokens": np.array([[4]], dtype=np.int32)}),
              "specguide_vllm": Case("specguide_vllm", {"text_input": np.array([b"Hi"], dtype=object),
                                                        "sampling_parameters": np.array([b'{"max_tokens": 4}'], dtype=object)}),
              "openai": Case("openai_completions", path="/v1/completions",
                             body=b'{"model": "specguide", "prompt": "Hi", "max_tokens": 4}')}
    for name, case in normal.items():
        out = send(server, openai_base, case, timeout=120)
        if out.verdict != OK:
            problems.append(f"a normal request to {name}: {out.verdict} {out.detail[:300]}")
    return problems


@dataclass
class Tally:
    """Counts of a run: requests per target, outcomes, error classes, the failures themselves."""

    per_target: Counter = field(default_factory=Counter)
    verdicts: Counter = field(default_factory=Counter)
    classes: Counter = field(default_factory=Counter)
    failures: list[tuple[Case, Outcome]] = field(default_factory=list)
    windows: list[tuple[float, float, str]] = field(default_factory=list)  # (t0, t1, case) of every request
    max_gap: float = 0.0
    max_gap_case: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)

    in_flight: dict[int, tuple[float, str]] = field(default_factory=dict)

    def began(self, case: Case) -> None:
        with self.lock:
            self.in_flight[id(case)] = (time.perf_counter(), case.describe(300))

    def slow(self, older_than: float) -> list[str]:
        """The requests in flight for more than `older_than` seconds."""
        now = time.perf_counter()
        with self.lock:
            return [f"{now - t0:.0f} s: {d}" for t0, d in self.in_flight.values() if now - t0 > older_than]

    def add(self, case: Case, out: Outcome, gap: Optional[float]) -> None:
        with self.lock:
            self.in_flight.pop(id(case), None)
            self.per_target[case.target] += 1
            self.verdicts[out.verdict] += 1
            self.classes[out.error_class() if out.verdict != OK else OK] += 1
            if out.verdict not in GOOD:
                self.failures.append((case, out))
            self.windows.append((out.t0, out.t1, case.describe(300)))
            if gap is not None and gap > self.max_gap:
                self.max_gap, self.max_gap_case = gap, case.describe(300)

    def spanning(self, a: float, b: float) -> list[str]:
        """The requests in flight at some moment of [a, b], the longest-running first."""
        with self.lock:
            hits = [(t1 - t0, f"{t1 - t0:.1f} s ({t0 - a:+.1f} s): {d}") for t0, t1, d in self.windows if t0 <= b and t1 >= a]
        return [d for _, d in sorted(hits, reverse=True)]

    def overlapping(self, t: float, slack: float = 0.5) -> list[str]:
        """The requests in flight around time t (a harmed victim's suspects)."""
        with self.lock:
            return [d for t0, t1, d in self.windows if t0 - slack <= t <= t1 + slack]
