"""Give freed heap memory back to the OS (glibc `malloc_trim`); read a process's RSS and CPU time;
back big long-lived buffers with huge pages.

After a big request (a multi-megabyte prompt tensor) or a big grammar compile, glibc keeps the
freed arenas mapped: the stub's RSS stays up for good. `trim()` returns them; it is cheap (a few
milliseconds) and rate-limited so bursts of big requests do not call it in a loop.

`advise_huge_pages` asks for 2 MiB pages under a buffer (where transparent huge pages are on:
"always" or "madvise", the usual default): the KV cache (kv_cache.huge_zeros), which a decode step
streams, with 4 KiB pages a TLB miss and a restart of the hardware prefetcher every 4 KiB
(bench/bench_huge_pages.py).
"""
from __future__ import annotations

import ctypes
import os
import re
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
try:
    _madvise = _libc.madvise
    _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    _madvise.restype = ctypes.c_int
except (NameError, AttributeError):
    _madvise = None
_MADV_HUGEPAGE, _MADV_COLLAPSE = 14, 25  # Linux
HUGE_PAGE = 2 << 20


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


def available_bytes() -> int:
    """Memory the system can give without swapping (/proc/meminfo MemAvailable; else free pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds a process has run (None if it is gone or there is no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime (stat fields 14, 15)
    except (OSError, IndexError, ValueError):
        return None


def advise_huge_pages(address: int, nbytes: int, collapse: bool = False) -> int:
    """Ask the kernel to back the whole 2 MiB pages inside [address, address + nbytes) with huge
    pages: MADV_HUGEPAGE (pages touched from then on), and with `collapse` MADV_COLLAPSE (Linux 6.1+:
    now, the pages already touched too; where a page fault found no free huge page, e.g. while other
    processes churn memory, its range had stayed in 4 KiB pages). Returns the bytes advised (0:
    none, e.g. not Linux, under 2 MiB, or madvise refused)."""
    if _madvise is None or not os.path.exists("/sys/kernel/mm/transparent_hugepage"):
        return 0
    a, b = -(-address // HUGE_PAGE) * HUGE_PAGE, (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    if b - a < HUGE_PAGE or _madvise(a, b - a, _MADV_HUGEPAGE) != 0:
        return 0
    if collapse:
        _madvise(a, b - a, _MADV_COLLAPSE)  # best effort (EINVAL before 6.1, EAGAIN without memory)
    return b - a


def huge_page_kb(address: int, nbytes: int) -> int:
    """kB of transparent huge pages (smaps' AnonHugePages) in this process's mappings that overlap
    [address, address + nbytes) (0 without /proc)."""
    kb, inside = 0, False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
                if m:
                    inside = int(m[1], 16) < address + nbytes and int(m[2], 16) > address
                elif inside and line.startswith("AnonHugePages:"):
                    kb += int(line.split()[1])
    except OSError:
        return 0
    return kb
