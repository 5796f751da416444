"""Issue 75: the token budget's shortest-completion work is bounded by the budget whatever the
guide asks for, even for a guide past `guided_max_expansion` (the check off): a completion that
cannot fit is never built (TooLong), derived schema nodes are evaluated once, a regex's NFA is
capped, and free text meets the tool-call triggers through one automaton."""
from __future__ import annotations

import json
import random

import pytest

from specguide.guided.budget import completion_cap, within_budget
from specguide.guided.json_scanner import Scanner
from specguide.guided.regex_completion import MAX_STATES, RegexScanner, TooLong, Unknown
from specguide.guided.schema_completion import Schemas
from specguide.guided.tag_completion import Phase, TagScanner
from specguide.request import GuidedDecodingParams as G
from specguide.request import InvalidRequestError

from .test_expansion import HUGE_REGEX, NESTED, nested_arrays


def test_nested_min_items_do_not_fit_and_are_not_built():
    """1000^10 integers: TooLong after one node per level, having built one small array."""
    s = Schemas(NESTED)
    with pytest.raises(TooLong):
        s.shortest(NESTED)
    assert s.work.steps <= 11 and s.work.used < 4000
    with pytest.raises(TooLong):  # and from inside the document: the open arrays' closing
        Scanner(Schemas(NESTED)).completion(Scanner(Schemas(NESTED)).feed(Scanner(Schemas(NESTED)).start(), b"[[["))
    short = Schemas(nested_arrays(3, 3))  # what fits is built as before
    assert short.shortest(short.root) == "[" + ",".join(["[" + ",".join(["[0,0,0]"] * 3) + "]"] * 3) + "]"


def test_an_open_array_with_a_long_min_items_is_measured_not_looped():
    sch = Schemas({"type": "array", "minItems": 60000, "items": {"type": "integer"}}, max_bytes=1000)
    sc = Scanner(sch)
    with pytest.raises(TooLong):
        sc.completion(sc.feed(sc.start(), b"[0"))
    assert sch.work.used < 10


def test_a_chain_of_refs_with_two_branches_each_is_walked_once_per_node():
    """anyOf of two $refs to the next definition, 40 deep: 2^40 paths, 40-odd nodes."""
    defs = {f"D{i}": {"title": "t", "anyOf": [{"$ref": f"#/$defs/D{i + 1}"}, {"$ref": f"#/$defs/D{i + 1}"}]}
            for i in range(40)}
    defs["D40"] = {"type": "null"}
    s = Schemas({"$defs": defs, "$ref": "#/$defs/D0"})
    assert s.shortest(s.root) == "null"
    assert s.work.steps <= 200


def test_a_regex_that_expands_too_far_is_refused_from_its_width():
    with pytest.raises(TooLong):
        RegexScanner(HUGE_REGEX)  # 16M characters: no NFA is built
    with pytest.raises(Unknown) as exc:
        RegexScanner("(a?){5000}b")  # short matches but too many states: the budget does nothing
    assert not isinstance(exc.value, TooLong)
    sc = RegexScanner("(a{60}){60}")  # what fits is built as before
    assert len(sc.nfa.eps) <= MAX_STATES and sc.completion(sc.start()) == "a" * 3600
    assert sc.completion(sc.feed(sc.start(), b"aaa")) == "a" * 3597


@pytest.mark.parametrize("guide_type, guide", [("json_schema", json.dumps(NESTED)), ("regex", HUGE_REGEX)])
def test_within_budget_refuses_what_cannot_fit_without_building_it(xgr_service, hf_tokenizer, guide_type, guide):
    """The engine loop's step when a compile is done (intake's _within_budget): INVALID_ARG at once."""
    encode = lambda s: hf_tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    compiled = xgr_service.compile(G(guide_type, guide, backend="llguidance" if guide_type == "json_schema"
                                     else "xgrammar"))
    cap = completion_cap(256, xgr_service.token_bytes)
    schemas = Schemas(json.loads(guide), cap) if guide_type == "json_schema" else None
    scanner = (lambda: Scanner(schemas)) if schemas else (lambda: RegexScanner(guide, cap))
    with pytest.raises(InvalidRequestError, match="max_tokens 256 cannot hold a valid answer: .* more than 256"):
        within_budget(compiled, scanner, 256, xgr_service.token_bytes, encode, xgr_service.stop_token_ids[0])
    if schemas is not None:
        assert schemas.work.steps <= 11


def test_a_long_completion_is_tokenized_and_checked_only_as_far_as_the_budget(xgr_service, hf_tokenizer):
    """40,000 characters of shortest answer against a budget of 30: the refusal names 'more than'
    after tokenizing about twice the budget's worth of it."""
    seen = []

    def encode(s):
        seen.append(len(s))
        return hf_tokenizer.encode(s, add_special_tokens=False)

    schema = {"type": "string", "minLength": 40000}
    compiled = xgr_service.compile(G("json_schema", json.dumps(schema), backend="llguidance"))
    with pytest.raises(InvalidRequestError, match="max_tokens 30 cannot hold a valid answer: .* more than 30 tokens"):
        within_budget(compiled, Scanner(Schemas(schema)), 30, xgr_service.token_bytes, encode,
                      xgr_service.stop_token_ids[0])
    assert seen and max(seen) < 40000 and max(seen) <= 64 * max(len(t) for t in xgr_service.token_bytes)


# -- tool-call triggers: one automaton ----------------------------------------------------------

def _trigger_tag(triggers: list[str]) -> dict:
    tags = [{"begin": t + ">", "end": "</x>", "content": {"type": "json_schema", "json_schema": {"type": "object"}}}
            for t in triggers]
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags}}


def test_free_text_meets_the_triggers_through_one_automaton():
    """The first trigger (in list order) the text ends with starts a call, as a naive search finds
    it; a byte's work does not grow with the triggers' length (a 4000-byte trigger)."""
    rng = random.Random(7)
    triggers = ["<ab", "b<ab", "<" + "a" * 4000, "aab"]
    sc = TagScanner(_trigger_tag(triggers), [b"a", b"b", b"<", b">"], lambda s: list(s.encode()))
    for _ in range(300):
        text = "".join(rng.choice("ab<") for _ in range(rng.randint(1, 30)))
        if rng.random() < 0.1:
            text = "<" + "a" * 4000
        st, want = sc.start(), None
        for i in range(1, len(text) + 1):
            ends = [j for j, t in enumerate(triggers) if text[:i].endswith(t)]
            if ends:
                want = (i, ends[0])
                break
        got = None
        for i, c in enumerate(text.encode(), 1):
            st = sc.feed(st, bytes([c]))
            if st.phase != Phase.TEXT:  # a call head begins: the trigger that fired is its text so far
                got = (i, triggers.index(st.buf.decode()))
                break
        assert got == want, (text[:40], got, want)
    nodes = len(sc._ac.children)
    assert nodes <= sum(map(len, triggers)) + 1
    assert len(sc._ac._steps) <= nodes * 3  # each (node, byte) computed once: the alphabet here is 3 bytes


def test_nested_anyofs_stop_at_the_readings_cap_before_they_multiply(monkeypatch):
    """anyOf of 200 branches nested 7 deep (200^7 flattened readings): the scanner stops at
    MAX_READINGS as the branches come, having looked at a few hundred of them."""
    from specguide.guided import json_scanner

    seen = []
    starts = json_scanner._starts
    monkeypatch.setattr(json_scanner, "_starts", lambda node, first: seen.append(1) or starts(node, first))
    node: dict = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for _ in range(7):
        node = {"anyOf": [node] * 200}
    sc = json_scanner.Scanner(Schemas(node))
    with pytest.raises(Unknown, match="more than 32 readings"):
        sc.feed(json_scanner.State(), b'{"a": 1')
    assert len(seen) < 8 * 200
