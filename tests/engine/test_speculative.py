"""Speculative decoding on the real SmolLM2: greedy output with speculation equals without it,
token for token (guided or not, staggered batch, mixed K, both drafters); stops inside accepted
runs; grammar dead ends in drafts."""
from __future__ import annotations

import json

import pytest

from specguide.config import EngineConfig
from specguide.engine.loop import Engine
from specguide.request import GuidedDecodingParams, Request, SamplingParams

from .conftest import run_alone
from .test_guided_engine import run_many

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}}, "required": ["name", "age", "city"]}
PEOPLE = ["Alice is 30 and lives in Paris.", "Bob, 41, from Berlin.", "Carol (25) lives in Rome.",
          "Dan is 60; home: Oslo."]


def prompts(engine):
    out = []
    for who in PEOPLE:
        out.append((engine.tokenizer.apply_chat_template([{"role": "user", "content":
                    f"Extract name, age and city as JSON matching {json.dumps(SCHEMA)}: {who}"}]), True))
        out.append((engine.tokenizer.apply_chat_template([{"role": "user", "content":
                    f"Repeat this sentence three times: {who}"}]), False))
    return out


def requests(engine, k_of, max_tokens=48, **kw):
    reqs = []
    for i, (prompt, guided) in enumerate(prompts(engine)):
        reqs.append(Request(prompt=prompt, num_draft_tokens=k_of(i),
                            params=SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw),
                            guided=GuidedDecodingParams("json_schema", json.dumps(SCHEMA)) if guided else None))
    return reqs


@pytest.fixture(scope="module")
def ngram_engine():
    """Prompt-lookup drafts alone, in every step (no clock decides whether a step drafts)."""
    eng = Engine(EngineConfig(max_slots=8, max_seq_len=512, prefill_chunk=64, num_draft_tokens=3, drafter="ngram",
                              cost_aware_k=False))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def early_exit_engine():
    eng = Engine(EngineConfig(max_slots=8, max_seq_len=512, num_draft_tokens=3, drafter="early_exit",
                              draft_layers=20, cost_aware_k=False))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def draft_model_engine():
    # the default model drafting for itself: with batch-invariant kernels every greedy draft is accepted
    eng = Engine(EngineConfig(max_slots=8, max_seq_len=512, num_draft_tokens=3, drafter="draft_model",
                              cost_aware_k=False))
    yield eng
    eng.shutdown()


@pytest.fixture
def recorded_runs(ngram_engine):
    """Record every verification step's emitted runs of the n-gram engine: [(tokens, accepted)]."""
    engine = ngram_engine
    runs = []
    original = engine.core.runner.step

    def step(*args, **kw):
        out = original(*args, **kw)
        runs.extend((toks, a) for toks, d, a in out if d)
        return out
    engine.core.runner.step = step
    yield runs
    del engine.core.runner.step


def _staggered(engine, reqs):
    import threading
    import time

    results = [[] for _ in reqs]
    finals = [None] * len(reqs)
    done = threading.Semaphore(0)
    for i, r in enumerate(reqs):
        def cb(o, i=i):
            results[i].extend(o.token_ids)
            if o.finished:
                finals[i] = o
                done.release()
        engine.submit(r, cb)
        time.sleep(0.1)
    for _ in reqs:
        assert done.acquire(timeout=300)
    return results, finals


@pytest.mark.parametrize("drafter", ["hybrid", "ngram", "early_exit", "draft_model"])
def test_greedy_with_speculation_equals_without(request, monkeypatch, drafter):
    eng = request.getfixturevalue({"hybrid": "engine", "ngram": "ngram_engine", "early_exit": "early_exit_engine",
                                   "draft_model": "draft_model_engine"}[drafter])  # hybrid: the served engine
    assert eng.core.drafter == drafter
    # every step with K > 0 drafts: the served engine's cost_aware_k judges from step times it measured
    # (on a loaded machine it once drafted in none of these steps); test_drafters checks it is lossless
    monkeypatch.setattr(eng.core.proposer, "step_costs", None)
    plain = [run_alone(eng, r)[0] for r in requests(eng, k_of=lambda i: 0)]
    spec, finals = _staggered(eng, requests(eng, k_of=lambda i: (3, 1, 2, 3, 0, 3, 2, 3)[i]))
    assert spec == plain
    drafted = sum(f.total_draft_tokens for f in finals)
    accepted = sum(f.total_accepted_draft_tokens for f in finals)
    assert drafted > 0 and 0 < accepted <= drafted
    assert finals[4].total_draft_tokens == 0  # num_draft_tokens = 0 turns speculation off
    if drafter == "draft_model":  # the target drafting for itself: every draft is accepted
        assert accepted == drafted
    for (prompt, guided), toks, f in zip(prompts(eng), spec, finals):
        if guided and f.finish_reason == "stop":
            import jsonschema

            jsonschema.validate(json.loads(eng.tokenizer.decode(toks)), SCHEMA)
    eng.core.scheduler.check_integrity()


def test_stops_inside_an_accepted_run(ngram_engine, recorded_runs):
    # n-gram drafts in every step (no cost-aware budget): long accepted runs on "repeat three times"
    engine = ngram_engine
    req = requests(engine, k_of=lambda i: 3, max_tokens=64)[1]  # "repeat three times": long accepted runs
    plain, _, _ = run_alone(engine, Request(prompt=req.prompt, num_draft_tokens=0, params=req.params))
    recorded_runs.clear()
    spec, _, _ = run_alone(engine, req)
    assert spec == plain
    # a position inside a multi-token run: cutting there must drop the rest of that run
    pos, cut = 0, None
    for toks, accepted in recorded_runs:
        if accepted >= 2 and pos > 0:
            cut = pos + 1  # index of the second token of this run
            break
        pos += len(toks)
    assert cut is not None, "no multi-token accepted run"
    prompt = req.prompt
    # max_tokens inside the run
    p = SamplingParams(max_tokens=cut + 1, temperature=0.0)
    a = run_alone(engine, Request(prompt=prompt, params=p, num_draft_tokens=3))
    b = run_alone(engine, Request(prompt=prompt, params=p, num_draft_tokens=0))
    assert a[0] == b[0] == plain[: cut + 1] and a[2].finish_reason == "length"
    # end_id inside the run (a token first seen there)
    tok = next((t for i, t in enumerate(plain) if i >= cut and t not in plain[:i]), None)
    if tok is not None:
        idx = plain.index(tok)
        p = SamplingParams(max_tokens=64, temperature=0.0, end_id=tok)
        a = run_alone(engine, Request(prompt=prompt, params=p, num_draft_tokens=3))
        assert a[0] == plain[: idx + 1] and a[2].finish_reason == "stop"
    # a stop string inside the run
    text = engine.tokenizer.decode(plain)
    word = engine.tokenizer.decode(plain[cut: cut + 1]).strip()
    if word and text.find(word) > 0:
        p = SamplingParams(max_tokens=64, temperature=0.0, stop=[word])
        a = run_alone(engine, Request(prompt=prompt, params=p, num_draft_tokens=3))
        b = run_alone(engine, Request(prompt=prompt, params=p, num_draft_tokens=0))
        assert a[1] == b[1] == text[: text.find(word)] and a[2].finish_reason == "stop"


def test_grammar_dead_end_in_drafts_is_not_an_error(ngram_engine):
    """n-gram drafts copied from the prompt's schema text are not valid object members: drafting
    stops at the first token the grammar rejects, and the output equals plain decoding."""
    engine = ngram_engine
    fed_log = []
    original = engine.core.guided.inner.fill_verify_rows

    def fill_verify_rows(drafts):
        fed = original(drafts)
        fed_log.extend((len(drafts[s]), n) for s, n in fed.items())
        return fed
    engine.core.guided.inner.fill_verify_rows = fill_verify_rows
    try:
        reqs = requests(engine, k_of=lambda i: 3)[0::2]
        spec = run_many(engine, reqs)
        plain = run_many(engine, [Request(prompt=r.prompt, params=r.params, guided=r.guided, num_draft_tokens=0)
                                  for r in reqs])
    finally:
        del engine.core.guided.inner.fill_verify_rows
    assert [s[0] for s in spec] == [p[0] for p in plain]
    assert all(f.finish_reason in ("stop", "length") for _, _, f in spec)
    assert any(n < k for k, n in fed_log), "no draft was cut by the grammar"


def test_sampled_speculation_is_reproducible_and_batch_independent(engine, monkeypatch):
    monkeypatch.setattr(engine.core.proposer, "step_costs", None)  # every K > 0 step drafts (see above)
    prompt = prompts(engine)[1][0]
    p = SamplingParams(max_tokens=40, temperature=0.8, seed=11, ignore_eos=True)
    a = run_alone(engine, Request(prompt=prompt, params=p))
    b = run_alone(engine, Request(prompt=prompt, params=p))
    assert a[0] == b[0] and a[2].total_draft_tokens > 0
    together = run_many(engine, [Request(prompt=prompt, params=p)] + requests(engine, k_of=lambda i: 3)[:4])
    assert together[0][0] == a[0]


def test_a_seeded_sampled_request_gives_the_same_tokens_with_any_drafts(ngram_engine):
    """Verification emits the target's own seeded sample at each position, so drafts change how
    many tokens a step emits, never which: K=0, K=1 and K=3 give the same tokens for the same seed
    (under rejection sampling an accepted draft replaced the seed's own sample: these runs differed,
    and cost_aware_k, which picks K from wall time, made a seeded request differ run to run; that case:
    test_drafters.py's cost-aware test). N-gram drafts in every step, so that K 1 and 3 really verify
    drafts (the served engine's cost-aware budget may decode a hot sample plainly throughout)."""
    engine = ngram_engine
    prompt = prompts(engine)[1][0]
    accepted, plain = 0, {}
    for seed, min_p in ((11, 0.0), (12, 0.0), (13, 0.0), (13, 0.05)):
        p = SamplingParams(max_tokens=64, temperature=1.3, min_p=min_p, seed=seed, ignore_eos=True)
        runs = {k: run_alone(engine, Request(prompt=prompt, params=p, num_draft_tokens=k)) for k in (0, 1, 3)}
        accepted += runs[1][2].total_accepted_draft_tokens + runs[3][2].total_accepted_draft_tokens
        assert runs[0][0] == runs[1][0] == runs[3][0], (seed, min_p)
        plain.setdefault(seed, runs[0][0])
    assert accepted > 0
    assert runs[0][0] != plain[13]  # min_p changed what seed 13 samples

@pytest.mark.parametrize("which", ["engine", "ngram_engine"])
def test_a_step_takes_back_only_the_drafts_verification_rejects(request, monkeypatch, which):
    """The drafts a guided row's matcher took while its masks were filled stay fed through the step;
    the commit takes back only those verification rejected (a matcher takes each accepted draft once,
    not again at the commit): over a run the tokens rolled back are the drafts verified less those
    accepted, in-step drafts (the served hybrid) and host-known ones (n-gram) alike."""
    from specguide.guided.decoder import GuidedDecoder

    engine = request.getfixturevalue(which)
    monkeypatch.setattr(engine.core.proposer, "step_costs", None)  # every K > 0 step drafts (see above)
    rolled = []
    original = GuidedDecoder.rollback
    monkeypatch.setattr(GuidedDecoder, "rollback", lambda self, slot, n: rolled.append(n) or original(self, slot, n))
    reqs = [r for r in requests(engine, lambda i: 3) if r.guided is not None]
    finals = [f for _, _, f in run_many(engine, reqs)]
    assert all(f.finish_reason in ("stop", "length") for f in finals)
    drafted = sum(f.total_draft_tokens for f in finals)
    accepted = sum(f.total_accepted_draft_tokens for f in finals)
    assert accepted > 0 and drafted > accepted  # both kinds of draft happened
    assert sum(rolled) == drafted - accepted
