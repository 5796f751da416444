"""Reliability inside the engine: a fault in one request's row fails that request only; cancel at
every stage; time limits; a full queue; a crashed loop fails everything with UNAVAILABLE.

Faults come from specguide.engine.faults (enabled here through the environment)."""
from __future__ import annotations

import queue
import sys
import time

import pytest

from specguide.engine import faults
from specguide.config import EngineConfig
from specguide.engine.loop import Engine
from specguide.request import EngineDeadError, GuidedDecodingParams, QueueFullError, Request, SamplingParams

from .conftest import run_alone

COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3,"  # n-gram drafts hit
PROMPTS = [COUNTING, "The capital of France is", "def fibonacci(n):"]
# (its shortest match is 19 tokens, past these tests' max_tokens: cut at max_tokens, not refused up front)
PHONE = GuidedDecodingParams("regex", "[0-9]{3}-[0-9]{4} and [0-9]{3}-[0-9]{4}", complete_within_budget=False)


@pytest.fixture(autouse=True)
def fault_injection(inject_faults, request):
    """Every engine a test here uses injects faults (the session's `engine`, the module's `small`)."""
    inject_faults(*(request.getfixturevalue(n) for n in ("engine", "small") if n in request.fixturenames))


def greedy(prompt: str, n: int = 16, k: int = 3, guided=None, fault=None, timeout_s=None) -> Request:
    return Request(prompt=prompt, params=SamplingParams(max_tokens=n, temperature=0.0), guided=guided,
                   num_draft_tokens=k, fault=fault, timeout_s=timeout_s)


def run_together(engine: Engine, requests: list[Request]) -> list[tuple[list[int], str, object]]:
    """Submit all at once; (ids, text, final event) per request."""
    events: list[queue.Queue] = [queue.Queue() for _ in requests]
    for q, r in zip(events, requests):
        engine.submit(r, q.put)
    out = []
    for q in events:
        got = []
        while not (got and got[-1].finished):
            got.append(q.get(timeout=120))
        out.append(([t for o in got for t in o.token_ids], "".join(o.text for o in got), got[-1]))
    return out


def assert_clean(engine: Engine) -> None:
    """No slot, queue entry or grammar matcher is left behind."""
    deadline = time.monotonic() + 5
    while engine.stats()["active_slots"] or engine.stats()["queue_depth"]:
        assert time.monotonic() < deadline, engine.stats()
        time.sleep(0.01)
    engine.core.scheduler.check_integrity()
    engine.core.guided.synchronize()
    assert all(m is None for m in engine.core.guided.inner.matchers), "a grammar matcher leaked"
    assert engine.is_alive()


@pytest.mark.parametrize("k", [0, 3])
def test_nan_logits_in_one_row_fail_only_that_request(engine, k):
    alone = [run_alone(engine, greedy(p, k=k)) for p in PROMPTS]
    got = run_together(engine, [greedy(p, k=k) for p in PROMPTS] + [greedy(PROMPTS[0], k=k, fault="nan_logits")])
    for (ids, text, _), (a_ids, a_text, _) in zip(got, alone):
        assert (ids, text) == (a_ids, a_text)
    ids, _, last = got[-1]
    assert last.finish_reason == "error" and last.error_code == "INTERNAL" and "non-finite" in last.error
    assert len(ids) == 1, "the first token (from the prefill) was fine"
    assert_clean(engine)


@pytest.mark.parametrize("k", [0, 3])
def test_a_matcher_that_raises_fails_only_its_request(engine, k):
    requests = [greedy(PROMPTS[1], k=k, guided=PHONE), greedy(PROMPTS[0], k=k), greedy(PROMPTS[2], k=k, guided=PHONE)]
    alone = [run_alone(engine, r) for r in requests]
    bad = greedy(PROMPTS[1], k=k, guided=PHONE, fault="matcher_error")
    got = run_together(engine, requests + [bad])
    for (ids, text, last), (a_ids, a_text, _) in zip(got, alone):
        assert (ids, text) == (a_ids, a_text)
    _, _, last = got[-1]
    assert last.finish_reason == "error" and "injected matcher fault" in last.error
    assert_clean(engine)


@pytest.fixture
def recoveries(engine, monkeypatch) -> list[int]:
    """The batch size of every decode step that raised (EngineCore._recover's calls)."""
    sizes: list[int] = []
    recover = engine.core._recover

    def counted(seqs, exc):
        sizes.append(len(seqs))
        return recover(seqs, exc)

    monkeypatch.setattr(engine.core, "_recover", counted)
    return sizes


@pytest.mark.parametrize("k", [0, 3])
def test_a_step_that_raises_naming_no_request_fails_only_the_request_that_makes_it(engine, recoveries, k):
    """The whole batched step raises and no request's state is broken: the engine runs the rows
    apart and fails only the one that raises alone; every other row (plain, guided, penalized)
    writes what it writes alone."""
    penalized = Request(prompt=PROMPTS[2], params=SamplingParams(max_tokens=16, temperature=0.0,
                                                                  repetition_penalty=1.3, frequency_penalty=0.5))
    victims = [greedy(PROMPTS[0], k=k), greedy(PROMPTS[1], k=k), greedy(PROMPTS[1], k=k, guided=PHONE), penalized,
               greedy(PROMPTS[2], k=k)]
    alone = [run_alone(engine, r) for r in victims]
    assert not recoveries
    bad = greedy(PROMPTS[1], k=k, fault="step_error")
    got = run_together(engine, victims[:2] + [bad] + victims[2:])  # the culprit mid-batch
    culprit = got.pop(2)
    for (ids, text, last), (a_ids, a_text, a_last) in zip(got, alone):
        assert (ids, text, last.finish_reason) == (a_ids, a_text, a_last.finish_reason)
    ids, _, last = culprit
    assert last.finish_reason == "error" and last.error_code == "INTERNAL", last
    assert "decode failed (injected step fault" in last.error and len(ids) == 1  # its prefill token was fine
    assert max(recoveries) >= 3, recoveries  # it failed in a batch with others, which were run apart
    assert_clean(engine)


def test_an_out_of_vocabulary_bad_word_past_intake_fails_only_its_request(engine, recoveries, monkeypatch):
    """The measured case: a bad word [first token, 999999] beside running streams made the batched
    step raise IndexError (the ban's index past the vocabulary) and ended every stream of the batch.
    Intake refuses such ids; here they are put in after it, as a check it lacked would let them."""
    victims = [greedy(p, k=3) for p in PROMPTS]
    alone = [run_alone(engine, r) for r in victims]
    first = alone[1][0][0]  # the culprit's prompt is PROMPTS[1]: its first token starts the bad word
    assert 999999 >= engine.core.runner.vocab_size
    make = engine.core.intake.sequence

    def past_intake(request, callback):
        seq = make(request, callback)
        if seq.params.bad_words_ids:
            seq.params.bad_words_ids = [[first, 999999]]
        return seq

    monkeypatch.setattr(engine.core.intake, "sequence", past_intake)
    bad = Request(prompt=PROMPTS[1], params=SamplingParams(max_tokens=16, temperature=0.0, bad_words_ids=[[first, 1]]))
    got = run_together(engine, [victims[0], bad, victims[1], victims[2]])
    ids, _, last = got.pop(1)
    for (ids_, text, _), (a_ids, a_text, _) in zip(got, alone):
        assert (ids_, text) == (a_ids, a_text)
    assert last.finish_reason == "error" and "decode failed (IndexError" in last.error and ids == [first], last
    assert max(recoveries) >= 2, recoveries
    assert_clean(engine)


def test_the_engine_sets_the_gil_switch_interval_it_is_configured_with(engine):
    """Every torch op and kernel call releases the GIL; while another Python thread is busy, the loop
    thread waits the interpreter's switch interval to take it back (5 ms by default: a step 10-160x
    slower, bench/bench_gil_contention.py). The served engine sets it to gil_switch_interval_ms."""
    assert engine.config.gil_switch_interval_ms > 0
    assert sys.getswitchinterval() == pytest.approx(engine.config.gil_switch_interval_ms / 1e3)
    assert sys.getswitchinterval() < 0.005


def test_faults_are_ignored_unless_enabled(engine, monkeypatch):
    monkeypatch.delenv(faults.ENV)
    ids, _, last = run_alone(engine, greedy(PROMPTS[1], fault="nan_logits"))
    assert last.finish_reason == "length" and len(ids) == 16


# ------------------------------------------------------------- one slot: queue, cancel, time limits


@pytest.fixture(scope="module")
def small():
    eng = Engine(EngineConfig(max_slots=1, max_queue=2, max_seq_len=1024, prefill_chunk=16, warmup=False))
    yield eng
    eng.shutdown(drain=False)


def submit(engine: Engine, request: Request) -> tuple[int, queue.Queue]:
    q: queue.Queue = queue.Queue()
    return engine.submit(request, q.put), q


def final(q: queue.Queue):
    while True:
        out = q.get(timeout=120)
        if out.finished:
            return out


def wait_first_event(q: queue.Queue):
    out = q.get(timeout=120)
    assert not out.finished, out
    return out


def test_a_full_queue_refuses_at_once(small):
    busy, qb = submit(small, greedy(PROMPTS[1], n=400))
    wait_first_event(qb)  # running: the queue is empty
    waiting = [submit(small, greedy(PROMPTS[2], n=4)) for _ in range(2)]
    with pytest.raises(QueueFullError):
        small.submit(greedy(PROMPTS[2], n=4))
    for sid, _ in [(busy, qb)] + waiting:
        small.cancel(sid)
    assert final(qb).finish_reason == "cancelled"
    assert [final(q).stage for _, q in waiting] == ["queued", "queued"]
    assert_clean(small)


def test_cancel_at_every_stage_frees_everything(small, tmp_path):
    stages = {}
    # decoding
    sid, q = submit(small, greedy(PROMPTS[1], n=400))
    wait_first_event(q)
    # queued behind it
    sid_q, qq = submit(small, greedy(PROMPTS[2], n=4))
    time.sleep(0.05)
    small.cancel(sid_q)
    stages["queued"] = final(qq)
    small.cancel(sid)
    stages["decode"] = final(q)
    # compiling (the compile is held for 30 s)
    sid, q = submit(small, greedy(PROMPTS[1], guided=PHONE, fault="compile_delay:30"))
    time.sleep(0.1)
    small.cancel(sid)
    stages["compiling"] = final(q)
    # prefill (a long prompt in 16-token chunks, each held 0.2 s)
    sid, q = submit(small, greedy("word " * 300, guided=PHONE, fault="prefill_delay:0.2"))
    time.sleep(0.5)
    small.cancel(sid)
    stages["prefill"] = final(q)
    for stage, out in stages.items():
        assert out.finish_reason == "cancelled" and out.stage == stage, (stage, out)
    assert_clean(small)
    ids, _, last = run_alone(small, greedy(PROMPTS[1], n=8, guided=PHONE))
    assert last.finish_reason == "length" and len(ids) == 8


def test_time_limit_ends_with_timeout_and_keeps_the_text(small):
    # the counting prompt runs to max_tokens (no EOS): 200 tokens take seconds, well past the limit
    full_ids, full_text, _ = run_alone(small, greedy(PROMPTS[0], n=200, k=0))
    assert len(full_ids) == 200
    sid, q = submit(small, greedy(PROMPTS[0], n=200, k=0, timeout_s=0.5))
    waiting_id, wq = submit(small, greedy(PROMPTS[2], n=4, timeout_s=0.2))  # queued behind it
    outs = []
    while not (outs and outs[-1].finished):
        outs.append(q.get(timeout=60))
    ids = [t for o in outs for t in o.token_ids]
    assert outs[-1].finish_reason == "timeout" and outs[-1].error is None
    assert 0 < len(ids) < 200 and ids == full_ids[: len(ids)]
    assert full_text.startswith("".join(o.text for o in outs))
    w = final(wq)
    assert w.finish_reason == "timeout" and w.stage == "queued" and not w.token_ids
    assert_clean(small)


def test_a_crashed_loop_fails_everything_with_unavailable_and_refuses_new_requests(small):
    running, qr = submit(small, greedy(PROMPTS[1], n=400))
    wait_first_event(qr)
    queued, qq = submit(small, greedy(PROMPTS[2], n=4))
    _, qc = submit(small, greedy(PROMPTS[2], n=4, fault="crash_engine"))
    for q in (qr, qq, qc):
        out = final(q)
        assert out.finish_reason == "error" and out.error_code == "UNAVAILABLE" and "engine stopped" in out.error
    assert not small.is_alive() and small.stats()["alive"] == 0
    with pytest.raises(EngineDeadError):
        small.submit(greedy(PROMPTS[1], n=4))
    small.join(timeout=60)
    assert not small.is_alive() and small.failure is not None


def test_faulty_matcher_raises_everywhere():
    m = faults.FaultyMatcher()
    with pytest.raises(faults.InjectedFault):
        m.accept_token(1)
    with pytest.raises(faults.InjectedFault):
        m.is_terminated()


def test_fault_names_are_checked(monkeypatch):
    from specguide.request import InvalidRequestError

    assert faults.parse("compile_delay:1.5") == faults.Fault("compile_delay", 1.5)
    with pytest.raises(InvalidRequestError):
        faults.parse("meltdown")
    monkeypatch.delenv(faults.ENV)
    assert faults.parse("meltdown") is None
