"""Prefill with the invariant C attention kernel vs SDPA, side by side (issue 17, chunk-invariant prefill).

    python bench/bench_prefill_attention.py [--tokens 256,512,1024] [--chunk 256] [--weight-dtype auto]
        [--repeats 5] [--json out.json]

The default model's forward over a prompt of N tokens from position 0 (one slot of an 8-slot cache
of 2048 positions), the attention of every chunk either in the C kernel (`invariant_prefill`: what
the engine runs) or in SDPA over a mask (the engine before: chunk-variant). Two splits: the whole
prompt in one chunk, and chunks of `--chunk` (the engine's prefill_chunk). Runs alternate between
the two attention paths, so machine load lands on both; prints the median and best of `--repeats`,
and the largest logit difference between the two (they differ in the last bits, not more).
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

from specguide.engine.kv_cache import KVCache  # noqa: E402
from specguide.models.loader import load_model, resolve_model_dir  # noqa: E402


@torch.inference_mode()
def prefill(model, kv: KVCache, ids: list[int], chunk: int) -> tuple[float, torch.Tensor]:
    """Seconds for the forward of `ids` into slot 0 in chunks of `chunk`; the last position's logits."""
    t0 = time.perf_counter()
    for a in range(0, len(ids), chunk):
        b = min(len(ids), a + chunk)
        ctx = model.make_context(torch.tensor([0]), torch.arange(a, b)[None], [0], b)
        hidden = model(torch.tensor([ids[a:b]]), ctx, kv)
    logits = model.logits(hidden[:, -1])
    return time.perf_counter() - t0, logits


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="256,512,1024")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--weight-dtype", default="auto")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    print(cpu_header())
    model = load_model(resolve_model_dir(), torch.float32, "cpu", args.weight_dtype)
    assert model.invariant_attention, "the C kernels are unavailable"
    cfg = model.cfg
    # the SDPA path needs torch's cache layout, the kernel its own
    caches = {kernel: KVCache(cfg.num_layers, 8, cfg.num_kv_heads, 2048, cfg.head_dim, torch.float32,
                              kernel_layout=kernel) for kernel in (False, True)}
    g = torch.Generator().manual_seed(0)
    rows = []
    print(f"weights {args.weight_dtype}, {torch.get_num_threads()} threads; seconds: median (best) of {args.repeats}")
    print("| tokens | split | SDPA (s) | kernel (s) | kernel / SDPA | max logit diff |")
    print("| --- | --- | --- | --- | --- | --- |")
    for n in (int(x) for x in args.tokens.split(",")):
        ids = torch.randint(100, cfg.vocab_size, (n,), generator=g).tolist()
        for chunk in sorted({n, args.chunk}, reverse=True):
            times: dict[bool, list[float]] = {False: [], True: []}
            logits = {}
            for _ in range(args.repeats + 1):  # the first round warms up
                for kernel in (False, True):
                    model.invariant_prefill = kernel
                    t, logits[kernel] = prefill(model, caches[kernel], ids, chunk)
                    times[kernel].append(t)
            model.invariant_prefill = True
            sdpa, kern = (times[k][1:] for k in (False, True))
            diff = (logits[True] - logits[False]).abs().max().item()
            row = dict(tokens=n, chunk=chunk, sdpa_s=statistics.median(sdpa), kernel_s=statistics.median(kern),
                       sdpa_best_s=min(sdpa), kernel_best_s=min(kern), max_logit_diff=diff)
            rows.append(row)
            split = "one chunk" if chunk >= n else f"chunks of {chunk}"
            print(f"| {n} | {split} | {row['sdpa_s']:.3f} ({row['sdpa_best_s']:.3f}) | {row['kernel_s']:.3f} "
                  f"({row['kernel_best_s']:.3f}) | {row['kernel_s'] / row['sdpa_s']:.2f} | {diff:.1e} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(cpu=cpu_header(), rows=rows), indent=1))


if __name__ == "__main__":
    main()
