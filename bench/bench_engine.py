"""Engine vs transformers `generate`, side by side in one run (greedy, N new tokens).

    python bench/bench_engine.py [--new-tokens 128] [--runs float32:0,auto:0,int8:3] [--concurrency 8]

A run is `FORMAT:K`: FORMAT a `weight_dtype` (float32, auto, q4_1, q8_0, int8, w-bfloat16 for bf16
weights) or the compute dtype `bfloat16` / `float16`; K the draft tokens (0 = no speculation).

Reports, on the same prompts:
  * transformers generate, batch 1, one request after another (fp32)
  * this engine, batch 1: end-to-end tokens/s and decode tokens/s (after the first token)
  * this engine, N concurrent requests: aggregate tokens/s
and checks the engine's greedy tokens equal transformers' for the batch-1 runs.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
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

PROMPTS = [
    "<|im_start|>user\nExplain why the sky is blue in two paragraphs.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWrite a short story about a robot learning to paint.<|im_end|>\n<|im_start|>assistant\n",
    "def quicksort(arr):\n",
    "The history of the Roman Empire begins",
    "<|im_start|>user\nGive me a recipe for pancakes.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWhat are the benefits of regular exercise?<|im_end|>\n<|im_start|>assistant\n",
    "In a distant galaxy, a small planet",
    "<|im_start|>user\nSummarize the plot of Hamlet.<|im_end|>\n<|im_start|>assistant\n",
]


def bench_hf(model_dir: Path, prompts: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        hf.generate(torch.tensor([prompts[0]]), max_new_tokens=4, do_sample=False, pad_token_id=0)  # warm-up
        t0 = time.perf_counter()
        for ids in prompts:
            out = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                              pad_token_id=0)
            outs.append(out[0, len(ids):].tolist())
        dt = time.perf_counter() - t0
    del hf
    return sum(len(o) for o in outs) / dt, outs


def run_engine_sequential(engine: Engine, prompts: list[list[int]], n: int):
    e2e, decode, ttft, outs = [], [], [], []
    for ids in prompts:
        t0 = time.perf_counter()
        first = None
        toks: list[int] = []
        for ev in engine.generate(Request(prompt_ids=ids, params=SamplingParams(max_tokens=n, temperature=0,
                                                                                  ignore_eos=True))):
            if ev.token_ids and first is None:
                first = time.perf_counter()
            toks += ev.token_ids
        t1 = time.perf_counter()
        outs.append(toks)
        ttft.append(first - t0)
        e2e.append(len(toks) / (t1 - t0))
        decode.append((len(toks) - 1) / (t1 - first))
    return statistics.mean(e2e), statistics.mean(decode), statistics.median(ttft), outs


def run_engine_concurrent(engine: Engine, prompts: list[list[int]], n: int) -> float:
    done = threading.Semaphore(0)
    count = [0]

    def cb(ev):
        count[0] += len(ev.token_ids)
        if ev.finished:
            done.release()
    t0 = time.perf_counter()
    for ids in prompts:
        engine.submit(Request(prompt_ids=ids, params=SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)), cb)
    for _ in prompts:
        done.acquire()
    return count[0] / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--runs", default="float32:0,auto:0,float32:3,auto:3",
                    help="engine runs as FORMAT:K (see the module docstring; K = draft tokens, 0 = no speculation)")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args()
    n = args.new_tokens
    print(cpu_header(), flush=True)
    model_dir = resolve_model_dir()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok.encode(p) for p in PROMPTS[: args.concurrency]]
    seq_prompts = prompts[:4]
    results: dict[str, object] = {"machine": f"{cpu_header()}, {torch.get_num_threads()} threads, "
                                             f"torch {torch.__version__}",
                                  "new_tokens": n}
    hf_tps, hf_outs = bench_hf(model_dir, seq_prompts, n)
    results["hf_generate_fp32_b1_tok_s"] = round(hf_tps, 1)
    print(f"transformers generate fp32 batch 1: {hf_tps:.1f} tok/s", flush=True)
    for spec in args.runs.split(","):
        fmt, k = spec.split(":")
        if fmt in ("bfloat16", "float16"):  # the compute dtype (fp32 weights)
            dtype, wd = fmt, "float32"
        else:  # a weight format with fp32 compute; w-bfloat16 = bf16 weights
            dtype, wd = "float32", fmt.removeprefix("w-")
        assert wd in WEIGHT_DTYPES, f"unknown run {spec!r}"
        # CPU, n-gram drafts at a fixed K (no cost-aware budget): what the recorded results ran
        engine = Engine(EngineConfig(dtype=dtype, weight_dtype=wd, max_slots=max(8, args.concurrency),
                                     max_seq_len=1024, num_draft_tokens=int(k), device="cpu", drafter="ngram",
                                     cost_aware_k=False, prefix_caching=False))  # the runs repeat prompts
        run_engine_sequential(engine, seq_prompts[:1], 8)  # warm-up
        e2e, dec, ttft, outs = run_engine_sequential(engine, seq_prompts, n)
        agg = run_engine_concurrent(engine, prompts, n)
        engine.shutdown()
        same = sum(a == b for a, b in zip(outs, hf_outs))
        r = {"b1_e2e_tok_s": round(e2e, 1), "b1_decode_tok_s": round(dec, 1), "b1_ttft_s": round(ttft, 3),
             f"c{len(prompts)}_aggregate_tok_s": round(agg, 1), "greedy_equal_to_hf": f"{same}/{len(outs)}",
             "speedup_b1_decode_vs_hf": round(dec / hf_tps, 2),
             f"speedup_c{len(prompts)}_vs_hf_sequential": round(agg / hf_tps, 2)}
        results[f"engine_{fmt}_K{k}"] = r
        print(f"engine {fmt} K={k}: {json.dumps(r)}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
