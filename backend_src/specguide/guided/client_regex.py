"""Regular expressions a client wrote (JSON Schema `pattern`, `patternProperties` keys), run in time
linear in the text they are matched against, never by a backtracking engine (issue 75: `^(a+)+$`
against `"aaaa...ab"` would otherwise hold the engine loop for hours).

`search(pattern, text)` is `re.search(pattern, text) is not None`, done by RE2 (google-re2, a
linear-time automaton). JSON Schema's regexes are ECMA-262's; what of that syntax RE2 lacks is
translated first: `\\uXXXX` / `\\u{X}` (surrogate pairs joined), `\\cX`, `\\s` (ECMA's Unicode
whitespace; RE2's is ASCII), `[\\b]` (backspace), `\\p{Script=X}` / `\\p{gc=X}`, and Python's `\\Z`.
`\\d`, `\\w`, `\\b` are ASCII, as in ECMA-262 (Python's `re` reads them as Unicode).

What RE2 cannot express:
- lookaround (`(?=`, `(?!`, `(?<=`, `(?<!`): the pattern is read with Python's regex syntax
  (regex_syntax.py) and run by `_Nfa` below, an automaton of our own whose lookarounds are position sets
  computed in one pass each: linear in the text too, at most MAX_STATES states and MAX_WORK
  characters x states per search (past that, TextTooCostly: the value is not accepted);
- backreferences (`\\1`, `\\k<n>`, `(?P=n)`), conditionals `(?(1)...)`, atomic groups `(?>...)`,
  possessive quantifiers, and anything else RE2 refuses (a repetition count over 1000, ...):
  UnsupportedPattern. A guide that uses one is refused at intake (schema.check_patterns: INVALID_ARG
  naming the pattern, its place and the feature), as xgrammar and llguidance refuse backreferences.

Compiled patterns are cached (CACHE entries, least recently used first out), refusals too.
"""
from __future__ import annotations

import re
import threading
from collections import OrderedDict
from typing import Any, Union

import re2

from .regex_syntax import RegexSyntaxError, Unsupported, parse
from .regex_tree import Anchor, Branch, Char, Group, Look, Node, Repeat

CACHE = 1024  # compiled patterns kept
MAX_STATES = 4096  # lookaround fallback: program states (its lookarounds' programs included)
MAX_WORK = 100_000  # lookaround fallback: (characters + 1) x states one search may step through

# ECMA-262 WhiteSpace and LineTerminator (what `\s` matches there and, near enough, in Python's re)
_WS = r"\t\n\x{B}\f\r \x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000}\x{FEFF}"
_PROPERTY_PREFIXES = ("General_Category=", "gc=", "Script=", "sc=")
_HEX = frozenset("0123456789abcdefABCDEF")


class ClientRegexError(ValueError):
    """A client's pattern that cannot be run here in linear time (the message says why)."""


class UnsupportedPattern(ClientRegexError):
    """Not a regex this server runs: invalid, or a feature no linear-time engine has."""


class TextTooCostly(ClientRegexError):
    """A lookaround pattern against a text longer than the fallback's work bound."""


def _options() -> Any:
    opts = re2.Options()
    opts.log_errors = False  # refusals are the client's business, not the server log's
    return opts


_OPTIONS = _options()
_cache: "OrderedDict[str, Union[_Re2, _Nfa, ClientRegexError]]" = OrderedDict()
_lock = threading.Lock()


def search(pattern: str, text: str) -> bool:
    """Whether `pattern` matches somewhere in `text` (re.search semantics); ClientRegexError when the
    pattern is refused (UnsupportedPattern) or a lookaround one meets a text past its bound."""
    return compile(pattern).search(text)


def compile(pattern: str) -> "Union[_Re2, _Nfa]":  # noqa: A001 - the module's re-like entry point
    """The cached compiled `pattern`; UnsupportedPattern (also cached) when it is refused."""
    with _lock:
        hit = _cache.get(pattern)
        if hit is not None:
            _cache.move_to_end(pattern)
    if hit is None:
        try:
            hit = _compile(pattern)
        except ClientRegexError as e:
            hit = e
        with _lock:
            _cache[pattern] = hit
            while len(_cache) > CACHE:
                _cache.popitem(last=False)
    if isinstance(hit, ClientRegexError):
        raise hit.with_traceback(None)  # (a cached exception raised again would grow its traceback)
    return hit


def is_valid(pattern: str) -> bool:
    """JSON Schema's `format: regex`: a pattern this server would run (not cached: generated text)."""
    try:
        _compile(pattern)
    except ClientRegexError:
        return False
    return True


def _compile(pattern: str) -> "Union[_Re2, _Nfa]":
    if not isinstance(pattern, str):
        raise UnsupportedPattern(f"pattern {pattern!r} is not a string")
    translated, lookaround = translate(pattern)
    if lookaround:
        return _Nfa(pattern)
    try:
        return _Re2(re2.compile(translated.encode("utf-8", "surrogatepass"), _OPTIONS))
    except re2.error as e:
        why = e.args[0].decode("utf-8", "replace") if e.args and isinstance(e.args[0], bytes) else str(e)
        raise UnsupportedPattern(f"pattern {_short(pattern)}: {why}") from None


def _short(pattern: str) -> str:
    return repr(pattern if len(pattern) <= 80 else pattern[:77] + "...")


def translate(pattern: str) -> tuple[str, bool]:
    """`pattern` in RE2's syntax, and whether it has a lookaround (then RE2 cannot run it).
    UnsupportedPattern for a backreference, a conditional or an atomic group. One pass."""
    out: list[str] = []
    i, n, in_class, lookaround = 0, len(pattern), False, False

    def refuse(feature: str) -> UnsupportedPattern:
        return UnsupportedPattern(f"pattern {_short(pattern)} uses {feature}, which no linear-time regex engine runs")

    while i < n:
        c = pattern[i]
        if c == "\\" and i + 1 < n:
            d = pattern[i + 1]
            if d == "u":
                cp, end = _unicode_escape(pattern, i)
                if cp is not None:
                    out.append(f"\\x{{{cp:X}}}")
                    i = end
                    continue
            elif d == "c" and i + 2 < n and pattern[i + 2].isascii() and pattern[i + 2].isalpha():
                out.append(f"\\x{{{ord(pattern[i + 2]) % 32:X}}}")
                i += 3
                continue
            elif d == "s":
                out.append(_WS if in_class else f"[{_WS}]")
                i += 2
                continue
            elif d == "S" and not in_class:
                out.append(f"[^{_WS}]")
                i += 2
                continue
            elif d == "b" and in_class:
                out.append(r"\x{8}")
                i += 2
                continue
            elif d == "Z" and not in_class:
                out.append(r"\z")
                i += 2
                continue
            elif d == "0" and not (i + 2 < n and pattern[i + 2].isdigit()):
                out.append(r"\x{0}")
                i += 2
                continue
            elif d in "123456789" and not in_class:
                raise refuse(f"a backreference (\\{d})")
            elif d == "k" and pattern.startswith("<", i + 2):
                raise refuse("a backreference (\\k<name>)")
            elif d in "pP" and pattern.startswith("{", i + 2):
                end = pattern.find("}", i + 3)
                if end > 0:
                    name = pattern[i + 3:end]
                    for prefix in _PROPERTY_PREFIXES:
                        if name.startswith(prefix):
                            name = name[len(prefix):]
                    out.append(f"\\{d}{{{name}}}")
                    i = end + 1
                    continue
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if in_class:
            if c == "]":
                in_class = False
            out.append("\\[" if c == "[" else c)  # a `[` inside a class is itself (ECMA, Python)
            i += 1
            continue
        if c == "[":
            in_class = True
            j = i + 1 + pattern.startswith("^", i + 1)
            if pattern.startswith("]", j):  # `[]...]`, `[^]...]`: a leading `]` is a member (Python, RE2)
                j += 1
            out.append(pattern[i:j])
            i = j
            continue
        if c == "(" and pattern.startswith("(?", i):
            rest = pattern[i + 2:i + 4]
            if rest[:1] in ("=", "!") or rest in ("<=", "<!"):
                lookaround = True
            elif rest[:1] == ">":
                raise refuse("an atomic group (?>...)")
            elif rest[:1] == "(":
                raise refuse("a conditional group (?(...)...)")
            elif pattern.startswith("(?P=", i):
                raise refuse("a backreference (?P=name)")
        out.append(c)
        i += 1
    return "".join(out), lookaround


def _unicode_escape(p: str, i: int) -> tuple[Any, int]:
    """The code point of the `\\u` escape at `p[i]` and the index after it; (None, i) if malformed."""
    if p.startswith("{", i + 2):
        end = p.find("}", i + 3)
        digits = p[i + 3:end] if end > 0 else ""
        if 0 < len(digits) <= 6 and set(digits) <= _HEX:
            return int(digits, 16), end + 1
        return None, i
    digits = p[i + 2:i + 6]
    if len(digits) != 4 or not set(digits) <= _HEX:
        return None, i
    cp, end = int(digits, 16), i + 6
    low = p[end + 2:end + 6]
    if 0xD800 <= cp < 0xDC00 and p.startswith("\\u", end) and len(low) == 4 and set(low) <= _HEX \
            and 0xDC00 <= int(low, 16) < 0xE000:
        cp, end = 0x10000 + ((cp - 0xD800) << 10) + (int(low, 16) - 0xDC00), end + 6
    return cp, end


class _Re2:
    """A pattern RE2 runs, on UTF-8 bytes (no character offsets to map back; a lone surrogate in a
    JSON string is no error)."""

    engine = "re2"

    def __init__(self, compiled: Any):
        self.r = compiled

    def search(self, text: str) -> bool:
        return self.r.search(text.encode("utf-8", "surrogatepass")) is not None


# -- the lookaround fallback ------------------------------------------------------------------------
class _Program:
    """A Thompson NFA: per state a kind ("atom": one character, "at": an anchor, "look": a
    lookaround, "split", "match"), its argument (a one-character or zero-width compiled Python
    pattern; (lookaround, negated)) and its successors. `reverse`: built right to left (a
    lookahead's, scanned from the end of the text)."""

    def __init__(self, tree: list[Node], flags: int, reverse: bool, budget: list[int]):
        self.kind: list[str] = []
        self.arg: list[Any] = []
        self.out: list[list[int]] = []
        self.looks: list[_Look] = []
        self.reverse, self.budget = reverse, budget
        self.start = self._seq(tree, self._add("match", None, []), flags)

    def _add(self, kind: str, arg: Any, out: list[int]) -> int:
        self.budget[0] -= 1
        if self.budget[0] < 0:
            raise UnsupportedPattern(f"needs more than {MAX_STATES} automaton states (with its lookaround)")
        self.kind.append(kind)
        self.arg.append(arg)
        self.out.append(out)
        return len(self.kind) - 1

    def _seq(self, items: list[Node], nxt: int, flags: int) -> int:
        for node in (items if self.reverse else items[::-1]):
            nxt = self._node(node, nxt, flags)
        return nxt

    def _node(self, node: Node, nxt: int, flags: int) -> int:
        if isinstance(node, Char):
            return self._add("atom", _mini(node, flags), [nxt])
        if isinstance(node, Anchor):
            return self._add("at", _mini(node, flags), [nxt])
        if isinstance(node, Branch):
            return self._add("split", None, [self._seq(alt, nxt, flags) for alt in node.alternatives])
        if isinstance(node, Group):
            return self._seq(node.body, nxt, (flags | node.add) & ~node.remove)
        if isinstance(node, Repeat) and node.mode != "possessive":
            lo, hi, sub = node.lo, node.hi, node.body
            s = nxt
            if hi is None:
                loop = s = self._add("split", None, [])
                self.out[loop] += [self._seq(sub, loop, flags), nxt]
            else:
                for _ in range(hi - lo):
                    s = self._add("split", None, [self._seq(sub, s, flags), s])
            for _ in range(lo):
                s = self._seq(sub, s, flags)
            return s
        if isinstance(node, Look):
            look = _Look(_Program(node.body, flags, not node.behind, self.budget), ahead=not node.behind)
            self.looks.append(look)
            return self._add("look", (look, node.negate), [nxt])
        raise UnsupportedPattern(  # a possessive repeat: it gives back nothing, which a Thompson NFA cannot say
            "uses a possessive quantifier, which no linear-time regex engine runs")

    def scan(self, text: str, memo: dict, first: bool) -> Any:
        """Forward (backward for a reversed program), a thread started at every position: whether
        some thread reaches "match" at each position (`first`: stop at the first, return True)."""
        n, kind, arg, out = len(text), self.kind, self.arg, self.out
        seen, stamp = [0] * len(kind), 0
        hits = [False] * (n + 1)
        current: list[int] = []
        for i in (range(n, -1, -1) if self.reverse else range(n + 1)):
            stamp += 1
            stack, atoms, matched = current + [self.start], [], False
            while stack:
                s = stack.pop()
                if seen[s] == stamp:
                    continue
                seen[s] = stamp
                k = kind[s]
                if k == "atom":
                    atoms.append(s)
                elif k == "split":
                    stack.extend(out[s])
                elif k == "match":
                    matched = True
                elif k == "at":
                    if arg[s].match(text, i) is not None:
                        stack.append(out[s][0])
                elif arg[s][0].holds(text, memo)[i] != arg[s][1]:  # a lookaround (negated or not)
                    stack.append(out[s][0])
            if matched:
                if first:
                    return True
                hits[i] = True
            at = i - 1 if self.reverse else i
            if not 0 <= at < n:
                break
            current = [out[s][0] for s in atoms if arg[s].match(text, at) is not None]
        return False if first else hits


class _Look:
    """A lookaround's program: whether it holds at each position of a text, one scan per text."""

    def __init__(self, program: _Program, ahead: bool):
        self.program, self.ahead = program, ahead

    def holds(self, text: str, memo: dict) -> list[bool]:
        got = memo.get(id(self))
        if got is None:
            got = memo[id(self)] = self.program.scan(text, memo, first=False)
        return got


def _mini(node: Union[Char, Anchor], flags: int) -> Any:
    """A compiled Python pattern of one character class or anchor, under the flags where it
    stands: O(1) per position."""
    return re.compile(node.source(), flags)


class _Nfa:
    """A lookaround pattern, Python's syntax and classes (re.search's reading of it), run by
    Thompson NFAs; each lookaround is the set of positions where it holds, one pass over the text."""

    engine = "lookaround"

    def __init__(self, pattern: str):
        try:
            tree = parse(pattern)
        except Unsupported as e:
            raise UnsupportedPattern(f"pattern {_short(pattern)}: uses {e.feature}, which no linear-time regex "
                                     "engine runs") from None
        except (RegexSyntaxError, RecursionError) as e:
            raise UnsupportedPattern(f"pattern {_short(pattern)}: {e}") from None
        budget = [MAX_STATES]
        try:
            self.program = _Program(tree.items, tree.flags, False, budget)
        except UnsupportedPattern as e:
            raise UnsupportedPattern(f"pattern {_short(pattern)}: {e}") from None
        except RecursionError:
            raise UnsupportedPattern(f"pattern {_short(pattern)} is nested too deep") from None
        self.states = MAX_STATES - budget[0]
        self.pattern = pattern

    def search(self, text: str) -> bool:
        if (len(text) + 1) * self.states > MAX_WORK:
            raise TextTooCostly(f"a text of {len(text)} characters is past what pattern {_short(self.pattern)} "
                                f"(with lookaround, {self.states} states) is checked against")
        return self.program.scan(text, {}, first=True)
