"""Where do a stream's client-side gaps come from while compile bombs run? (issue 19 diagnosis)

    PYTHONPATH=backend_src python bench/probe_stalls.py base,cpu,mem,xcomp,bombs1,bombs2,bombsq

Starts the served model (limits off: `guided_max_schema_properties=0`, compile timeout 10 s) and runs
9-s phases. In each, a 512-token stream runs (not in `...q` phases) and a separate minimal process
sleeps 10 ms in a loop and reports every oversleep > 40 ms (a stall of the whole machine, not of
Triton's response path); this process does the same in a thread. Phases: `base` nothing else; `cpu`
two busy-loop processes at nice 5; `mem` two processes touching 3 GB each; `xcomp` two processes
compiling a 3,500-property schema with xgrammar outside the server; a trailing `S` (`cpuS`) starts those two processes in a session of their own; `bombsN` two such schemas sent
to the server (each phase its own, so each compiles in the server's worker processes).
Prints per phase: the stream's 3 largest client gaps, its engine-clock gaps, the stalls, and
/proc/stat CPU ticks (user / nice / system / idle / steal).
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_hostile import start_stream  # noqa: E402
from machine import cpu_header  # noqa: E402
from tests.integration.conftest import _stop, launch, repository_with  # noqa: E402
from tests.integration.test_hostile_server import Stream, bomb  # noqa: E402

TICKER = """import sys, time
end, t0, out = time.time() + float(sys.argv[1]), time.time(), []
while time.time() < end:
    t = time.perf_counter(); time.sleep(0.01); o = time.perf_counter() - t - 0.01
    if o > 0.04: out.append((round(time.time() - t0, 2), round(o * 1e3)))
print("  other process stalls (at s, ms):", out[:16], flush=True)"""
COMPILE = f"""import json, sys
sys.path.insert(0, {str(ROOT / 'backend_src')!r})
import xgrammar as xgr
from transformers import AutoTokenizer
from specguide.models.loader import resolve_model_dir
tok = AutoTokenizer.from_pretrained(str(resolve_model_dir()))
c = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=49152), max_threads=1, cache_enabled=False)
c.compile_json_schema(json.dumps({{"type": "object", "properties": {{f"a{{i}}": {{"type": "integer"}} for i in range(3500)}}}}),
                      strict_mode=False, any_whitespace=True, max_whitespace_cnt=8)"""
BURN = {"cpu": "while True: pass", "xcomp": COMPILE,
        "mem": "bufs = []\nfor i in range(60):\n    b = bytearray(50 << 20)\n    b[::4096] = b'x' * len(b[::4096])\n"
               "    bufs.append(b)\nwhile True: pass"}


class Ticker:
    """This process's own 10 ms sleeps: (when, oversleep s)."""

    def __init__(self):
        self.over: list[tuple[float, float]] = []
        threading.Thread(target=self.run, daemon=True).start()

    def run(self):
        while True:
            t = time.perf_counter()
            time.sleep(0.01)
            self.over.append((t, time.perf_counter() - t - 0.01))


def ticks() -> list[int]:
    return [int(x) for x in open("/proc/stat").readline().split()[1:9]]


def phase(server, name: str, ticker: Ticker, secs: float = 9.0) -> None:
    st0 = ticks()
    s = None if name.endswith("q") else start_stream(server)
    ext = subprocess.Popen([sys.executable, "-c", TICKER, str(secs)])
    t0 = time.perf_counter()
    procs = [subprocess.Popen(["nice", "-n", "5", sys.executable, "-c", BURN[name.rstrip("S")]],
                              start_new_session=name.endswith("S")) for _ in range(2)] \
        if name.rstrip("S") in BURN else []
    hostile = [Stream(server, {"text_input": "Fill it.", "max_tokens": 8, "guided_decoding_guide_type": "json_schema",
                               "guided_decoding_guide": bomb(name + tag, 3500)}) for tag in "ab"] \
        if name.startswith("bombs") else []
    time.sleep(secs)
    t1 = time.perf_counter()
    for p in procs:
        p.kill()
    ext.wait()
    d = dict(zip(["user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal"],
                 [b - a for a, b in zip(st0, ticks())]))
    own = [(round(t - t0, 2), round(o * 1e3)) for t, o in ticker.over if t0 <= t <= t1 and o > 0.04]
    print(f"{name}: this process's stalls (at s, ms): {own[:16]}")
    if s is not None:
        ts = [t for t in s.times if t0 <= t <= t1]
        gaps = sorted(((b - a, a - t0) for a, b in zip(ts, ts[1:])), reverse=True)[:3]
        eng = sorted(((b - a) / 1e9 for a, b in zip(s.server_ns, s.server_ns[1:])), reverse=True)[:3]
        print(f"  stream gaps, client (s, at): {[(round(g, 3), round(a, 1)) for g, a in gaps]}; "
              f"engine clock: {[round(g, 3) for g in eng]}")
        s.client.stop_stream(cancel_requests=True)
    print(f"  cpu ticks: {d}", flush=True)
    for h in hostile:
        h.wait(60)
    time.sleep(2)


def main() -> None:
    print(cpu_header(), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        server = launch(Path(tmp) / "server.log", repository_with(Path(tmp), {"guided_max_schema_properties": "0",
                                                                              "guided_compile_timeout_s": "10"}))
        ticker = Ticker()
        try:
            for name in (sys.argv[1] if len(sys.argv) > 1 else "base,cpu,mem,bombs1,bombs2,bombsq").split(","):
                phase(server, name, ticker)
        finally:
            _stop(server.proc)


if __name__ == "__main__":
    main()
