"""The shortest text that completes a regex match: a Thompson NFA over characters (`Nfa`), for
JSON Schema's `pattern` strings (`shortest_match`) and for regex guides (`RegexScanner`, the
scanner of a regex guide's token budget, budget.py). `Unknown` is raised by every budget scanner
where it cannot tell the shortest completion (the budget then does nothing); `TooLong` where the
completion is longer than the scanner's byte cap (it cannot fit the budget: issue 75).

The pattern is read by regex_syntax.py (Python's syntax; inline flags are read and not applied).
Every size here is bounded, whatever the client writes: an NFA holds at most MAX_STATES states
(`(a{4000}){4000}` is refused before it is built, from the tree's width), and the shortest end comes
from distances to the accepting state computed once per NFA (one pass over its edges), so a
completion costs its own length, never a search of the automaton."""
from __future__ import annotations

import functools
from collections import deque
from typing import Any, Optional

from .regex_syntax import RegexSyntaxError, parse
from .regex_tree import ANY, Anchor, Branch, Char, Group, Item, Node, Repeat, min_width


class Unknown(Exception):
    """The scanner cannot tell the shortest completion from here (the budget then does nothing)."""


class TooLong(Unknown):
    """The shortest completion is longer than `limit` bytes (the scanner's cap): what a budget of
    that many bytes cannot hold, so it need not be built."""

    def __init__(self, what: str, limit: int):
        super().__init__(f"{what} is longer than {limit} bytes")
        self.what, self.limit = what, limit


def again(e: Unknown) -> Unknown:
    """A fresh copy of a memoized failure (raising one instance again and again grows its traceback)."""
    return TooLong(e.what, e.limit) if isinstance(e, TooLong) else Unknown(*e.args)


MAX_BYTES = 1 << 20  # the default cap on a completion's text (budget.completion_cap gives a request's)
MAX_STATES = 1 << 12  # NFA states a regex may build (a character's step costs up to all of them)
MAX_WALK = 1 << 16  # characters x states a minLength walk may visit


def shortest_match(pattern: str, prefix: str = "", max_bytes: int = MAX_BYTES, min_chars: int = 0) -> str:
    """The shortest text that, after `prefix`, makes a string JSON Schema's `pattern` accepts
    (a search: unanchored ends take anything), at least `min_chars` characters long (a minLength);
    Unknown when none (or the regex is beyond this), TooLong when longer than `max_bytes`."""
    return nfa(pattern, False, max_bytes).shortest_end(prefix, max_bytes=max_bytes, min_chars=min_chars)


def nfa(pattern: str, full: bool, max_bytes: int = MAX_BYTES) -> "Nfa":
    """The NFA of `pattern` (cached); TooLong when its shortest match alone is longer than
    `max_bytes`, Unknown when it cannot be built (or needs more than MAX_STATES states)."""
    built = _nfa(pattern, full)
    if isinstance(built, Nfa):
        return built
    why, min_width = built
    if min_width is not None and min_width > max_bytes:
        raise TooLong(f"the shortest match of {pattern[:40]!r}", max_bytes)
    raise Unknown(why)


class _TooBig(Unknown):
    def __init__(self, min_width: int):
        super().__init__(f"the regex needs more than {MAX_STATES} NFA states")
        self.min_width = min_width


@functools.lru_cache(maxsize=16)
def _nfa(pattern: str, full: bool) -> "Nfa | tuple[str, Optional[int]]":
    """The NFA, or why not (and the shortest match's width when it is too big): failures are
    cached too, so a refused pattern is not parsed again at every token."""
    try:
        return Nfa(pattern, full)
    except _TooBig as e:
        return str(e), e.min_width
    except Unknown as e:
        return str(e), None


_MAX_COPIES = 64  # {m,n} with n - m beyond this is taken as {m,} (the grammar's own check still holds)
_PICKS = "a0A_-. "  # representative characters tried first for a character class


class Nfa:
    """Thompson NFA of a regex (regex_syntax's tree) over characters: just enough for the shortest end.
    `full`: the whole text must match (a regex guide); else a search (JSON Schema's `pattern`).
    `_TooBig` (an Unknown) past `max_states` states."""

    def __init__(self, pattern: str, full: bool = False, max_states: int = MAX_STATES):
        try:
            items = parse(pattern).items
            width = min_width(items)  # saturating, from the tree: nothing is expanded
        except (RegexSyntaxError, RecursionError) as e:
            raise Unknown(f"pattern {pattern[:40]!r}: {e}") from None
        self.max_states, self.min_width = max_states, width
        if width >= max_states:  # at least one state per character of the shortest match
            raise _TooBig(width)
        self.eps: list[list[int]] = []
        self.moves: list[list[tuple[Any, int]]] = []  # (predicate, target)
        self._dist: Optional[tuple[list[int], list[tuple[int, str]]]] = None  # _distances, once
        self._picks: dict[int, Optional[str]] = {}  # id(predicate) -> the character it is walked with
        self._reached: dict[int, frozenset[int]] = {}  # state -> its empty-move closure (_reach)
        anchored_start = full or (bool(items) and items[0] == Anchor("^"))
        anchored_end = full or (bool(items) and items[-1] in (Anchor("$"), Anchor("\\Z")))
        self.start = self._state()
        s = self.start
        if not anchored_start:
            s = self._star_any(s)
        s = self._seq(items, s)
        if not anchored_end:
            s = self._star_any(s)
        self.accept = s

    def _state(self) -> int:
        if len(self.eps) >= self.max_states:
            raise _TooBig(self.min_width)
        self.eps.append([])
        self.moves.append([])
        return len(self.eps) - 1

    def _star_any(self, s: int) -> int:
        self.moves[s].append((lambda c: True, s))
        return s

    def _seq(self, items: list[Node], s: int) -> int:
        for node in items:
            s = self._one(node, s)
        return s

    def _one(self, node: Node, s: int) -> int:
        if isinstance(node, Char):
            return self._move(s, _predicate(node))
        if isinstance(node, Group):
            return self._seq(node.body, s)
        if isinstance(node, Anchor):  # only a leading ^ and a trailing $ / \Z mean anything here
            return s
        if isinstance(node, Branch):
            end = self._state()
            for alt in node.alternatives:
                self.eps[self._seq(alt, s)].append(end)
            return end
        if isinstance(node, Repeat):  # lazy and possessive ones built as greedy (the texts they may match)
            lo, hi, sub = node.lo, node.hi, node.body
            for _ in range(lo):
                s = self._seq(sub, s)
            if hi is None or hi - lo > _MAX_COPIES:
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
        raise Unknown(f"regex construct {type(node).__name__}")  # a lookaround

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

    def shortest_end(self, prefix: str, cur: Optional[frozenset[int]] = None, max_bytes: int = MAX_BYTES,
                     min_chars: int = 0) -> str:
        """The shortest text that takes the states after `prefix` (from `cur`) to the accepting
        state: the nearest state's distance, then its path (its own length in steps). With
        `min_chars`, at least that many characters: the states `min_chars` characters on, then the
        nearest of those."""
        cur = self.step(self.initial() if cur is None else cur, prefix)
        dist, nxt = self._distances()
        heads = self._walk(cur, min_chars, max_bytes) if min_chars > 0 else dict.fromkeys(cur, "")
        best = min(heads, key=lambda s: (dist[s], s))
        if dist[best] == _FAR:
            raise Unknown("no end matches the pattern")
        if dist[best] > max_bytes:
            raise TooLong("the rest of the match", max_bytes)
        out, s = [heads[best]], best
        if dist[best] + len(out[0]) > max_bytes:
            raise TooLong("the rest of the match", max_bytes)
        while s != self.accept:  # the first character move on a shortest way (as a forward search
            d = dist[s]          # meets them), else the BFS's step: each step nears the end
            step = next(((t, c) for c, t in ((self._picks[id(p)], t) for p, t in self.moves[s])
                         if c is not None and dist[t] == d - 1), None) or nxt[s]
            s = step[0]
            if step[1]:
                out.append(step[1])
        return "".join(out)

    def _walk(self, cur: frozenset[int], n: int, max_bytes: int) -> dict[int, str]:
        """Each state `n` characters on from `cur`, with a text that reaches it (the first found),
        layer by layer; Unknown where none is, or past MAX_WALK states visited."""
        if n > max_bytes:
            raise TooLong("the minLength string", max_bytes)
        if n * len(self.eps) > MAX_WALK:
            raise Unknown(f"a minLength of {n} over {len(self.eps)} states")
        self._distances()  # the picked characters
        layers: list[dict[int, tuple[int, str]]] = [{s: (-1, "") for s in cur}]  # state -> (previous, character)
        for _ in range(n):
            nxt: dict[int, tuple[int, str]] = {}
            for s in layers[-1]:
                for pred, t in self.moves[s]:
                    c = self._picks[id(pred)]
                    if c is not None and t not in nxt:
                        for u in self._reach(t):
                            nxt.setdefault(u, (s, c))
            if not nxt:
                raise Unknown("no match that long")
            layers.append(nxt)
        out: dict[int, str] = {}
        for end in layers[-1]:
            chars, s = [], end
            for layer in reversed(layers[1:]):
                s, c = layer[s]
                chars.append(c)
            out[end] = "".join(reversed(chars))
        return out

    def _reach(self, s: int) -> frozenset[int]:
        """The states `s` reaches by empty moves (itself included), memoized."""
        hit = self._reached.get(s)
        if hit is None:
            hit = self._reached[s] = frozenset(self._closure({s}))
        return hit

    def _distances(self) -> tuple[list[int], list[tuple[int, str]]]:
        """Per state: characters to the accepting state, and the next step on a shortest way there
        (state, character or ''); one 0-1 BFS backwards over every edge, once per NFA."""
        if self._dist is None:
            n = len(self.eps)
            back: list[list[tuple[int, str]]] = [[] for _ in range(n)]
            for s in range(n):
                for t in self.eps[s]:
                    back[t].append((s, ""))
                for pred, t in self.moves[s]:
                    c = self._picks[id(pred)] = _pick(pred)  # the predicates live in self.moves
                    if c is not None:
                        back[t].append((s, c))
            dist, nxt = [_FAR] * n, [(-1, "")] * n
            dist[self.accept] = 0
            todo = deque([self.accept])
            while todo:  # eps edges cost 0 (to the front), characters 1 (to the back)
                t = todo.popleft()
                for s, c in back[t]:
                    d = dist[t] + (1 if c else 0)
                    if d < dist[s]:
                        dist[s], nxt[s] = d, (t, c)
                        if c:
                            todo.append(s)
                        else:
                            todo.appendleft(s)
            self._dist = (dist, nxt)  # one assignment: a thread reading it sees all or nothing
        return self._dist


_FAR = 1 << 62  # no way to the accepting state


def _pick(pred: Any) -> Optional[str]:
    """A character the predicate takes (printable, JSON-safe), preferring _PICKS."""
    for c in _PICKS:
        if pred(c):
            return c
    for o in range(0x21, 0x7F):
        if chr(o) not in '"\\' and pred(chr(o)):
            return chr(o)
    return None


def _predicate(node: Char) -> Any:
    """Whether a character is the node's (`.`: any but a newline); a fresh function per move."""
    items, negate = node.items, node.negate
    if items == (ANY,):
        return lambda c: c != "\n"
    if len(items) == 1 and items[0][0] == "lit":
        return (lambda c, v=items[0][1]: ord(c) != v) if negate else (lambda c, v=items[0][1]: ord(c) == v)
    return lambda c: _in_set(c, items) != negate


def _in_set(c: str, items: tuple[Item, ...]) -> bool:
    """Whether character c is one of a class's items."""
    for it in items:
        if it[0] == "lit" and ord(c) == it[1] or it[0] == "range" and it[1] <= ord(c) <= it[2]:
            return True
        if it[0] == "cat" and {"d": c.isdigit(), "D": not c.isdigit(), "w": c.isalnum() or c == "_",
                               "W": not (c.isalnum() or c == "_"), "s": c.isspace(),
                               "S": not c.isspace()}[it[1]]:
            return True
    return False


class RegexScanner:
    """A regex guide's scanner (the whole answer matches): the NFA's states after the text so far;
    the completion is the shortest end of the match (TooLong past `max_bytes`); one free token adds
    at most SLACK."""

    def __init__(self, pattern: str, max_bytes: int = MAX_BYTES):
        self.max_bytes = max_bytes
        self.nfa = nfa(pattern, True, max_bytes)

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
        return self.nfa.shortest_end("", cur, self.max_bytes)

    def completions(self, state: tuple[frozenset[int], bytes]) -> list[str]:
        """The completions the budget checks, shortest first: here the one."""
        return [self.completion(state)]

    def growth(self, state: Any) -> int:
        return 0
