"""An engine crash costs seconds, not the replica, against a real tritonserver serving all three names.

The engine process (engine_process.py, the one that holds the model) is SIGKILLed, as the
kernel's OOM killer or a fault in native code would, while requests run through every interface:
a gRPC stream and an HTTP generate_stream to `specguide`, a gRPC stream through `specguide_vllm`
and a unary gRPC request through `specguide_unary`. Each client must get its error (naming the
cause) within 2 s; a 1-token inference through each name (health_probe: the readiness probe)
fails until the engine is back, which it is by itself; then answers are what they were before.
Three crash-recover cycles leave the server's memory and shared-memory regions where the first
left them. A killed tritonserver leaves none of its processes behind (stubs, engine, workers)."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from client.common import GrpcStream, grpc_inputs, http_generate_stream
from specguide.process import health_probe
from specguide.process.ipc import process_identity
from specguide.util.memory import rss_bytes
from specguide.process.supervisor import descendants

from .conftest import MODEL, ROOT, Server, _stop, launch, stop_and_check
from .helpers import tensor_inputs

PROMPT = "<|im_start|>user\nTell me a long story about the sea.<|im_end|>\n<|im_start|>assistant\n"
CAUSE = "killed by SIGKILL"
DEADLINE_S = 2.0  # each client hears of the crash this soon
RECOVERY_S = 60.0  # the engine serves again this soon (the default model)
LONG = 2000  # tokens: the requests are still running when the engine dies


@pytest.fixture(scope="module")
def crash(tmp_path_factory) -> Server:
    root = tmp_path_factory.mktemp("crash")
    srv = launch(root / "server.log", ROOT / "model_repository")
    yield srv
    stop_and_check(srv, allow_tracebacks=True)


class Client:
    """One request on a thread of its own; records when its last response (or error) came."""

    def __init__(self, name: str, run: Callable[["Client"], None]):
        self.name, self.error, self.t_end, self.tokens = name, None, None, 0
        self.finish = None  # a finish reason the stream carried (vLLM's output), if any
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(run,), daemon=True)
        self.thread.start()

    def _run(self, run: Callable[["Client"], None]) -> None:
        try:
            run(self)
        except Exception as e:  # the transport's error is an answer too
            self.error = f"{type(e).__name__}: {e}"
        self.t_end = time.monotonic()
        self.started.set()

    def result(self, timeout: float) -> "Client":
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"{self.name}: no answer {timeout} s after the crash"
        return self


def grpc_stream(srv: Server) -> Callable[[Client], None]:
    def run(c: Client) -> None:
        s = GrpcStream(srv.grpc, MODEL)
        for chunk in s.generate({"text_input": PROMPT, "max_tokens": LONG, "stream": True}, timeout=120):
            c.tokens += len(chunk.token_ids)
            c.started.set()
            if chunk.error:
                c.error = chunk.error
        s.close()
    return run


def http_stream(srv: Server) -> Callable[[Client], None]:
    def run(c: Client) -> None:
        for chunk in http_generate_stream({"text_input": PROMPT, "max_tokens": LONG}, url=srv.http, timeout=120):
            c.tokens += 1
            c.started.set()
            if chunk.error:
                c.error = chunk.error
    return run


def vllm_stream(srv: Server) -> Callable[[Client], None]:
    def run(c: Client) -> None:
        done = threading.Event()

        def on(result: Any, error: Any) -> None:
            if error is not None:
                c.error = error.message()
                done.set()
                return
            c.tokens += 1
            c.started.set()
            reason = result.as_numpy("finish_reason") if result.get_response().outputs else None
            if reason is not None and reason.size and reason.reshape(-1)[0] != b"None":
                c.finish = reason.reshape(-1)[0]  # the request ended by itself: say so if the test fails
            if result.get_response().parameters["triton_final_response"].bool_param:
                done.set()

        client = grpcclient.InferenceServerClient(srv.grpc)
        client.start_stream(callback=on)
        # ignore_eos: vLLM's default is sampling (temperature 1), which may end a story before the
        # kill; the other interfaces are greedy by default
        sampling = {"max_tokens": LONG, "ignore_eos": True}
        inputs = tensor_inputs({"text_input": np.array([PROMPT.encode()], np.object_), "stream": np.array([True]),
                                "return_finish_reason": np.array([True]),
                                "sampling_parameters": np.array([json.dumps(sampling).encode()], np.object_)})
        client.async_stream_infer("specguide_vllm", inputs, enable_empty_final_response=True)
        done.wait(120)
        client.stop_stream()
        client.close()
    return run


def unary(srv: Server) -> Callable[[Client], None]:
    def run(c: Client) -> None:
        client = grpcclient.InferenceServerClient(srv.grpc)
        inputs = grpc_inputs({"text_input": PROMPT, "max_tokens": LONG})
        c.started.set()  # a unary request shows nothing until it ends
        try:
            client.infer("specguide_unary", inputs, client_timeout=120)
        except grpcclient.InferenceServerException as e:
            c.error = e.message()
        client.close()
    return run


def not_ready(srv: Server) -> list[str]:
    """The served names a 1-token inference fails through (the readiness probe's view)."""
    return [m for m in health_probe.SERVED if health_probe.probe(srv.http, m, timeout=30)]


def greedy(srv: Server) -> list[int]:
    s = GrpcStream(srv.grpc, MODEL)
    ids = [t for c in s.generate({"text_input": PROMPT, "max_tokens": 12, "temperature": 0.0}) for t in c.token_ids]
    s.close()
    return ids


def tree_rss(srv: Server) -> tuple[int, list[str]]:
    """(Resident memory of the server and every process under it but the engine's compile workers,
    the command lines of the processes, workers included). A fresh engine's workers are measured
    mid-start-up or not (17-36 MiB then 130 MiB each, whenever they finish loading the
    tokenizer): they hold nothing across crashes, so they are counted, not weighed. Their start-up
    runs helpers of its own for a moment (importing tvm_ffi runs `ldconfig -p`: cuda.pathfinder's
    find_library("dl")): the count waits up to 30 s for those to end, so that what it counts stays."""
    deadline = time.monotonic() + 30.0
    while True:
        every = [srv.proc.pid, *descendants(srv.proc.pid)]
        workers = set(descendants(srv.engine_pid()))
        helpers = [pid for w in workers for pid in descendants(w)]  # the workers' own children
        if not helpers or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return sum(rss_bytes(pid) for pid in every if pid not in workers), sorted(map(command_line, every))


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return f"{pid} (gone)"


def shm_regions() -> set[str]:
    return {p.name for p in Path("/dev/shm").iterdir()} if Path("/dev/shm").is_dir() else set()


def shm_mapped_outside(srv: Server) -> set[str]:
    """Regions that a process outside the server's tree maps (another server on the same machine)."""
    tree = {srv.proc.pid, *descendants(srv.proc.pid)}
    out: set[str] = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) in tree:
            continue
        try:
            maps = (d / "maps").read_text()
        except OSError:
            continue
        out.update(line.split("/dev/shm/", 1)[1].split()[0] for line in maps.splitlines() if "/dev/shm/" in line)
    return out


def kill_engine_and_recover(srv: Server, with_clients: bool) -> dict[str, Any]:
    """SIGKILL the engine process (with requests in flight on every interface); wait until it serves again."""
    clients = []
    if with_clients:
        clients = [Client("grpc stream", grpc_stream(srv)), Client("http generate_stream", http_stream(srv)),
                   Client("vllm proxy stream", vllm_stream(srv)), Client("unary proxy", unary(srv))]
        for c in clients:
            assert c.started.wait(60), f"{c.name} did not start"
        time.sleep(0.3)  # every request is in the engine
    pid = srv.engine_pid()
    assert pid is not None
    restarts = srv.metric("specguide_engine_restarts_total", model=MODEL)
    t_kill = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    alive = srv.wait_metric("specguide_engine_alive", 0.0, timeout=DEADLINE_S, model=MODEL)
    for c in clients:
        c.result(timeout=30)
    down = not_ready(srv)
    probes = (health_probe.main(["--url", srv.http]), health_probe.main(["--url", srv.http, "--liveness"]))
    while not_ready(srv):
        assert time.monotonic() - t_kill < RECOVERY_S, f"not serving {RECOVERY_S} s after the crash:\n{srv.log_tail()}"
        time.sleep(0.2)
    return {"clients": clients, "t_kill": t_kill, "down": down, "alive_while_down": alive, "probes_while_down": probes,
            "recovery_s": time.monotonic() - t_kill, "restarts": srv.metric("specguide_engine_restarts_total", model=MODEL) - restarts,
            "new_pid": srv.engine_pid(), "old_pid": pid}


def test_every_client_hears_of_an_engine_kill_at_once_and_the_engine_comes_back(crash):
    assert not not_ready(crash)
    stub = rss_bytes(crash.stubs()[MODEL])  # the stub that outlives the engine holds no model, no torch
    assert stub < 150 * 2**20 < 4 * stub < rss_bytes(crash.engine_pid()), (stub, rss_bytes(crash.engine_pid()))
    before = greedy(crash)
    got = kill_engine_and_recover(crash, with_clients=True)
    for c in got["clients"]:
        # the server log's tail goes with a failure: a vLLM-proxy stream once ended without the
        # error (docs/known-issues.md), and the log was gone before anyone looked
        assert c.error is not None and CAUSE in c.error, \
            f"{c.name}: {c.error!r} after {c.tokens} responses (finish {c.finish!r})\n{crash.log_tail(80)}"
        assert c.t_end - got["t_kill"] < DEADLINE_S, f"{c.name} heard after {c.t_end - got['t_kill']:.2f} s"
    assert got["down"] == list(health_probe.SERVED)  # readiness (a real inference) false while it restarts
    assert got["probes_while_down"] == (1, 0)  # the readiness probe fails; the liveness probe does not
    assert health_probe.main(["--url", crash.http]) == 0
    assert got["alive_while_down"] == 0.0
    assert got["restarts"] == 1 and got["new_pid"] not in (None, got["old_pid"])
    assert greedy(crash) == before  # the new engine answers as the old one did
    log = crash.log.read_text(errors="replace")
    assert "engine restarted in" in log and CAUSE in log
    print(f"recovered in {got['recovery_s']:.1f} s")


def test_crash_recover_cycles_leak_neither_memory_nor_shared_memory(crash):
    restarts = crash.metric("specguide_engine_restarts_total", model=MODEL)
    kill_engine_and_recover(crash, with_clients=False)
    greedy(crash)
    (rss1, procs1), shm1 = tree_rss(crash), shm_regions()
    times = []
    for _ in range(2):
        times.append(kill_engine_and_recover(crash, with_clients=False)["recovery_s"])
        greedy(crash)
    (rss3, procs3), shm3 = tree_rss(crash), shm_regions()
    assert rss3 <= 1.05 * rss1, f"RSS {rss1 / 2**20:.0f} MiB after the first cycle, {rss3 / 2**20:.0f} MiB after the third"
    assert len(procs3) == len(procs1), \
        f"processes in the server's tree after the first cycle: {procs1}; after the third: {procs3}"
    left = shm3 - shm1 - shm_mapped_outside(crash)  # new since the first cycle, and not another server's
    assert not left, f"shared-memory regions left by the restarts: {sorted(left)}"
    assert crash.metric("specguide_engine_restarts_total", model=MODEL) == restarts + 3
    print("recovery times (s):", ", ".join(f"{t:.1f}" for t in times))



def test_a_dead_engine_stub_restarts_the_server_under_the_supervisor(tmp_path):
    """The `specguide` stub itself dies (Triton never restarts a decoupled model's stub, and its
    requests would never end): `make serve`'s supervisor kills and restarts tritonserver, which
    closes every client's connection at once; then the server serves again by itself."""
    srv = launch(tmp_path / "server.log", ROOT / "model_repository", command="serve")
    try:
        before = greedy(srv)
        client = Client("grpc stream", grpc_stream(srv))
        assert client.started.wait(60)
        stubs = srv.stubs()
        regions = {Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[2].decode() for pid in stubs.values()}
        assert len(regions) == 3 and regions <= shm_regions()
        t_kill = time.monotonic()
        os.kill(stubs[MODEL], signal.SIGKILL)
        client.result(timeout=30)
        assert client.error is not None and client.t_end - t_kill < DEADLINE_S, (client.error, client.t_end - t_kill)
        while not_ready(srv):
            assert time.monotonic() - t_kill < 2 * RECOVERY_S, f"not serving after the restart:\n{srv.log_tail()}"
            time.sleep(0.5)
        assert greedy(srv) == before
        assert srv.metric("specguide_server_restarts_total", model=MODEL) == 1.0
        assert not (regions & shm_regions()), "the killed server's shared-memory regions were left behind"
        assert MODEL not in set(srv.stubs()) - set(stubs) and srv.stubs()[MODEL] != stubs[MODEL]
        log = srv.log.read_text(errors="replace")
        # the supervisor restarted it for the dead stub, or because Triton 2.51's Python backend
        # aborted tritonserver itself on the dead stub's shared-memory lock (boost lock_exception,
        # SIGABRT: seen once in a clean-clone CI run; docs/known-issues.md): either way, once
        assert (f"the Python backend stub of model '{MODEL}' died" in log
                or ("lock_exception" in log and "tritonserver exited with code -6" in log)), srv.log_tail()
        assert log.count("restarting tritonserver") == 1
        print(f"server back in {time.monotonic() - t_kill:.1f} s")
    finally:
        _stop(srv.proc)


def test_a_killed_tritonserver_leaves_no_stub_engine_or_worker_behind(tmp_path):
    """tritonserver itself dies (SIGKILL: the OOM killer, a fault, the supervisor restarting it for a
    proxy's dead stub): every process under it ends too. Triton 2.51's `specguide` stub never
    finished exiting then (its response thread waited forever inside a metric call to the dead
    server), so it, the engine process and its compile workers stayed, with the engine's memory,
    beside the server started again; the engine process now watches the server and ends them."""
    srv = launch(tmp_path / "server.log", ROOT / "model_repository")
    try:
        engine = srv.engine_pid()
        stubs = srv.stubs()
        tree = {pid: command_line(pid)[:120] for pid in descendants(srv.proc.pid)}
        assert len(stubs) == 3 and set(stubs.values()) <= set(tree) and engine in tree
        assert any(b"compile_worker" in Path(f"/proc/{p}/cmdline").read_bytes() for p in descendants(engine))
        t_kill = time.monotonic()
        srv.proc.kill()
        srv.proc.wait()  # reaped at once, as the supervisor or a container's init does
        while (left := {p: c for p, c in tree.items() if process_identity(p)}) and time.monotonic() - t_kill < 30:
            time.sleep(0.1)
        assert not left, f"still running {time.monotonic() - t_kill:.0f} s after tritonserver was killed: {left}"
        print(f"every process gone {time.monotonic() - t_kill:.2f} s after the kill")
    finally:
        _stop(srv.proc)
