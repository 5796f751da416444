"""JSON that closes within its budget: when the tokens left reach the shortest valid completion, follow it.

A `BudgetMatcher` wraps a JSON guide's matcher. It follows the accepted bytes with a scanner that
knows, at every point, which subschema each open container and the current value belong to, and
from that the shortest text that completes a valid document (`Scanner.completion`): the open
string, number or literal finished, each open object's missing required keys with their shortest
valid values (in the schema's key order, as the grammars generate them), each open array's
missing items, every container closed. Its tokens plus the stop token are the fewest this path needs.

With r tokens left (max_tokens minus those accepted, the stop token included), n needed and g the
most one free token can add (`Scanner.growth`: one more array item or optional key, in bytes):
while n + g + SLACK < r the grammar's mask stands, so after any token the answer can still close;
from then on the mask allows only the first token of the completion (its tokens are also the
forced tokens drafters propose), so the answer ends valid with finish reason "stop". Every
decision is a function of the matcher's own state, so draft positions get the same masks as plain
decoding: speculation stays lossless. Where the scanner cannot tell (an anyOf between objects, a
pattern-constrained string half written) or the grammar refuses the completion, it does nothing
and the grammar's mask stands. A regex guide gets the same through `RegexScanner`: the states of
an NFA of the regex after the text so far, and the shortest text that completes the match.
"""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch

try:  # the regex parser re uses (its old top-level names are deprecated since 3.11)
    from re import _constants as sre_constants  # type: ignore[attr-defined]
    from re import _parser as sre_parse  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - Python < 3.11
    import sre_constants  # type: ignore[no-redef]
    import sre_parse  # type: ignore[no-redef]

from ..request import InvalidRequestError
from .backend import CompiledGuide, Encode, Matcher, fill_by_class

SLACK = 8  # tokens kept in hand beyond what one free token may add to the completion
_WS = b" \t\n\r"
_JSON_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")
_FORMATS = {"date": "2000-01-01", "time": "00:00:00Z", "date-time": "2000-01-01T00:00:00Z", "email": "a@a.aa",
            "uuid": "00000000-0000-0000-0000-000000000000", "ipv4": "0.0.0.0", "ipv6": "::", "hostname": "a",
            "uri": "a:a", "uri-reference": "a", "duration": "P0D"}


class Unknown(Exception):
    """The scanner cannot tell the shortest completion from here (the budget then does nothing)."""


# ---------------------------------------------------------------------------------------------
# the shortest valid value of a schema


class Schemas:
    """A JSON schema's nodes, $refs resolved, with the shortest valid value of each (memoized)."""

    def __init__(self, root: Any):
        self.root = root
        self._short: dict[int, tuple[Any, str]] = {}  # id -> (the node, kept alive so its id stays its own; text)
        self._busy: set[int] = set()
        self._extra: dict[tuple[int, str], tuple[Any, int]] = {}  # (id, kind) -> (the node, kept alive; bytes)

    def resolve(self, node: Any) -> Any:
        """The node with its local $ref followed and its allOf parts merged (shallow)."""
        for _ in range(32):
            if not isinstance(node, dict) or "$ref" not in node:
                break
            target = self._pointer(node["$ref"])
            rest = {k: v for k, v in node.items() if k != "$ref"}
            node = _merge(target, rest) if rest else target
        if isinstance(node, dict) and isinstance(node.get("allOf"), list):
            merged = {k: v for k, v in node.items() if k != "allOf"}
            for part in node["allOf"]:
                merged = _merge(merged, self.resolve(part))
            node = merged
        return node

    def _pointer(self, ref: str) -> Any:
        if not ref.startswith("#"):
            raise Unknown(f"remote $ref {ref}")
        node = self.root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, list):
                node = node[int(part)]
            elif isinstance(node, dict) and part in node:
                node = node[part]
            else:
                raise Unknown(f"$ref {ref} does not resolve")
        return node

    def shortest(self, node: Any) -> str:
        """The shortest JSON text valid for `node` (compact)."""
        node = self.resolve(node)
        if node is True or node == {} or node is None:
            return "0"
        if node is False:
            raise Unknown("false schema")
        key = id(node)
        if key in self._short:
            return self._short[key][1]
        if key in self._busy:  # a recursive schema: its shortest value does not recurse (else no finite value)
            raise Unknown("recursion")
        self._busy.add(key)
        try:
            out = self._shortest(node)
        finally:
            self._busy.discard(key)
        self._short[key] = (node, out)
        return out

    def _shortest(self, node: dict) -> str:
        if "const" in node:
            return _dump(node["const"])
        if isinstance(node.get("enum"), list) and node["enum"]:
            return min((_dump(v) for v in node["enum"]), key=len)
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list):
                base = {k: v for k, v in node.items() if k != key}
                options = []
                for branch in node[key]:
                    try:
                        options.append(self.shortest(_merge(base, self.resolve(branch))))
                    except Unknown:
                        pass
                if not options:
                    raise Unknown(f"no branch of {key} has a shortest value")
                return min(options, key=len)
        types = node.get("type")
        if types is None:
            types = "object" if "properties" in node or "required" in node else \
                "array" if "items" in node or "prefixItems" in node else None
        if types is None:
            return "0"
        options = []
        for t in (types if isinstance(types, list) else [types]):
            try:
                options.append(self._typed(node, t))
            except Unknown:
                pass
        if not options:
            raise Unknown(f"no shortest value for type {types}")
        return min(options, key=len)

    def _typed(self, node: dict, t: str) -> str:
        if t == "null":
            return "null"
        if t == "boolean":
            return "true"
        if t in ("integer", "number"):
            return _number(node, t == "integer")
        if t == "string":
            return _dump(shortest_string(node))
        if t == "array":
            prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
            n = int(node.get("minItems", 0) or 0)
            items = [self.shortest(prefix[i] if i < len(prefix) else node.get("items", {})) for i in range(n)]
            return "[" + ",".join(items) + "]"
        if t == "object":
            props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
            required = [k for k in props if k in set(node.get("required", []))]
            extra = [k for k in node.get("required", []) if k not in props]
            if extra and node.get("additionalProperties") is False:
                raise Unknown("a required key that may not appear")
            pairs = [(k, props[k]) for k in required] + [(k, node.get("additionalProperties", {})
                                                          if isinstance(node.get("additionalProperties"), dict) else {})
                                                         for k in extra]
            need = int(node.get("minProperties", 0) or 0) - len(pairs)
            optional = sorted((k for k in props if k not in required), key=lambda k: len(k) + len(self._try(props[k])))
            pairs += [(k, props[k]) for k in optional[:max(0, need)]]
            if len(pairs) < int(node.get("minProperties", 0) or 0):
                raise Unknown("minProperties beyond the declared keys")
            order = {k: i for i, k in enumerate(props)}
            pairs.sort(key=lambda kv: order.get(kv[0], len(order)))
            return "{" + ",".join(_dump(k) + ":" + self.shortest(v) for k, v in pairs) + "}"
        raise Unknown(f"type {t}")

    def extra(self, node: Any, kind: str) -> int:
        """Bytes one more element of an object / array of this schema can add at most (memoized)."""
        node = self.resolve(node)
        node = node if isinstance(node, dict) else {}
        key = (id(node), kind)
        if key not in self._extra:
            most = 0
            if kind == "array":
                subs = list(node.get("prefixItems", [])) if isinstance(node.get("prefixItems"), list) else []
                subs.append(node.get("items", {}) if isinstance(node.get("items"), (dict, bool)) else {})
                most = max(1 + self._size(sub) for sub in subs)
            else:
                props = node.get("properties", {}) if isinstance(node.get("properties"), dict) else {}
                required = set(node.get("required", []))
                most = max((2 + len(_dump(k)) + self._size(v) for k, v in props.items() if k not in required),
                           default=0)
                if node.get("additionalProperties") is not False and not node.get("patternProperties"):
                    extra = node.get("additionalProperties", {})
                    most = max(most, 20 + self._size(extra if isinstance(extra, dict) else {}))
            self._extra[key] = (node, min(most, 256))
        return self._extra[key][1]

    def _size(self, node: Any) -> int:
        """Bytes of the shortest value (64 where it cannot be told: a recursive schema)."""
        try:
            return len(self.shortest(node))
        except Unknown:
            return 64

    def _try(self, node: Any) -> str:
        try:
            return self.shortest(node)
        except Unknown:
            return "x" * 1000


def _merge(a: Any, b: Any) -> Any:
    """Two schemas of the same instance, shallowly combined (properties and required united)."""
    if not isinstance(a, dict) or not isinstance(b, dict):
        return b if isinstance(a, bool) or a is None else a
    out = dict(a)
    for k, v in b.items():
        if k == "properties" and isinstance(out.get(k), dict) and isinstance(v, dict):
            out[k] = {**out[k], **v}
        elif k == "required" and isinstance(out.get(k), list) and isinstance(v, list):
            out[k] = list(dict.fromkeys(out[k] + v))
        else:
            out.setdefault(k, v)
    return out


def _dump(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _number(node: dict, integer: bool) -> str:
    lo = node.get("minimum")
    if isinstance(node.get("exclusiveMinimum"), (int, float)) and not isinstance(node["exclusiveMinimum"], bool):
        lo = node["exclusiveMinimum"] + (1 if integer else 0.5)
    hi = node.get("maximum")
    if isinstance(node.get("exclusiveMaximum"), (int, float)) and not isinstance(node["exclusiveMaximum"], bool):
        hi = node["exclusiveMaximum"] - (1 if integer else 0.5)
    v: float = 0
    if lo is not None and v < lo:
        v = lo
    if hi is not None and v > hi:
        v = hi
    m = node.get("multipleOf")
    if isinstance(m, (int, float)) and m > 0 and v % m:
        v = (v // m + 1) * m
    if integer or float(v).is_integer():
        return str(int(-(-v // 1)) if integer else int(v))
    return repr(float(v))


def shortest_string(node: dict) -> str:
    """The shortest string a string schema accepts (minLength, format, pattern)."""
    fmt = node.get("format")
    if isinstance(fmt, str) and fmt in _FORMATS:
        return _FORMATS[fmt]
    if isinstance(fmt, str) and fmt not in ("regex",):
        raise Unknown(f"format {fmt}")
    n = int(node.get("minLength", 0) or 0)
    if isinstance(node.get("pattern"), str):
        s = shortest_match(node["pattern"])
        if len(s) < n:
            raise Unknown("pattern and minLength")
        return s
    return "a" * n


def shortest_match(pattern: str, prefix: str = "") -> str:
    """The shortest text that, after `prefix`, makes a string JSON Schema's `pattern` accepts
    (a search: unanchored ends take anything); Unknown when none (or the regex is beyond this)."""
    return _Nfa(pattern).shortest_end(prefix)


_MAX_COPIES = 64  # {m,n} with n - m beyond this is taken as {m,} (the grammar's own check still holds)
_PICKS = "a0A_-. "  # representative characters tried first for a character class


class _Nfa:
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


# ---------------------------------------------------------------------------------------------
# the scanner: where in the document the accepted bytes are


@dataclass(frozen=True)
class Frame:
    """An open object or array, or the scalar being written (`kind` "scalar": its schema). `phase`:
    what comes next ('key?' after '{', 'key' after ',', ':' after a key, 'value' after ':' or
    '[' / ',' in an array, 'more' after a value)."""

    kind: str  # "object" | "array" | "scalar"
    schema: Any
    phase: str
    keys: tuple[str, ...] = ()  # object: keys so far (the last is the current one)
    items: int = 0  # array: values so far


@dataclass(frozen=True)
class State:
    """Open containers (outermost first), then the scalar being written: `lex` None between values,
    else ("string" | "key" | "number" | "literal", bytes so far (strings: after the quote))."""

    stack: tuple[Frame, ...] = ()
    lex: Optional[tuple[str, bytes]] = None
    done: bool = False  # the top-level value is complete


class Scanner:
    """Follows JSON bytes against a schema: State -> State, raising Unknown where it cannot."""

    def __init__(self, schemas: Schemas):
        self.s = schemas

    def child(self, frame: Optional[Frame]) -> Any:
        """The schema of the value that comes next in `frame` (the root's at the top)."""
        if frame is None:
            return self.s.root
        node = self.s.resolve(frame.schema)
        if not isinstance(node, dict):
            return {}
        if frame.kind == "array":
            prefix = node.get("prefixItems")
            if isinstance(prefix, list) and frame.items < len(prefix):
                return prefix[frame.items]
            return node.get("items", {}) if isinstance(node.get("items"), (dict, bool)) else {}
        key = frame.keys[-1]
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        if key in props:
            return props[key]
        for pat, sub in (node.get("patternProperties") or {}).items():
            if re.search(pat, key):
                return sub
        extra = node.get("additionalProperties", {})
        return extra if isinstance(extra, (dict, bool)) else {}

    def value_schema(self, node: Any, first: int) -> Any:
        """The branch of `node` a value starting with byte `first` takes (anyOf / oneOf by JSON type)."""
        node = self.s.resolve(node)
        if not isinstance(node, dict):
            return node
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list):
                base = {k: v for k, v in node.items() if k != key}
                fits = [b for b in (self.s.resolve(x) for x in node[key]) if _starts(b, first)]
                if len(fits) != 1:
                    if len(fits) > 1 and first not in b"{[":
                        return {}  # several scalar branches: a scalar closes the same way in each
                    raise Unknown(f"{key}: {len(fits)} branches start with {chr(first)!r}")
                return _merge(base, fits[0])
        return node

    def start(self) -> State:
        return State()

    def feed(self, state: State, data: bytes) -> State:
        for c in data:
            state = self._byte(state, c)
        return state

    def _byte(self, st: State, c: int) -> State:
        lex, stack = st.lex, st.stack
        top = stack[-1] if stack else None
        if lex is not None:
            kind, buf = lex
            if kind in ("string", "key"):
                if _string_closed(buf, c):
                    if kind == "key":
                        key = json.loads(b'"' + buf + b'"')
                        return State(stack[:-1] + (dataclasses.replace(top, keys=top.keys + (key,), phase=":"),))
                    return self._after_value(State(stack))
                return State(stack, (kind, buf + bytes([c])))
            if kind == "number" and (48 <= c <= 57 or c in b"+-.eE"):
                return State(stack, (kind, buf + bytes([c])))
            if kind == "literal" and 97 <= c <= 122:
                return State(stack, (kind, buf + bytes([c])))
            st = self._after_value(State(stack))  # the number / literal ended at this byte
            return self._byte(st, c)
        if c in _WS:
            return st
        if st.done:
            raise Unknown("bytes after the document")
        if top is not None and top.kind == "object" and top.phase in ("key?", "key"):
            if c == ord('"'):
                return State(stack, ("key", b""))
            if c == ord("}") and top.phase == "key?":
                return self._after_value(State(stack[:-1]))
            raise Unknown(f"byte {chr(c)!r} where a key goes")
        if top is not None and top.phase == ":":
            if c != ord(":"):
                raise Unknown("no colon after a key")
            return State(stack[:-1] + (dataclasses.replace(top, phase="value"),))
        if top is not None and top.phase == "more":
            if c == ord(","):
                nxt = "key" if top.kind == "object" else "value"
                return State(stack[:-1] + (dataclasses.replace(top, phase=nxt),))
            if c == ord("}" if top.kind == "object" else "]"):
                return self._after_value(State(stack[:-1]))
            raise Unknown(f"byte {chr(c)!r} after a value")
        if top is not None and top.kind == "array" and c == ord("]") and top.items == 0:
            return self._after_value(State(stack[:-1]))
        # a value starts here
        schema = self.value_schema(self.child(top), c)
        if top is not None and top.kind == "array":  # its schema decided: count it now
            stack = stack[:-1] + (dataclasses.replace(top, phase="value"),)
        if c == ord("{"):
            return State(stack + (Frame("object", schema, "key?"),))
        if c == ord("["):
            return State(stack + (Frame("array", schema, "value"),))
        if c == ord('"'):
            return State(stack + (Frame("scalar", schema, ""),), ("string", b""))
        if c == ord("-") or 48 <= c <= 57:
            return State(stack + (Frame("scalar", schema, ""),), ("number", bytes([c])))
        if c in b"tfn":
            return State(stack + (Frame("scalar", schema, ""),), ("literal", bytes([c])))
        raise Unknown(f"byte {chr(c)!r} cannot start a value")

    def _after_value(self, st: State) -> State:
        """A value just ended: drop its scalar frame, advance the container."""
        stack = st.stack
        if stack and stack[-1].kind == "scalar":
            stack = stack[:-1]
        if not stack:
            return State((), None, True)
        top = stack[-1]
        items = top.items + 1 if top.kind == "array" else top.items
        return State(stack[:-1] + (dataclasses.replace(top, phase="more", items=items),))

    # -- the shortest completion -------------------------------------------------------------

    def completion(self, st: State) -> str:
        """The shortest text that ends a valid document from `st`."""
        if st.done:
            return ""
        out, stack = [], list(st.stack)
        if not stack and st.lex is None:
            return self.s.shortest(self.s.root)
        if st.lex is not None:
            kind, buf = st.lex
            if kind == "key":
                top = stack.pop()
                key, key_text, value = self._finish_key(top, buf)
                out.append(key_text + ":" + value)
                stack.append(dataclasses.replace(top, keys=top.keys + (key,), phase="more"))
            else:
                scalar = stack.pop()
                out.append(_finish_scalar(kind, buf, self.s.resolve(scalar.schema)))
                _value_done(stack)
        while stack:
            out.append(self._close(stack.pop()))
            _value_done(stack)
        return "".join(out)

    def _finish_key(self, top: Frame, buf: bytes) -> tuple[str, str, str]:
        """(the key, the rest of its text, its value's shortest text) for a key being written:
        keys come in the schema's order, so one of the properties after the last declared key,
        up to the first missing required one."""
        node = self.s.resolve(top.schema)
        node = node if isinstance(node, dict) else {}
        props = node.get("properties", {}) if isinstance(node.get("properties"), dict) else {}
        if _escape_end(buf):
            raise Unknown("a half-written escape in a key")
        done, prefix, required = set(top.keys), _decoded_prefix(buf), set(node.get("required", []))
        later: list[str] = []
        for k in list(props)[self._next_index(top, props):]:
            if k not in done:
                later.append(k)
                if k in required:
                    break
        options = [k for k in later if k.startswith(prefix)]
        if not options:
            if node.get("additionalProperties") is False or node.get("patternProperties"):
                raise Unknown("a key that matches no declared key")
            extra = node.get("additionalProperties", {})
            return prefix, '"', self.s.shortest(extra if isinstance(extra, dict) else {})
        if later[-1] in required and later[-1] in options:  # any other key only adds to the keys still due
            key = later[-1]
        else:
            key = min(options, key=lambda k: len(k) + len(self.s.shortest(props[k])))
        return key, _dump(key)[1:][len(_dump(prefix)[1:-1]):], self.s.shortest(props[key])

    def _next_index(self, top: Frame, props: dict) -> int:
        """Keys come in the schema's order: the first property index after the last declared key."""
        names = list(props)
        last = -1
        for k in top.keys:
            if k in props:
                last = max(last, names.index(k))
        return last + 1

    def growth(self, st: State) -> int:
        """The most bytes one more element adds to the completion, over the open containers (one
        token may close inner ones and start an element of an outer one: `},{"`): an array's item,
        an object's optional key (any of them: an upper bound; a free object's: a 20-byte key)."""
        return max((self.s.extra(top.schema, top.kind) for top in st.stack if top.kind != "scalar"), default=0)

    def _close(self, top: Frame) -> str:
        node = self.s.resolve(top.schema)
        node = node if isinstance(node, dict) else {}
        if top.kind == "array":
            text = ""
            if top.phase == "value":  # after '[' or ',': an item must come unless '[' closes at once
                if top.items > 0 or int(node.get("minItems", 0) or 0) > 0:
                    text += self.s.shortest(self.child(top))
                    top = dataclasses.replace(top, items=top.items + 1, phase="more")
            for _ in range(top.items, int(node.get("minItems", 0) or 0)):
                text += "," + self.s.shortest(self.child(top))
                top = dataclasses.replace(top, items=top.items + 1)
            return text + "]"
        props = node.get("properties", {}) if isinstance(node.get("properties"), dict) else {}
        text = ""
        if top.phase == ":":
            top = dataclasses.replace(top, phase="value")
            text += ":"
        if top.phase == "value":
            text += self.s.shortest(self.child(top))
            top = dataclasses.replace(top, phase="more")
        done = set(top.keys)
        missing = [k for k in list(props)[self._next_index(top, props):]
                   if k in set(node.get("required", [])) and k not in done]
        missing += [k for k in node.get("required", []) if k not in props and k not in done]
        pairs = [_dump(k) + ":" + self.s.shortest(props.get(k, node.get("additionalProperties", {})
                                                               if isinstance(node.get("additionalProperties"), dict)
                                                               else {})) for k in missing]
        if top.phase == "key":  # after ',': a key must come
            if not pairs:
                later = [k for k in list(props)[self._next_index(top, props):] if k not in done]
                if not later:
                    raise Unknown("a comma with no key left to write")
                k = min(later, key=lambda k: len(k) + len(self.s.shortest(props[k])))
                pairs = [_dump(k) + ":" + self.s.shortest(props[k])]
            return text + ",".join(pairs) + "}"
        if top.phase == "key?":
            return text + ",".join(pairs) + "}"
        return text + "".join("," + p for p in pairs) + "}"


def _in_bounds(v: float, node: dict) -> bool:
    def num(k: str) -> Optional[float]:
        x = node.get(k)
        return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None
    lo, hi, xlo, xhi = num("minimum"), num("maximum"), num("exclusiveMinimum"), num("exclusiveMaximum")
    return ((lo is None or v >= lo) and (hi is None or v <= hi) and (xlo is None or v > xlo)
            and (xhi is None or v < xhi))


def _value_done(stack: list[Frame]) -> None:
    """The value inside stack[-1] (if any) is complete."""
    if stack:
        top = stack[-1]
        stack[-1] = dataclasses.replace(top, phase="more", items=top.items + (top.kind == "array"))


def _starts(node: Any, first: int) -> bool:
    """Whether a value valid for `node` may start with byte `first`."""
    if not isinstance(node, dict):
        return node is not False
    if "const" in node or "enum" in node:
        values = [node["const"]] if "const" in node else node["enum"]
        return any(_dump(v).encode()[:1] == bytes([first]) for v in values)
    types = node.get("type")
    if types is None:
        return True
    want = {ord("{"): "object", ord("["): "array", ord('"'): "string", ord("t"): "boolean", ord("f"): "boolean",
            ord("n"): "null"}.get(first, "number")
    names = types if isinstance(types, list) else [types]
    return want in names or (want == "number" and "integer" in names)


def _string_closed(buf: bytes, c: int) -> bool:
    """Whether byte `c` (a quote) closes a string whose content so far is `buf`."""
    if c != ord('"'):
        return False
    backslashes = len(buf) - len(buf.rstrip(b"\\"))
    return backslashes % 2 == 0


def _escape_end(buf: bytes) -> str:
    """What completes a half-written escape at the end of a string's bytes ('' when none)."""
    body = buf.rstrip(b"\\")
    if (len(buf) - len(body)) % 2:
        return "\\"  # a lone backslash: make it an escaped backslash
    m = re.search(rb"(\\+)u([0-9a-fA-F]{0,3})$", buf)
    if m and len(m.group(1)) % 2:
        return "0" * (4 - len(m.group(2)))
    return ""


def _decoded_prefix(buf: bytes) -> str:
    """The characters of a partial JSON string (a half-written escape dropped)."""
    for cut in range(len(buf), max(-1, len(buf) - 7), -1):
        try:
            return json.loads(b'"' + buf[:cut] + b'"')
        except ValueError:
            continue
    raise Unknown("undecodable string prefix")


def _finish_scalar(kind: str, buf: bytes, node: Any) -> str:
    node = node if isinstance(node, dict) else {}
    if kind == "literal":
        for word in ("true", "false", "null"):
            if word.encode().startswith(buf):
                return word[len(buf):]
        raise Unknown("not a literal")
    if kind == "number":  # the fewest digits that make it a number within the schema's bounds
        text = buf.decode()
        for tail in ("", "0", "00", "000", "0000", "00000", "000000"):
            if not _JSON_NUMBER.fullmatch(text + tail):
                continue
            v = float(text + tail)
            if _in_bounds(v, node) and (node.get("type") != "integer" or v.is_integer()):
                return tail
        raise Unknown(f"no short end for the number {text!r}")
    # a string value: enum / const / pattern / format need a matching end
    escape = _escape_end(buf)
    if escape:
        buf += escape.encode()
    prefix = _decoded_prefix(buf)
    values = [node["const"]] if "const" in node else node.get("enum") if isinstance(node.get("enum"), list) else None
    if values is not None:
        fits = [v for v in values if isinstance(v, str) and v.startswith(prefix)]
        if not fits:
            raise Unknown("no enum value with this prefix")
        return _dump(min(fits, key=len))[1:][len(_dump(prefix)[1:-1]):]
    if isinstance(node.get("format"), str):
        if prefix:
            raise Unknown("a string with a format half written")
        return _dump(shortest_string(node))[1:]
    if isinstance(node.get("pattern"), str):
        end = shortest_match(node["pattern"], prefix)
        if len(prefix + end) < int(node.get("minLength", 0) or 0):
            raise Unknown("pattern and minLength")
        return escape + _dump(end)[1:]
    missing = max(0, int(node.get("minLength", 0) or 0) - len(prefix))
    return escape + "a" * missing + '"'


# ---------------------------------------------------------------------------------------------
# the matcher


class RegexScanner:
    """A regex guide's scanner (the whole answer matches): the NFA's states after the text so far;
    the completion is the shortest end of the match; one free token adds at most SLACK."""

    def __init__(self, pattern: str):
        self.nfa = _Nfa(pattern, full=True)

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


class BudgetPlan:
    """What every BudgetMatcher of one request shares: the scanner (a JSON schema's or a regex's),
    token bytes, encode, stop id, and the tokens the budget forced (position -> token; NOTE:
    written by grammar callbacks, read when the request ends)."""

    def __init__(self, scanner: Any, token_bytes: Sequence[bytes], encode: Encode, stop_id: int, budget: int):
        self.scanner = scanner
        self.token_bytes, self.encode, self.stop_id, self.budget = token_bytes, encode, stop_id, budget
        self.forced: dict[int, int] = {}

    def tokens(self, text: str) -> list[int]:
        return self.encode(text) if text else []

    def closed(self, output_ids: Sequence[int]) -> bool:
        """Whether the budget forced the end of this answer (a forced position the output took)."""
        return any(i < len(output_ids) and output_ids[i] == t for i, t in list(self.forced.items()))


class BudgetMatcher(Matcher):
    """A JSON guide's matcher that ends the document within `budget` tokens (module docstring)."""

    def __init__(self, inner: Matcher, plan: BudgetPlan):
        self.inner, self.plan = inner, plan
        self.states: list[Any] = [plan.scanner.start()]  # the scanner's state after each accepted token (None: Unknown)
        self._texts: dict[int, Optional[str]] = {}  # per state index: the completion's text
        self._growths: dict[int, int] = {}  # per state index: Scanner.growth
        self._plans: dict[int, Optional[list[int]]] = {}  # per state index: its verified tokens + stop

    # -- the completion ---------------------------------------------------------------------

    def _text(self) -> Optional[str]:
        """The shortest completion's text from the current state (None: cannot tell)."""
        i = len(self.states) - 1
        if i not in self._texts:
            st = self.states[-1]
            try:
                self._texts[i] = None if st is None else self.plan.scanner.completion(st)
            except Unknown:
                self._texts[i] = None
        return self._texts[i]

    def _growth(self) -> int:
        """Scanner.growth of the current state, in bytes (>= the tokens it may add)."""
        i = len(self.states) - 1
        if i not in self._growths:
            try:
                self._growths[i] = self.plan.scanner.growth(self.states[-1]) if self.states[-1] else 0
            except Unknown:
                self._growths[i] = 0
        return self._growths[i]

    def _completion(self) -> Optional[list[int]]:
        """The verified completion tokens (stop token last) from the current state, or None."""
        i = len(self.states) - 1
        if i not in self._plans:
            text, out = self._text(), None
            if text is not None:
                toks = self.plan.tokens(text) + [self.plan.stop_id]
                if self.inner.validate(toks) == len(toks):  # the grammar takes it, stop token included
                    out = toks
            self._plans[i] = out
        return self._plans[i]

    def left(self) -> int:
        """Tokens left in the budget (the one about to be chosen included)."""
        return self.plan.budget - (len(self.states) - 1)

    def forcing(self) -> Optional[list[int]]:
        """The completion tokens when the budget takes over from here, else None."""
        st = self.states[-1]
        if st is None or self.inner.is_terminated():
            return None
        text = self._text()  # a token holds at least a byte: no tokenizing while the bytes fit
        if text is None:
            return None
        margin = SLACK + self._growth()
        if len(text.encode()) + 1 + margin < self.left():
            return None
        comp = self._completion()
        if comp is None or len(comp) + margin < self.left():
            return None
        return comp

    # -- Matcher ----------------------------------------------------------------------------

    def accept(self, token: int) -> bool:
        t = int(token)
        if not self.inner.accept(t):
            return False
        st = self.states[-1]
        if st is not None and t != self.plan.stop_id:
            try:
                st = self.plan.scanner.feed(st, self.plan.token_bytes[t])
            except Unknown:
                st = None
        self.states.append(st)
        return True

    def rollback(self, n: int) -> None:
        if n > 0:
            self.inner.rollback(n)
            for i in range(len(self.states) - n, len(self.states)):
                self._plans.pop(i, None)
                self._texts.pop(i, None)
                self._growths.pop(i, None)
            del self.states[len(self.states) - n:]

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.inner.fill(bitmask, row)
        self._restrict(bitmask, row)

    def _restrict(self, bitmask: torch.Tensor, row: int) -> None:
        comp = self.forcing()
        if comp is None:
            return
        t = comp[0]
        self.plan.forced[len(self.states) - 1] = t
        words = bitmask.numpy()[row].view(np.uint32)  # bit t % 32 of word t // 32: token t allowed
        words[:] = 0
        words[t >> 5] = np.uint32(1 << (t & 31))

    def forced_tokens(self, encode: Encode, k: int) -> list[int]:
        comp = self.forcing()
        if comp is not None:
            return comp[:k]
        return self.inner.forced_tokens(encode, k)

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def is_completed(self) -> bool:
        return self.inner.is_completed()

    def reset(self) -> None:
        self.inner.reset()
        self.states = [self.plan.scanner.start()]
        self._plans.clear()
        self._texts.clear()
        self._growths.clear()

    def violation(self) -> Optional[str]:
        return self.inner.violation()

    @classmethod
    def fill_many(cls, matchers: list["BudgetMatcher"], bitmask: torch.Tensor, rows: list[int],
                  num_threads: int | str = "auto") -> None:
        fill_by_class([m.inner for m in matchers], bitmask, rows, num_threads)
        for m, r in zip(matchers, rows):
            m._restrict(bitmask, r)


def within_budget(guide: CompiledGuide, scanner: Any, budget: int, token_bytes: Sequence[bytes], encode: Encode,
                  stop_id: int) -> CompiledGuide:
    """`guide` whose matchers close the answer within `budget` tokens (stop token included);
    `scanner`: `Scanner(Schemas(schema))` for JSON guides, `RegexScanner(pattern)` for regex ones.
    InvalidRequestError when even the shortest valid answer's text does not fit; the guide unchanged
    where its shortest answer cannot be told or fits only without its stop token."""
    try:
        plan = BudgetPlan(scanner() if callable(scanner) else scanner, token_bytes, encode, stop_id, budget)
    except Unknown:
        return guide
    probe = BudgetMatcher(guide.matcher(), plan)
    first = probe._completion()
    if first is None:
        return guide
    if len(first) - 1 > budget:  # not even the text fits (the text without its stop token ends with "length")
        raise InvalidRequestError(
            f"max_tokens {budget} cannot hold a valid answer: the shortest one this guide accepts takes "
            f"{len(first) - 1} tokens")
    if len(first) > budget:  # the shortest text fits but not its stop token: no answer can end with "stop",
        return guide  # so the grammar alone decides (forcing would only replace the model's words)
    make = guide.make_matcher
    return dataclasses.replace(guide, make_matcher=lambda: BudgetMatcher(make(), plan), budget=plan)

