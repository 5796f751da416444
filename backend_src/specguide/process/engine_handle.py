"""One engine process and the pipes to it (`EngineHandle`): its start, bounded by
`engine_start_timeout_s`, the messages sent to it, its end. EngineProcess (engine_process.py)
holds one at a time and starts a new one when it dies."""
from __future__ import annotations

import subprocess
import threading
from typing import Optional

from ..config import EngineConfig
from .engine_protocol import PARENT_ENV, SERVER_ENV, EngineInfo, describe_exit
from .ipc import child_env, python_executable, read_msg, write_msg

# its command line names engine_process_child: tools and tests find the engine process by "engine_process"
_CHILD_MAIN = "from specguide.process.engine_process_child import child_main; child_main()"


class EngineHandle:
    """One engine process and the pipes to it. The constructor starts it and waits for its ready
    message; it raises RuntimeError (the engine's own reason) when the engine does not start."""

    def __init__(self, config: EngineConfig, server: Optional[str] = None):
        env = child_env(PARENT_ENV)
        env.pop(SERVER_ENV, None)
        if server:
            env[SERVER_ENV] = server
        self.proc = subprocess.Popen([python_executable(), "-c", _CHILD_MAIN], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, close_fds=True)
        self.write_lock = threading.Lock()
        self.stalled = ""  # why the watchdog killed it ("" unless it did)
        self.exited = False  # its end was handled (EngineProcess._on_exit)
        limit, late = config.engine_start_timeout_s, threading.Event()

        def expire() -> None:  # ends the read below
            late.set()
            self.proc.kill()

        timer = threading.Timer(limit, expire) if limit > 0 else None
        if timer is not None:
            timer.daemon = True
            timer.start()
        try:
            self.send(config)
            reply = read_msg(self.proc.stdout)
        finally:
            if timer is not None:
                timer.cancel()
        if not (isinstance(reply, tuple) and reply[0] == "ready"):
            self.kill()
            if isinstance(reply, tuple) and reply[0] == "failed":
                detail = reply[1]
            elif late.is_set():
                detail = f"not loaded within engine_start_timeout_s ({limit:g} s); killed"
            else:
                detail = describe_exit(self.proc.returncode)
            raise RuntimeError(f"the engine did not start: {detail}")
        self.info: EngineInfo = reply[1]

    def send(self, msg: object) -> bool:
        """Write one message to the engine process; False when it is gone."""
        try:
            with self.write_lock:
                write_msg(self.proc.stdin, msg)
            return True
        except (OSError, ValueError):  # the process is gone: its reader thread reports it
            return False

    def kill(self) -> None:
        """Kill the engine process (unless it has ended), reap it and close its pipes."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
