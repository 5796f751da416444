"""Train a model's draft head (self-distillation on its own outputs) and save it where the "head"
and "hybrid" drafters find it: `python -m specguide.training.cli --engine-config JSON`, which the
server runs in the background when the head is missing (`head_training.BackgroundTraining`), and
`scripts/train_draft_head.py`, which adds `--model-repository` / `--model-dir` on top.

One training per head file at a time: a lock beside the file (`<head>.lock`, released by the
kernel whatever ends the process) makes a second run wait for the first, then find the head made.
The save is an atomic rename: a reader never sees half a file. An interrupted run leaves no head,
and the next run starts over.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Iterator

from ..config import EngineConfig
from ..engine.loop import Engine
from ..process.head_training import PARENT_ENV
from ..process.ipc import demote
from ..models.loader import resolve_model_dir
from ..speculative.draft_head import default_head_path
from .precision import CHOICES
from .train_head import TrainConfig, corpus_engine_config, run

def parser(description: str = __doc__) -> argparse.ArgumentParser:
    """The recipe's settings (defaults: TrainConfig's), where to save, and how to run."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="where to save (default: the config's draft_head_path, else the model "
                                  "cache's draft_heads/<folder>-<hash>.pt, where the server looks)")
    ap.add_argument("--engine-config", default="", help="the served EngineConfig as JSON (the server passes it)")
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
    ap.add_argument("--quick", action="store_true", help="tiny smoke run (a minute or two on 2 cores)")
    ap.add_argument("--if-missing", action="store_true", help="do nothing when the head already exists")
    ap.add_argument("--background", action="store_true",
                    help="the server's run: the least CPU share (ipc.demote), dies with the server")
    return ap


def recipe(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig the arguments ask for."""
    if args.quick:
        return TrainConfig(seed=args.seed, epochs=1, num_schemas=8, num_chat=8, max_tokens_json=48,
                           max_tokens_chat=32, num_subschemas=8, draft_vocab=args.draft_vocab, depth=2,
                           matmul_dtype=args.matmul_dtype)
    return TrainConfig(seed=args.seed, epochs=args.epochs, num_schemas=args.schemas, num_chat=args.chat,
                       schema_variants=args.variants, num_subschemas=args.subschemas,
                       draft_vocab=args.draft_vocab, depth=args.depth, matmul_dtype=args.matmul_dtype)


@contextlib.contextmanager
def head_lock(out: Path) -> Iterator[None]:
    """Hold `<out>.lock` (waiting for another training of the same head to end)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"draft head: another process is training {out}; waiting for it", flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


def train(served: EngineConfig, cfg: TrainConfig, out: str = "", if_missing: bool = False) -> int:
    """Train the head of the model `served` serves into `out` (default: where the engine looks)."""
    folder = resolve_model_dir(served.model_dir, served.gguf_file)
    path = Path(out or served.draft_head_path or default_head_path(folder))
    with head_lock(path):
        if if_missing and path.exists():
            print(f"draft head: {path} (delete it to retrain)", flush=True)
            return 0
        print(f"training the draft head of {folder} into {path} (the default model: about 7 minutes on a 2-core "
              "CPU; once)", flush=True)
        t0 = time.perf_counter()
        engine = Engine(corpus_engine_config(replace(served, model_dir=str(folder), gguf_file="")))
        head, report, engine = run(cfg, engine)
        engine.shutdown()
        meta = {"train_config": asdict(cfg), "report": asdict(report), "model": str(folder),
                "date": time.strftime("%Y-%m-%d"), "seconds_total": round(time.perf_counter() - t0, 1)}
        head.save(path, meta)  # atomic: a temporary file renamed over the name
    print(json.dumps({"saved": str(path), **meta}, indent=1), flush=True)
    return 0


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.background:
        demote(PARENT_ENV)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    served = EngineConfig(**json.loads(args.engine_config)) if args.engine_config else EngineConfig()
    return train(served, recipe(args), args.out or "", args.if_missing)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
