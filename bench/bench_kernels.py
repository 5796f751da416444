"""The C GEMV/GEMM kernels per ISA path vs torch `F.linear` (MKL), on the default model's shapes (issue 14).

    python bench/bench_kernels.py [--marches native,x86-64-v3,x86-64] [--threads 2]

Each ISA path is built on this machine (SPECGUIDE_KERNEL_MARCH: `x86-64-v3` is the AVX2-only
build, `x86-64` the portable one) with its tuned rows per pass, in a process of its own, and
timed on the projections of one SmolLM2 layer (576 -> 1728 q|k|v + ... as packed by the engine:
576x1536 gate|up halves, 1536x576 down) at rows B = 1, 4, 16, 256, float32 weights and the block formats both ways: widened to fp32
(q4_1, q8_0) and in integer dot products with int8 activations (q4_1_q8, q8_0_q8).
torch `F.linear` (MKL, fp32) is the vendor baseline, timed in the same process as each build.
Prints the best of 20 (B <= 16) or 5 (B = 256) calls, ms, and GFLOP/s.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import cpu_header  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ((576, 960), (576, 3072), (1536, 576))  # (I, O): q|k|v, gate|up, down of SmolLM2-135M
ROWS = (1, 4, 16, 256)
# fp32 weights; GGUF blocks widened to fp32 (the dequantized model's bits); the same blocks times
# int8 activations in integer dot products (issue 36)
FORMATS = ("float32", "q4_1", "q4_1_q8", "q8_0", "q8_0_q8")
CHILD = """
import json, sys, time, torch
import torch.nn.functional as F
from specguide import kernels
torch.set_num_threads(int(sys.argv[1]))
g = torch.Generator().manual_seed(0)
lib = kernels.library()
out = {}
for I, O in %r:
    W = torch.randn(O, I, generator=g) * 0.05
    packs = {fmt: kernels.pack_weight(W, fmt) for fmt in %r}
    for B in %r:
        x = torch.randn(B, I, generator=g)
        runs = {"torch F.linear": lambda: F.linear(x, W)}
        runs.update({f"C {fmt}": (lambda p: lambda: kernels.gemv(x, *p, O))(p) for fmt, p in packs.items()})
        for name, f in runs.items():
            f()
            best = float("inf")
            for _ in range(20 if B <= 16 else 5):
                t = time.perf_counter(); f(); best = min(best, time.perf_counter() - t)
            out[f"{name} B={B} {I}x{O}"] = best
print(json.dumps(out))
""" % (SHAPES, FORMATS, ROWS)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--marches", default="native,x86-64-v3,x86-64")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args()
    print(cpu_header(), f"{args.threads} threads", flush=True)
    results = {}
    for march in args.marches.split(","):
        env = {**os.environ, "SPECGUIDE_KERNEL_MARCH": f"-march={march}",
               "PYTHONPATH": str(ROOT / "backend_src")}
        p = subprocess.run([sys.executable, "-c", CHILD, str(args.threads)], env=env, capture_output=True,
                           text=True, check=True)
        results[march] = json.loads(p.stdout.strip().splitlines()[-1])
    names = list(next(iter(results.values())))
    print(f"{'call':44s}" + "".join(f"{m:>22s}" for m in results))
    for name in names:
        kind, rest = name.split(" B=")
        B = int(rest.split()[0])
        I, O = map(int, rest.split()[1].split("x"))
        cells = "".join(f"{r[name] * 1e3:9.3f} ms {2 * B * I * O / r[name] / 1e9:6.1f} GF"
                        for r in results.values())
        print(f"{name:44s}{cells}")
    print("\nrows B cost relative to B=1 (per format and shape; issue 36's goal for q4_1 / q8_0: B=4 <= 1.5x, B=16 <= 3x)")
    for march, r in results.items():
        for I, O in SHAPES:
            for fmt in ("C " + f for f in FORMATS):
                one = r[f"{fmt} B=1 {I}x{O}"]
                print(f"  {march:12s} {fmt:10s} {I}x{O}: " + "  ".join(
                    f"B={B} {r[f'{fmt} B={B} {I}x{O}'] / one:5.2f}x" for B in ROWS[1:3]))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
