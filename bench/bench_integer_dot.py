"""One forward of the default model per batch shape, block formats widened to fp32 vs in integer
dot products, per ISA build; against the time to stream its weights from memory (issue 36).

    python bench/bench_integer_dot.py [--marches native,x86-64-v3] [--threads 2] [--json out.json]

Per build (SPECGUIDE_KERNEL_MARCH, a process of its own; `x86-64-v3` is the AVX2 build, made and
run on this CPU) and per `activation_dtype` (float32: the GGUF blocks widened to fp32; int8: the
same blocks times int8 activations), `weight_dtype` auto: the best of 15 forwards + logits at
(rows B, queries T) = (1, 1) decode, (1, 4) a K=3 verification, (4, 1), (8, 1), (16, 1) batched
decode, at position 200 of each row's slot. Prints ms, the ratio to (1, 1), and batch-1 decode
against the weights' streaming time (bytes / the read bandwidth measured first: a 512 MB sum).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import cpu_header  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ((1, 1), (1, 4), (4, 1), (8, 1), (16, 1))
POS = 200
CHILD = """
import json, sys, time, torch
from specguide import kernels
from specguide.engine.kv_cache import KVCache
from specguide.models.loader import load_model, resolve_model_dir
torch.set_num_threads(int(sys.argv[1]))
out = {"path": kernels.integer_dot_path()}
folder = resolve_model_dir("")
for act in ("float32", "int8"):
    m = load_model(folder, torch.float32, "cpu", "auto", integer_dot=act == "int8")
    out[act + " bytes"] = sum(x.packed.numel() * x.packed.element_size()
                              + (0 if x.scale is None else x.scale.numel() * x.scale.element_size())
                              for x in m.modules() if hasattr(x, "packed"))
    cfg = m.cfg
    kv = KVCache(cfg.num_layers, 16, cfg.num_kv_heads, 512, cfg.head_dim, torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for B, T in %r:
            slots = list(range(B))
            pos = torch.arange(%d, %d + T).expand(B, T)
            ctx = m.make_context(torch.tensor(slots), pos, slots, %d + T)
            ids = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
            step = lambda: m.logits(m(ids, ctx, kv))
            step()
            best = float("inf")
            for _ in range(15):
                t = time.perf_counter(); step(); best = min(best, time.perf_counter() - t)
            out[f"{act} B={B} T={T}"] = best
    del m, kv
print(json.dumps(out))
""" % (SHAPES, POS, POS, POS)


def read_bandwidth(threads: int) -> float:
    """GB/s of a 512 MB fp32 sum (best of 5), torch with `threads` threads."""
    import torch

    torch.set_num_threads(threads)
    x = torch.ones(128 * 1024 * 1024)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        float(x.sum())
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--marches", default="native,x86-64-v3")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    bw = read_bandwidth(args.threads)
    print(cpu_header(), f"{args.threads} threads; read bandwidth {bw:.1f} GB/s", flush=True)
    results = {"bandwidth_gb_s": bw}
    for march in args.marches.split(","):
        env = {**os.environ, "SPECGUIDE_KERNEL_MARCH": f"-march={march}", "PYTHONPATH": str(ROOT / "backend_src")}
        p = subprocess.run([sys.executable, "-c", CHILD, str(args.threads)], env=env, capture_output=True,
                           text=True, check=True)
        r = results[march] = json.loads(p.stdout.strip().splitlines()[-1])
        print(f"\n{march} build (integer path: {r['path']})")
        print(f"{'rows x queries':16s}{'float32 (widened)':>26s}{'int8 (integer dot)':>26s}{'int8 / float32':>16s}")
        for B, T in SHAPES:
            f, i = r[f"float32 B={B} T={T}"], r[f"int8 B={B} T={T}"]
            f1, i1 = r["float32 B=1 T=1"], r["int8 B=1 T=1"]
            print(f"B={B:<2d} T={T:<9d}{f * 1e3:12.2f} ms ({f / f1:4.2f}x){i * 1e3:12.2f} ms ({i / i1:4.2f}x)"
                  f"{i / f:15.2f}x")
        for act in ("float32", "int8"):
            stream = r[f"{act} bytes"] / (bw * 1e9)
            print(f"{act}: weights {r[f'{act} bytes'] / 1e6:.1f} MB, streaming {stream * 1e3:.2f} ms; "
                  f"batch-1 decode {r[f'{act} B=1 T=1'] * 1e3:.2f} ms = {r[f'{act} B=1 T=1'] / stream:.2f}x streaming")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
