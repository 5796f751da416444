"""Python's regular-expression syntax (what `re` reads) parsed into the tree of regex_tree.py: the
public stand-in for re's private parser, for the automata of our own (regex_completion.py,
client_regex.py). It reads every construct as re does: the same escapes, classes, quantifiers,
groups, inline flags and verbose mode, the same errors (RegexSyntaxError, with re's message), and
re's shortcuts, so an automaton built from this tree has the shape one built from re's has: a
non-capturing group without flags is spliced into its sequence, alternatives' common leading nodes
move before the branch, and alternatives of one character each become one class.

Refused (`Unsupported`, a RegexSyntaxError that names the feature): backreferences, conditional
groups, atomic groups. One pass over the pattern: linear in its length (Python's recursion for
nested groups only)."""
from __future__ import annotations

import re
import unicodedata
from typing import Optional, Union

from .regex_tree import ANY, Anchor, Branch, Char, Group, Item, Look, Node, Regex, Repeat

MAX_REPEAT = (1 << 32) - 1  # a repetition count from here on is refused, as re refuses it

FLAGS = {"a": int(re.ASCII), "i": int(re.IGNORECASE), "L": int(re.LOCALE), "m": int(re.MULTILINE),
         "s": int(re.DOTALL), "u": int(re.UNICODE), "x": int(re.VERBOSE)}
_TYPE_FLAGS = int(re.ASCII | re.LOCALE | re.UNICODE)
_SPECIAL = ".\\[{()*+?^$|"
_WHITESPACE = frozenset(" \t\n\r\v\f")
_DIGITS, _OCT, _HEX = frozenset("0123456789"), frozenset("01234567"), frozenset("0123456789abcdefABCDEF")
_ESCAPES = {"\\a": 7, "\\b": 8, "\\f": 12, "\\n": 10, "\\r": 13, "\\t": 9, "\\v": 11, "\\\\": 92}
_CATEGORIES = frozenset("dDsSwW")
_ANCHORS = {"\\A", "\\b", "\\B", "\\Z"}


class RegexSyntaxError(ValueError):
    """Not a pattern re accepts (re's message and the position), or one with an `Unsupported` construct."""


class Unsupported(RegexSyntaxError):
    """A construct no automaton here runs; `feature` names it ("a backreference", ...)."""

    def __init__(self, feature: str, pos: int):
        super().__init__(f"{feature} is not supported, at position {pos}")
        self.feature = feature


def parse(pattern: str) -> Regex:
    """The tree of `pattern`; RegexSyntaxError where re refuses it or it holds an Unsupported construct
    (RecursionError for groups nested past Python's recursion limit)."""
    p = _Parser(pattern)
    items = p.alternation(False, 0)
    if p.peek() is not None:
        raise p.error("unbalanced parenthesis")
    if p.flags & FLAGS["a"] and p.flags & FLAGS["u"]:
        raise RegexSyntaxError("ASCII and UNICODE flags are incompatible")
    return Regex(items, p.flags)


def _merge(alts: list[list[Node]]) -> list[Node]:
    """Alternatives as re keeps them: common leading nodes first, one class if each is one character."""
    k, first = 0, alts[0]
    while all(k < len(a) for a in alts) and all(a[k] == first[k] for a in alts[1:]):
        k += 1
    out, alts = first[:k], [a[k:] for a in alts]
    items: list[Item] = []
    for alt in alts:
        node = alt[0] if len(alt) == 1 else None
        if not isinstance(node, Char) or node.negate or node.items == (ANY,):
            out.append(Branch(alts))
            return out
        items.extend(node.items)
    out.append(Char(tuple(dict.fromkeys(items))))
    return out


class _Parser:
    """Recursive descent over re's tokens (a character, or a backslash and the character after it)."""

    def __init__(self, pattern: str):
        self.s, self.i, self.flags, self.names = pattern, 0, 0, set()

    def error(self, msg: str) -> RegexSyntaxError:
        return RegexSyntaxError(f"{msg} at position {self.i}")

    def peek(self) -> Optional[str]:
        if self.i >= len(self.s):
            return None
        if self.s[self.i] != "\\":
            return self.s[self.i]
        if self.i + 1 >= len(self.s):
            raise self.error("bad escape (end of pattern)")
        return self.s[self.i:self.i + 2]

    def get(self) -> Optional[str]:
        tok = self.peek()
        if tok is not None:
            self.i += len(tok)
        return tok

    def match(self, tok: str) -> bool:
        if self.peek() == tok:
            self.i += len(tok)
            return True
        return False

    def take(self, n: int, charset: frozenset) -> str:
        """Up to `n` characters of `charset`."""
        j = self.i
        while j < len(self.s) and j - self.i < n and self.s[j] in charset:
            j += 1
        out, self.i = self.s[self.i:j], j
        return out

    def until(self, end: str, what: str) -> str:
        out = ""
        while True:
            tok = self.get()
            if tok is None:
                raise self.error(f"missing {end}, unterminated name" if out else f"missing {what}")
            if tok == end:
                if not out:
                    raise self.error(f"missing {what}")
                return out
            out += tok

    def alternation(self, verbose: bool, nested: int) -> list[Node]:
        alts: list[list[Node]] = []
        while True:
            alts.append(self.sequence(verbose, nested + 1, not nested and not alts))
            if not self.match("|"):
                break
            if not nested:
                verbose = bool(self.flags & FLAGS["x"])
        return alts[0] if len(alts) == 1 else _merge(alts)

    def sequence(self, verbose: bool, nested: int, first: bool) -> list[Node]:
        items: list[Node] = []
        while True:
            tok = self.peek()
            if tok is None or tok in "|)":
                break
            self.get()
            if verbose and tok in _WHITESPACE:
                continue
            if verbose and tok == "#":
                while self.get() not in (None, "\n"):
                    pass
            elif tok[0] == "\\":
                items.append(self.escape(tok))
            elif tok not in _SPECIAL:
                items.append(Char((("lit", ord(tok)),)))
            elif tok == "[":
                items.append(self.char_class())
            elif tok in "*+?{":
                self.repeat(tok, items)
            elif tok == ".":
                items.append(Char((ANY,)))
            elif tok in "^$":
                items.append(Anchor(tok))
            else:  # "(": its head here, its body by recursion, so a level of nesting costs two frames
                start = self.i - 1
                head = self.group_head(start)
                if head is None:  # a comment
                    continue
                if head == "global":
                    if not first or items:
                        raise self.error("global flags not at the start of the expression")
                    verbose = bool(self.flags & FLAGS["x"])
                    continue
                kind, add, remove = head
                x = FLAGS["x"]
                body = self.alternation((verbose or bool(add & x)) and not remove & x, nested + 1)
                if not self.match(")"):
                    raise self.error("missing ), unterminated subpattern")
                items.append(Look(body, kind[1] == "<", kind[-1] == "!") if kind[0] == "?"
                             else Group(body, kind == "capture", add, remove))
        out: list[Node] = []
        for node in items:  # re splices a plain non-capturing group into its sequence
            if isinstance(node, Group) and not (node.capture or node.add or node.remove):
                out.extend(node.body)
            else:
                out.append(node)
        return out

    def group_head(self, start: int) -> Union[None, str, tuple[str, int, int]]:
        """After "(": None for a comment, "global" for global flags, else (kind, flags on, flags off);
        kind "capture", "group", or a lookaround's "?=", "?!", "?<=", "?<!"."""
        if not self.match("?"):
            return "capture", 0, 0
        c = self.get()
        if c is None:
            raise self.error("unexpected end of pattern")
        if c == "P":
            if self.match("<"):
                name = self.until(">", "group name")
                if not name.isidentifier():
                    raise self.error(f"bad character in group name {name!r}")
                if name in self.names:
                    raise self.error(f"redefinition of group name {name!r}")
                self.names.add(name)
                return "capture", 0, 0
            if self.peek() == "=":
                raise Unsupported("a backreference", start)
            c = self.get()
            raise self.error("unexpected end of pattern" if c is None else "unknown extension ?P" + c)
        if c == ":":
            return "group", 0, 0
        if c == "#":
            while self.peek() is not None:
                if self.get() == ")":
                    return None
            raise self.error("missing ), unterminated comment")
        if c in "=!":
            return "?" + c, 0, 0
        if c == "<":
            d = self.get()
            if d is None:
                raise self.error("unexpected end of pattern")
            if d not in "=!":
                raise self.error("unknown extension ?<" + d)
            return "?<" + d, 0, 0
        if c == "(":
            raise Unsupported("a conditional group", start)
        if c == ">":
            raise Unsupported("an atomic group", start)
        if c in FLAGS or c == "-":
            return self.flags_head(c)
        raise self.error("unknown extension ?" + c)

    def flags_head(self, c: str) -> Union[str, tuple[str, int, int]]:
        """`(?aiLmsux)` (global: "global") or `(?aiLmsux-imsx:` (scoped), re's checks."""
        add = remove = 0
        if c != "-":
            while True:
                if c == "L":
                    raise self.error("bad inline flags: cannot use 'L' flag with a str pattern")
                add |= FLAGS[c]
                if FLAGS[c] & _TYPE_FLAGS and add & _TYPE_FLAGS != FLAGS[c]:
                    raise self.error("bad inline flags: flags 'a', 'u' and 'L' are incompatible")
                c = self.get()
                if c is None:
                    raise self.error("missing -, : or )")
                if c in ")-:":
                    break
                if c not in FLAGS:
                    raise self.error("unknown flag" if c.isalpha() else "missing -, : or )")
        if c == ")":
            self.flags |= add
            return "global"
        if c == "-":
            c = self.get()
            if c is None or c not in FLAGS:
                raise self.error("missing flag" if c is None or not c.isalpha() else "unknown flag")
            while True:
                if FLAGS[c] & _TYPE_FLAGS:
                    raise self.error("bad inline flags: cannot turn off flags 'a', 'u' and 'L'")
                remove |= FLAGS[c]
                c = self.get()
                if c is None:
                    raise self.error("missing :")
                if c == ":":
                    break
                if c not in FLAGS:
                    raise self.error("unknown flag" if c.isalpha() else "missing :")
        if add & remove:
            raise self.error("bad inline flags: flag turned on and off")
        return "group", add, remove

    def repeat(self, tok: str, items: list[Node]) -> None:
        """A quantifier after items[-1] (or, for a `{` that is none, the literal `{`)."""
        here = self.i
        lo, hi = {"?": (0, 1), "*": (0, None), "+": (1, None)}.get(tok, (0, None))
        if tok == "{":
            if self.peek() == "}":
                items.append(Char((("lit", ord("{")),)))
                return
            low = self.take(len(self.s), _DIGITS)
            high = self.take(len(self.s), _DIGITS) if self.match(",") else low
            if not self.match("}"):
                items.append(Char((("lit", ord("{")),)))
                self.i = here
                return
            if any(len(n.lstrip("0")) > 10 or int(n or 0) >= MAX_REPEAT for n in (low, high)):
                raise RegexSyntaxError(f"the repetition number is too large at position {here}")
            lo, hi = int(low or 0), (int(high) if high else None)
            if hi is not None and hi < lo:
                raise self.error("min repeat greater than max repeat")
        if not items or isinstance(items[-1], Anchor):
            raise self.error("nothing to repeat")
        if isinstance(items[-1], Repeat):
            raise self.error("multiple repeat")
        last = items[-1]
        body = last.body if isinstance(last, Group) and not (last.capture or last.add or last.remove) else [last]
        mode = "lazy" if self.match("?") else "possessive" if self.match("+") else "greedy"
        items[-1] = Repeat(body, lo, hi, mode)

    def char_class(self) -> Char:
        """After "[": the class up to its "]" (a "]" first is a member)."""
        items: list[Item] = []
        negate = self.match("^")
        while True:
            tok = self.get()
            if tok is None:
                raise self.error("unterminated character set")
            if tok == "]" and items:
                break
            first = self.class_escape(tok) if tok[0] == "\\" else ("lit", ord(tok))
            if not self.match("-"):
                items.append(first)
                continue
            tok2 = self.get()
            if tok2 is None:
                raise self.error("unterminated character set")
            if tok2 == "]":
                items += [first, ("lit", ord("-"))]
                break
            last = self.class_escape(tok2) if tok2[0] == "\\" else ("lit", ord(tok2))
            if first[0] != "lit" or last[0] != "lit" or last[1] < first[1]:
                raise self.error(f"bad character range {tok}-{tok2}")
            items.append(("range", first[1], last[1]))
        return Char(tuple(dict.fromkeys(items)), negate)

    def class_escape(self, tok: str) -> Item:
        """An escape inside a class: `\\b` is a backspace, anchors are refused."""
        if tok in _ESCAPES:
            return ("lit", _ESCAPES[tok])
        if tok[1] in _CATEGORIES:
            return ("cat", tok[1])
        if tok[1] in _OCT:
            code = int(tok[1] + self.take(2, _OCT), 8)
            if code > 0o377:
                raise self.error(f"octal escape value {tok}... outside of range 0-0o377")
            return ("lit", code)
        return self.plain_escape(tok)

    def escape(self, tok: str) -> Node:
        """An escape outside a class: a category, an anchor, a character; `\\1`...: a backreference."""
        if tok[1] in _CATEGORIES:
            return Char((("cat", tok[1]),))
        if tok in _ANCHORS:
            return Anchor(tok)
        if tok in _ESCAPES:
            return Char((("lit", _ESCAPES[tok]),))
        if tok[1] == "0":
            return Char((("lit", int(self.take(2, _OCT) or "0", 8)),))
        if tok[1] in _DIGITS:  # three octal digits are a character, else a group's number
            octal = self.s[self.i:self.i + 2]
            if tok[1] in _OCT and len(octal) == 2 and set(octal) <= _OCT:
                code = int(tok[1] + self.take(2, _OCT), 8)
                if code > 0o377:
                    raise self.error(f"octal escape value {tok}... outside of range 0-0o377")
                return Char((("lit", code),))
            raise Unsupported("a backreference", self.i - 2)
        return Char((self.plain_escape(tok),))

    def plain_escape(self, tok: str) -> Item:
        """`\\x..`, `\\u....`, `\\U........`, `\\N{name}`, or an escaped non-letter (itself)."""
        c = tok[1]
        if c in "xuU":
            digits = self.take({"x": 2, "u": 4, "U": 8}[c], _HEX)
            if len(digits) != {"x": 2, "u": 4, "U": 8}[c]:
                raise self.error(f"incomplete escape {tok}{digits}")
            if int(digits, 16) > 0x10FFFF:
                raise self.error(f"bad escape {tok}{digits}")
            return ("lit", int(digits, 16))
        if c == "N":
            if not self.match("{"):
                raise self.error("missing {")
            name = self.until("}", "character name")
            try:
                return ("lit", ord(unicodedata.lookup(name)))
            except KeyError:
                raise self.error(f"undefined character name {name!r}") from None
        if c.isascii() and c.isalnum():
            raise self.error(f"bad escape {tok}")
        return ("lit", ord(c))
