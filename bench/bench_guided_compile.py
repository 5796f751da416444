"""Grammar compile time (cold and cached) over JSONSchemaBench, and mask-fill time per row per step.

    python bench/bench_guided_compile.py [--data-dir DIR (default: the shipped jsonschemabench_dev)]
        [--batch-sizes 1,8,32] [--steps 64] [--fill-schemas 32]

Compile: every schema once on a fresh compiler (cold, one at a time on the calling thread), then
again (cached), then all of them through the service's thread pool (wall time). Mask fill: B slots
decode model-free (highest random logit among the allowed tokens, biased to close strings) and
each step times `GuidedDecoder.fill` for all B rows in one batched call, and `apply` on [B, V].
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend_src"))

from specguide.guided import GrammarCompilerService, GuidedDecoder  # noqa: E402
from specguide.models.loader import resolve_model_dir  # noqa: E402
from specguide.request import GuidedDecodingParams, InvalidRequestError  # noqa: E402
from machine import cpu_header  # noqa: E402  (bench/ is on sys.path when run as a script)

REPO = Path(__file__).resolve().parents[1]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def summary(xs: list[float]) -> str:
    return f"p50 {pct(xs, .5) * 1e3:8.2f} ms   p99 {pct(xs, .99) * 1e3:8.2f} ms   max {max(xs) * 1e3:8.2f} ms   mean {statistics.mean(xs) * 1e3:7.2f} ms"


def bench_compile(svc: GrammarCompilerService, schemas: list[tuple[str, str]]) -> dict[str, list]:
    svc.clear_cache()
    out: dict[str, list] = {"cold": [], "cached": [], "ok": [], "failed": []}
    for name, text in schemas:
        t0 = time.perf_counter()
        try:
            svc.compile(GuidedDecodingParams("json_schema", text))
            out["ok"].append(name)
        except InvalidRequestError as e:
            out["failed"].append((name, str(e)))
        out["cold"].append(time.perf_counter() - t0)
    for name, text in schemas:
        t0 = time.perf_counter()
        try:
            svc.compile(GuidedDecodingParams("json_schema", text))
        except InvalidRequestError:
            pass
        out["cached"].append(time.perf_counter() - t0)
    svc.clear_cache()
    t0 = time.perf_counter()
    handles = [svc.submit(GuidedDecodingParams("json_schema", text)) for _, text in schemas]
    submit_s = time.perf_counter() - t0
    for h in handles:
        try:
            h.result()
        except InvalidRequestError:
            pass
    out["pool_wall"] = [time.perf_counter() - t0]
    out["submit"] = [submit_s]
    return out


def token_bias(tok, vocab: int, stop: list[int]) -> torch.Tensor:
    """Closing characters up, whitespace-only down, stop tokens way up: short outputs that end."""
    bias = torch.zeros(vocab)
    for t, i in tok.get_vocab().items():
        s = tok.convert_tokens_to_string([t])
        bias[i] = 3.0 * any(c in s for c in '"}]') - 3.0 * (s.strip() == "") + 2.0 * s.startswith(" ") - 0.1 * len(s)
    bias[stop] += 8.0
    return bias


def bench_fill(svc: GrammarCompilerService, grammars: list, batch: int, steps: int, bias: torch.Tensor,
               threads: int | str) -> tuple[list[float], list[float]]:
    """Per step: (fill seconds / rows, apply seconds / rows) for `batch` guided slots."""
    vocab = svc.vocab_size
    dec = GuidedDecoder(batch, 0, vocab, num_threads=threads)
    nxt = 0
    fill_t, apply_t = [], []
    gen = torch.Generator().manual_seed(0)
    for s in range(batch):
        dec.add(s, grammars[nxt % len(grammars)])
        nxt += 1
    for _ in range(steps):
        for s in range(batch):  # a finished slot takes the next grammar (in-flight batching)
            if dec.is_terminated(s) or dec.num_tokens(s) > 400:
                dec.remove(s)
                dec.add(s, grammars[nxt % len(grammars)])
                nxt += 1
        rows = [(s, 0) for s in range(batch)]
        t0 = time.perf_counter()
        dec.fill(rows)
        t1 = time.perf_counter()
        logits = torch.rand(batch, vocab, generator=gen) * 4 + bias
        t2 = time.perf_counter()
        dec.apply(logits, rows)
        t3 = time.perf_counter()
        for s, tok in enumerate(logits.argmax(-1).tolist()):
            assert dec.advance(s, tok)
        fill_t.append((t1 - t0) / batch)
        apply_t.append((t3 - t2) / batch)
    return fill_t, apply_t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default=str(REPO / "backend_src" / "specguide" / "training" / "data" / "jsonschemabench_dev"))
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--fill-schemas", type=int, default=32, help="compiled schemas cycled through the fill benchmark")
    ap.add_argument("--threads", default="auto", help="BatchGrammarMatcher threads: an int or auto")
    ap.add_argument("--json", help="also write the raw figures here")
    args = ap.parse_args()
    print(cpu_header(), flush=True)

    from transformers import AutoConfig, AutoTokenizer

    files = sorted(Path(args.data_dir).glob("*/*.json"))
    assert files, f"no schemas under {args.data_dir}"
    schemas = [(f"{f.parent.name}/{f.name}", f.read_text()) for f in files]
    model_dir = resolve_model_dir()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    vocab = AutoConfig.from_pretrained(str(model_dir)).vocab_size  # the logits' width
    svc = GrammarCompilerService(tok, vocab, max_workers=2)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; torch {torch.__version__}; "
          f"model {model_dir.name}, vocab {vocab}; {len(schemas)} schemas from {args.data_dir}")

    res = bench_compile(svc, schemas)
    n_ok = len(res["ok"])
    print(f"\ncompile rate: {n_ok}/{len(schemas)} = {n_ok / len(schemas):.1%}")
    for name, msg in res["failed"]:
        print(f"  failed: {name}: {msg}")
    print(f"cold   : {summary(res['cold'])}   total {sum(res['cold']):.1f} s")
    print(f"cached : {summary(res['cached'])}")
    print(f"pool ({svc._pool._max_workers} workers): all {len(schemas)} submitted in {res['submit'][0] * 1e3:.1f} ms, "
          f"done after {res['pool_wall'][0]:.1f} s")

    ok = set(res["ok"])
    grammars = [svc.compile(GuidedDecodingParams("json_schema", t)) for n, t in schemas if n in ok][: args.fill_schemas]
    bias = token_bias(tok, vocab, svc.stop_token_ids)
    threads = args.threads if args.threads == "auto" else int(args.threads)
    report = {"compile": {k: v for k, v in res.items() if k in ("cold", "cached", "pool_wall")}, "fill": {}}
    print(f"\nmask fill + apply, per row per step ({args.steps} steps, {len(grammars)} schemas, threads={threads}):")
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        fill_t, apply_t = bench_fill(svc, grammars, b, args.steps, bias, threads)
        report["fill"][b] = {"fill": fill_t, "apply": apply_t}
        print(f"  batch {b:3d}: fill p50 {pct(fill_t, .5) * 1e6:7.1f} us  p99 {pct(fill_t, .99) * 1e6:7.1f} us  "
              f"mean {statistics.mean(fill_t) * 1e6:6.1f} us   apply p50 {pct(apply_t, .5) * 1e6:6.1f} us  "
              f"p99 {pct(apply_t, .99) * 1e6:6.1f} us")
    if args.json:
        Path(args.json).write_text(json.dumps(report))
    svc.shutdown()


if __name__ == "__main__":
    main()
