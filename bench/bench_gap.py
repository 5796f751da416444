"""Issue 77's "one token budget" figure (and issue 75's victim gap): while one long prompt
prefills, how long do the running streams wait between tokens, against their normal step?

    python bench/bench_gap.py [--streams 8] [--long 6000] [--budgets 256] [--rounds 2] [--against 18a9ee8]

`--streams` greedy requests (~300-token prompts, `ignore_eos`, speculation as served) decode;
their normal step is the median gap between output events over `--settle` seconds. Then one
`--long`-token prompt arrives (`max_tokens` 1). Per round: the streams' longest gap between
events while it prefills (from its arrival to its token), that gap over the normal step, the long
prompt's TTFT, and the streams' output events/s meanwhile. `--budgets`: values of the
token budget of a step: `step_token_budget`, or `prefill_chunk` in a tree without it). `--against REV`: the same measurement on a git revision's tree, in a
process of its own that imports that tree's package, rounds alternated (old, new, new, old, ...).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure(engine, prompts: list[list[int]], long_prompt: list[int], settle: float) -> dict:
    from specguide.request import Request, SamplingParams

    events: list[list[float]] = [[] for _ in prompts]
    ids = []
    for i, p in enumerate(prompts):
        cb = (lambda i: lambda out: events[i].append(time.perf_counter()) if out.token_ids else None)(i)
        ids.append(engine.submit(Request(prompt_ids=p, params=SamplingParams(max_tokens=4000, temperature=0.0,
                                                                             ignore_eos=True)), cb))
    deadline = time.perf_counter() + 600
    while not all(events):
        assert time.perf_counter() < deadline
        time.sleep(0.01)
    t_settled = time.perf_counter()
    time.sleep(settle)
    normal = statistics.median(b - a for ev in events for a, b in zip(ev, ev[1:]) if a >= t_settled)
    first = threading.Event()
    t0 = time.perf_counter()
    engine.submit(Request(prompt_ids=long_prompt, params=SamplingParams(max_tokens=1, temperature=0.0)),
                  lambda out: first.set() if out.finished else None)
    assert first.wait(timeout=1200)
    t1 = time.perf_counter()
    time.sleep(0.5)  # the gap that ends after the prompt's token counts too
    for seq_id in ids:
        engine.cancel(seq_id)
    gaps, tokens = [], 0
    for ev in events:
        inside = [t for t in ev if t0 <= t <= t1]
        tokens += len(inside)
        marks = [max(t for t in ev if t < t0)] + inside + [min((t for t in ev if t > t1), default=t1)]
        gaps += [b - a for a, b in zip(marks, marks[1:])]
    longest, q = max(gaps), statistics.quantiles(gaps, n=100)
    deadline = time.perf_counter() + 600
    while engine.stats()["active_slots"]:
        assert time.perf_counter() < deadline
        time.sleep(0.01)
    return {"normal_ms": normal * 1e3, "longest_ms": longest * 1e3, "ratio": longest / normal,
            "p50_ms": q[49] * 1e3, "p99_ms": q[98] * 1e3,
            "ttft_s": t1 - t0, "events_per_s": tokens / (t1 - t0)}


def child(args: argparse.Namespace) -> None:
    """One tree's rounds: rows as JSON on stdout's last line."""
    sys.path.insert(0, str(Path(args.package).resolve()))
    import specguide  # that tree's package, before bench_kv_cache puts this tree's first on the path
    from specguide.config import EngineConfig
    from specguide.engine.loop import Engine
    from specguide.request import Request  # noqa: F401 (measure's imports: the same package)

    assert Path(specguide.__file__).resolve().is_relative_to(Path(args.package).resolve()), specguide.__file__
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_kv_cache import prompt_of, texts

    rows = []
    for budget in (int(b) for b in args.budgets.split(",")):
        # the step's token budget: step_token_budget (one forward a step), before it prefill_chunk
        knob = "step_token_budget" if "step_token_budget" in EngineConfig.__dataclass_fields__ else "prefill_chunk"
        engine = Engine(EngineConfig(prefix_caching=False, **{knob: budget}))
        ids = texts(engine)
        prompts = [prompt_of(ids, 300, i) for i in range(args.streams)]
        for r in range(args.round_count):
            long_prompt = prompt_of(ids, args.long, args.round_base + r)
            rows.append({"budget": budget, **measure(engine, prompts, long_prompt, args.settle)})
        engine.shutdown()
    print(json.dumps(rows))


def run_tree(tree: Path, args: argparse.Namespace, round_base: int) -> list[dict]:
    cmd = [sys.executable, str(ROOT / "bench" / "bench_gap.py"), "--child", "--package", str(tree / "backend_src"),
           "--streams", str(args.streams), "--long", str(args.long), "--budgets", args.budgets,
           "--settle", str(args.settle), "--round-count", "1", "--round-base", str(round_base)]
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--long", type=int, default=6000)
    ap.add_argument("--budgets", default="256")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--settle", type=float, default=3.0)
    ap.add_argument("--against", default=None)
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--package", default=str(ROOT / "backend_src"))
    ap.add_argument("--round-count", type=int, default=1)
    ap.add_argument("--round-base", type=int, default=0)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    sys.path.insert(0, str(ROOT / "bench"))
    from machine import cpu_header

    print(cpu_header(), flush=True)
    trees = {"this tree": ROOT}
    tmp = None
    if args.against:
        tmp = tempfile.mkdtemp(prefix="bench_gap_")
        subprocess.run(["git", "worktree", "add", "--detach", tmp, args.against], cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        trees = {args.against: Path(tmp), "this tree": ROOT}
    order = list(trees)
    results: dict[str, list[dict]] = {name: [] for name in trees}
    try:
        for r in range(args.rounds):
            for name in (order if r % 2 == 0 else order[::-1]):
                results[name] += run_tree(trees[name], args, r)
    finally:
        if tmp:
            subprocess.run(["git", "worktree", "remove", "--force", tmp], cwd=ROOT, check=False)
    print(f"\n{args.streams} streams decoding, one {args.long}-token prompt arrives:")
    print("| tree | budget | normal step (ms) | gaps meanwhile p50 / p99 (ms) | longest gap (ms) | longest / step "
          "| long TTFT (s) | stream events/s meanwhile |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, rows in results.items():
        for row in rows:
            print(f"| {name} | {row['budget']} | {row['normal_ms']:.0f} | {row['p50_ms']:.0f} / {row['p99_ms']:.0f} | "
                  f"{row['longest_ms']:.0f} | {row['ratio']:.1f} | {row['ttft_s']:.2f} | {row['events_per_s']:.1f} |",
                  flush=True)


if __name__ == "__main__":
    main()
