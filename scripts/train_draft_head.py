#!/usr/bin/env python3
"""Train a model's draft head (self-distillation on its own outputs) and save it to the model
cache, where the "head" and "hybrid" drafters find it.

    python scripts/train_draft_head.py [--model-repository DIR | --model-dir DIR [--gguf-file F]]
                                       [--epochs N] [--seed 0] [--out PATH] [--quick] [--if-missing]

`--model-repository DIR` trains for what DIR/specguide/config.pbtxt serves (its model_dir,
gguf_file, device, dtypes, draft_head_path), as `make serve MODEL_REPOSITORY=DIR` does; without
it, for --model-dir (default: the embedded default model). The target answers the training
prompts on CUDA when one is present (device "auto"), and the head trains where the target is.

~7 minutes on a 2-core CPU with bf16 dot products (~5.7 in fp32, with 4 epochs), with the defaults; `--quick` is
a smoke run (a minute or two).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend_src"))

from specguide.config import EngineConfig  # noqa: E402
from specguide.engine import Engine  # noqa: E402
from specguide.models.loader import resolve_model_dir  # noqa: E402
from specguide.speculative.draft_head import default_head_path  # noqa: E402
from specguide.training.precision import CHOICES  # noqa: E402
from specguide.training.train_head import TrainConfig, corpus_engine_config, run  # noqa: E402
from specguide.triton.interfaces import ENGINE_MODEL, engine_parameters  # noqa: E402


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="where to save (default: the repository's draft_head_path, else the model "
                                  "cache's draft_heads/<folder>-<hash>.pt, where the server looks)")
    ap.add_argument("--model-repository", default="",
                    help=f"a Triton model repository: train for what its {ENGINE_MODEL}/config.pbtxt serves")
    ap.add_argument("--model-dir", default="", help="HF folder of the target model (default: the embedded model)")
    ap.add_argument("--gguf-file", default="", help="a GGUF file inside --model-dir (converted once, cached)")
    ap.add_argument("--weight-dtype", default="", help="EngineConfig.weight_dtype of the target while training "
                                                       "(default: the repository's, else auto)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=TrainConfig.epochs,
                    help="0 = by the matmul dtype: 8 with bf16, 4 in fp32 (training.train_head.AUTO_EPOCHS)")
    ap.add_argument("--schemas", type=int, default=TrainConfig.num_schemas)
    ap.add_argument("--variants", type=int, default=TrainConfig.schema_variants, help="phrasings per whole schema")
    ap.add_argument("--subschemas", type=int, default=TrainConfig.num_subschemas,
                    help="nested object schemas of the train split, one phrasing each (0 = none)")
    ap.add_argument("--chat", type=int, default=TrainConfig.num_chat)
    ap.add_argument("--draft-vocab", type=int, default=TrainConfig.draft_vocab)
    ap.add_argument("--depth", type=int, default=TrainConfig.depth)
    ap.add_argument("--matmul-dtype", default=TrainConfig.matmul_dtype, choices=CHOICES,
                    help="training matmuls: auto = bfloat16 autocast where the CPU/GPU has bf16 dot products")
    ap.add_argument("--quick", action="store_true", help="tiny smoke run")
    ap.add_argument("--if-missing", action="store_true", help="do nothing when the head already exists")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    cfg = TrainConfig(seed=args.seed, epochs=args.epochs, num_schemas=args.schemas, num_chat=args.chat,
                      schema_variants=args.variants, num_subschemas=args.subschemas,
                      draft_vocab=args.draft_vocab, depth=args.depth, matmul_dtype=args.matmul_dtype)
    if args.quick:
        cfg = TrainConfig(seed=args.seed, epochs=1, num_schemas=8, num_chat=8, max_tokens_json=48,
                          max_tokens_chat=32, num_subschemas=8, draft_vocab=args.draft_vocab, depth=2,
                          matmul_dtype=args.matmul_dtype)
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
    folder = resolve_model_dir(served.model_dir, served.gguf_file)
    out = Path(args.out or served.draft_head_path or default_head_path(folder))
    if args.if_missing and out.exists():
        print(f"draft head: {out} (delete it to retrain)")
        return 0
    print(f"training the draft head of {folder} into {out} (the default model: about 7 minutes on a 2-core CPU; "
          "once)", flush=True)
    t0 = time.perf_counter()
    engine = Engine(corpus_engine_config(replace(served, model_dir=str(folder), gguf_file="")))
    head, report, engine = run(cfg, engine)
    engine.shutdown()
    meta = {"train_config": asdict(cfg), "report": asdict(report), "model": str(folder),
            "date": time.strftime("%Y-%m-%d"), "seconds_total": round(time.perf_counter() - t0, 1)}
    head.save(out, meta)
    print(json.dumps({"saved": str(out), **meta}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
