"""Prefix caching: a free slot keeps its KV, and a prompt that starts with the same tokens prefills
only the rest (whole prefill chunks). Outputs equal those of the engine without reuse, token for
token: greedy and seeded sampled, guided and unguided, speculative with the hybrid drafter (whose
head reads the reused positions' features), alone and in a batch; a prompt that diverges inside
a chunk reuses only the chunks before it."""
from __future__ import annotations

import dataclasses
import json
import threading

import pytest

from specguide import faults
from specguide.config import EngineConfig
from specguide.engine import Engine
from specguide.request import GuidedDecodingParams, Request, SamplingParams

from .conftest import placed_in, stale_kept_prefixes
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
        out += [(toks, final.finish_reason, final.total_draft_tokens, final.total_accepted_draft_tokens,
                 final.kv_cache_reused_blocks) for toks, _, final in run_many(engine, batch)]
    return out


@pytest.mark.parametrize("alone", [True, False], ids=["batch1", "batch3"])
def test_outputs_with_reuse_equal_outputs_without(engines, alone):
    on, off = engines
    want = _run(off, _requests(off), alone)
    got = _run(on, _requests(on), alone)
    assert [g[:4] for g in got] == [w[:4] for w in want]  # tokens, and the drafts: the head's features are right
    assert all(w[4] == 0 for w in want)
    assert sum(1 for g in got if g[4] > 0) >= len(got) - on.config.max_slots  # the first of each slot computes
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
        assert [g[:4] for g in got] == [w[:4] for w in _run(off, _requests(off, system)[:1], alone=True)]
        a, b = on.tokenizer.encode(base[0].prompt), on.tokenizer.encode(req[0].prompt)
        common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        assert got[0][4] * on.runner.kv.tokens_per_block == common - common % chunk  # whole chunks before it
        _run(on, base, alone=True)  # the base prompt again: fully reusable
    assert common > 2 * chunk and common % chunk  # the late variant shares chunks and diverges mid-chunk


def _detailed(engine: Engine, reqs: list[Request], first: Request) -> list[tuple]:
    """Run `first`; once it has its first token (its prompt is prefilled), the others, all at once.
    Per request (`first` last): tokens, log probs, finish reason, drafts proposed / accepted, cached tokens."""
    results: list[list] = [[[], [], None] for _ in range(len(reqs) + 1)]
    started, done = threading.Event(), threading.Semaphore(0)

    def collect(i):
        def cb(out):
            results[i][0].extend(out.token_ids)
            results[i][1].extend(out.logprobs or [])
            started.set()
            if out.finished:
                results[i][2] = out
                done.release()
        return cb

    engine.submit(first, collect(len(reqs)))
    assert started.wait(120)
    for i, r in enumerate(reqs):
        engine.submit(r, collect(i))
    for _ in range(len(reqs) + 1):
        assert done.acquire(timeout=600)
    return [(toks, lps, f.finish_reason, f.total_draft_tokens, f.total_accepted_draft_tokens, f.num_cached_tokens)
            for toks, lps, f in results]


def test_a_prefix_held_by_a_busy_slot_is_copied_exactly(engines, monkeypatch):
    on, off = engines
    system = "Copy test. " + SYSTEM  # no free slot holds it: any reuse is a copy from the busy slot
    copies = []
    orig = on.runner.copy_prefix
    monkeypatch.setattr(on.runner, "copy_prefix", lambda c: (copies.append(c), orig(c)))
    got, want = [], []
    for engine, out in ((on, got), (off, want)):
        reqs = _requests(engine, system)
        donor = dataclasses.replace(reqs[0], guided=None, num_draft_tokens=0,  # decodes 40 tokens, then stops
                                    params=SamplingParams(max_tokens=40, min_tokens=40, temperature=0.0))
        others = []
        for r in reqs[1:4]:  # sampled + speculative, guided sampled + speculative, greedy
            r.params.return_log_probs = True
            others.append(r)
        out += _detailed(engine, others, donor)
    prompts = [on.tokenizer.encode(r.prompt) for r in _requests(on, system)[:4]]
    chunk = on.config.prefill_chunk
    common = [next(i for i, (x, y) in enumerate(zip(prompts[0], p)) if x != y) for p in prompts[1:]]
    assert copies and copies[0].start == 0 and min(common) >= 2 * chunk
    assert [g[5] for g in got[:3]] == [c - c % chunk for c in common]  # whole chunks of the shared part
    assert [w[5] for w in want] == [0] * 4
    # tokens, exact log probs (a stale or shifted row would move them), the drafts (the head's features)
    assert [g[:5] for g in got] == [w[:5] for w in want]
    on.scheduler.check_integrity()


def test_a_next_turn_reuses_only_prefilled_positions_and_stays_exact(engines):
    """A chat's next turn holds the last answer: positions the decode steps computed differ in the
    last bits from a prefill's, so reuse stops at the first turn's prompt chunks (exact log probs)."""
    on, off = engines
    chunk = on.config.prefill_chunk
    first = on.tokenizer.apply_chat_template([{"role": "system", "content": "Turns. " + SYSTEM},
                                              {"role": "user", "content": TEXTS[4]}])
    ids = on.tokenizer.encode(first)
    got, want = [], []
    for engine, out in ((on, got), (off, want)):
        params = SamplingParams(max_tokens=40, min_tokens=40, temperature=0.0, return_log_probs=True)
        answer, _, _ = run_many(engine, [Request(prompt_ids=ids, params=params, num_draft_tokens=0)])[0]
        turn = ids + answer + engine.tokenizer.encode("<|im_end|>\n<|im_start|>user\nAnd Frank?<|im_end|>\n")
        events = list(engine.generate(Request(prompt_ids=turn, params=params, num_draft_tokens=3)))
        out.append(([t for e in events for t in e.token_ids], [lp for e in events for lp in e.logprobs],
                    events[-1].num_cached_tokens))
    assert got[0][:2] == want[0][:2]
    assert got[0][2] == len(ids) - len(ids) % chunk and want[0][2] == 0


@pytest.fixture(scope="module")
def draft_model_engines():
    cfg = dict(max_slots=3, max_seq_len=512, prefill_chunk=32, num_draft_tokens=3, drafter="draft_model",
               spec_max_rows=0)
    on, off = Engine(EngineConfig(**cfg, prefix_caching=True)), Engine(EngineConfig(**cfg, prefix_caching=False))
    yield on, off
    on.shutdown()
    off.shutdown()


def test_the_draft_models_cache_starts_right_after_reuse(draft_model_engines):
    """The draft model (here the target itself: every right draft is accepted) refills its own
    cache from position 0 after reuse: the same tokens and the same accepted drafts as without."""
    on, off = draft_model_engines
    want = _run(off, _requests(off), alone=False) + _run(off, _requests(off), alone=True)
    got = _run(on, _requests(on), alone=False) + _run(on, _requests(on), alone=True)
    assert [g[:4] for g in got] == [w[:4] for w in want]
    assert sum(1 for g in got if g[4] > 0) >= len(got) - on.config.max_slots


def _dirty(engine: Engine) -> None:
    """Traffic that leaves state behind in every slot: prompts sharing chunks with the probes and
    not, guided and not, sampled with penalties and bans, log probs, K 0 and 3, a request failing
    mid-decode (NaN logits), one cancelled mid-decode and one timing out."""
    reqs = []
    for i, r in enumerate(_requests(engine) + _requests(engine, "Dirty. " + SYSTEM)[:3]):
        p = r.params
        p.temperature, p.seed, p.max_tokens = (0.9, 100 + i, 8 + 5 * i) if i % 2 else (0.0, None, 30)
        if i % 3 == 1:
            p.repetition_penalty, p.presence_penalty, p.frequency_penalty = 1.3, 0.5, 0.4
        if i % 4 == 2:
            p.bad_words_ids, p.return_log_probs = [[11], [28]], True
        reqs.append(r)
    reqs.append(Request(prompt=reqs[0].prompt, params=SamplingParams(max_tokens=30, temperature=0.0),
                        num_draft_tokens=3, fault="nan_logits"))
    reqs.append(Request(prompt="word " * 90, params=SamplingParams(max_tokens=40, temperature=0.0), timeout_s=0.5))
    run_many(engine, reqs)
    started, done = threading.Event(), threading.Event()
    sid = engine.submit(Request(prompt=reqs[1].prompt, params=SamplingParams(max_tokens=200, ignore_eos=True)),
                        lambda o: (started.set(), o.finished and done.set()))
    assert started.wait(120)
    engine.cancel(sid)
    assert done.wait(120)


def test_a_greedy_output_is_the_same_whichever_free_slot_it_gets(engines, monkeypatch):
    """After traffic that dirties every slot, the same greedy requests (reusing a kept prefix, or
    a copy of it, or none) placed in each free slot in turn: the same tokens, log probs and drafts
    as without prefix caching; every free slot's kept rows are what a prefill computes."""
    monkeypatch.setenv(faults.ENV, "1")
    on, off = engines

    def run(engine):  # per probe: tokens, log probs, finish reason, drafts proposed / accepted, cached tokens
        out = []
        for r, k in zip((_requests(engine)[0], _requests(engine)[3], _requests(engine, "Fresh. " + SYSTEM)[5]),
                        (3, 0, 3)):
            r = dataclasses.replace(r, num_draft_tokens=k,
                                    params=SamplingParams(max_tokens=30, temperature=0.0, return_log_probs=True))
            events = list(engine.generate(r))
            f = events[-1]
            out.append(([t for e in events for t in e.token_ids], [lp for e in events for lp in e.logprobs],
                        f.finish_reason, f.total_draft_tokens, f.total_accepted_draft_tokens, f.num_cached_tokens))
        return out

    want = run(off)
    _dirty(on)
    assert stale_kept_prefixes(on) == []
    for slot in range(on.config.max_slots):
        with placed_in(on, slot):
            got = run(on)
        assert [g[:5] for g in got] == [w[:5] for w in want], slot
        assert got[0][5] > 0 and got[1][5] > 0  # the first two reuse the kept system prompt (or a copy)
        assert stale_kept_prefixes(on) == []
    assert sum(w[3] for w in want) > 0  # drafts were proposed (their counts compare the head's state)
    on.scheduler.check_integrity()
