"""The three served names side by side: TTFT and tokens/s through each, and the memory they cost.

    python bench/bench_interfaces.py [--requests 24] [--concurrency 4] [--max-tokens 64] [--json out.json]

Starts tritonserver twice on free ports: once with `specguide` alone, once with all three names
(`specguide`, `specguide_unary`, `specguide_vllm`), and reads the resident memory of the server
and its Python backend stubs after a warm-up. On the three-name server it sends the same greedy
requests through each name in alternating rounds (so drift hits every name alike): gRPC streaming
for `specguide` and `specguide_vllm` (TTFT = first response), gRPC `infer()` for `specguide_unary`
(its TTFT is its whole latency: one response). tokens/s = output tokens / wall time of a round.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
from machine import cpu_header, cpu_model  # noqa: E402  (bench/ is on sys.path when run as a script)

ROOT = Path(__file__).resolve().parents[1]
NAMES = ("specguide", "specguide_unary", "specguide_vllm")
PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "The three laws of robotics are",
           "My favourite season is", "def fibonacci(n):", "List three primary colors:"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> dict[str, float]:
    """The server's and each stub's resident memory, by process (stubs by model name)."""
    def rss(p: int) -> float:
        return next(int(ln.split()[1]) for ln in Path(f"/proc/{p}/status").read_text().splitlines()
                    if ln.startswith("VmRSS:")) / 1024
    out = {"tritonserver": rss(pid)}
    from specguide.process.supervisor import descendants

    for child in descendants(pid):
        cmd = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        if b"triton_python_backend_stub" in cmd[0]:
            out["stub:" + Path(cmd[1].decode()).parents[1].name] = rss(int(child))
        elif b"engine_process" in b" ".join(cmd):
            out["engine process"] = rss(int(child))
    return out


class Server:
    """tritonserver on free ports over a copy of the named models; `parameters` (config.pbtxt
    parameters present in the copies, e.g. {"gil_switch_interval_ms": "0"}) replace theirs;
    `grpc`: its gRPC port (default: a free one). `beside`: commands started in its session (a
    session of its own, which `make serve` also gives tritonserver and the OpenAI server), their
    output in `<name>.log`; they stop with it.
    NOTE: with autogroup scheduling CPU is shared between sessions first: a server process started
    in the benchmark's own session would share the clients' slice, as no deployed server does."""

    def __init__(self, names: tuple[str, ...], parameters: dict[str, str] | None = None,
                 beside: dict[str, list[str]] | None = None, grpc: int | None = None):
        self.dir, self.names = Path(tempfile.mkdtemp(prefix="specguide-bench-")), names
        for n in names:
            shutil.copytree(ROOT / "model_repository" / n, self.dir / n)
            pbtxt = self.dir / n / "config.pbtxt"
            text = pbtxt.read_text()
            for key, value in (parameters or {}).items():
                text, found = re.subn(r'(key: "%s"\s*value: \{ string_value: ")[^"]*' % re.escape(key),
                                      lambda m: m.group(1) + value, text)
                assert found == 1, f"{n}/config.pbtxt has no parameter {key!r}"
            pbtxt.write_text(text)
        self.http, self.grpc, self.metrics = free_port(), grpc or free_port(), free_port()
        env = {**os.environ, "MODEL_REPOSITORY": str(self.dir), "TRITON_HTTP_PORT": str(self.http),
               "TRITON_GRPC_PORT": str(self.grpc), "TRITON_METRICS_PORT": str(self.metrics)}
        self.log = open(self.dir / "server.log", "wb")
        command = [sys.executable, str(ROOT / "scripts" / "tritonserver.py"), "run"]
        if beside:  # a shell starts them, then becomes tritonserver (proc.pid stays the server's)
            starts = "".join(f"{shlex.join(c)} >{shlex.quote(str(self.dir / (n + '.log')))} 2>&1 & "
                             for n, c in beside.items())
            command = ["bash", "-c", f"{starts}exec {shlex.join(command)}"]
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        deadline = time.monotonic() + 600
        while not self._ready():
            assert self.proc.poll() is None and time.monotonic() < deadline, "server did not start"
            time.sleep(0.5)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def beside_pid(self, fragment: str) -> int:
        """The pid of the process started beside tritonserver whose command line holds `fragment`."""
        from specguide.process.supervisor import descendants

        return next(int(c) for c in descendants(self.proc.pid)
                    if fragment.encode() in Path(f"/proc/{c}/cmdline").read_bytes())

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        finally:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            keep = Path(tempfile.gettempdir()) / f"bench_interfaces_{len(self.names)}names_server.log"
            shutil.copy(self.dir / "server.log", keep)  # kept for a post-mortem
            shutil.rmtree(self.dir, ignore_errors=True)


def _inputs(name: str, prompt: str, max_tokens: int) -> tuple[list, bool]:
    def t(n, arr, dt):
        x = grpcclient.InferInput(n, list(arr.shape), dt)
        x.set_data_from_numpy(arr)
        return x
    if name == "specguide_vllm":
        sp = json.dumps({"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
        return [t("text_input", np.array([prompt.encode()], np.object_), "BYTES"),
                t("stream", np.array([True]), "BOOL"),
                t("sampling_parameters", np.array([sp.encode()], np.object_), "BYTES"),
                t("return_num_output_tokens", np.array([True]), "BOOL")], True
    sp = json.dumps({"ignore_eos": True})  # every name generates exactly max_tokens
    ins = [t("text_input", np.array([[prompt.encode()]], np.object_), "BYTES"),
           t("max_tokens", np.array([[max_tokens]], np.int32), "INT32"),
           t("temperature", np.array([[0.0]], np.float32), "FP32"),
           t("sampling_parameters", np.array([[sp.encode()]], np.object_), "BYTES"),
           t("exclude_input_in_output", np.array([[True]]), "BOOL"),
           t("return_num_output_tokens", np.array([[True]]), "BOOL")]
    stream = name == "specguide"
    if stream:
        ins.append(t("stream", np.array([[True]]), "BOOL"))
    return ins, stream


def one_request(url: str, name: str, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    """(ttft, latency, output tokens) of one request."""
    client = grpcclient.InferenceServerClient(url)
    inputs, stream = _inputs(name, prompt, max_tokens)
    t0 = time.perf_counter()
    try:
        if name == "specguide_unary":
            r = client.infer(name, inputs)
            t = time.perf_counter() - t0
            return t, t, int(r.as_numpy("num_output_tokens").reshape(-1)[0])
        q: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: q.put((result, error, time.perf_counter())))
        client.async_stream_infer(name, inputs, enable_empty_final_response=True)
        ttft, n = None, 0
        while True:
            result, error, t = q.get(timeout=600)
            assert error is None, error
            resp = result.get_response()
            if resp.outputs:
                n += int(result.as_numpy("num_output_tokens").reshape(-1)[0])
                ttft = ttft if ttft is not None else t - t0
            if resp.parameters["triton_final_response"].bool_param:
                client.stop_stream()
                return ttft, t - t0, n
    finally:
        client.close()


def run_round(url: str, name: str, n: int, concurrency: int, max_tokens: int) -> dict:
    jobs: queue.Queue = queue.Queue()
    for i in range(n):
        jobs.put(PROMPTS[i % len(PROMPTS)])
    results, lock = [], threading.Lock()

    def worker():
        while True:
            try:
                p = jobs.get_nowait()
            except queue.Empty:
                return
            r = one_request(url, name, p, max_tokens)
            with lock:
                results.append(r)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    return {"ttft": [r[0] for r in results], "latency": [r[1] for r in results],
            "tokens": sum(r[2] for r in results), "wall": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=24, help="per name per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    print(cpu_header(), flush=True)

    mem = {}
    for names in (("specguide",), NAMES):
        srv = Server(names)
        try:
            url = f"127.0.0.1:{srv.grpc}"
            for name in names:  # warm every name once
                one_request(url, name, PROMPTS[0], 8)
            mem[len(names)] = rss_mib(srv.proc.pid)
            if len(names) == 1:
                continue
            agg = {n: {"ttft": [], "latency": [], "tokens": 0, "wall": 0.0} for n in names}
            for r in range(args.rounds):
                for name in (names if r % 2 == 0 else names[::-1]):
                    res = run_round(url, name, args.requests, args.concurrency, args.max_tokens)
                    a = agg[name]
                    a["ttft"] += res["ttft"]
                    a["latency"] += res["latency"]
                    a["tokens"] += res["tokens"]
                    a["wall"] += res["wall"]
                    print(f"round {r} {name}: {res['tokens'] / res['wall']:.1f} tok/s", flush=True)
        finally:
            srv.stop()

    base = agg["specguide"]
    base_tps = base["tokens"] / base["wall"]
    print(f"\n{args.rounds} rounds x {args.requests} requests per name, concurrency {args.concurrency}, "
          f"{args.max_tokens} greedy tokens each")
    print("| name | TTFT p50 (ms) | latency p50 (ms) | tokens/s | vs specguide |")
    print("| --- | --- | --- | --- | --- |")
    rows = {}
    for name in NAMES:
        a = agg[name]
        tps = a["tokens"] / a["wall"]
        rows[name] = {"ttft_p50_ms": 1000 * statistics.median(a["ttft"]),
                      "latency_p50_ms": 1000 * statistics.median(a["latency"]), "tokens_per_s": tps,
                      "ratio": tps / base_tps}
        r = rows[name]
        print(f"| {name} | {r['ttft_p50_ms']:.0f} | {r['latency_p50_ms']:.0f} | {tps:.1f} | {r['ratio']:.3f} |")
    one, three = sum(mem[1].values()), sum(mem[3].values())
    print(f"\nRSS (MiB) one name: {json.dumps({k: round(v) for k, v in mem[1].items()})} = {one:.0f}")
    print(f"RSS (MiB) three names: {json.dumps({k: round(v) for k, v in mem[3].items()})} = {three:.0f}")
    print(f"the two extra names add {three - one:.0f} MiB")
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_model(), "args": vars(args) | {"json": str(args.json)},
                                         "rows": rows, "rss_mib": mem}, indent=1))


if __name__ == "__main__":
    main()
