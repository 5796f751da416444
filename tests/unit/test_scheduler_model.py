"""The scheduler and its KV blocks driven as the engine drives them, by random traffic (hypothesis):
arrivals at random steps, prompts that share prefixes, speculative steps that accept any number of
drafts, cancels, requests that arrive during a step's prefills, prefix sharing turned off midway,
and pools from tight (preemption every few steps) to ample. A shadow of every
block's contents (what each position's K/V was computed from) checks, at every step, that each
running sequence's cached positions hold its own tokens' K/V, shared or not; that every chunk is
the next span of its sequence's tokens; that a decoding sequence holds the blocks its step writes;
and that every request ends once arrivals stop (none waits forever)."""
from __future__ import annotations

import random

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specguide.engine.block_pool import BLOCK, BlockPool
from specguide.engine.scheduler import Scheduler, Sequence, Status
from specguide.request import SamplingParams


class Shadow:
    """What each (block, offset) holds: the tokens its K/V was computed from (a position's K/V is a
    function of the tokens up to it); block 0 takes the dead writes past a slot's blocks."""

    def __init__(self, s: Scheduler) -> None:
        self.s = s
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}

    def where(self, seq: Sequence, p: int) -> tuple[int, int]:
        return int(self.s.pool.table[seq.slot, p // BLOCK]), p % BLOCK

    def write(self, seq: Sequence, p: int, tokens: list[int]) -> None:
        held = int(self.s.pool.held[seq.slot])
        if p >= held * BLOCK:  # only past max_seq_len: a draft position with no block
            assert p >= self.s.max_seq_len, (seq.seq_id, p, held)
            return
        self.kv[self.where(seq, p)] = tuple(tokens[: p + 1])

    def check(self, seq: Sequence) -> None:
        tokens = seq.prompt_ids + seq.output_ids
        for p in range(seq.num_cached):
            assert self.kv.get(self.where(seq, p)) == tuple(tokens[: p + 1]), (seq.seq_id, p, seq.num_reused)


def _prefill(shadow: Shadow, chunk, rng: random.Random) -> None:
    """What Runner.prefill and EngineCore._prefill_chunk do with a chunk."""
    seq = chunk.seq
    tokens = seq.prompt_ids + seq.output_ids
    assert chunk.start == seq.num_cached < chunk.end <= seq.prefill_end, (seq.seq_id, chunk.start, chunk.end)
    shadow.check(seq)
    for p in range(chunk.start, chunk.end):
        shadow.write(seq, p, tokens)
    seq.num_cached = chunk.end
    if chunk.resumes:
        seq.status = Status.DECODE
    elif chunk.is_last:
        seq.status = Status.DECODE
        _append(shadow.s, seq, [rng.randint(1, 3)])


def _decode(shadow: Shadow, seq: Sequence, K: int, rng: random.Random) -> None:
    """One speculative step of a decoding row: its last token and K drafts written, `a` of the
    drafts accepted, then the token after them."""
    s = shadow.s
    assert seq.status is Status.DECODE and seq.num_cached == seq.num_tokens - 1
    assert s.pool.held[seq.slot] * BLOCK >= s.blocks.decode_need(seq)
    shadow.check(seq)
    drafts = [rng.randint(1, 3) for _ in range(K)]
    tokens = seq.prompt_ids + seq.output_ids + drafts
    for p in range(seq.num_tokens - 1, seq.num_tokens + K):
        shadow.write(seq, p, tokens)
    a = rng.randint(0, K)
    seq.num_cached = seq.num_tokens + a
    _append(s, seq, drafts[:a] + [rng.randint(1, 3)])


def _append(s: Scheduler, seq: Sequence, tokens: list[int]) -> None:
    for t in tokens:
        seq.output_ids.append(t)
        reason = s.check_stop_token(seq)
        if reason:
            s.finish(seq, reason)
            return


@st.composite
def traffic(draw):
    K = draw(st.sampled_from([0, 1, 3]))
    max_seq_len = draw(st.sampled_from([48, 80]))
    slots = draw(st.integers(1, 5))
    per_seq = BlockPool.blocks_for(max_seq_len + K + 1)
    # one sequence alone always fits; mostly a few blocks more (preemptions every few steps)
    blocks = draw(st.one_of(st.integers(per_seq, per_seq + 4), st.integers(per_seq, per_seq * slots)))
    config = dict(max_slots=slots, max_seq_len=max_seq_len, prefill_chunk=draw(st.sampled_from([16, 32, 64])),
                  prefix_caching=draw(st.booleans()), any_prefix=True, lookahead=K,
                  step_budget=draw(st.sampled_from([0, 24, 64])), key_cost=draw(st.sampled_from([0.0, 0.01])),
                  new_request_slots=draw(st.integers(0, max(0, slots - 1))),
                  pool=BlockPool(np.zeros((slots, per_seq), np.int32), 1 + blocks))
    prefixes = [[1, 2, 3] * 14, [2, 1] * 20]
    requests = []
    for i in range(draw(st.integers(1, 10))):
        head = prefixes[draw(st.integers(0, 1))][: draw(st.integers(0, 40))]
        tail = draw(st.lists(st.integers(1, 3), min_size=1, max_size=20))
        prompt = (head + tail)[: max_seq_len - 1]
        requests.append((draw(st.integers(0, 12)), prompt, draw(st.integers(1, 60)),
                         draw(st.one_of(st.none(), st.integers(0, 40))), draw(st.integers(0, 3)),
                         draw(st.booleans())))  # arrives during the step's prefills (schedule_more)
    forget_at = draw(st.one_of(st.none(), st.integers(0, 20)))  # a draft head joins: no sharing from then
    return config, K, requests, forget_at, draw(st.randoms(use_true_random=False))


# the same 500 cases every run (derandomized)
@settings(max_examples=500, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(traffic())
def test_random_traffic_keeps_every_sequences_kv_its_own_and_every_request_ends(case):
    config, K, requests, forget_at, rng = case
    s = Scheduler(**config)
    shadow = Shadow(s)
    seqs = []
    for i, (at, prompt, max_tokens, cancel_at, group, mid) in enumerate(requests):
        q = Sequence(seq_id=i, prompt_ids=prompt, params=SamplingParams(max_tokens=max_tokens), seed=0,
                     callback=lambda o: None, stop_ids=frozenset(), group=group)
        seqs.append((at, cancel_at, mid and not config["step_budget"], q))  # mid-step: the stepwise engine's
    last_arrival = max(at for at, _, _, _ in seqs)
    limit = last_arrival + 30 * sum(len(q.prompt_ids) + q.params.max_tokens for _, _, _, q in seqs)
    step = 0
    while step <= last_arrival or s.has_work():
        assert step < limit, "a request never ends"
        if step == forget_at:
            s.forget_prefixes()
        for at, cancel_at, mid, q in seqs:
            if at == step and not mid:
                s.waiting.append(q)
            if cancel_at is not None and at + cancel_at == step and q.status is not Status.FINISHED:
                q.cancelled = True
                s.finish(q, "cancelled")
        plan = s.schedule()
        assert all(q.status is Status.PREEMPTED or q.status is Status.PREFILL for q in plan.preempted)
        for chunk in plan.prefills:
            _prefill(shadow, chunk, rng)
        arrived = [q for at, _, mid, q in seqs if at == step and mid and not q.cancelled]
        budget = s.prefill_chunk - sum(c.end - c.start for c in plan.prefills)
        if arrived:  # EngineCore.step's stepwise path: they join the step's prefills within its budget
            s.waiting.extend(arrived)
            if budget > 0:
                more = s.schedule_more(budget, {c.seq.seq_id for c in plan.prefills})
                assert sum(c.end - c.start for c in more.prefills) <= budget
                for chunk in more.prefills:
                    _prefill(shadow, chunk, rng)
        for q in plan.decodes:
            if q.status is Status.DECODE:  # not finished by this step's prefill bookkeeping
                _decode(shadow, q, K, rng)
        s.check_integrity()
        step += 1
    assert all(q.status is Status.FINISHED for _, _, _, q in seqs)
    assert s.pool.num_used == 0
