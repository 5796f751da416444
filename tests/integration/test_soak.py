"""Soak at CI size: 300 requests at concurrency 16 through the real server (client.soak): 10% bad
inputs, 10% cancelled streams, guided and not, streaming and not, gRPC and HTTP, mixed
num_draft_tokens. Every good request completes with FINAL; every guided output that ended by its
grammar validates; the slot and queue gauges return to 0; the cancels reach the engine. The
backend's resident memory over a longer run is measured by bench/bench_soak.py (a threshold on
a shared CI machine would fail on noise, not on a leak)."""
from __future__ import annotations

from client import soak

REQUESTS, CONCURRENCY = 300, 16
STAGES = ("queued", "compiling", "prefill", "decode")


def cancellations(server) -> float:
    return sum(server.metric("specguide_cancellations_total", stage=s) for s in STAGES)


def test_soak(server):
    warm = soak.run(soak.make_plans(48, seed=1), server.grpc, server.http, CONCURRENCY)
    assert not warm.failures, warm.summary()
    assert server.wait_metric("specguide_active_slots", 0.0, timeout=30) == 0.0
    cancelled = cancellations(server)
    report = soak.run(soak.make_plans(REQUESTS, seed=0), server.grpc, server.http, CONCURRENCY)
    summary = report.summary()
    print(summary)
    assert not report.failures, summary
    kinds = summary["kinds"]
    assert sum(kinds.values()) == REQUESTS and kinds["bad"] >= 20 and kinds["cancel"] >= 20
    assert summary["guided"] >= 50 and summary["guided_stop_validated"] >= 25 and summary["streaming"] >= 50
    assert server.wait_metric("specguide_active_slots", 0.0, timeout=30) == 0.0
    assert server.wait_metric("specguide_queue_depth", 0.0, timeout=30) == 0.0
    counted = cancellations(server) - cancelled
    print(f"cancels counted by the engine: {counted:.0f} of {kinds['cancel']}")
    assert counted >= 20, f"the cancels reached the engine ({counted:.0f} of {kinds['cancel']})"
