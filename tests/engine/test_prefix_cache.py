"""Prefix caching: a free slot keeps its KV, and a prompt that starts with the same tokens prefills
only the rest (whole prefill chunks). Outputs equal those of the engine without reuse, token for
token: greedy and seeded sampled, guided and unguided, speculative with the hybrid drafter (whose
head reads the reused positions' features), alone and in a batch; a prompt that diverges inside
a chunk reuses only the chunks before it."""
from __future__ import annotations

import json

import pytest

from specguide.config import EngineConfig
from specguide.engine import Engine
from specguide.request import GuidedDecodingParams, Request, SamplingParams

from .test_guided_engine import run_many

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "city"]}
SYSTEM = ("You extract facts from short texts about people. Answer with one JSON object that follows "
          f"this JSON schema exactly, and nothing else: {json.dumps(SCHEMA)}")
TEXTS = ["Alice is 30 and lives in Paris; she likes chess.", "Bob, 41, moved to Lyon last year.",
         "Carol (25) works in Berlin as a nurse.", "Dan is a 60-year-old farmer near Oslo.",
         "Eve, 33, Madrid, loves opera and tennis.", "Frank lives in Rome. He is 52."]


def _engine(head: str, caching: bool) -> Engine:
    return Engine(EngineConfig(max_slots=3, max_seq_len=512, prefill_chunk=32, num_draft_tokens=3, drafter="hybrid",
                               draft_head_path=head, spec_max_rows=0, prefix_caching=caching))


def _requests(engine: Engine, system: str = SYSTEM) -> list[Request]:
    reqs = []
    for i, text in enumerate(TEXTS):
        prompt = engine.tokenizer.apply_chat_template([{"role": "system", "content": system},
                                                       {"role": "user", "content": text}])
        guided = GuidedDecodingParams("json_schema", json.dumps(SCHEMA)) if i % 2 == 0 else None
        reqs.append(Request(prompt=prompt, guided=guided, num_draft_tokens=3 if i % 3 else 0,
                            params=SamplingParams(max_tokens=40, temperature=0.7 if i in (1, 2) else 0.0, seed=i)))
    return reqs


@pytest.fixture(scope="module")
def engines(random_head):
    on, off = _engine(str(random_head), True), _engine(str(random_head), False)
    yield on, off
    on.shutdown()
    off.shutdown()


def _run(engine: Engine, reqs: list[Request], alone: bool):
    out = []
    for batch in ([[r] for r in reqs] if alone else [reqs]):
        out += [(toks, final.finish_reason, final.kv_cache_reused_blocks) for toks, _, final in run_many(engine, batch)]
    return out


@pytest.mark.parametrize("alone", [True, False], ids=["batch1", "batch3"])
def test_outputs_with_reuse_equal_outputs_without(engines, alone):
    on, off = engines
    want = _run(off, _requests(off), alone)
    got = _run(on, _requests(on), alone)
    assert [g[:2] for g in got] == [w[:2] for w in want]
    assert all(w[2] == 0 for w in want)
    assert sum(1 for g in got if g[2] > 0) >= len(got) - on.config.max_slots  # the first of each slot computes
    assert all(g[1] in ("stop", "length") for g in got)
    on.scheduler.check_integrity()


def test_a_prompt_diverging_inside_a_chunk_reuses_only_the_chunks_before_it(engines):
    on, off = engines
    base = _requests(on)[:1]
    _run(on, base, alone=True)  # a free slot now holds this prompt
    early = SYSTEM.replace("short texts", "brief notes")  # diverges in the first chunk
    late = SYSTEM.replace('"tags"', '"labels"')  # diverges inside a later chunk
    chunk = on.config.prefill_chunk
    for system in (early, late):
        req = _requests(on, system)[:1]
        got = _run(on, req, alone=True)
        assert [g[:2] for g in got] == [w[:2] for w in _run(off, _requests(off, system)[:1], alone=True)]
        a, b = on.tokenizer.encode(base[0].prompt), on.tokenizer.encode(req[0].prompt)
        common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        assert got[0][2] * on.runner.kv.tokens_per_block == common - common % chunk  # whole chunks before it
        _run(on, base, alone=True)  # the base prompt again: fully reusable
    assert common > 2 * chunk and common % chunk  # the late variant shares chunks and diverges mid-chunk
