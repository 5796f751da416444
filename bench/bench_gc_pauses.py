"""Garbage-collector pauses in the serving processes: a full collection before and after the
start-up heap is frozen (util/heap.py), and every collection each process makes under load.

    python bench/bench_gc_pauses.py [--repeats 5] [--load-seconds 90] [--json out.json]

Part 1, side by side in one run: each kind of serving process is built in a fresh interpreter as
it starts when served (the OpenAI server: its app with uvicorn, uvloop and httptools imported; the
engine: `Engine` with config.pbtxt's parameters; a compile worker: xgrammar's compiler as it
imports it); a full collection (`gc.collect()`) is timed
`--repeats` times, the heap frozen, and timed again. A full collection stops every stream the
process carries for that long.

Part 2 (`--load-seconds` > 0), twice: with `gc.freeze` made a no-op in every process (as before
util/heap.py), then as served. The served stack (tritonserver + the OpenAI server, as
`bench_openai.py` starts it) under load: bursts of 8 streams through the OpenAI server, 64 tokens
each. Every Python process of the stack logs each collection (a
`sitecustomize` on PYTHONPATH with a `gc.callbacks` hook): per process the collections of each
generation and the longest; the full ones after start-up are the pauses the freeze removes.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "backend_src"))
from machine import cpu_header  # noqa: E402  (bench/ is on sys.path when run as a script)

BUILD = {
    "OpenAI server": """
import uvicorn, uvicorn.loops.uvloop, uvicorn.protocols.http.httptools_impl
from specguide.openai_api.app import Settings, create_app
held = create_app(Settings(triton_url="127.0.0.1:8001"))
""",
    "engine": """
from pathlib import Path
from specguide.config import EngineConfig
from specguide.engine.loop import Engine
from specguide.triton.interfaces import engine_parameters
held = Engine(EngineConfig.from_parameters(engine_parameters(Path(ROOT) / "model_repository")))
""",
    "compile worker": """
from specguide.guided.compile_worker import _import_xgrammar_compiler
from specguide.guided.xgrammar_compile import compile_guide
from specguide.guided.schema import json_schema_of
xgr = _import_xgrammar_compiler()
""",
}

TIMED = """
import gc, json, statistics, time
from specguide.util.heap import freeze_startup_heap
def full(n):
    out = []
    for _ in range(n):
        t0 = time.perf_counter(); gc.collect(); out.append(1e3 * (time.perf_counter() - t0))
    return out
objects = len(gc.get_objects())
before = full(REPEATS)
frozen = freeze_startup_heap()
after = full(REPEATS)
print(json.dumps({"objects": objects, "frozen": frozen, "before_ms": before, "after_ms": after}))
"""

HOOK = """
import gc, os, sys, time
_t = [0.0]
_f = None
def _gc_logged(phase, info):
    global _f
    if phase == "start":
        _t[0] = time.perf_counter()
        return
    if _f is None:
        _f = open(os.path.join(LOGS, str(os.getpid())), "a", buffering=1)
        _f.write("# " + " ".join(getattr(sys, "orig_argv", sys.argv))[:160] + "\\n")
    _f.write(f"{info['generation']} {1e3 * (time.perf_counter() - _t[0]):.3f} {time.time():.3f}\\n")
gc.callbacks.append(_gc_logged)
"""


def side_by_side(repeats: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "backend_src")}
    out = {}
    for kind, build in BUILD.items():
        code = f"ROOT = {str(ROOT)!r}\nREPEATS = {repeats}\n" + build + TIMED
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{kind}: {r.stderr[-2000:]}")
        res = json.loads(r.stdout.strip().splitlines()[-1])
        out[kind] = res
        print(f"{kind:14s} {res['objects']:8d} objects: a full collection {statistics.median(res['before_ms']):7.2f} ms "
              f"(range {min(res['before_ms']):.2f}-{max(res['before_ms']):.2f}), after the freeze "
              f"{statistics.median(res['after_ms']):.3f} ms ({res['frozen']} frozen)")
    return out


def _process_name(header: str) -> str:
    for key, name in (("engine_process_child", "engine"), ("compile_worker", "compile worker"),
                      ("specguide.openai_api", "OpenAI server"), ("tritonserver.py", "launcher")):
        if key in header:
            return name
    return "Triton stub"  # the Python backend's stub runs no command line of ours


def under_load(seconds: float, freeze: bool) -> dict:
    import bench_openai as bo

    logs = Path(tempfile.mkdtemp(prefix="gc_pauses_"))
    site = logs / "site"
    site.mkdir()
    # without the freeze: gc.freeze made a no-op in every process of the stack (the code before util/heap.py)
    off = "" if freeze else "gc.freeze = lambda: None\n"
    (site / "sitecustomize.py").write_text(f"LOGS = {str(logs)!r}\n" + HOOK + off)
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = f"{site}:{saved}" if saved else str(site)
    try:
        stack = bo.Stack("server")
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    question = "Write a short poem about the sea."
    time.sleep(10)  # the compile workers start after the engine is ready: their start-up is not the load's
    try:
        start, n = time.time(), 0
        with ThreadPoolExecutor(8) as pool:
            while time.time() - start < seconds:
                list(pool.map(lambda _: bo.via_http(stack.api, question, 64), range(8)))
                n += 8
        end = time.time()
    finally:
        stack.stop()
    out = {}
    for f in sorted(logs.iterdir()):
        if not f.is_file():
            continue
        lines = f.read_text().splitlines()
        name = _process_name(lines[0] if lines and lines[0].startswith("#") else "")
        if name == "launcher":  # scripts/tritonserver.py: waits on the server, allocates nothing
            continue
        rows = [ln.split() for ln in lines if not ln.startswith("#")]
        during = [(int(g), float(ms)) for g, ms, t in rows if start <= float(t) <= end]
        gens = {g: [ms for gg, ms in during if gg == g] for g in (0, 1, 2)}
        key = name if name not in out else f"{name} ({f.name})"
        out[key] = {str(g): {"count": len(v), "max_ms": max(v, default=0.0), "total_ms": sum(v)} for g, v in gens.items()}
        print(f"{key:28s} " + "  ".join(f"gen {g}: {len(v):4d} ({sum(v):7.1f} ms, longest {max(v, default=0.0):6.2f})"
                                        for g, v in gens.items()))
    print(f"({n} requests in {end - start:.0f} s)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--load-seconds", type=float, default=0.0)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    print(cpu_header())
    results = {"cpu": cpu_header(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "side_by_side": side_by_side(args.repeats)}
    for freeze in (False, True) if args.load_seconds > 0 else ():
        print(f"under load, the start-up heap {'frozen (served)' if freeze else 'not frozen'}:")
        results["under_load_" + ("frozen" if freeze else "not_frozen")] = under_load(args.load_seconds, freeze)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
