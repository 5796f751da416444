"""The machine a benchmark ran on: CPU model and the vector flags the kernels use (every bench prints it)."""
from __future__ import annotations

import os
import platform
from pathlib import Path

FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            have = set(line.split(":", 1)[1].split())
            return [f for f in FLAGS if f in have]
    return []


def cpu_header() -> str:
    """One line: `CPU: <model> (<n> cores; flags ...)`."""
    return f"CPU: {cpu_model()} ({os.cpu_count()} cores; {' '.join(cpu_flags()) or 'no AVX2'})"
