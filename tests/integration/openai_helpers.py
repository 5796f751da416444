"""The OpenAI-compatible server (specguide.openai_api) as its integration tests run it: one server
process in front of a tritonserver (`Api`, free port, 127.0.0.1), the request bodies the tests
share, and `chat` (a short greedy chat completion)."""
from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional

import openai

from .conftest import ROOT, _free_ports

MODEL = "specguide"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Api:
    """One OpenAI server process."""

    def __init__(self, triton_grpc: str, log: Path, *extra: str):
        self.port = _free_ports(1)[0]
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = {**os.environ, "SPECGUIDE_API_KEY": ""}
        with open(log, "wb") as f:
            self.proc = subprocess.Popen([sys.executable, "-m", "specguide.openai_api", "--triton-url", triton_grpc,
                                          "--port", str(self.port), *extra], stdout=f, stderr=subprocess.STDOUT,
                                         env=env, cwd=ROOT)
        deadline = time.monotonic() + 60
        while not self._up():
            assert self.proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)

    def _up(self) -> bool:
        try:
            with urllib.request.urlopen(self.base + "/v1/models", timeout=2):
                return True
        except urllib.error.HTTPError:
            return True  # answering (e.g. 401)
        except OSError:
            return False

    def client(self, key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key=key, max_retries=0, timeout=300)

    def wait_configured(self, timeout: float = 60.0) -> None:
        """Until the server has read the model's settings from Triton (it does once Triton answers)."""
        deadline = time.monotonic() + timeout
        while "configured from Triton" not in self.log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)

    def post_raw(self, path: str, body: bytes, headers: Optional[dict] = None) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        data = r.read()
        conn.close()
        return r.status, data

    def post(self, path: str, body: bytes, headers: Optional[dict] = None) -> tuple[int, dict]:
        status, data = self.post_raw(path, body, headers)
        return status, json.loads(data)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def chat(client, **kw):
    return client.chat.completions.create(model=MODEL, **{"messages": ASK, "max_tokens": 24, "temperature": 0, **kw})
