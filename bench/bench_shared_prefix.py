"""Issue 77's prefix-sharing goal: `--requests` requests whose prompts start with one ~`--prefix`-token
system prompt (JSON schemas to extract against) and end with their own short record, sent at once.
Prefix sharing on vs off, side by side in one run (an engine each, the served defaults otherwise):
TTFT p50 and longest; when the most requests ran at once (sampled every 2 ms), the KV blocks held
(a shared one once) and the table entries pointing at them (a shared one once per request); each
request's tokens checked equal between the two. "cold": nothing cached before; "warm": one request with
the prefix ran to its end first (its blocks cached).

    python bench/bench_shared_prefix.py [--requests 16] [--prefix 1500] [--max-tokens 64]

Goals (issue 77): the prefix's blocks held once (blocks at the peak ~ one prefix plus each
request's own); TTFT p50 with sharing <= 0.2x without.
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend_src"))

from specguide.config import EngineConfig  # noqa: E402
from specguide.engine.block_pool import BLOCK  # noqa: E402
from specguide.engine.loop import Engine  # noqa: E402
from specguide.request import Request, SamplingParams  # noqa: E402
from specguide.training.prompts import load_schemas  # noqa: E402
from machine import cpu_header  # noqa: E402  (bench/ is on sys.path when run as a script)

NAMES = ["Alice", "Bob", "Carol", "Dan", "Eve", "Frank", "Grace", "Heidi"]
CITIES = ["Paris", "Lyon", "Berlin", "Oslo", "Madrid", "Rome", "Vienna", "Prague"]


def prompts(engine: Engine, n: int, prefix_tokens: int) -> tuple[list[list[int]], int]:
    """n prompts sharing a system prompt of about `prefix_tokens` tokens; (prompt ids, shared tokens)."""
    system = "Extract the record as one JSON object following the first JSON schema below that fits it."
    for schema in load_schemas("heldout", engine.core.compiler):
        if len(engine.tokenizer.encode(system)) >= prefix_tokens:
            break
        system += "\n" + schema
    out = []
    for i in range(n):
        user = f"Record {i}: {NAMES[i % 8]} is {20 + i} years old and lives in {CITIES[(i * 3) % 8]}."
        out.append(engine.tokenizer.encode(engine.tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": user}])))
    shared = next(j for j, (a, b) in enumerate(zip(out[0], out[1])) if a != b)
    return out, shared


def run(engine: Engine, ids: list[list[int]], max_tokens: int) -> dict:
    """All at once; TTFT per request, the most blocks held meanwhile, the tokens."""
    sched, pool, stop = engine.core.scheduler, engine.core.scheduler.pool, threading.Event()
    peak = [0, 0, 0]  # the most requests running at once, and then: blocks held (each once), table entries

    def watch() -> None:
        while not stop.wait(0.002):
            running = len(sched.running)
            if running >= peak[0]:
                peak[:] = [running, pool.num_used, sum(pool.held)]

    threading.Thread(target=watch, daemon=True).start()
    done = threading.Semaphore(0)
    first = [0.0] * len(ids)
    toks: list[list[int]] = [[] for _ in ids]

    def cb(out, i: int) -> None:
        if out.token_ids and not first[i]:
            first[i] = time.perf_counter()
        toks[i].extend(out.token_ids)
        if out.finished:
            done.release()

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    t0 = time.perf_counter()
    for i, p in enumerate(ids):
        engine.submit(Request(prompt_ids=p, params=params), lambda o, i=i: cb(o, i))
    for _ in ids:
        done.acquire()
    stop.set()
    ttft = [f - t0 for f in first]
    return {"ttft_p50": median(ttft), "ttft_max": max(ttft), "running": peak[0], "blocks": peak[1], "entries": peak[2],
            "tokens": toks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=1500, help="tokens of the shared system prompt (about)")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    print(cpu_header())
    results = {}
    for sharing in (False, True):
        engine = Engine(EngineConfig(prefix_caching=sharing))
        try:
            ids, shared = prompts(engine, args.requests, args.prefix)
            for case in ("cold", "warm"):
                if case == "warm":  # one request with the prefix, to its end
                    run(engine, [ids[0][:shared] + engine.tokenizer.encode(" Warm-up.")], 1)
                results[sharing, case] = run(engine, ids, args.max_tokens)
        finally:
            engine.shutdown()
            engine.join(timeout=30)
    own = sum(-(-len(p) // BLOCK) for p in ids) / len(ids)
    print(f"{args.requests} requests at once, prompts of {min(map(len, ids))}-{max(map(len, ids))} tokens sharing "
          f"the first {shared} ({shared // BLOCK} whole blocks), {args.max_tokens} new tokens each; "
          f"~{own:.0f} blocks a prompt alone")
    print("| case | sharing | TTFT p50 (s) | TTFT longest (s) | most running | blocks held then | their table entries | same tokens |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for case in ("cold", "warm"):
        off, on = results[False, case], results[True, case]
        for sharing, r in (("off", off), ("on", on)):
            same = "-" if r is off else str(r["tokens"] == off["tokens"])
            print(f"| {case} | {sharing} | {r['ttft_p50']:.3f} | {r['ttft_max']:.3f} | {r['running']} | {r['blocks']} "
                  f"| {r['entries']} | {same} |")
        print(f"| {case} | on / off | {on['ttft_p50'] / off['ttft_p50']:.2f}x | {on['ttft_max'] / off['ttft_max']:.2f}x "
              f"| | | | |")


if __name__ == "__main__":
    main()
