"""The shortest text that completes a regex match: a Thompson NFA over characters (`Nfa`), for
JSON Schema's `pattern` strings (`shortest_match`) and for regex guides (`RegexScanner`, the
scanner of a regex guide's token budget, budget.py). `Unknown` is raised by every budget scanner
where it cannot tell the shortest completion (the budget then does nothing)."""
from __future__ import annotations

import re
from typing import Any, Optional

try:  # the regex parser re uses (its old top-level names are deprecated since 3.11)
    from re import _constants as sre_constants  # type: ignore[attr-defined]
    from re import _parser as sre_parse  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - Python < 3.11
    import sre_constants  # type: ignore[no-redef]
    import sre_parse  # type: ignore[no-redef]


class Unknown(Exception):
    """The scanner cannot tell the shortest completion from here (the budget then does nothing)."""


def shortest_match(pattern: str, prefix: str = "") -> str:
    """The shortest text that, after `prefix`, makes a string JSON Schema's `pattern` accepts
    (a search: unanchored ends take anything); Unknown when none (or the regex is beyond this)."""
    return Nfa(pattern).shortest_end(prefix)


_MAX_COPIES = 64  # {m,n} with n - m beyond this is taken as {m,} (the grammar's own check still holds)
_PICKS = "a0A_-. "  # representative characters tried first for a character class


class Nfa:
    """Thompson NFA of a regex (sre_parse's tree) over characters: just enough for the shortest end.
    `full`: the whole text must match (a regex guide); else a search (JSON Schema's `pattern`)."""

    def __init__(self, pattern: str, full: bool = False):
        try:
            tree = sre_parse.parse(pattern)
        except (re.error, RecursionError) as e:
            raise Unknown(f"pattern {pattern!r}: {e}") from None
        self.eps: list[list[int]] = []
        self.moves: list[list[tuple[Any, int]]] = []  # (predicate, target)
        items = list(tree)
        anchored_start = full or (bool(items) and items[0][0] == sre_constants.AT
                                  and items[0][1] == sre_constants.AT_BEGINNING)
        anchored_end = full or (bool(items) and items[-1][0] == sre_constants.AT and items[-1][1] in (
            sre_constants.AT_END, sre_constants.AT_END_STRING))
        self.start = self._state()
        s = self.start
        if not anchored_start:
            s = self._star_any(s)
        s = self._seq(items, s)
        if not anchored_end:
            s = self._star_any(s)
        self.accept = s

    def _state(self) -> int:
        self.eps.append([])
        self.moves.append([])
        return len(self.eps) - 1

    def _star_any(self, s: int) -> int:
        self.moves[s].append((lambda c: True, s))
        return s

    def _seq(self, items: Any, s: int) -> int:
        for op, av in items:
            s = self._one(op, av, s)
        return s

    def _one(self, op: Any, av: Any, s: int) -> int:
        if op == sre_constants.LITERAL:
            return self._move(s, lambda c, v=av: ord(c) == v)
        if op == sre_constants.NOT_LITERAL:
            return self._move(s, lambda c, v=av: ord(c) != v)
        if op == sre_constants.ANY:
            return self._move(s, lambda c: c != "\n")
        if op == sre_constants.IN:
            return self._move(s, lambda c, items=av: _in_set(c, items))
        if op == sre_constants.SUBPATTERN:
            return self._seq(av[-1], s)
        if op == sre_constants.AT:
            return s
        if op == sre_constants.BRANCH:
            end = self._state()
            for alt in av[1]:
                self.eps[self._seq(alt, s)].append(end)
            return end
        if op in (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT, getattr(sre_constants, "POSSESSIVE_REPEAT", None)):
            lo, hi, sub = av
            for _ in range(lo):
                s = self._seq(sub, s)
            if hi == sre_constants.MAXREPEAT or hi - lo > _MAX_COPIES:
                loop = self._state()
                self.eps[s].append(loop)
                self.eps[self._seq(sub, loop)].append(loop)
                return loop
            end = self._state()
            for _ in range(hi - lo):
                self.eps[s].append(end)
                s = self._seq(sub, s)
            self.eps[s].append(end)
            return end
        raise Unknown(f"regex op {op}")

    def _move(self, s: int, pred: Any) -> int:
        t = self._state()
        self.moves[s].append((pred, t))
        return t

    def _closure(self, states: set[int]) -> set[int]:
        todo, seen = list(states), set(states)
        while todo:
            for t in self.eps[todo.pop()]:
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        return seen

    def initial(self) -> frozenset[int]:
        return frozenset(self._closure({self.start}))

    def step(self, cur: frozenset[int], text: str) -> frozenset[int]:
        """The states after `text` from `cur` (Unknown when none)."""
        for c in text:
            cur = frozenset(self._closure({t for s in cur for pred, t in self.moves[s] if pred(c)}))
            if not cur:
                raise Unknown("the text leaves the pattern")
        return cur

    def shortest_end(self, prefix: str, cur: Optional[frozenset[int]] = None) -> str:
        cur = self.step(self.initial() if cur is None else cur, prefix)
        seen, frontier = set(cur), [(s, "") for s in cur]
        while frontier:  # breadth first: the first accepting state reached is the shortest end
            nxt = []
            for s, text in frontier:
                if s == self.accept:
                    return text
                for pred, t in self.moves[s]:
                    c = _pick(pred)
                    if c is None:
                        continue
                    for u in self._closure({t}):
                        if u not in seen:
                            seen.add(u)
                            nxt.append((u, text + c))
            frontier = nxt
        raise Unknown("no end matches the pattern")


def _pick(pred: Any) -> Optional[str]:
    """A character the predicate takes (printable, JSON-safe), preferring _PICKS."""
    for c in _PICKS:
        if pred(c):
            return c
    for o in range(0x21, 0x7F):
        if chr(o) not in '"\\' and pred(chr(o)):
            return chr(o)
    return None


def _in_set(c: str, items: Any) -> bool:
    """Whether character c is in a character class (sre_parse IN items)."""
    hit, negate = False, False
    for op, av in items:
        if op == sre_constants.NEGATE:
            negate = True
        elif op == sre_constants.LITERAL:
            hit = hit or ord(c) == av
        elif op == sre_constants.RANGE:
            hit = hit or av[0] <= ord(c) <= av[1]
        elif op == sre_constants.CATEGORY:
            hit = hit or {sre_constants.CATEGORY_DIGIT: c.isdigit(), sre_constants.CATEGORY_NOT_DIGIT: not c.isdigit(),
                          sre_constants.CATEGORY_WORD: c.isalnum() or c == "_",
                          sre_constants.CATEGORY_NOT_WORD: not (c.isalnum() or c == "_"),
                          sre_constants.CATEGORY_SPACE: c.isspace(),
                          sre_constants.CATEGORY_NOT_SPACE: not c.isspace()}.get(av, False)
    return hit != negate


class RegexScanner:
    """A regex guide's scanner (the whole answer matches): the NFA's states after the text so far;
    the completion is the shortest end of the match; one free token adds at most SLACK."""

    def __init__(self, pattern: str):
        self.nfa = Nfa(pattern, full=True)

    def start(self) -> tuple[frozenset[int], bytes]:
        return self.nfa.initial(), b""

    def feed(self, state: tuple[frozenset[int], bytes], data: bytes) -> tuple[frozenset[int], bytes]:
        cur, pending = state
        raw = pending + data
        for cut in range(len(raw), max(-1, len(raw) - 4), -1):  # a UTF-8 character split between tokens waits
            try:
                return self.nfa.step(cur, raw[:cut].decode()), raw[cut:]
            except UnicodeDecodeError:
                continue
        raise Unknown("undecodable bytes")

    def completion(self, state: tuple[frozenset[int], bytes]) -> str:
        cur, pending = state
        if pending:
            raise Unknown("half a UTF-8 character")
        return self.nfa.shortest_end("", cur)

    def growth(self, state: Any) -> int:
        return 0
