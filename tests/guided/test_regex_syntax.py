"""Issue 76: the regex automata read Python's regex syntax through guided/regex_syntax.py (a parser
of our own, no private module of the standard library). Its tree for each construct it supports,
the shortcuts re's parser takes (so the automata keep their shape), what it refuses and how the
two automata (regex_completion, client_regex) answer with it; and, against `re` itself, which
texts a regex guide's NFA takes."""
from __future__ import annotations

import re

import pytest

from specguide.guided import client_regex
from specguide.guided.regex_completion import Nfa, RegexScanner, TooLong, Unknown, shortest_match
from specguide.guided.regex_syntax import RegexSyntaxError, Unsupported, parse
from specguide.guided.regex_tree import ANY, Anchor, Branch, Char, Group, Look, Repeat, min_width


def lit(c: str, negate: bool = False) -> Char:
    return Char((("lit", ord(c)),), negate)


def one(pattern: str):
    (node,) = parse(pattern).items
    return node


@pytest.mark.parametrize("pattern, items, negate", [
    ("[a-z]", (("range", 97, 122),), False), ("[^ab]", (("lit", 97), ("lit", 98)), True),
    ("[]a]", (("lit", 93), ("lit", 97)), False), ("[^]]", (("lit", 93),), True),
    ("[a-]", (("lit", 97), ("lit", 45)), False), ("[-a]", (("lit", 45), ("lit", 97)), False),
    (r"[\d_]", (("cat", "d"), ("lit", 95)), False), (r"[\b]", (("lit", 8),), False),
    (r"[\x41-\x5a]", (("range", 65, 90),), False), ("[aa]", (("lit", 97),), False),
    (r"\d", (("cat", "d"),), False), (r"\D", (("cat", "D"),), False), (r"\w", (("cat", "w"),), False),
    (r"\W", (("cat", "W"),), False), (r"\s", (("cat", "s"),), False), (r"\S", (("cat", "S"),), False),
    (".", (ANY,), False), (r"\.", (("lit", 46),), False), (r"\n", (("lit", 10),), False),
    (r"\x41", (("lit", 65),), False), (r"\u00e9", (("lit", 233),), False), (r"\U0001F600", (("lit", 0x1F600),), False),
    (r"\N{EM DASH}", (("lit", 0x2014),), False), (r"\0", (("lit", 0),), False), (r"\101", (("lit", 65),), False),
    ("é", (("lit", 233),), False), ("{", (("lit", 123),), False), ("}", (("lit", 125),), False)])
def test_one_character(pattern, items, negate):
    assert one(pattern) == Char(items, negate)
    for c in "Aa0_ -\n\x00é]{":  # its source (client_regex compiles it alone) is the same class
        assert (re.fullmatch(one(pattern).source(), c) is None) == (re.fullmatch(pattern, c) is None), c


@pytest.mark.parametrize("pattern, lo, hi, mode", [
    ("a?", 0, 1, "greedy"), ("a*", 0, None, "greedy"), ("a+", 1, None, "greedy"), ("a{3}", 3, 3, "greedy"),
    ("a{2,5}", 2, 5, "greedy"), ("a{2,}", 2, None, "greedy"), ("a{,4}", 0, 4, "greedy"), ("a{,}", 0, None, "greedy"),
    ("a??", 0, 1, "lazy"), ("a*?", 0, None, "lazy"), ("a+?", 1, None, "lazy"), ("a{2,5}?", 2, 5, "lazy"),
    ("a*+", 0, None, "possessive"), ("a{2}+", 2, 2, "possessive")])
def test_quantifiers(pattern, lo, hi, mode):
    node = one(pattern)
    assert isinstance(node, Repeat) and (node.body, node.lo, node.hi, node.mode) == ([lit("a")], lo, hi, mode)


def test_a_brace_that_is_no_quantifier_is_itself():
    assert parse("a{x}").items == [lit("a"), lit("{"), lit("x"), lit("}")]
    assert parse("a{}").items == [lit("a"), lit("{"), lit("}")]
    assert parse("a{2").items == [lit("a"), lit("{"), lit("2")]


def test_groups_anchors_and_flags():
    assert parse("(?:ab)c").items == [lit("a"), lit("b"), lit("c")]  # a plain non-capturing group is spliced
    group = one("(ab)")
    assert isinstance(group, Group) and group.capture and group.body == [lit("a"), lit("b")]
    assert one("(?P<year>a)").capture
    scoped = one("(?i-s:a)")
    assert not scoped.capture and (scoped.add, scoped.remove) == (re.I, re.S) and scoped.body == [lit("a")]
    assert one("(?:ab)*").body == [lit("a"), lit("b")]  # a repeated plain group: its items
    assert parse("a(?#note)b").items == [lit("a"), lit("b")]
    assert parse(r"^\A\b\B\Z$").items == [Anchor(k) for k in ("^", r"\A", r"\b", r"\B", r"\Z", "$")]
    regex = parse("(?i)(?m)ab")
    assert regex.flags == re.I | re.M and regex.items == [lit("a"), lit("b")]
    assert parse("(?x) a b  # the rest\n [ ]").items == [lit("a"), lit("b"), Char((("lit", 32),))]
    look = [one(p) for p in ("(?=a)", "(?!a)", "(?<=a)", "(?<!a)")]
    assert [(x.behind, x.negate) for x in look] == [(False, False), (False, True), (True, False), (True, True)]
    assert all(isinstance(x, Look) and x.body == [lit("a")] for x in look)


def test_alternatives_take_re_s_shortcuts():
    assert parse("ab|ac").items == [lit("a"), Char((("lit", 98), ("lit", 99)))]  # common head, then one class
    assert parse(r"a|b|[cd]|\d").items == [Char((("lit", 97), ("lit", 98), ("lit", 99), ("lit", 100), ("cat", "d")))]
    (branch,) = parse("ab|cd|.").items
    assert isinstance(branch, Branch) and branch.alternatives == [[lit("a"), lit("b")], [lit("c"), lit("d")], [Char((ANY,))]]
    assert parse("ab|a").items[0] == lit("a") and parse("ab|a").items[1].alternatives == [[lit("b")], []]


def test_min_width():
    assert [min_width(parse(p).items) for p in ("(a{4000}){4000}", "a|bc", "(?=abc)", "x{2,5}", "^$", "(ab)+c?")] == \
        [16_000_000, 1, 0, 2, 0, 2]


@pytest.mark.parametrize("pattern, feature", [
    (r"(a)\1", "a backreference"), (r"(?P<x>a)(?P=x)", "a backreference"), (r"(a)?(?(1)b|c)", "a conditional group"),
    (r"(?>a+)b", "an atomic group")])
def test_refused_constructs(pattern, feature):
    with pytest.raises(Unsupported) as exc:
        parse(pattern)
    assert exc.value.feature == feature
    with pytest.raises(Unknown) as unknown:  # the budget does nothing with it, as with re's parser
        RegexScanner(pattern)
    assert not isinstance(unknown.value, TooLong)
    with pytest.raises(client_regex.UnsupportedPattern, match=re.escape(feature)):
        client_regex._Nfa("(?=a)" + pattern)  # the lookaround automaton names it


@pytest.mark.parametrize("pattern", [
    "[a-", "(a", "a)", r"\q", "*a", "a**", "^*", "a{3,2}", "[z-a]", r"[\d-z]", r"\x4", "(?P<1>a)", "(?P<a>x)(?P<a>y)",
    "a(?i)", "(?<x>a)", "(?Lx)", "(?au)", "(?-a:x)", "a{4294967295}", "a" + "\\", r"\N{NO SUCH NAME}", r"\400"])
def test_what_re_refuses_is_refused(pattern):
    with pytest.raises((re.error, OverflowError)):
        re.compile(pattern)
    with pytest.raises(RegexSyntaxError):
        parse(pattern)
    with pytest.raises(Unknown):
        RegexScanner(pattern)


def test_the_nfa_refuses_a_lookaround_and_reads_leading_and_trailing_anchors():
    with pytest.raises(Unknown):
        RegexScanner("(?=a)a")
    assert shortest_match("^ab$", "") == "ab" and shortest_match("ab", "x") == "ab"
    assert shortest_match("(?:^ab)", "") == "ab" and shortest_match(r"ab\Z", "") == "ab"
    with pytest.raises(Unknown):
        shortest_match("(?:^ab)", "x")  # a leading ^ anchors the search


PATTERNS = [r"[a-c]+\d{2,3}", r"(?:ab|ac)*d", r"x?y+?z*", r"(a|bc){2}", r"[^a-c\s]+", r"\w+@\w+\.com", r"\D\W\S",
            r"(?P<n>[0-9]{1,2})-(\d)", r"a{,2}b{1,}", r"[]x-]+", r"(?:)a", r"\bword\b", r"é+|[\u00e0-\u00ff]"]
TEXTS = ["", "a", "ab", "abc12", "ac123", "abacd", "d", "xyz", "yy", "zz", "bcbc", "abc", "dd!", "a@b.com", "12-3",
         "1-2", "aab", "b", "]x-", "a", "word", "éé", "à", "a_!", "1 2", "x"]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_a_regex_guide_nfa_takes_what_re_fullmatch_takes(pattern):
    nfa = Nfa(pattern, full=True)
    for text in TEXTS:
        try:
            got = nfa.accept in nfa.step(nfa.initial(), text)
        except Unknown:
            got = False
        assert got == (re.fullmatch(pattern, text) is not None), (pattern, text)


@pytest.mark.timeout(60)
def test_parsing_is_linear_in_the_pattern():
    n = 200_000
    assert len(parse("|".join(["ab"] * n)).items) == 3  # the common head a, b, then n empty alternatives
    assert min_width(parse("(?:x|y)" * n).items) == n
    assert len(parse("[" + "a-b" * n + "]").items) == 1
