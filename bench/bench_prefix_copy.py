"""Prefix copy vs recompute: the crossover below which computing KV rows beats copying them.

    python bench/bench_prefix_copy.py [--sizes 1,16,64,256,1024,1792] [--chunk 256] [--weight-dtype auto]

For n positions: "copy" = what admission does when a busy slot holds the prefix (the target's K/V
rows of every layer, `KVCache.copy_rows`, plus the draft head's feature rows); "compute" = the
prefill of those positions from scratch in chunks of --chunk (the forward over the slot cache,
no LM head: the rows a copy replaces are never a prompt's last). Best of --repeats (the machine may be shared).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend_src"))

from specguide.config import EngineConfig  # noqa: E402
from specguide.engine.loop import Engine  # noqa: E402
from machine import cpu_header  # noqa: E402  (bench/ is on sys.path when run as a script)


def timed(fn, repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1,16,64,256,1024,1792")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--weight-dtype", default="auto")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(cpu_header(), flush=True)
    engine = Engine(EngineConfig(max_slots=8, max_seq_len=2048, prefill_chunk=args.chunk, num_draft_tokens=0,
                                 weight_dtype=args.weight_dtype, warmup=False))
    model, kv = engine.core.model, engine.core.runner.kv
    feats = torch.zeros(8, kv.max_seq_len, model.cfg.hidden_size)  # the draft head's per-slot features
    ids = torch.randint(100, model.cfg.vocab_size, (1, 2048))
    try:
        for n in [int(s) for s in args.sizes.split(",")]:
            def copy() -> None:
                kv.copy_rows(0, 1, 0, n)
                feats[1, :n] = feats[0, :n]

            @torch.inference_mode()
            def compute() -> None:
                for a in range(0, n, args.chunk):
                    b = min(n, a + args.chunk)
                    ctx = model.make_context(torch.tensor([2]), torch.arange(a, b)[None], [2], b)
                    model(ids[:, a:b], ctx, kv)

            c, p = timed(copy, args.repeats), timed(compute, args.repeats)
            print(json.dumps(dict(tokens=n, copy_ms=round(c * 1e3, 3), compute_ms=round(p * 1e3, 1),
                                  compute_over_copy=round(p / c))), flush=True)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
