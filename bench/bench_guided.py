"""Guided decoding (json_schema) vs unguided, side by side in one run, on the same prompts.

    python bench/bench_guided.py [--num-schemas 16] [--max-tokens 128] [--concurrency 8] [--repeats 3]
        [--draft-tokens K] [--skip-hf] [--skip-compile] [--json out.json]

Prompts: a chat-templated request "generate a JSON object that follows this schema" for N schemas
of the JSONSchemaBench dev sample (round-robin over its subsets, file-name order, compact schema
text <= --max-schema-tokens tokens, compiling). Greedy, fp32, max_tokens 128, no speculation
unless --draft-tokens says otherwise (with speculation the length-matched unguided run drafts on
different text, so the ratio then mixes grammar cost with acceptance). Reports:

  1. tokens/s, guided (json_schema) vs unguided, batch 1 (one request after another) and batch 8
     (8 submitted together). Unguided runs twice: *natural* (ignore_eos=False, stops where the
     model stops) and *length-matched* (ignore_eos=True, max_tokens = the guided output's length
     for that prompt), so that guided and matched unguided generate exactly the same number of
     tokens at the same positions with the same batch occupancy. The ratio guided / matched is
     the like-for-like figure. Batch 1 runs guided and matched alternately, prompt by prompt;
     batch 8 runs `--repeats` adjacent guided/matched pairs per group of 8 (order alternating)
     and reports the aggregate and the median of the pairs' ratios. Every prompt's prefill and
     every batch size are warmed up first.
     Mask fill / apply / matcher advance inside the engine are timed by wrapping the engine's
     GuidedDecoder methods (no engine change).
  2. grammar compile p50/p99, cold and cached, over the whole JSONSchemaBench sample, and
     mask-fill time per row per step (bench_guided_compile.py's functions, reused).
  3. validity of the outputs: engine guided, engine unguided (natural), and transformers
     `generate` (fp32, batch 1) with xgrammar's HF logits processor given the same compiled
     grammar: fraction that parses as JSON, that validates with `jsonschema`, and how many ended
     at the grammar's end (stop) vs max_tokens (length).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent / "backend_src"))
sys.path.insert(0, str(BENCH))

import bench_guided_compile as bgc  # noqa: E402
from specguide.config import EngineConfig  # noqa: E402
from specguide.engine.loop import Engine  # noqa: E402
from specguide.guided import GrammarCompilerService  # noqa: E402
from specguide.models.loader import resolve_model_dir  # noqa: E402
from specguide.request import GuidedDecodingParams, InvalidRequestError, Request, SamplingParams  # noqa: E402
from machine import cpu_header  # noqa: E402  (bench/ is on sys.path when run as a script)

DATA_DIR = BENCH.parent / "backend_src" / "specguide" / "training" / "data" / "jsonschemabench_dev"
INSTRUCTION = ("Generate a JSON object that follows this JSON schema. Reply with the JSON object only, "
               "no explanation.\n\nJSON schema:\n{schema}")


# ---- workload --------------------------------------------------------------------------------

def load_schemas(data_dir: Path) -> list[tuple[str, str]]:
    files = sorted(data_dir.glob("*/*.json"))
    assert files, f"no schemas under {data_dir}"
    return [(f"{f.parent.name}/{f.name}", f.read_text()) for f in files]


def pick_schemas(schemas: list[tuple[str, str]], engine: Engine, n: int, max_schema_tokens: int,
                 value_checked: bool = False) -> list[dict]:
    """Round-robin over the subsets, file-name order; keep small ones that compile (warms the cache);
    with `value_checked`, only schemas whose llguidance guide leaves keywords to the value check."""
    by_subset: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for name, text in schemas:
        by_subset[name.split("/")[0]].append((name, text))
    queues = [list(v) for _, v in sorted(by_subset.items())]
    picked: list[dict] = []
    while len(picked) < n and any(queues):
        for q in queues:
            while q and len(picked) < n:
                name, text = q.pop(0)
                compact = json.dumps(json.loads(text), separators=(",", ":"))
                if len(engine.tokenizer.encode(compact)) > max_schema_tokens:
                    continue
                try:
                    for backend in ("xgrammar", "llguidance"):  # the same schemas for either --backend
                        g = engine.core.compiler.compile(GuidedDecodingParams("json_schema", text, backend=backend))
                except InvalidRequestError:
                    continue
                if value_checked and not g.checked:
                    continue
                picked.append({"name": name, "schema_text": text, "schema": json.loads(text), "compact": compact})
                break
    return picked


def build_prompts(engine: Engine, picked: list[dict]) -> list[list[int]]:
    out = []
    for p in picked:
        text = engine.tokenizer.apply_chat_template([{"role": "user", "content": INSTRUCTION.format(schema=p["compact"])}])
        out.append(engine.tokenizer.encode(text))
    return out


# ---- instrumentation (wraps the engine's objects; the engine is not modified) ------------------

class StepTimers:
    """Per-call wall time of the grammar's mask fill (GuidedDecoder.fill), mask apply
    (GuidedStepper.apply_rows), advance, and of Runner.step ("decode")."""

    def __init__(self, engine: Engine):
        self.on = False
        self.calls: dict[str, list[tuple[int, float]]] = defaultdict(list)  # name -> [(rows, seconds)]
        g, r = engine.core.guided, engine.core.runner
        self._wrap(g.inner, "fill", lambda a: len(a[0]))
        self._wrap(g.stepper, "apply_rows", lambda a: int(a[1].numel()), "apply")
        self._wrap(g, "advance", lambda a: 1)
        self._wrap(r, "step", lambda a: len(a[0]), "decode")

    def _wrap(self, obj, attr, rows_of, name: str = "") -> None:
        fn, name = getattr(obj, attr), name or attr

        def timed(*a, **kw):
            if not self.on:
                return fn(*a, **kw)
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            self.calls[name].append((int(rows_of(a)), time.perf_counter() - t0))
            return out
        setattr(obj, attr, timed)

    def take(self) -> dict[str, list[tuple[int, float]]]:
        calls, self.calls = self.calls, defaultdict(list)
        return calls


# ---- engine runs ------------------------------------------------------------------------------

DRAFT_TOKENS: list = [0]  # --draft-tokens: Request.num_draft_tokens (None = the engine's configured K)
BACKEND: list = [""]  # --backend: the guides' grammar backend ("" = the engine's guided_backend)


def make_request(ids: list[int], p: dict, guided: bool, max_tokens: int, ignore_eos: bool) -> Request:
    return Request(prompt_ids=ids, params=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=ignore_eos),
                   guided=GuidedDecodingParams("json_schema", p["schema_text"], backend=BACKEND[0]) if guided else None,
                   num_draft_tokens=DRAFT_TOKENS[0])


def run_one(engine: Engine, req: Request) -> dict:
    t0 = time.perf_counter()
    first, toks, text, reason, err = None, [], "", None, None
    for ev in engine.generate(req):
        if ev.token_ids and first is None:
            first = time.perf_counter()
        toks += ev.token_ids
        text += ev.text
        if ev.finished:
            reason, err = ev.finish_reason, ev.error
    return {"tokens": toks, "text": text, "finish": reason, "error": err, "t0": t0, "t_first": first,
            "t_end": time.perf_counter()}


def run_together(engine: Engine, reqs: list[Request]) -> tuple[list[dict], list[tuple[float, int]]]:
    """Submit all at once; per request results and the (time, tokens) of every event."""
    lock, done = threading.Lock(), threading.Semaphore(0)
    res = [{"tokens": [], "text": "", "finish": None, "error": None, "t_first": None} for _ in reqs]
    events: list[tuple[float, int]] = []

    def cb(i):
        def f(ev):
            now = time.perf_counter()
            with lock:
                r = res[i]
                if ev.token_ids and r["t_first"] is None:
                    r["t_first"] = now
                r["tokens"] += ev.token_ids
                r["text"] += ev.text
                events.append((now, len(ev.token_ids)))
                if ev.finished:
                    r["finish"], r["error"], r["t_end"] = ev.finish_reason, ev.error, now
                    done.release()
        return f
    t0 = time.perf_counter()
    for i, req in enumerate(reqs):
        engine.submit(req, cb(i))
    for _ in reqs:
        done.acquire()
    for r in res:
        r["t0"] = t0
    return res, events


def warm_up(engine: Engine, prompts: list[list[int]], picked: list[dict], c: int) -> None:
    """Before any timing: every prompt's prefill, every decode batch size 1..c, guided and not
    (first-time shapes cost extra in the kernels' and oneDNN's caches)."""
    for g in range(0, len(prompts), c):
        idx = list(range(g, min(g + c, len(prompts))))
        run_together(engine, [make_request(prompts[i], picked[i], False, 2 + 2 * j, True) for j, i in enumerate(idx)])
    idx = list(range(min(c, len(prompts))))
    run_together(engine, [make_request(prompts[i], picked[i], True, 2 + 2 * j, False) for j, i in enumerate(idx)])
    run_one(engine, make_request(prompts[0], picked[0], True, 8, False))
    run_one(engine, make_request(prompts[0], picked[0], False, 8, True))


def b1_rates(runs: list[dict]) -> dict:
    n = sum(len(r["tokens"]) for r in runs)
    dec_tok = sum(len(r["tokens"]) - 1 for r in runs if len(r["tokens"]) > 1)
    dec_s = sum(r["t_end"] - r["t_first"] for r in runs if len(r["tokens"]) > 1)
    return {"tokens": n, "decode_tok_s": dec_tok / dec_s, "e2e_tok_s": n / sum(r["t_end"] - r["t0"] for r in runs),
            "ttft_p50_s": statistics.median(r["t_first"] - r["t0"] for r in runs)}


def batch_rates(groups: list[tuple[list[dict], list[tuple[float, int]]]]) -> dict:
    """Aggregate over groups: wall tok/s (submit to last finish) and decode-window tok/s
    (from the moment every request of the group has its first token to the last finish)."""
    n = wall = win_tok = win_s = 0
    for res, events in groups:
        n += sum(len(r["tokens"]) for r in res)
        end = max(r["t_end"] for r in res)
        wall += end - res[0]["t0"]
        start = max(r["t_first"] for r in res)
        win_tok += sum(k for t, k in events if start < t <= end)
        win_s += end - start
    return {"tokens": n, "wall_tok_s": n / wall, "decode_window_tok_s": win_tok / win_s if win_s > 0 else float("nan")}


def grammar_share(calls: dict[str, list[tuple[int, float]]]) -> dict:
    """Per decode step: time in fill + apply (+ advance, on the loop thread) vs the whole decode call."""
    out = {}
    for k in ("fill", "apply", "advance"):
        c = [(r, s) for r, s in calls.get(k, []) if r > 0]
        if c:
            per_row = [s / r for r, s in c]
            out[f"{k}_us_per_row_p50"] = round(bgc.pct(per_row, .5) * 1e6, 1)
            out[f"{k}_us_per_row_p99"] = round(bgc.pct(per_row, .99) * 1e6, 1)
            out[f"{k}_total_s"] = round(sum(s for _, s in c), 3)
    dec = calls.get("decode", [])
    if dec:
        out["decode_step_ms_p50"] = round(bgc.pct([s for _, s in dec], .5) * 1e3, 2)
        out["decode_total_s"] = round(sum(s for _, s in dec), 3)
        gs = sum(out.get(f"{k}_total_s", 0) for k in ("fill", "apply", "advance"))
        out["grammar_share_of_decode"] = round(gs / out["decode_total_s"], 4)
    return out


# ---- transformers + xgrammar ------------------------------------------------------------------

def run_hf(model_dir: Path, engine: Engine, prompts: list[list[int]], picked: list[dict], max_tokens: int) -> list[dict]:
    import xgrammar as xgr
    from transformers import LlamaForCausalLM, LogitsProcessorList

    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = sorted(engine.core.eos_token_ids)
    outs = []
    with torch.inference_mode():
        hf.generate(torch.tensor([prompts[0]]), max_new_tokens=2, do_sample=False, pad_token_id=eos[0])  # warm-up
        for ids, p in zip(prompts, picked):
            compiled = engine.core.compiler.compile(GuidedDecodingParams("json_schema", p["schema_text"], backend="xgrammar"))
            proc = xgr.contrib.hf.LogitsProcessor(compiled.grammar)  # one per generate() call
            t0 = time.perf_counter()
            out = hf.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos,
                              pad_token_id=eos[0], logits_processor=LogitsProcessorList([proc]))
            dt = time.perf_counter() - t0
            toks = out[0, len(ids):].tolist()
            outs.append({"tokens": toks, "text": engine.tokenizer.decode(toks), "seconds": dt,
                         "finish": "stop" if toks and toks[-1] in eos else "length"})
    del hf
    return outs


# ---- validity ---------------------------------------------------------------------------------

FENCE = re.compile(r"```(?:json)?\s*(.*?)\s*```", re.S)


def check(text: str, schema: dict) -> tuple[bool, bool, bool, bool]:
    """(parses, validates, parses after taking a ```json fence's content, validates so)."""
    import jsonschema

    def one(t):
        try:
            obj = json.loads(t)
        except ValueError:
            return False, False
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        try:
            return True, cls(schema).is_valid(obj)
        except Exception:  # unresolvable $ref and the like: count as not validated
            return True, False
    strict = one(text.strip())
    m = FENCE.search(text)
    lenient = one(m.group(1)) if m and not strict[0] else strict
    return strict + lenient


def validity(outs: list[dict], picked: list[dict]) -> dict:
    rows = [check(o["text"], p["schema"]) for o, p in zip(outs, picked)]
    n = len(rows)
    return {"n": n, "parses": sum(r[0] for r in rows) / n, "valid": sum(r[1] for r in rows) / n,
            "parses_fence_ok": sum(r[2] for r in rows) / n, "valid_fence_ok": sum(r[3] for r in rows) / n,
            "valid_among_stop": (sum(r[1] for r, o in zip(rows, outs) if o["finish"] == "stop")
                                 / max(1, sum(o["finish"] == "stop" for o in outs))),
            "stop": sum(o["finish"] == "stop" for o in outs), "length": sum(o["finish"] == "length" for o in outs),
            "mean_tokens": statistics.mean(len(o["tokens"]) for o in outs)}


# ---- main -------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default=str(DATA_DIR))
    ap.add_argument("--num-schemas", type=int, default=16)
    ap.add_argument("--max-schema-tokens", type=int, default=600)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3, help="guided / matched pairs per group at batch --concurrency")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--weight-dtype", default="auto", help="EngineConfig.weight_dtype (auto | float32 | q4_1 | ...)")
    ap.add_argument("--fill-batch-sizes", default="1,8,32")
    ap.add_argument("--fill-steps", type=int, default=64)
    ap.add_argument("--draft-tokens", type=int, default=0,
                    help="per-request speculative draft tokens K (default 0: plain decoding, which is what the "
                         "in-engine grammar timing covers; -1: the engine's configured K)")
    ap.add_argument("--skip-hf", action="store_true", help="no transformers + xgrammar validity run")
    ap.add_argument("--skip-compile", action="store_true", help="no compile / mask-fill micro-benchmark")
    ap.add_argument("--backend", default="", help="grammar backend of the guides: auto | xgrammar | llguidance "
                    "('' = the engine's guided_backend, auto)")
    ap.add_argument("--value-checked", action="store_true",
                    help="only schemas with keywords left to the value check (guided/value_check.py)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    print(cpu_header(), flush=True)
    BACKEND[0] = args.backend
    T0 = time.perf_counter()
    DRAFT_TOKENS[0] = None if args.draft_tokens < 0 else args.draft_tokens
    load_start = os.getloadavg()
    n, c = args.max_tokens, args.concurrency

    schemas = load_schemas(Path(args.data_dir))
    model_dir = resolve_model_dir()
    engine = Engine(EngineConfig(dtype=args.dtype, weight_dtype=args.weight_dtype, max_slots=max(8, c), max_seq_len=2048))
    timers = StepTimers(engine)
    picked = pick_schemas(schemas, engine, args.num_schemas, args.max_schema_tokens, args.value_checked)
    prompts = build_prompts(engine, picked)
    results: dict = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                   f"{torch.get_num_threads()} torch threads, torch {torch.__version__}",
        "model": model_dir.name, "dtype": args.dtype, "max_tokens": n, "concurrency": c,
        "draft_tokens": DRAFT_TOKENS[0],
        "schemas": [p["name"] for p in picked],
        "prompt_tokens_mean": round(statistics.mean(len(x) for x in prompts), 1)}
    print(f"{len(picked)} schemas, prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens "
          f"(mean {results['prompt_tokens_mean']}); grammars compiled and cached", flush=True)

    warm_up(engine, prompts, picked, c)
    print(f"  warm-up: done ({time.perf_counter() - T0:.0f} s)", flush=True)

    # -- batch c: guided vs length-matched unguided, in adjacent pairs (order alternating),
    #    `--repeats` pairs per group of c prompts; natural unguided once per group ------------
    b8 = {"guided": [], "matched": [], "natural": []}
    pair_ratios: list[tuple[float, float]] = []  # (decode window, wall) guided / matched, per pair
    b8_calls: dict = {}
    first_guided: list[dict] = []
    for g in range(0, len(prompts), c):
        idx = list(range(g, min(g + c, len(prompts))))
        lens: list[int] = []
        for rep in range(args.repeats):
            pair = {}
            for kind in (("guided", "matched") if rep % 2 == 0 else ("matched", "guided")):
                if kind == "guided":
                    timers.on = True
                    pair[kind] = run_together(engine, [make_request(prompts[i], picked[i], True, n, False) for i in idx])
                    timers.on = False
                    for k, v in timers.take().items():
                        b8_calls.setdefault(k, []).extend(v)
                    if rep == 0:
                        first_guided += pair[kind][0]
                        lens = [len(r["tokens"]) for r in pair[kind][0]]
                else:
                    pair[kind] = run_together(engine, [make_request(prompts[i], picked[i], False, L, True)
                                                       for i, L in zip(idx, lens)])
                b8[kind].append(pair[kind])
            rg, rm = batch_rates([pair["guided"]]), batch_rates([pair["matched"]])
            pair_ratios.append((rg["decode_window_tok_s"] / rm["decode_window_tok_s"], rg["wall_tok_s"] / rm["wall_tok_s"]))
        b8["natural"].append(run_together(engine, [make_request(prompts[i], picked[i], False, n, False) for i in idx]))
        print(f"  batch {c} group {g // c}: done ({time.perf_counter() - T0:.0f} s)", flush=True)
    guided_lens = [len(r["tokens"]) for r in first_guided]
    rb8 = {k: batch_rates(v) for k, v in b8.items()}
    rb8["ratio_guided_vs_matched_decode_window"] = rb8["guided"]["decode_window_tok_s"] / rb8["matched"]["decode_window_tok_s"]
    rb8["ratio_guided_vs_matched_wall"] = rb8["guided"]["wall_tok_s"] / rb8["matched"]["wall_tok_s"]
    rb8["pair_ratios_decode_window"] = [round(a, 3) for a, _ in pair_ratios]
    rb8["pair_ratios_wall"] = [round(b, 3) for _, b in pair_ratios]
    rb8["ratio_median_of_pairs_decode_window"] = statistics.median(a for a, _ in pair_ratios)
    rb8["ratio_median_of_pairs_wall"] = statistics.median(b for _, b in pair_ratios)
    rb8["ratio_guided_vs_natural_wall"] = rb8["guided"]["wall_tok_s"] / rb8["natural"]["wall_tok_s"]
    rb8["in_engine_grammar"] = grammar_share(b8_calls)
    results[f"batch{c}"] = rb8
    print(f"batch {c}: {json.dumps(rb8)}", flush=True)

    # -- batch 1: guided and length-matched unguided, alternating which goes first ----------
    b1g, b1m, b1_calls = [], [], {}
    for i, (ids, p) in enumerate(zip(prompts, picked)):
        for kind in (("g", "m") if i % 2 == 0 else ("m", "g")):
            if kind == "g":
                timers.on = True
                b1g.append(run_one(engine, make_request(ids, p, True, n, False)))
                timers.on = False
                for k, v in timers.take().items():
                    b1_calls.setdefault(k, []).extend(v)
            else:
                b1m.append(run_one(engine, make_request(ids, p, False, guided_lens[i], True)))
    print(f"  batch 1: done ({time.perf_counter() - T0:.0f} s)", flush=True)
    rb1 = {"guided": b1_rates(b1g), "matched": b1_rates(b1m)}
    rb1["ratio_guided_vs_matched_decode"] = rb1["guided"]["decode_tok_s"] / rb1["matched"]["decode_tok_s"]
    per_prompt = [((len(a["tokens"]) - 1) / (a["t_end"] - a["t_first"])) / ((len(b["tokens"]) - 1) / (b["t_end"] - b["t_first"]))
                  for a, b in zip(b1g, b1m) if len(a["tokens"]) > 1]
    rb1["ratio_median_of_prompts_decode"] = statistics.median(per_prompt)
    rb1["in_engine_grammar"] = grammar_share(b1_calls)
    rb1["guided_tokens_equal_batch1_vs_batch8"] = f"{sum(a['tokens'] == b for a, b in zip(b1g, [r['tokens'] for r in first_guided]))}/{len(b1g)}"
    results["batch1"] = rb1
    print(f"batch 1: {json.dumps(rb1)}", flush=True)
    engine_guided = b1g
    engine_natural = [r for res, _ in b8["natural"] for r in res]
    errors = [(p["name"], r["error"]) for r, p in zip(engine_guided, picked) if r["error"]]
    if errors:
        print(f"engine errors: {errors}", flush=True)

    # -- transformers generate + xgrammar logits processor ----------------------------------
    hf_outs = None
    if not args.skip_hf:
        hf_outs = run_hf(model_dir, engine, prompts, picked, n)
        hf_tok = sum(len(o["tokens"]) for o in hf_outs)
        results["hf_xgrammar_b1_tok_s"] = hf_tok / sum(o["seconds"] for o in hf_outs)
        results["guided_tokens_equal_engine_vs_hf"] = f"{sum(a['tokens'] == b['tokens'] for a, b in zip(engine_guided, hf_outs))}/{len(hf_outs)}"
        print(f"  transformers + xgrammar: done ({time.perf_counter() - T0:.0f} s)", flush=True)
    engine.shutdown()

    val = {"engine_guided": validity(engine_guided, picked), "engine_unguided": validity(engine_natural, picked)}
    if hf_outs is not None:
        val["hf_xgrammar"] = validity(hf_outs, picked)
    results["validity"] = val
    results["outputs"] = [{"schema": p["name"], "guided": g["text"], "guided_finish": g["finish"],
                           "unguided": u["text"][:400], "hf_xgrammar": h["text"] if h else None}
                          for p, g, u, h in zip(picked, engine_guided, engine_natural, hf_outs or [None] * len(picked))]

    # -- compile and mask fill over the whole sample (bench_guided_compile.py) ---------------
    if not args.skip_compile:
        from transformers import AutoConfig, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model_dir))
        vocab = AutoConfig.from_pretrained(str(model_dir)).vocab_size
        svc = GrammarCompilerService(tok, vocab, max_workers=2)
        comp = bgc.bench_compile(svc, schemas)
        results["compile"] = {
            "schemas": len(schemas), "ok": len(comp["ok"]), "failed": [name for name, _ in comp["failed"]],
            **{f"{k}_{q}_ms": round(bgc.pct(comp[k], v) * 1e3, 3) for k in ("cold", "cached")
               for q, v in (("p50", .5), ("p99", .99), ("max", 1.0))},
            "cold_total_s": round(sum(comp["cold"]), 2), "pool_wall_s": round(comp["pool_wall"][0], 2)}
        ok = set(comp["ok"])
        grammars = [svc.compile(GuidedDecodingParams("json_schema", t)) for name, t in schemas if name in ok][:32]
        bias = bgc.token_bias(tok, vocab, svc.stop_token_ids)
        results["mask_fill"] = {}
        for b in [int(x) for x in args.fill_batch_sizes.split(",")]:
            fill_t, apply_t = bgc.bench_fill(svc, grammars, b, args.fill_steps, bias, 1)
            results["mask_fill"][b] = {f"{name}_us_per_row_{q}": round(bgc.pct(xs, v) * 1e6, 1)
                                       for name, xs in (("fill", fill_t), ("apply", apply_t))
                                       for q, v in (("p50", .5), ("p99", .99))}
        svc.shutdown()
    results["bench_seconds"] = round(time.perf_counter() - T0, 1)
    results["loadavg_1m_start_end"] = [round(load_start[0], 2), round(os.getloadavg()[0], 2)]

    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=float))


def print_table(r: dict) -> None:
    c = r["concurrency"]
    b1, b8 = r["batch1"], r[f"batch{c}"]
    print(f"\n== guided (json_schema) vs unguided, {len(r['schemas'])} prompts, greedy, max_tokens {r['max_tokens']} "
          f"({r['machine']}) ==")
    print(f"{'run':44s} {'tokens':>7s} {'tok/s':>8s} {'guided/unguided':>16s}")
    print(f"{'batch 1 guided, decode':44s} {b1['guided']['tokens']:7d} {b1['guided']['decode_tok_s']:8.2f}")
    print(f"{'batch 1 unguided length-matched, decode':44s} {b1['matched']['tokens']:7d} {b1['matched']['decode_tok_s']:8.2f} "
          f"{b1['ratio_guided_vs_matched_decode']:15.3f}x")
    for k, lab in (("guided", "guided"), ("matched", "unguided length-matched"), ("natural", "unguided natural")):
        print(f"{f'batch {c} {lab}, wall':44s} {b8[k]['tokens']:7d} {b8[k]['wall_tok_s']:8.2f}")
        print(f"{f'batch {c} {lab}, decode window':44s} {'':7s} {b8[k]['decode_window_tok_s']:8.2f}")
    print(f"ratio batch 1 guided/matched, decode: aggregate {b1['ratio_guided_vs_matched_decode']:.3f}x, "
          f"median of per-prompt pairs {b1['ratio_median_of_prompts_decode']:.3f}x")
    print(f"ratio batch {c} guided/matched: decode window aggregate {b8['ratio_guided_vs_matched_decode_window']:.3f}x, "
          f"median of pairs {b8['ratio_median_of_pairs_decode_window']:.3f}x {b8['pair_ratios_decode_window']}; "
          f"wall aggregate {b8['ratio_guided_vs_matched_wall']:.3f}x, median of pairs {b8['ratio_median_of_pairs_wall']:.3f}x "
          f"{b8['pair_ratios_wall']}; guided/natural wall {b8['ratio_guided_vs_natural_wall']:.3f}x")
    for lab, g in (("batch 1", b1["in_engine_grammar"]), (f"batch {c}", b8["in_engine_grammar"])):
        print(f"in-engine grammar work, {lab}: {json.dumps(g)}")
        if r["draft_tokens"] == 0 and "grammar_share_of_decode" in g:  # speculative steps bypass Runner.decode
            print(f"  -> fill+apply+advance = {g['grammar_share_of_decode']:.1%} of the guided decode calls' time: "
                  f"a load-insensitive estimate of the ratio, about {1 - g['grammar_share_of_decode']:.3f}x")
    if "hf_xgrammar_b1_tok_s" in r:
        print(f"transformers generate + xgrammar, batch 1: {r['hf_xgrammar_b1_tok_s']:.2f} tok/s (end to end); "
              f"guided tokens engine == transformers: {r['guided_tokens_equal_engine_vs_hf']}")
    print(f"guided tokens batch 1 == batch {c}: {b1['guided_tokens_equal_batch1_vs_batch8']}")
    print(f"\n{'validity':18s} {'parses':>7s} {'valid':>7s} {'parses*':>8s} {'valid*':>7s} {'stop':>5s} {'length':>7s} {'valid|stop':>11s} {'mean tok':>9s}")
    for k, v in r["validity"].items():
        print(f"{k:18s} {v['parses']:7.1%} {v['valid']:7.1%} {v['parses_fence_ok']:8.1%} {v['valid_fence_ok']:7.1%} "
              f"{v['stop']:5d} {v['length']:7d} {v['valid_among_stop']:11.1%} {v['mean_tokens']:9.1f}")
    print("(* = the content of a ```json fence when the whole text does not parse)")
    if "compile" in r:
        cp = r["compile"]
        print(f"\ncompile ({cp['ok']}/{cp['schemas']} ok): cold p50 {cp['cold_p50_ms']:.1f} ms, p99 {cp['cold_p99_ms']:.1f} ms, "
              f"max {cp['cold_max_ms']:.1f} ms (total {cp['cold_total_s']} s); cached p50 {cp['cached_p50_ms']:.3f} ms, "
              f"p99 {cp['cached_p99_ms']:.3f} ms; thread pool all {cp['schemas']}: {cp['pool_wall_s']} s")
        for b, v in r["mask_fill"].items():
            print(f"mask fill batch {b:>3}: {json.dumps(v)}")
    print(f"\nbench wall time {r['bench_seconds']} s; 1-minute load average at start / end: {r['loadavg_1m_start_end']}")


if __name__ == "__main__":
    main()
