"""Token after token of a free string the budget's completion does not change: BudgetMatcher takes
the latest plain-string state's completions (Scanner.plain_end / extends) instead of computing them
again, and every text and growth it takes so is the one a fresh scanner computes."""
from __future__ import annotations

import json
import random

import pytest

from specguide.guided.budget import BudgetMatcher, within_budget
from specguide.guided.json_scanner import Scanner, State
from specguide.guided.regex_completion import Unknown
from specguide.guided.schema_completion import Schemas
from specguide.request import GuidedDecodingParams as G

from .test_budget import CASES, PERSON

FREE = {"type": "object", "properties": {
    "text": {"type": "string"}, "code": {"type": "string", "pattern": "^[a-z]+$"},
    "id": {"type": "string", "minLength": 12}, "kind": {"enum": ["alpha", "beta"]},
    "at": {"type": "string", "format": "date"}, "items": {"type": "array", "items": {"type": "string"}}},
    "required": ["text", "id"]}
FREE_DOC = ('{"text": "caf\u00e9 \u2014 na\u00efve \\"quoted\\" \\u00e9t\u00e9 \\\\ tab\\t and \U0001F600 plain words here", '
            '"code": "abc", "id": "0123456789abcdef", "kind": "beta", "at": "2024-01-02", '
            '"items": ["one two", "thr\u00e9e \\n four", ""]}')
PLAIN_DOC = ('{"text": "' + " ".join(["the quick brown fox jumps over the lazy dog"] * 8)
             + '", "id": "0123456789abcdef"}')
DOCS = [(schema, doc) for schema, doc in CASES] + [(FREE, FREE_DOC)]


def _fresh(schema, st) -> tuple:
    """(completions, growth) of `st` by a new scanner, as BudgetMatcher reads them (None, 0: cannot tell)."""
    if st is None:
        return None, 0
    sc = Scanner(Schemas(schema))
    out = []
    for fn, unknown in ((sc.completions, None), (sc.growth, 0)):
        try:
            out.append(fn(st))
        except Unknown:
            out.append(unknown)
    return tuple(out)


@pytest.mark.parametrize("schema, doc", DOCS)
def test_a_plain_string_state_keeps_its_completion_and_growth_over_whatever_extends_it(schema, doc):
    """Fed in random chunks (multi-byte characters cut in two, escapes, quotes): wherever a state is
    plain_end and a later one extends it, the later one is plain_end too and a fresh scanner gives
    it the same completions and growth."""
    data = doc.encode()
    rng = random.Random(len(data))
    for _ in range(8):
        sc = Scanner(Schemas(schema))
        states, i = [State()], 0
        while i < len(data):
            n = rng.randint(1, 6)
            states.append(sc.feed(states[-1], data[i: i + n]))
            i += n
        for a in range(len(states)):
            if not sc.plain_end(states[a]):
                continue
            assert _fresh(schema, states[a])[0] is not None
            for b in range(a + 1, len(states)):
                if sc.extends(states[a], states[b]):
                    assert sc.plain_end(states[b]), (data, a, b)
                    assert _fresh(schema, states[b]) == _fresh(schema, states[a]), (states[a], states[b])


def test_only_plain_strings_are_plain_ends():
    sc = Scanner(Schemas(FREE))
    st = sc.feed(State(), b'{"text": "abc')
    assert sc.plain_end(st)
    assert sc.extends(st, sc.feed(st, " d\u00e9f".encode()))
    assert not sc.extends(st, sc.feed(st, b'\\n'))  # an escape: computed again
    assert not sc.extends(st, sc.feed(st, '\u00e9'.encode()[:1]))  # half a character
    assert not sc.plain_end(sc.feed(st, b"\\"))  # an escape half written
    assert not sc.plain_end(sc.feed(st, '\u00e9'.encode()[:1]))
    for prefix in (b'{"text": "a", "id": "01', b'{"text": "a", "code": "ab', b'{"text": "a", "at": "20',
                   b'{"text": "a", "kind": "al', b'{"text": "a", "items": [', b'{"text": "a"'):
        assert not sc.plain_end(sc.feed(State(), prefix)), prefix
    assert sc.plain_end(sc.feed(State(), b'{"text": "a", "items": ["x'))


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_budget_matcher_texts_are_a_fresh_scanners_through_rollbacks(xgr_service, hf_tokenizer, backend):
    """A BudgetMatcher fed a document's tokens, with drafts taken back and fed again as a step does,
    holds at every state the completions and growth a fresh scanner computes, and takes its free
    string's texts from the state before (no scanner call past the string's opening quote)."""
    encode = lambda s: hf_tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    stop = xgr_service.stop_token_ids[0]
    for schema, doc in ((FREE, FREE_DOC), (PERSON, CASES[0][1]), (FREE, PLAIN_DOC)):
        toks = encode(json.dumps(json.loads(doc), separators=(",", ":"), ensure_ascii=False))  # as guides write it
        guide = within_budget(xgr_service.compile(G("json_schema", json.dumps(schema), backend=backend)),
                              Scanner(Schemas(schema)), 4 * len(toks), xgr_service.token_bytes, encode, stop)
        m = guide.matcher()
        assert isinstance(m, BudgetMatcher)
        computed = []
        scanner = m.plan.scanner
        original = scanner.completions

        def counted(st, original=original):
            computed.append(st)
            return original(st)

        scanner.completions = counted
        rng, i = random.Random(0), 0
        while i < len(toks):
            k = min(rng.randint(1, 4), len(toks) - i)
            for t in toks[i: i + k]:  # the step's drafts, a text for each
                assert m.accept(t)
                assert (m._candidates(), m._growth()) == _fresh(schema, m.states[-1])
            back = rng.randint(0, k)
            m.rollback(back)  # verification keeps k - back of them
            i += k - back
        assert m.accept(stop)
        if doc is PLAIN_DOC:  # past its opening quote, no state of the free text was computed
            assert computed and not [st for st in computed if st is not None and st.lex is not None
                                     and st.lex[1].startswith(b"the")]


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_a_copied_mask_is_the_mask_the_grammar_computes(xgr_service, hf_tokenizer, backend, monkeypatch):
    """Inside a free string the grammar's mask is copied from the latest state it was computed at
    (Matcher.mask_by_position): at every state of these answers, taken back and fed again as a step
    does, the mask (the budget's restriction included) is the bits a matcher that computes every mask
    writes; and in the free text most masks were copied."""
    import numpy as np
    import torch

    from .conftest import VOCAB

    encode = lambda s: hf_tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    stop = xgr_service.stop_token_ids[0]
    W = (VOCAB + 31) // 32
    copied = []
    real_copy = BudgetMatcher._copy_mask
    monkeypatch.setattr(BudgetMatcher, "_copy_mask",
                        lambda self, b, r: copied.append(real_copy(self, b, r)) or copied[-1])
    plain = {"type": "object", "properties": {"text": {"type": "string"}, "id": {"type": "string", "minLength": 12}},
             "required": ["text", "id"]}
    for schema, doc in ((FREE, FREE_DOC), (plain, PLAIN_DOC), (PERSON, CASES[0][1])):
        toks = encode(json.dumps(json.loads(doc), separators=(",", ":"), ensure_ascii=False))
        compiled = xgr_service.compile(G("json_schema", json.dumps(schema), backend=backend))
        fast, slow = (within_budget(compiled, Scanner(Schemas(schema)), len(toks) + 12, xgr_service.token_bytes,
                                    encode, stop).matcher() for _ in range(2))
        slow._copy_mask = lambda b, r: False  # every mask computed
        rng, i, n_copied = random.Random(1), 0, len(copied)
        while i < len(toks):
            k = min(rng.randint(1, 4), len(toks) - i)
            for t in toks[i: i + k]:
                masks = []
                for m in (fast, slow):
                    bm = torch.zeros((2, W), dtype=torch.int32)
                    type(m).fill_many([m], bm, [1])
                    masks.append(bm[1].numpy().copy())
                    assert m.accept(t)
                assert np.array_equal(masks[0], masks[1]), (backend, hf_tokenizer.decode(toks[:i + k]))
            back = rng.randint(0, k)
            fast.rollback(back)
            slow.rollback(back)
            i += k - back
        if doc is PLAIN_DOC:  # (a grammar backend's own matcher: no value check wraps it)
            assert fast.inner.mask_by_position
            assert sum(copied[n_copied:]) > len(toks) / 2, (sum(copied[n_copied:]), len(toks))


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_a_rambling_answers_copied_masks_are_the_computed_ones(xgr_service, hf_tokenizer, backend):
    """The same over an answer of the longest tokens that close nothing (multi-byte pieces, spaces,
    digits: helpers.rambler), until the budget closes it; a string with a maxLength computes its own."""
    import torch

    from .conftest import VOCAB
    from .helpers import rambler

    pick = rambler(hf_tokenizer, VOCAB)
    encode = lambda s: hf_tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    stop = xgr_service.stop_token_ids[0]
    plain = {"type": "object", "properties": {"note": {"type": "string"}, "tags": {"type": "array", "items": {
        "type": "string"}}}, "required": ["note", "tags"]}
    capped = {"type": "object", "properties": {"note": {"type": "string", "maxLength": 9}, "more": {"type": "string"}},
              "required": ["note", "more"]}  # the grammar counts a maxLength string's characters: its own masks
    for schema in (plain, PERSON, capped):
        compiled = xgr_service.compile(G("json_schema", json.dumps(schema), backend=backend))
        fast, slow = (within_budget(compiled, Scanner(Schemas(schema)), 96, xgr_service.token_bytes, encode,
                                    stop).matcher() for _ in range(2))
        slow._copy_mask = lambda b, r: False
        real, hits = fast._copy_mask, []
        fast._copy_mask = lambda b, r: hits.append(real(b, r)) or hits[-1]
        W = (VOCAB + 31) // 32
        while not fast.is_terminated():
            masks = []
            for m in (fast, slow):
                bm = torch.zeros((1, W), dtype=torch.int32)
                type(m).fill_many([m], bm, [0])
                masks.append(bm)
            assert torch.equal(masks[0], masks[1])
            t = pick(masks[0])
            assert fast.accept(t) and slow.accept(t)
        assert len(fast.states) == len(slow.states)
        if schema is plain:
            assert sum(hits) > len(hits) / 4, (sum(hits), len(hits))
