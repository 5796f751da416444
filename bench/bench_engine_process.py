"""What the engine's own process costs, and how fast it comes back after a crash.

    python bench/bench_engine_process.py [--rounds 3] [--max-tokens 64] [--kills 3] [--json out.json]

Side by side in one run, the served settings (model_repository/specguide/config.pbtxt), greedy:
- `Engine` in this process vs `EngineProcess` (the same engine in a child process, every output
  pickled over a pipe): tokens/s at concurrency 1 and 8, in alternating rounds;
- recovery: SIGKILL the engine process, time until a request is answered again (`--kills` times).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "backend_src"))
from machine import cpu_header  # noqa: E402  (bench/ is on sys.path when run as a script)

from specguide.config import EngineConfig  # noqa: E402
from specguide.engine.loop import Engine  # noqa: E402
from specguide.process.engine_process import EngineProcess  # noqa: E402
from specguide.request import Request, SamplingParams  # noqa: E402
from specguide.triton.interfaces import engine_parameters  # noqa: E402

PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "The three laws of robotics are",
           "My favourite season is", "def fibonacci(n):", "List three primary colors:", "Water boils at",
           "The best way to learn a language is"]


def run(engine, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
    """Submit all at once; (tokens generated, seconds until the last finished). Raises on an error."""
    done = threading.Semaphore(0)
    tokens, errors = [0], []
    lock = threading.Lock()

    def on(out):
        with lock:
            tokens[0] += len(out.token_ids)
        if out.finished:
            if out.error is not None:
                errors.append(out.error)
            done.release()

    t0 = time.perf_counter()
    for ids in prompts:
        engine.submit(Request(prompt_ids=ids, params=SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                  ignore_eos=True)), on)
    for _ in prompts:
        done.acquire()
    if errors:
        raise RuntimeError(errors[0])
    return tokens[0], time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    print(cpu_header())
    config = EngineConfig.from_parameters(engine_parameters(ROOT / "model_repository"))
    t0 = time.perf_counter()
    inproc = Engine(config)
    t_in = time.perf_counter() - t0
    t0 = time.perf_counter()
    child = EngineProcess(config)
    t_child = time.perf_counter() - t0
    print(f"start: in-process {t_in:.1f} s, engine process {t_child:.1f} s (its tokenizer included)")
    encode = inproc.tokenizer.encode
    results: dict = {"cpu": cpu_header(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                     "settings": {"drafter": config.drafter, "max_tokens": args.max_tokens}, "concurrency": {}}
    for conc in (1, 8):
        prompts = [encode(PROMPTS[i % len(PROMPTS)]) for i in range(conc)]
        rates: dict[str, list[float]] = {"in_process": [], "engine_process": []}
        run(inproc, prompts, 8), run(child, prompts, 8)  # warm
        for _ in range(args.rounds):
            for name, eng in (("in_process", inproc), ("engine_process", child)):
                n, s = run(eng, prompts, args.max_tokens)
                rates[name].append(n / s)
        med = {k: statistics.median(v) for k, v in rates.items()}
        results["concurrency"][conc] = {**med, "ratio": med["engine_process"] / med["in_process"]}
        print(f"concurrency {conc}: in-process {med['in_process']:.1f} tok/s, engine process "
              f"{med['engine_process']:.1f} tok/s ({med['engine_process'] / med['in_process']:.3f}x)")
    inproc.shutdown(drain=False)
    recover = []
    probe = encode(PROMPTS[0])
    for _ in range(args.kills):  # a second and third crash within restarts.STABLE_S back off 1 s, 2 s
        time.sleep(1.0)
        t0 = time.perf_counter()
        os.kill(child.pid, signal.SIGKILL)
        while True:
            try:
                run(child, [probe], 1)
                break
            except Exception:
                time.sleep(0.05)
        recover.append(time.perf_counter() - t0)
    results["recovery_s"] = recover
    print("recovery after SIGKILL, crash 1, 2, 3 in a row (s): " + ", ".join(f"{t:.1f}" for t in recover))
    child.shutdown(drain=False)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
