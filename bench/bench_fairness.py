"""Issue 75's many-row request: one request of `--rows` rows (a Triton batch, or n > 1) decodes;
then one more request arrives. How long does it wait for its first token, and how evenly do its
tokens come, with the last free slots kept for new requests (`new_request_slots` -1: max_slots / 8)
and without (0)? Side by side in one run, each setting in an engine of its own.

    python bench/bench_fairness.py [--rows 64] [--tokens 400] [--victim 150] [--settings -1,0]

The late request is greedy, `--victim` tokens (EOS suppressed), sent `--wait` seconds after the rows;
its solo run is taken first in the same engine. Prints the CPU, then per setting: the late request's
TTFT, its gaps between output events (p50, p90, longest) against its solo run's, and whether the
rows were still decoding when it finished.
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "backend_src"))

from machine import cpu_header  # noqa: E402  (bench/ is on sys.path when run as a script)

VICTIM = "Write a long story about a lighthouse keeper and the sea."


def submit(engine, prompt: str, n: int, group=None, times=None) -> threading.Event:
    from specguide.request import Request, SamplingParams

    done = threading.Event()

    def on(out) -> None:
        if out.token_ids and times is not None:
            times.append(time.perf_counter())
        if out.finished:
            done.set()

    params = SamplingParams(max_tokens=n, min_tokens=n, temperature=0)
    engine.submit(Request(prompt=prompt, params=params, group=group), on)
    return done


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))] * 1e3


def measure(reserve: int, args) -> str:
    from specguide.config import EngineConfig
    from specguide.engine.loop import Engine

    engine = Engine(EngineConfig(max_seq_len=2048, new_request_slots=reserve))
    try:
        solo: list[float] = []
        submit(engine, VICTIM, args.victim, times=solo).wait()
        rows = [submit(engine, f"Row {i}: count upwards from {i}:", args.tokens, group=1) for i in range(args.rows)]
        time.sleep(args.wait)
        late: list[float] = []
        t0 = time.perf_counter()
        submit(engine, VICTIM, args.victim, times=late).wait()
        busy = sum(not r.is_set() for r in rows)
        for r in rows:
            r.wait()
        g = [b - a for a, b in zip(late, late[1:])]
        s = [b - a for a, b in zip(solo, solo[1:])]
        return (f"new_request_slots {reserve:>2} (max_slots {engine.config.max_slots}): TTFT {(late[0] - t0) * 1e3:,.0f} ms; "
                f"gaps p50 {pct(g, .5):.0f} / p90 {pct(g, .9):.0f} / longest {max(g) * 1e3:.0f} ms "
                f"(solo {pct(s, .5):.0f} / {pct(s, .9):.0f} / {max(s) * 1e3:.0f} ms); "
                f"{busy} of {args.rows} rows still decoding when it ended")
    finally:
        engine.shutdown()
        engine.join(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=400, help="max_tokens (= min_tokens) of each row")
    ap.add_argument("--victim", type=int, default=150, help="tokens of the late request")
    ap.add_argument("--wait", type=float, default=8.0, help="seconds between the rows and the late request")
    ap.add_argument("--settings", default="-1,0", help="new_request_slots values, side by side")
    args = ap.parse_args()
    print(cpu_header())
    print(f"{args.rows} rows of {args.tokens} tokens, then a {args.victim}-token request {args.wait:.0f} s later")
    for reserve in (int(x) for x in args.settings.split(",")):
        print(measure(reserve, args), flush=True)


if __name__ == "__main__":
    main()
