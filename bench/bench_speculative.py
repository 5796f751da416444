"""Speculative decoding: accepted length per step and tokens/s vs speculation off, in one run.

    python bench/bench_speculative.py [--schemas 8] [--max-tokens 96] [--ks 1,2,3,4,5]

Workloads (greedy): guided JSON (JSONSchemaBench dev schemas, chat prompts that show the schema
and ask for an object) and unguided chat. Batch 1 (one request after another) and batch 8
(all submitted together). Drafters: n-gram prompt lookup for each K, the early-exit self-draft
and the draft-model drafter (default: the default model itself) for each K; the early-exit
drafter also without grammar masks on the drafts (the seed's ablation). Every speculative run's tokens are
checked against the speculation-off run (they must be identical: greedy is lossless).
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend_src"))

from specguide.config import EngineConfig  # noqa: E402
from specguide.engine import Engine  # noqa: E402
from specguide.request import GuidedDecodingParams, Request, SamplingParams  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "jsonschemabench_dev"
CHAT = ["Explain why the sky is blue.", "Write a short story about a robot learning to paint.",
        "Give me a recipe for pancakes.", "What are the benefits of regular exercise?",
        "Summarize the plot of Hamlet.", "Describe how a bicycle works.",
        "List five tips for better sleep.", "What is photosynthesis?"]
SUBSETS = ["Glaiveai2K", "Github_easy", "Kubernetes", "Snowplow"]


def schema_prompts(engine: Engine, n: int) -> list[tuple[str, str]]:
    out = []
    files = [f for sub in SUBSETS for f in sorted((DATA / sub).glob("*.json"))]
    for f in files:
        schema = json.loads(f.read_text())
        text = json.dumps(schema)
        if len(text) > 1500:
            continue
        try:
            engine.compiler.compile(GuidedDecodingParams("json_schema", text))
        except Exception:
            continue
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content":
            f"Generate a JSON object that follows this JSON schema.\nSchema: {text}"}])
        out.append((prompt, text))
        if len(out) == n:
            break
    return out


def run(engine: Engine, reqs: list[Request], concurrent: bool) -> dict:
    """Generated tokens/s and per-request (tokens, decode steps, drafted, accepted)."""
    per = [dict(tokens=[], steps=0, final=None) for _ in reqs]
    done = threading.Semaphore(0)

    def cb_for(i):
        def cb(o):
            r = per[i]
            if o.token_ids and r["tokens"]:
                r["steps"] += 1  # a decode step (the first token comes from the prefill)
            r["tokens"] += o.token_ids
            if o.finished:
                r["final"] = o
                done.release()
        return cb
    t0 = time.perf_counter()
    if concurrent:
        for i, r in enumerate(reqs):
            engine.submit(r, cb_for(i))
        for _ in reqs:
            done.acquire()
    else:
        for i, r in enumerate(reqs):
            engine.submit(r, cb_for(i))
            done.acquire()
    dt = time.perf_counter() - t0
    n = sum(len(r["tokens"]) for r in per)
    steps = sum(r["steps"] for r in per)
    return dict(tok_s=n / dt, tokens_per_step=(n - len(reqs)) / max(steps, 1),
                drafted=sum(r["final"].total_draft_tokens for r in per),
                accepted=sum(r["final"].total_accepted_draft_tokens for r in per),
                outputs=[r["tokens"] for r in per])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schemas", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--ks", default="1,2,3,4,5")
    ap.add_argument("--drafters", default="ngram,early_exit,early_exit_unmasked,draft_model",
                    help="ngram | early_exit | early_exit_unmasked (mask ablation) | draft_model")
    ap.add_argument("--json")
    args = ap.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    Kmax = max(ks + [3])
    results = []
    names = {"ngram": ("ngram", True), "early_exit": ("early_exit", True),
             "early_exit_unmasked": ("early_exit", False), "draft_model": ("draft_model", True)}
    engines = [names[d] for d in args.drafters.split(",")]
    baseline: dict = {}
    for drafter, masked in engines:
        eng = Engine(EngineConfig(max_slots=8, max_seq_len=2048, num_draft_tokens=Kmax, drafter=drafter,
                                  draft_layers=20, mask_drafts=masked))
        guided = schema_prompts(eng, args.schemas)
        work = {
            "guided_json": [(p, GuidedDecodingParams("json_schema", s)) for p, s in guided],
            "chat": [(eng.tokenizer.apply_chat_template([{"role": "user", "content": c}]), None)
                     for c in CHAT[: args.schemas]],
        }
        k_list = [0] + ks  # K=0 first: the speculation-off baseline of this engine
        for wname, items in work.items():
            if not masked and wname == "chat":
                continue  # the mask ablation only concerns guided output
            for batch in (1, 8):
                for k in k_list:
                    reqs = [Request(prompt=p, guided=g, num_draft_tokens=k,
                                    params=SamplingParams(max_tokens=args.max_tokens, temperature=0.0))
                            for p, g in (items[:4] if batch == 1 else items)]
                    r = run(eng, reqs, concurrent=batch > 1)
                    key = (wname, batch)
                    if k == 0:
                        baseline[key] = r
                    base = baseline[key]
                    row = dict(workload=wname, batch=batch, drafter="off" if k == 0 else drafter,
                               masked_drafts=masked, K=k, tok_s=round(r["tok_s"], 1),
                               tokens_per_step=round(r["tokens_per_step"], 2),
                               acceptance=round(r["accepted"] / r["drafted"], 3) if r["drafted"] else 0.0,
                               speedup_vs_off=round(r["tok_s"] / base["tok_s"], 2),
                               lossless=r["outputs"] == base["outputs"][: len(r["outputs"])])
                    results.append(row)
                    print(json.dumps(row), flush=True)
        eng.shutdown()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
