"""Prefix sharing by block (issue 77): every full KV block a sequence computed is keyed by its
tokens (and the one after it) and shared by any later sequence that starts with them, while its
owner runs or after it ended; that sequence prefills only the rest (the CPU forward is
chunk-invariant: a prompt prefilled in any chunk split gives the same K/V and logits, bit for bit).
Outputs equal those of the engine without sharing, token for token: greedy and seeded sampled,
guided and unguided, speculative with the hybrid drafter (whose head reads the shared positions'
features and computes its own rows again) or a draft model, alone and in a batch; shared prefixes
end inside prefill chunks, and a chat's next turn shares the answer that decode steps computed."""
from __future__ import annotations

import dataclasses
import json
import threading

import pytest
import torch

from specguide.config import EngineConfig
from specguide.engine.loop import Engine
from specguide.engine.block_pool import BLOCK
from specguide.engine.kv_cache import KVCache
from specguide.request import GuidedDecodingParams, Request, SamplingParams

from .conftest import placed_in, stale_blocks
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
    # cost_aware_k off: whether a step drafts follows no clock, so the draft counters compare across runs;
    # chunks of 40 tokens: a prefix of whole 16-token blocks mostly ends inside one
    return Engine(EngineConfig(max_slots=3, max_seq_len=512, prefill_chunk=40, num_draft_tokens=3, drafter="hybrid",
                               draft_head_path=head, spec_max_rows=0, prefix_caching=caching, cost_aware_k=False))


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
                 final.kv_cache_reused_blocks, final.num_cached_tokens) for toks, _, final in run_many(engine, batch)]
    return out


@torch.inference_mode()
def test_a_prompt_prefilled_in_any_chunk_split_gives_the_same_kv_and_logits(engine):
    """The forward of a 150-token prompt in one chunk, in the engine's chunks, in uneven chunks and
    one token at a time (decode steps): bit-identical K/V in every layer and logits at every position."""
    m = engine.core.model
    assert m.chunk_invariant and engine.core.scheduler.any_prefix
    ids = engine.tokenizer.encode(_requests(engine, SYSTEM + " " + SYSTEM)[0].prompt)[:150]
    N = len(ids)
    assert N == 150

    def run(bounds):
        kv = KVCache(m.cfg.num_layers, 2, m.cfg.num_kv_heads, 256, m.cfg.head_dim, torch.float32)
        logits = []
        for a, b in zip(bounds, bounds[1:]):
            ctx = m.make_context(torch.tensor([1]), torch.arange(a, b)[None], [1], b)
            logits.append(m.logits(m(torch.tensor([ids[a:b]]), ctx, kv))[0])
        return *kv.rows(1, 0, N), torch.cat(logits)

    want = run([0, N])
    for bounds in ([0, 64, 128, N], [0, 1, 17, 18, 100, N], list(range(N + 1))):
        got = run(bounds)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), bounds[:4]


@pytest.mark.parametrize("alone", [True, False], ids=["batch1", "batch3"])
def test_outputs_with_reuse_equal_outputs_without(engines, alone):
    on, off = engines
    want = _run(off, _requests(off), alone)
    got = _run(on, _requests(on), alone)
    assert [g[:4] for g in got] == [w[:4] for w in want]  # tokens, and the drafts
    assert all(w[4] == 0 for w in want)
    # the first computes the system prompt (as do those admitted in the same step), the others share it
    assert sum(1 for g in got if g[4] > 0) >= len(got) - (1 if alone else on.config.max_slots)
    assert all(g[5] == g[4] * BLOCK for g in got)  # whole blocks
    assert max(g[5] for g in got) >= 2 * on.config.prefill_chunk  # the system prompt
    assert all(g[1] in ("stop", "length") for g in got)
    on.core.scheduler.check_integrity()


def _own_rows(engine, drafter) -> list[tuple[torch.Tensor, ...]]:
    """Run each request alone; as it ends (before its slot gives its blocks back), the drafter's rows
    of its slot (the draft head: its K/V rows and the target features it read; a draft model: its
    K/V in every layer)."""
    rows = []
    proposer = engine.core.proposer

    def free(slot):
        if hasattr(drafter, "feats"):
            n = drafter.valid[slot]
            rows.append((*drafter.kv.rows(slot, 0, n), drafter.features(slot, 0, n + 1)))
        else:
            n = drafter.cached[slot]
            rows.append(drafter.kv.rows(slot, 0, n))

    proposer.free = free
    try:
        for r in _requests(engine):
            run_many(engine, [r])
    finally:
        del proposer.free
    return rows


def test_the_draft_heads_rows_over_a_shared_prefix_are_those_it_computes_from_scratch(engines):
    """The head's own K/V rows and the features it reads, after each request (which shared its
    prefix's blocks, where it wrote its head rows again): bit for bit those of the engine without
    prefix sharing."""
    on, off = engines
    _same_rows(_own_rows(on, on.core.proposer.head), _own_rows(off, off.core.proposer.head), on)


def _same_rows(got, want, engine) -> None:
    """The rows both hold are equal; after a speculative request both hold all but the last tokens'."""
    for g, w, r in zip(got, want, _requests(engine)):
        n = min(g[0].shape[-2], w[0].shape[-2])
        if r.num_draft_tokens:
            assert n > 100 and g[0].shape == w[0].shape
        assert all(torch.equal(a[..., :n, :], b[..., :n, :]) for a, b in zip(g, w))


def _shared(tokens: list[int], earlier: list[list[int]]) -> int:
    """Tokens of `tokens` in whole blocks keyed by an earlier token list: blocks b whose positions and
    the one after, [0, 16b + 17), it shares with that list."""
    best = 0
    for e in earlier:
        common = next((j for j, (x, y) in enumerate(zip(e, tokens)) if x != y), min(len(e), len(tokens)))
        best = max(best, (common - 1) // BLOCK * BLOCK)
    return best


def test_a_prompt_diverging_inside_a_chunk_shares_the_blocks_before_the_first_differing_token(engines):
    """Each request kind (greedy guided, seeded sampled + speculative, guided sampled + speculative,
    greedy, ...) after a base prompt that it shares up to a token inside a chunk: it shares exactly
    the whole blocks before that token (of the base, or of an earlier variant), and its outputs and
    drafts are those without sharing."""
    on, off = engines
    base = _requests(on)[:1]
    early = SYSTEM.replace("short texts", "brief notes")  # diverges in the first chunk
    late = SYSTEM.replace('"tags"', '"labels"')  # diverges inside a later chunk
    chunk = on.config.prefill_chunk
    reused, earlier = [], [on.tokenizer.encode(base[0].prompt)]
    for system, i in [(early, 0)] + [(late, i) for i in range(len(TEXTS))]:
        _run(on, base, alone=True)  # the base prompt again: its blocks are cached
        req = _requests(on, system)[i:i + 1]
        a, b = earlier[0], on.tokenizer.encode(req[0].prompt)
        common = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
        got = _run(on, req, alone=True)
        assert [g[:4] for g in got] == [w[:4] for w in _run(off, _requests(off, system)[i:i + 1], alone=True)]
        assert got[0][5] == _shared(b, earlier) >= (common - 1) // BLOCK * BLOCK, (system == late, i)
        earlier.append(b)
        reused.append((common, got[0][5]))
    assert reused[0][1] < chunk < reused[1][0]  # the early variant in the first chunk, the late ones later
    assert all(n % chunk for _, n in reused[1:])  # the late ones share prefixes ending inside a chunk
    assert stale_blocks(on, earlier) == []


def _detailed(engine: Engine, reqs: list[Request], first: Request, after: int = 1) -> list[tuple]:
    """Run `first`; once it has `after` tokens (its prompt is prefilled, and decode steps ran), the
    others, all at once. Per request (`first` last): tokens, log probs, finish reason, drafts
    proposed / accepted, cached tokens."""
    results: list[list] = [[[], [], None] for _ in range(len(reqs) + 1)]
    started, done = threading.Event(), threading.Semaphore(0)

    def collect(i):
        def cb(out):
            results[i][0].extend(out.token_ids)
            results[i][1].extend(out.logprobs or [])
            if len(results[i][0]) >= after:
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


def test_a_prefix_a_running_sequence_computed_is_shared_exactly(engines):
    """Requests that arrive while the donor (their system prompt, then its own text) decodes share its
    blocks up to the last whole one before their first differing token; the same tokens, exact log
    probs and the same drafts as without sharing, and the shared blocks hold what a prefill computes."""
    on, off = engines
    system = "Share test. " + SYSTEM  # not cached yet: any sharing is of the donor's blocks
    got, want = [], []
    for engine, out in ((on, got), (off, want)):
        reqs = _requests(engine, system)
        donor = dataclasses.replace(reqs[0], guided=None, num_draft_tokens=3,  # decodes 40 tokens, then stops
                                    params=SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0))
        others = []
        for r in reqs[1:4]:  # sampled + speculative, guided sampled + speculative, greedy
            r.params.return_log_probs = True
            others.append(r)
        out += _detailed(engine, others, donor, after=5)
    prompts = [on.tokenizer.encode(r.prompt) for r in _requests(on, system)[:4]]
    chunk = on.config.prefill_chunk
    common = [next(i for i, (x, y) in enumerate(zip(prompts[0], p)) if x != y) for p in prompts[1:]]
    assert min(common) >= 2 * chunk
    assert [g[5] for g in got[:3]] == [(c - 1) // BLOCK * BLOCK for c in common]
    assert any(g[5] % chunk for g in got[:3])
    assert [w[5] for w in want] == [0] * 4
    # tokens, exact log probs (a stale or shifted row would move them), the drafts (the head's features)
    assert [g[:5] for g in got] == [w[:5] for w in want]
    assert stale_blocks(on, prompts) == []
    on.core.scheduler.check_integrity()


@pytest.mark.parametrize("k", [0, 3])
def test_a_next_turn_reuses_the_answer_and_stays_exact(engines, k):
    """A chat's next turn holds the last answer: the positions decode steps (or verification steps,
    K = 3) computed are what a prefill computes, so reuse goes through the answer (exact log probs)."""
    on, off = engines
    first = on.tokenizer.apply_chat_template([{"role": "system", "content": "Turns. " + SYSTEM},
                                              {"role": "user", "content": TEXTS[4]}])
    ids = on.tokenizer.encode(first)
    got, want = [], []
    for engine, out in ((on, got), (off, want)):
        params = SamplingParams(max_tokens=40, min_tokens=40, temperature=0.0, return_log_probs=True)
        answer, _, _ = run_many(engine, [Request(prompt_ids=ids, params=params, num_draft_tokens=k)])[0]
        turn = ids + answer + engine.tokenizer.encode("<|im_end|>\n<|im_start|>user\nAnd Frank?<|im_end|>\n")
        events = list(engine.generate(Request(prompt_ids=turn, params=params, num_draft_tokens=3)))
        out.append(([t for e in events for t in e.token_ids], [lp for e in events for lp in e.logprobs],
                    events[-1].num_cached_tokens, answer))
    assert got[0][:2] == want[0][:2] and got[0][3] == want[0][3]
    # the blocks of all but the answer's last token (which has no K/V)
    assert got[0][2] == (len(ids) + len(got[0][3]) - 1) // BLOCK * BLOCK > len(ids) and want[0][2] == 0
    assert stale_blocks(on, [ids + got[0][3]]) == []


@pytest.fixture(scope="module")
def draft_model_engines():
    cfg = dict(max_slots=3, max_seq_len=512, prefill_chunk=32, num_draft_tokens=3, drafter="draft_model",
               spec_max_rows=0, cost_aware_k=False)
    on, off = Engine(EngineConfig(**cfg, prefix_caching=True)), Engine(EngineConfig(**cfg, prefix_caching=False))
    yield on, off
    on.shutdown()
    off.shutdown()


def test_the_draft_model_over_a_shared_prefix_drafts_as_without(draft_model_engines):
    """The draft model (here the target itself: every right draft is accepted) computes its rows of
    a shared prefix again, in the shared blocks (its forwards are chunk-invariant: the bits already
    there): the same tokens and the same accepted drafts as without sharing, alone, in a batch, and
    beside a running donor; its rows after each request are those it computes without sharing."""
    on, off = draft_model_engines
    want = _run(off, _requests(off), alone=False) + _run(off, _requests(off), alone=True)
    got = _run(on, _requests(on), alone=False) + _run(on, _requests(on), alone=True)
    assert [g[:4] for g in got] == [w[:4] for w in want]
    assert sum(1 for g in got if g[4] > 0) >= len(got) - on.config.max_slots
    got, want = [], []
    for engine, out in ((on, got), (off, want)):
        reqs = _requests(engine, "Draft share test. " + SYSTEM)
        donor = dataclasses.replace(reqs[0], guided=None, num_draft_tokens=3,
                                    params=SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0))
        out += _detailed(engine, reqs[1:3], donor, after=5)
    assert [g[:5] for g in got] == [w[:5] for w in want] and all(g[5] > 2 * on.config.prefill_chunk for g in got[:2])
    _same_rows(_own_rows(on, on.core.proposer.draft_model), _own_rows(off, off.core.proposer.draft_model), on)


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


def test_a_greedy_output_is_the_same_whichever_free_slot_it_gets(engines, inject_faults):
    """After traffic that dirties every slot, the same greedy requests (sharing cached blocks, or
    none) placed in each free slot in turn: the same tokens, log probs and drafts as without prefix
    sharing; the cached blocks are what a prefill computes."""
    on, off = engines
    inject_faults(on, off)

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
    probes = [on.tokenizer.encode(r.prompt) for r in _requests(on) + _requests(on, "Fresh. " + SYSTEM)]
    assert stale_blocks(on, probes) == []
    for slot in range(on.config.max_slots):
        with placed_in(on, slot):
            got = run(on)
        assert [g[:5] for g in got] == [w[:5] for w in want], slot
        assert got[0][5] > 0 and got[1][5] > 0  # the first two share the cached system prompt
        assert stale_blocks(on, probes) == []
    assert sum(w[3] for w in want) > 0  # drafts were proposed (their counts compare the head's state)
    on.core.scheduler.check_integrity()
