"""The build of ops.c: compiled once per machine with the system C compiler (no torch headers: about
a second), cached under the key of its source, CPU and flags, and loaded with ctypes.

`library()` owns the one loaded library of the process; when no compiler is available it is None
and `unavailable_reason()` says why (the callers fall back to torch ops)."""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional

import torch

from ..util.paths import cache_dir
from . import tune
from .bindings import INT_DOT_PATHS, declare

log = logging.getLogger("specguide")
HERE = Path(__file__).resolve().parent
_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_error: Optional[str] = None


def _cpu_key() -> str:
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line
                break
    except OSError:
        pass
    return platform.machine() + flags


def _build() -> ctypes.CDLL:
    folder, key, _ = _target()
    lib = variant(tune.rows_per_pass(folder, key, variant))
    lib.set_prefetch(tune.prefetch_blocks(folder, key, lib, torch.get_num_threads()))
    return lib


# NOTE: -ffp-contract=off: the compiler never fuses a product and a sum by itself (its choice varies
# with the loop and the -mtune target, and broke batch / query-count invariance on Zen 3); ops.c
# writes every FMA out and refuses to build without the define
FLAGS = ["-O3", "-ffp-contract=off", "-DSPECGUIDE_FP_CONTRACT_OFF", "-fopenmp"]


@functools.cache
def _target() -> tuple[Path, str, list[str]]:
    """(cache folder, key of this source + CPU + -march, the -march flags): read once per process."""
    # NOTE: SPECGUIDE_KERNEL_MARCH (e.g. "-march=x86-64-v3" = AVX2) builds another ISA's path on this
    # machine: the tests check every path here, whatever CPU runs them
    march = os.environ.get("SPECGUIDE_KERNEL_MARCH", "-march=native").split()
    src = (HERE / "ops.c").read_bytes()
    key = hashlib.sha1(src + _cpu_key().encode() + " ".join(FLAGS + march).encode()).hexdigest()[:16]
    folder = cache_dir() / "kernels"
    folder.mkdir(parents=True, exist_ok=True)
    return folder, key, march


def variant(rb: int) -> ctypes.CDLL:
    """The kernels built for this machine with RB = rb rows per pass (kernels/tune.py)."""
    folder, key, march = _target()
    return declare(ctypes.CDLL(str(_compile(folder, key, march, rb))))


def _compile(folder: Path, key: str, march: list[str], rb: int) -> Path:
    """ops.c built for this machine with RB = rb (once: the file is cached under its key)."""
    out = folder / f"ops-{key}-rb{rb}.so"
    if out.exists():
        return out
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc/cc) found")
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    # NOTE: -march=native: the cache key includes the CPU flags, so a copy never runs on another CPU;
    # the vector paths (AVX-512, AVX2, portable) are chosen at compile time from what this CPU has
    cmd = [cc, *FLAGS, *march, f"-DRB={rb}", "-shared", "-fPIC", str(HERE / "ops.c"), "-o", tmp, "-lm"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def library() -> Optional[ctypes.CDLL]:
    """The compiled kernels, or None (see `unavailable_reason()`)."""
    global _lib, _error
    with _lock:
        if _lib is None and _error is None:
            try:
                _lib = _build()
            except Exception as exc:  # no compiler, no OpenMP, read-only cache...
                _error = f"{type(exc).__name__}: {exc}"
                log.warning("specguide: C kernels unavailable (%s); using torch ops", _error)
        return _lib


def integer_dot_path() -> Optional[str]:
    """How this build sums the integer-dot formats: "vnni" (dpbusd: AVX-512 VNNI, or AVX-VNNI on an AVX2
    build), "maddubs" (AVX2 or AVX-512BW), "scalar" (portable C); None without the kernels."""
    lib = library()
    return None if lib is None else INT_DOT_PATHS[lib.int_dot_path()]


def use_integer_dot(activation_dtype: str) -> bool:
    """EngineConfig.activation_dtype -> whether block-format weights take int8 activations: "auto"
    does where the build has a vector integer path (measured ~2x faster: bench/bench_kernels.py)."""
    if activation_dtype == "auto":
        return integer_dot_path() in ("vnni", "maddubs")
    return activation_dtype == "int8"


def unavailable_reason() -> Optional[str]:
    library()
    return _error
