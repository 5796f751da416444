"""A guide whose grammar allows no first token (no way to end: rules that only refer to each other)
is refused by the compile, on either backend, before any request holds it; the engine answers it
with INVALID_ARG before its first step (tests/engine/test_guided_engine.py)."""
from __future__ import annotations

import pytest

from specguide.request import GuidedDecodingParams, InvalidRequestError


@pytest.mark.parametrize("ebnf, ok", [
    ('root ::= x\nx ::= y\ny ::= x', False),  # found by the fuzz suite: answered 500 after a step
    ('root ::= "a" root | "b"', True),
    ('root ::= "yes" | "no"', True),
])
def test_a_grammar_that_cannot_end_is_refused_by_the_compile(service, ebnf, ok):
    params = GuidedDecodingParams("ebnf_grammar", ebnf)
    if ok:
        assert service.compile(params).can_start()
    else:  # xgrammar: an empty first mask; llguidance finds the grammar broken as its matcher starts
        with pytest.raises(InvalidRequestError, match="allows no first token|too complex"):
            service.compile(params)


def test_can_start_reads_the_first_mask(xgr_service):
    good = xgr_service.compile(GuidedDecodingParams("ebnf_grammar", 'root ::= "yes"'))
    assert good.can_start()
    backend = xgr_service.backends["xgrammar"]  # the backend alone: no refusal in the way
    assert not backend.compile(GuidedDecodingParams("ebnf_grammar", "root ::= x\nx ::= y\ny ::= x")).can_start()
