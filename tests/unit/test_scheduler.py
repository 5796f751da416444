"""Scheduler (pure Python): slot free list, admission, chunked prefill budget, integrity."""
from __future__ import annotations

from specguide.request import SamplingParams
import numpy as np

from specguide.engine.block_pool import BLOCK, BlockPool, block_keys
from specguide.engine.scheduler import Scheduler, Sequence, Status


def seq(i, n_prompt=10, **kw):
    return Sequence(seq_id=i, prompt_ids=list(range(n_prompt)), params=SamplingParams(**kw), seed=0,
                    callback=lambda o: None, stop_ids=frozenset({0}))


def test_admission_fills_lowest_slots_and_queues_the_rest():
    s = Scheduler(max_slots=2, max_seq_len=100, prefill_chunk=1000)
    seqs = [seq(i) for i in range(3)]
    for q in seqs:
        s.waiting.append(q)
    plan = s.schedule()
    assert [c.seq.slot for c in plan.prefills] == [0, 1]
    assert seqs[2].status is Status.WAITING and s.num_waiting == 1
    s.finish(seqs[0], "length")
    s.schedule()
    assert seqs[2].slot == 0
    s.check_integrity()


def test_chunked_prefill_respects_the_token_budget():
    s = Scheduler(max_slots=4, max_seq_len=1000, prefill_chunk=16)
    a, b = seq(1, n_prompt=40), seq(2, n_prompt=5)
    s.waiting.append(a)
    s.waiting.append(b)
    spans = []
    for _ in range(4):
        plan = s.schedule()
        assert sum(c.end - c.start for c in plan.prefills) <= 16
        for c in plan.prefills:
            spans.append((c.seq.seq_id, c.start, c.end))
            c.seq.num_cached = c.end
            if c.is_last:
                c.seq.status = Status.DECODE
    assert spans[:3] == [(1, 0, 16), (1, 16, 32), (1, 32, 40)]
    assert (2, 0, 5) in spans  # shares the third step's budget
    assert a.status is b.status is Status.DECODE


def test_one_budget_counts_the_decode_rows_first_and_cuts_prompt_chunks_to_the_rest():
    """Prompt chunks and decode rows in one forward: while sequences decode, `step_budget` tokens a
    step, each decoding sequence's lookahead + 1 rows first, prompt chunks cut to what is left (never
    below a quarter); with nothing decoding, prompt chunks take `prefill_chunk`."""
    s = Scheduler(max_slots=16, max_seq_len=1000, prefill_chunk=128, any_prefix=True, lookahead=3, step_budget=64)
    runners = [seq(i, n_prompt=4) for i in range(14)]
    for q in runners:
        s.waiting.append(q)
    for c in s.schedule().prefills:  # nothing decodes yet: all 14 four-token prompts in one step
        computed(s, c.seq, c.end)
        c.seq.status = Status.DECODE
    assert all(q.status is Status.DECODE for q in runners)
    long = seq(99, n_prompt=300)
    s.waiting.append(long)
    plan = s.schedule()  # 14 x 4 = 56 decode rows: 8 left, but never below 16
    assert len(plan.decodes) == 14 and [(c.start, c.end) for c in plan.prefills] == [(0, 16)]
    computed(s, long, 16)
    for q in runners[4:]:  # ten end: 16 rows, the chunk takes the other 48
        s.finish(q, "stop")
    assert [(c.start, c.end) for c in s.schedule().prefills] == [(16, 64)]
    computed(s, long, 64)
    for q in runners[:4]:  # nothing decodes: a whole prefill_chunk
        s.finish(q, "stop")
    assert [(c.start, c.end) for c in s.schedule().prefills] == [(64, 192)]


def test_a_burst_of_prompts_beside_decoding_streams_gets_a_share_per_prompt():
    """Each prefilling sequence gets as much of a step as a decoding one's rows on average (up to
    prefill_chunk in all): one prompt beside 8 streams keeps what the budget leaves, 40 prompts
    (a burst whose first requests already decode) are not held to it."""
    def eight_streams() -> Scheduler:
        s = Scheduler(max_slots=64, max_seq_len=1000, prefill_chunk=128, any_prefix=True, lookahead=3, step_budget=64)
        for q in [seq(i, n_prompt=4) for i in range(8)]:
            s.waiting.append(q)
        for c in s.schedule().prefills:
            computed(s, c.seq, c.end)
            c.seq.status = Status.DECODE
        return s

    s = eight_streams()
    s.waiting.append(seq(100, n_prompt=100))
    assert sum(c.end - c.start for c in s.schedule().prefills) == 64 - 8 * 4  # the budget's rest
    s = eight_streams()
    for i in range(40):
        s.waiting.append(seq(100 + i, n_prompt=100 + i))
    plan = s.schedule()
    assert len(plan.decodes) == 8
    assert sum(c.end - c.start for c in plan.prefills) == 128  # 40 x 32 / 8 rows' worth, capped at prefill_chunk
    s.check_integrity()


def test_while_streams_decode_a_prompt_token_counts_its_attention_so_late_chunks_are_shorter():
    """A token at position p is 1 + p * key_cost tokens' worth of work: a long prompt's chunks beside
    a decoding stream shrink as its position grows, so no step holds the stream longer than its
    first did; the decode rows count their positions too."""
    s = Scheduler(max_slots=2, max_seq_len=4000, prefill_chunk=256, any_prefix=True, lookahead=3, step_budget=64,
                  key_cost=1 / 100)
    stream, long = seq(1, n_prompt=4), seq(2, n_prompt=2000)
    s.waiting.append(stream)
    for c in s.schedule().prefills:
        computed(s, c.seq, c.end)
        stream.status = Status.DECODE
    s.waiting.append(long)
    rows = 4 + (4 * 3 + 6) / 100  # the stream's last token and 3 drafts at positions 3 .. 6
    assert [(c.start, c.end) for c in s.schedule().prefills] == [(0, 48)]  # 48 + 48 * 47 / 200 <= 64 - rows
    assert s.budget.cost(0, 49) > 64 - rows
    computed(s, long, 1000)
    assert [(c.start, c.end) for c in s.schedule().prefills] == [(1000, 1005)]  # ~11 a token at 1,000
    s.finish(stream, "stop")  # nothing decodes: a whole prefill_chunk, whatever its position
    assert [(c.start, c.end) for c in s.schedule().prefills] == [(1000, 1256)]


def test_not_ready_requests_wait():  # the queue limit is the engine's (test_reliability)
    s = Scheduler(max_slots=1, max_seq_len=100, prefill_chunk=100)
    a, b = seq(1), seq(2)
    s.waiting.append(a)
    s.waiting.append(b)
    s.schedule(ready=lambda q: q is not a)
    assert a.status is Status.WAITING and b.slot == 0
    assert list(s.waiting) == [a]


def test_stop_conditions():
    s = Scheduler(max_slots=1, max_seq_len=14, prefill_chunk=100)
    q = seq(1, max_tokens=3, min_tokens=1)
    q.output_ids = [5]
    assert s.check_stop_token(q) is None
    q.output_ids = [5, 0]
    assert s.check_stop_token(q) == "stop"
    q.output_ids = [5, 6, 7]
    assert s.check_stop_token(q) == "length"
    long = seq(2, max_tokens=50)
    long.output_ids = [5, 6, 7, 8]  # 10 prompt + 4 = max_seq_len
    assert s.check_stop_token(long) == "length"


def computed(s, q, n):
    """Pretend the forwards computed q's first n positions: its KV in the blocks they were given."""
    q.num_cached = n
    assert s.pool.grow(q.slot, n)


def _prompt(i, shared, n):
    return Sequence(seq_id=i, prompt_ids=shared + [1000 + i] * n, params=SamplingParams(), seed=0,
                    callback=lambda o: None, stop_ids=frozenset({0}))


def _sharing(slots: int = 4, **kw) -> Scheduler:
    return Scheduler(max_slots=slots, max_seq_len=1000, prefill_chunk=64, prefix_caching=True, any_prefix=True, **kw)


def _admit(s, q):
    s.waiting.append(q)
    return s.schedule()


def test_full_blocks_are_shared_by_every_sequence_whose_tokens_key_them():
    """Issue 77: a computed full block is keyed by the hash chain of its tokens and the one after it;
    a sequence admitted later (while its owner runs, or after it ended) whose tokens give the same
    keys takes those blocks into its table row, computes from the first block it lacks, and every
    shared block is held once however many sequences read it."""
    s = _sharing()
    shared = list(range(1, 41))  # 40 tokens: blocks 0 and 1 whole (block 1 keyed with token 32)
    a = _prompt(1, shared, 5)
    _admit(s, a)
    assert a.num_reused == 0  # nothing cached yet
    computed(s, a, 45)
    a.output_ids, a.status = [1], Status.DECODE  # its prefill ran
    b = _prompt(2, shared, 9)
    plan = _admit(s, b)  # registers a's computed blocks, then admits b
    assert (b.num_reused, b.num_cached) == (32, 32) and [(c.start, c.end) for c in plan.prefills] == [(32, 49)]
    assert b.slot != a.slot and (s.pool.table[b.slot, :2] == s.pool.table[a.slot, :2]).all()
    assert [s.pool.ref[int(x)] for x in s.pool.table[a.slot, :3]] == [2, 2, 1]
    assert s.pool.num_used == 3 + 2  # a's 3 blocks (positions < 45) and b's own blocks 2 .. 3, each once
    assert s.reused_blocks == 2  # (metrics)
    c = _prompt(3, shared[:32] + [999], 0)  # the token after block 1 differs: block 1's key does too
    _admit(s, c)
    assert c.num_reused == 16
    d = _prompt(4, shared[:33], 0)  # the token after block 1 matches: both blocks, one token left to compute
    _admit(s, d)
    assert d.num_reused == 32
    s.check_integrity()
    for q in (a, b, c, d):
        s.finish(q, "stop")
    assert s.pool.num_used == 0 and s.pool.num_free == s.pool.num_blocks - 1  # cached blocks count as free
    e = _prompt(5, shared, 2)
    _admit(s, e)
    assert e.num_reused == 32  # from the cache, after its owners ended
    s.check_integrity()


def test_prompts_that_arrive_together_wait_for_the_first_to_compute_their_shared_prefix():
    """16 requests with one system prompt, sent at once: the first computes the prefix, the others
    wait while it does (other prompts go on) and then share it, instead of each computing it; once
    fewer than `wait_min_blocks` of it are left to compute, they go on and compute those."""
    s = _sharing(slots=8)
    shared = list(range(1, 201))  # 200 tokens: 12 whole blocks
    same = [_prompt(i, shared, 4) for i in range(1, 5)]
    other = _prompt(9, [500 + i for i in range(30)], 0)
    for q in same + [other]:
        s.waiting.append(q)
    plan = s.schedule()
    assert [c.seq.seq_id for c in plan.prefills] == [1] and other.status is Status.PREFILL  # admitted: its turn comes
    for n in (64, 128):  # the first's chunks: 8, then 4 blocks of the prefix still to come
        assert all(q.status is Status.WAITING for q in same[1:])
        computed(s, same[0], n)
        plan = s.schedule()
    assert all(q.status is Status.WAITING for q in same[1:])
    computed(s, same[0], 192)
    plan = s.schedule()
    assert [q.num_reused for q in same[1:]] == [192] * 3
    assert [(c.seq.seq_id, c.start, c.end) for c in plan.prefills][1:4] == [(2, 192, 204), (3, 192, 204), (4, 192, 204)]
    s.check_integrity()
    late = _prompt(5, shared[:40], 30)  # a later prompt with part of it: the cached blocks at once
    s.waiting.append(late)
    s.schedule()
    assert late.status is Status.PREFILL and late.num_reused == 32
    s.check_integrity()


def test_a_shared_prefix_leaves_a_token_to_compute_and_is_not_taken_for_context_logits_or_when_off():
    s = _sharing()
    a = _run_to_end(s, _prompt(1, list(range(1, 33)), 0), num_cached=32)  # 32 tokens: blocks 0 and 1
    same = _prompt(2, list(range(1, 33)), 0)
    _admit(s, same)
    assert same.num_reused == 16  # block 1's key needs token 32, past this prompt: its logits give the first token
    ctx = Sequence(seq_id=3, prompt_ids=a.prompt_ids + [5] * 9, params=SamplingParams(return_context_logits=True),
                   seed=0, callback=lambda o: None, stop_ids=frozenset({0}))
    _admit(s, ctx)
    assert ctx.num_reused == 0  # context logits need every prompt position computed
    for kw in ({"prefix_caching": False, "any_prefix": True}, {"prefix_caching": True, "any_prefix": False}):
        # off, or a forward whose K/V bits depend on the chunk split (a block is not the same from anyone)
        off = Scheduler(max_slots=2, max_seq_len=1000, prefill_chunk=8, **kw)
        _run_to_end(off, _prompt(4, list(range(1, 41)), 0))
        d = _prompt(5, list(range(1, 41)), 4)
        _admit(off, d)
        assert d.num_reused == 0 and not off.pool.by_key


def _run_to_end(s, q, num_cached=None):
    """Admit q alone, pretend its prompt (or num_cached tokens) was computed, finish it."""
    s.waiting.append(q)
    s.schedule()
    computed(s, q, len(q.prompt_ids) if num_cached is None else num_cached)
    s.finish(q, "stop")
    return q


def test_decoded_positions_are_shared_too_so_a_next_turn_reuses_the_answer():
    """The forward is chunk-invariant: positions decode steps computed are the bits a prefill computes,
    so a chat's next turn (the last prompt and answer, then more) shares them, up to the last block
    whose positions and next token it has."""
    s = _sharing()
    a = _prompt(1, list(range(1, 21)), 0)
    a.output_ids = [7] * 30
    _run_to_end(s, a, num_cached=49)  # 50 tokens, the newest without K/V: blocks 0 .. 2 computed
    turn = _prompt(2, a.prompt_ids + a.output_ids + [8, 9], 3)
    _admit(s, turn)
    assert turn.num_reused == 48
    partial = _prompt(3, a.prompt_ids + a.output_ids[:20] + [9], 0)  # diverges at position 40
    _admit(s, partial)
    assert partial.num_reused == 32
    s.check_integrity()


def test_cached_blocks_are_taken_last_least_recently_freed_first():
    """Blocks nobody holds stay cached for later prompts; a sequence that needs blocks when no other is
    free takes the least recently freed; what is left still matches."""
    s = _sharing(slots=3, pool=BlockPool(np.zeros((3, 6), np.int32), 1 + 8))
    old, new = [500 + i for i in range(40)], [600 + i for i in range(40)]
    _run_to_end(s, _prompt(1, old, 0))  # 3 blocks, 2 of them keyed (block 2 holds positions 32 .. 39 only)
    _run_to_end(s, _prompt(2, new, 0))
    assert len(s.pool.cached) == 4 and s.pool.num_free == 8
    big = _prompt(3, [700 + i for i in range(70)], 0)  # 5 blocks: the 4 free ones, then a cached one
    _admit(s, big)
    computed(s, big, 64)
    s.schedule()  # its second chunk's block
    assert s.pool.held[big.slot] == 5 and len(s.pool.cached) == 3
    assert len(s.pool.match(block_keys(old, [], 40))) == 1  # old's last block went (its chain's tail first)
    q = _prompt(4, new, 3)
    _admit(s, q)
    assert q.num_reused == 32
    s.check_integrity()


def test_a_sequence_running_when_prefixes_are_forgotten_never_shares_what_it_computes():
    """forget_prefixes (a draft head attached: blocks computed before lack its features): nothing cached
    is shared, nor what the sequences running then compute later."""
    s = _sharing()
    _run_to_end(s, _prompt(1, list(range(1, 41)), 0))
    running = _prompt(2, [300 + i for i in range(40)], 0)
    _admit(s, running)
    s.forget_prefixes()
    assert not s.pool.by_key and not s.pool.cached
    computed(s, running, 40)
    late = _prompt(3, list(range(1, 41)), 2)
    _admit(s, late)
    other = _prompt(4, running.prompt_ids, 2)
    _admit(s, other)
    assert late.num_reused == 0 and other.num_reused == 0
    s.check_integrity()


def test_requests_that_arrive_during_a_steps_prefills_join_them_within_its_budget():
    s = Scheduler(max_slots=5, max_seq_len=1000, prefill_chunk=64, prefix_caching=True, any_prefix=True)
    shared = list(range(1, 34))  # 33 tokens every prompt starts with: 2 blocks and the token after them
    first, decoding = _prompt(1, shared, 2), seq(9, n_prompt=3)
    for q in (decoding, first):
        s.waiting.append(q)
    plan = s.schedule()
    decoding.num_cached, decoding.status = 3, Status.DECODE  # pretend: prefilled in an earlier step
    plan = s.schedule()  # the step: `first` prefilled (35 tokens), `decoding` in its batch
    assert [(c.seq.seq_id, c.start, c.end) for c in plan.prefills] == [(1, 0, 35)] and plan.decodes == [decoding]
    first.num_cached, first.status = 35, Status.DECODE  # its prefill ran; then these came
    late = [_prompt(2, shared, 3), _prompt(3, shared, 5), _prompt(4, shared, 29)]
    for q in late:
        s.waiting.append(q)
    more = s.schedule_more(64 - 35, {1})
    # all are admitted (slots free) and share `first`'s 2 blocks, which its prefill just computed;
    # chunks in arrival order while they fit the 29 tokens left: 4 and 6, then 30 does not fit (no skipping)
    assert [q.num_reused for q in late] == [32, 32, 32]
    assert [(c.seq.seq_id, c.start, c.end) for c in more.prefills] == [(2, 32, 36), (3, 32, 38)] and more.decodes == []
    late[0].num_cached, late[0].status = 36, Status.DECODE
    late[1].num_cached, late[1].status = 38, Status.DECODE
    # nothing planned twice, and the next step's schedule takes the rest
    assert s.schedule_more(3, {1, 2, 3}).prefills == []
    plan = s.schedule()
    assert [(c.seq.seq_id, c.start, c.end) for c in plan.prefills] == [(4, 32, 62)]
    assert [q.seq_id for q in plan.decodes] == [9, 1, 2, 3]
    s.check_integrity()


def test_a_request_of_many_rows_leaves_the_last_free_slots_to_the_requests_after_it():
    """Issue 75, found by the fuzzing run: a 64-row request (max_tokens 4,096 each) took all 64 slots,
    and a request sent after it waited minutes for one. Now the last `new_request_slots` free slots go
    only to requests none of whose rows holds a slot: the many-row request runs on the others, a
    single-row request after it starts at once, and the held-back rows take slots as they come free
    (first come, first served among them). With new_request_slots 0, the late request waits."""
    def run(reserve: int):
        s = Scheduler(max_slots=8, max_seq_len=100, prefill_chunk=1000, new_request_slots=reserve)
        batch = [seq(i) for i in range(1, 11)]  # one request's 10 rows
        for q in batch:
            q.group = 1
            s.waiting.append(q)
        s.schedule()
        late = seq(20)
        late.group = 2
        s.waiting.append(late)
        s.schedule()
        s.check_integrity()
        return s, batch, late

    s, batch, late = run(2)
    assert [q.slot is not None for q in batch] == [True] * 6 + [False] * 4  # 2 slots kept free
    assert late.slot is not None and late.status is Status.PREFILL
    late2 = seq(21)
    late2.group = 3
    s.waiting.append(late2)
    s.schedule()
    assert late2.slot is not None and not s.free_slots  # the last free slot: it holds none
    s.finish(batch[0], "length")
    s.schedule()
    assert batch[6].slot is None and len(s.free_slots) == 1  # one free: kept
    s.finish(late, "length")
    s.finish(late2, "length")
    s.schedule()
    assert batch[6].slot is not None and batch[7].slot is None  # the oldest waiting row, then 2 kept again
    assert len(s.free_slots) == 2
    s.check_integrity()

    s, batch, late = run(0)
    assert all(q.slot is not None for q in batch[:8]) and late.slot is None and late.status is Status.WAITING
