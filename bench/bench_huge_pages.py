"""The KV cache in huge pages against 4 KiB pages: the default model's layer stack side by side.

    python bench/bench_huge_pages.py [--rounds 10] [--positions 300,1000]

One process, one model (served: Q4_1 x int8, fp16 KV cache), two KV caches of the served shape
(8 slots x max_seq_len 2048): one as `KVCache` allocates it (`kv_cache.huge_zeros`: advised for
2 MiB pages before its first touch), one by `torch.zeros` (4 KiB pages). The steps the engine
runs (decode of 1 and 8 sequences, a K=3 verification of 1 and 8, a 256-token prefill chunk) at
each cached length, the two caches alternated per round (drift hits them alike); p25 and median
of every call. Checks the two give the same bits. Prints what this machine's transparent huge
pages setting is and how much of each cache the kernel backed with huge pages (smaps).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend_src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import cpu_header  # noqa: E402
from specguide.engine.kv_cache import huge_zeros  # noqa: E402
from specguide.util.memory import huge_page_kb  # noqa: E402
from specguide.models.loader import load_model, resolve_model_dir  # noqa: E402

STEPS = ((1, 1, 60), (8, 1, 20), (1, 4, 40), (8, 4, 8))  # (sequences, queries each, calls a round)
SLOTS, MAX_SEQ = 8, 2048


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--positions", default="300,1000")
    args = ap.parse_args()
    print(cpu_header(), flush=True)
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    print("transparent_hugepage:", thp.read_text().strip() if thp.exists() else "(none)")
    model = load_model(resolve_model_dir(), torch.float32, "cpu", "auto", True)
    fused, cfg = model.fused, model.cfg
    L, kvh, hd = len(fused), cfg.num_kv_heads, cfg.head_dim
    MB = MAX_SEQ // 16  # the paged layout, each slot its own run of blocks (block 0: no slot's)
    kshape, vshape = (L, 1 + SLOTS * MB, kvh, hd, 16), (L, 1 + SLOTS * MB, kvh, 16, hd)
    table = (1 + torch.arange(SLOTS * MB, dtype=torch.int32)).view(SLOTS, MB)
    g = torch.Generator().manual_seed(0)
    k0, v0 = (torch.randn(kshape, generator=g) * 0.5).half(), (torch.randn(vshape, generator=g) * 0.5).half()
    caches = {"4 KiB": (torch.zeros(kshape, dtype=torch.float16), torch.zeros(vshape, dtype=torch.float16)),
              "huge": (huge_zeros(kshape, torch.float16), huge_zeros(vshape, torch.float16))}
    for kc, vc in caches.values():
        kc.copy_(k0), vc.copy_(v0)
    for name, (kc, vc) in caches.items():
        print(f"{name}: {(huge_page_kb(kc.data_ptr(), kc.nbytes) + huge_page_kb(vc.data_ptr(), vc.nbytes)) >> 10} of {(kc.nbytes + vc.nbytes) >> 20} MiB in huge pages")
    tables = model.rope_tables(MAX_SEQ)
    print(f"\n| step | cached positions | 4 KiB p25 / median ms | huge p25 / median ms | huge / 4 KiB (p25, median) | same bits |")
    print("| --- | ---: | --- | --- | --- | --- |")
    steps = [(B, T, p, n) for p in (int(x) for x in args.positions.split(",")) for B, T, n in STEPS]
    steps.append((1, 256, 0, 2))
    for B, T, p0, n in steps:
        x = torch.randn(B, T, cfg.hidden_size, generator=g) * 0.5
        slots = torch.arange(B, dtype=torch.int64)
        pos = (p0 + torch.arange(T, dtype=torch.int64)).expand(B, T).contiguous()
        times: dict[str, list[float]] = {n_: [] for n_ in caches}
        outs = {}
        for r in range(args.rounds):
            for name in (list(caches) if r % 2 == 0 else list(caches)[::-1]):
                kc, vc = caches[name]
                for _ in range(n):
                    t0 = time.perf_counter()
                    outs[name] = fused(x, (*tables, *tables), kc, vc, table, slots, pos)
                    times[name].append(time.perf_counter() - t0)
        same = torch.equal(outs["4 KiB"], outs["huge"])
        (a, b) = (sorted(times["4 KiB"]), sorted(times["huge"]))
        pa, pb, ma, mb = a[len(a) // 4], b[len(b) // 4], statistics.median(a), statistics.median(b)
        step = "prefill chunk" if T > 4 else "verification" if T > 1 else "decode"
        print(f"| {step}, {B} x {T} | {p0} | {pa * 1e3:.2f} / {ma * 1e3:.2f} | {pb * 1e3:.2f} / {mb * 1e3:.2f} | "
              f"{pb / pa:.3f}, {mb / ma:.3f} | {'yes' if same else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()
