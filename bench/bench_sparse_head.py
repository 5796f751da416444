"""The sparse LM head (`sparse_lm_head`): guided JSON with the head over every output tile vs only the
tiles the grammar masks allow, in one engine, alternated.

    python bench/bench_sparse_head.py [--schemas 8] [--max-tokens 96] [--rounds 3] [--ks 0,3] [--batches 1,8]

Workload: held-out JSONSchemaBench schemas (as bench_speculative.py's guided JSON), greedy, batch 1
(4 requests one after another) and batch 8 (all at once), the served engine (prefix caching off:
every round prefills its prompts). Each round runs the sparse head on and off back to back, in
alternating order; tok/s are means over rounds (wall time, prefill included; decode: a request's
tokens after its first over the time from its first to its last, averaged over requests, so at
batch 8 one stream's rate while the others' prefills interleave). Also: the share of the LM head's
tiles the sparse calls computed, and whether the tokens are the same (they must be).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from statistics import mean

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend_src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from specguide import kernels  # noqa: E402
from specguide.config import EngineConfig  # noqa: E402
from specguide.engine.loop import Engine  # noqa: E402
from specguide.request import GuidedDecodingParams, Request, SamplingParams  # noqa: E402

from bench_speculative import run, schema_prompts  # noqa: E402
from machine import cpu_header  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schemas", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ks", default="0,3")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--json")
    args = ap.parse_args()
    print(cpu_header(), flush=True)
    tiles: list[int] = []
    real = kernels.gemv_tiles

    def counted(x, packed, scale, out_features, sel, weight_dtype):
        tiles.append(sel.numel())
        return real(x, packed, scale, out_features, sel, weight_dtype)
    kernels.gemv_tiles = counted
    eng = Engine(EngineConfig(max_slots=8, max_seq_len=2048, prefix_caching=False))
    core = eng.core.runner.core
    total_tiles = eng.core.model.head.out_features // kernels.TILE
    items = [(p, GuidedDecodingParams("json_schema", s)) for p, s in schema_prompts(eng, args.schemas)]
    rows = []
    for k in (int(x) for x in args.ks.split(",")):
        for batch in (int(x) for x in args.batches.split(",")):
            runs: dict[bool, list[dict]] = {True: [], False: []}
            share: list[float] = []
            for r in range(args.rounds):
                for sparse in ((True, False) if r % 2 == 0 else (False, True)):
                    core.sparse_lm_head = sparse
                    reqs = [Request(prompt=p, guided=g, num_draft_tokens=k,
                                    params=SamplingParams(max_tokens=args.max_tokens, temperature=0.0))
                            for p, g in (items[:4] if batch == 1 else items)]
                    del tiles[:]
                    runs[sparse].append(run(eng, reqs, concurrent=batch > 1))
                    if sparse and tiles:
                        share.append(mean(tiles) / total_tiles)
            on, off = runs[True], runs[False]
            row = dict(K=k, batch=batch, tok_s_on=round(mean(x["tok_s"] for x in on), 1),
                       tok_s_off=round(mean(x["tok_s"] for x in off), 1),
                       decode_tok_s_on=round(mean(x["decode_tok_s"] for x in on), 1),
                       decode_tok_s_off=round(mean(x["decode_tok_s"] for x in off), 1),
                       sparse_steps_tile_share=round(mean(share), 3) if share else None,
                       same_tokens=all(a["outputs"] == b["outputs"] for a, b in zip(on, off)))
            row["on_vs_off"] = round(row["tok_s_on"] / row["tok_s_off"], 3)
            row["decode_on_vs_off"] = round(row["decode_tok_s_on"] / row["decode_tok_s_off"], 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
    eng.shutdown()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
