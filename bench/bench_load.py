"""Where an engine start spends its time: one `Engine(EngineConfig(...))` build, timed by phase.

    python bench/bench_load.py [--weight-dtype auto] [--activation-dtype auto] [--packed cold|warm|off]

--packed cold: this model's packed-weights cache entry is removed first (the build packs and writes
it); warm: an entry is made first if missing (in a subprocess), then the build reads it; off:
packed_weights_cache false (packs, writes nothing). The phases are wall time (time.perf_counter) and
the process's CPU time (all its threads: steadier than wall time on a shared machine) around the
functions the build calls, nested ones indented; the packing functions are summed over
all their callers (the LM head, the layers, the draft head). Run each configuration in its own
process: the first build of a process also pays the imports of transformers (under "tokenizer").
"""
from __future__ import annotations

import argparse
import collections
import functools
import subprocess
import sys
import time
from pathlib import Path

t_start = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend_src"))

import torch  # noqa: E402

from specguide.engine import core

from specguide import kernels  # noqa: E402
from specguide.config import EngineConfig  # noqa: E402
from specguide.engine.loop import Engine  # noqa: E402
from specguide.models import llama, loader, packed_cache  # noqa: E402
from specguide.speculative import draft_head  # noqa: E402
from machine import cpu_header  # noqa: E402  (bench/ is on sys.path when run as a script)

IMPORT_S = time.perf_counter() - t_start
TIMES: dict[str, float] = collections.defaultdict(float)
CPU: dict[str, float] = collections.defaultdict(float)  # process CPU time (all threads): less noisy on a shared machine
CALLS: collections.Counter = collections.Counter()
PHASES = [  # (owner, attribute, label): the order they are printed in
    (core, "Tokenizer", "tokenizer (and transformers' imports)"),
    (core, "load_model", "load_model"),
    (loader, "_remap", "  _remap (fused q|k|v, gate|up)"),
    (packed_cache.PackedCache, "load", "  packed cache: read"),
    (llama.LlamaModel, "finalize", "  finalize"),
    (llama, "make_head", "    make_head (LM head)"),
    (llama, "prepare_linears", "    prepare_linears (layers)"),
    (packed_cache.PackedCache, "save", "  packed cache: write"),
    (core, "GrammarCompilerService", "grammar compiler service"),
    (core, "Runner", "runner (KV cache, step)"),
    (core, "Proposer", "proposer"),
    (draft_head.DraftHead, "attach", "  draft head attach (packs it)"),
    (kernels, "pack_exact", "[pack_exact: all callers]"),
    (kernels, "pack_weight", "[pack_weight: all callers]"),
    (kernels.quantize, "pack_weight", "[pack_weight: all callers]"),  # pack_exact's own calls
]


def timed(owner, name: str, label: str) -> None:
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t, c = time.perf_counter(), time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[label] += time.perf_counter() - t
            CPU[label] += time.process_time() - c
            CALLS[label] += 1

    setattr(owner, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weight-dtype", default="auto")
    ap.add_argument("--activation-dtype", default="auto")
    ap.add_argument("--packed", choices=("cold", "warm", "off"), default="warm")
    args = ap.parse_args()
    config = EngineConfig(weight_dtype=args.weight_dtype, activation_dtype=args.activation_dtype,
                          packed_weights_cache=args.packed != "off")
    folder = loader.resolve_model_dir(config.model_dir, config.gguf_file)
    entry = packed_cache.PackedCache(folder, loader.weight_files(folder), config.weight_dtype,
                                     kernels.use_integer_dot(config.activation_dtype))
    if args.packed == "cold":
        for p in entry.dir.glob(f"{entry.slot}.*.pt"):
            p.unlink()
    elif args.packed == "warm" and not entry.path.exists():
        subprocess.run([sys.executable, __file__, "--weight-dtype", args.weight_dtype, "--activation-dtype",
                        args.activation_dtype, "--packed", "cold"], check=True, capture_output=True)
    for owner, name, label in PHASES:
        timed(owner, name, label)
    t, c = time.perf_counter(), time.process_time()
    engine = Engine(config)
    total, cpu = time.perf_counter() - t, time.process_time() - c
    print(cpu_header())
    print(f"weight_dtype {args.weight_dtype}, activation_dtype {args.activation_dtype} (integer dot: "
          f"{engine.core.model.integer_dot}), packed cache {args.packed}, {torch.get_num_threads()} threads")
    print(f"{'':44s} {'wall':>8s} {'share':>6s} {'CPU':>8s}")
    print(f"{'imports before Engine() (torch, specguide)':44s} {IMPORT_S:6.2f} s")
    print(f"{'Engine() in all':44s} {total:6.2f} s {100:5.1f}% {cpu:6.2f} s")
    for label in dict.fromkeys(label for _, _, label in PHASES):
        if CALLS[label]:
            print(f"{label:44s} {TIMES[label]:6.2f} s {100 * TIMES[label] / total:5.1f}% {CPU[label]:6.2f} s"
                  f"  ({CALLS[label]} calls)")
    print(f"{'warmup (one forward)':44s} {engine.core.warmup_s:6.2f} s {100 * engine.core.warmup_s / total:5.1f}%")
    print(f"packed cache entry: {entry.path} ({entry.path.stat().st_size / 2**20:.0f} MiB)"
          if entry.path.exists() else "packed cache entry: none")
    engine.shutdown()


if __name__ == "__main__":
    main()
