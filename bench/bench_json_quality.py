"""Generation quality of structured output (issue 33): do JSON answers validate within their budget?

    python bench/bench_json_quality.py [--schemas 24] [--max-tokens 384] [--modes allow/off,forbid/off,forbid/on]
        [--llama-cpp]

The served engine (model_repository/specguide/config.pbtxt: the default model, its drafter and
every served setting) answers JSON-mode chat prompts, each showing its JSON schema (the held-out
JSONSchemaBench dev schemas that no test and no draft-head training uses), greedy, one request
after another, the schema as the request's json_schema guide. Per mode, side by side in one run:
  * valid: the answer parses and validates against the request's schema (jsonschema, formats checked)
  * cut: the answer ran to max_tokens (finish reason "length"), so it is cut-off JSON
  * refused: the request got an error up front
  * tokens per step (generated tokens after the first / decode steps) and tokens/s (wall time)
A mode is KEYS/BUDGET: KEYS `allow` (undeclared keys allowed: JSON Schema's reading) or `forbid`
(declared keys only: the served default); BUDGET `on` (the answer closes within max_tokens: the
served default, guided/budget.py) or `off` (cut at max_tokens). `--llama-cpp`: llama-cpp-python on the same GGUF, the schema through its
LlamaGrammar (llama.cpp generates declared keys only), the same prompts and max_tokens.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "backend_src"))
sys.path.insert(0, str(ROOT / "bench"))

from machine import cpu_header  # noqa: E402

from specguide.config import EngineConfig  # noqa: E402
from specguide.engine.loop import Engine  # noqa: E402
from specguide.guided.value_check import make_validator  # noqa: E402
from specguide.request import GuidedDecodingParams, Request, SamplingParams  # noqa: E402
from specguide.training.prompts import load_schemas, schema_message  # noqa: E402
from specguide.triton.interfaces import engine_parameters  # noqa: E402


def verdict(text: str, schema: dict) -> str:
    """'valid', 'invalid' (parses, fails the schema) or 'unparsed'."""
    try:
        doc = json.loads(text)
    except ValueError:
        return "unparsed"
    return "valid" if make_validator(schema).is_valid(doc) else "invalid"


def generate(engine: Engine, req: Request) -> tuple[list[int], str, object, float]:
    """(tokens, text, final event, seconds) of one request."""
    toks, parts, final = [], [], []
    done = threading.Event()

    def cb(o):
        toks.extend(o.token_ids)
        parts.append(o.text)
        if o.finished:
            final.append(o)
            done.set()
    t0 = time.perf_counter()
    engine.submit(req, cb)
    done.wait()
    return toks, "".join(parts), final[0], time.perf_counter() - t0


def run_mode(engine: Engine, prompts: list[tuple[str, str]], mode: str, max_tokens: int) -> dict:
    rows = []
    keys, budget = mode.split("/")
    for prompt, schema in prompts:
        guide = GuidedDecodingParams("json_schema", schema, undeclared_keys=keys, complete_within_budget=budget == "on")
        req = Request(prompt=prompt, params=SamplingParams(max_tokens=max_tokens, temperature=0.0), guided=guide)
        toks, text, final, dt = generate(engine, req)
        if final.error:
            rows.append(dict(outcome="refused", error=final.error, tokens=0, seconds=dt, steps=0))
            continue
        steps = final.num_output_tokens - 1 - final.total_accepted_draft_tokens
        rows.append(dict(outcome=verdict(text, json.loads(schema)), finish=final.finish_reason, tokens=len(toks),
                         seconds=dt, steps=steps, text=text))
    return summarize(mode, rows)


def summarize(mode: str, rows: list[dict]) -> dict:
    n = len(rows)
    toks = sum(r["tokens"] for r in rows)
    steps = sum(r["steps"] for r in rows)
    secs = sum(r["seconds"] for r in rows)
    return dict(mode=mode, n=n, valid=sum(r["outcome"] == "valid" for r in rows),
                cut=sum(r.get("finish") == "length" for r in rows), refused=sum(r["outcome"] == "refused" for r in rows),
                invalid_complete=sum(r["outcome"] != "valid" and r.get("finish") == "stop" for r in rows),
                tokens=toks, tokens_per_step=round((toks - n) / steps, 3) if steps else None,
                tok_s=round(toks / secs, 1) if secs else None, rows=rows)


LLAMA_CHILD = """
import json, sys, time
from llama_cpp import Llama, LlamaGrammar
from specguide.models.default_model import default_gguf_path
prompt, schema, max_tokens = json.loads(sys.stdin.read())
llm = Llama(model_path=str(default_gguf_path()), n_ctx=2048, n_threads=2, verbose=False, seed=0)
grammar = LlamaGrammar.from_json_schema(schema, verbose=False)
t0 = time.perf_counter()
out = llm.create_completion(prompt, max_tokens=max_tokens, temperature=0.0, grammar=grammar)
print(json.dumps(dict(text=out["choices"][0]["text"], finish=out["choices"][0]["finish_reason"],
                      tokens=out["usage"]["completion_tokens"], seconds=time.perf_counter() - t0)))
"""


def llama_cpp(prompts: list[tuple[str, str]], max_tokens: int) -> dict:
    """llama-cpp-python on the same GGUF, one process per schema: its grammar sampler crashes on some
    schemas (a segfault counts as refused, like a converter error)."""
    import subprocess

    rows = []
    for prompt, schema in prompts:
        p = subprocess.run([sys.executable, "-c", LLAMA_CHILD], input=json.dumps([prompt, schema, max_tokens]),
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "backend_src")})
        if p.returncode != 0:
            rows.append(dict(outcome="refused", error=p.stderr[-300:], tokens=0, seconds=0.0, steps=0))
            continue
        out = json.loads(p.stdout.strip().splitlines()[-1])
        rows.append(dict(outcome=verdict(out["text"], json.loads(schema)), finish=out["finish"], tokens=out["tokens"],
                         seconds=out["seconds"], steps=max(out["tokens"] - 1, 0), text=out["text"]))
    return summarize("llama.cpp (declared keys)", rows)


def row(r: dict) -> None:
    print(f"| {r['mode']} | {r['valid']}/{r['n']} ({100 * r['valid'] / r['n']:.0f}%) | {r['cut']} | {r['refused']} "
          f"| {r['invalid_complete']} | {r['tokens']} | {r['tokens_per_step']} | {r['tok_s']} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schemas", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--modes", default="allow/off,forbid/off,forbid/on")
    ap.add_argument("--llama-cpp", action="store_true")
    ap.add_argument("--kv-cache-dtype", default="", help="instead of the served kv_cache_dtype (e.g. int8)")
    ap.add_argument("--json", help="write every answer here")
    args = ap.parse_args()
    print(cpu_header(), time.strftime("%Y-%m-%d"), flush=True)
    config = EngineConfig.from_parameters(engine_parameters(ROOT / "model_repository"))
    if args.kv_cache_dtype:
        config = dataclasses.replace(config, kv_cache_dtype=args.kv_cache_dtype)
    engine = Engine(config)
    try:
        print(f"engine: drafter {engine.core.drafter}, K={config.num_draft_tokens}, weight_dtype {config.weight_dtype}, "
              f"kv_cache_dtype {config.kv_cache_dtype}", flush=True)
        prompts = [(engine.tokenizer.apply_chat_template([{"role": "user", "content": schema_message(s)}]), s)
                   for s in load_schemas("heldout", engine.core.compiler)[: args.schemas]]
        print(f"{len(prompts)} held-out schemas, max_tokens {args.max_tokens}, greedy, batch 1\n")
        print("| mode | valid | cut at max_tokens | refused | complete but invalid | tokens | tokens per step | tok/s |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
        results = []
        for mode in args.modes.split(","):
            results.append(run_mode(engine, prompts, mode, args.max_tokens))
            row(results[-1])
    finally:
        engine.shutdown()
    if args.llama_cpp:
        results.append(llama_cpp(prompts, args.max_tokens))
        row(results[-1])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
