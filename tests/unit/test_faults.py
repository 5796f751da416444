"""faults.Injector: does nothing by default; the engine's follows SPECGUIDE_FAULT_INJECTION."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from specguide.engine import faults
from specguide.request import InvalidRequestError


def seq(kind=None, seconds=0.0, **kw):
    fault = faults.Fault(kind, seconds) if kind else None
    return SimpleNamespace(fault=fault, output_ids=[1], stats=SimpleNamespace(arrival=time.monotonic()),
                           guide=SimpleNamespace(grammar=object()), slot=0, **kw)


def test_the_default_injector_does_nothing(monkeypatch):
    monkeypatch.setenv(faults.ENV, "1")
    off = faults.Injector()
    assert not off.active and off.parse("crash_engine") is None and off.checked("meltdown") is None
    logits = torch.zeros(1, 4)
    off.poison(logits, [seq("nan_logits")])
    assert not logits.isnan().any()


def test_the_engines_injector_follows_the_environment(monkeypatch):
    inj = faults.injector()
    monkeypatch.delenv(faults.ENV, raising=False)
    assert inj.parse("nan_logits") is None
    monkeypatch.setenv(faults.ENV, "1")
    assert inj.parse("prefill_delay:0.5") == faults.Fault("prefill_delay", 0.5)
    assert inj.checked("nan_logits") == "nan_logits"
    with pytest.raises(InvalidRequestError, match="unknown fault"):
        inj.checked("meltdown")


def test_each_hook_acts_only_on_its_fault(monkeypatch):
    monkeypatch.setenv(faults.ENV, "1")
    inj = faults.injector()
    inj.on_submit(seq("nan_logits"))
    with pytest.raises(faults.InjectedFault, match="engine crash"):
        inj.on_submit(seq("crash_engine"))
    assert inj.holds_compile(seq("compile_delay", 60.0)) and not inj.holds_compile(seq("compile_delay", 0.0))
    assert not inj.holds_compile(seq())
    logits = torch.zeros(2, 3, 4)
    inj.poison(logits, [seq(), seq("nan_logits")])
    assert not logits[0].isnan().any() and logits[1].isnan().all()


def test_matcher_fault_reaches_the_decoder_inside_a_wrapper(monkeypatch):
    monkeypatch.setenv(faults.ENV, "1")
    inj = faults.injector()
    plain = SimpleNamespace(matchers=[None])
    wrapped = SimpleNamespace(inner=SimpleNamespace(matchers=[None]))
    inj.after_append(seq("matcher_error"), plain)
    inj.after_append(seq("matcher_error"), wrapped)
    assert isinstance(plain.matchers[0], faults.FaultyMatcher)
    assert isinstance(wrapped.inner.matchers[0], faults.FaultyMatcher)
    unguided = SimpleNamespace(matchers=[None])
    inj.after_append(SimpleNamespace(fault=faults.Fault("matcher_error"), guide=SimpleNamespace(grammar=None), slot=0),
                     unguided)
    assert unguided.matchers[0] is None


def test_step_error_makes_the_whole_step_raise_naming_no_request_past_the_first_token(monkeypatch):
    monkeypatch.setenv(faults.ENV, "1")
    inj = faults.injector()
    logits = torch.zeros(3, 2, 4)
    inj.poison(logits, [seq(), seq("nan_logits")])  # no step_error: nothing raised
    with pytest.raises(faults.InjectedStepError, match="injected step fault"):
        inj.poison(logits, [seq(), seq("step_error"), seq()])
    first = SimpleNamespace(fault=faults.Fault("step_error"), output_ids=[])  # its prefill: not yet
    inj.poison(logits, [first])
    monkeypatch.delenv(faults.ENV)
    inj.poison(logits, [seq("step_error")])  # injection off: nothing


def test_stall_engine_blocks_the_loop_as_it_takes_the_request(monkeypatch):
    monkeypatch.setenv(faults.ENV, "1")
    inj = faults.injector()
    assert inj.parse("stall_engine:0.2") == faults.Fault("stall_engine", 0.2)
    t0 = time.monotonic()
    inj.on_submit(seq("stall_engine", 0.2))
    assert time.monotonic() - t0 >= 0.2
    inj.on_submit(seq("step_error"))  # other faults: nothing at submit
