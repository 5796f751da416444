"""Reasoning models (guided/reasoning.py) on the real SmolLM2 tokenizer, both grammar backends: the guide
waits for `</think>` in any tokenization, bans stop tokens and marker-straddling tokens before it,
and rollback / validate / fill_many / forced tokens are exact across the boundary."""
from __future__ import annotations

import json

import pytest
import torch
import xgrammar as xgr

from specguide.config import ReasoningMarkers
from specguide.guided import GuidedDecoder
from specguide.guided.reasoning import Reasoning, ReasoningMatcher
from specguide.request import GuidedDecodingParams

from .conftest import VOCAB

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
THINK = "<|im_start|>assistant\n<think>\n"  # a template that opened the block


@pytest.fixture(scope="module")
def reasoning(hf_tokenizer):
    return Reasoning.for_tokenizer(ReasoningMarkers("<think>", "</think>"), hf_tokenizer, [hf_tokenizer.eos_token_id], VOCAB)


@pytest.fixture
def guide(service):
    return service.compile(GuidedDecodingParams("json_schema", json.dumps(SCHEMA)))


def enc(hf_tokenizer, text: str) -> list[int]:
    return hf_tokenizer.encode(text, add_special_tokens=False)


def mask(m, rows: int = 1):
    bm = xgr.allocate_token_bitmask(rows, VOCAB)
    m.fill(bm, 0)
    return bm[0]


def allowed(row: torch.Tensor, t: int) -> bool:
    return bool(int(row[t // 32]) >> (t % 32) & 1)


def test_the_guide_applies_only_after_the_end_marker(hf_tokenizer, reasoning, guide):
    eos = hf_tokenizer.eos_token_id
    wrapped = reasoning.wrap(guide, enc(hf_tokenizer, THINK))
    m = wrapped.matcher()
    assert isinstance(m, ReasoningMatcher)
    thought = enc(hf_tokenizer, "The user wants a JSON object; a is 7.")
    assert not guide.matcher().accept(thought[0])  # the guide alone refuses free text
    assert allowed(mask(m), thought[0]) and not allowed(mask(m), eos)
    assert not m.accept(eos) and m.forced_tokens(lambda s: enc(hf_tokenizer, s), 4) == []
    assert all(m.accept(t) for t in thought) and not m.is_completed() and not m.is_terminated()
    assert all(m.accept(t) for t in enc(hf_tokenizer, "</think>"))
    assert m.ended and torch.equal(mask(m), mask(guide.matcher()))  # from here, the guide's mask
    assert not m.accept(enc(hf_tokenizer, "The")[0])
    assert all(m.accept(t) for t in enc(hf_tokenizer, '{"a": 7}')) and m.is_completed()
    assert m.accept(eos) and m.is_terminated()


@pytest.mark.parametrize("spelling", [["</", "think", ">"], [" </", "think", ">"], list("</think>")])
def test_any_tokenization_of_the_marker_ends_the_block(hf_tokenizer, reasoning, guide, spelling):
    m = reasoning.wrap(guide, enc(hf_tokenizer, THINK)).matcher()
    toks = [enc(hf_tokenizer, piece) for piece in spelling]
    assert all(len(t) == 1 for t in toks), toks  # one token per piece
    for t in toks[:-1]:
        assert m.accept(t[0]) and not m.ended
    assert m.accept(toks[-1][0]) and m.ended


def test_a_token_that_goes_on_past_the_marker_is_refused(hf_tokenizer, reasoning, guide):
    """`>,` after `</think` would put the guide's start inside a token: masked and refused; `>` is fine."""
    m = reasoning.wrap(guide, enc(hf_tokenizer, THINK)).matcher()
    assert all(m.accept(t) for t in enc(hf_tokenizer, "ok </think"))
    straddle, close = enc(hf_tokenizer, ">,"), enc(hf_tokenizer, ">")
    assert len(straddle) == 1 and not allowed(mask(m), straddle[0]) and not m.accept(straddle[0])
    assert allowed(mask(m), close[0]) and m.accept(close[0]) and m.ended


def test_rollback_and_validate_across_the_boundary(hf_tokenizer, reasoning, guide):
    """Every rollback of a run that spans the marker (a draft window holding `</think>`) leaves the
    matcher equal to a fresh one fed the kept tokens: same phase, completion and mask."""
    wrapped = reasoning.wrap(guide, enc(hf_tokenizer, THINK))
    run = enc(hf_tokenizer, "So a=1.</think>") + enc(hf_tokenizer, '{"a": 1}') + [hf_tokenizer.eos_token_id]
    for n in range(len(run) + 1):
        m = wrapped.matcher()
        assert all(m.accept(t) for t in run) and m.is_terminated()
        m.rollback(n)
        fresh = wrapped.matcher()
        assert all(fresh.accept(t) for t in run[: len(run) - n])
        assert (m.ended, m.is_completed(), m.is_terminated()) == (fresh.ended, fresh.is_completed(), fresh.is_terminated())
        if not m.is_terminated():
            assert torch.equal(mask(m), mask(fresh)), n
        assert m.validate(run[len(run) - n:]) == n  # the rolled-back tokens are valid again, state unchanged
        assert m.is_terminated() or torch.equal(mask(m), mask(fresh))
    m = wrapped.matcher()
    bad = enc(hf_tokenizer, "x</think>") + enc(hf_tokenizer, "nope")
    assert m.validate(bad) == len(bad) - len(enc(hf_tokenizer, "nope")) and not m.ended
    m.accept(run[0])
    m.reset()
    assert not m.think and not m.ended


def test_the_prompt_decides_where_the_block_stands(hf_tokenizer, reasoning, guide):
    closed = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # a template with thinking off
    history = "<|im_start|>assistant\n<think>x</think>hi<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
    assert reasoning.wrap(guide, enc(hf_tokenizer, closed)) is guide  # guided from the first token
    for prompt in (THINK, history, "Plain prompt"):
        assert isinstance(reasoning.wrap(guide, enc(hf_tokenizer, prompt)).matcher(), ReasoningMatcher)
    m = reasoning.wrap(guide, enc(hf_tokenizer, "Thinking... </")).matcher()  # the marker's start is in the prompt
    assert m.accept(enc(hf_tokenizer, "think")[0]) and m.accept(enc(hf_tokenizer, ">")[0]) and m.ended


def test_fill_many_mixes_reasoning_and_guided_rows(hf_tokenizer, reasoning, guide):
    """The decoder's batched fill (one call per matcher type) equals each matcher's own fill."""
    wrapped = reasoning.wrap(guide, enc(hf_tokenizer, THINK))
    dec = GuidedDecoder(3, 0, VOCAB)
    fed = [enc(hf_tokenizer, text) for text in ["thinking", "done</think>", 'done</think>{"a": ']]
    for s, ids in enumerate(fed):
        dec.add(s, wrapped)
        assert dec.advance_many(s, ids) == len(ids)
    dec.fill([(0, 0), (1, 0), (2, 0)])
    for s in range(3):
        assert torch.equal(dec.bitmask[s], mask(dec.matchers[s])), s
        assert dec.check_fresh(s, fed[s]) is None
    assert torch.equal(dec.bitmask[1], mask(guide.matcher()))


def test_verification_rows_across_the_boundary(hf_tokenizer, reasoning, guide):
    """A verification step whose drafts hold the marker: rows before it are free text, the row after
    it is the guide's; rejecting drafts from before the marker on rolls back across it exactly."""
    wrapped = reasoning.wrap(guide, enc(hf_tokenizer, THINK))
    drafts = enc(hf_tokenizer, "1.</think>") + enc(hf_tokenizer, '{"')
    marker_end = len(enc(hf_tokenizer, "1.</think>"))
    dec = GuidedDecoder(1, len(drafts), VOCAB)
    for accepted in range(len(drafts) + 1):
        dec.add(0, wrapped)
        dec.advance_many(0, enc(hf_tokenizer, "So a="))
        assert dec.fill_verify_rows({0: drafts}) == {0: len(drafts)}
        assert torch.equal(dec.bitmask[marker_end], mask(guide.matcher()))  # the first guided position
        assert allowed(dec.bitmask[0], drafts[0]) and not allowed(dec.bitmask[0], hf_tokenizer.eos_token_id)
        dec.rollback(0, len(drafts) - accepted)
        held = enc(hf_tokenizer, "So a=") + drafts[:accepted]
        assert dec.matchers[0].ended == (accepted >= marker_end) and dec.check_fresh(0, held) is None
        dec.remove(0)


def test_a_value_checked_guide_is_checked_after_the_marker(hf_tokenizer, reasoning, service):
    """The wrapped guide may itself be a wrapper (ValueCheckedMatcher): its value check sees only the
    answer, and its bans come through the batched fill."""
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    guide = service.compile(GuidedDecodingParams("json_schema", json.dumps(schema)))
    eos = hf_tokenizer.eos_token_id
    dec = GuidedDecoder(1, 0, VOCAB)
    dec.add(0, reasoning.wrap(guide, enc(hf_tokenizer, THINK)))
    assert dec.advance_many(0, enc(hf_tokenizer, "[1, 1] is fine.</think>")) == len(enc(hf_tokenizer, "[1, 1] is fine.</think>"))
    head, close = enc(hf_tokenizer, "[1, 1"), enc(hf_tokenizer, "]")[0]
    assert dec.violation(0) is None and dec.advance_many(0, head) == len(head)
    dec.fill([(0, 0)])
    assert not allowed(dec.bitmask[0], close) and not dec.advance(0, close)  # the closing `]` is checked
    assert "non-unique" in dec.violation(0)
    assert not allowed(dec.bitmask[0], eos) and not dec.advance(0, eos)
