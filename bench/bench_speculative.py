"""Speculative decoding: accepted length per step and tokens/s vs speculation off, in one run.

    python bench/bench_speculative.py [--schemas 8] [--max-tokens 96] [--ks 3,5]
        [--drafters ngram,grammar,head,head_unmasked,hybrid] [--weight-dtypes float32,int8]
        [--activation-dtypes auto,float32] [--llama-cpp]

Workloads (greedy): guided JSON (held-out JSONSchemaBench dev schemas, never trained on: chat
prompts that show the schema and ask for an object) and unguided chat. Batch 1 (one request
after another) and batch 8 (all submitted together), the same prompts; every grammar compiled
before the timed runs (a warm cache, as llama.cpp's grammars are built before its clock).
Drafters: n-gram prompt lookup, grammar (jump-forward tokens + n-gram), the trained head (with and
without grammar masks on its drafts), the hybrid (head + grammar-forced + trusted n-gram), early
exit, draft model. Every speculative run's tokens are checked against the speculation-off run
(identical: greedy is lossless).
`--weight-dtypes`: the whole matrix once per CPU weight format (float32 exact; bfloat16 / int8
weight-only quantization), each against its own speculation-off baseline.
`--activation-dtypes`: and once per activation_dtype (block formats: int8 = integer dot products).
`--kv-cache-dtypes`: and once per kv_cache_dtype (float16, int8: the CPU KV cache in fp16, int8).
`--draft-head-weight-dtypes`: the head / hybrid rows once per draft-head weight format (drafts only).
`--llama-cpp`: llama-cpp-python on the same GGUF (Q4_1), JSON schemas through its grammar, batch 1.
"tokens per step" = generated tokens after the first / decode steps, from the engine's counters.
Prefix caching is off: every run prefills its prompts (the runs repeat them; distinct requests would).
`--repeats N`: each workload's off and K runs alternate N times; tok/s are means (others: first run).
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from statistics import mean

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend_src"))

from specguide.config import EngineConfig  # noqa: E402
from specguide.engine.loop import Engine  # noqa: E402
from specguide.request import GuidedDecodingParams, Request, SamplingParams  # noqa: E402

from specguide.training.prompts import CHAT_BENCH as CHAT, load_schemas, schema_message  # noqa: E402
from machine import cpu_header  # noqa: E402  (bench/ is on sys.path when run as a script)


def schema_prompts(engine: Engine, n: int) -> list[tuple[str, str]]:
    """(prompt, schema) for the first n held-out schemas that compile."""
    return [(engine.tokenizer.apply_chat_template([{"role": "user", "content": schema_message(t)}]), t)
            for t in load_schemas("heldout", engine.core.compiler)[:n]]


def run(engine: Engine, reqs: list[Request], concurrent: bool) -> dict:
    """Generated tokens/s (wall time, prefill included), decode tokens/s (after each request's
    first token) and per-request (tokens, decode steps, drafted, accepted)."""
    per = [dict(tokens=[], final=None, first=None, end=None, start=None) for _ in reqs]
    done = threading.Semaphore(0)

    def cb_for(i):
        def cb(o):
            r = per[i]
            if o.token_ids and r["first"] is None:
                r["first"] = time.perf_counter()
            r["tokens"] += o.token_ids
            if o.finished:
                r["final"], r["end"] = o, time.perf_counter()
                done.release()
        return cb
    t0 = time.perf_counter()
    if concurrent:
        for i, r in enumerate(reqs):
            per[i]["start"] = time.perf_counter()
            engine.submit(r, cb_for(i))
        for _ in reqs:
            done.acquire()
    else:
        for i, r in enumerate(reqs):
            per[i]["start"] = time.perf_counter()
            engine.submit(r, cb_for(i))
            done.acquire()
    dt = time.perf_counter() - t0
    n = sum(len(r["tokens"]) for r in per)
    # decode steps from the engine's own counters (a step's tokens may arrive in two callbacks)
    steps = sum(r["final"].num_output_tokens - 1 - r["final"].total_accepted_draft_tokens for r in per)
    decode_s = sum(r["end"] - r["first"] for r in per if r["first"] is not None)
    return dict(tok_s=n / dt, decode_tok_s=(n - len(reqs)) / decode_s if decode_s else 0.0,
                tokens_per_step=(n - len(reqs)) / max(steps, 1),
                drafted=sum(r["final"].total_draft_tokens for r in per),
                accepted=sum(r["final"].total_accepted_draft_tokens for r in per),
                outputs=[r["tokens"] for r in per],
                per_request=[(len(r["tokens"]), r["end"] - r["start"]) for r in per])  # batch 1: each on its own


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schemas", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--ks", default="3,5")
    ap.add_argument("--drafters", default="ngram,grammar,head,head_unmasked,hybrid",
                    help="ngram | grammar | head | head_unmasked (mask ablation) | hybrid | early_exit | "
                         "early_exit_unmasked | draft_model")
    ap.add_argument("--adaptive-k", type=int, default=1)
    ap.add_argument("--cost-aware-k", type=int, default=0)
    ap.add_argument("--weight-dtypes", default="float32", help="comma list of weight_dtype values (float32 | auto | q4_1 | q8_0 | bfloat16 | int8)")
    ap.add_argument("--activation-dtypes", default="auto", help="comma list of activation_dtype values (auto | int8 | float32)")
    ap.add_argument("--kv-cache-dtypes", default="auto", help="comma list of kv_cache_dtype values (auto | float32 | float16 | int8)")
    ap.add_argument("--draft-head-weight-dtypes", default="int8",
                    help="comma list: the draft head's weights (head / hybrid drafters; '' = the target's)")
    ap.add_argument("--llama-cpp", action="store_true", help="also llama-cpp-python on the same GGUF")
    ap.add_argument("--repeats", type=int, default=1, help="alternate off / K runs this often; mean tok/s")
    ap.add_argument("--draft-head", default="", help="draft head file (default: the trained head's cache path)")
    ap.add_argument("--json")
    args = ap.parse_args()
    print(cpu_header(), flush=True)
    ks = [int(k) for k in args.ks.split(",")]
    Kmax = max(ks + [3])
    results = []
    names = {"ngram": ("ngram", True), "grammar": ("grammar", True), "head": ("head", True),
             "head_unmasked": ("head", False), "hybrid": ("hybrid", True), "early_exit": ("early_exit", True),
             "early_exit_unmasked": ("early_exit", False), "draft_model": ("draft_model", True)}
    head_wds = args.draft_head_weight_dtypes.split(",")
    engines = [(wd, ad, kd, hd) + names[d] for wd in args.weight_dtypes.split(",")
               for ad in args.activation_dtypes.split(",") for kd in args.kv_cache_dtypes.split(",")
               for d in args.drafters.split(",")
               for hd in (head_wds if names[d][0] in ("head", "hybrid") else head_wds[:1])]
    baseline: dict = {}
    batch1: dict = {}  # (engine, workload, K) -> every repeat's per_request: llama.cpp's rows compare the same requests
    for wd, ad, kd, hd, drafter, masked in engines:
        # NOTE: prefix caching off: every run sends the same prompts, and a run after the first would
        # find them in the slots (K=0 always ran first, so K=3 skipped its prompts' prefill)
        eng = Engine(EngineConfig(max_slots=8, max_seq_len=2048, num_draft_tokens=Kmax, drafter=drafter,
                                  prefix_caching=False,
                                  draft_layers=20, mask_drafts=masked, adaptive_k=bool(args.adaptive_k),
                                  weight_dtype=wd, activation_dtype=ad, kv_cache_dtype=kd,
                                  cost_aware_k=bool(args.cost_aware_k),
                                  draft_head_weight_dtype=hd, draft_head_path=args.draft_head))
        if eng.core.drafter != drafter:
            sys.exit(f"drafter {drafter!r} is not available (no trained head? run scripts/train_draft_head.py)")
        guided = schema_prompts(eng, args.schemas)
        work = {
            "guided_json": [(p, GuidedDecodingParams("json_schema", s)) for p, s in guided],
            "chat": [(eng.tokenizer.apply_chat_template([{"role": "user", "content": c}]), None)
                     for c in CHAT[: args.schemas]],
        }
        # NOTE: every grammar compiled before the clock (llama.cpp's rows build theirs before it too):
        # K=0 runs first, so its first run paid every compile and the K runs found them cached,
        # which had put ~0.16x into the guided K=3 vs K=0 ratio (1.22x against 1.06x, Zen 5)
        run(eng, [Request(prompt=p, guided=g, num_draft_tokens=0, params=SamplingParams(max_tokens=2, temperature=0.0))
                  for items in work.values() for p, g in items], concurrent=True)
        k_list = [0] + ks  # K=0 first: the speculation-off baseline of this engine
        for wname, items in work.items():
            if not masked and wname == "chat":
                continue  # the mask ablation only concerns guided output
            for batch in (1, 8):
                runs: dict[int, list[dict]] = {k: [] for k in k_list}
                for _ in range(args.repeats):  # alternated: K=0, K1, K2, K=0, K1, ...
                    for k in k_list:
                        reqs = [Request(prompt=p, guided=g, num_draft_tokens=k,
                                        params=SamplingParams(max_tokens=args.max_tokens, temperature=0.0))
                                for p, g in items]  # batch 1: the same prompts, one after another
                        runs[k].append(run(eng, reqs, concurrent=batch > 1))
                for k in k_list:
                    if batch == 1:
                        label = f"{wd}/{ad}/{kd}" + (f"/{drafter}/{hd}" if k else "")
                        batch1[(label, wname, k)] = [x["per_request"] for x in runs[k]]
                    r = dict(runs[k][0], tok_s=mean(x["tok_s"] for x in runs[k]),
                             decode_tok_s=mean(x["decode_tok_s"] for x in runs[k]))
                    key = (f"{wd}/{ad}/{kd}", wname, batch)
                    if k == 0:
                        baseline[key] = r
                    base = baseline[key]
                    row = dict(weight_dtype=wd, activation_dtype=ad, integer_dot=eng.core.model.integer_dot,
                               kv_cache_dtype=kd, kv_store=str(eng.core.runner.kv.store).removeprefix("torch."),
                               cost_aware_k=bool(args.cost_aware_k), adaptive_k=bool(args.adaptive_k),
                               draft_head_weight_dtype=hd if drafter in ("head", "hybrid") and k else None,
                               workload=wname, batch=batch, drafter="off" if k == 0 else drafter,
                               masked_drafts=masked, K=k, tok_s=round(r["tok_s"], 1),
                               decode_tok_s=round(r["decode_tok_s"], 1) if batch == 1 else None,
                               tokens_per_step=round(r["tokens_per_step"], 2),
                               acceptance=round(r["accepted"] / r["drafted"], 3) if r["drafted"] else 0.0,
                               speedup_vs_off=round(r["tok_s"] / base["tok_s"], 2),
                               lossless=r["outputs"] == base["outputs"][: len(r["outputs"])])
                    results.append(row)
                    print(json.dumps(row), flush=True)
        eng.shutdown()
    if args.llama_cpp:
        results += llama_cpp_rows(args, baseline, batch1, work)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def llama_cpp_rows(args, baseline: dict, batch1: dict, work: dict) -> list[dict]:
    """llama-cpp-python on the default model's GGUF, batch 1, the engine's prompts and
    max_tokens; JSON schemas through LlamaGrammar.from_json_schema. Tokens/s over wall time
    (prefill included) and after the first token (decode), like the engine rows; beside them the
    engine's batch-1 tok/s over the same requests (a schema llama.cpp's converter refuses is left
    out of both)."""
    from llama_cpp import Llama, LlamaGrammar

    from specguide.models.default_model import default_gguf_path

    llm = Llama(model_path=str(default_gguf_path()), n_ctx=2048, n_threads=2, verbose=False, seed=0)
    rows = []
    for wname, items in work.items():
        n = dt = dec_s = 0.0
        done = 0
        ran = []
        for i, (prompt, guide) in enumerate(items):
            try:
                grammar = LlamaGrammar.from_json_schema(guide.guide, verbose=False) if guide else None
            except Exception:
                continue
            ran.append(i)
            llm.reset()  # no prompt cache reuse between requests
            t0 = time.perf_counter()
            first, count = None, 0
            for _ in llm.create_completion(prompt, max_tokens=args.max_tokens, temperature=0.0,
                                           grammar=grammar, stream=True):
                count += 1  # one streamed chunk per generated token
                first = first or time.perf_counter()
            end = time.perf_counter()
            dt += end - t0
            dec_s += end - (first or end)
            n += count
            done += 1
        row = dict(workload=wname, batch=1, drafter="llama.cpp (Q4_1)", K=0, tok_s=round(n / dt, 1),
                   decode_tok_s=round((n - done) / dec_s, 1) if dec_s else None, requests=done)
        for (wd, w, b), base in baseline.items():
            if (w, b) == (wname, 1):
                row[f"engine_off_tok_s_{wd}"] = round(base["tok_s"], 1)
        for (label, w, k), repeats in batch1.items():  # the engine over the requests llama.cpp ran
            if w == wname:
                row[f"engine_same_requests_tok_s_{label}_K{k}"] = round(mean(
                    sum(per[i][0] for i in ran) / sum(per[i][1] for i in ran) for per in repeats), 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    main()
