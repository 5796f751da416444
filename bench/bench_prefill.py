"""Time to first token on schema prompts: this engine vs transformers, side by side (issue 14).

    python bench/bench_prefill.py [--runs auto,float32] [--prompts 8] [--repeats 3] [--json out.json]

Prompts: held-out JSON schemas in the chat template (`schema_message`, as the guided benchmarks
send them), the first `--prompts` whose length falls in [--min-tokens, --max-tokens] (300-600 by
default: the issue's schema prompts). For each prompt, in turn: transformers fp32 `generate` with
one new token, then each engine run (a `weight_dtype`; prefix caching off, so every request
prefills its whole prompt), `--repeats` times; the median per prompt and system. Reports the
median TTFT per system and its ratio to transformers (< 1: the engine is faster).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend_src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import cpu_header  # noqa: E402

from specguide.config import WEIGHT_DTYPES, EngineConfig  # noqa: E402
from specguide.engine.loop import Engine  # noqa: E402
from specguide.models.loader import resolve_model_dir  # noqa: E402
from specguide.request import Request, SamplingParams  # noqa: E402
from specguide.training.prompts import load_schemas, schema_message  # noqa: E402


def engine_ttft(engine: Engine, ids: list[int]) -> float:
    t0 = time.perf_counter()
    for ev in engine.generate(Request(prompt_ids=ids, params=SamplingParams(max_tokens=1, temperature=0))):
        if ev.token_ids:
            return time.perf_counter() - t0
    raise RuntimeError("no token")


def hf_ttft(hf, ids: list[int]) -> float:
    t0 = time.perf_counter()
    with torch.inference_mode():
        hf.generate(torch.tensor([ids]), max_new_tokens=1, do_sample=False, pad_token_id=0)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", default="auto,float32", help="engine weight_dtypes, comma-separated")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--min-tokens", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=600)
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args()
    runs = args.runs.split(",")
    for wd in runs:
        assert wd in WEIGHT_DTYPES, f"unknown weight_dtype {wd!r} (one of {WEIGHT_DTYPES})"
    print(cpu_header(), f"{torch.get_num_threads()} threads, torch {torch.__version__}", flush=True)
    engines = {wd: Engine(EngineConfig(weight_dtype=wd, max_slots=1, max_seq_len=2048, num_draft_tokens=0,
                                       prefix_caching=False)) for wd in runs}
    tok = next(iter(engines.values())).tokenizer
    prompts = []
    for schema in load_schemas("heldout"):
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": schema_message(schema)}]))
        if args.min_tokens <= len(ids) <= args.max_tokens:
            prompts.append(ids)
        if len(prompts) == args.prompts:
            break
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(resolve_model_dir(), dtype=torch.float32).eval()
    systems = {"transformers fp32": lambda ids: hf_ttft(hf, ids)}
    systems.update({f"engine {wd}": (lambda e: lambda ids: engine_ttft(e, ids))(e) for wd, e in engines.items()})
    for f in systems.values():  # warm-up
        f(prompts[0])
    per: dict[str, list[float]] = {name: [] for name in systems}
    for ids in prompts:
        times = {name: [] for name in systems}
        for _ in range(args.repeats):
            for name, f in systems.items():  # interleaved: the machine's load hits every system alike
                times[name].append(f(ids))
        for name in systems:
            per[name].append(statistics.median(times[name]))
        print(f"{len(ids)} tokens: " + ", ".join(f"{n} {statistics.median(t) * 1e3:.0f} ms" for n, t in times.items()),
              flush=True)
    base = statistics.median(per["transformers fp32"])
    result = {"machine": cpu_header(), "prompt_tokens": [len(p) for p in prompts], "median_ttft_ms": {},
              "ratio_to_transformers": {}}
    for name, ts in per.items():
        med = statistics.median(ts)
        result["median_ttft_ms"][name] = round(med * 1e3, 1)
        result["ratio_to_transformers"][name] = round(med / base, 2)
        print(f"{name}: median TTFT {med * 1e3:.0f} ms ({med / base:.2f}x transformers)")
    for e in engines.values():
        e.shutdown()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
