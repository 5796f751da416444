"""A base-model stream's gaps while requests over many LoRA adapters make the engine swap them in and
out of its few places (issues 75 and 79: an adapter read from disk must not hold every stream).

    python bench/bench_lora_swaps.py [--adapters 16] [--rank 64] [--max-loras 2] [--requests 48] [--json F]

A victim request on the base model decodes throughout; meanwhile `--requests` short requests (8
tokens) name the `--adapters` adapters in turn, 2 at a time, with `max_loras` places, so nearly
every one needs its adapter read from its folder. Prints the CPU, the adapter size, the victim's
inter-token gaps (p50 / p99 / longest) during that phase, the phase's wall time and the loads.
`--json F` writes one row (for bench_ab.py: key `bench`, metrics `gap_max_ms`, `gap_p99_ms`).
"""
from __future__ import annotations

import argparse
import atexit
import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "backend_src"))

from bench_lora import PROMPTS, write_adapters  # noqa: E402  (bench/ is on sys.path when run as a script)
from machine import cpu_header  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--adapters", type=int, default=16)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--max-loras", type=int, default=2)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--json")
    args = ap.parse_args()
    print(cpu_header())

    from specguide.config import EngineConfig
    from specguide.engine.loop import Engine
    from specguide.request import Request, SamplingParams

    tmp = Path(tempfile.mkdtemp(prefix="bench-lora-swaps-"))
    atexit.register(shutil.rmtree, tmp, True)  # the adapters' files (hundreds of MB) go with the run
    probe = Engine(EngineConfig(max_seq_len=2048, warmup=False))
    folders = write_adapters(tmp, args.adapters, args.rank, probe.core.model.cfg)
    probe.shutdown()
    engine = Engine(EngineConfig(max_seq_len=4096, max_loras=args.max_loras, lora_adapters=json.dumps(folders)))
    names = list(folders)
    nbytes = sum(f.stat().st_size for f in Path(folders[names[0]]).iterdir())
    print(f"{args.adapters} adapters of rank {args.rank} ({nbytes / 2**20:.1f} MiB a file), max_loras "
          f"{args.max_loras}, {args.requests} requests of 8 tokens, 2 at a time, beside one base-model stream")

    arrivals: list[float] = []
    victim_done = threading.Event()

    def on_victim(out) -> None:
        if out.token_ids:
            arrivals.append(time.perf_counter())
        if out.finished:
            victim_done.set()

    victim = engine.submit(Request(prompt=PROMPTS[0], params=SamplingParams(max_tokens=3500, temperature=0.0,
                                                                            ignore_eos=True)), on_victim)
    while len(arrivals) < 20:  # decoding
        time.sleep(0.01)
    loads0 = engine.core.adapters.loads
    t0 = time.perf_counter()
    for i in range(0, args.requests, 2):
        done = [threading.Event(), threading.Event()]
        for j in range(2):
            name = names[(i + j) % len(names)]
            engine.submit(Request(prompt=PROMPTS[(i + j) % 4], params=SamplingParams(max_tokens=8, temperature=0.0),
                                  lora_name=name), lambda out, d=done[j]: out.finished and d.set())
        for d in done:
            assert d.wait(300)
    t1 = time.perf_counter()
    engine.cancel(victim)
    victim_done.wait(60)
    gaps = sorted((b - a) * 1e3 for a, b in zip(arrivals, arrivals[1:]) if a >= t0 and b <= t1)
    p = lambda q: gaps[min(len(gaps) - 1, int(q * len(gaps)))]  # noqa: E731
    row = {"bench": "lora_swaps", "gap_p50_ms": p(0.5), "gap_p99_ms": p(0.99), "gap_max_ms": gaps[-1],
           "phase_s": t1 - t0, "loads": engine.core.adapters.loads - loads0}
    print(f"victim gaps over {len(gaps)} tokens: p50 {row['gap_p50_ms']:.1f} ms, p99 {row['gap_p99_ms']:.1f} ms, "
          f"longest {row['gap_max_ms']:.1f} ms; phase {row['phase_s']:.1f} s, {row['loads']} adapter loads")
    engine.shutdown()
    if args.json:
        Path(args.json).write_text(json.dumps([row]))


if __name__ == "__main__":
    main()
