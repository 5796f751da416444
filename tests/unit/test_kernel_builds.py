"""Exact on every build: the invariants hold whatever ISA and tuning the kernels are compiled for.

Each build runs tests/unit/build_exactness.py in a process of its own (batch, query-count and
chunk-split invariance of the kernels and of whole models). The builds are those users' CPUs get:
the portable x86-64 path, AVX2 (x86-64-v3, Zen 3's ISA), AVX2 with AVX-VNNI (Intel's AVX2 CPUs since
Alder Lake), AVX-512 (x86-64-v4), this CPU's native one, and other CPUs' tunings (-mtune changes
which products the compiler would fuse into FMAs: it broke the invariants on Zen 3 until the kernels
fixed every rounding in the source). A build this CPU cannot execute skips with its reason."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from specguide import kernels

pytestmark = pytest.mark.skipif(kernels.library() is None, reason=f"no C compiler: {kernels.unavailable_reason()}")

CHECK = Path(__file__).with_name("build_exactness.py")
V3 = ("avx2", "fma", "f16c", "bmi2")
V4 = V3 + ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")
# torch's own kernels limited to the same ISA (its per-row ops in the model: norms, embeddings)
TORCH_ISA = {"-march=x86-64": {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
             "-march=x86-64-v3": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}}
BUILDS = {  # SPECGUIDE_KERNEL_MARCH -> the CPU flags it needs
    "-march=x86-64": (),
    "-march=x86-64-v3": V3,
    "-march=x86-64-v3 -mtune=znver3": V3,
    "-march=x86-64-v3 -mtune=icelake-server": V3,
    "-march=x86-64-v3 -mavxvnni": V3 + ("avx_vnni",),  # AVX2 + AVX-VNNI (Alder Lake, Sierra Forest): dpbusd on 8 lanes
    "-march=x86-64-v4": V4,
    "-march=x86-64-v4 -mtune=sapphirerapids": V4,
    "-march=native": (),
    "-march=native -mtune=znver3": (),
    "-march=native -mtune=skylake": (),
}


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.parametrize("march", list(BUILDS))
def test_every_build_keeps_the_invariants(march):
    if platform.machine() != "x86_64" and march != "-march=native":
        pytest.skip(f"{march}: an x86-64 build")
    missing = [f for f in BUILDS[march] if f not in _cpu_flags()]
    if missing:
        pytest.skip(f"{march} does not run on this CPU (no {', '.join(missing)})")
    # RB and the prefetch distance fixed: tuning would build 6 variants per build (every RB gives
    # the same bits: test_kernels.test_rows_per_pass_never_changes_a_bit)
    env = {**os.environ, "SPECGUIDE_KERNEL_MARCH": march, "SPECGUIDE_KERNEL_RB": "4", "SPECGUIDE_KERNEL_PF": "0",
           **TORCH_ISA.get(march.split()[0], {})}
    p = subprocess.run([sys.executable, str(CHECK)], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-3000:]
