"""The grammar masks of 32 JSON answers writing free text, as a step fills them (issue 78): computed by
the grammar at every state, against copied from the state the string went on from (guided/budget.py,
`Matcher.mask_by_position`), each backend.

    python bench/bench_free_text_masks.py [--rows 32] [--fills 52]

Each of `--rows` budget-closing matchers (max_tokens 400) of a schema with one free-text string holds
a prefix of the same answer (English words), a few tokens apart; before each batched fill
(`BudgetMatcher.fill_many`, the one a step makes per draft position) every row takes one more token and
a 256 x 576 @ 576 x 2048 matmul runs (a forward's worth of cache traffic). Prints the CPU, then the
median fill per backend and mode, and copied / computed.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "backend_src"))

from machine import cpu_header  # noqa: E402  (bench/ is on sys.path when run as a script)

SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}, "id": {"type": "string", "minLength": 12}},
          "required": ["text", "id"]}
ANSWER = json.dumps({"text": " ".join(["the quick brown fox jumps over the lazy dog"] * 12), "id": "0123456789abcdef"},
                    separators=(",", ":"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--fills", type=int, default=52)
    args = ap.parse_args()
    import torch
    from transformers import AutoTokenizer

    from specguide.guided.budget import BudgetMatcher, within_budget
    from specguide.guided.compiler import GrammarCompilerService
    from specguide.guided.json_scanner import Scanner
    from specguide.guided.schema_completion import Schemas
    from specguide.models.loader import resolve_model_dir
    from specguide.request import GuidedDecodingParams

    print(cpu_header(), flush=True)
    hf = AutoTokenizer.from_pretrained(str(resolve_model_dir()))
    vocab = 49152
    svc = GrammarCompilerService(hf, vocab, max_workers=1, default_backend="auto")
    encode = lambda s: hf.encode(s, add_special_tokens=False)  # noqa: E731
    stop, toks = svc.stop_token_ids[0], encode(ANSWER)
    x, w = torch.randn(256, 576), torch.randn(576, 2048)
    try:
        for backend in ("llguidance", "xgrammar"):
            compiled = svc.compile(GuidedDecodingParams("json_schema", json.dumps(SCHEMA), backend=backend))
            ms_of = {}
            for mode in ("computed", "copied"):
                ms = [within_budget(compiled, Scanner(Schemas(SCHEMA)), 400, svc.token_bytes, encode, stop).matcher()
                      for _ in range(args.rows)]
                if mode == "computed":
                    for m in ms:
                        m._copy_mask = lambda words, row: False  # every mask from the grammar
                bm = torch.zeros((args.rows, (vocab + 31) // 32), dtype=torch.int32)
                times = []
                for j in range(8, 8 + args.fills):
                    for r, m in enumerate(ms):
                        while len(m.states) - 1 < min(j + r % 5, len(toks) - 20):
                            m.accept(toks[len(m.states) - 1])
                    x @ w
                    t0 = time.perf_counter()
                    BudgetMatcher.fill_many(ms, bm, list(range(args.rows)), 1)
                    times.append(time.perf_counter() - t0)
                ms_of[mode] = 1e3 * statistics.median(times)
                print(f"{backend:10s} {mode:8s}: a fill of {args.rows} rows {ms_of[mode]:.3f} ms "
                      f"(median of {args.fills})", flush=True)
            print(f"{backend:10s} copied / computed: {ms_of['copied'] / ms_of['computed']:.2f}", flush=True)
    finally:
        svc.shutdown()


if __name__ == "__main__":
    main()
