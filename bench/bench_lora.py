"""Issue 79's figures: LoRA adapters against the base model, side by side in one engine (the served
defaults, `max_loras` 8), rounds interleaved.

    python bench/bench_lora.py [--tokens 128] [--rank 16] [--adapters 32] [--rounds 3]

`--adapters` random PEFT adapters of rank `--rank` on every projection are written first (the file
layout `peft` saves). Prints the CPU, then:
- an adapter's load time (read, checked, placed; median of 5);
- one decode forward (the C stack alone), batch 1 and 8, without adapters, with one, with 4 x 2 rows;
- tokens/s of 1 stream and of 8 concurrent streams (base, and 4 adapters x 2 streams), with
  speculation (the served K) and without (K=0): the ratios adapter / base and each speculation
  speedup;
- `--adapters` adapters loaded at run time (`Engine.load_adapter`, /v1/load_lora_adapter's path:
  each time), 8 resident, 4 x `--adapters` requests spread over all of them
  8 at a time: errors, adapter loads, the engine's RSS before and after.
"""
from __future__ import annotations

import argparse
import atexit
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "backend_src"))

from machine import cpu_header  # noqa: E402  (bench/ is on sys.path when run as a script)

PROMPTS = [
    "<|im_start|>user\nWrite a short story about a lighthouse keeper.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nExplain how a bicycle gear works.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nList five facts about the moon.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nDescribe a day at a busy market.<|im_end|>\n<|im_start|>assistant\n",
]
MODULES = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def write_adapters(root: Path, count: int, rank: int, cfg, seed: int = 0) -> dict[str, str]:
    """`count` random adapters (PEFT's file layout) under `root`: {name: folder}."""
    import torch
    from safetensors.torch import save_file

    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, inter = cfg.hidden_size, cfg.intermediate_size
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}  # (in, out)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n in range(count):
        tensors = {}
        for i in range(cfg.num_layers):
            for block, names in MODULES.items():
                for m in names:
                    fan_in, fan_out = shapes[m]
                    key = f"base_model.model.model.layers.{i}.{block}.{m}"
                    tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in ** 0.5
                    tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
        folder = root / f"tuned-{n:02d}"
        folder.mkdir(parents=True)
        (folder / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": sum(MODULES.values(), ())}))
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        out[folder.name] = str(folder)
    return out


def forward_ab(core, rounds: int = 15) -> None:
    """Median ms of one decode forward (the served model's C stack), base and with adapters bound to
    its rows (the engine idle; bank places 0-3 hold 4 adapters)."""
    import torch
    from specguide.engine.kv_cache import KVCache

    m, bank = core.model, core.adapters.bank
    kv = KVCache(m.cfg.num_layers, 8, m.cfg.num_kv_heads, 256, m.cfg.head_dim, torch.float32)
    cases = {"batch 1, base": (1, []), "batch 1, 1 adapter": (1, [0]), "batch 8, base": (8, []),
             "batch 8, 1 adapter": (8, [0] * 8), "batch 8, 4 adapters x 2": (8, [0, 1, 2, 3] * 2)}
    ctx = {B: m.make_context(torch.arange(B), torch.full((B, 1), 100), list(range(B)), 101) for B in (1, 8)}
    got: dict[str, list[float]] = {c: [] for c in cases}
    with torch.inference_mode():
        for _ in range(rounds):
            for c, (B, binds) in cases.items():
                for r in range(8):
                    bank.bind(r, binds[r] if r < len(binds) else -1)
                ids = torch.full((B, 1), 5)
                m(ids, ctx[B], kv)
                t0 = time.perf_counter()
                for _ in range(10):
                    m(ids, ctx[B], kv)
                got[c].append((time.perf_counter() - t0) / 10 * 1e3)
    for r in range(8):
        bank.bind(r, -1)
    med = {c: statistics.median(v) for c, v in got.items()}
    print(f"\none decode forward, median of {rounds} rounds of 10 (ms; base / with):")
    for c, v in med.items():
        base = med["batch 1, base" if c.startswith("batch 1") else "batch 8, base"]
        print(f"  {c:28s} {v:7.2f}   {base / v:.2f}x")


def run(engine, reqs: list[tuple[str, str | None, int | None]], tokens: int) -> tuple[float, int]:
    """Send (prompt, adapter, K) requests at once; (tokens/s over the batch's wall time, errors)."""
    from specguide.request import Request, SamplingParams

    done = threading.Semaphore(0)
    counts, errors = [0], [0]
    lock = threading.Lock()

    def on(out) -> None:
        with lock:
            counts[0] += len(out.token_ids)
            if out.finished and out.error:
                errors[0] += 1
        if out.finished:
            done.release()

    t0 = time.perf_counter()
    for prompt, adapter, k in reqs:
        engine.submit(Request(prompt=prompt, params=SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0),
                              lora_name=adapter, num_draft_tokens=k), on)
    for _ in reqs:
        done.acquire()
    return counts[0] / (time.perf_counter() - t0), errors[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lora-dtype", default="auto", choices=("auto", "float32", "bfloat16", "int8"),
                    help="config lora_dtype (the random adapters are float32)")
    args = ap.parse_args()
    print(cpu_header())

    from specguide.config import EngineConfig
    from specguide.engine.loop import Engine
    from specguide.models.lora import load_adapter
    from specguide.util.memory import rss_bytes

    tmp = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    atexit.register(shutil.rmtree, tmp, True)  # the adapters' files (hundreds of MB) go with the run
    # the served defaults; the adapters are loaded at run time from under lora_root
    engine = Engine(EngineConfig(max_seq_len=2048, lora_dtype=args.lora_dtype, lora_root=str(tmp)))
    core = engine.core
    folders = write_adapters(tmp, args.adapters, args.rank, core.model.cfg)
    names = list(folders)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        adapter = load_adapter(names[0], Path(folders[names[0]]), core.model.cfg, args.lora_dtype)
        core.adapters.bank.place(core.adapters.max_loras - 1, adapter)  # placed too, as a load is
        core.adapters.bank.place(core.adapters.max_loras - 1, None)
        times.append(time.perf_counter() - t0)
    print(f"adapter load (rank {args.rank}, {adapter.nbytes / 2**20:.1f} MiB): median {statistics.median(times) * 1e3:.0f} ms "
          f"of 5 (read, checked, placed)")
    loads = []
    for name in names:  # as /v1/load_lora_adapter does: the path checked under the root, read, checked
        t0 = time.perf_counter()
        engine.load_adapter(name, name)
        loads.append(time.perf_counter() - t0)
    print(f"{len(names)} adapters loaded at run time (Engine.load_adapter) in {sum(loads):.1f} s: median "
          f"{statistics.median(loads) * 1e3:.0f} ms, longest {max(loads) * 1e3:.0f} ms; placed at first use "
          f"(max_loras {core.adapters.max_loras})")
    K = core.config.num_draft_tokens
    configs = {
        "1 stream, base, K=0": [(PROMPTS[0], None, 0)],
        "1 stream, adapter, K=0": [(PROMPTS[0], names[0], 0)],
        f"1 stream, base, K={K}": [(PROMPTS[0], None, None)],
        f"1 stream, adapter, K={K}": [(PROMPTS[0], names[0], None)],
        "8 streams, base, K=0": [(PROMPTS[i % 4], None, 0) for i in range(8)],
        "8 streams, 4 adapters, K=0": [(PROMPTS[i % 4], names[i % 4], 0) for i in range(8)],
        f"8 streams, base, K={K}": [(PROMPTS[i % 4], None, None) for i in range(8)],
        f"8 streams, 4 adapters, K={K}": [(PROMPTS[i % 4], names[i % 4], None) for i in range(8)],
    }
    run(engine, configs[f"8 streams, 4 adapters, K={K}"], 16)  # warm: the 4 adapters resident
    assert sorted(core.adapters.by_name[n].index for n in names[:4]) == [0, 1, 2, 3]
    forward_ab(core)
    rates: dict[str, list[float]] = {c: [] for c in configs}
    for _ in range(args.rounds):
        for c, reqs in configs.items():
            rate, errors = run(engine, reqs, args.tokens)
            assert not errors, c
            rates[c].append(rate)
    med = {c: statistics.median(r) for c, r in rates.items()}
    print(f"\ntokens/s, median of {args.rounds} interleaved rounds, {args.tokens} tokens a request (greedy):")
    for c, r in med.items():
        print(f"  {c:32s} {r:7.1f}   ({', '.join(f'{x:.1f}' for x in rates[c])})")
    for streams, base, lora in (("1 stream", "base", "adapter"), ("8 streams", "base", "4 adapters")):
        for k in (0, K):
            b, a = med[f"{streams}, {base}, K={k}"], med[f"{streams}, {lora}, K={k}"]
            print(f"  {streams}, K={k}: adapter / base = {a / b:.2f}x")
        sb = med[f"{streams}, {base}, K={K}"] / med[f"{streams}, {base}, K=0"]
        sa = med[f"{streams}, {lora}, K={K}"] / med[f"{streams}, {lora}, K=0"]
        print(f"  {streams}: speculation speedup base {sb:.2f}x, adapter {sa:.2f}x ({sa / sb:.2f} of base's)")

    rss0, loads0 = rss_bytes(), core.adapters.loads
    spread = [(PROMPTS[i % 4], names[i % len(names)], None) for i in range(4 * len(names))]
    t0 = time.perf_counter()
    errors = 0
    for i in range(0, len(spread), 8):
        errors += run(engine, spread[i: i + 8], 32)[1]
    print(f"\n{len(spread)} requests over {len(names)} adapters, 8 at a time, 32 tokens each: {errors} errors, "
          f"{core.adapters.loads - loads0} adapter loads, {time.perf_counter() - t0:.1f} s; RSS "
          f"{rss0 / 2**20:.0f} -> {rss_bytes() / 2**20:.0f} MiB; resident {core.adapters.stats()['lora_adapters_resident']}")
    engine.shutdown()


if __name__ == "__main__":
    main()
