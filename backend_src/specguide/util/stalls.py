"""Pauses worth an operator's attention, logged as they happen: an engine loop turn, a response
thread's turn, a garbage collection that holds every stream longer than `SLOW_S`. Each line carries
the monotonic clock (`time.monotonic()`, the clock clients and benchmarks of this machine stamp
with), so a client's long wait can be matched to what the server did then."""
from __future__ import annotations

import gc
import logging
import time
from typing import Callable, Optional

SLOW_S = 0.25  # a pause this long is logged
GC_SLOW_S = 0.1  # a collection this long is logged
EVERY_S = 1.0  # at most one line a second of each kind

_installed = False


_last: dict[str, float] = {}  # what -> when its last line went out
_held: dict[str, tuple[int, float]] = {}  # what -> (pauses not logged since, the longest of them)


def report(what: str, seconds: float, detail: str = "", log: Callable[[str], None] | None = None) -> None:
    """Log `what` took `seconds` (ending now), with `detail`, when it is SLOW_S or longer; at most
    one line a second for each `what` (the next line counts the pauses left out, and their longest)."""
    if seconds < SLOW_S:
        return
    now = time.monotonic()
    if now - _last.get(what, -EVERY_S) < EVERY_S:
        n, longest = _held.get(what, (0, 0.0))
        _held[what] = (n + 1, max(longest, seconds))
        return
    _last[what] = now
    n, longest = _held.pop(what, (0, 0.0))
    text = f"slow {what}: {seconds:.2f} s, ended at monotonic {now:.3f}" + (f" ({detail})" if detail else "")
    if n:
        text += f"; {n} more since the last line, the longest {longest:.2f} s"
    (log or logging.getLogger("specguide").warning)(text)


def watch_collections() -> Optional[Callable[[str, dict], None]]:
    """Log every garbage collection of this process that takes GC_SLOW_S or longer (once per
    process); returns the gc callback installed (None when it was already)."""
    global _installed
    if _installed:
        return None
    _installed = True
    started = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        elif started[0]:
            took = time.perf_counter() - started[0]
            if took >= GC_SLOW_S:
                logging.getLogger("specguide").warning(
                    "slow garbage collection: %.2f s (generation %s, %s collected), ended at monotonic %.3f",
                    took, info.get("generation"), info.get("collected"), time.monotonic())

    gc.callbacks.append(on_gc)
    return on_gc
