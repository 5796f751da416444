"""One real tritonserver per test session, on 127.0.0.1 with free ports, serving model_repository/."""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

from specguide.process import supervisor
from specguide.util.memory import rss_bytes

ROOT = Path(__file__).resolve().parents[2]
MODEL = "specguide"
# upstream/ holds the peer backends' own client and CI files, run by test_conformance.py against
# the test server; pytest must not collect them on their own (they would aim at localhost:8001).
collect_ignore = ["upstream"]
STARTUP_TIMEOUT_S = 600


def _free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@dataclass
class Server:
    http: str  # host:port
    grpc: str
    metrics_url: str
    log: Path
    proc: subprocess.Popen

    def metrics_text(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=10) as r:
            return r.read().decode()

    def metric(self, name: str, **labels: str) -> float:
        """The value of one sample (labels must match those given); 0.0 if absent."""
        for line in self.metrics_text().splitlines():
            if not line.startswith(name + "{") and not line.startswith(name + " "):
                continue
            m = re.match(r"(\w+)(?:\{(.*)\})?\s+(\S+)", line)
            got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            if m.group(1) == name and all(got.get(k) == v for k, v in labels.items()):
                return float(m.group(3))
        return 0.0

    def wait_metric(self, name: str, value: float, timeout: float = 10.0, **labels: str) -> float:
        deadline = time.monotonic() + timeout
        while True:
            got = self.metric(name, **labels)
            if got == value or time.monotonic() > deadline:
                return got
            time.sleep(0.02)

    def stubs(self) -> dict[str, int]:
        """The pid of each Python backend stub (one per model), by model name."""
        # the server's, or under `serve` the supervisor's server's
        return {model: pids[0] for model, pids in supervisor.stubs(self.proc.pid).items()}

    def engine_pid(self) -> Optional[int]:
        """The engine process (engine_process.py), a child of the engine model's stub; None while there is none."""
        stub = self.stubs().get(MODEL)
        for child in supervisor.descendants(stub) if stub else []:
            if b"engine_process" in Path(f"/proc/{child}/cmdline").read_bytes():
                return child
        return None

    def stub_rss_by_model(self) -> dict[str, int]:
        """Resident memory of each model's processes (its Python backend stub; for the engine model,
        plus the engine process), by model name."""
        out = {}
        engine = self.engine_pid()
        for model, pid in self.stubs().items():
            out[model] = rss_bytes(pid) + (rss_bytes(engine) if model == MODEL and engine else 0)
        return out

    def stub_rss_bytes(self) -> int:
        """Resident memory of the engine model's stub and engine process (the ones that hold the model)."""
        rss = self.stub_rss_by_model()
        if MODEL not in rss:
            raise RuntimeError("no triton_python_backend_stub child runs the engine model")
        return rss[MODEL]

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, OSError):
        return False


def _ready(srv: Server) -> bool:
    # NOTE: tritonserver opens its metrics port after the HTTP one, so /v2/health/ready can answer
    # while /metrics still refuses connections (a test that read a metric at once failed so in CI).
    return _answers(f"http://{srv.http}/v2/health/ready") and _answers(srv.metrics_url)


def repository_with(tmp: Path, settings: dict[str, str]) -> Path:
    """A copy of model_repository under `tmp` with some of the engine model's settings replaced."""
    repo = tmp / "models"
    shutil.copytree(ROOT / "model_repository", repo, ignore=shutil.ignore_patterns("__pycache__"))
    cfg = repo / MODEL / "config.pbtxt"
    text = cfg.read_text()
    for key, value in settings.items():
        text, n = re.subn(rf'(key:\s*"{key}"\s*value:\s*\{{\s*string_value:\s*)"[^"]*"', rf'\1"{value}"', text)
        assert n == 1, f"no setting {key} in config.pbtxt"
    cfg.write_text(text)
    return repo


def launch(log: Path, model_repository: Path, extra_args: tuple[str, ...] = (), env: Optional[dict] = None,
           command: str = "run") -> Server:
    """Start tritonserver on free ports and wait until it is ready (fails the test if it is not).
    `command` "serve" runs it under specguide.process.supervisor, as `make serve` does."""
    subprocess.run([sys.executable, str(ROOT / "scripts" / "tritonserver.py"), "setup"], check=True,
                   stdout=subprocess.DEVNULL)
    http, grpc, metrics = _free_ports(3)
    env = {**os.environ, "TRITON_HTTP_PORT": str(http), "TRITON_GRPC_PORT": str(grpc),
           "TRITON_METRICS_PORT": str(metrics), "MODEL_REPOSITORY": str(model_repository), **(env or {})}
    with open(log, "wb") as f:
        # the script exec()s tritonserver, so proc.pid is the server; its own session lets us
        # clean up the Python backend stub with it
        proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "tritonserver.py"), command, *extra_args],
                                stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    srv = Server(f"127.0.0.1:{http}", f"127.0.0.1:{grpc}", f"http://127.0.0.1:{metrics}/metrics", log, proc)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not _ready(srv):
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop(proc)
            pytest.fail(f"tritonserver did not become ready (exit code {proc.poll()}):\n{srv.log_tail()}")
        time.sleep(0.5)
    return srv


def stop_and_check(srv: Server, allow_tracebacks: bool = False) -> None:
    """SIGTERM; the model must unload cleanly (finalize drains and stops the engine)."""
    _stop(srv.proc)
    log_text = srv.log.read_text(errors="replace")
    assert f"successfully unloaded '{MODEL}'" in log_text, f"the model did not unload cleanly:\n{srv.log_tail()}"
    crash = re.search(r"Signal \((?!15\))\d+\)", log_text)  # 15 = our SIGTERM
    assert crash is None, f"tritonserver crashed ({crash and crash.group(0)}):\n{srv.log_tail(80)}"
    if not allow_tracebacks:
        assert "Traceback" not in log_text, f"a Python error in the server log:\n{srv.log_tail(200)}"


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Server:
    log = tmp_path_factory.mktemp("tritonserver") / "server.log"
    srv = launch(log, ROOT / "model_repository")
    yield srv
    stop_and_check(srv)


@pytest.fixture(scope="module")
def api(server, tmp_path_factory):
    """An OpenAI server process (openai_helpers.Api) in front of the session's tritonserver, one per
    test module; its log must hold no traceback once it stops."""
    from .openai_helpers import Api  # (openai_helpers imports this module)

    a = Api(server.grpc, tmp_path_factory.mktemp("openai") / "api.log")
    a.wait_configured()
    yield a
    a.stop()
    assert "Traceback" not in a.log.read_text(), a.log.read_text()[-3000:]


@pytest.fixture(scope="module")
def client(api):
    """The `openai` SDK's client of `api`."""
    return api.client()


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # graceful: the model's finalize drains and stops the engine
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the group (the backend stub)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)
