"""CUDA graphs vs eager steps on a GPU: tokens/s at batch 1, 4, 16, 32, guided vs unguided,
speculation on vs off, and the CPU time exposed per step.

    python bench/bench_cuda_graphs.py [--batches 1,4,16,32] [--max-tokens 128] [--drafter ngram]
                                      [--dtype float32] [--model-dir DIR]
                                      [--mask-threads 1,8] [--json /tmp/bench_cuda_graphs.json]

Each configuration submits `batch` requests at once (greedy) after one untimed run of the same
shape (graph capture, allocator warm-up). Guided requests carry a JSON schema and end with the
grammar; unguided ones ignore EOS. Speculation on = K=3 (`--drafter`), spec_max_rows=0.

Columns: tok/s (generated tokens / wall time), steps/s, exposed CPU ms/step (graphs: host time
per step outside the wait for the replayed step, during which the GPU idles; eager: the whole step
wall time is an upper bound, the host launches every kernel), grammar callback ms/step (CPU work
the captured callbacks do, overlapped with the forwards).
`--mask-threads`: the guided rows under graphs once more per further guided_mask_threads value
(threads filling a step's grammar masks; the first value serves every other row).
Refuses to run without a CUDA device.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend_src"))

import torch  # noqa: E402
from machine import cpu_header  # noqa: E402  (bench/ is on sys.path when run as a script)

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}}, "required": ["name", "age", "city"]}
PEOPLE = ["Alice is 30 and lives in Paris.", "Bob, 41, from Berlin.", "Carol (25) lives in Rome.",
          "Dan is 60; home: Oslo.", "Eve, 35, Madrid.", "Frank (52) lives in Vienna.",
          "Grace is 28, from Dublin.", "Heidi, 44, Lisbon."]


def requests(engine, batch: int, guided: bool, k: int, max_tokens: int):
    from specguide.request import GuidedDecodingParams, Request, SamplingParams

    out = []
    for i in range(batch):
        who = PEOPLE[i % len(PEOPLE)]
        text = f"Extract name, age and city as JSON matching {json.dumps(SCHEMA)}: {who}"
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])
        out.append(Request(prompt=prompt, num_draft_tokens=k,
                           guided=GuidedDecodingParams("json_schema", json.dumps(SCHEMA)) if guided else None,
                           params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=not guided)))
    return out


def run_batch(engine, reqs) -> tuple[int, float]:
    done = threading.Semaphore(0)
    counts = [0] * len(reqs)

    def cb_for(i):
        def cb(o):
            counts[i] += len(o.token_ids)
            if o.finished:
                done.release()
        return cb
    t0 = time.perf_counter()
    for i, r in enumerate(reqs):
        engine.submit(r, cb_for(i))
    for _ in reqs:
        done.acquire()
    return sum(counts), time.perf_counter() - t0


def measure(engine, batch, guided, k, max_tokens) -> dict:
    steps = [0, 0.0]
    original = engine.core.step

    def step():
        t = time.perf_counter()
        try:
            return original()
        finally:
            steps[0] += 1
            steps[1] += time.perf_counter() - t
    run_batch(engine, requests(engine, batch, guided, k, max_tokens))  # warm-up: captures this shape
    g = engine.core.step_graphs
    st0 = (g.stats.steps, g.stats.wait_s) if g else (0, 0.0)
    cb0 = engine.core.guided.stepper.worker.callback_s
    engine.core.step = step
    try:
        tokens, wall = run_batch(engine, requests(engine, batch, guided, k, max_tokens))
    finally:
        del engine.core.step
    n = max(steps[0], 1)
    graph_steps = g.stats.steps - st0[0] if g else 0
    # graphs: everything but the wait for the replayed step is host time with the GPU idle
    # (the few eager prefill steps count whole); eager: the step's wall time, an upper bound
    exposed = (steps[1] - (g.stats.wait_s - st0[1])) / n if graph_steps else steps[1] / n
    return {"batch": batch, "guided": guided, "K": k, "tokens": tokens, "wall_s": wall,
            "tok_s": tokens / wall, "steps": steps[0], "graph_steps": graph_steps,
            "step_ms": 1e3 * steps[1] / n, "exposed_cpu_ms_per_step": 1e3 * exposed,
            "callback_ms_per_step": 1e3 * (engine.core.guided.stepper.worker.callback_s - cb0) / n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,4,16,32")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--drafter", default="ngram", choices=["ngram", "early_exit", "hybrid", "head", "draft_model"])
    ap.add_argument("--draft-head", default="", help="draft head file for hybrid / head (default: the trained head)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--model-dir", default="", help="model folder (default: the default model); "
                                                    "scripts/make_random_model.py makes one in a larger shape")
    ap.add_argument("--fixed-k", action="store_true", help="draft K tokens every step (adaptive_k off): "
                    "step times of K=3 with a random model, whose drafts are rarely accepted")
    ap.add_argument("--mask-threads", default="1", help="comma list of guided_mask_threads values")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    print(cpu_header(), flush=True)
    if not torch.cuda.is_available():
        sys.exit("bench_cuda_graphs.py measures CUDA graphs and needs a CUDA GPU; none is visible here "
                 "(run it on a GPU host: python bench/bench_cuda_graphs.py).")
    from specguide.config import EngineConfig
    from specguide.engine.loop import Engine

    batches = [int(b) for b in args.batches.split(",")]
    threads = [int(t) for t in args.mask_threads.split(",")]
    rows = []
    for graphs, mask_threads in [(True, threads[0]), (False, threads[0])] + [(True, t) for t in threads[1:]]:
        engine = Engine(EngineConfig(device="cuda", dtype=args.dtype, max_slots=max(batches), max_seq_len=1024,
                                     prefill_chunk=512, num_draft_tokens=3, drafter=args.drafter,
                                     spec_max_rows=0, cuda_graphs=graphs, max_queue=1024,
                                     draft_head_path=args.draft_head, model_dir=args.model_dir,
                                     adaptive_k=not args.fixed_k, guided_mask_threads=mask_threads))
        try:
            for batch in batches:
                for guided in (False, True):
                    if mask_threads != threads[0] and not guided:
                        continue
                    for k in (0, 3):
                        r = measure(engine, batch, guided, k, args.max_tokens)
                        r["graphs"], r["mask_threads"] = graphs, mask_threads
                        rows.append(r)
                        print(f"graphs={graphs!s:5} batch={batch:3} guided={guided!s:5} K={k} "
                              f"mask threads {mask_threads} "
                              f"{r['tok_s']:8.1f} tok/s  {r['step_ms']:6.2f} ms/step  {r['tokens'] / max(r['steps'], 1):4.2f} tok/step  "
                              f"exposed CPU {r['exposed_cpu_ms_per_step']:6.2f} ms/step  "
                              f"callbacks {r['callback_ms_per_step']:5.2f} ms/step", flush=True)
        finally:
            engine.shutdown()
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}, drafter {args.drafter}, "
          f"max_tokens {args.max_tokens}, model {args.model_dir or 'default'}\n")
    print("| batch | guided | K | graphs tok/s | eager tok/s | speed-up | graphs exposed CPU ms/step | "
          "eager ms/step | callbacks ms/step |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in [x for x in rows if x["graphs"] and x["mask_threads"] == threads[0]]:
        e = next(x for x in rows if not x["graphs"] and (x["batch"], x["guided"], x["K"]) == (r["batch"], r["guided"], r["K"]))
        print(f"| {r['batch']} | {'yes' if r['guided'] else 'no'} | {r['K']} | {r['tok_s']:.0f} | {e['tok_s']:.0f} | "
              f"{r['tok_s'] / e['tok_s']:.2f}x | {r['exposed_cpu_ms_per_step']:.2f} | {e['step_ms']:.2f} | "
              f"{r['callback_ms_per_step']:.2f} |")
    if len(threads) > 1:
        print("\n| batch | K | guided tok/s under graphs by mask threads " + " / ".join(map(str, threads))
              + " | callbacks ms/step | guided / unguided |")
        print("| ---: | ---: | --- | --- | --- |")
        for batch in batches:
            for k in (0, 3):
                un = next(x for x in rows if x["graphs"] and not x["guided"] and (x["batch"], x["K"]) == (batch, k))
                g = [next(x for x in rows if x["graphs"] and x["guided"] and x["mask_threads"] == t
                          and (x["batch"], x["K"]) == (batch, k)) for t in threads]
                print(f"| {batch} | {k} | " + " / ".join(f"{x['tok_s']:.0f}" for x in g) + " | "
                      + " / ".join(f"{x['callback_ms_per_step']:.2f}" for x in g) + " | "
                      + " / ".join(f"{x['tok_s'] / un['tok_s']:.2f}x" for x in g) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
