"""Keeps tritonserver serving when one of its Python backend stubs dies.

    python3 -m specguide.process.supervisor [--http 127.0.0.1:8000] -- tritonserver ARGS...

The engine's own crashes are handled inside the `specguide` stub (engine_process.py: clients
told at once, a new engine in seconds). What is left is a stub itself dying: Triton 2.51 never
restarts the stub of a decoupled model, its requests never end, and every later request to
that model fails with "Stub process ... is not healthy" while the server reports itself live
and ready. Only a new server helps, so this supervisor runs tritonserver as its child and:

- every POLL_S checks that each model the server says is READY (repository index) has a live
  stub process for each of its instances (config.pbtxt `instance_group`); one missing twice in a
  row is a dead stub;
- then kills the server (SIGKILL: the dead stub's requests would hold a graceful shutdown
  until its exit timeout), which closes every client connection at once (the only way those
  clients hear of it; the other stubs exit within 0.3 s of their parent), removes the
  shared-memory regions the server left, and starts it again, backing off when failures repeat
  (restarts.Backoff); the same when tritonserver itself exits unasked;
- logs each restart; the count reaches the new server as SPECGUIDE_SERVER_RESTARTS (the metric
  specguide_server_restarts_total);
- passes SIGTERM / SIGINT on to the server and exits with its exit code; killed itself (SIGKILL),
  the server gets SIGTERM from Linux (PR_SET_PDEATHSIG), so no unsupervised server keeps the ports
  a new `make serve` needs.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional

from ..triton.instance import instance_count
from .ipc import parent_death_signal
from .restarts import RESTARTS_ENV, Backoff, sleep_unless

POLL_S = 0.5
SHM = Path("/dev/shm")
SHM_PREFIX = "triton_python_backend_shm_region"


def log(text: str) -> None:
    print(f"specguide supervisor: {text}", file=sys.stderr, flush=True)


def descendants(pid: int) -> list[int]:
    """Every process under `pid` (whichever thread started it)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def stubs(server_pid: int) -> dict[str, list[int]]:
    """Live Python backend stubs under the server, by model name (its model.py's folder)."""
    out: dict[str, list[int]] = {}
    for pid in descendants(server_pid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"triton_python_backend_stub" in cmd[0] and len(cmd) > 1 and state != "Z":
            out.setdefault(Path(cmd[1].decode(errors="replace")).parents[1].name, []).append(pid)
    return out


def model_instances(http: str, model: str) -> int:
    """The instance count of a loaded model (its config from the server); 1 when it does not answer."""
    try:
        with urllib.request.urlopen(f"http://{http}/v2/models/{model}/config", timeout=5) as r:
            return instance_count(json.loads(r.read()))
    except (urllib.error.URLError, OSError, ValueError):
        return 1


def ready_models(http: str) -> Optional[list[str]]:
    """Models the server reports READY; None when it does not answer (starting, stopping)."""
    req = urllib.request.Request(f"http://{http}/v2/repository/index", data=b"{}", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            index = json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None
    return [m["name"] for m in index if m.get("state") == "READY"]


class Supervisor:
    """Runs one tritonserver at a time (see the module docstring)."""

    def __init__(self, command: list[str], http: str):
        self.command, self.http = command, http
        self.restarts = 0
        self.backoff = Backoff()
        self.stopping = False
        self.proc: Optional[subprocess.Popen] = None
        self._instances: dict[str, int] = {}  # READY model -> its instance count (read once it is ready)

    def start(self) -> None:
        self.shm_before = _shm_regions()
        env = {**os.environ, RESTARTS_ENV: str(self.restarts)}
        # NOTE: preexec_fn runs between fork and exec: safe here, this process has one thread
        self.proc = subprocess.Popen(self.command, env=env,
                                     preexec_fn=functools.partial(parent_death_signal, signal.SIGTERM, os.getpid()))
        self.backoff.started()

    def dead_stub(self) -> Optional[str]:
        """A model that is READY without a live stub: its name; None while all is well."""
        ready = ready_models(self.http)
        if not ready:
            return None
        # a model that left READY may come back with another config (explicit model control)
        self._instances = {m: n for m, n in self._instances.items() if m in ready}
        live = stubs(self.proc.pid)
        for m in ready:
            if m not in self._instances:
                self._instances[m] = model_instances(self.http, m)
            if len(live.get(m, ())) < self._instances[m]:
                return m
        return None

    def kill(self) -> None:
        """Kill the server; remove the shared-memory regions its stubs leave behind."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for name in _shm_regions() - self.shm_before:
            try:
                (SHM / name).unlink()
            except OSError:
                pass

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        self.start()
        suspect: Optional[str] = None
        while True:
            time.sleep(POLL_S)
            if self.stopping:
                return self.proc.wait()
            code = self.proc.poll()
            if code is not None:
                self._restart(f"tritonserver exited with code {code}")
                suspect = None
                continue
            dead = self.dead_stub()
            if dead is not None and dead == suspect:
                self._restart(f"the Python backend stub of model '{dead}' died (Triton does not restart it)")
                suspect = None
            else:
                suspect = dead

    def _restart(self, why: str) -> None:
        delay = self.backoff.failed()
        log(f"{why}: restarting tritonserver (restart {self.restarts + 1}, failure {self.backoff.failures} in a row)")
        self.kill()
        if delay:
            log(f"waiting {delay:g} s before starting it again")
        if sleep_unless(delay, lambda: self.stopping):
            return
        self.restarts += 1
        self.start()

    def _on_signal(self, signum: int, frame: object) -> None:
        self.stopping = True
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signum)


def _shm_regions() -> set[str]:
    try:
        return {p.name for p in SHM.iterdir() if p.name.startswith(SHM_PREFIX)}
    except OSError:
        return set()


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print(__doc__, file=sys.stderr)
        return 2
    split = argv.index("--")
    ap = argparse.ArgumentParser()
    ap.add_argument("--http", default="127.0.0.1:8000", help="the server's HTTP address (its repository index)")
    args = ap.parse_args(argv[:split])
    return Supervisor(argv[split + 1:], args.http).run()


if __name__ == "__main__":
    sys.exit(main())
