"""Prefix caching: TTFT and tokens/s with reuse on vs off, in one run.

    python bench/bench_prefix_cache.py [--requests 32] [--max-tokens 48] [--prefill-chunks 256,64]
        [--weight-dtype auto] [--llama-cpp] [--json out.json]

Workload "shared": N requests with one system prompt that carries a JSON schema (a held-out
JSONSchemaBench schema; the prompt is the issue's 300-600 tokens) and different user texts,
guided by that schema; batch 1 (one after another) and batch 8 (all submitted together).
Workload "distinct": the same requests, each system prompt starting with its own job number (no
shared prefix beyond the chat template's first tokens): reuse must not cost anything there. Every "on" run's tokens are checked against
the "off" run's (identical: reuse is exact).

`--llama-cpp`: the peer, llama-cpp-python on the same GGUF, batch 1 (it serves one sequence), the
shared workload's prompts with the schema as its grammar. "on" is its prompt cache (the server's `cache_prompt`:
a request evaluates only the tokens past the longest prefix it shares with the previous one); "off"
resets it before each request. The shared workload only (see the NOTE in main).
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend_src"))

from specguide.config import EngineConfig  # noqa: E402
from specguide.engine.loop import Engine  # noqa: E402
from specguide.request import GuidedDecodingParams, Request, SamplingParams  # noqa: E402
from specguide.training.prompts import load_schemas  # noqa: E402
from machine import cpu_header  # noqa: E402  (bench/ is on sys.path when run as a script)

NAMES = ["Alice", "Bob", "Carol", "Dan", "Eve", "Frank", "Grace", "Heidi"]
CITIES = ["Paris", "Lyon", "Berlin", "Oslo", "Madrid", "Rome", "Vienna", "Prague"]


def workload(engine: Engine, n: int, shared: bool, max_tokens: int) -> list[Request]:
    schemas = [s for s in load_schemas("heldout", engine.core.compiler) if 900 <= len(s) <= 2200]
    reqs = []
    for i in range(n):
        schema = schemas[0] if shared else schemas[i % len(schemas)]
        job = "" if shared else f"Job {i}. "  # distinct: the prompts part within a few tokens
        system = f"{job}Extract the record as one JSON object following this JSON schema, nothing else: {schema}"
        user = f"Record {i}: {NAMES[i % 8]} is {20 + i} years old and lives in {CITIES[(i * 3) % 8]}."
        prompt = engine.tokenizer.apply_chat_template([{"role": "system", "content": system},
                                                       {"role": "user", "content": user}])
        reqs.append(Request(prompt=prompt, guided=GuidedDecodingParams("json_schema", schema),
                            params=SamplingParams(max_tokens=max_tokens, temperature=0.0)))
    return reqs


def run(engine: Engine, reqs: list[Request], batch: int) -> dict:
    """Submit `batch` at a time; TTFT p50 (submit -> first token) and tokens/s over the wall time."""
    ttft, tokens, outs = [], 0, []
    t0 = time.perf_counter()
    for start in range(0, len(reqs), batch):
        group = reqs[start: start + batch]
        done = threading.Semaphore(0)
        results: list[list[int]] = [[] for _ in group]
        sent = [0.0] * len(group)
        first = [0.0] * len(group)

        def cb(out, i):
            if out.token_ids and not first[i]:
                first[i] = time.perf_counter()
            results[i].extend(out.token_ids)
            if out.finished:
                done.release()
        for i, r in enumerate(group):
            sent[i] = time.perf_counter()
            engine.submit(r, lambda o, i=i: cb(o, i))
        for _ in group:
            done.acquire()
        ttft += [f - s for f, s in zip(first, sent)]
        tokens += sum(len(x) for x in results)
        outs += results
    wall = time.perf_counter() - t0
    return {"ttft_p50_s": round(median(ttft), 4), "tok_s": round(tokens / wall, 1), "outputs": outs}


def llama_cpp_rows(reqs: list[Request], max_tokens: int, shared: bool) -> dict:
    """The peer on one workload: TTFT p50 and tokens/s with its prompt cache on and off (batch 1)."""
    from llama_cpp import Llama, LlamaGrammar

    from specguide.models.default_model import default_gguf_path

    llm = Llama(model_path=str(default_gguf_path()), n_ctx=2048, n_threads=2, verbose=False, seed=0)
    grammars = {}
    res = {}
    for on in (False, True):
        ttft, tokens, outs = [], 0, []
        llm.reset()
        t0 = time.perf_counter()
        for r in reqs:
            if r.guided.guide not in grammars:
                grammars[r.guided.guide] = LlamaGrammar.from_json_schema(r.guided.guide, verbose=False)
            if not on:
                llm.reset()  # nothing kept: every prompt evaluated in full
            sent, first, text = time.perf_counter(), 0.0, []
            for chunk in llm.create_completion(r.prompt, max_tokens=max_tokens, temperature=0.0,
                                               grammar=grammars[r.guided.guide], stream=True):
                first = first or time.perf_counter()
                text.append(chunk["choices"][0]["text"])
                tokens += 1  # one streamed chunk per generated token
            ttft.append(first - sent)
            outs.append("".join(text))
        res[on] = dict(ttft=round(median(ttft), 4), tok_s=round(tokens / (time.perf_counter() - t0), 1), outs=outs)
    return dict(engine="llama.cpp (Q4_1, cache_prompt)", workload="shared" if shared else "distinct", batch=1,
                ttft_off=res[False]["ttft"], ttft_on=res[True]["ttft"],
                ttft_ratio=round(res[True]["ttft"] / res[False]["ttft"], 3), tok_s_off=res[False]["tok_s"],
                tok_s_on=res[True]["tok_s"], tok_s_ratio=round(res[True]["tok_s"] / res[False]["tok_s"], 3),
                identical=res[True]["outs"] == res[False]["outs"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prefill-chunks", default="256,64")
    ap.add_argument("--weight-dtype", default="auto")
    ap.add_argument("--llama-cpp", action="store_true", help="also llama-cpp-python with its prompt cache on / off")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    print(cpu_header(), flush=True)
    rows = []
    chunks = [int(c) for c in args.prefill_chunks.split(",")] if args.prefill_chunks else []
    for chunk in chunks:
        engines = {on: Engine(EngineConfig(max_slots=8, max_seq_len=2048, prefill_chunk=chunk, num_draft_tokens=0,
                                           weight_dtype=args.weight_dtype, prefix_caching=on)) for on in (False, True)}
        try:
            for shared in (True, False):
                for batch in (1, 8):
                    res = {}
                    for on, eng in engines.items():
                        reqs = workload(eng, args.requests, shared, args.max_tokens)
                        run(eng, reqs[:2], 1)  # warm: the first prompt's chunks are cached for "on"
                        res[on] = run(eng, reqs, batch)
                    row = dict(prefill_chunk=chunk, workload="shared" if shared else "distinct", batch=batch,
                               ttft_off=res[False]["ttft_p50_s"], ttft_on=res[True]["ttft_p50_s"],
                               ttft_ratio=round(res[True]["ttft_p50_s"] / res[False]["ttft_p50_s"], 3),
                               tok_s_off=res[False]["tok_s"], tok_s_on=res[True]["tok_s"],
                               tok_s_ratio=round(res[True]["tok_s"] / res[False]["tok_s"], 3),
                               identical=res[True]["outputs"] == res[False]["outputs"])
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        finally:
            for eng in engines.values():
                eng.shutdown()
    if args.llama_cpp:
        eng = Engine(EngineConfig(max_slots=1, max_seq_len=2048, warmup=False))  # its tokenizer and schemas
        try:  # NOTE: the shared workload only: some "distinct" schemas give llama.cpp a grammar that it
            # cannot parse ("number of rules ... exceeds sane defaults"), and its sampler then segfaults
            reqs = workload(eng, args.requests, True, args.max_tokens)
        finally:
            eng.shutdown()
        rows.append(llama_cpp_rows(reqs, args.max_tokens, True))
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
