"""Per-machine choice of the GEMM kernel's rows per pass (`RB` in ops.c), measured once and cached.

RB rows of x share each pass over a weight tile: more rows reuse each loaded weight more, but
keep RB x NV vector accumulators live (NV = 64 / vector width: 4 with AVX-512's 32 registers, 8
with AVX2's 16), besides the widened weights. Which RB is fastest is a property of the CPU and
compiler, and more rows can cost decode: on AVX-512, RB 6 ties RB 4 on prefill but its 24
accumulators plus the Q4_1 widening spill registers and made the batch-1 GEMV 7.6% slower. So it
is measured here: each candidate is built and timed on decode, verification and prefill shapes
(one thread, CPU time of this thread, so other processes on a shared machine do not decide it;
best of several interleaved rounds), and the choice is cached next to the built kernels. RB never
changes a result: a row's sums are the same operations whatever RB is (tests/unit/test_kernels.py
checks every candidate bit for bit).

The software prefetch distance of the block-format GEMVs (`set_prefetch` in ops.c) is measured the
same way, but where it matters: batch-1 GEMVs in the format a decode step streams (Q4_1 x int8
where the build has an integer path) over more weights than the L3 cache holds, with the serving
thread count and wall time, on the built library (no rebuilds).
"""
from __future__ import annotations

import ctypes
import json
import logging
import os
import time
from pathlib import Path
from typing import Callable

import torch

log = logging.getLogger("specguide")
CANDIDATES = (1, 2, 3, 4, 6, 8)
DEFAULT = 4
MARGIN = 0.05  # another RB replaces the default only when its summed relative time is this much lower
# (weight format, rows B, inputs I, outputs O): decode and verification (B <= 16, the served
# default's q4_1 weights in integer dot products, fp32 weights, q4_1 widened) and a prefill chunk
SHAPES = (("q4_1_q8", 1, 576, 3072), ("float32", 1, 576, 3072), ("q4_1_q8", 4, 1536, 576),
          ("float32", 4, 1536, 576), ("q4_1_q8", 16, 576, 1536), ("q4_1", 4, 1536, 576), ("float32", 128, 576, 1536))
ROUNDS = 5
CALLS = 10  # per timing: the decode shapes take ~20 us


def _nibbles_shape(fmt: str, I: int, O: int) -> tuple[int, ...]:
    """The packed Q4_1 nibbles of an [O, I] weight: [O/64, I, 32], or in 4-input groups for the
    integer kernels (q4_1_q8) [O/64, I/4, 32, 4]."""
    return (O // 64, I, 32) if fmt == "q4_1" else (O // 64, I // 4, 32, 4)


def _timer(lib: ctypes.CDLL, fmt: str, B: int, I: int, O: int, g: torch.Generator) -> Callable[[], float]:
    x, y = torch.randn(B, I, generator=g), torch.empty(B, O)
    if fmt in ("q4_1", "q4_1_q8"):  # any values do for timing; fp16 d and m [O/64, I/32, 2, 64]
        packed = torch.randint(0, 256, _nibbles_shape(fmt, I, O), generator=g, dtype=torch.uint8)
        dm = (torch.rand(O // 64, I // 32, 2, 64, generator=g) * 0.01).half()
        fn = getattr(lib, f"gemv_{fmt}")

        def call() -> None:
            fn(x.data_ptr(), packed.data_ptr(), dm.data_ptr(), None, y.data_ptr(), B, I, O, 1)
    else:  # packed fp32 [O/64, I, 64]
        w = torch.randn(O // 64, I, 64, generator=g)

        def call() -> None:
            lib.gemv_f32(x.data_ptr(), w.data_ptr(), None, y.data_ptr(), B, I, O, 1)

    def timed() -> float:
        t0 = time.thread_time()
        for _ in range(CALLS):
            call()
        return time.thread_time() - t0
    return timed


def measure(build: Callable[[int], ctypes.CDLL]) -> dict[int, float]:
    """Per candidate RB: the sum over SHAPES of its best time relative to the best candidate's
    (1.0 per shape at best), so the ~20-us decode GEMVs weigh as much as a prefill GEMM."""
    libs = {rb: build(rb) for rb in CANDIDATES}
    g = torch.Generator().manual_seed(0)
    timers = {rb: [_timer(lib, *shape, g=g) for shape in SHAPES] for rb, lib in libs.items()}
    best = {rb: [float("inf")] * len(SHAPES) for rb in libs}
    for _ in range(ROUNDS):
        for rb in libs:  # interleaved: a slow moment hits every candidate alike
            for s, timed in enumerate(timers[rb]):
                best[rb][s] = min(best[rb][s], timed())
    floor = [min(best[rb][s] for rb in libs) for s in range(len(SHAPES))]
    return {rb: sum(t / f for t, f in zip(best[rb], floor)) for rb in libs}


def _record(cache: Path, key: str) -> dict:
    """What tuned-{key}.json holds (empty when missing or unreadable)."""
    try:
        return json.loads((cache / f"tuned-{key}.json").read_text())
    except (OSError, ValueError):
        return {}


def _save(cache: Path, key: str, fields: dict) -> None:
    path = cache / f"tuned-{key}.json"
    record = _record(cache, key)
    record.update(fields)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def _tuned(cache: Path, key: str, field: str, default: int, measure: Callable[[], dict[int, float]],
           times_field: str, what: str) -> int:
    """`field` for this machine (`key`: the source, CPU flags and -march): forced, cached, else
    measured: the candidate with the least time, unless it is within MARGIN of `default` (the noise
    of a shared machine); saved with its candidates' times under `times_field`. A record without
    `times_field` was measured another way: measured again."""
    forced = os.environ.get(f"SPECGUIDE_KERNEL_{field}")  # tests, benchmarks
    if forced:
        return int(forced)
    record = _record(cache, key)
    if field in record and times_field in record:  # measured the way this version measures it
        return int(record[field])
    try:
        times = measure()
    except Exception as exc:  # noqa: BLE001 - a candidate that does not build or run: the default is correct
        log.warning("specguide: kernel tuning of the %s failed (%s); %s=%d", what, exc, field, default)
        return default
    best = min(times, key=times.get)
    if times[best] > times[default] * (1 - MARGIN):
        best = default
    log.info("specguide: kernel %s %s=%d (%s: %s)", what, field, best, times_field,
             {k: round(v, 3) for k, v in times.items()})
    _save(cache, key, {field: best, times_field: {str(k): round(v, 4) for k, v in times.items()}})
    return best


def rows_per_pass(cache: Path, key: str, build: Callable[[int], ctypes.CDLL]) -> int:
    """RB for this machine: cached, else measured (time relative to the best, summed over SHAPES).
    SPECGUIDE_KERNEL_RB forces one (tests, benchmarks)."""
    return _tuned(cache, key, "RB", DEFAULT, lambda: measure(build), "relative", "rows per pass")


PF_CANDIDATES = (0, 2, 4, 6, 8)  # blocks of 32 inputs ahead (0: no software prefetch)
STREAM_BYTES = 64 << 20  # at least; twice the L3 cache where it is larger


def _l3_bytes() -> int:
    try:
        size = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        return int(size[:-1]) << (10 if size[-1] == "K" else 20) if size[-1] in "KM" else int(size)
    except (OSError, ValueError, IndexError):
        return 0


def prefetch_format(lib: ctypes.CDLL) -> str:
    """The block format a decode step streams with these kernels: Q4_1 times int8 activations where
    the build has a vector integer path (`activation_dtype` auto), else Q4_1 widened to fp32."""
    return "q4_1_q8" if lib.int_dot_path() > 0 else "q4_1"


def measure_prefetch(lib: ctypes.CDLL, threads: int) -> dict[int, float]:
    """Per prefetch distance: the best wall time of one pass of batch-1 GEMVs in the served block
    format (`prefetch_format`) over more distinct weights than the L3 cache holds (interleaved rounds)."""
    fmt = prefetch_format(lib)
    I, O = 576, 3072  # a SmolLM2 gate|up: 1.1 MB of nibbles, 0.2 MB of scales
    per = (O // 64) * I * 32 + (O // 64) * (I // 32) * 2 * 64 * 2
    n = -(-max(STREAM_BYTES, 2 * _l3_bytes()) // per)
    mats = [(torch.full(_nibbles_shape(fmt, I, O), 0x35, dtype=torch.uint8),  # written: no lazily mapped zero pages
             torch.full((O // 64, I // 32, 2, 64), 0.01, dtype=torch.float16)) for _ in range(n)]
    x, y = torch.randn(1, I), torch.empty(1, O)
    fn = getattr(lib, f"gemv_{fmt}")

    def one_pass() -> float:
        t0 = time.perf_counter()
        for w, dm in mats:
            fn(x.data_ptr(), w.data_ptr(), dm.data_ptr(), None, y.data_ptr(), 1, I, O, threads)
        return time.perf_counter() - t0
    best = {pf: float("inf") for pf in PF_CANDIDATES}
    try:
        for _ in range(ROUNDS):
            for pf in PF_CANDIDATES:
                lib.set_prefetch(pf)
                best[pf] = min(best[pf], one_pass())
    finally:
        lib.set_prefetch(0)
    return best


def prefetch_blocks(cache: Path, key: str, lib: ctypes.CDLL, threads: int) -> int:
    """The prefetch distance for this machine: cached, else measured (`measure_prefetch`, ms per
    stream); none stays unless another is MARGIN faster. SPECGUIDE_KERNEL_PF forces one."""
    def ms() -> dict[int, float]:
        return {pf: t * 1e3 for pf, t in measure_prefetch(lib, threads).items()}
    return _tuned(cache, key, "PF", 0, ms, f"prefetch_ms_{prefetch_format(lib)}", "prefetch distance")
