"""Issue 77's figures for the paged KV cache: the model's whole context, and concurrency bounded by
blocks instead of slots, side by side with the slot-bound setting of before (8 slots) in one run.

    python bench/bench_paged.py [--long 2000,8000] [--streams 8,64] [--prompt-tokens 300] [--new-tokens 256]

Long prompts: one request of each length (README and held-out schema text, cut to length), alone,
`max_tokens` 1: TTFT and prefill tokens/s (length / TTFT), served defaults (`max_seq_len` 0: the
model's 8,192); best of `--rounds`.

Concurrency: `--streams` requests at once (prompts of `--prompt-tokens`, `--new-tokens` greedy
tokens, `ignore_eos`, speculation as served), on the served defaults (`max_slots` 0: 64 on CPU,
the KV blocks from memory) and on `max_slots` 8 (what `max_slots` 0 gave before: a 9th request
waited for a slot). Per run: TTFT p50 / p90, aggregate output tokens/s (all tokens / wall time),
and the KV blocks the running sequences held at the peak against the blocks of what they held
(sum of ceil(tokens / 16)): at most one block a sequence more (its next step's draft positions).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend_src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kv_cache import prompt_of, texts, ttft  # noqa: E402
from machine import cpu_header  # noqa: E402

from specguide.config import EngineConfig  # noqa: E402
from specguide.engine.block_pool import BlockPool  # noqa: E402
from specguide.engine.loop import Engine  # noqa: E402
from specguide.request import Request, SamplingParams  # noqa: E402


def concurrent(engine: Engine, prompts: list[list[int]], new_tokens: int) -> dict:
    """All prompts at once: TTFTs, tokens/s, and the KV blocks held against what they hold."""
    t0 = time.perf_counter()
    first: list[float] = [0.0] * len(prompts)
    tokens = [0] * len(prompts)
    done = threading.Semaphore(0)
    sched = engine.core.scheduler
    peak = {"held": 0, "need": 0, "running": 0}
    preemptions = engine.stats()["preemptions"]

    def cb_for(i: int):
        def cb(out):  # on the loop thread, between steps
            if out.token_ids and not first[i]:
                first[i] = time.perf_counter() - t0
            tokens[i] += len(out.token_ids)
            running = [s for s in sched.running.values() if sched.pool.held[s.slot]]
            held = sum(sched.pool.held[s.slot] for s in running)
            if held > peak["held"]:
                peak.update(held=held, need=sum(BlockPool.blocks_for(s.num_tokens) for s in running),
                            running=len(running))
            if out.finished:
                done.release()
        return cb

    for i, p in enumerate(prompts):
        engine.submit(Request(prompt_ids=p, params=SamplingParams(max_tokens=new_tokens, temperature=0.0,
                                                                  ignore_eos=True)), cb_for(i))
    for _ in prompts:
        assert done.acquire(timeout=3600)
    wall = time.perf_counter() - t0
    q = statistics.quantiles(first, n=10)
    return {"p50": statistics.median(first), "p90": q[-1], "tps": sum(tokens) / wall, "wall": wall,
            "preemptions": engine.stats()["preemptions"] - preemptions, **peak}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--long", default="2000,8000")
    ap.add_argument("--streams", default="8,64")
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    print(cpu_header(), f"{torch.get_num_threads()} threads", flush=True)
    served = Engine(EngineConfig(prefix_caching=False))
    cfg = served.config
    print(f"served defaults: max_seq_len {cfg.max_seq_len}, max_slots {cfg.max_slots}, "
          f"{served.core.scheduler.pool.num_blocks} KV blocks of 16 positions", flush=True)
    ids = texts(served)
    lengths = [int(n) for n in args.long.split(",")]
    best = {n: float("inf") for n in lengths}
    for _ in range(args.rounds):
        for n in lengths:
            best[n] = min(best[n], ttft(served, prompt_of(ids, n, 0)))
    print("\n| prompt tokens | TTFT (s) | prefill tokens/s | vs the first |")
    print("| ---: | ---: | ---: | ---: |")
    for n in lengths:
        print(f"| {n} | {best[n]:.2f} | {n / best[n]:.0f} | {(n / best[n]) / (lengths[0] / best[lengths[0]]):.2f} |")
    slots8 = Engine(EngineConfig(prefix_caching=False, max_slots=8))
    engines = {"served (blocks, 64 slots)": served, "8 slots (before)": slots8}
    print(f"\n{args.prompt_tokens}-token prompts, {args.new_tokens} new tokens each, all at once:")
    print("| streams | setting | TTFT p50 (s) | TTFT p90 (s) | tokens/s | wall (s) | peak blocks held | "
          "their tokens' blocks | sequences | preemptions |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in (int(s) for s in args.streams.split(",")):
        prompts = [prompt_of(ids, args.prompt_tokens, i) for i in range(n)]
        for name, eng in engines.items():
            r = concurrent(eng, prompts, args.new_tokens)
            print(f"| {n} | {name} | {r['p50']:.2f} | {r['p90']:.2f} | {r['tps']:.1f} | {r['wall']:.1f} | "
                  f"{r['held']} | {r['need']} | {r['running']} | {r['preemptions']} |", flush=True)
    for e in engines.values():
        e.shutdown()


if __name__ == "__main__":
    main()
