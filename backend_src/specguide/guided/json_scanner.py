"""Where in a JSON document the accepted bytes are (`Scanner`: State -> State against a schema),
and the shortest text that completes a valid document from there (`Scanner.completion`) and the
most one free token can add to it (`Scanner.growth`): the token budget's view (budget.py). The
end of a scalar being written comes from partial_scalar.py. A completion longer than the
schemas' `max_bytes` is never built (TooLong): its length is known before its text is."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Optional

from . import client_regex
from .partial_scalar import decoded_prefix, escape_end, finish_scalar
from .regex_completion import Unknown, again
from .schema_completion import Schemas, count, json_text

_WS = b" \t\n\r"


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


CLOSINGS_KEPT = 512  # closing texts a scanner memoizes (one per container configuration seen)


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

    def value_schema(self, node: Any, first: int) -> Any:
        """The branch of `node` a value starting with byte `first` takes (anyOf / oneOf by JSON type)."""
        node = self.s.resolve(node)
        if not isinstance(node, dict):
            return node
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list):
                fits = [i for i, x in enumerate(node[key]) if _starts(self.s.resolve(x), first)]
                if len(fits) != 1:
                    if len(fits) > 1 and first not in b"{[":
                        return {}  # several scalar branches: a scalar closes the same way in each
                    raise Unknown(f"{key}: {len(fits)} branches start with {chr(first)!r}")
                return self.s.branches(node, key)[fits[0]]
        return node

    def start(self) -> State:
        return State()

    def feed(self, state: State, data: bytes) -> State:
        i = 0
        while i < len(data):
            lex = state.lex
            if lex is not None and lex[0] in ("string", "key"):  # inside a string: up to its quote at once
                q = data.find(b'"', i)
                if q < 0:
                    return State(state.stack, (lex[0], lex[1] + data[i:]))
                if q > i:
                    state, i = State(state.stack, (lex[0], lex[1] + data[i:q])), q
            state = self._byte(state, data[i])
            i += 1
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
        if not options:
            if node.get("additionalProperties") is False or node.get("patternProperties"):
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

    def _next_index(self, top: Frame, props: dict) -> int:
        """Keys come in the schema's order: the first property index after the last declared key."""
        if not props:
            return 0
        hit = self._orders.get(id(props))
        if hit is None:
            hit = self._orders[id(props)] = (props, {k: i for i, k in enumerate(props)})
        order = hit[1]
        return max((order[k] for k in top.keys if k in order), default=-1) + 1

    def growth(self, st: State) -> int:
        """The most bytes one more element adds to the completion, over the open containers (one
        token may close inner ones and start an element of an outer one: `},{"`): an array's item,
        an object's optional key (any of them: an upper bound; a free object's: a 20-byte key)."""
        return max((self.s.extra(top.schema, top.kind) for top in st.stack if top.kind != "scalar"), default=0)

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
                if not later:
                    raise Unknown("a comma with no key left to write")
                k = min(later, key=lambda k: len(k) + self.s.cost(props[k]))
                pairs = [json_text(k) + ":" + self.s.shortest(props[k])]
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


def _string_closed(buf: bytes, c: int) -> bool:
    """Whether byte `c` (a quote) closes a string whose content so far is `buf`."""
    if c != ord('"'):
        return False
    backslashes = len(buf) - len(buf.rstrip(b"\\"))
    return backslashes % 2 == 0
