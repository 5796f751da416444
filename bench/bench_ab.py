"""One benchmark, two revisions of the code, in one run: a git revision's tree against this one.

    python bench/bench_ab.py [--against c6a2f80] [--rounds 2] [--key workload,batch,K] [--metric tok_s]
        -- bench/bench_speculative.py --drafters hybrid --ks 3 --schemas 8

Checks `--against` out into a temporary git worktree and runs the benchmark script (the arguments
after `--`, which must write its rows to `--json FILE` as a JSON list of objects) from each tree in
turn, alternated `--rounds` times (old, new, new, old, ...), each in a process of its own that
imports the package of its own tree (the bench scripts put their tree's `backend_src` first on
`sys.path`). Rows are matched on `--key`; prints each tree's mean `--metric` and new / old. The
same machine, model and settings for both: only the code differs (issue 75's "throughput of normal
traffic unchanged").
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from statistics import mean

sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import cpu_header  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def run_once(tree: Path, script: list[str], out: Path) -> list[dict]:
    cmd = [sys.executable, str(tree / script[0]), *script[1:], "--json", str(out)]
    subprocess.run(cmd, cwd=tree, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", default="c6a2f80", help="the git revision to compare with")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--key", default="workload,batch,K", help="comma list of the fields that name a row")
    ap.add_argument("--metric", default="tok_s")
    args = ap.parse_args(argv[:split])
    script = argv[split + 1:] or ["bench/bench_speculative.py", "--drafters", "hybrid", "--ks", "3", "--schemas", "8"]
    keys = args.key.split(",")
    rev = subprocess.run(["git", "rev-parse", "--short", args.against], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.strip()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout.strip()
    print(cpu_header())
    print(f"A/B: {rev} (old) vs the working tree at {head} (new); {' '.join(script)}; {args.rounds} rounds", flush=True)
    values: dict[str, dict[tuple, list[float]]] = {"old": defaultdict(list), "new": defaultdict(list)}
    with tempfile.TemporaryDirectory(prefix="bench_ab_") as tmp:
        old = Path(tmp) / "old"
        subprocess.run(["git", "worktree", "add", "--detach", str(old), args.against], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            for r in range(args.rounds):
                pair = (("old", old), ("new", ROOT))
                for name, tree in (pair if r % 2 == 0 else pair[::-1]):  # each goes first in turn
                    rows = run_once(tree, script, Path(tmp) / f"{name}{r}.json")
                    for row in rows:
                        if row.get(args.metric) is not None:
                            values[name][tuple(row.get(k) for k in keys)].append(float(row[args.metric]))
                    print(f"round {r + 1} {name}: {len(rows)} rows", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT, capture_output=True)
    print(f"| {' | '.join(keys)} | {args.metric} old | {args.metric} new | new / old |")
    print("|" + " --- |" * (len(keys) + 3))
    for key in sorted(values["new"], key=str):
        a, b = values["old"].get(key), values["new"][key]
        if not a:
            continue
        print(f"| {' | '.join(map(str, key))} | {_fmt(a)} | {_fmt(b)} | {mean(b) / mean(a):.3f} |")


def _fmt(values: list[float]) -> str:
    """The mean, then each round's value (3 decimals below 10: ratios such as speedup_vs_off)."""
    f = (lambda v: f"{v:.1f}") if max(abs(v) for v in values) >= 10 else (lambda v: f"{v:.3f}")
    return f"{f(mean(values))} ({', '.join(f(v) for v in values)})"


if __name__ == "__main__":
    main()
