"""`python -m specguide.guided check --cases FILE.jsonl [--model DIR] [--backend auto|xgrammar|llguidance]
    [--undeclared-keys forbid|allow]`

Prints one JSON line per case (see guided/check.py) and a summary on stderr.
"""
from __future__ import annotations

import argparse
import json
import sys

from .backend import BACKEND_NAMES


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specguide.guided")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="compile JSON schemas and walk MaskBench-style instances through the grammar")
    c.add_argument("--cases", required=True, help="JSONL: {schema, tests: [{data, valid}]} per line")
    c.add_argument("--model", default="", help="HF model folder (default: the model `make serve` serves)")
    c.add_argument("--backend", default="auto", choices=BACKEND_NAMES)
    c.add_argument("--timeout", type=float, default=30.0, help="compile timeout per case, seconds")
    c.add_argument("--undeclared-keys", default="forbid", choices=("forbid", "allow"),
                   help="objects silent on additionalProperties: declared keys only (forbid, as served) or any "
                        "key (allow: JSON Schema's reading, what MaskBench's instances expect)")
    c.add_argument("--out", default="-", help="output JSONL (default stdout)")
    args = ap.parse_args(argv)

    from transformers import AutoConfig, AutoTokenizer

    from ..models.loader import resolve_model_dir
    from .check import check_lines
    from .compiler import GrammarCompilerService

    folder = resolve_model_dir(args.model) if args.model else resolve_model_dir()
    tok = AutoTokenizer.from_pretrained(str(folder))
    vocab = AutoConfig.from_pretrained(str(folder)).vocab_size
    service = GrammarCompilerService(tok, vocab, max_workers=1, default_backend=args.backend,
                                     undeclared_keys=args.undeclared_keys)

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    out = sys.stdout if args.out == "-" else open(args.out, "w")
    n = passing = invalid = 0
    try:
        with open(args.cases) as f:
            for r in check_lines(service, encode, f, "", args.timeout):
                out.write(json.dumps(r.to_json(), ensure_ascii=False) + "\n")
                out.flush()
                n, passing, invalid = n + 1, passing + r.passing, invalid + r.invalid_accepted
    finally:
        service.shutdown()
        if out is not sys.stdout:
            out.close()
    print(f"{n} cases: {passing} passing (both forms), {invalid} invalid instance forms accepted", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
