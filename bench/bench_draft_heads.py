#!/usr/bin/env python3
"""Draft heads side by side on every held-out JSON schema: hybrid tokens per step and acceptance
at a fixed K (adaptive and cost-aware K off, so the figures depend on the head only), with the
grammar drafter (no head) as the baseline, and whether the heads' weights are bit-identical.

    python bench/bench_draft_heads.py HEAD.pt [HEAD.pt ...] [--max-tokens 128] [--k 3]

Greedy, batch-invariant decoding: the same head gives the same figures on any run of one machine.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend_src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_speculative import run, schema_prompts  # noqa: E402
from machine import cpu_header  # noqa: E402

from specguide.config import EngineConfig  # noqa: E402
from specguide.engine.loop import Engine  # noqa: E402
from specguide.request import GuidedDecodingParams, Request, SamplingParams  # noqa: E402


def measure(head: str, k: int, max_tokens: int) -> dict:
    """The held-out schemas all at once through the hybrid with `head` ("" = the grammar drafter)."""
    drafter = "hybrid" if head else "grammar"
    eng = Engine(EngineConfig(max_slots=8, max_seq_len=1024, drafter=drafter, draft_head_path=head,
                              adaptive_k=False, cost_aware_k=False, spec_max_rows=8 * (k + 1)))
    try:
        assert (eng.core.head_drafter is not None) == bool(head), f"{head}: the head did not load"
        prompts = schema_prompts(eng, 10_000)
        reqs = [Request(prompt=p, guided=GuidedDecodingParams("json_schema", s), num_draft_tokens=k,
                        params=SamplingParams(max_tokens=max_tokens, temperature=0.0)) for p, s in prompts]
        r = run(eng, reqs, concurrent=True)
    finally:
        eng.shutdown()
    return {"head": head or "(none: grammar drafter)", "schemas": len(reqs),
            "output_tokens": sum(map(len, r["outputs"])), "tokens_per_step": round(r["tokens_per_step"], 3),
            "acceptance": round(r["accepted"] / max(r["drafted"], 1), 3), "tok_s": round(r["tok_s"], 1)}


def same_weights(a: str, b: str) -> bool:
    sa, sb = (torch.load(p, map_location="cpu", weights_only=True)["state"] for p in (a, b))
    return sa.keys() == sb.keys() and all(torch.equal(sa[n], sb[n]) for n in sa)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("heads", nargs="+")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    print(cpu_header(), flush=True)
    for head in ["", *args.heads]:
        print(json.dumps(measure(head, args.k, args.max_tokens)), flush=True)
    for i, a in enumerate(args.heads):
        for b in args.heads[i + 1:]:
            print(json.dumps({"a": a, "b": b, "bit_identical_weights": same_weights(a, b)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
