"""Scheduler (pure Python): slot free list, admission, chunked prefill budget, integrity."""
from __future__ import annotations

from specguide.request import SamplingParams
from specguide.engine.scheduler import PrefixCopy, Scheduler, Sequence, Status


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
    assert s._cost(0, 49) > 64 - rows
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


def test_prefix_caching_reuses_whole_chunks_of_the_longest_cached_prefix():
    s = Scheduler(max_slots=3, max_seq_len=1000, prefill_chunk=16, prefix_caching=True)
    shared = list(range(1, 41))  # 40 shared tokens: two whole chunks of 16
    a, b = _prompt(1, shared, 5), _prompt(2, shared[:20], 30)
    for q in (a, b):
        s.waiting.append(q)
    s.schedule()
    assert (a.slot, a.num_reused, b.slot, b.num_reused) == (0, 0, 1, 0)  # nothing cached yet
    computed(s, a, 45)  # prompts prefilled (the KV of positions < num_cached)
    computed(s, b, 50)
    s.finish(a, "stop")
    s.finish(b, "stop")
    c = _prompt(3, shared, 7)
    s.waiting.append(c)
    plan = s.schedule()
    # slot 0 holds 40 shared tokens (32 reusable), slot 1 only 20 (16): slot 0, from position 32
    assert (c.slot, c.num_reused, c.num_cached) == (0, 32, 32)
    assert [(p.start, p.end) for p in plan.prefills] == [(32, 47)]  # chunks stay [k*16, (k+1)*16)
    assert s.reused_blocks == 2  # 32 reused positions: two whole KV blocks of 16 (metrics)
    assert s.slot_tokens[0] == [] and s.slot_tokens[1] == b.prompt_ids[:48]  # whole chunks of the prompt
    s.check_integrity()


def test_prefix_caching_never_reuses_the_whole_prompt_or_for_context_logits():
    s = Scheduler(max_slots=2, max_seq_len=1000, prefill_chunk=8, prefix_caching=True)
    a = _prompt(1, list(range(1, 17)), 0)  # 16 tokens
    s.waiting.append(a)
    s.schedule()
    computed(s, a, 16)
    s.finish(a, "stop")
    same = _prompt(2, list(range(1, 17)), 0)
    s.waiting.append(same)
    s.schedule()
    assert same.num_reused == 8  # one token at least is prefilled (its logits give the first token)
    s.finish(same, "stop")
    s.slot_tokens[0] = list(range(1, 17))
    ctx = Sequence(seq_id=3, prompt_ids=list(range(1, 17)) + [5] * 9, params=SamplingParams(return_context_logits=True),
                   seed=0, callback=lambda o: None, stop_ids=frozenset({0}))
    s.waiting.append(ctx)
    s.schedule()
    assert ctx.num_reused == 0  # context logits need every prompt position computed
    off = Scheduler(max_slots=1, max_seq_len=1000, prefill_chunk=8)
    off.slot_tokens[0] = list(range(1, 17))
    d = _prompt(4, list(range(1, 17)), 4)
    off.waiting.append(d)
    off.schedule()
    assert d.num_reused == 0  # prefix_caching off


def _run_to_end(s, q, num_cached=None):
    """Admit q alone, pretend its prompt (or num_cached tokens) was computed, finish it."""
    s.waiting.append(q)
    s.schedule()
    computed(s, q, len(q.prompt_ids) if num_cached is None else num_cached)
    s.finish(q, "stop")
    return q


def test_a_slot_keeps_only_its_prompts_prefilled_whole_chunks():
    s = Scheduler(max_slots=1, max_seq_len=1000, prefill_chunk=8, prefix_caching=True)
    a = _prompt(1, list(range(1, 21)), 0)  # 20 prompt tokens: chunks [0, 8), [8, 16), [16, 20)
    a.output_ids = [7] * 10
    _run_to_end(s, a, num_cached=30)
    # positions >= 16 were computed by a partial chunk or by decode steps: not what a prefill from
    # scratch computes for a longer prompt, so never reused
    assert s.slot_tokens[0] == a.prompt_ids[:16]
    b = _prompt(2, a.prompt_ids + a.output_ids, 5)
    s.waiting.append(b)
    s.schedule()
    assert b.num_reused == 16


def test_with_a_chunk_invariant_model_reuse_goes_to_the_first_differing_token():
    """any_prefix (the forward is chunk-invariant): a slot keeps every computed position, prompt and
    output (all but the newest token), and reuse goes up to the first differing token, from a free
    slot or copied from a busy one; chunks then start at the reused position."""
    s = Scheduler(max_slots=3, max_seq_len=1000, prefill_chunk=8, prefix_caching=True, any_prefix=True)
    a = _prompt(1, list(range(1, 21)), 0)  # 20 prompt tokens
    a.output_ids = [7] * 10
    _run_to_end(s, a, num_cached=29)  # the newest output token has no K/V yet
    assert s.slot_tokens[0] == (a.prompt_ids + a.output_ids)[:29]
    b = _prompt(2, a.prompt_ids + a.output_ids[:5] + [9], 12)  # a's prompt and 5 of its outputs, then not
    s.waiting.append(b)
    plan = s.schedule()
    assert (b.slot, b.num_reused) == (0, 25)
    assert [(p.start, p.end) for p in plan.prefills] == [(25, 33)]  # chunks from the reused position
    computed(s, b, 33)
    c = _prompt(3, b.prompt_ids[:30], 4)  # its first 30 tokens are b's, whose slot has computed 33: copied
    s.waiting.append(c)
    plan = s.schedule()
    assert (c.slot, c.num_reused) == (1, 30) and plan.copies == [PrefixCopy(0, 1, 0, 30)]
    whole = _prompt(4, list(range(1, 21)), 0)  # a prompt that a slot holds whole: one token left to compute
    s.waiting.append(whole)
    s.schedule()
    assert whole.num_reused == 19
    s.check_integrity()


def test_without_reuse_the_least_useful_free_slot_is_overwritten():
    s = Scheduler(max_slots=3, max_seq_len=1000, prefill_chunk=8, prefix_caching=True)
    hot = list(range(1, 17))  # a shared system prompt: two whole chunks
    _run_to_end(s, _prompt(1, hot, 4))  # slot 0
    again = _run_to_end(s, _prompt(2, hot, 6))  # reuses slot 0: its prefix is hot
    assert (again.slot, again.num_reused) == (None, 16) and s.slot_hits[0] == 1
    one_off = Sequence(seq_id=3, prompt_ids=[500 + i for i in range(20)], params=SamplingParams(), seed=0,
                       callback=lambda o: None, stop_ids=frozenset({0}))
    s.waiting.append(one_off)
    s.schedule()
    assert one_off.slot == 1  # the lowest empty slot
    s.finish(one_off, "stop")
    old_one_off = _run_to_end(s, Sequence(seq_id=4, prompt_ids=[600 + i for i in range(20)], params=SamplingParams(),
                                          seed=0, callback=lambda o: None, stop_ids=frozenset({0})))
    assert s.slot_tokens[2] == old_one_off.prompt_ids[:16]  # slot 2, the last empty one; all hold tokens now
    new = [Sequence(seq_id=5 + i, prompt_ids=[700 + 50 * i + j for j in range(20)], params=SamplingParams(), seed=0,
                    callback=lambda o: None, stop_ids=frozenset({0})) for i in range(2)]
    for q in new:
        s.waiting.append(q)
    s.schedule()
    # no reuse for either: the one-offs' slots go first, least recently freed first (1, then 2);
    # the hot prefix in slot 0 survives (the lowest free slot would have been 0)
    assert [q.slot for q in new] == [1, 2] and s.slot_tokens[0] == (hot + [1002] * 6)[:16]
    late = _prompt(9, hot, 3)
    s.waiting.append(late)
    s.finish(new[0], "stop")
    s.schedule()
    assert (late.slot, late.num_reused) == (0, 16)
    s.check_integrity()


def test_a_prefix_held_by_a_busy_slot_is_copied_into_the_new_slot():
    s = Scheduler(max_slots=3, max_seq_len=1000, prefill_chunk=8, prefix_caching=True)
    shared = list(range(1, 33))  # 4 chunks
    _run_to_end(s, _prompt(1, shared[:16], 3))  # slot 0 keeps 2 chunks of the shared prefix
    busy = _prompt(2, shared, 5)
    s.waiting.append(busy)
    s.schedule()
    assert (busy.slot, busy.num_reused) == (0, 16)  # same-slot reuse, then it runs in slot 0
    computed(s, busy, 24)  # three chunks prefilled so far
    c = _prompt(3, shared, 9)
    s.waiting.append(c)
    plan = s.schedule()
    # 24 prefilled tokens of the busy slot are reusable: copy them into a free slot, prefill the rest
    assert (c.slot, c.num_reused, c.num_cached) == (1, 24, 24)
    assert plan.copies == [PrefixCopy(src=0, dst=1, start=0, end=24)]
    assert [(p.seq.seq_id, p.start, p.end) for p in plan.prefills] == [(2, 24, 32)]  # c's chunk waits for budget
    # a free slot holding part of it: only the rest is copied
    s.finish(c, "stop")  # cancelled before its prefill: slot 1 keeps the 24 copied positions
    assert s.slot_tokens[1] == shared[:24]
    computed(s, busy, 37)
    d = _prompt(4, shared, 2)
    s.waiting.append(d)
    plan = s.schedule()
    assert (d.slot, d.num_reused) == (1, 32) and plan.copies == [PrefixCopy(0, 1, 24, 32)]
    assert s.slot_hits == [3, 3, 0]  # each reuse of the shared prefix counts for the slots holding it
    s.check_integrity()


def test_requests_that_arrive_during_a_steps_prefills_join_them_within_its_budget():
    s = Scheduler(max_slots=5, max_seq_len=1000, prefill_chunk=16, prefix_caching=True, any_prefix=True)
    shared = list(range(1, 9))  # 8 tokens every prompt starts with (any_prefix: reusable up to any token)
    first, decoding = _prompt(1, shared, 2), seq(9, n_prompt=3)
    for q in (decoding, first):
        s.waiting.append(q)
    plan = s.schedule()
    decoding.num_cached, decoding.status = 3, Status.DECODE  # pretend: prefilled in an earlier step
    plan = s.schedule()  # the step: `first` prefilled (10 tokens), `decoding` in its batch
    assert [(c.seq.seq_id, c.start, c.end) for c in plan.prefills] == [(1, 0, 10)] and plan.decodes == [decoding]
    first.num_cached, first.status = 10, Status.DECODE  # its prefill ran; then these came
    late = [_prompt(2, shared, 3), _prompt(3, shared, 5), _prompt(4, shared, 9)]
    for q in late:
        s.waiting.append(q)
    more = s.schedule_more(16 - 10, {1})
    # all are admitted (slots free) and reuse `first`'s 8 shared tokens, copied from its busy slot;
    # chunks in arrival order while they fit the 6 tokens left: 3, then 5 does not fit (no skipping)
    assert [q.num_reused for q in late] == [8, 8, 8]
    assert more.copies == [PrefixCopy(first.slot, q.slot, 0, 8) for q in late]
    assert [(c.seq.seq_id, c.start, c.end) for c in more.prefills] == [(2, 8, 11)] and more.decodes == []
    late[0].num_cached, late[0].status = 11, Status.DECODE
    # nothing planned twice, and the next step's schedule takes the rest
    assert s.schedule_more(3, {1, 2}).prefills == []
    plan = s.schedule()
    assert [(c.seq.seq_id, c.start, c.end) for c in plan.prefills] == [(3, 8, 13), (4, 8, 17)]
    assert [q.seq_id for q in plan.decodes] == [9, 1, 2]
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
