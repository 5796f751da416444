"""The draft head made while the server serves: when the configured head is missing, the server
starts `python -m specguide.training.cli --background` in a process of its own at the least CPU
share (a session of its own at autogroup nice 19, killed with the server: `ipc.demote`), logs its
progress, and the engine attaches the head between steps once its file is written
(`Engine._poll_head`). Until then the engine drafts grammar-forced tokens + n-gram."""
from __future__ import annotations

import json
import subprocess
import threading
from dataclasses import asdict
from typing import Callable, Optional

from ..config import EngineConfig
from .ipc import child_env, python_executable

Log = Callable[[str, str], None]  # (level: "info" | "warn" | "error", message)
PARENT_ENV = "SPECGUIDE_TRAINING_PARENT"  # the server's pid, for the training's ipc.demote
PREFIX = "draft head training: "


class BackgroundTraining:
    """One background training of the head at `out` for `config` (see the module's text)."""

    def __init__(self, config: EngineConfig, out: str, log: Log, quick: bool = False):
        self.out, self._log = out, log
        self.command = [python_executable(), "-m", "specguide.training.cli", "--background", "--if-missing",
                        "--engine-config", json.dumps(asdict(config)), "--out", out] + (["--quick"] if quick else [])
        self.proc: Optional[subprocess.Popen] = None
        self.returncode: Optional[int] = None
        self._started = threading.Event()
        # NOTE: the process dies with the thread that started it (PR_SET_PDEATHSIG): this thread
        # starts it and lives until it ends
        self._thread = threading.Thread(target=self._run, name="specguide-head-training", daemon=True)
        self._thread.start()
        self._started.wait()

    @classmethod
    def start_if_needed(cls, config: EngineConfig, awaited_head: str, log: Log) -> Optional["BackgroundTraining"]:
        """Start one when the engine awaits a head and the config trains it in the background."""
        if not awaited_head or config.draft_head_training != "background":
            return None
        log("info", f"specguide: no draft head at {awaited_head}: training it in the background at the lowest "
                    "CPU share; the engine drafts without it meanwhile and attaches it when written")
        return cls(config, awaited_head, log)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        """Wait for the training to end; its exit code (None: still running)."""
        self._thread.join(timeout)
        return self.returncode

    def stop(self, timeout: float = 10.0) -> None:
        """End the training (the server is stopping); a partial head is never written."""
        if self.running:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            self.proc = subprocess.Popen(self.command, env=child_env(PARENT_ENV), stdin=subprocess.DEVNULL,
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                         close_fds=True, start_new_session=True)  # its own autogroup
        except OSError as e:
            self._log("error", f"{PREFIX}could not start ({e})")
            return
        finally:
            self._started.set()
        for line in self.proc.stdout:
            if line.strip():
                self._log("info", PREFIX + line.rstrip())
        self.returncode = self.proc.wait()
        if self.returncode == 0:
            self._log("info", f"{PREFIX}done: {self.out}")
        else:
            self._log("warn", f"{PREFIX}ended with exit code {self.returncode}; the engine keeps drafting without "
                              "the head (the next start trains it again)")
