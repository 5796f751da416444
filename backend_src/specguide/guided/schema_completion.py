"""The shortest valid JSON value of a schema (`Schemas.shortest`), $refs resolved and allOf parts
merged; the budget's JSON scanner (json_scanner.py) completes open values with these."""
from __future__ import annotations

import json
from typing import Any

from .regex_completion import Unknown, shortest_match

_FORMATS = {"date": "2000-01-01", "time": "00:00:00Z", "date-time": "2000-01-01T00:00:00Z", "email": "a@a.aa",
            "uuid": "00000000-0000-0000-0000-000000000000", "ipv4": "0.0.0.0", "ipv6": "::", "hostname": "a",
            "uri": "a:a", "uri-reference": "a", "duration": "P0D"}


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
            node = merge_schemas(target, rest) if rest else target
        if isinstance(node, dict) and isinstance(node.get("allOf"), list):
            merged = {k: v for k, v in node.items() if k != "allOf"}
            for part in node["allOf"]:
                merged = merge_schemas(merged, self.resolve(part))
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
            return json_text(node["const"])
        if isinstance(node.get("enum"), list) and node["enum"]:
            return min((json_text(v) for v in node["enum"]), key=len)
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list):
                base = {k: v for k, v in node.items() if k != key}
                options = []
                for branch in node[key]:
                    try:
                        options.append(self.shortest(merge_schemas(base, self.resolve(branch))))
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
            return json_text(shortest_string(node))
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
            return "{" + ",".join(json_text(k) + ":" + self.shortest(v) for k, v in pairs) + "}"
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
                most = max((2 + len(json_text(k)) + self._size(v) for k, v in props.items() if k not in required),
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


def merge_schemas(a: Any, b: Any) -> Any:
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


def json_text(value: Any) -> str:
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
