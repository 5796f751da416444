"""The supervisor thread of an EngineProcess (engine_process.py), as a base class of it
(`EngineSupervision`): it starts a new engine process when one dies (at once after the first crash,
then backing off when crashes repeat: restarts.Backoff) and runs the watchdog, which kills an
engine process that, with requests in flight, makes no progress for `engine_stall_s` (after it
dumps every thread's stack to the log, SIGUSR1); its reader thread then fails its requests and the
supervisor restarts it."""
from __future__ import annotations

import signal
import subprocess
import threading
import time
from typing import Callable, Optional

from ..config import EngineConfig
from .engine_handle import EngineHandle
from .engine_protocol import Callback, EngineInfo
from .restarts import Backoff, sleep_unless

Log = Callable[[str, str], None]  # (level: "info" | "warn" | "error", message)

WATCH_S = 1.0  # how often the watchdog looks (at most)
DUMP_WAIT_S = 1.0  # a stuck engine process's time to write its threads' stacks before it is killed


class EngineSupervision:
    """Restarts and the watchdog of an EngineProcess, which sets the state below and starts
    `_supervise` on a thread of its own."""

    _log: Log
    _config: EngineConfig
    _server: Optional[str]
    _lock: threading.Lock
    _callbacks: dict[int, Callback]  # requests the engine holds, by key
    _stats: dict[str, int]
    _down: Optional[str]  # why the engine is down (None while it serves)
    _closing: bool
    restarts: int
    _backoff: Backoff  # crashes in a row
    _restart_delay: float
    _wake: threading.Event  # set when the engine died or shutdown began
    _progress_at: float  # the engine's last sign of progress, or when work began
    _turns: int  # its loop's turns as last reported
    _child: EngineHandle
    _reader: threading.Thread
    info: EngineInfo

    def _start_reader(self, child: EngineHandle) -> threading.Thread:
        """Start the thread that reads `child`'s messages (EngineProcess's)."""
        raise NotImplementedError

    # ---- the watchdog ------------------------------------------------------------------------
    def _watch_period(self) -> Optional[float]:
        stall = self._config.engine_stall_s
        return min(WATCH_S, stall / 4) if stall > 0 else None

    def _watch(self) -> None:
        """Kill the engine process when, with requests in flight, its loop has not moved for
        `engine_stall_s` (the reader then fails its requests and the supervisor restarts it)."""
        stall = self._config.engine_stall_s
        if stall <= 0:
            return
        with self._lock:
            now, child = time.monotonic(), self._child
            if not self._callbacks or self._down is not None:  # idle: nothing is owed
                self._progress_at = now
            idle = now - self._progress_at
        if idle >= stall:
            self._stalled(child, f"no step for {idle:.0f} s with requests in flight; engine_stall_s {stall:g}")

    def _stalled(self, child: EngineHandle, why: str) -> None:
        """The engine process is stuck: it writes every thread's stack to the log (SIGUSR1:
        faulthandler), then is killed; its reader reports the death (cause: `child.stalled`)."""
        with self._lock:
            if child.stalled or child is not self._child or self._down is not None:
                return
            child.stalled = f"the engine was stuck ({why}) and was killed"
        self._log("error", f"specguide: {child.stalled}; its threads' stacks follow in the log")
        try:
            child.proc.send_signal(signal.SIGUSR1)  # (Popen's: never a reaped pid)
            child.proc.wait(DUMP_WAIT_S)
        except (OSError, subprocess.TimeoutExpired):
            pass
        child.proc.kill()

    # ---- supervisor thread: restarts, and the watchdog ---------------------------------------
    def _supervise(self) -> None:
        while True:
            self._wake.wait(self._watch_period())
            self._wake.clear()
            if self._closing:
                return
            if self._down is None:
                self._watch()
                continue
            delay = self._restart_delay
            if delay > 0:
                self._log("warn", f"specguide: waiting {delay:g} s before restarting the engine "
                                  f"(crash {self._backoff.failures} in a row)")
                if sleep_unless(delay, lambda: self._closing):
                    return
            t0 = time.monotonic()
            self._backoff.started()
            try:
                child = EngineHandle(self._config, self._server)
            except Exception as e:
                self._restart_delay = self._backoff.failed()
                with self._lock:
                    self._down = f"the engine failed to restart ({e}); retrying"
                self._log("error", f"specguide: {self._down}")
                self._wake.set()
                continue
            with self._lock:
                if self._closing:
                    child.kill()
                    return
                self._child, self._down, self.info = child, None, child.info
                self.restarts += 1
                self._stats, self._turns, self._progress_at = {}, -1, time.monotonic()
            self._reader = self._start_reader(child)
            self._log("info", f"specguide: engine restarted in {time.monotonic() - t0:.1f} s "
                              f"(restart {self.restarts}, pid {child.info.pid})")
