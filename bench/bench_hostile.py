"""One hostile client must not slow anyone else (issue 19): a trivial guided request's TTFT and a
running stream's largest gap while compile bombs and a 5 MB prompt arrive, and the stub's memory.

    python bench/bench_hostile.py [--settings key=value,...] [--requests 12] [--json out.json]

Starts `scripts/tritonserver.py run` on free ports with a copy of model_repository/ (with
`--settings` applied to specguide's config.pbtxt), then:
1. idle: `--requests` trivial regex-guided requests one after another (each regex distinct, so
   each compiles), TTFT p50;
2. baseline: the same trivial requests beside a long background stream (its largest gap);
3. attack: a long background stream runs; 2 compile bombs (json_schema objects with `--bomb`
   optional integer properties, ~120 KB each, as in the issue) and a 5 MB text_input arrive over
   gRPC (Triton 2.51's HTTP front end crashes on bodies past ~4 MB whatever the model: docs/operations.md);
   meanwhile the same trivial guided requests run again: TTFT p50, and the background stream's
   largest gap between responses while the attack lasts;
4. the stub's RSS warm (before the attack) and 2 s after it.
Goals: attacked TTFT p50 <= 2x idle, largest gap <= 250 ms, RSS after within 20% of warm.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.integration.conftest import _stop, launch, repository_with  # noqa: E402
from tests.integration.test_hostile_server import Stream, bomb  # noqa: E402
from tests.integration.test_resilience_server import PROMPT  # noqa: E402

from machine import cpu_header, cpu_model  # noqa: E402  (bench/ is on sys.path when run as a script)


def trivial(server, i: int) -> float:
    s = Stream(server, {"text_input": "Phone:", "max_tokens": 4, "guided_decoding_guide_type": "regex",
                        "guided_decoding_guide": f"[0-9]{{3}}-[0-9]{{{4 + i % 7}}}( ext {i})?"}).wait()
    assert not s.errors, s.errors
    return s.ttft()


def start_stream(server) -> Stream:
    s = Stream(server, {"text_input": PROMPT, "max_tokens": 512, "min_tokens": 512, "return_perf_metrics": True})
    while len(s.times) < 3:
        time.sleep(0.01)
    return s


def rss_mib(server) -> float:
    return server.stub_rss_bytes() / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", default="", help="config.pbtxt overrides, key=value,...")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--bomb", type=int, default=3500, help="optional properties per bomb schema")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    settings = dict(kv.split("=", 1) for kv in args.settings.split(",") if kv)
    print(cpu_header(), flush=True)
    print(f"settings: {settings or 'model_repository defaults'}")
    with tempfile.TemporaryDirectory() as tmp:
        server = launch(Path(tmp) / "server.log", repository_with(Path(tmp), settings))
        try:
            for i in range(3):  # warm-up: first requests, first compiles
                trivial(server, 100 + i)
            idle = [trivial(server, i) for i in range(args.requests)]
            time.sleep(1.0)
            warm = rss_mib(server)

            # baseline: the same trivial requests beside a running stream, nothing hostile
            background = start_stream(server)
            tb = time.perf_counter()
            beside = [trivial(server, 500 + i) for i in range(args.requests)]
            base_gap = background.max_gap(tb, time.perf_counter())
            base_server_gap = background.max_server_gap()
            background.client.stop_stream(cancel_requests=True)

            background = start_stream(server)
            t0 = time.perf_counter()
            hostile = [Stream(server, {"text_input": "Fill it.", "max_tokens": 8, "guided_decoding_guide_type":
                                       "json_schema", "guided_decoding_guide": bomb(tag, args.bomb)}) for tag in ("a", "b")]
            hostile.append(Stream(server, {"text_input": "x" * 5_000_000, "max_tokens": 4}))
            attacked = [trivial(server, 1000 + i) for i in range(args.requests)]
            for h in hostile:
                h.wait(600)
            t1 = time.perf_counter()
            gap = background.max_gap(t0, t1)
            server_gap = background.max_server_gap()
            background.client.stop_stream(cancel_requests=True)
            time.sleep(2.0)
            after = rss_mib(server)
        finally:
            _stop(server.proc)
    result = {
        "cpu": cpu_model(), "settings": settings,
        "idle_ttft_p50_s": statistics.median(idle), "attacked_ttft_p50_s": statistics.median(attacked),
        "beside_stream_ttft_p50_s": statistics.median(beside), "stream_max_gap_no_attack_s": base_gap,
        "attacked_ttft_max_s": max(attacked), "attack_s": t1 - t0, "stream_max_gap_s": gap,
        "stream_max_engine_gap_s": server_gap, "stream_max_engine_gap_no_attack_s": base_server_gap,
        "stub_rss_warm_mib": warm, "stub_rss_after_mib": after,
        "hostile_errors": [h.errors[0][:120] if h.errors else "" for h in hostile],
    }
    ratio = result["attacked_ttft_p50_s"] / result["idle_ttft_p50_s"]
    print(f"trivial guided TTFT p50: idle {result['idle_ttft_p50_s'] * 1e3:.0f} ms, under attack "
          f"{result['attacked_ttft_p50_s'] * 1e3:.0f} ms ({ratio:.2f}x; goal <= 2x), max {max(attacked) * 1e3:.0f} ms")
    print(f"running stream's largest gap during the attack ({t1 - t0:.1f} s): {gap * 1e3:.0f} ms (goal <= 250 ms); "
          f"with the same trivial requests and no attack: {base_gap * 1e3:.0f} ms "
          f"(trivial TTFT p50 beside the stream {result['beside_stream_ttft_p50_s'] * 1e3:.0f} ms)")
    print(f"  engine-side (last_token_time_ns, whole stream): {server_gap * 1e3:.0f} ms with the attack, "
          f"{base_server_gap * 1e3:.0f} ms without")
    print(f"stub RSS: warm {warm:.0f} MiB, after {after:.0f} MiB ({(after / warm - 1) * 100:+.1f}%; goal within 20%)")
    for e in result["hostile_errors"]:
        print(f"  hostile request answered: {e}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
