"""MaskBench (guidance-ai/jsonschemabench `maskbench/data`) through the engine's grammar code, per backend.

    git clone https://github.com/guidance-ai/jsonschemabench && cp -r jsonschemabench/maskbench/data /tmp/maskbench
    python bench/bench_jsonschema.py /tmp/maskbench --per-split 60 --seed 0

Runs per backend (`xgrammar`, `llguidance`, `auto`, and `auto+best_effort`: formats nothing can check
accepted unchecked). Keywords a grammar cannot express are checked by jsonschema when their value
closes, on every backend (guided/value_check.py).

Never check the data in. A schema passes when it compiles and every test instance, compact and
`json.dumps`-spaced, is accepted exactly when valid (guided/check.py: token walk + EOS).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from machine import cpu_header  # noqa: E402  (bench/ is on sys.path when run as a script)


def load_cases(folder: Path, per_split: int, seed: int) -> list[tuple[str, dict]]:
    """A seeded sample of `per_split` schemas with tests from each split (file name before `---` / `_<n>`)."""
    splits: dict[str, list[Path]] = defaultdict(list)
    for f in sorted(folder.glob("*.json")):
        split = f.name.split("---")[0] if "---" in f.name else f.name.rsplit("_", 1)[0]
        splits[split].append(f)
    rng = random.Random(seed)
    out = []
    for split, files in sorted(splits.items()):
        rng.shuffle(files)
        taken = 0
        for f in files:
            if taken >= per_split:
                break
            try:
                case = json.loads(f.read_text())
            except ValueError:  # an unreadable file: skipped (not counted)
                continue
            if case.get("tests"):
                out.append((f"{split}/{f.stem}", case))
                taken += 1
    return out


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("data", help="folder with MaskBench *.json cases")
    ap.add_argument("--per-split", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backends", default="xgrammar,llguidance,auto,auto+best_effort",
                    help="comma list; '+best_effort' / '+any_key_order': with that request option")
    ap.add_argument("--timeout", type=float, default=30.0, help="compile timeout per schema, s")
    ap.add_argument("--undeclared-keys", default="allow", choices=("allow", "forbid"),
                    help="allow (default here): JSON Schema's reading, which MaskBench's instances test; "
                         "forbid: the served default (declared keys only)")
    ap.add_argument("--model", default="")
    ap.add_argument("--out", default="", help="write per-case JSONL here too")
    args = ap.parse_args()

    from transformers import AutoConfig, AutoTokenizer

    from specguide.guided.check import check_case
    from specguide.guided.compiler import GrammarCompilerService
    from specguide.models.loader import resolve_model_dir

    cases = load_cases(Path(args.data), args.per_split, args.seed)
    folder = resolve_model_dir(args.model)
    tok = AutoTokenizer.from_pretrained(str(folder))
    vocab = AutoConfig.from_pretrained(str(folder)).vocab_size
    print(f"# bench_jsonschema: {len(cases)} MaskBench schemas ({args.per_split} per split, seed {args.seed}); "
          f"{cpu_header()}; {time.strftime('%Y-%m-%d')}")
    print("| backend | passing (both spacings) | compile errors | valid rejected | invalid accepted | "
          "compile p50 / p99 ms | mask p50 / p99 us |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    sink = open(args.out, "w") if args.out else None
    for run in args.backends.split(","):
        backend, *modes = run.split("+")  # "auto+best_effort+any_key_order": request options set to true
        svc = GrammarCompilerService(tok, vocab, max_workers=1, default_backend=backend,
                                     undeclared_keys=args.undeclared_keys)
        params = {m: True for m in modes}
        results = []
        for cid, case in cases:
            r = check_case(svc, lambda s: tok.encode(s, add_special_tokens=False), case, cid, "", args.timeout, params)
            results.append(r)
            if sink:
                sink.write(json.dumps({**r.to_json(), "bench_backend": run}) + "\n")
        svc.shutdown()
        n = len(results)
        compiled = [r for r in results if r.compiled]
        comp_ms = [r.compile_ms for r in compiled]
        mask50 = [r.mask_us_p50 for r in compiled if r.mask_us_p50 is not None]
        mask99 = [r.mask_us_p99 for r in compiled if r.mask_us_p99 is not None]
        print(f"| {run} | {sum(r.passing for r in results)}/{n} ({100 * sum(r.passing for r in results) / n:.1f}%) "
              f"| {n - len(compiled)} | {sum(r.valid_rejected for r in results)} "
              f"| {sum(r.invalid_accepted for r in results)} "
              f"| {pct(comp_ms, 50):.1f} / {pct(comp_ms, 99):.1f} | {pct(mask50, 50):.0f} / {pct(mask99, 99):.0f} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
