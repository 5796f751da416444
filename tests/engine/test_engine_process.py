"""EngineProcess: the engine in a process of its own, restarted when it dies (the real default model).

Its death (SIGKILL, as the OOM killer sends; or its loop thread failing) must end every request
it held, running and queued, with UNAVAILABLE naming the cause at once; refuse new requests
while down; and bring a new engine that answers as the old one did. Repeated crashes back off."""
from __future__ import annotations

import os
import signal
from dataclasses import replace
import threading
import time

import pytest

from specguide.engine import faults

from specguide.process import ipc, restarts
from specguide.config import CPU_SLOTS, EngineConfig
from specguide.process.engine_process import EngineProcess
from specguide.process.engine_protocol import describe_exit
from specguide.process.restarts import backoff_s
from specguide.request import EngineDeadError, InvalidRequestError, Request, RequestOutput, SamplingParams

from .conftest import thread_nices

PROMPT = "<|im_start|>user\nTell me a long story about the sea.<|im_end|>\n<|im_start|>assistant\n"


class Collector:
    def __init__(self):
        self.outs: list[RequestOutput] = []
        self.done = threading.Event()
        self.t_done = 0.0

    def __call__(self, out: RequestOutput) -> None:
        self.outs.append(out)
        if out.finished:
            self.t_done = time.monotonic()
            self.done.set()

    @property
    def last(self) -> RequestOutput:
        assert self.done.wait(120), "no final event"
        return self.outs[-1]

    def ids(self) -> list[int]:
        assert self.last.error is None, self.last.error
        return [t for o in self.outs for t in o.token_ids]


@pytest.fixture(scope="module")
def engine():
    os.environ[faults.ENV] = "1"  # every engine process (restarts too) inherits it: the crash_engine fault below
    try:
        ep = EngineProcess(EngineConfig(max_slots=1, max_queue=4, warmup=False))
        yield ep
        ep.shutdown(drain=False, timeout=10)
    finally:
        del os.environ[faults.ENV]


def request(ep: EngineProcess, max_tokens: int, fault: str | None = None) -> Request:
    return Request(prompt_ids=ep.tokenizer.encode(PROMPT), params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
                   fault=fault)


def wait_alive(ep: EngineProcess, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not ep.is_alive():
        assert time.monotonic() < deadline, f"the engine is still down: {ep.down_reason()}"
        time.sleep(0.05)


def test_requests_run_through_the_engine_process_and_errors_come_back_as_raised(engine):
    c = Collector()
    engine.submit(request(engine, 8), c)
    assert len(c.ids()) == 8 and c.last.finish_reason == "length" and c.last.seq_id > 0
    with pytest.raises(InvalidRequestError):  # the engine's own refusal, raised here
        engine.submit(Request(prompt_ids=[], params=SamplingParams(max_tokens=4)), Collector())
    assert engine.pid != os.getpid() and engine.stats()["alive"] == 1


def test_the_text_is_made_in_the_stub_and_a_stop_string_there_ends_the_request_in_the_engine(engine, monkeypatch):
    """Only token ids cross the pipe; the stub's TextStream makes the text, finds the stop string,
    ends the request for its client at once and asks the engine to stop: the request ends there too
    ("stop", its slot free for the next one)."""
    raw: list[RequestOutput] = []
    deliver = engine._deliver
    monkeypatch.setattr(engine, "_deliver", lambda key, out: (raw.append(replace(out)), deliver(key, out)))
    c = Collector()
    engine.submit(request(engine, 24), c)
    ids, full = c.ids(), "".join(o.text for o in c.outs)
    assert full == engine.tokenizer.decode(ids) and all(o.text == "" for o in raw)
    word = full.split()[4]
    stopped = Collector()
    engine.submit(Request(prompt_ids=engine.tokenizer.encode(PROMPT), params=SamplingParams(
        max_tokens=400, temperature=0.0, ignore_eos=True, stop=[word])), stopped)
    final = stopped.last
    assert final.finish_reason == "stop" and "".join(o.text for o in stopped.outs) == full[:full.find(word)]
    got = [t for o in stopped.outs for t in o.token_ids]
    assert got == ids[:len(got)] and final.num_output_tokens == len(got) < 24
    deadline = time.monotonic() + 60  # the client's final went out at once; the engine ends the request after
    while not (raw[-1].finished and raw[-1].seq_id == final.seq_id) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert raw[-1].finished and raw[-1].finish_reason == "stop"  # the engine's own ending, not a cancel
    assert sum(o.finished for o in stopped.outs) == 1 and all(o.text == "" for o in raw)
    after = Collector()  # one slot: the stopped request left it
    engine.submit(request(engine, 4), after)
    assert len(after.ids()) == 4


def test_the_engine_freezes_its_start_up_heap(engine):
    """torch, transformers and the model: walked by no full collection while every stream waits (heap.py)."""
    assert engine.frozen_objects > 100000


def test_a_terminals_ctrl_c_leaves_the_engine_to_the_servers_shutdown(engine):
    """`make serve` stopped with Ctrl-C: SIGINT reaches the engine process too (the stub's process group).
    It must not die of it (its stub would restart it in the middle of the server's shutdown)."""
    wait_alive(engine)
    pid, restarts = engine.pid, engine.restarts
    os.kill(pid, signal.SIGINT)
    time.sleep(1.0)
    c = Collector()
    engine.submit(request(engine, 4), c)
    assert len(c.ids()) == 4
    assert engine.pid == pid and engine.restarts == restarts and ipc.process_identity(pid) is not None


def test_every_thread_of_the_engine_process_runs_engine_nice_nicer_than_its_parent(engine):
    """So that the server's front ends, stubs and the OpenAI server preempt it as soon as they wake."""
    assert engine.config.engine_nice == EngineConfig().engine_nice > 0  # the default, served
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    assert len(os.listdir(f"/proc/{engine.pid}/task")) > 2  # the loop, the reader, the kernels' workers ...
    assert thread_nices(engine.pid) == {min(19, ours + engine.config.engine_nice)}


def test_a_killed_engine_fails_running_and_queued_requests_at_once_and_comes_back(engine):
    reference = Collector()
    engine.submit(request(engine, 12), reference)
    reference = reference.ids()
    restarts, old = engine.restarts, engine.pid
    running, queued = Collector(), [Collector(), Collector()]
    engine.submit(request(engine, 2000), running)
    for q in queued:  # one slot: these wait in the engine's queue
        engine.submit(request(engine, 8), q)
    deadline = time.monotonic() + 60
    while not running.outs:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    t_kill = time.monotonic()
    os.kill(engine.pid, signal.SIGKILL)
    for c in [running, *queued]:
        last = c.last
        assert last.finish_reason == "error" and last.error_code == "UNAVAILABLE", last
        assert "killed by SIGKILL" in last.error and c.t_done - t_kill < 2.0, (last.error, c.t_done - t_kill)
    assert not engine.is_alive() and engine.stats()["alive"] == 0
    with pytest.raises(EngineDeadError, match="killed by SIGKILL.*a new engine is starting"):
        engine.submit(request(engine, 4), Collector())
    wait_alive(engine)
    assert engine.restarts == restarts + 1 and engine.pid != old
    again = Collector()
    engine.submit(request(engine, 12), again)
    assert again.ids() == reference  # greedy: the new engine answers as the old one did


def test_a_dying_engine_loop_ends_its_process_and_a_new_engine_starts(engine):
    restarts = engine.restarts
    running, crash = Collector(), Collector()
    engine.submit(request(engine, 2000), running)
    engine.submit(request(engine, 4, fault="crash_engine"), crash)  # the loop raises at its turn
    for c in (running, crash):
        assert c.last.error_code == "UNAVAILABLE" and "engine stopped" in c.last.error, c.last
    deadline = time.monotonic() + 120  # its requests are told before the process ends: wait for the restart
    while engine.restarts == restarts:
        assert time.monotonic() < deadline, "no restart"
        time.sleep(0.05)
    wait_alive(engine)
    assert engine.restarts == restarts + 1
    after = Collector()
    engine.submit(request(engine, 4), after)
    assert len(after.ids()) == 4


def test_the_stub_side_tokenizer_needs_no_transformers_and_agrees_with_the_engines(engine):
    from specguide.tokenizer import Tokenizer, TokenizerFile, probe

    assert isinstance(engine.tokenizer, TokenizerFile)  # tokenizers alone: the stub stays small
    full = Tokenizer(engine.info.model_dir)
    text = "Grüße aus Köln 🙂 — \"quoted\" <|im_end|>"
    assert engine.tokenizer.encode(text) == full.encode(text) and engine.tokenizer.decode(full.encode(text)) == \
        full.decode(full.encode(text))
    reference = probe(full)
    assert engine.tokenizer.matches(reference)
    text, (ids, back) = next(iter(reference.items()))
    assert not engine.tokenizer.matches({text: (ids[:-1], back)})  # a model where they differ keeps transformers'


def test_repeated_crashes_back_off():
    assert [backoff_s(n) for n in range(1, 10)] == [0, 1, 2, 4, 8, 16, 32, 60, 60]
    assert "killed by SIGKILL" in describe_exit(-signal.SIGKILL) and "OOM" in describe_exit(-signal.SIGKILL)
    assert describe_exit(-signal.SIGSEGV) == "the engine process was killed by SIGSEGV"
    assert describe_exit(3, "the engine loop failed") == "the engine loop failed"


def test_crashes_in_a_row_count_up_and_a_stable_engine_counts_from_one(engine, monkeypatch):
    assert engine._backoff.failures >= 1  # the two crashes above came less than STABLE_S apart
    monkeypatch.setattr(restarts, "STABLE_S", 0.0)  # as if the engine had run for a long time
    os.kill(engine.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while engine.is_alive():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert engine._backoff.failures == 1  # restarted at once, not after a back-off
    wait_alive(engine)


def test_shutdown_drains_then_stops_the_engine_process():
    ep = EngineProcess(EngineConfig(device="auto", max_slots=0, warmup=False))
    assert ep.config.max_slots == (CPU_SLOTS if ep.config.resolved_device() == "cpu" else ep.config.max_slots) > 0
    c = Collector()
    ep.submit(request(ep, 16), c)
    pid = ep.pid
    ep.shutdown(drain=True, timeout=60)
    assert c.last.finish_reason == "length" and len(c.ids()) == 16
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    with pytest.raises(EngineDeadError):
        ep.submit(request(ep, 2), Collector())


@pytest.mark.parametrize("training", ["background", "off"])
def test_a_missing_draft_head_is_trained_beside_the_engine_and_stopped_with_it(tmp_path, training):
    """The engine awaits the head file; with draft_head_training "background" the EngineProcess
    starts its training (head_training.BackgroundTraining), which ends with shutdown."""
    head = tmp_path / "head.pt"
    ep = EngineProcess(EngineConfig(drafter="hybrid", draft_head_path=str(head), draft_head_training=training,
                                    max_slots=1, warmup=False))
    try:
        assert ep.info.awaited_head == str(head) and ep.drafter == "grammar" and not ep.head_drafter
        c = Collector()
        ep.submit(request(ep, 8), c)  # served meanwhile
        assert c.done.wait(120) and len(c.ids()) == 8
        if training == "off":
            assert ep.training is None
            return
        assert ep.training is not None and ep.training.running
        pid = ep.training.proc.pid
    finally:
        ep.shutdown(drain=False, timeout=10)
    assert ep.training.returncode is not None and not head.exists()
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
