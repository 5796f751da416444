"""Back-off for restarting a process that keeps dying (the engine process, tritonserver).

A failure within STABLE_S of the last start counts as one more in a row; the first waits nothing,
the next ones 1, 2, 4 ... MAX_BACKOFF_S seconds: repeated crashes back off instead of looping."""
from __future__ import annotations

import time
from typing import Callable

STABLE_S = 300.0  # a process up this long has its failure counted as the first again
MAX_BACKOFF_S = 60.0  # the longest wait before a restart
RESTARTS_ENV = "SPECGUIDE_SERVER_RESTARTS"  # how many times the supervisor restarted tritonserver (for the metric)


def backoff_s(failures: int) -> float:
    """Delay before restarting after `failures` failures in a row (1 = the first): 0, 1, 2, 4, ... MAX_BACKOFF_S."""
    return 0.0 if failures <= 1 else min(MAX_BACKOFF_S, 2.0 ** (failures - 2))


class Backoff:
    """Failures in a row of one supervised process, and the wait before its next start."""

    def __init__(self) -> None:
        self.failures = 0
        self.started_at = time.monotonic()

    def started(self) -> None:
        self.started_at = time.monotonic()

    def failed(self) -> float:
        """Count a failure; the seconds to wait before starting again."""
        self.failures = self.failures + 1 if time.monotonic() - self.started_at < STABLE_S else 1
        return backoff_s(self.failures)


def sleep_unless(seconds: float, stop: Callable[[], bool]) -> bool:
    """Wait `seconds`, unless `stop()` turns true first; returns `stop()`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not stop():
        time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
    return stop()
