"""Engine steps with another Python thread competing for the GIL (the convoy effect).

    python bench/bench_gil_contention.py [--device cuda|cpu] [--max-tokens 64] [--intervals 0.005,0.0005]
                                         [--draft-head PATH]
    python bench/bench_gil_contention.py --served [--concurrency 8] [--rounds 12] [--max-tokens 64]

Every torch op and kernel call releases the GIL and takes it back; while a busy Python thread
holds it, taking it back waits for the interpreter's switch interval (`sys.setswitchinterval`,
5 ms by default), and so does a CUDA grammar host function on its driver thread. This runs one
warm-up round (graph capture on CUDA), then the same 8 requests (4 JSON-schema guided, 4 unguided,
K=3 hybrid, greedy) with no competing thread and with one busy thread at each switch interval,
and prints ms per step and, on CUDA, host functions per step and the host's wait for replayed steps.

`--served`: two tritonservers serving `specguide`, one with the served gil_switch_interval_ms
(0.1) and one with 0 (Python's 5 ms), in alternating rounds of `--concurrency` streamed chat
requests over gRPC (distinct prompts, greedy, ignore_eos): TTFT p50 / p90 / max and tokens/s.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend_src"))

import torch  # noqa: E402
from machine import cpu_header  # noqa: E402  (bench/ is on sys.path when run as a script)

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def requests(engine, max_tokens: int):
    from specguide.request import GuidedDecodingParams, Request, SamplingParams

    def chat(t):
        return engine.tokenizer.apply_chat_template([{"role": "user", "content": t}])

    out = []
    for _ in range(4):
        out.append(Request(prompt=chat("Describe Alice, 30, as JSON."), num_draft_tokens=3,
                           guided=GuidedDecodingParams("json_schema", json.dumps(SCHEMA)),
                           params=SamplingParams(max_tokens=max_tokens, temperature=0.0)))
        out.append(Request(prompt=chat("Count from one to one hundred in words."), num_draft_tokens=3,
                           params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)))
    return out


def run_round(engine, reqs) -> None:
    done = threading.Semaphore(0)
    for r in reqs:
        engine.submit(r, lambda o: o.finished and done.release())
    for _ in reqs:
        if not done.acquire(timeout=600):
            raise TimeoutError("a request did not finish in 600 s")


def host_function_runs() -> int:
    from specguide.cuda import hostfunc

    return sum(e.runs for e in list(hostfunc._registry.values()))  # captured entries keep their count


def served_main(args) -> None:
    """TTFT and tokens/s through tritonserver, served interval vs Python's, alternating rounds."""
    from bench_interfaces import Server
    from bench_openai import QUESTIONS, via_triton  # (puts the repository root on sys.path: client/)
    from client.common import chat_prompt, load_chat_template

    print(cpu_header(), flush=True)
    template = load_chat_template()
    prompts = [chat_prompt(template, f"{QUESTIONS[i % len(QUESTIONS)]} ({i})") for i in range(args.concurrency)]
    servers = {name: Server(("specguide",), {"gil_switch_interval_ms": value})
               for name, value in (("0.1 ms (served)", "0.1"), ("5 ms (Python's; 0)", "0"))}
    res = {k: {"ttft": [], "tokens": 0, "wall": 0.0} for k in servers}
    try:
        for s in servers.values():
            via_triton(f"127.0.0.1:{s.grpc}", prompts[0], 8)  # warm
        for r in range(args.rounds):
            for name in (list(servers) if r % 2 == 0 else list(servers)[::-1]):
                url = f"127.0.0.1:{servers[name].grpc}"
                t0 = time.perf_counter()
                with ThreadPoolExecutor(args.concurrency) as pool:
                    out = list(pool.map(lambda p: via_triton(url, p, args.max_tokens), prompts))
                wall = time.perf_counter() - t0
                res[name]["ttft"] += [o[0] for o in out]
                res[name]["tokens"] += sum(o[1] for o in out)
                res[name]["wall"] += wall
                print(f"round {r} {name}: TTFT ms {sorted(round(o[0] * 1e3) for o in out)}, "
                      f"{sum(o[1] for o in out) / wall:.1f} tok/s", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    print(f"\n{args.rounds} rounds x {args.concurrency} concurrent gRPC streams, {args.max_tokens} tokens each")
    print("| engine process switch interval | TTFT p50 ms | p90 | max | tokens/s |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, a in res.items():
        t = sorted(a["ttft"])
        print(f"| {name} | {statistics.median(t) * 1e3:.0f} | {t[int(len(t) * 0.9)] * 1e3:.0f} | {t[-1] * 1e3:.0f} | "
              f"{a['tokens'] / a['wall']:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--served", action="store_true", help="through tritonserver: served interval vs Python's")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--intervals", default="0.005,0.0005", help="switch intervals (s) to run with a busy thread")
    ap.add_argument("--draft-head", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.served:
        return served_main(args)
    from specguide.config import EngineConfig
    from specguide.engine.loop import Engine

    print(cpu_header(), flush=True)
    eng = Engine(EngineConfig(device=args.device, max_slots=8, max_seq_len=512, prefill_chunk=128, spec_max_rows=0,
                              drafter="hybrid", draft_head_path=args.draft_head, num_draft_tokens=3))
    default_interval = sys.getswitchinterval()
    rows = []
    try:
        run_round(eng, requests(eng, args.max_tokens))  # capture
        modes = [("no busy thread", default_interval)] + [("busy thread", float(s)) for s in args.intervals.split(",")]
        for name, interval in modes:
            stop = threading.Event()
            spin = None
            if name == "busy thread":
                spin = threading.Thread(target=lambda: [sum(range(200)) for _ in iter(stop.is_set, True)], daemon=True)
                spin.start()
            sys.setswitchinterval(interval)
            graphs = eng.core.step_graphs
            s0, w0, h0 = eng.core.num_steps, graphs.stats.wait_s if graphs else 0.0, host_function_runs()
            t0 = time.perf_counter()
            try:
                run_round(eng, requests(eng, args.max_tokens))
            finally:
                wall = time.perf_counter() - t0
                sys.setswitchinterval(default_interval)
                stop.set()
                if spin:
                    spin.join()
            steps = eng.core.num_steps - s0
            row = dict(mode=name, switch_interval_ms=interval * 1e3, steps=steps, wall_s=round(wall, 2),
                       ms_per_step=round(wall / max(steps, 1) * 1e3, 2),
                       host_functions_per_step=round((host_function_runs() - h0) / max(steps, 1), 1),
                       wait_ms_per_step=round(((graphs.stats.wait_s if graphs else 0.0) - w0) / max(steps, 1) * 1e3, 2))
            rows.append(row)
            print(row, flush=True)
    finally:
        eng.shutdown()
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"\n{where}, {eng.core.drafter} drafter, torch {torch.__version__}, K=3, 8 requests, max_tokens {args.max_tokens}")
    print("| mode | switch interval ms | steps | ms/step | host functions/step | host wait ms/step |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['mode']} | {r['switch_interval_ms']:g} | {r['steps']} | {r['ms_per_step']} | "
              f"{r['host_functions_per_step']} | {r['wait_ms_per_step']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
