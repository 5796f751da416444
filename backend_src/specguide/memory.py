"""Give freed heap memory back to the OS (glibc `malloc_trim`); read a process's RSS and CPU time.

After a big request (a multi-megabyte prompt tensor) or a big grammar compile, glibc keeps the
freed arenas mapped: the stub's RSS stays up for good. `trim()` returns them; it is cheap (a few
milliseconds) and rate-limited so bursts of big requests do not call it in a loop.
"""
from __future__ import annotations

import ctypes
import os
import threading
import time

_MIN_INTERVAL_S = 0.5
_lock = threading.Lock()
_last = 0.0
try:
    _libc = ctypes.CDLL("libc.so.6")
    _malloc_trim = _libc.malloc_trim
    _malloc_trim.argtypes = [ctypes.c_size_t]
    _malloc_trim.restype = ctypes.c_int
except (OSError, AttributeError):  # not glibc: nothing to do
    _malloc_trim = None


def trim(force: bool = True) -> bool:
    """`malloc_trim(0)`; with `force=False` at most once per 0.5 s. True when it ran."""
    global _last
    if _malloc_trim is None:
        return False
    with _lock:
        now = time.monotonic()
        if not force and now - _last < _MIN_INTERVAL_S:
            return False
        _last = now
    _malloc_trim(0)
    return True


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size of a process (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds a process has run (None if it is gone or there is no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime (stat fields 14, 15)
    except (OSError, IndexError, ValueError):
        return None
