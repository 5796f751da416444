"""Two versions of the C kernels side by side: a git revision's vs this tree's.

    python bench/bench_kernel_ab.py [--what gemm|attention|forward] [--against HEAD] [--marches native,x86-64-v3] [--rounds 7]

Builds `kernels/ops.c` of `--against` and of the working tree with the flags the engine uses
(one -march each), loads both into one process and times the served integer formats (q4_1_q8,
q8_0_q8) on the default model's shapes at B = 1, 4, 8, 16 rows, streamed from memory as in a
forward (copies of the packed weights, 128 MiB in all, called in turn), the two builds alternated
`--rounds` times: the best round of each. Checks that both give the same bits (a kernel change
that moves work around must not change a sum). Prints ms and each build's B rows relative to
B = 1 (issue 36's goal: B = 4 <= 1.5x, B = 16 <= 3x).

`--what attention`: the fused RoPE + attention call (`rope_attn_f32`) on the default model's
attention geometry (9 query heads, 3 KV heads, 64 dims) in the steps the engine runs: decode
(T = 1), verification (T = 4: K = 3), a prefill chunk (T = 64), at 300 and 1000 cached positions,
with the fp16 KV cache served by default and fp32; 30 layers' caches called in turn (streamed, as
in a forward). Same bits checked, outputs and the cache written.

`--what forward`: the default model's whole layer stack in one `forward_f32` call, as served
(Q4_1 weights x int8 activations, fp16 KV cache), in the steps the engine runs: decode of 1 and 8
sequences and a K=3 verification of 8 (at 300 cached positions), and a 256-token prefill chunk.
Same bits checked on the hidden states and the cache.
"""
from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "backend_src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernels import SHAPES  # noqa: E402  (the default model's projections)
from machine import cpu_header  # noqa: E402
from specguide import kernels  # noqa: E402

ROWS = (1, 4, 8, 16)
FORMATS = ("q4_1_q8", "q8_0_q8")
SRC = "backend_src/specguide/kernels/ops.c"


class _Lenient(ctypes.CDLL):
    """A build of an older revision: functions it lacks declare as nothing (the A/B calls only shared ones)."""

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return types.SimpleNamespace()


def build(source: str, march: str, out: Path) -> ctypes.CDLL:
    src = out.with_suffix(".c")
    src.write_text(source)
    subprocess.run(["gcc", *kernels.FLAGS, *f"-march={march}".split(), "-DRB=4", "-shared", "-fPIC", str(src), "-o",
                    str(out), "-lm"], check=True)
    lib = kernels.bindings.declare(_Lenient(str(out)))
    lib.set_prefetch(2)
    return lib


def compare(libs: dict[str, ctypes.CDLL], rounds: int, threads: int) -> dict:
    g = torch.Generator().manual_seed(0)
    best: dict = {}
    for I, O in SHAPES:
        W = torch.randn(O, I, generator=g) * 0.05
        for fmt in FORMATS:
            p = kernels.pack_weight(W, fmt)
            nbytes = sum(t.numel() * t.element_size() for t in p)
            copies = [tuple(t.clone() for t in p) for _ in range(-(-(128 << 20) // nbytes))]
            for B in ROWS:
                x = torch.randn(B, I, generator=g)
                ys = {n: torch.empty(B, -(-O // 64) * 64) for n in libs}
                times: dict[str, list[float]] = {n: [] for n in libs}
                for _ in range(rounds):
                    for n, lib in libs.items():
                        fn = lib.gemv_q4_1_q8 if fmt == "q4_1_q8" else lib.gemv_q8_0_q8
                        y = ys[n]
                        t0 = time.perf_counter()
                        for c in copies:
                            fn(x.data_ptr(), c[0].data_ptr(), c[1].data_ptr(), None, y.data_ptr(), B, I, O, threads)
                        times[n].append((time.perf_counter() - t0) / len(copies))
                first = next(iter(ys.values()))[:, :O]
                same = all(torch.equal(y[:, :O], first) for y in ys.values())
                best[(fmt, I, O, B)] = ({n: min(t) for n, t in times.items()}, same)
    return best


ATTENTION = ((8, 1, 300), (8, 1, 1000), (1, 1, 300), (8, 4, 300), (8, 4, 1000), (1, 4, 300), (1, 64, 300))
NH, KVH, HD, LAYERS = 9, 3, 64, 30


OLD_ATTN = ([ctypes.c_void_p] * 5 + [ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_int] * 6
            + [ctypes.c_float, ctypes.c_int, ctypes.c_float, ctypes.c_int])  # rope_attn_f32 before the paged cache


def paged(kc: torch.Tensor, vc: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-slot caches [B, kvh, S/16, hd, 16] / [B, kvh, S, hd] as the paged kernel's blocks and table:
    each sequence's blocks in a run, or dealt out in turns (as sequences decoding together grow)."""
    B, kvh, nb, hd, kb = kc.shape
    ids = torch.arange(B * nb).view(nb, B).t() if interleaved else torch.arange(B * nb).view(B, nb)
    table = (1 + ids).to(torch.int32).contiguous()
    kp = torch.zeros(1 + B * nb, kvh, hd, kb, dtype=kc.dtype)
    vp = torch.zeros(1 + B * nb, kvh, kb, hd, dtype=vc.dtype)
    kp[table.long()] = kc.permute(0, 2, 1, 3, 4)
    vp[table.long()] = vc.view(B, kvh, nb, kb, hd).permute(0, 2, 1, 3, 4)
    return kp, vp, table


def compare_attention(libs: dict[str, ctypes.CDLL], rounds: int, threads: int, kinds: dict[str, str]) -> dict:
    """kinds: each build's cache ("slots": per-slot, before the paged cache; "runs" / "turns": paged)."""
    g = torch.Generator().manual_seed(0)
    best: dict = {}
    for n, lib in libs.items():
        if kinds[n] == "slots":
            lib.rope_attn_f32.argtypes = OLD_ATTN
    for dtype in (torch.float16, torch.float32):
        for B, T, p0 in ATTENTION:
            S = (p0 + T + 15) // 16 * 16
            qkv = torch.randn(B, T, NH + 2 * KVH, HD, generator=g)
            cos, sin = torch.randn(S, HD, generator=g), torch.randn(S, HD, generator=g)
            base = [(torch.randn(B, KVH, S // 16, HD, 16, generator=g).to(dtype),
                     torch.randn(B, KVH, S, HD, generator=g).to(dtype)) for _ in range(LAYERS)]
            caches = {n: [(k.clone(), v.clone()) if kinds[n] == "slots" else paged(k, v, kinds[n] == "turns")
                          for k, v in base] for n in libs}  # the same values for every build
            first = next(iter(caches))
            slots = torch.arange(B, dtype=torch.int64)
            pos = (p0 + torch.arange(T, dtype=torch.int64)).expand(B, T).contiguous()
            outs = {n: torch.empty(B, T, NH, HD) for n in libs}
            qrot = torch.empty(B, T, NH, HD)
            times: dict[str, list[float]] = {n: [] for n in libs}
            for _ in range(rounds):
                for n, lib in libs.items():
                    t0 = time.perf_counter()
                    for c in caches[n]:
                        kvk = int(dtype == torch.float16)
                        if kinds[n] == "slots":
                            lib.rope_attn_f32(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), c[0].data_ptr(),
                                              c[1].data_ptr(), kvk, slots.data_ptr(), pos.data_ptr(),
                                              qrot.data_ptr(), outs[n].data_ptr(), B, T, NH, KVH, S, HD, HD ** -0.5, 0,
                                              0.0, threads)
                        else:
                            lib.rope_attn_f32(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), c[0].data_ptr(),
                                              c[1].data_ptr(), kvk, c[2].data_ptr(), c[2].shape[1], slots.data_ptr(),
                                              pos.data_ptr(), qrot.data_ptr(), outs[n].data_ptr(), B, T, NH, KVH, HD,
                                              HD ** -0.5, 0, 0.0, threads)
                    times[n].append((time.perf_counter() - t0) / LAYERS)
            same = all(torch.equal(o, outs[first]) for o in outs.values())
            best[(str(dtype).removeprefix("torch."), B, T, p0)] = ({n: min(t) for n, t in times.items()}, same)
    return best


FORWARD = ((1, 1, 300), (8, 1, 300), (8, 4, 300), (1, 256, 0))  # (B, T, cached positions)


def compare_forward(libs: dict[str, ctypes.CDLL], rounds: int, threads: int) -> dict:
    from specguide.models.loader import load_model, resolve_model_dir

    model = load_model(resolve_model_dir(), torch.float32, "cpu", "auto", True)
    fused, cfg = model.fused, model.cfg
    assert fused is not None
    L, kvh, hd, S = len(fused), cfg.num_kv_heads, cfg.head_dim, 512
    g = torch.Generator().manual_seed(0)
    best: dict = {}
    for B, T, p0 in FORWARD:
        kc0 = (torch.randn(L, B, kvh, S // 16, hd, 16, generator=g) * 0.5).half()
        vc0 = (torch.randn(L, B, kvh, S, hd, generator=g) * 0.5).half()
        x = torch.randn(B, T, cfg.hidden_size, generator=g) * 0.5
        slots = torch.arange(B, dtype=torch.int64)
        pos = (p0 + torch.arange(T, dtype=torch.int64)).expand(B, T).contiguous()
        tables = model.rope_tables(S)
        outs, caches = {}, {}
        times: dict[str, list[float]] = {n: [] for n in libs}
        for _ in range(rounds):
            for n, lib in libs.items():
                kernels.build._lib = lib  # the stack calls kernels.library(), which hands out this
                kc, vc = kc0.clone(), vc0.clone()
                t0 = time.perf_counter()
                outs[n] = fused(x, (*tables, *tables), kc, vc, slots, pos)
                times[n].append(time.perf_counter() - t0)
                caches[n] = (kc, vc)
        first = next(iter(libs))
        same = all(torch.equal(outs[n], outs[first]) and torch.equal(caches[n][0], caches[first][0])
                   and torch.equal(caches[n][1], caches[first][1]) for n in libs)
        best[(B, T, p0)] = ({n: min(t) for n, t in times.items()}, same)
    return best


def print_forward(res: dict, names: tuple[str, str], march: str, rounds: int) -> None:
    print(f"\n-march={march}: forward_f32 of the default model's layers, ms (best of {rounds})")
    print(f"| step | B | T | positions | {names[0]} ms | tree ms | tree / {names[0]} | same bits |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for (B, T, p0), (t, same) in res.items():
        step = "prefill chunk" if T > 4 else "verification" if T > 1 else "decode"
        print(f"| {step} | {B} | {T} | {p0} | {t[names[0]] * 1e3:.2f} | {t['tree'] * 1e3:.2f} | "
              f"{t['tree'] / t[names[0]]:.2f} | {'yes' if same else 'NO'} |")


def print_attention(res: dict, names: tuple[str, ...], march: str, rounds: int) -> None:
    print(f"\n-march={march}: rope_attn_f32, us per layer (best of {rounds}; {LAYERS} layers' caches in turn)")
    print(f"| KV cache | B | T | positions | " + " | ".join(f"{n} us" for n in names)
          + " | " + " | ".join(f"{n} / {names[0]}" for n in names[1:]) + " | same bits |")
    print("| --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in range(2 * len(names) - 1)) + " | --- |")
    for (dt, B, T, p0), (t, same) in res.items():
        print(f"| {dt} | {B} | {T} | {p0} | " + " | ".join(f"{t[n] * 1e6:.1f}" for n in names) + " | "
              + " | ".join(f"{t[n] / t[names[0]]:.2f}" for n in names[1:]) + f" | {'yes' if same else 'NO'} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--what", choices=("gemm", "attention", "forward"), default="gemm")
    ap.add_argument("--against", default="HEAD", help="git revision whose ops.c is the baseline")
    ap.add_argument("--marches", default="native,x86-64-v3")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    print(cpu_header(), f"{args.threads} threads", flush=True)
    torch.set_num_threads(args.threads)
    old = subprocess.run(["git", "-C", str(ROOT), "show", f"{args.against}:{SRC}"], check=True,
                         capture_output=True, text=True).stdout
    new = (ROOT / SRC).read_text()
    names = (args.against, "tree")
    with tempfile.TemporaryDirectory() as tmp:
        for march in args.marches.split(","):
            libs = {n: build(s, march, Path(tmp) / f"{i}-{march}.so") for i, (n, s) in enumerate(zip(names, (old, new)))}
            if args.what == "attention":  # the tree's paged cache: each sequence's blocks in a run, or dealt in turns
                libs["tree, blocks dealt in turns"] = build(new, march, Path(tmp) / f"turns-{march}.so")
                kinds = {args.against: "runs" if "pages_t" in old else "slots", "tree": "runs",
                         "tree, blocks dealt in turns": "turns"}
                print_attention(compare_attention(libs, args.rounds, args.threads, kinds), tuple(libs), march,
                                args.rounds)
                continue
            if args.what == "forward":
                print_forward(compare_forward(libs, args.rounds, args.threads), names, march, args.rounds)
                continue
            res = compare(libs, args.rounds, args.threads)
            print(f"\n-march={march}: streamed ms (best of {args.rounds}), rows B relative to B=1")
            print(f"| format | shape | B | {names[0]} ms | tree ms | tree / {names[0]} | same bits |")
            print("| --- | --- | ---: | ---: | ---: | ---: | --- |")
            for (fmt, I, O, B), (t, same) in res.items():
                print(f"| {fmt} | {I}x{O} | {B} | {t[names[0]] * 1e3:.4f} | {t['tree'] * 1e3:.4f} | "
                      f"{t['tree'] / t[names[0]]:.2f} | {'yes' if same else 'NO'} |")
            print(f"\n| format | shape | {names[0]}: B=4 / B=8 / B=16 vs B=1 | tree: B=4 / B=8 / B=16 vs B=1 |")
            print("| --- | --- | --- | --- |")
            for fmt in FORMATS:
                for I, O in SHAPES:
                    cells = [" / ".join(f"{res[(fmt, I, O, B)][0][n] / res[(fmt, I, O, 1)][0][n]:.2f}x"
                                        for B in ROWS[1:]) for n in names]
                    print(f"| {fmt} | {I}x{O} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
