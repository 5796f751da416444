"""Explicit model control: a fleet's operators load and unload models through Triton's repository API.

Against a real tritonserver started with `--model-control-mode=explicit` and no model loaded, the
three models are loaded and unloaded CYCLES times (tritonclient `load_model` / `unload_model`). In
every cycle each name serves one request, and then:

- the resident memory of the server's whole process tree (tritonserver, the three Python backend
  stubs, the engine process, its compile worker), measured loaded once the compile worker has
  started, stays within 5% of the first cycle's;
- after the unload, none of the processes the load started is left (stubs, engine process, compile
  workers, a head training), none of the shared-memory regions named on the stubs' command lines
  is left in /dev/shm, none of the engine model's metric series is still exported, and
  tritonserver has at most one thread more than after the first unload.

One cycle unloads with requests in flight (a stream through `specguide_vllm`, one to `specguide`):
each finishes or ends with an error that says the model was unloaded. A request to an unloaded
model gets Triton's error, and the server stays up and serves after the next load. A last load
whose draft head is missing starts the background head training; its unload ends that process too.
"""
from __future__ import annotations

import json
import os
import platform
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from specguide.util.memory import rss_bytes
from specguide.process.supervisor import descendants

from .conftest import MODEL, Server, launch, repository_with, stop_and_check
from .helpers import B, I, S, raw_stream, tensor_inputs

MODELS = (MODEL, "specguide_unary", "specguide_vllm")
# 10 in the suite (~19 s a cycle on a 2-core Zen 3: the largest single test); the recorded 20-cycle
# figures (bench/RESULTS.md) come from SPECGUIDE_LOAD_CYCLES=20
CYCLES = int(os.environ.get("SPECGUIDE_LOAD_CYCLES", "10"))
IN_FLIGHT_CYCLE = 1  # the cycle whose unload finds requests running
RSS_TOLERANCE = 0.05
READ_SYSCALL = {"aarch64": "63"}.get(platform.machine(), "0")  # read(2) in /proc/<pid>/syscall (x86_64: 0)
PROMPT = "<|im_start|>user\nTell me a long story about the sea.<|im_end|>\n<|im_start|>assistant\n"
OUR_FAMILIES = ("specguide_", "vllm:", "nv_trt_llm_", "nv_llm_")  # the metric families the engine model exports
UNLOADED = ("unloaded", "shutting down")  # what the engine model's errors say of an unload
WAIT_S = 300.0  # a load or an unload must be done this soon (a 2-core machine under load)


# NOTE: about half of the engine's build with the shipped config is packing the default model's
# weights into their exact block formats (weight_dtype auto) from the float32 safetensors, again
# at every load (5.7 of 11 s in a profile on a busy 2-core machine); float32 weights skip that and
# load through the same code otherwise. One compile worker: each imports xgrammar (and with it
# torch, ~330 MiB) in the background at the least CPU share, and the tree is measured once it has.
# No background head training: the RSS of a training process starting and stopping would drown
# the comparison (test_unload_ends_the_background_head_training covers that process).
SETTINGS = {"weight_dtype": "float32", "draft_head_training": "off", "guided_compile_workers": "1"}
COMPILE_WORKERS = int(SETTINGS["guided_compile_workers"])


@pytest.fixture(scope="module")
def explicit(tmp_path_factory) -> Server:
    root = tmp_path_factory.mktemp("explicit")
    repo = repository_with(root, SETTINGS)
    srv = launch(root / "server.log", repo, ("--model-control-mode=explicit",))
    yield srv
    stop_and_check(srv)


@dataclass
class Tree:
    """The server's process tree at one moment."""

    rss: int  # bytes, summed over every process
    processes: dict[int, bytes]  # pid -> command line, the server's descendants
    shm: set[str] = field(default_factory=set)  # shared-memory regions named on the stubs' command lines
    by_kind: dict[str, int] = field(default_factory=dict)  # MiB per kind of process (the report)


def kind(cmd: bytes) -> str:
    """What a process of the tree is, in a word (the report's breakdown)."""
    args = cmd.split(b"\0")
    if b"triton_python_backend_stub" in args[0] and len(args) > 1:
        return "stub:" + Path(args[1].decode(errors="replace")).parents[1].name
    for word in (b"engine_process", b"compile_worker", b"training.cli"):
        if word in cmd:
            return word.decode()
    return args[0].decode(errors="replace")


def tree(srv: Server) -> Tree:
    processes: dict[int, bytes] = {}
    for pid in descendants(srv.proc.pid):
        try:
            processes[pid] = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
    shm = set()
    for cmd in processes.values():
        args = cmd.split(b"\0")
        if b"triton_python_backend_stub" in args[0] and len(args) > 2:
            shm.add(args[2].decode().lstrip("/"))  # the stub's region: argv[2]
    by_kind = {"server": rss_bytes(srv.proc.pid)}
    for pid, cmd in processes.items():
        by_kind[kind(cmd)] = by_kind.get(kind(cmd), 0) + rss_bytes(pid)
    return Tree(sum(by_kind.values()), processes, shm, {k: v >> 20 for k, v in by_kind.items()})


def waiting_for_a_job(pid: int) -> bool:
    """Blocked reading its standard input (fd 0): a compile worker that has started and waits for a job."""
    try:
        fields = Path(f"/proc/{pid}/syscall").read_text().split()
    except OSError:
        return False
    return len(fields) > 1 and fields[0] == READ_SYSCALL and int(fields[1], 16) == 0


def settled(srv: Server) -> Tree:
    """The tree once its compile workers have started: they import xgrammar in the background at the
    lowest CPU share after the model is ready (~330 MiB each once done), which on a busy machine
    takes seconds; then the RSS steady for a second."""
    deadline = time.monotonic() + WAIT_S
    last = tree(srv)
    while True:
        time.sleep(1.0)
        now = tree(srv)
        workers = [pid for pid, c in now.processes.items() if b"compile_worker" in c]
        if len(workers) == COMPILE_WORKERS and all(waiting_for_a_job(w) for w in workers) and \
                abs(now.rss - last.rss) <= 0.005 * last.rss:
            return now
        assert time.monotonic() < deadline, f"the process tree never settled: {now.by_kind}"
        last = now


def still_running(processes: dict[int, bytes]) -> dict[int, bytes]:
    """Those of `processes` that still exist: the same command line (not a reused pid), or a zombie."""
    out = {}
    for pid, cmd in processes.items():
        try:
            same = Path(f"/proc/{pid}/cmdline").read_bytes() == cmd
            zombie = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            continue
        if same or zombie:
            out[pid] = cmd
    return out


def server_threads(srv: Server) -> int:
    return len(os.listdir(f"/proc/{srv.proc.pid}/task"))


def each(action: str, srv: Server, models=MODELS, **kw) -> None:
    """load_model / unload_model of each model at once, on a client of its own (clients are not thread-safe)."""
    errors: list[BaseException] = []

    def run(model: str) -> None:
        try:
            getattr(httpclient.InferenceServerClient(srv.http, network_timeout=WAIT_S), action)(model, **kw)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(m,)) for m in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def wait_unloaded(srv: Server, loaded: Tree) -> None:
    """Until every model is unloaded and every process its load started has ended."""
    client = httpclient.InferenceServerClient(srv.http)
    deadline = time.monotonic() + WAIT_S
    while True:
        states = {m["name"]: m.get("state") for m in client.get_model_repository_index()}
        left = still_running(loaded.processes)
        if all(states.get(m) == "UNAVAILABLE" for m in MODELS) and not left:
            return
        assert time.monotonic() < deadline, f"not unloaded: {states}; processes left: {left}\n{srv.log_tail()}"
        time.sleep(0.1)


def trt(max_tokens: int) -> dict[str, np.ndarray]:
    return {"text_input": S(PROMPT), "max_tokens": I(max_tokens), "stream": B(True)}


def vllm(max_tokens: int) -> dict[str, np.ndarray]:
    return {"text_input": np.array([PROMPT.encode()], np.object_), "stream": np.array([True]),
            "sampling_parameters": np.array([json.dumps({"max_tokens": max_tokens}).encode()], np.object_)}


def serve_each(srv: Server) -> None:
    """One short request through each name; each must answer with text."""
    for model, inputs in ((MODEL, trt(4)), ("specguide_vllm", vllm(4))):
        got = raw_stream(srv, inputs, model=model)
        assert not any(e for _, e, _ in got) and any(r.as_numpy("text_output") is not None for r, _, _ in got), got
    client = grpcclient.InferenceServerClient(srv.grpc)
    unary = {k: v for k, v in trt(4).items() if k != "stream"}
    assert client.infer("specguide_unary", tensor_inputs(unary)).as_numpy("text_output") is not None
    client.close()


class InFlight:
    """A streamed request on a gRPC stream of its own: its responses with text, and its error."""

    def __init__(self, srv: Server, model: str, inputs: dict[str, np.ndarray]):
        self.texts, self.error = 0, None
        self.first, self.done = threading.Event(), threading.Event()
        self.client = grpcclient.InferenceServerClient(srv.grpc)
        self.client.start_stream(callback=self._on)
        self.client.async_stream_infer(model, tensor_inputs(inputs), enable_empty_final_response=True)

    def _on(self, result, error) -> None:
        if error is not None:
            self.error = error.message()
        elif result.as_numpy("text_output") is not None:
            self.texts += 1
        self.first.set()
        if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
            self.done.set()

    def result(self) -> "InFlight":
        assert self.done.wait(WAIT_S), "a request in flight at unload never ended"
        self.client.stop_stream()
        self.client.close()
        return self


def in_flight(srv: Server) -> list[InFlight]:
    running = [InFlight(srv, MODEL, trt(24)), InFlight(srv, "specguide_vllm", vllm(24))]
    for r in running:
        assert r.first.wait(120), "no first response"
    return running


def check_unloaded_model_answers_with_triton_error(srv: Server) -> None:
    client = grpcclient.InferenceServerClient(srv.grpc)
    for model in MODELS:
        with pytest.raises(InferenceServerException) as err:
            client.infer(model, tensor_inputs({"text_input": S(PROMPT), "max_tokens": I(1)}))
        message = err.value.message()
        assert model in message and ("unknown model" in message or "not ready" in message or
                                     "not found" in message), message
    assert client.is_server_live()
    client.close()


def test_load_unload_cycles_leave_nothing_behind(explicit):
    srv = explicit
    loaded_rss: list[int] = []
    unloaded_rss: list[int] = []
    threads_after: list[int] = []
    kinds: list[dict[str, int]] = []  # the loaded tree's MiB by process
    for cycle in range(CYCLES):
        each("load_model", srv)
        serve_each(srv)
        loaded = settled(srv)
        assert loaded.shm and "engine_process" in b" ".join(loaded.processes.values()).decode(errors="replace")
        loaded_rss.append(loaded.rss)
        kinds.append(loaded.by_kind)
        running = in_flight(srv) if cycle == IN_FLIGHT_CYCLE else []
        each("unload_model", srv)
        for r in (r.result() for r in running):  # finished, or told of the unload
            assert (r.error is None and r.texts > 1) or any(w in (r.error or "") for w in UNLOADED), (r.error, r.texts)
        wait_unloaded(srv, loaded)
        left = {name for name in loaded.shm if os.path.exists(f"/dev/shm/{name}")}
        assert not left, f"cycle {cycle}: shared-memory regions left after unload: {left}"
        stale = [line for line in srv.metrics_text().splitlines() if line.startswith(OUR_FAMILIES)]
        assert not stale, f"cycle {cycle}: the unloaded model's metrics are still exported: {stale[:3]}"
        unloaded_rss.append(rss_bytes(srv.proc.pid))
        threads_after.append(server_threads(srv))
        if cycle == 0:
            check_unloaded_model_answers_with_triton_error(srv)
    report = (f"loaded RSS per cycle (MiB): {[r >> 20 for r in loaded_rss]}; unloaded server RSS (MiB): "
              f"{[r >> 20 for r in unloaded_rss]}; server threads after unload: {threads_after}; "
              f"loaded MiB by process: {kinds}")
    print(report)
    assert all(abs(r - loaded_rss[0]) <= RSS_TOLERANCE * loaded_rss[0] for r in loaded_rss), report
    # NOTE: unloaded, the tree is tritonserver alone (checked above), ~45 MiB, and it grows on its own
    # over the first cycles (43 -> 46 MiB in 5 cycles here, then flat): a 10-line Python model that
    # makes 30 metric families and deletes them in finalize grew it from 42.0 to 43.4 MiB in 12 cycles
    # (41.7 to 42.5 without the families), so 5% of it is no test of this model; the numbers are in
    # the report
    # NOTE: a thread left per cycle would add CYCLES - 1; tritonserver once started one more thread of
    # its own late in a clean-clone CI run (28 -> 29 after the 18th unload, flat before and after)
    assert max(threads_after) <= threads_after[0] + 1, report


def test_unload_ends_the_background_head_training(explicit, tmp_path):
    """A load whose draft head is missing trains it in a process of its own; the unload ends it."""
    srv = explicit
    client = httpclient.InferenceServerClient(srv.http, network_timeout=WAIT_S)
    config = client.get_model_config(MODEL) if client.is_model_ready(MODEL) else None
    if config is None:
        client.load_model(MODEL)
        config = client.get_model_config(MODEL)
        client.unload_model(MODEL)
        wait_gone(srv, MODEL)
    missing = tmp_path / "no-head.pt"
    config["parameters"]["draft_head_path"] = {"string_value": str(missing)}
    config["parameters"]["draft_head_training"] = {"string_value": "background"}
    client.load_model(MODEL, config=json.dumps(config))
    deadline = time.monotonic() + 60
    while not (training := training_processes(srv)):
        assert time.monotonic() < deadline, f"no head training started:\n{srv.log_tail()}"
        time.sleep(0.1)
    loaded = tree(srv)
    client.unload_model(MODEL)
    wait_gone(srv, MODEL, loaded)  # every process of the load ended: the training's too
    assert training.keys() <= loaded.processes.keys() and not missing.exists()


def training_processes(srv: Server) -> dict[int, bytes]:
    return {pid: cmd for pid, cmd in tree(srv).processes.items() if b"specguide.training.cli" in cmd}


def wait_gone(srv: Server, model: str, loaded: Optional[Tree] = None) -> None:
    """Until `model` is unloaded and no engine process is left, nor any process of `loaded`."""
    client = httpclient.InferenceServerClient(srv.http)
    deadline = time.monotonic() + WAIT_S
    while {m["name"]: m.get("state") for m in client.get_model_repository_index()}.get(model) != "UNAVAILABLE" \
            or any(b"engine_process" in c for c in tree(srv).processes.values()) \
            or (loaded is not None and still_running(loaded.processes)):
        left = still_running(loaded.processes) if loaded is not None else {}
        assert time.monotonic() < deadline, f"{model} not unloaded; processes left: {left}\n{srv.log_tail()}"
        time.sleep(0.1)
