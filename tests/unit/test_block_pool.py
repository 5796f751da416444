"""BlockPool (the KV blocks' owner) and the scheduler's use of it: blocks handed out as sequences
grow and taken back when they end; when they run short the newest sequence is preempted (it keeps
its slot), recomputes its tokens once blocks are free again, and the waiting queue waits for it."""
from __future__ import annotations

import numpy as np
import pytest

from specguide.engine.block_pool import BLOCK, BlockPool
from specguide.engine.scheduler import Scheduler, Sequence, Status
from specguide.request import SamplingParams


def pool(slots: int = 3, per_seq: int = 4, blocks: int = 8) -> BlockPool:
    return BlockPool(np.full((slots, per_seq), 7, np.int32), blocks)


def test_blocks_are_handed_out_lowest_first_and_taken_back():
    p = pool()
    assert (p.table == 0).all() and p.num_free == 7 and p.num_used == 0
    assert p.grow(0, 17) and p.table[0].tolist() == [1, 2, 0, 0]  # 17 positions: 2 blocks
    assert p.grow(1, 1) and p.table[1].tolist() == [3, 0, 0, 0]
    assert p.grow(0, 32) and p.held[0] == 2  # already covered
    assert p.missing(0, 33) == 1 and p.missing(0, 10 * BLOCK) == 2  # at most the table's row
    assert p.grow(0, 10 * BLOCK) and p.table[0].tolist() == [1, 2, 4, 5]
    assert not p.grow(2, 3 * BLOCK) and p.held[2] == 0 and (p.table[2] == 0).all()  # 2 free: nothing given
    p.shrink(0, 20)  # keeps the blocks of positions < 20
    assert p.table[0].tolist() == [1, 2, 0, 0] and p.num_free == 4
    assert p.grow(2, 3 * BLOCK) and sorted(p.table[2, :3].tolist()) == [4, 5, 6]
    p.check_integrity()
    p.shrink(2)
    p.shrink(1)
    p.shrink(0)
    assert p.num_used == 0 and (p.table == 0).all()
    p.check_integrity()


def test_integrity_finds_a_block_held_twice():
    p = pool()
    p.grow(0, 16)
    p.grow(1, 16)
    p.table[1, 0] = p.table[0, 0]
    with pytest.raises(AssertionError):
        p.check_integrity()


def seq(i: int, n: int = 20) -> Sequence:
    return Sequence(seq_id=i, prompt_ids=list(range(1, n + 1)), params=SamplingParams(max_tokens=1000), seed=0,
                    callback=lambda o: None, stop_ids=frozenset())


def run_chunks(s: Scheduler, plan) -> None:
    """What the engine does with a plan's chunks (its prefill ends with the first token)."""
    for c in plan.prefills:
        c.seq.num_cached = c.end
        if c.is_last:
            c.seq.output_ids.append(1)
            c.seq.status = Status.DECODE
        elif c.resumes:
            c.seq.status = Status.DECODE


def decode(plan, n: int = 1) -> None:
    for q in plan.decodes:
        q.num_cached = q.num_tokens
        q.output_ids += [1] * n


def test_the_newest_sequence_is_preempted_keeps_its_slot_and_is_recomputed_when_blocks_free():
    K = 3  # draft positions a decoding sequence's step may write
    s = Scheduler(max_slots=3, max_seq_len=128, prefill_chunk=64, pool=BlockPool(
        np.zeros((3, BlockPool.blocks_for(128 + K + 1)), np.int32), 1 + 9), lookahead=K)
    a, b, c = seq(1), seq(2), seq(3)
    for q in (a, b, c):
        s.waiting.append(q)
    plan = s.schedule()
    assert [ch.seq for ch in plan.prefills] == [a, b, c] and s.pool.num_used == 6  # 20 positions: 2 blocks each
    run_chunks(s, plan)
    preempted = []
    for _ in range(40):
        plan = s.schedule()
        s.check_integrity()
        preempted += plan.preempted
        for q in s.running.values():
            if q.status is Status.DECODE:  # its step's positions: its tokens and K drafts
                assert s.pool.held[q.slot] == BlockPool.blocks_for(q.num_tokens + K)
        if preempted:
            break
        decode(plan)
    assert preempted == [c] and c.status is Status.PREEMPTED and s.pool.held[c.slot] == 0
    assert s.running[c.slot] is c and c.num_cached == 0 and c.preemptions == 1 and s.num_preemptions == 1
    d = seq(4)
    s.waiting.append(d)
    plan = s.schedule()
    assert d.status is Status.WAITING and plan.prefills == []  # the preempted go first
    s.finish(a, "stop")  # its blocks come back
    s.finish(b, "stop")
    plan = s.schedule()
    (chunk,) = [ch for ch in plan.prefills if ch.seq is c]
    assert (chunk.start, chunk.end) == (0, c.num_tokens - 1) and chunk.resumes and not chunk.is_last
    run_chunks(s, plan)
    assert c.status is Status.DECODE
    plan = s.schedule()
    assert c in plan.decodes and s.pool.held[c.slot] == BlockPool.blocks_for(c.num_tokens + K)
    s.check_integrity()
    s.finish(c, "stop")
    s.finish(d, "stop")
    s.check_integrity()
    assert s.pool.num_used == sum(s.pool.held)  # only free slots' kept prefixes


def test_cached_prefix_blocks_are_given_up_before_anything_is_preempted():
    s = Scheduler(max_slots=2, max_seq_len=64, prefill_chunk=64, prefix_caching=True, any_prefix=True,
                  pool=BlockPool(np.zeros((2, 5), np.int32), 1 + 5))
    a = seq(1, 48)
    s.waiting.append(a)
    run_chunks(s, s.schedule())
    s.finish(a, "stop")
    assert s.pool.held[0] == 0 and len(s.pool.cached) == 3  # its 3 computed blocks (48 positions) are keyed
    b = seq(2, 40)
    b.prompt_ids = [9] * 40  # shares nothing
    s.waiting.append(b)
    plan = s.schedule()
    assert plan.prefills[0].seq is b and not plan.preempted
    assert len(s.pool.cached) == 2  # the 2 free blocks, then a cached one for b's 3
    s.check_integrity()


def test_shared_blocks_count_their_holders_and_go_back_to_the_cache_with_the_last():
    p = pool(slots=3, per_seq=4, blocks=9)
    keys = [bytes([i]) * 16 for i in range(3)]
    assert p.grow(0, 40) and p.table[0, :3].tolist() == [1, 2, 3]
    p.register(0, keys[:2])  # blocks 0 and 1 computed
    assert p.match(keys) == [1, 2] and p.match([keys[0], b"y" * 16, keys[1]]) == [1]  # a run from the first
    p.share(1, [1, 2])
    assert p.grow(1, 33) and p.table[1, :3].tolist() == [1, 2, 4] and p.ref[1:5] == [2, 2, 1, 1]
    assert p.num_used == 4
    p.register(1, [keys[0], keys[1], b"x" * 16], 2)  # its own block 2
    p.shrink(0)
    assert p.ref[1:5] == [1, 1, 0, 1] and 3 in p.free and not p.cached  # block 3 unkeyed: free
    p.shrink(1)
    assert list(p.cached) == [4, 2, 1] and p.num_free == 8 and p.num_used == 0
    p.check_integrity()
    assert p.grow(2, 6 * 16 - 1) is False or p.held[2] == 4  # at most its row: 4 blocks
    assert p.held[2] == 4 and list(p.cached) == [4, 2, 1]  # the 5 unkeyed free blocks went first
    p.shrink(2)
    p.forget()
    assert not p.cached and not p.by_key and p.num_free == 8
    p.check_integrity()


def test_a_preempted_sequence_shares_its_own_cached_blocks_when_it_resumes():
    K = 1
    s = Scheduler(max_slots=2, max_seq_len=128, prefill_chunk=128, prefix_caching=True, any_prefix=True, lookahead=K,
                  pool=BlockPool(np.zeros((2, BlockPool.blocks_for(128 + K + 1)), np.int32), 1 + 8))
    a, b = seq(1, 40), seq(2, 40)
    b.prompt_ids = [7] * 40
    for q in (a, b):
        s.waiting.append(q)
    run_chunks(s, s.schedule())
    preempted = []
    while not preempted:
        plan = s.schedule()
        preempted += plan.preempted
        decode(plan, 3)
    assert preempted == [b] and b.num_cached == 0 and s.pool.held[b.slot] == 0
    assert len(s.pool.cached) >= 2  # its computed blocks, cached
    s.finish(a, "stop")
    plan = s.schedule()
    (chunk,) = plan.prefills
    assert chunk.seq is b and chunk.start == b.num_reused > 0 and chunk.end == b.num_tokens - 1
    s.check_integrity()


def test_a_resumed_sequence_whose_last_block_reads_its_last_token_still_computes_up_to_it():
    """Preempted with 16k + 17 tokens, a sequence's keyed blocks cover every token but its last
    (block k's key reads token 16k + 16, the last one); its recompute stops one short of that
    (the next decode step feeds the last token), so it shares k blocks, not k + 1, and its chunk
    ends where its tokens do: it once took all k + 1, had nothing left to compute, and was given
    chunks past its tokens (the request failed)."""
    s = Scheduler(max_slots=1, max_seq_len=128, prefill_chunk=64, prefix_caching=True, any_prefix=True,
                  pool=BlockPool(np.zeros((1, BlockPool.blocks_for(128 + 1)), np.int32), 1 + 12))
    a = seq(1, 40)
    s.waiting.append(a)
    run_chunks(s, s.schedule())
    while a.num_tokens < 3 * BLOCK + 1:  # 49 = 16 * 2 + 17
        decode(s.schedule())
    assert a.num_tokens == 3 * BLOCK + 1 and a.num_cached == a.num_tokens - 1
    s._preempt(a)
    assert len(a.block_keys) == 3  # blocks 0-2 keyed: block 2's key reads token 48
    plan = s.schedule()
    (chunk,) = plan.prefills
    assert (chunk.start, chunk.end) == (2 * BLOCK, a.num_tokens - 1) and chunk.resumes
    run_chunks(s, plan)
    assert a.status is Status.DECODE
    s.check_integrity()


def test_the_cache_reuses_memory_already_taken_so_memory_follows_the_work():
    """On the CPU a block's pages are taken when it is first written. Had blocks never used gone
    before cached ones, 40 distinct requests one after another would touch 120 blocks (all of them
    cached). Cached blocks go first once the cache holds a table row's worth (5 here) or as many as
    are in use: the blocks ever handed out stay within that and one request's own."""
    s = Scheduler(max_slots=2, max_seq_len=64, prefill_chunk=64, prefix_caching=True, any_prefix=True,
                  pool=BlockPool(np.zeros((2, 5), np.int32), 1 + 200))
    for i in range(40):
        q = seq(i + 1, 48)
        q.prompt_ids = [1000 + 100 * i + j for j in range(48)]  # shares nothing
        s.waiting.append(q)
        run_chunks(s, s.schedule())
        s.finish(q, "stop")
    assert s.pool.num_blocks - 1 - len(s.pool.fresh) <= 5 + 3
    assert len(s.pool.cached) >= 5  # the most recent prefixes stay cached
    s.check_integrity()


def test_a_request_of_many_rows_gives_up_its_own_rows_before_a_later_one_row_request():
    """A batch of 3 rows (one client request) admitted first holds most blocks; a one-row request
    comes after. When blocks run short the batch's newest row is preempted, never the one-row
    request (newest-first alone would preempt it again and again); two one-row requests still go
    newest first."""
    K = 3
    s = Scheduler(max_slots=4, max_seq_len=128, prefill_chunk=64, pool=BlockPool(
        np.zeros((4, BlockPool.blocks_for(128 + K + 1)), np.int32), 1 + 12), lookahead=K)
    batch = [seq(i) for i in (1, 2, 3)]
    for q in batch:
        q.group = 7
    lone = seq(4)
    lone.group = 9
    for q in (*batch, lone):
        s.waiting.append(q)
    run_chunks(s, s.schedule())
    preempted = []
    for _ in range(200):
        plan = s.schedule()
        s.check_integrity()
        preempted += plan.preempted
        if len(preempted) >= 2:
            break
        run_chunks(s, plan)
        decode(plan)
    assert preempted[:2] == [batch[2], batch[1]], preempted
    assert lone.preemptions == 0 and lone.status is Status.DECODE
    # one-row requests alone: the newest goes
    t = Scheduler(max_slots=3, max_seq_len=128, prefill_chunk=64, pool=BlockPool(
        np.zeros((3, BlockPool.blocks_for(128 + K + 1)), np.int32), 1 + 9), lookahead=K)
    solo = [seq(i) for i in (1, 2, 3)]
    for i, q in enumerate(solo):
        q.group = 10 + i
        t.waiting.append(q)
    run_chunks(t, t.schedule())
    first = []
    while not first:
        plan = t.schedule()
        first = plan.preempted
        decode(plan)
    assert first == [solo[2]]
