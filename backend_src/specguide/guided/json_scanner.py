"""Where in a JSON document the accepted bytes are (`Scanner`: State -> State against a schema),
and the shortest text that completes a valid document from there (`Scanner.completion`) and the
most one free token can add to it (`Scanner.growth`): the token budget's view (budget.py). The
end of a scalar being written comes from partial_scalar.py. A completion longer than the
schemas' `max_bytes` is never built (TooLong): its length is known before its text is.

Where several anyOf / oneOf branches may take a value (objects that all start with `{`), each is
followed as a reading of its own (`Readings`, at most MAX_READINGS): JSON's syntax is one, so the
readings share their containers and lexeme and differ only in schemas. A reading whose schema the
bytes break (a key its object forbids, a value outside its enum or const, a value of another type)
is dropped while another holds; the completions are the readings' ones, shortest first."""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any, Optional

from . import client_regex
from .partial_scalar import decoded_prefix, escape_end, finish_scalar
from .regex_completion import TooLong, Unknown, again, shortest_match
from .schema_completion import Schemas, count, json_text

_WS = b" \t\n\r"
# a string schema's keywords that say nothing of its text
_TEXT_FREE = frozenset({"type", "title", "description", "$comment", "examples", "default", "deprecated", "readOnly",
                        "writeOnly", "$id", "$anchor", "$schema"})
_PLAIN_CHARS = re.compile(rb'[^\x00-\x1f"\\]+')  # a string's characters that end no string nor escape


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
    weak: bool = False  # the bytes broke this reading's schema (kept only while no other reading holds)


@dataclass(frozen=True)
class Readings:
    """Several readings of the same bytes (module docstring): their containers and lexeme are one."""

    states: tuple[State, ...]

    @property
    def stack(self) -> tuple[Frame, ...]:
        return self.states[0].stack

    @property
    def lex(self) -> Optional[tuple[str, bytes]]:
        return self.states[0].lex

    @property
    def done(self) -> bool:
        return self.states[0].done


def _pack(states: tuple[State, ...]) -> "State | Readings":
    return states[0] if len(states) == 1 else Readings(states)


CLOSINGS_KEPT = 512  # closing texts a scanner memoizes (one per container configuration seen)
MAX_READINGS = 32  # readings followed at once; past it the scanner cannot tell (Unknown)
MAX_NESTING = 8  # anyOf / oneOf nested in branches, flattened as far as this


class Scanner:
    """Follows JSON bytes against a schema: State -> State, raising Unknown where it cannot."""

    def __init__(self, schemas: Schemas):
        self.s = schemas
        # the open containers' closing text (or why none) by their configuration; the schema
        # nodes are kept alive in the value, so no other node can take their ids while cached
        self._closings: dict[tuple, tuple[tuple[Any, ...], Any]] = {}
        self._orders: dict[int, tuple[Any, dict[str, int]]] = {}  # id(properties) -> (them; key -> index)

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
            try:
                hit = client_regex.search(pat, key)  # RE2: linear in the key, whatever the client's pattern
            except client_regex.ClientRegexError as e:
                raise Unknown(str(e)) from None
            if hit:
                return sub
        extra = node.get("additionalProperties", {})
        return extra if isinstance(extra, (dict, bool)) else {}

    def value_schemas(self, node: Any, first: int, depth: int = 0) -> list[Any]:
        """The schemas a value starting with byte `first` may take under `node`: the anyOf / oneOf
        branches (each merged with the node's other keywords; nested ones flattened) that may start
        so (none: [] ), else the node itself."""
        node = self.s.resolve(node)
        if not isinstance(node, dict):
            return [node]
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list):
                if depth >= MAX_NESTING:
                    raise Unknown(f"{key} nested more than {MAX_NESTING} deep")
                out: list[Any] = []
                for b in self.s.branches(node, key):
                    if _starts(self.s.resolve(b), first):
                        out += self.value_schemas(b, first, depth + 1)
                        if len(out) > MAX_READINGS:  # NOTE: checked as they come: nested anyOfs multiply
                            raise Unknown(f"more than {MAX_READINGS} readings")
                return out
        return [node]

    def allows_key(self, frame: Frame, key: str) -> bool:
        """Whether an object of this frame's schema may hold `key` (declared, or not forbidden)."""
        node = self.s.resolve(frame.schema)
        if not isinstance(node, dict) or node.get("additionalProperties") is not False or node.get("patternProperties"):
            return True
        props = node.get("properties")
        return isinstance(props, dict) and key in props

    def start(self) -> State:
        return State()

    def feed(self, state: "State | Readings", data: bytes) -> "State | Readings":
        states = state.states if isinstance(state, Readings) else (state,)
        i = 0
        while i < len(data):
            lex = states[0].lex
            if lex is not None and lex[0] in ("string", "key"):  # inside a string: up to its quote at once
                q = data.find(b'"', i)
                # (State(...) rather than dataclasses.replace: this runs for every token of a string)
                if q < 0:
                    return _pack(tuple(State(st.stack, (lex[0], st.lex[1] + data[i:]), st.done, st.weak)
                                       for st in states))
                if q > i:
                    states = tuple(State(st.stack, (lex[0], st.lex[1] + data[i:q]), st.done, st.weak) for st in states)
                    i = q
            states = self._step(states, data[i])
            i += 1
        return _pack(states)

    def _step(self, states: tuple[State, ...], c: int) -> tuple[State, ...]:
        """One byte for every reading: those it breaks are dropped while another holds."""
        strong: list[State] = []
        weak: list[State] = []
        error: Optional[Unknown] = None
        for st in states:
            try:
                for nxt in self._byte(st, c):
                    (weak if nxt.weak else strong).append(nxt)
            except Unknown as e:
                error = e
        out = strong or weak
        if not out:
            assert error is not None
            raise error
        if len(out) > MAX_READINGS:
            raise Unknown(f"more than {MAX_READINGS} readings")
        return tuple(out)

    def _byte(self, st: State, c: int) -> tuple[State, ...]:
        lex, stack, weak = st.lex, st.stack, st.weak
        top = stack[-1] if stack else None
        if lex is not None:
            kind, buf = lex
            if kind in ("string", "key"):
                if _string_closed(buf, c):
                    if kind == "key":
                        key = json.loads(b'"' + buf + b'"')
                        weak = weak or not self.allows_key(top, key)
                        return State(stack[:-1] + (dataclasses.replace(top, keys=top.keys + (key,), phase=":"),),
                                     weak=weak),
                    return self._after_value(State(stack, weak=weak or self._outside(top, b'"' + buf + b'"'))),
                return State(stack, (kind, buf + bytes([c])), weak=weak),
            if kind == "number" and (48 <= c <= 57 or c in b"+-.eE"):
                return State(stack, (kind, buf + bytes([c])), weak=weak),
            if kind == "literal" and 97 <= c <= 122:
                return State(stack, (kind, buf + bytes([c])), weak=weak),
            st = self._after_value(State(stack, weak=weak or self._outside(top, buf)))  # it ended at this byte
            return self._byte(st, c)
        if c in _WS:
            return st,
        if st.done:
            raise Unknown("bytes after the document")
        if top is not None and top.kind == "object" and top.phase in ("key?", "key"):
            if c == ord('"'):
                return State(stack, ("key", b""), weak=weak),
            if c == ord("}") and top.phase == "key?":
                return self._after_value(State(stack[:-1], weak=weak)),
            raise Unknown(f"byte {chr(c)!r} where a key goes")
        if top is not None and top.phase == ":":
            if c != ord(":"):
                raise Unknown("no colon after a key")
            return State(stack[:-1] + (dataclasses.replace(top, phase="value"),), weak=weak),
        if top is not None and top.phase == "more":
            if c == ord(","):
                nxt = "key" if top.kind == "object" else "value"
                return State(stack[:-1] + (dataclasses.replace(top, phase=nxt),), weak=weak),
            if c == ord("}" if top.kind == "object" else "]"):
                return self._after_value(State(stack[:-1], weak=weak)),
            raise Unknown(f"byte {chr(c)!r} after a value")
        if top is not None and top.kind == "array" and c == ord("]") and top.items == 0:
            return self._after_value(State(stack[:-1], weak=weak)),
        # a value starts here: one reading per schema it may take
        schemas = self.value_schemas(self.child(top), c)
        if top is not None and top.kind == "array":  # its schema decided: count it now
            stack = stack[:-1] + (dataclasses.replace(top, phase="value"),)
        if not schemas:  # no branch starts so, yet the grammar took it: follow the grammar (an untyped value)
            schemas, weak = [{}], True
        elif len(schemas) == 1:
            weak = weak or not _starts(self.s.resolve(schemas[0]), c)
        if c == ord("{"):
            return tuple(State(stack + (Frame("object", x, "key?"),), weak=weak) for x in schemas)
        if c == ord("["):
            return tuple(State(stack + (Frame("array", x, "value"),), weak=weak) for x in schemas)
        if c == ord('"'):
            lex = ("string", b"")
        elif c == ord("-") or 48 <= c <= 57:
            lex = ("number", bytes([c]))
        elif c in b"tfn":
            lex = ("literal", bytes([c]))
        else:
            raise Unknown(f"byte {chr(c)!r} cannot start a value")
        return tuple(State(stack + (Frame("scalar", x, ""),), lex, weak=weak) for x in schemas)

    def _outside(self, frame: Optional[Frame], text: bytes) -> bool:
        """Whether a scalar just written (its JSON text) is outside its schema's enum or const."""
        node = self.s.resolve(frame.schema) if frame is not None else None
        if not isinstance(node, dict) or ("const" not in node and not isinstance(node.get("enum"), list)):
            return False
        try:
            value = json.loads(text)
        except ValueError:
            return False
        values = [node["const"]] if "const" in node else node["enum"]
        return not any(value == v and type(value) is type(v) or _same_number(value, v) for v in values)

    def _after_value(self, st: State) -> State:
        """A value just ended: drop its scalar frame, advance the container."""
        stack = st.stack
        if stack and stack[-1].kind == "scalar":
            stack = stack[:-1]
        if not stack:
            return State((), None, True, st.weak)
        top = stack[-1]
        items = top.items + 1 if top.kind == "array" else top.items
        return State(stack[:-1] + (dataclasses.replace(top, phase="more", items=items),), weak=st.weak)

    # -- the shortest completion -------------------------------------------------------------

    def completions(self, state: "State | Readings") -> list[str]:
        """The readings' completions, shortest first (one per reading that can tell; duplicates
        dropped); TooLong when every reading's is too long, else Unknown when none can tell."""
        if not isinstance(state, Readings):
            return [self.completion(state)]
        texts: list[str] = []
        failures: list[Unknown] = []
        for st in state.states:
            try:
                texts.append(self.completion(st))
            except Unknown as e:
                failures.append(e)
        if not texts:
            long = [e for e in failures if isinstance(e, TooLong)]
            raise long[0] if len(long) == len(failures) else Unknown(f"no reading can tell: {failures[0]}")
        return sorted(dict.fromkeys(texts), key=len)

    def completion(self, st: "State | Readings") -> str:
        """The shortest text that ends a valid document from `st`."""
        if isinstance(st, Readings):
            return self.completions(st)[0]
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
                out.append(finish_scalar(kind, buf, self.s.resolve(scalar.schema), self.s.max_bytes))
                _value_done(stack)
        out.append(self._closing(stack))
        self.s.fits(sum(map(len, out)), "the completion")
        return "".join(out)

    def _closing(self, stack: list[Frame]) -> str:
        """The text that closes the open containers `stack` (innermost last), memoized: a value
        being written leaves its containers as they are, so most tokens find theirs here."""
        key = tuple((id(f.schema), f.kind, f.phase, f.keys, f.items) for f in stack)
        hit = self._closings.get(key)
        if hit is None:
            frames, out, size = list(stack), [], 0
            try:
                while frames:
                    out.append(self._close(frames.pop()))
                    size += len(out[-1])
                    self.s.fits(size, "the closing of the open containers")
                    _value_done(frames)
                text: Any = "".join(out)
            except Unknown as e:
                text = e
            if len(self._closings) >= CLOSINGS_KEPT:
                self._closings.clear()
            hit = self._closings[key] = (tuple(f.schema for f in stack), text)
        if isinstance(hit[1], Unknown):
            raise again(hit[1])
        return hit[1]

    def _finish_key(self, top: Frame, buf: bytes) -> tuple[str, str, str]:
        """(the key, the rest of its text, its value's shortest text) for a key being written:
        keys come in the schema's order, so one of the properties after the last declared key,
        up to the first missing required one."""
        node = self.s.resolve(top.schema)
        node = node if isinstance(node, dict) else {}
        props = node.get("properties", {}) if isinstance(node.get("properties"), dict) else {}
        if escape_end(buf):
            raise Unknown("a half-written escape in a key")
        done, prefix, required = set(top.keys), decoded_prefix(buf), set(_required(node))
        later: list[str] = []
        for k in list(props)[self._next_index(top, props):]:
            if k not in done:
                later.append(k)
                if k in required:
                    break
        options = [k for k in later if k.startswith(prefix)]
        if not options and isinstance(node.get("patternProperties"), dict) and node["patternProperties"]:
            return self._pattern_key(node, prefix)
        if not options:
            if node.get("additionalProperties") is False:
                raise Unknown("a key that matches no declared key")
            extra = node.get("additionalProperties", {})
            value = self.s.shortest(extra if isinstance(extra, dict) else {})
            owed = [k for k in _required(node) if k not in props and k not in done and k.startswith(prefix)]
            if owed:  # a required key the properties do not declare: this key may as well be it
                key = min(owed, key=len)
                return key, json_text(key)[1:][len(json_text(prefix)[1:-1]):], value
            return prefix, '"', value
        if later[-1] in required and later[-1] in options:  # any other key only adds to the keys still due
            key = later[-1]
        else:
            key = min(options, key=lambda k: len(k) + self.s.cost(props[k]))
        return key, json_text(key)[1:][len(json_text(prefix)[1:-1]):], self.s.shortest(props[key])

    def _pattern_key(self, node: dict, prefix: str) -> tuple[str, str, str]:
        """(key, rest of its text, value) for a key being written in an object with
        patternProperties: the shortest key a pattern takes after `prefix` with its value, or
        (where other keys may come) the key as it stands with an additional value."""
        options: list[tuple[str, str]] = []
        for pattern, sub in node["patternProperties"].items():
            try:
                key = prefix + shortest_match(pattern, prefix, self.s.max_bytes)
                options.append((key, self.s.shortest(sub)))
            except Unknown:
                continue
        if node.get("additionalProperties") is not False:
            extra = node.get("additionalProperties", {})
            options.append((prefix, self.s.shortest(extra if isinstance(extra, dict) else {})))
        if not options:
            raise Unknown("a key that matches no pattern")
        key, value = min(options, key=lambda kv: len(json_text(kv[0])) + len(kv[1]))
        return key, json_text(key)[1:][len(json_text(prefix)[1:-1]):], value

    def _next_index(self, top: Frame, props: dict) -> int:
        """Keys come in the schema's order: the first property index after the last declared key."""
        if not props:
            return 0
        hit = self._orders.get(id(props))
        if hit is None:
            hit = self._orders[id(props)] = (props, {k: i for i, k in enumerate(props)})
        order = hit[1]
        return max((order[k] for k in top.keys if k in order), default=-1) + 1

    def growth(self, st: "State | Readings") -> int:
        """The most bytes one more element adds to the completion, over the open containers (one
        token may close inner ones and start an element of an outer one: `},{"`): an array's item,
        an object's optional key (any of them: an upper bound; a free object's: a 20-byte key); where
        a value is due, the container one token may open with its first element; the most over the
        readings."""
        most = 0
        for s in st.states if isinstance(st, Readings) else (st,):
            most = max([most] + [self.s.extra(top.schema, top.kind) for top in s.stack if top.kind != "scalar"])
            top = s.stack[-1] if s.stack else None
            if s.lex is None and not s.done and (top is None or top.phase in (":", "value")):
                most = max(most, self._opening(self.child(top)))
        return most

    def _string_schemas(self, st: "State | Readings") -> Optional[list[dict]]:
        """The schema of the string each reading of `st` is inside ({} for a non-dict one); None when
        some reading is not inside a string value or its schema cannot be resolved."""
        nodes = []
        for s in st.states if isinstance(st, Readings) else (st,):
            if s.lex is None or s.lex[0] != "string" or not s.stack:
                return None
            try:
                node = self.s.resolve(s.stack[-1].schema)
            except Unknown:
                return None
            nodes.append(node if isinstance(node, dict) else {})
        return nodes

    def plain_end(self, st: "State | Readings") -> bool:
        """Whether every reading of `st` is inside a plain string (no const, enum, format, pattern or
        minLength) whose bytes so far decode whole, no escape half written: its completion is the
        quote and the containers' closing, whatever characters follow (`extends`)."""
        nodes = self._string_schemas(st)
        if nodes is None or escape_end(st.lex[1]):
            return False
        try:
            json.loads(b'"' + st.lex[1] + b'"')  # (the readings share their lexeme)
        except ValueError:
            return False
        return not any("const" in node or isinstance(node.get("enum"), list) or isinstance(node.get("format"), str)
                       or isinstance(node.get("pattern"), str) or count(node.get("minLength")) for node in nodes)

    def free_text(self, st: "State | Readings") -> bool:
        """Whether every reading of `st` is inside a string whose schema says nothing of its text (no
        keyword but `type` and annotations): the grammar then takes any characters there, at any
        length, and its mask after whole characters is the same (what a plain_end state that extends
        another may copy)."""
        nodes = self._string_schemas(st)
        return nodes is not None and all(set(node) <= _TEXT_FREE for node in nodes)

    @staticmethod
    def extends(a: "State | Readings", b: "State | Readings") -> bool:
        """Whether `b` is `a` with more characters of the same string: the same containers, bytes that
        add no quote, backslash or control character and decode whole. Where `plain_end(a)`, then
        `plain_end(b)` too, and b's completions and growth are a's (the bytes do not enter them)."""
        xs = a.states if isinstance(a, Readings) else (a,)
        ys = b.states if isinstance(b, Readings) else (b,)
        if len(xs) != len(ys):
            return False
        for x, y in zip(xs, ys):
            if x.stack is not y.stack or x.weak != y.weak or x.lex is None or y.lex is None or x.lex[0] != y.lex[0]:
                return False
        old, new = xs[0].lex[1], ys[0].lex[1]
        if len(new) <= len(old) or not new.startswith(old) or any(x.lex[1] != old for x in xs[1:]) \
                or any(y.lex[1] != new for y in ys[1:]):  # (readings share their lexeme: a check)
            return False
        delta = new[len(old):]
        if not _PLAIN_CHARS.fullmatch(delta):
            return False
        try:
            delta.decode()
        except UnicodeDecodeError:
            return False
        return True

    def _opening(self, node: Any) -> int:
        """The most bytes one token that starts the value due here (`[{`, `{"`) commits to: the
        shortest array or object it opens, and one element of it (memoized in the schemas)."""
        most = 0
        for c, kind in ((ord("["), "array"), (ord("{"), "object")):
            for branch in self.value_schemas(node, c):
                if _starts(self.s.resolve(branch), c):
                    most = max(most, self.s.size(branch) + self.s.extra(branch, kind))
        return most

    def _close(self, top: Frame) -> str:
        node = self.s.resolve(top.schema)
        node = node if isinstance(node, dict) else {}
        if top.kind == "array":
            parts, need = [], count(node.get("minItems"))
            if top.phase == "value":  # after '[' or ',': an item must come unless '[' closes at once
                if top.items > 0 or need > 0:
                    parts.append(self.s.shortest(self.child(top)))
                    top = dataclasses.replace(top, items=top.items + 1, phase="more")
            prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
            while top.items < min(need, len(prefix)):  # each prefixItems entry has its own value
                parts.append("," + self.s.shortest(self.child(top)))
                top = dataclasses.replace(top, items=top.items + 1)
            if top.items < need:  # the rest: copies of one item, measured before they are made
                item = "," + self.s.shortest(self.child(top))
                self.s.fits(sum(map(len, parts)) + (need - top.items) * len(item) + 1, "the minItems array")
                parts.append(item * (need - top.items))
            return "".join(parts) + "]"
        props = node.get("properties", {}) if isinstance(node.get("properties"), dict) else {}
        text = ""
        if top.phase == ":":
            top = dataclasses.replace(top, phase="value")
            text += ":"
        if top.phase == "value":
            text += self.s.shortest(self.child(top))
            top = dataclasses.replace(top, phase="more")
        done, required = set(top.keys), _required(node)
        wanted = set(required)
        missing = [k for k in list(props)[self._next_index(top, props):] if k in wanted and k not in done]
        missing += [k for k in required if k not in props and k not in done]
        pairs = [json_text(k) + ":" + self.s.shortest(props.get(k, node.get("additionalProperties", {})
                                                               if isinstance(node.get("additionalProperties"), dict)
                                                               else {})) for k in missing]
        self.s.fits(len(text) + sum(map(len, pairs)) + len(pairs) + 1, "the object")
        if top.phase == "key":  # after ',': a key must come
            if not pairs:
                later = [k for k in list(props)[self._next_index(top, props):] if k not in done]
                if later:
                    k = min(later, key=lambda k: len(k) + self.s.cost(props[k]))
                    pairs = [json_text(k) + ":" + self.s.shortest(props[k])]
                elif isinstance(node.get("patternProperties"), dict) and node["patternProperties"]:
                    key, _, value = self._pattern_key(node, "")
                    if key in done:
                        raise Unknown("a comma whose shortest key is written already")
                    pairs = [json_text(key) + ":" + value]
                else:
                    raise Unknown("a comma with no key left to write")
            return text + ",".join(pairs) + "}"
        if top.phase == "key?":
            return text + ",".join(pairs) + "}"
        return text + "".join("," + p for p in pairs) + "}"


def _required(node: dict) -> list[str]:
    """A schema's `required` keys (strings only)."""
    req = node.get("required")
    return [k for k in req if isinstance(k, str)] if isinstance(req, list) else []


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
        return any(json_text(v).encode()[:1] == bytes([first]) for v in values)
    types = node.get("type")
    if types is None:
        return True
    want = {ord("{"): "object", ord("["): "array", ord('"'): "string", ord("t"): "boolean", ord("f"): "boolean",
            ord("n"): "null"}.get(first, "number")
    names = types if isinstance(types, list) else [types]
    return want in names or (want == "number" and "integer" in names)


def _same_number(a: Any, b: Any) -> bool:
    """1 and 1.0 are one JSON number (booleans are not numbers)."""
    return all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b)) and a == b


def _string_closed(buf: bytes, c: int) -> bool:
    """Whether byte `c` (a quote) closes a string whose content so far is `buf`."""
    if c != ord('"'):
        return False
    backslashes = len(buf) - len(buf.rstrip(b"\\"))
    return backslashes % 2 == 0
