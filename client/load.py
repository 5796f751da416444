"""Load client: N concurrent users streaming over gRPC; reports genai-perf's LLM metrics.

    python -m client.load --concurrency 8 --requests 32 --max-tokens 64
    python -m client.load --concurrency 4 --prompts-file prompts.txt --chat --json results.json

Each user owns one gRPC stream and sends its next request when the previous one finished.
Definitions (as genai-perf):
  time to first token   request sent -> first response with text
  inter-token latency   gap between consecutive responses / tokens in the later one
  request latency       request sent -> final response
  output tokens/s       all generated tokens / benchmark duration (and per user: 1 / mean ITL)
Token counts are the server's `num_output_tokens` (exact) rather than a client-side re-tokenization.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from client.common import MODEL, GrpcStream, chat_prompt, load_tokenizer

DEFAULT_PROMPTS = [
    "Explain in two sentences why the sky is blue.",
    "Write a short poem about a lighthouse.",
    "List three uses of a paperclip.",
    "What is the boiling point of water at sea level?",
    "Describe a cat to someone who has never seen one.",
    "Give me a recipe for a simple tomato sauce.",
    "Why do leaves change colour in autumn?",
    "Summarize the plot of a heist movie in one paragraph.",
]


@dataclass
class RequestRecord:
    t_send: float
    ttft: Optional[float] = None
    latency: Optional[float] = None
    output_tokens: int = 0
    input_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: Optional[str] = None


def run_request(stream: GrpcStream, values: dict, timeout: float) -> RequestRecord:
    rec = RequestRecord(t_send=time.perf_counter())
    t_prev = None
    for c in stream.generate(values, timeout=timeout):
        if c.error is not None:
            rec.error = c.error
            break
        n = c.num_output_tokens if c.num_output_tokens is not None else len(c.token_ids)
        if c.num_input_tokens is not None:
            rec.input_tokens = c.num_input_tokens
        if n > 0:
            if t_prev is None:
                rec.ttft = c.t - rec.t_send
            else:
                rec.itl.append((c.t - t_prev) / n)
            t_prev = c.t
            rec.output_tokens += n
        if c.final:
            rec.latency = c.t - rec.t_send
    return rec


def stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    v = sorted(values)

    def pct(p):
        return v[min(len(v) - 1, int(round(p / 100 * (len(v) - 1))))]

    return {"avg": statistics.fmean(v), "min": v[0], "p50": pct(50), "p90": pct(90), "p99": pct(99), "max": v[-1]}


def summarize(records: list[RequestRecord], duration: float, concurrency: int) -> dict:
    ok = [r for r in records if r.error is None and r.latency is not None]
    out_tokens = sum(r.output_tokens for r in ok)
    per_user = [1.0 / statistics.fmean(r.itl) for r in ok if r.itl and statistics.fmean(r.itl) > 0]
    return {
        "concurrency": concurrency,
        "requests": len(records),
        "errors": len(records) - len(ok),
        "duration_s": duration,
        "time_to_first_token_ms": {k: v * 1e3 for k, v in stats([r.ttft for r in ok if r.ttft is not None]).items()},
        "inter_token_latency_ms": {k: v * 1e3 for k, v in stats([x for r in ok for x in r.itl]).items()},
        "request_latency_ms": {k: v * 1e3 for k, v in stats([r.latency for r in ok]).items()},
        "output_sequence_length": stats([float(r.output_tokens) for r in ok]),
        "input_sequence_length": stats([float(r.input_tokens) for r in ok]),
        "output_token_throughput_per_s": out_tokens / duration if duration > 0 else 0.0,
        "output_token_throughput_per_user_per_s": stats(per_user),
        "request_throughput_per_s": len(ok) / duration if duration > 0 else 0.0,
        "first_error": next((r.error for r in records if r.error), None),
    }


def run_load(url: str, model: str, prompts: list[str], concurrency: int, num_requests: int, base: dict,
             timeout: float = 600.0) -> dict:
    records: list[RequestRecord] = []
    lock = threading.Lock()
    counter = iter(range(num_requests))

    def user(uid: int) -> None:
        stream = GrpcStream(url, model)
        try:
            while True:
                with lock:
                    i = next(counter, None)
                if i is None:
                    return
                rec = run_request(stream, {**base, "text_input": prompts[i % len(prompts)]}, timeout)
                with lock:
                    records.append(rec)
        finally:
            stream.close()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=user, args=(u,), daemon=True) for u in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return summarize(records, time.perf_counter() - t0, concurrency)


def format_report(r: dict) -> str:
    lines = [f"concurrency {r['concurrency']}  requests {r['requests']}  errors {r['errors']}  duration {r['duration_s']:.2f} s"]
    rows = [("time to first token (ms)", r["time_to_first_token_ms"]), ("inter-token latency (ms)", r["inter_token_latency_ms"]),
            ("request latency (ms)", r["request_latency_ms"]), ("output sequence length", r["output_sequence_length"]),
            ("input sequence length", r["input_sequence_length"]),
            ("output tokens/s per user", r["output_token_throughput_per_user_per_s"])]
    lines.append(f"{'metric':<28}{'avg':>10}{'min':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'max':>10}")
    for name, s in rows:
        if s:
            lines.append(f"{name:<28}" + "".join(f"{s[k]:>10.2f}" for k in ("avg", "min", "p50", "p90", "p99", "max")))
    lines.append(f"output token throughput: {r['output_token_throughput_per_s']:.2f} tokens/s")
    lines.append(f"request throughput:      {r['request_throughput_per_s']:.3f} requests/s")
    if r["first_error"]:
        lines.append(f"first error: {r['first_error']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m client.load", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="localhost:8001", help="gRPC host:port")
    p.add_argument("--model", default=MODEL)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--requests", type=int, default=None, help="total requests (default 4 per user)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens (vLLM sampling_parameters)")
    p.add_argument("--temperature", type=float)
    p.add_argument("--num-draft-tokens", type=int)
    p.add_argument("--prompt", action="append", help="a prompt (repeatable); default: built-in prompts")
    p.add_argument("--prompts-file", help="one prompt per line")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--tokenizer", help="tokenizer folder for --chat")
    p.add_argument("--warmup", type=int, default=1, help="requests sent before measuring")
    p.add_argument("--json", help="also write the report as JSON here")
    a = p.parse_args(argv)

    prompts = a.prompt or (Path(a.prompts_file).read_text().splitlines() if a.prompts_file else DEFAULT_PROMPTS)
    prompts = [x for x in prompts if x.strip()]
    if a.chat:
        tok = load_tokenizer(a.tokenizer)
        prompts = [chat_prompt(tok, x) for x in prompts]
    base = {"max_tokens": a.max_tokens, "stream": True, "exclude_input_in_output": True,
            "return_num_input_tokens": True, "return_num_output_tokens": True}
    if a.temperature is not None:
        base["temperature"] = a.temperature
    if a.num_draft_tokens is not None:
        base["num_draft_tokens"] = a.num_draft_tokens
    if a.ignore_eos:
        base["sampling_parameters"] = json.dumps({"ignore_eos": True, "max_tokens": a.max_tokens, "temperature": 0.0})
    if a.warmup > 0:
        run_load(a.url, a.model, prompts, 1, a.warmup, base)
    report = run_load(a.url, a.model, prompts, a.concurrency, a.requests or 4 * a.concurrency, base)
    print(format_report(report))
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
