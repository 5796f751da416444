"""Soak run against a real tritonserver it starts itself (the long version of tests/integration/test_soak.py).

    python bench/bench_soak.py [--requests 2000] [--concurrency 16] [--warmup 64] [--json out.json]

Starts `scripts/tritonserver.py run` on free ports with model_repository/, runs a warm-up mix,
reads the Python backend stub's resident memory, runs the soak mix (client.soak: 10% bad inputs,
10% cancelled streams, guided/unguided, streaming or not, gRPC/HTTP, num_draft_tokens 0/1/3) in
rounds, reading the memory after each, then checks the gauges and stops the server (SIGTERM).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from client import soak  # noqa: E402
from machine import cpu_header  # noqa: E402  (bench/ is on sys.path when run as a script)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url, timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.split()[-1])
    return 0.0


def stub_rss_mib(server_pid: int) -> float:
    """The engine model's stub and its engine process (process/engine_process.py): the memory that holds the model."""
    from specguide.util.memory import rss_bytes
    from specguide.process.supervisor import descendants

    for child in descendants(server_pid):
        if b"triton_python_backend_stub" in Path(f"/proc/{child}/cmdline").read_bytes():
            engine = [p for p in descendants(child) if b"engine_process" in Path(f"/proc/{p}/cmdline").read_bytes()]
            return (rss_bytes(child) + sum(rss_bytes(p) for p in engine)) / 2**20
    raise RuntimeError("no Python backend stub found")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5, help="memory is read after each round")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=64)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    print(cpu_header(), flush=True)
    http, grpc, metrics = free_port(), free_port(), free_port()
    env = {**os.environ, "TRITON_HTTP_PORT": str(http), "TRITON_GRPC_PORT": str(grpc), "TRITON_METRICS_PORT": str(metrics)}
    log = tempfile.NamedTemporaryFile(prefix="soak-server-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "tritonserver.py"), "run"], stdout=log,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)
    http_url, grpc_url, metrics_url = f"127.0.0.1:{http}", f"127.0.0.1:{grpc}", f"http://127.0.0.1:{metrics}/metrics"
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                urllib.request.urlopen(f"http://{http_url}/v2/health/ready", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    sys.exit(f"the server did not start; see {log.name}")
                time.sleep(0.5)
        warm = soak.run(soak.make_plans(args.warmup, seed=1), grpc_url, http_url, args.concurrency)
        rss = [stub_rss_mib(proc.pid)]
        per_round = args.requests // args.rounds
        rounds = []
        for r in range(args.rounds):
            report = soak.run(soak.make_plans(per_round, seed=100 + r), grpc_url, http_url, args.concurrency)
            rounds.append(report.summary())
            rss.append(stub_rss_mib(proc.pid))
            print(f"round {r + 1}: {report.duration_s:.1f} s, {len(report.failures)} failures, "
                  f"rss {rss[-1]:.0f} MiB", flush=True)
        time.sleep(1.0)
        result = {
            "requests": per_round * args.rounds, "concurrency": args.concurrency, "warmup_failures": len(warm.failures),
            "duration_s": round(sum(r["duration_s"] for r in rounds), 1),
            "failures": sum(r["failures"] for r in rounds),
            "kinds": {k: sum(r["kinds"].get(k, 0) for r in rounds) for k in ("good", "bad", "cancel")},
            "guided": sum(r["guided"] for r in rounds), "guided_stop_validated": sum(r["guided_stop_validated"] for r in rounds),
            "streaming": sum(r["streaming"] for r in rounds),
            "generated_tokens": sum(r["generated_tokens"] for r in rounds),
            "rss_mib": [round(x) for x in rss], "rss_growth_pct": round((rss[-1] / rss[0] - 1) * 100, 2),
            "active_slots_after": metric(metrics_url, "specguide_active_slots"),
            "queue_depth_after": metric(metrics_url, "specguide_queue_depth"),
            "first_failures": [p for r in rounds for p in r["first_failures"]][:5],
        }
        print(json.dumps(result, indent=2))
        if args.json:
            args.json.write_text(json.dumps(result, indent=2))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
