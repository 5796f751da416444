"""What the KV cache's storage buys and costs: kv_cache_dtype float16 (served) vs int8, side by side.

    python bench/bench_kv_cache.py [--contexts 300,1000,2000] [--streams 8] [--new-tokens 64] [--rounds 3]

Speed: for each context length, `--streams` requests at once whose prompts are that many tokens
(held-out schema prompts and README text, cut to length; prefix caching off), greedy, `ignore_eos`;
decode tokens/s of all streams while every one decodes (from the last first token to the first
last token: no prefill chunk in those steps); and the first prompt's time to first token alone
(prefill attention reads the cache too); the engines alternate round by round and the best round
counts. Memory: the KV cache's bytes. Quality: the
teacher-forced logits of the same texts against the float32 model's (weights `auto`, float32
activations, float32 KV): KL and argmax agreement, served cache beside int8.
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "backend_src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import cpu_header  # noqa: E402

from specguide.config import EngineConfig  # noqa: E402
from specguide.engine.loop import Engine  # noqa: E402
from specguide.request import Request, SamplingParams  # noqa: E402
from specguide.training.prompts import load_schemas, schema_message  # noqa: E402


def texts(engine: Engine) -> list[list[int]]:
    tok = engine.tokenizer
    out = [tok.apply_chat_template([{"role": "user", "content": schema_message(t)}])
           for t in load_schemas("heldout", engine.core.compiler)[:8]]
    return [tok.encode(t) for t in out] + [tok.encode((ROOT / "README.md").read_text())]


def prompt_of(ids: list[list[int]], n: int, i: int) -> list[int]:
    """n tokens: text i, then the others after it, cut to n."""
    out: list[int] = []
    for j in range(len(ids)):
        out += ids[(i + j) % len(ids)]
        if len(out) >= n:
            break
    while len(out) < n:
        out += out
    return out[:n]


def decode_rate(engine: Engine, prompts: list[list[int]], new_tokens: int) -> float:
    """Tokens/s of all streams together while every one of them decodes: from the last stream's
    first token to the first stream's last (before it, prefill chunks share the steps)."""
    stamps: list[list[tuple[float, int]]] = [[] for _ in prompts]
    done = threading.Semaphore(0)

    def cb_for(i: int):
        def cb(out):
            if out.token_ids:
                stamps[i].append((time.perf_counter(), len(out.token_ids)))
            if out.finished:
                done.release()
        return cb

    for i, p in enumerate(prompts):
        engine.submit(Request(prompt_ids=p, num_draft_tokens=0,
                              params=SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)),
                      cb_for(i))
    for _ in prompts:
        assert done.acquire(timeout=1800)
    start, end = max(s[0][0] for s in stamps), min(s[-1][0] for s in stamps)
    tokens = sum(n for s in stamps for t, n in s if start < t <= end)
    assert end > start and tokens > 0, "the streams never all decoded at once: raise --new-tokens"
    return tokens / (end - start)


def ttft(engine: Engine, prompt: list[int]) -> float:
    """Seconds to one request's first token, alone (its whole prompt prefilled)."""
    t0, first = time.perf_counter(), threading.Event()
    engine.submit(Request(prompt_ids=prompt, num_draft_tokens=0, params=SamplingParams(max_tokens=1, temperature=0.0)),
                  lambda out: first.set() if out.finished else None)
    assert first.wait(timeout=600)
    return time.perf_counter() - t0


def logits_of(engine: Engine, ids: list[int]) -> torch.Tensor:
    m = engine.core.model
    own = engine.core.runner.kv.like(1, len(ids) + 16)
    ctx = m.make_context(torch.tensor([0]), torch.arange(len(ids))[None], [0], len(ids))
    with torch.no_grad():
        return m.logits(m(torch.tensor([ids]), ctx, own))[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="300,1000,2000")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quality-tokens", type=int, default=1500)
    args = ap.parse_args()
    print(cpu_header(), f"{torch.get_num_threads()} threads", flush=True)
    contexts = [int(c) for c in args.contexts.split(",")]
    S = max(contexts) + args.new_tokens + 16
    kinds = ("float16", "int8")
    engines = {k: Engine(EngineConfig(max_slots=args.streams, max_seq_len=S, num_draft_tokens=0, weight_dtype="auto",
                                      activation_dtype="int8", kv_cache_dtype=k, prefix_caching=False))
               for k in kinds}
    ids = texts(engines[kinds[0]])
    for k, e in engines.items():
        print(f"kv_cache_dtype {k}: KV cache {e.core.runner.kv.nbytes / 2**20:.0f} MiB ({args.streams} slots x {S})")
    print(f"\n| context | {' | '.join(f'{k} decode tok/s' for k in kinds)} | int8 / float16 | "
          f"{' | '.join(f'{k} TTFT alone (ms)' for k in kinds)} | int8 / float16 |")
    print("| ---: | " + " | ".join("---:" for _ in kinds) + " | ---: | " + " | ".join("---:" for _ in kinds) + " | ---: |")
    for n in contexts:
        prompts = [prompt_of(ids, n, i) for i in range(args.streams)]
        best, first = {k: 0.0 for k in kinds}, {k: float("inf") for k in kinds}
        for _ in range(args.rounds):
            for k in kinds:
                best[k] = max(best[k], decode_rate(engines[k], prompts, args.new_tokens))
                first[k] = min(first[k], ttft(engines[k], prompts[0]))
        print(f"| {n} | " + " | ".join(f"{best[k]:.1f}" for k in kinds) + f" | {best['int8'] / best['float16']:.3f} | "
              + " | ".join(f"{first[k] * 1e3:.0f}" for k in kinds) + f" | {first['int8'] / first['float16']:.3f} |",
              flush=True)
    for e in engines.values():
        e.shutdown()
    ref = Engine(EngineConfig(max_slots=1, max_seq_len=args.quality_tokens + 16, num_draft_tokens=0,
                              weight_dtype="auto", activation_dtype="float32", kv_cache_dtype="float32"))
    quality = {k: Engine(EngineConfig(max_slots=1, max_seq_len=args.quality_tokens + 16, num_draft_tokens=0,
                                      weight_dtype="auto", activation_dtype="int8", kv_cache_dtype=k))
               for k in kinds}
    print("\nAgainst the float32 model (teacher-forced): KL / argmax agreement")
    print(f"| text | tokens | {' | '.join(kinds)} |")
    print("| --- | ---: | " + " | ".join("---:" for _ in kinds) + " |")
    for i, t in enumerate(ids):
        t = t[:args.quality_tokens]
        want = logits_of(ref, t)
        row = []
        for k in kinds:
            got = logits_of(quality[k], t)
            kl = torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True,
                                            reduction="batchmean").item()
            row.append(f"{kl:.2e} / {(got.argmax(-1) == want.argmax(-1)).float().mean().item():.3f}")
        print(f"| {'README' if i == len(ids) - 1 else f'schema {i}'} | {len(t)} | " + " | ".join(row) + " |",
              flush=True)
    for e in (ref, *quality.values()):
        e.shutdown()


if __name__ == "__main__":
    main()
