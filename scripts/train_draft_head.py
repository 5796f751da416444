#!/usr/bin/env python3
"""Train a model's draft head (self-distillation on its own outputs) and save it to the model
cache, where the "head" and "hybrid" drafters find it.

    python scripts/train_draft_head.py [--model-repository DIR | --model-dir DIR [--gguf-file F]]
                                       [--epochs N] [--seed 0] [--out PATH] [--quick] [--if-missing]

`--model-repository DIR` trains for what DIR/specguide/config.pbtxt serves (its model_dir,
gguf_file, device, dtypes, draft_head_path), as `make draft-head MODEL_REPOSITORY=DIR` does; without
it, for --model-dir (default: the embedded default model). The target answers the training
prompts on CUDA when one is present (device "auto"), and the head trains where the target is.
The server runs the same training in the background when the head is missing
(`python -m specguide.training.cli`); a run started meanwhile waits for that one.

~7 minutes on a 2-core CPU with bf16 dot products (~5.7 in fp32, with 4 epochs), with the defaults; `--quick` is
a smoke run (a minute or two).
"""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend_src"))

from specguide.config import EngineConfig  # noqa: E402
from specguide.training.cli import parser, recipe, train  # noqa: E402
from specguide.triton.interfaces import ENGINE_MODEL, engine_parameters  # noqa: E402


def main(argv: list[str]) -> int:
    ap = parser(__doc__)
    ap.add_argument("--model-repository", default="",
                    help=f"a Triton model repository: train for what its {ENGINE_MODEL}/config.pbtxt serves")
    ap.add_argument("--model-dir", default="", help="HF folder of the target model (default: the embedded model)")
    ap.add_argument("--gguf-file", default="", help="a GGUF file inside --model-dir (converted once, cached)")
    ap.add_argument("--weight-dtype", default="", help="EngineConfig.weight_dtype of the target while training "
                                                       "(default: the repository's, else auto)")
    args = ap.parse_args(argv)
    if args.engine_config or args.background:
        ap.error("--engine-config / --background are the server's (python -m specguide.training.cli)")
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.model_repository:
        if args.model_dir or args.gguf_file:
            ap.error("--model-repository names the model itself: leave out --model-dir and --gguf-file")
        served = EngineConfig.from_parameters(engine_parameters(Path(args.model_repository)))
        if served.drafter not in ("head", "hybrid") or not served.num_draft_tokens:
            print(f"draft head: none needed (drafter {served.drafter!r}, num_draft_tokens {served.num_draft_tokens})")
            return 0
    else:
        served = EngineConfig(model_dir=args.model_dir, gguf_file=args.gguf_file)  # the served defaults
    if args.weight_dtype:
        served = replace(served, weight_dtype=args.weight_dtype)
    return train(served, recipe(args), args.out or "", args.if_missing)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
