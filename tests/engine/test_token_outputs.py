"""Per-token outputs on the real SmolLM2 (issue 21): log probabilities and top log probabilities
(equal with speculation off and on), generation and context logits, TensorRT-LLM stop token
sequences (kept in the output), perf-metric timestamps and KV cache figures."""
from __future__ import annotations

import json
import math
import threading

import pytest
import torch

from specguide.config import EngineConfig
from specguide.engine.loop import Engine
from specguide.request import InvalidRequestError, Request, SamplingParams

from .conftest import PROMPTS
from .test_speculative import prompts as spec_prompts, SCHEMA

K = 4
TOL = 1e-4


@pytest.fixture(scope="module")
def eng():
    # fixed K (no adaptive / cost-aware budget) so that speculation really runs at K=4; n-gram drafts
    # (long accepted runs on the "repeat" prompts); the float32 model, whose log probs and logits are
    # compared with transformers' float32 ones
    e = Engine(EngineConfig(max_slots=8, max_seq_len=512, prefill_chunk=64, num_draft_tokens=K,
                            adaptive_k=False, cost_aware_k=False, drafter="ngram",
                            weight_dtype="float32", activation_dtype="float32"))
    yield e
    e.shutdown()


def collect(engine, requests, timeout=600):
    """Submit all at once; every request's list of events."""
    events = [[] for _ in requests]
    done = threading.Semaphore(0)

    def cb_for(i):
        def cb(out):
            events[i].append(out)
            if out.finished:
                done.release()
        return cb
    for i, r in enumerate(requests):
        engine.submit(r, cb_for(i))
    for _ in requests:
        assert done.acquire(timeout=timeout)
    return events


def joined(events):
    """(token ids, logprobs, top logprobs, text, final event) over one request's events."""
    toks = [t for o in events for t in o.token_ids]
    lps = [x for o in events if o.logprobs is not None for x in o.logprobs]
    tops = [x for o in events if o.top_logprobs is not None for x in o.top_logprobs]
    return toks, lps, tops, "".join(o.text for o in events), events[-1]


def with_k(r: Request, k: int) -> Request:
    return Request(prompt=r.prompt, prompt_ids=r.prompt_ids, params=r.params, guided=r.guided, num_draft_tokens=k)


def spec_requests(engine, n=4, **kw):
    from specguide.request import GuidedDecodingParams
    out = []
    for prompt, guided in spec_prompts(engine)[:n]:
        out.append(Request(prompt=prompt, params=SamplingParams(max_tokens=40, temperature=0.0, **kw),
                           guided=GuidedDecodingParams("json_schema", json.dumps(SCHEMA)) if guided else None))
    return out


@torch.inference_mode()
def reference_logits(hf_model, prompt_ids, output_ids):
    """Teacher-forced logits [len(output), V] of the positions that produced output_ids."""
    ids = torch.tensor([prompt_ids + output_ids])
    return hf_model(ids).logits[0, len(prompt_ids) - 1: -1].float()


# ---- log probabilities ------------------------------------------------------------------------
def test_greedy_logprobs_equal_with_and_without_speculation(eng):
    """Guided (json_schema) and unguided, alone and in a mixed batch of 4: same tokens, same log
    probs and top log probs (1e-4) at K=0 and K=4, so the verification's per-position logits
    (accepted drafts and the bonus token) produce them."""
    reqs = spec_requests(eng, return_log_probs=True, top_logprobs=5)
    plain = [joined(collect(eng, [with_k(r, 0)])[0]) for r in reqs]
    alone = [joined(collect(eng, [with_k(r, K)])[0]) for r in reqs]
    batch = [joined(ev) for ev in collect(eng, [with_k(r, K) for r in reqs])]
    accepted = 0
    for i, ref in enumerate(plain):
        assert len(ref[1]) == len(ref[0]) == len(ref[2]) > 0
        for got in (alone[i], batch[i]):
            assert got[0] == ref[0]
            assert len(got[1]) == len(got[0]) == len(got[2])
            assert max(abs(a - b) for a, b in zip(got[1], ref[1])) < TOL
            for ta, tb in zip(got[2], ref[2]):
                assert len(ta) == len(tb) == 5
                assert max(abs(a[1] - b[1]) for a, b in zip(ta, tb)) < TOL
            accepted += got[4].total_accepted_draft_tokens
        assert ref[4].total_draft_tokens == 0
    assert accepted > 0, "no draft was accepted: the verification path was not exercised"


def test_logprobs_with_the_capturable_guided_decoder(eng):
    """Grammar callbacks on a worker thread give the same log probs."""
    worker = Engine(EngineConfig(max_slots=4, max_seq_len=512, prefill_chunk=64, num_draft_tokens=K,
                                 adaptive_k=False, cost_aware_k=False, drafter="ngram", guided_executor="worker",
                                 weight_dtype="float32", activation_dtype="float32"))  # as `eng`
    try:
        reqs = spec_requests(eng, n=2, return_log_probs=True)
        ref = [joined(collect(eng, [with_k(r, 0)])[0]) for r in reqs]
        got = [joined(ev) for ev in collect(worker, [with_k(r, K) for r in reqs])]
    finally:
        worker.shutdown()
    for a, b in zip(got, ref):
        assert a[0] == b[0] and max(abs(x - y) for x, y in zip(a[1], b[1])) < TOL
    assert sum(a[4].total_accepted_draft_tokens for a in got) > 0


def test_greedy_logprobs_equal_log_softmax_of_reference(eng, hf_model):
    engine = eng  # the float32 model
    for prompt in PROMPTS[:3]:
        ids = engine.tokenizer.encode(prompt)
        toks, lps, _, _, final = joined(collect(engine, [Request(
            prompt_ids=ids, num_draft_tokens=0,
            params=SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, return_log_probs=True))])[0])
        ref = reference_logits(hf_model, ids, toks).log_softmax(-1)
        want = ref[torch.arange(len(toks)), torch.tensor(toks)]
        assert torch.allclose(torch.tensor(lps), want, atol=2e-3), (lps, want.tolist())
        assert all(x <= 0 for x in lps) and final.top_logprobs is None
        assert abs(final.cum_logprob - sum(lps)) < 1e-6


def test_logprobs_follow_penalties_and_min_tokens(eng, hf_model):
    """Log probs are of the processed logits: repetition / presence / frequency penalties and the
    min_tokens EOS ban applied; alone (plain decode) and beside a speculating request (the
    verification's position 0)."""
    ids = eng.tokenizer.encode(PROMPTS[4])
    params = SamplingParams(max_tokens=20, temperature=0.0, min_tokens=12, repetition_penalty=1.3,
                            presence_penalty=0.5, frequency_penalty=0.4, return_log_probs=True)
    req = Request(prompt_ids=ids, params=params, num_draft_tokens=K)
    partner = with_k(spec_requests(eng, n=2)[1], K)  # "repeat three times": drafts in every step
    alone = joined(collect(eng, [req])[0])
    beside, other = collect(eng, [req, partner])
    beside = joined(beside)
    assert joined(other)[4].total_draft_tokens > 0
    toks = alone[0]
    assert beside[0] == toks and len(toks) >= 12
    logits = reference_logits(hf_model, ids, toks)
    want = []
    for j, t in enumerate(toks):
        row = logits[j].clone()
        counts = torch.bincount(torch.tensor(toks[:j], dtype=torch.long), minlength=row.shape[0]).float()
        seen = torch.zeros_like(row, dtype=torch.bool)
        seen[torch.tensor(ids + toks[:j])] = True
        row = torch.where(seen, torch.where(row > 0, row / 1.3, row * 1.3), row)
        row = row - 0.4 * counts - 0.5 * (counts > 0).float()
        if j < 12:
            row[torch.tensor(sorted(eng.core.eos_token_ids))] = float("-inf")
        want.append(row.log_softmax(-1)[t].item())
    for got in (alone, beside):
        assert max(abs(a - b) for a, b in zip(got[1], want)) < 2e-3, (got[1], want)


@pytest.mark.parametrize("k", [0, K])
@pytest.mark.parametrize("top_k, min_p", [(0, 0.0), (20, 0.0), (0, 0.05)])
def test_sampled_logprobs_follow_the_sampling_distribution(eng, hf_model, k, top_k, min_p):
    """temperature 0.7 (and top_k 20, or min_p 0.05): the emitted token's log prob under
    softmax(logits / 0.7), renormalized over the kept set; with drafts (K=4) the same (verification
    emits the target's own tokens)."""
    ids = eng.tokenizer.encode(PROMPTS[3])
    params = SamplingParams(max_tokens=24, temperature=0.7, top_k=top_k, min_p=min_p, seed=7, ignore_eos=True,
                            return_log_probs=True)
    toks, lps, _, _, final = joined(collect(eng, [Request(prompt_ids=ids, params=params, num_draft_tokens=k)])[0])
    logits = reference_logits(hf_model, ids, toks) / 0.7
    if top_k:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if min_p:
        p = logits.softmax(-1)
        logits = logits.masked_fill(p < min_p * p.max(dim=-1, keepdim=True).values, float("-inf"))
    want = logits.log_softmax(-1)[torch.arange(len(toks)), torch.tensor(toks)]
    assert torch.isfinite(want).all()
    assert torch.allclose(torch.tensor(lps), want, atol=2e-3), (lps, want.tolist())
    greedy_lp = reference_logits(hf_model, ids, toks).log_softmax(-1)[torch.arange(len(toks)), torch.tensor(toks)]
    assert not torch.allclose(torch.tensor(lps), greedy_lp, atol=1e-2)  # really temperature-scaled


def test_top_logprobs_are_ordered_and_hold_the_greedy_token(eng):
    reqs = spec_requests(eng, n=2, top_logprobs=4)  # top_logprobs alone implies the token's log prob
    for r in reqs:
        for k in (0, K):
            toks, lps, tops, _, _ = joined(collect(eng, [with_k(r, k)])[0])
            assert len(tops) == len(lps) == len(toks)
            for t, lp, top in zip(toks, lps, tops):
                assert len(top) == 4
                vals = [v for _, v in top]
                assert vals == sorted(vals, reverse=True)
                assert top[0][0] == t and abs(top[0][1] - lp) < 1e-6  # greedy: the token is the argmax


def test_only_requests_that_ask_get_per_token_outputs(eng):
    reqs = spec_requests(eng, n=2, return_log_probs=True, return_generation_logits=True)
    reqs += spec_requests(eng, n=2)
    for events in collect(eng, reqs)[2:]:
        assert all(o.logprobs is None and o.top_logprobs is None and o.generation_logits is None
                   and o.context_logits is None for o in events)


# ---- generation and context logits --------------------------------------------------------------
@pytest.mark.parametrize("k", [0, K])
def test_generation_and_context_logits(eng, hf_model, k):
    ids = eng.tokenizer.encode(spec_prompts(eng)[0][0])  # long enough for two prefill chunks
    assert len(ids) > 64
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, return_generation_logits=True,
                            return_context_logits=True)
    events = collect(eng, [Request(prompt_ids=ids, params=params, num_draft_tokens=k)])[0]
    toks = [t for o in events for t in o.token_ids]
    assert events[0].context_logits is not None and all(o.context_logits is None for o in events[1:])
    ctx = torch.from_numpy(events[0].context_logits)
    assert ctx.shape == (len(ids), eng.core.runner.vocab_size) and ctx.dtype == torch.float32
    gen = [o.generation_logits for o in events]
    assert all(g.shape == (len(o.token_ids), eng.core.runner.vocab_size) for g, o in zip(gen, events))
    gen = torch.cat([torch.from_numpy(g) for g in gen])
    assert gen.argmax(-1).tolist() == toks
    assert torch.equal(ctx[-1], gen[0])  # the last prompt position produced the first token
    with torch.inference_mode():
        ref = hf_model(torch.tensor([ids + toks])).logits[0].float()
    assert torch.allclose(ctx, ref[: len(ids)], atol=2e-2)
    assert torch.allclose(gen, ref[len(ids) - 1: -1], atol=2e-2)
    if k:
        assert events[-1].total_accepted_draft_tokens > 0


def test_prompt_logprobs_are_the_models_over_every_chunk(eng, hf_model):
    """vLLM's prompt_logprobs: once, on the first event: no log p for the first prompt token, then each
    token's log p under transformers' log_softmax and the top 3, across two prefill chunks; a prompt
    that a slot holds is prefilled again (prefix reuse would skip the positions)."""
    ids = eng.tokenizer.encode(spec_prompts(eng)[0][0])
    assert len(ids) > 64
    with torch.inference_mode():
        ref = hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    run_alone_ids = Request(prompt_ids=ids, params=SamplingParams(max_tokens=2, temperature=0.0))
    collect(eng, [run_alone_ids])  # a slot now holds this prompt
    for n in (0, 3):
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=n)
        events = collect(eng, [Request(prompt_ids=ids, params=params)])[0]
        plp = events[0].prompt_logprobs
        assert plp is not None and all(o.prompt_logprobs is None for o in events[1:])
        assert events[-1].num_cached_tokens == 0 and len(plp) == len(ids) and plp[0] == (ids[0], None, [])
        for j, (tid, lp, top) in enumerate(plp[1:], start=1):
            assert tid == ids[j] and abs(lp - ref[j - 1, tid].item()) < 2e-3
            assert len(top) == n
            if n:
                want = ref[j - 1].topk(n)
                assert [t for t, _ in top] == want.indices.tolist() or \
                    max(abs(v - w) for (_, v), w in zip(top, want.values.tolist())) < 2e-3  # near-ties
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        eng.submit(Request(prompt_ids=ids, params=SamplingParams(prompt_logprobs=21)))


# ---- stop token sequences -----------------------------------------------------------------------
def test_stop_token_seqs_are_kept_and_end_inside_an_accepted_run(eng):
    prompt = spec_prompts(eng)[1][0]  # "repeat three times": long accepted runs
    runs = []  # tokens of each decode step, in order
    step = eng.core.runner.step
    eng.core.runner.step = lambda *a, **kw: (lambda out: (runs.extend(t for t, _, _ in out), out)[1])(step(*a, **kw))
    try:
        full = joined(collect(eng, [Request(prompt=prompt, num_draft_tokens=K,
                                            params=SamplingParams(max_tokens=64, temperature=0.0))])[0])[0]
    finally:
        del eng.core.runner.step
    assert sum(len(t) for t in runs) >= len(full) - 1
    # candidate ends: inside a multi-token run, where a 2-token stop sequence first occurs
    pos, ends = 1, []  # the first token comes from the prefill
    for toks in runs:
        ends += [pos + j for j in range(1, len(toks) - 1)]  # not the run's last token
        pos += len(toks)
    end = next(e for e in ends if e >= 2 and not any(full[i - 2: i] == full[e - 2: e] for i in range(2, e)))
    word = full[end - 2: end]
    outs = []
    for k in (0, K):
        params = SamplingParams(max_tokens=64, temperature=0.0, stop_token_seqs=[[49151, 49150, 3], word])
        toks, _, _, text, final = joined(collect(eng, [Request(prompt=prompt, params=params, num_draft_tokens=k)])[0])
        assert toks == full[:end] and toks[-2:] == word and final.finish_reason == "stop"
        assert text == eng.tokenizer.decode(toks)
        outs.append(toks)
    assert outs[0] == outs[1]
    # not before min_tokens: the sequence goes on past `end`
    params = SamplingParams(max_tokens=end + 4, min_tokens=end + 1, temperature=0.0, stop_token_seqs=[word])
    toks = joined(collect(eng, [Request(prompt=prompt, params=params, num_draft_tokens=K)])[0])[0]
    assert toks[:end] == full[:end] and len(toks) > end


def test_stop_token_seqs_validation(eng):
    for bad in ([[]], [[eng.core.runner.vocab_size]]):
        with pytest.raises(InvalidRequestError):
            eng.submit(Request(prompt="hi", params=SamplingParams(stop_token_seqs=bad)))
    with pytest.raises(InvalidRequestError):
        eng.submit(Request(prompt="hi", params=SamplingParams(top_logprobs=21)))


# ---- timestamps, KV figures, several sequences per request id -------------------------------------
def test_timestamps_are_monotone_and_kv_blocks_follow_the_length(eng):
    ids = eng.tokenizer.encode(spec_prompts(eng)[0][0])
    reqs = [Request(prompt_ids=ids, request_id="same", num_draft_tokens=k,
                    params=SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)) for k in (0, K)]
    per_block = eng.core.runner.kv.tokens_per_block
    for events in collect(eng, reqs):  # two sequences with one request id: both complete
        assert events[-1].finished and events[-1].finish_reason == "length"
        n, last = 0, 0
        for o in events:
            n += len(o.token_ids)
            assert 0 < o.arrival_time_ns <= o.first_scheduled_time_ns <= o.first_token_time_ns <= o.last_token_time_ns
            assert o.last_token_time_ns >= last
            last = o.last_token_time_ns
            # prefix caching: the prompt's reused whole blocks count as reused, the rest as new
            assert o.kv_cache_alloc_total_blocks == math.ceil((len(ids) + n) / per_block)
            assert o.kv_cache_alloc_new_blocks + o.kv_cache_reused_blocks == o.kv_cache_alloc_total_blocks
            assert o.kv_cache_reused_blocks * per_block < len(ids)
            assert o.kv_cache_hit_rate == o.kv_cache_reused_blocks / o.kv_cache_alloc_total_blocks
        assert n == 30 and events[-1].kv_cache_alloc_total_blocks > 1
