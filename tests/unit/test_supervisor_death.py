"""`make serve`'s supervisor killed (SIGKILL: nothing of it runs) must not leave its server running
unsupervised: it would keep the ports, and `make serve` again could not start. Linux sends the server
SIGTERM when the supervisor dies (PR_SET_PDEATHSIG, armed between fork and exec)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import specguide
from specguide.process.ipc import process_identity
from specguide.process.supervisor import descendants


def test_the_server_ends_when_the_supervisor_is_killed():
    env = {**os.environ, "PYTHONPATH": str(Path(specguide.__file__).parents[1])}
    # the "server": a process that ignores nothing and would run for 10 minutes (nothing answers
    # the supervisor's health polls on port 1: it just keeps waiting)
    sup = subprocess.Popen([sys.executable, "-m", "specguide.process.supervisor", "--http", "127.0.0.1:1", "--",
                            "sleep", "600"], env=env, stderr=subprocess.DEVNULL)
    server = None
    try:
        deadline = time.monotonic() + 30
        while not (kids := descendants(sup.pid)):
            assert time.monotonic() < deadline, "the supervisor never started its server"
            time.sleep(0.05)
        server = kids[0]
        sup.kill()
        sup.wait()
        deadline = time.monotonic() + 10
        while process_identity(server) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process_identity(server) is None, "the server outlived its supervisor"
    finally:
        sup.kill()
        if server is not None and process_identity(server) is not None:
            os.kill(server, signal.SIGKILL)
