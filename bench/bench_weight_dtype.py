"""Weight-only quantization on CPU: size, forward latency and closeness to fp32, in one run.

    python bench/bench_weight_dtype.py [--schemas 8] [--max-tokens 96] [--json out.json]

For each `weight_dtype` (float32, bfloat16, int8): bytes of the packed linear weights, one
forward + logits at decode sizes (1 and 4 query rows, at position 400), and against the float32
model: top-1 agreement and KL(fp32 || quantized) of the next-token distribution, teacher-forced
along the float32 engine's greedy answers (held-out JSON-schema prompts under their grammar, and
unguided chat), and how many greedy answers come out identical token for token.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend_src"))

from specguide.config import EngineConfig  # noqa: E402
from specguide.engine.loop import Engine  # noqa: E402
from specguide.engine.kv_cache import KVCache  # noqa: E402
from specguide.models.linear import InvariantLinear  # noqa: E402
from specguide.request import GuidedDecodingParams, Request, SamplingParams  # noqa: E402
from specguide.training.prompts import CHAT_BENCH, load_schemas, schema_message  # noqa: E402
from machine import cpu_header  # noqa: E402  (bench/ is on sys.path when run as a script)


def answers(engine: Engine, work: list[tuple[str, GuidedDecodingParams | None]], max_tokens: int) -> list[list[int]]:
    out = []
    for prompt, guide in work:
        req = Request(prompt=prompt, guided=guide, params=SamplingParams(max_tokens=max_tokens, temperature=0.0))
        out.append([t for o in engine.generate(req) for t in o.token_ids])
    return out


def scratch_kv(engine: Engine) -> KVCache:
    """A one-slot KV cache shaped like the engine's: direct forwards must not write the engine's own
    (a free slot keeps its prompt's rows for prefix caching; the answers below would reuse them)."""
    return engine.core.runner.kv.like(1)


@torch.no_grad()
def logits_along(engine: Engine, ids: list[int]) -> torch.Tensor:
    """Teacher-forced logits [T, vocab] (prefill-sized forward, a scratch cache)."""
    m = engine.core.model
    ctx = m.make_context(torch.tensor([0]), torch.arange(len(ids))[None], [0], len(ids))
    return m.logits(m(torch.tensor([ids]), ctx, scratch_kv(engine)))[0]


@torch.no_grad()
def forward_ms(engine: Engine, rows: int, reps: int = 30) -> float:
    m, kv = engine.core.model, scratch_kv(engine)
    pos = torch.arange(400, 400 + rows)[None]
    ctx = m.make_context(torch.tensor([0]), pos, [0], 400 + rows)
    ids = torch.randint(0, 1000, (1, rows))
    for _ in range(3):
        m.logits(m(ids, ctx, kv))
    t = time.perf_counter()
    for _ in range(reps):
        m.logits(m(ids, ctx, kv))
    return (time.perf_counter() - t) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schemas", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--weight-dtypes", default="float32,auto,q4_1,bfloat16,int8",
                    help="comma list of weight_dtype values; the first is the reference")
    ap.add_argument("--json")
    args = ap.parse_args()
    print(cpu_header(), flush=True)
    engines = {wd: Engine(EngineConfig(max_slots=2, max_seq_len=2048, num_draft_tokens=0, weight_dtype=wd))
               for wd in args.weight_dtypes.split(",")}
    ref = engines[args.weight_dtypes.split(",")[0]]
    tok = ref.tokenizer
    work = {"guided_json": [(tok.apply_chat_template([{"role": "user", "content": schema_message(s)}]),
                             GuidedDecodingParams("json_schema", s))
                            for s in load_schemas("heldout", ref.core.compiler)[: args.schemas]],
            "chat": [(tok.apply_chat_template([{"role": "user", "content": c}]), None)
                     for c in CHAT_BENCH[: args.schemas]]}
    ref_answers = {w: answers(ref, items, args.max_tokens) for w, items in work.items()}
    rows = []
    for wd, eng in engines.items():
        row = dict(weight_dtype=wd,
                   packed_mib=round(sum(m.packed.numel() * m.packed.element_size() for m in eng.core.model.modules()
                                        if isinstance(m, InvariantLinear)) / 2 ** 20, 1),
                   forward_ms_1_row=round(forward_ms(eng, 1), 2), forward_ms_4_rows=round(forward_ms(eng, 4), 2))
        for w, items in work.items():
            agree = kl = n = 0.0
            for (prompt, _), ans in zip(items, ref_answers[w]):
                ids = tok.encode(prompt) + ans
                a, b = logits_along(ref, ids)[:-1], logits_along(eng, ids)[:-1]
                agree += (a.argmax(-1) == b.argmax(-1)).sum().item()
                kl += torch.nn.functional.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True,
                                                 reduction="sum").item()
                n += a.shape[0]
            same = sum(x == y for x, y in zip(answers(eng, items, args.max_tokens), ref_answers[w]))
            row[f"{w}_top1_agreement"] = round(agree / n, 4)
            row[f"{w}_kl"] = float(f"{kl / n:.2e}")
            row[f"{w}_identical_answers"] = f"{same}/{len(items)}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    for e in engines.values():
        e.shutdown()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
