"""Scheduler (pure Python): slot free list, admission, chunked prefill budget, integrity."""
from __future__ import annotations

from specguide.request import SamplingParams
from specguide.scheduler import Scheduler, Sequence, Status


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
