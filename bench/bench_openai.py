"""Streaming chat through the OpenAI-compatible server vs the same requests over Triton gRPC directly.

    python bench/bench_openai.py [--requests 16] [--rounds 2] [--max-tokens 64] [--concurrency 1 8] [--json out.json]

Starts tritonserver (the `specguide` model alone) and `specguide.openai_api` beside it on free
ports, in one session as `make serve` runs them (with autogroup scheduling, CPU is shared between
sessions first; `--api-session client` starts the OpenAI server in this benchmark's session,
sharing the clients' slice, as the runs before cf63a6f did). Each request is the same chat
prompt (the model's template applied once, here, for the direct path), greedy, `ignore_eos` so
both paths generate exactly `--max-tokens` tokens. Per concurrency level, rounds alternate the
paths (drift hits them alike): the `openai` SDK with `stream=True`, and `tritonclient` gRPC
streaming (`client.common.GrpcStream`, its stream opened before the clock starts) to `specguide`.
A third path sends the OpenAI requests with a plain HTTP client (`http.client` on kept-alive
connections, as the SDK's pool keeps them; one `json.loads` per event). The clients run on the
same cores as the engine here: the SDK spends about as much CPU a token as `tritonclient`, the
plain client a third of that, so the two OpenAI rows split the server's cost from the client's.
TTFT = first content delta / first response; tokens/s = output tokens / wall time of a round. Every path
sends the same requests in the same order, so TTFTs pair up (same round, same job): the table gives
the median of the paired ratios and its 95% bootstrap interval.
The OpenAI server's resident memory is read after the runs, and its CPU time per token (it shares
the CPUs with the engine: on a small machine what it spends, the engine loses); likewise the
clients' (this process's) CPU time per token on each path.

Last, each OpenAI client's own floor: the same requests against a stand-in server that answers
every one at once with the events this server sends for such an answer (`--serve-canned`), the
stack stopped: the TTFT and stream time no server can take away from that client.
"""
from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import queue
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from bench_interfaces import Server, free_port  # noqa: E402  (bench/ is on sys.path when run as a script)
from machine import cpu_header, cpu_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from client.common import GrpcStream, chat_prompt, load_chat_template  # noqa: E402
from specguide.util.memory import rss_bytes  # noqa: E402

LABELS = {"triton": "Triton gRPC (tritonclient)", "openai": "OpenAI server (openai SDK)",
          "http": "OpenAI server (plain HTTP client)"}
QUESTIONS = ["Write a haiku about the sea.", "Explain photosynthesis briefly.", "List three primary colors.",
             "What is a prime number?", "Describe a cat.", "Give me a recipe idea."]


def wait(url: str, what: str, proc: subprocess.Popen, limit: float = 600) -> None:
    deadline = time.monotonic() + limit
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, f"{what} did not start"
        time.sleep(0.5)


class Stack:
    """tritonserver serving `specguide` (bench_interfaces.Server) + the OpenAI server, on free ports.
    `api_session` "server": the OpenAI server starts in tritonserver's session, as under `make serve`;
    "client": in this benchmark's, beside the clients (the layout of the runs before cf63a6f).
    `parameters`: config.pbtxt parameters to replace (bench_interfaces.Server)."""

    def __init__(self, api_session: str = "server", parameters: dict[str, str] | None = None) -> None:
        self.api, grpc = free_port(), free_port()
        # the served defaults (`make serve`: log level info, so uvicorn's access log a request)
        command = [sys.executable, "-m", "specguide.openai_api", "--triton-url", f"127.0.0.1:{grpc}", "--port",
                   str(self.api)]
        beside = {"openai": command} if api_session == "server" else None
        self.triton = Server(("specguide",), parameters=parameters, beside=beside, grpc=grpc)
        self.grpc, self.own = grpc, None
        if beside is None:
            self.own = subprocess.Popen(command, stdout=open(self.triton.dir / "openai.log", "wb"),
                                        stderr=subprocess.STDOUT)
        self.pid = self.own.pid if self.own else self.triton.beside_pid("specguide.openai_api")
        wait(f"http://127.0.0.1:{self.api}/health", "the OpenAI server", self.own or self.triton.proc, 60)

    def stop(self) -> None:
        if self.own is not None:
            self.own.terminate()
            self.own.wait(timeout=30)
        self.triton.stop()


def via_openai(client, question: str, max_tokens: int) -> tuple[float, int, float]:
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    for chunk in client.chat.completions.create(
            model="specguide", messages=[{"role": "user", "content": question}], max_tokens=max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].delta.content and ttft is None:
            ttft = time.perf_counter() - t0
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    return ttft or 0.0, tokens, time.perf_counter() - t0


_IDLE: dict[int, "queue.SimpleQueue[http.client.HTTPConnection]"] = {}  # by port: kept alive, as the SDK's pool


def _post(port: int, body: str) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse, float]:
    """POST /v1/chat/completions on a kept-alive connection (a new one if the server closed it)."""
    pool = _IDLE.setdefault(port, queue.SimpleQueue())
    while True:
        try:
            conn, reused = pool.get_nowait(), True
        except queue.Empty:
            conn, reused = http.client.HTTPConnection("127.0.0.1", port, timeout=600), False
        t0 = time.perf_counter()
        try:
            conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
            return conn, conn.getresponse(), t0
        except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
            conn.close()  # idle past the server's keep-alive timeout
            if not reused:
                raise


def via_http(port: int, question: str, max_tokens: int) -> tuple[float, int, float]:
    body = json.dumps({"model": "specguide", "messages": [{"role": "user", "content": question}],
                       "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}, "ignore_eos": True})
    conn, resp, t0 = _post(port, body)
    try:
        assert resp.status == 200, resp.read()
        ttft, tokens = None, 0
        for line in resp:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
        done = time.perf_counter()
        resp.read()  # the chunked body's end: the connection is ready for the next request
        _IDLE[port].put(conn)
        return ttft or 0.0, tokens, done - t0
    except BaseException:
        conn.close()
        raise


def via_triton(url: str, prompt: str, max_tokens: int) -> tuple[float, int, float]:
    stream = GrpcStream(url)
    try:
        t0 = time.perf_counter()
        ttft, tokens = None, 0
        params = json.dumps({"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
        for c in stream.generate({"text_input": prompt, "stream": True, "sampling_parameters": params,
                                  "return_num_output_tokens": True}):
            assert c.error is None, c.error
            if c.text and ttft is None:
                ttft = c.t - t0
            tokens += c.num_output_tokens or 0
        return ttft or 0.0, tokens, time.perf_counter() - t0
    finally:
        stream.close()


def canned_events(max_tokens: int) -> list[bytes]:
    """The SSE events of a streamed `max_tokens`-token chat answer with usage, as this server writes
    them (the role chunk with the first text, one chunk a token, the finish chunk with the last, usage
    with [DONE]), each as an HTTP/1.1 chunk."""
    head = {"id": "chatcmpl-0", "created": 0, "model": "specguide", "object": "chat.completion.chunk"}

    def sse(choices: list, **extra) -> str:
        return f"data: {json.dumps({**head, 'choices': choices, **extra})}\n\n"

    def chunk(delta: dict, reason=None) -> str:
        return sse([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}])
    writes = [chunk({"role": "assistant", "content": ""}) + chunk({"content": " word"})]
    writes += [chunk({"content": " word"}) for _ in range(max_tokens - 2)]
    writes += [chunk({"content": " word"}) + chunk({}, "length")]
    usage = {"prompt_tokens": 20, "completion_tokens": max_tokens, "total_tokens": 20 + max_tokens}
    writes += [sse([], usage=usage) + "data: [DONE]\n\n"]
    return [b"%x\r\n%s\r\n" % (len(w.encode()), w.encode()) for w in writes]


def serve_canned(port: int, max_tokens: int) -> None:
    """An HTTP/1.1 server on 127.0.0.1:`port` that answers every POST with `canned_events` at once
    (kept-alive connections, one write per event as this server makes them)."""
    events = canned_events(max_tokens)
    start = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                size = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                             if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(size)
                writer.write(start)
                for e in events:
                    writer.write(e)
                    await writer.drain()
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(answer, "127.0.0.1", port)
        async with server:
            await server.serve_forever()
    asyncio.run(main())


def client_floors(args: argparse.Namespace, qs: list[str]) -> dict[str, dict]:
    """TTFT and stream time of the two OpenAI clients against `serve_canned` (nothing else running)."""
    import openai

    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--serve-canned", str(port), "--max-tokens", str(args.max_tokens)])
    try:
        wait(f"http://127.0.0.1:{port}/v1/chat/completions", "the canned server", proc, 30)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        paths = {"openai": (via_openai, [(client, q, args.max_tokens) for q in qs]),
                 "http": (via_http, [(port, q, args.max_tokens) for q in qs])}
        for fn, jobs in paths.values():
            run_round(fn, jobs[:2], 1, proc.pid)  # warm
        rows = {}
        for c in args.concurrency:
            for p, (fn, jobs) in paths.items():
                res = [run_round(fn, jobs, c, proc.pid) for _ in range(args.rounds)]
                rows[f"{p}@{c}"] = {"ttft_p50_ms": 1000 * statistics.median(t for r in res for t in r["ttft"]),
                                    "stream_p50_ms": 1000 * statistics.median(t for r in res for t in r["stream"]),
                                    "client_cpu_ms_per_token": 1000 * sum(r["client_cpu"] for r in res)
                                    / max(sum(r["tokens"] for r in res), 1)}
        return rows
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def paired_ratio(a: list[float], b: list[float], draws: int = 4000, seed: int = 0) -> tuple[float, float, float]:
    """Median of a[i] / b[i] (the same request on two paths: same round, same job) and its 95%
    bootstrap interval (the pairs resampled)."""
    r = np.asarray(a) / np.asarray(b)
    boot = np.median(r[np.random.default_rng(seed).integers(0, len(r), (draws, len(r)))], axis=1)
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return float(np.median(r)), float(lo), float(hi)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_round(fn, jobs: list, concurrency: int, api_pid: int) -> dict:
    cpu0, own0, t0 = cpu_seconds(api_pid), time.process_time(), time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        res = list(pool.map(lambda j: fn(*j), jobs))
    wall = time.perf_counter() - t0
    return {"ttft": [r[0] for r in res], "tokens": sum(r[1] for r in res), "wall": wall,
            "stream": [r[2] for r in res], "api_cpu": cpu_seconds(api_pid) - cpu0,
            "client_cpu": time.process_time() - own0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16, help="per path per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--api-session", choices=("server", "client"), default="server",
                    help="the OpenAI server in tritonserver's session (as `make serve`) or in the clients'")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--serve-canned", type=int, metavar="PORT", help=argparse.SUPPRESS)  # client_floors' server
    args = ap.parse_args()
    if args.serve_canned:
        return serve_canned(args.serve_canned, args.max_tokens)
    print(cpu_header(), flush=True)
    import openai

    template = load_chat_template()
    stack = Stack(args.api_session)
    rows = {}
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{stack.api}/v1", api_key="unused", max_retries=0,
                               timeout=600)
        url = f"127.0.0.1:{stack.grpc}"
        qs = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.requests)]
        via_openai(client, qs[0], 8)  # warm the paths
        via_http(stack.api, qs[0], 8)
        via_triton(url, chat_prompt(template, qs[0]), 8)
        paths = {"openai": (via_openai, [(client, q, args.max_tokens) for q in qs]),
                 "http": (via_http, [(stack.api, q, args.max_tokens) for q in qs]),
                 "triton": (via_triton, [(url, chat_prompt(template, q), args.max_tokens) for q in qs])}
        for c in args.concurrency:
            agg = {p: {"ttft": [], "tokens": 0, "wall": 0.0, "api_cpu": 0.0, "client_cpu": 0.0} for p in paths}
            for r in range(args.rounds):
                for p in (list(paths) if r % 2 == 0 else list(paths)[::-1]):
                    fn, jobs = paths[p]
                    res = run_round(fn, jobs, c, stack.pid)
                    agg[p]["ttft"] += res["ttft"]
                    agg[p]["tokens"] += res["tokens"]
                    agg[p]["wall"] += res["wall"]
                    agg[p]["api_cpu"] += res["api_cpu"]
                    agg[p]["client_cpu"] += res["client_cpu"]
                    print(f"concurrency {c} round {r} {p}: {res['tokens'] / res['wall']:.1f} tok/s", flush=True)
            for p, a in agg.items():
                rows[f"{p}@{c}"] = {"ttft_p50_ms": 1000 * statistics.median(a["ttft"]), "ttft": a["ttft"],
                                    "tokens_per_s": a["tokens"] / a["wall"], "tokens": a["tokens"],
                                    "api_cpu_ms_per_token": 1000 * a["api_cpu"] / max(a["tokens"], 1),
                                    "client_cpu_ms_per_token": 1000 * a["client_cpu"] / max(a["tokens"], 1)}
        rss = rss_bytes(stack.pid) / 2**20
    finally:
        stack.stop()
    floors = client_floors(args, qs)
    print(f"\n{args.rounds} rounds x {args.requests} streamed chat requests per path, {args.max_tokens} greedy tokens each")
    print("| path | concurrency | TTFT p50 (ms) | TTFT / Triton's, same request: median (95% interval) | tokens/s "
          "| vs Triton gRPC | OpenAI server CPU (ms/token) | client CPU (ms/token) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for c in args.concurrency:
        base = rows[f"triton@{c}"]
        for p in ("triton", "openai", "http"):
            r = rows[f"{p}@{c}"]
            mid, lo, hi = paired_ratio(r["ttft"], base["ttft"])
            r["ttft_vs_triton_paired"] = [mid, lo, hi]
            print(f"| {LABELS[p]} | {c} | {r['ttft_p50_ms']:.1f} | {mid:.3f} ({lo:.3f}-{hi:.3f}) | "
                  f"{r['tokens_per_s']:.1f} | {r['tokens_per_s'] / base['tokens_per_s']:.3f} | "
                  f"{r['api_cpu_ms_per_token']:.2f} | {r['client_cpu_ms_per_token']:.2f} |")
    print(f"\nOpenAI server RSS after the runs: {rss:.0f} MiB")
    print("\nEach OpenAI client's own floor: the same requests against a server that answers at once (stack stopped)")
    print("| client | concurrency | TTFT p50 (ms) | whole stream p50 (ms) | client CPU (ms/token) |")
    print("| --- | --- | --- | --- | --- |")
    for c in args.concurrency:
        for p in ("openai", "http"):
            r = floors[f"{p}@{c}"]
            print(f"| {LABELS[p].split('(')[1].rstrip(')')} | {c} | {r['ttft_p50_ms']:.2f} | {r['stream_p50_ms']:.2f} | "
                  f"{r['client_cpu_ms_per_token']:.3f} |")
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_model(), "args": vars(args) | {"json": str(args.json)},
                                         "rows": rows, "openai_rss_mib": rss, "client_floors": floors}, indent=1))


if __name__ == "__main__":
    main()
