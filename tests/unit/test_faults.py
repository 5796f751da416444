"""faults: names checked; a FaultInjector wraps a core's parts while installed, acts only on the
requests that name its faults, only while the environment enables injection, and `remove` leaves the
parts as they were. (The engine tests run every fault through a real engine: test_reliability.py.)"""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from specguide.engine import faults
from specguide.request import InvalidRequestError


class Part:
    """A stand-in for one of the core's parts: a method that records its calls."""

    def __init__(self, name: str, result=None):
        self.calls: list = []
        self._result = result
        self.name = name

    def call(self, *args):
        self.calls.append(args)
        return self._result(*args) if callable(self._result) else self._result


def core():
    """The parts FaultInjector wraps, each method a recording `Part.call`."""
    parts = {n: Part(n) for n in ("sequence", "poll_compiles", "add", "finish", "prefill", "step", "logits", "append")}
    parts["sequence"]._result = lambda request, cb: SimpleNamespace(seq_id=request.seq_id)
    parts["poll_compiles"]._result = lambda waiting: list(waiting)
    parts["logits"]._result = lambda key, hidden: torch.zeros(len(hidden), 2, 4)
    ns = SimpleNamespace
    matchers = [None, None]
    c = ns(intake=ns(sequence=parts["sequence"].call, poll_compiles=parts["poll_compiles"].call),
           add=parts["add"].call, finish=parts["finish"].call,
           runner=ns(prefill=parts["prefill"].call, step=parts["step"].call, core=ns(logits=parts["logits"].call)),
           outputs=ns(append=parts["append"].call),
           guided=ns(synchronize=lambda: None, inner=ns(matchers=matchers)))
    return c, parts


def request(seq_id: int, fault=None):
    return SimpleNamespace(seq_id=seq_id, fault=fault)


def seq(seq_id: int, output_ids=(1,), slot=0, grammar=True):
    return SimpleNamespace(seq_id=seq_id, output_ids=list(output_ids), slot=slot,
                           stats=SimpleNamespace(arrival=time.monotonic()),
                           guide=SimpleNamespace(grammar=object() if grammar else None))


def test_fault_names_are_checked_only_while_enabled(monkeypatch):
    monkeypatch.delenv(faults.ENV, raising=False)
    assert faults.parse("meltdown") is None and faults.checked("nan_logits") is None
    monkeypatch.setenv(faults.ENV, "1")
    assert faults.parse("prefill_delay:0.5") == faults.Fault("prefill_delay", 0.5)
    assert faults.checked("nan_logits") == "nan_logits"
    with pytest.raises(InvalidRequestError, match="unknown fault"):
        faults.checked("meltdown")
    with pytest.raises(InvalidRequestError, match="bad seconds"):
        faults.parse("compile_delay:soon")


def test_install_wraps_and_remove_restores_every_part():
    c, _ = core()
    before = (c.intake.sequence, c.add, c.runner.step, c.runner.core.logits, c.outputs.append)
    inj = faults.FaultInjector(c).install()
    assert c.add is not before[1] and c.runner.core.logits is not before[3]
    inj.remove()
    assert (c.intake.sequence, c.add, c.runner.step, c.runner.core.logits, c.outputs.append) == before


def test_a_request_gets_its_fault_only_while_injection_is_on(monkeypatch):
    c, parts = core()
    inj = faults.FaultInjector(c).install()
    monkeypatch.delenv(faults.ENV, raising=False)
    c.intake.sequence(request(1, "crash_engine"), None)
    c.add(seq(1))  # off as it arrived: no fault
    monkeypatch.setenv(faults.ENV, "1")
    c.intake.sequence(request(2, "crash_engine"), None)
    with pytest.raises(faults.InjectedFault, match="engine crash"):
        c.add(seq(2))
    with pytest.raises(InvalidRequestError, match="unknown fault"):
        c.intake.sequence(request(3, "meltdown"), None)
    assert [a[0].seq_id for a in parts["add"].calls] == [1, 2]  # taken, then the loop raises
    c.finish(seq(2), "error")  # its fault goes with it
    assert inj.faults == {}


def test_each_hook_acts_only_on_its_fault(monkeypatch):
    monkeypatch.setenv(faults.ENV, "1")
    c, parts = core()
    inj = faults.FaultInjector(c).install()
    for i, f in enumerate(["compile_delay:60", "compile_delay:0", None, "nan_logits", "matcher_error"], start=1):
        c.intake.sequence(request(i, f), None)
    waiting = [seq(1), seq(2), seq(3)]
    assert [s.seq_id for s in c.intake.poll_compiles(waiting)] == [2, 3]  # 1 is held back
    logits = c.runner.step([seq(3), seq(4)], None) or c.runner.core.logits(None, [0, 0])  # outside a step: no batch
    assert not logits.isnan().any()
    parts["step"]._result = lambda seqs, plan: c.runner.core.logits(None, [0] * len(seqs))
    out = c.runner.step([seq(3), seq(4), seq(4, output_ids=())], None)
    assert not out[0].isnan().any() and out[1].isnan().all() and not out[2].isnan().any()  # past its first token
    c.outputs.append(seq(4, slot=1), [5])
    c.outputs.append(seq(5, slot=1, grammar=False), [5])  # unguided: no matcher to break
    assert c.guided.inner.matchers == [None, None]
    c.outputs.append(seq(5, slot=1), [5])
    assert c.guided.inner.matchers[0] is None and isinstance(c.guided.inner.matchers[1], faults.FaultyMatcher)
    parts["append"]._result = ("stop", None, None)  # the request ended: nothing to break
    c.guided.inner.matchers[1] = None
    c.outputs.append(seq(5, slot=1), [5])
    assert c.guided.inner.matchers[1] is None
    inj.remove()


def test_step_error_makes_the_whole_step_raise_naming_no_request_past_the_first_token(monkeypatch):
    monkeypatch.setenv(faults.ENV, "1")
    c, parts = core()
    faults.FaultInjector(c).install()
    c.intake.sequence(request(7, "step_error"), None)
    parts["step"]._result = lambda seqs, plan: c.runner.core.logits(None, [0] * len(seqs))
    c.runner.step([seq(1), seq(7, output_ids=())], None)  # its prefill's token only: not yet
    with pytest.raises(faults.InjectedStepError, match="injected step fault") as raised:
        c.runner.step([seq(1), seq(7), seq(2)], None)
    assert raised.value.client_readable


def test_delays_sleep_before_the_wrapped_call(monkeypatch):
    monkeypatch.setenv(faults.ENV, "1")
    c, parts = core()
    faults.FaultInjector(c).install()
    slept = []
    monkeypatch.setattr(faults.time, "sleep", slept.append)
    c.intake.sequence(request(1, "prefill_delay:0.25"), None)
    c.intake.sequence(request(2, "stall_engine:3"), None)
    c.runner.prefill(SimpleNamespace(seq=seq(1)))
    c.runner.prefill(SimpleNamespace(seq=seq(3)))
    c.add(seq(2))
    assert slept == [0.25, 3.0] and len(parts["prefill"].calls) == 2 and len(parts["add"].calls) == 1


def test_faulty_matcher_raises_everywhere():
    m = faults.FaultyMatcher()
    with pytest.raises(faults.InjectedFault):
        m.accept_token(1)
    with pytest.raises(faults.InjectedFault):
        m.fill_next_token_bitmask(None)
