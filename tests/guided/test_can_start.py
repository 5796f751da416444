"""A compiled guide says whether it can start: a grammar with no way to end (rules that only refer
to each other) allows no first token, on either backend; the engine refuses such a guide with
INVALID_ARG before its first step (tests/engine/test_guided_engine.py)."""
from __future__ import annotations

import pytest

from specguide.request import GuidedDecodingParams, InvalidRequestError


@pytest.mark.parametrize("ebnf, ok", [
    ('root ::= x\nx ::= y\ny ::= x', False),  # found by the fuzz suite: answered 500 after a step
    ('root ::= "a" root | "b"', True),
    ('root ::= "yes" | "no"', True),
])
def test_a_grammar_that_cannot_end_cannot_start(service, ebnf, ok):
    try:
        guide = service.compile(GuidedDecodingParams("ebnf_grammar", ebnf))
    except Exception:  # a backend that refuses it at compile time refuses it clearly already
        assert not ok
        return
    try:
        started = guide.can_start()
    except InvalidRequestError as e:  # llguidance finds the grammar broken as its matcher starts
        assert not ok and "too complex" in str(e)
        return
    assert started is ok
    assert guide.can_start() is ok  # asked again: the answer kept
