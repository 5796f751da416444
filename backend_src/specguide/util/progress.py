"""Progress lines for long offline jobs (draft-head training): done/total, rate and ETA, at most
every `every_s` seconds and at the end. Thread-safe (engine callbacks report from the loop thread)."""
from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("specguide")


class Progress:
    """`Progress("generate", 300, "answers")`; `.update()` per item; logs `generate: 40/300 answers
    (13%), 2.1/s, ETA 2m04s`."""

    def __init__(self, phase: str, total: int, unit: str = "items", every_s: float = 10.0):
        self.phase, self.total, self.unit, self.every_s = phase, max(1, total), unit, every_s
        self.done = 0
        self.t0 = self.last = time.perf_counter()
        self._lock = threading.Lock()
        log.info("%s: 0/%d %s", phase, total, unit)

    def update(self, n: int = 1) -> None:
        with self._lock:
            self.done += n
            now = time.perf_counter()
            if now - self.last < self.every_s and self.done < self.total:
                return
            self.last = now
            log.info("%s", self.line(now))

    def line(self, now: float) -> str:
        elapsed = now - self.t0
        rate = self.done / elapsed if elapsed > 0 else 0.0
        left = (self.total - self.done) / rate if rate > 0 else float("inf")
        eta = "done" if self.done >= self.total else f"ETA {fmt_s(left)}"
        return (f"{self.phase}: {self.done}/{self.total} {self.unit} ({100 * self.done // self.total}%), "
                f"{rate:.1f}/s, {eta}")


def fmt_s(s: float) -> str:
    if s == float("inf"):
        return "?"
    m, sec = divmod(int(round(s)), 60)
    return f"{m}m{sec:02d}s" if m else f"{sec}s"
