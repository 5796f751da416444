"""The tree of a regular expression in Python's syntax (regex_syntax.parse builds it), read by the
automata of our own: regex_completion.py (the shortest end of a match) and client_regex.py
(patterns with lookaround).

A pattern is a list of nodes: `Char` (one character: a literal, `.`, an escape or a class),
`Anchor` (`^ $ \\A \\Z \\b \\B`), `Group` (capturing, or with flags), `Branch` (alternatives),
`Repeat` (a quantifier: greedy, lazy or possessive) and `Look` (a lookahead or lookbehind).
Characters and anchors compare by value (alternatives' common leading ones are merged), the
other nodes by identity."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

MAX_WIDTH = 1 << 64  # min_width saturates here (as re's own count does)

ANY = ("any",)  # the item of `.`
Item = tuple  # ("lit", code) | ("range", lo, hi) | ("cat", one of "dDsSwW") | ANY


@dataclass(frozen=True)
class Char:
    """One character: `items` (literals, ranges, categories, or ANY alone for `.`), `negate` for `[^...]`."""

    items: tuple[Item, ...]
    negate: bool = False

    def source(self) -> str:
        """This character in re's syntax (to compile it alone, under the flags where it stands)."""
        if self.items == (ANY,):
            return "."
        parts = [f"\\U{it[1]:08x}" if it[0] == "lit" else f"\\U{it[1]:08x}-\\U{it[2]:08x}" if it[0] == "range"
                 else "\\" + it[1] for it in self.items]
        return ("[^" if self.negate else "[") + "".join(parts) + "]"


@dataclass(frozen=True)
class Anchor:
    """A zero-width test, by its syntax: "^", "$", "\\A", "\\Z", "\\b" or "\\B"."""

    kind: str

    def source(self) -> str:
        """The anchor in re's syntax."""
        return self.kind


@dataclass(eq=False)
class Group:
    """`(...)`, `(?P<name>...)`, or `(?flags-flags:...)` (`add` / `remove`: re flags inside it)."""

    body: list[Node]
    capture: bool
    add: int = 0
    remove: int = 0


@dataclass(eq=False)
class Branch:
    """`a|b|...`: two or more alternatives."""

    alternatives: list[list[Node]]


@dataclass(eq=False)
class Repeat:
    """`body` from `lo` to `hi` times (None: no limit); `mode`: "greedy", "lazy" or "possessive"."""

    body: list[Node]
    lo: int
    hi: Optional[int]
    mode: str = "greedy"


@dataclass(eq=False)
class Look:
    """`(?=...)`, `(?!...)` (negate), `(?<=...)`, `(?<!...)` (behind)."""

    body: list[Node]
    behind: bool
    negate: bool


Node = Union[Char, Anchor, Group, Branch, Repeat, Look]


@dataclass
class Regex:
    """A parsed pattern: its nodes and its global flags (an inline `(?i)` at the start, ...)."""

    items: list[Node]
    flags: int


def min_width(items: list[Node]) -> int:
    """The fewest characters a match of `items` has (re's count, saturating at MAX_WIDTH)."""
    total = 0
    for node in items:
        if isinstance(node, Char):
            total += 1
        elif isinstance(node, Group):
            total += min_width(node.body)
        elif isinstance(node, Branch):
            total += min(min_width(alt) for alt in node.alternatives)
        elif isinstance(node, Repeat):
            total += node.lo * min_width(node.body)
    return min(total, MAX_WIDTH)
