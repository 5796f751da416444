"""The shortest valid JSON value of a schema (`Schemas.shortest`), $refs resolved and allOf parts
merged; the budget's JSON scanner (json_scanner.py) completes open values with these.

Bounded whatever the schema says (issue 75): a value longer than `max_bytes` is never built
(`TooLong`: its length is known from its parts before they are joined, so `minItems` nested ten
deep costs ten steps, not 1000^10 bytes); all the values one request builds take at most
`Work.limit` bytes and `Work.max_steps` schema nodes; derived nodes ($ref with siblings, allOf,
anyOf branches) are made once per content, so $ref chains are not walked once per path."""
from __future__ import annotations

import json
from typing import Any, Optional

from .regex_completion import MAX_BYTES, TooLong, Unknown, again, shortest_match

_FORMATS = {"date": "2000-01-01", "time": "00:00:00Z", "date-time": "2000-01-01T00:00:00Z", "email": "a@a.aa",
            "uuid": "00000000-0000-0000-0000-000000000000", "ipv4": "0.0.0.0", "ipv6": "::", "hostname": "a",
            "uri": "a:a", "uri-reference": "a", "duration": "P0D"}
_DATE = r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
_TIME = r"([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]+)?([Zz]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
# what a format's string looks like, to end one half written (the grammar checks the end it gives)
FORMAT_PATTERNS = {
    "date": f"^{_DATE}$", "time": f"^{_TIME}$", "date-time": f"^{_DATE}[Tt]{_TIME}$",
    "uuid": r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$",
    "ipv4": rf"^({_OCTET}\.){{3}}{_OCTET}$", "email": r"^[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}$",
    "hostname": r"^[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?)*$",
    "uri": r"^[A-Za-z][A-Za-z0-9+.-]*:[^\s]*$",
}
WORK_PER_BYTE = 8  # the bytes of shortest values a request may build, per byte of its completion cap
MAX_STEPS = 1 << 16  # schema nodes a request's shortest values may evaluate
_BASE_FIRST = "$specguide:base-first"  # on a merged allOf whose anyOf / oneOf came after properties


class Work:
    """What one request's shortest values may cost in all (shared by the schemas of its tags):
    `limit` bytes built, `max_steps` nodes evaluated; past either, what is not built yet is Unknown.
    `steps` and `used` are what was spent (the tests read them)."""

    def __init__(self, limit: int, max_steps: int = MAX_STEPS):
        self.limit, self.max_steps, self.used, self.steps = limit, max_steps, 0, 0

    def step(self) -> None:
        self.steps += 1
        if self.steps > self.max_steps or self.used > self.limit:
            raise Unknown(f"the shortest values take more than {self.max_steps} steps or {self.limit} bytes")

    def spend(self, nbytes: int) -> None:
        self.used += nbytes


def count(v: Any) -> int:
    """A schema's count keyword (minItems, minLength, ...) as an int >= 0 (saturating; 0 if not a number)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v <= 0:
        return 0
    return int(v) if v < 1 << 62 else 1 << 62


class Schemas:
    """A JSON schema's nodes, $refs resolved, with the shortest valid value of each (memoized);
    values longer than `max_bytes` raise TooLong."""

    def __init__(self, root: Any, max_bytes: int = MAX_BYTES, work: Optional[Work] = None):
        self.root = root
        self.max_bytes = max_bytes
        self.work = work if work is not None else Work(WORK_PER_BYTE * max_bytes)
        # id -> (the node, kept alive so its id stays its own; its text, or why it has none)
        self._short: dict[int, tuple[Any, Any]] = {}
        self._busy: set[int] = set()
        self._recursions = 0  # recursion hits so far: a failure that met one is not memoized
        self._extra: dict[tuple[int, str], tuple[Any, int]] = {}  # (id, kind) -> (the node, kept alive; bytes)
        self._resolved: dict[int, tuple[Any, Any]] = {}  # id -> (the node, kept alive; resolve's result)
        self._resolving: set[int] = set()
        self._merged: dict[tuple, tuple[Any, Any, Any]] = {}  # merge's key -> (a, b, kept alive; the merge)
        self._branches: dict[tuple[int, str], tuple[Any, list]] = {}  # (id, anyOf/oneOf) -> (node; branches)

    def resolve(self, node: Any) -> Any:
        """The node with its local $ref followed and its allOf parts merged (shallow), made once."""
        if not isinstance(node, dict) or ("$ref" not in node and "allOf" not in node):
            return node  # nothing to resolve (and nothing kept: `{}` defaults are made per call)
        hit = self._resolved.get(id(node))
        if hit is None:
            if id(node) in self._resolving:
                raise Unknown("a $ref / allOf cycle")
            self._resolving.add(id(node))
            try:
                hit = self._resolved[id(node)] = (node, self._resolve(node))
            finally:
                self._resolving.discard(id(node))
        return hit[1]

    def _resolve(self, node: Any) -> Any:
        for _ in range(32):
            if not isinstance(node, dict) or "$ref" not in node:
                break
            target = self._pointer(node["$ref"])
            rest = {k: v for k, v in node.items() if k != "$ref"}
            node = self.merge(target, rest) if rest else target
        if isinstance(node, dict) and isinstance(node.get("allOf"), list):
            merged = {k: v for k, v in node.items() if k != "allOf"}
            for part in node["allOf"]:
                part = self.resolve(part)
                if isinstance(part, dict) and ("anyOf" in part or "oneOf" in part) and merged.get("properties"):
                    merged = {**merged, _BASE_FIRST: True}  # keys of the parts before come before the branch's
                merged = self.merge(merged, part)
            node = merged
        return node

    def merge(self, a: Any, b: Any) -> Any:
        """merge_schemas(a, b), one node per content (a's and b's entries by identity), so nodes
        derived along different paths are one node, evaluated once."""
        if not isinstance(a, dict) or not isinstance(b, dict):
            return merge_schemas(a, b)
        if not a:
            return b
        key = (tuple((k, id(v)) for k, v in a.items()), id(b))
        hit = self._merged.get(key)
        if hit is None:
            hit = self._merged[key] = (a, b, merge_schemas(a, b))
        return hit[2]

    def branches(self, node: dict, key: str) -> list:
        """The anyOf / oneOf branches of a resolved node, each merged with the node's other keywords:
        the branch's properties first, as llguidance writes them, except after an allOf's earlier
        parts (whose keys come first)."""
        hit = self._branches.get((id(node), key))
        if hit is None:
            base = {k: v for k, v in node.items() if k != key}
            merged = [self.merge(base, self.resolve(b)) for b in node[key]]
            if not node.get(_BASE_FIRST):
                merged = [_branch_first(m, self.resolve(b)) for m, b in zip(merged, node[key])]
            hit = self._branches[(id(node), key)] = (node, merged)
        return hit[1]

    def _pointer(self, ref: Any) -> Any:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise Unknown(f"remote $ref {str(ref)[:40]}")
        node = self.root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            elif isinstance(node, dict) and part in node:
                node = node[part]
            else:
                raise Unknown(f"$ref {ref[:40]} does not resolve")
        return node

    def fits(self, nbytes: int, what: str) -> None:
        """TooLong when a value of `nbytes` bytes would pass the cap (checked before it is built)."""
        if nbytes > self.max_bytes:
            raise TooLong(what, self.max_bytes)

    def shortest(self, node: Any) -> str:
        """The shortest JSON text valid for `node` (compact); TooLong past max_bytes."""
        node = self.resolve(node)
        if node is True or node == {} or node is None:
            return "0"
        if node is False:
            raise Unknown("false schema")
        if not isinstance(node, dict):
            raise Unknown("not a schema")
        key = id(node)
        hit = self._short.get(key)
        if hit is not None:
            if isinstance(hit[1], Unknown):
                raise again(hit[1])
            return hit[1]
        if key in self._busy:  # a recursive schema: its shortest value does not recurse (else no finite value)
            self._recursions += 1
            raise Unknown("recursion")
        self.work.step()
        self._busy.add(key)
        before = self._recursions
        try:
            out = self._shortest(node)
        except Unknown as e:
            if self._recursions == before:  # not a recursion seen from here: the same from any path
                self._short[key] = (node, e)
            raise
        finally:
            self._busy.discard(key)
        self.work.spend(len(out))
        self._short[key] = (node, out)
        return out

    def _shortest(self, node: dict) -> str:
        if "const" in node:
            return json_text(node["const"])
        if isinstance(node.get("enum"), list) and node["enum"]:
            return min((json_text(v) for v in node["enum"]), key=len)
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list):
                return self._best(key, [lambda b=b: self.shortest(b) for b in self.branches(node, key)])
        types = node.get("type")
        if types is None:
            types = "object" if "properties" in node or "required" in node else \
                "array" if "items" in node or "prefixItems" in node else None
        if types is None:
            return "0"
        return self._best(f"type {types}", [lambda t=t: self._typed(node, t)
                                            for t in (types if isinstance(types, list) else [types])])

    def _best(self, what: str, options: list) -> str:
        """The shortest of the options that can be told; TooLong when each is too long."""
        if len(options) == 1:
            return options[0]()
        texts, long = [], 0
        for option in options:
            try:
                texts.append(option())
            except TooLong:
                long += 1
            except Unknown:
                pass
        if texts:
            return min(texts, key=len)
        if long and long == len(options):
            raise TooLong(f"every {what} option", self.max_bytes)
        raise Unknown(f"no shortest value for {what}")

    def _typed(self, node: dict, t: str) -> str:
        if t == "null":
            return "null"
        if t == "boolean":
            return "true"
        if t in ("integer", "number"):
            try:
                return _number(node, t == "integer")
            except (OverflowError, ValueError, TypeError, ZeroDivisionError):
                raise Unknown("bounds past the number range") from None
        if t == "string":
            return json_text(shortest_string(node, self.max_bytes))
        if t == "array":
            prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
            n = count(node.get("minItems"))
            items = [self.shortest(prefix[i]) for i in range(min(n, len(prefix)))]
            rest = n - len(items)
            item = self.shortest(node.get("items", {})) if rest else ""
            self.fits(2 + sum(map(len, items)) + rest * len(item) + max(0, n - 1), "the minItems array")
            return "[" + ",".join(items + [item] * rest) + "]"
        if t == "object":
            props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
            req = [k for k in node.get("required", []) if isinstance(k, str)] \
                if isinstance(node.get("required"), list) else []
            required = [k for k in props if k in set(req)]
            extra = [k for k in req if k not in props]
            if extra and node.get("additionalProperties") is False:
                raise Unknown("a required key that may not appear")
            pairs = [(k, props[k]) for k in required] + [(k, node.get("additionalProperties", {})
                                                          if isinstance(node.get("additionalProperties"), dict) else {})
                                                         for k in extra]
            least = count(node.get("minProperties"))
            if least > len(props) + len(extra):
                raise Unknown("minProperties beyond the declared keys")
            need = least - len(pairs)
            if need > 0:
                optional = sorted((k for k in props if k not in required), key=lambda k: len(k) + self.cost(props[k]))
                pairs += [(k, props[k]) for k in optional[:need]]
            order = {k: i for i, k in enumerate(props)}
            pairs.sort(key=lambda kv: order.get(kv[0], len(order)))
            texts = [json_text(k) + ":" + self.shortest(v) for k, v in pairs]
            self.fits(2 + sum(map(len, texts)) + len(texts), "the object")
            return "{" + ",".join(texts) + "}"
        raise Unknown(f"type {t}")

    def extra(self, node: Any, kind: str) -> int:
        """Bytes one more element of an object / array of this schema can add at most (memoized)."""
        node = self.resolve(node)
        node = node if isinstance(node, dict) else {}
        key = (id(node), kind) if node else (0, kind)  # every `{}` alike (defaults are made per call)
        if key not in self._extra:
            most = 0
            if kind == "array":
                subs = list(node.get("prefixItems", [])) if isinstance(node.get("prefixItems"), list) else []
                subs.append(node.get("items", {}) if isinstance(node.get("items"), (dict, bool)) else {})
                most = max(1 + self.size(sub) for sub in subs)
            else:
                props = node.get("properties", {}) if isinstance(node.get("properties"), dict) else {}
                required = set(k for k in node.get("required", []) if isinstance(k, str)) \
                    if isinstance(node.get("required"), list) else set()
                most = max((2 + len(json_text(k)) + self.size(v) for k, v in props.items() if k not in required),
                           default=0)
                if node.get("additionalProperties") is not False and not node.get("patternProperties"):
                    extra = node.get("additionalProperties", {})
                    most = max(most, 20 + self.size(extra if isinstance(extra, dict) else {}))
            self._extra[key] = (node, min(most, 256))
        return self._extra[key][1]

    def size(self, node: Any) -> int:
        """Bytes of the shortest value (64 where it cannot be told: a recursive schema; the cap
        and one where it is too long)."""
        try:
            return len(self.shortest(node))
        except TooLong:
            return self.max_bytes + 1
        except Unknown:
            return 64

    def cost(self, node: Any) -> int:
        """Bytes of the shortest value, to order keys by (1000 where it cannot be told, past the cap
        where it is too long)."""
        try:
            return len(self.shortest(node))
        except TooLong:
            return self.max_bytes + 1
        except Unknown:
            return 1000


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


def _branch_first(merged: Any, branch: Any) -> Any:
    """`merged` with `branch`'s properties ahead of the others (their merged schemas kept)."""
    if not (isinstance(merged, dict) and isinstance(branch, dict) and isinstance(branch.get("properties"), dict)
            and isinstance(merged.get("properties"), dict)) or merged is branch:
        return merged
    props = merged["properties"]
    order = [k for k in branch["properties"] if k in props] + [k for k in props if k not in branch["properties"]]
    if order == list(props):
        return merged
    return {**merged, "properties": {k: props[k] for k in order}}


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


def shortest_string(node: dict, max_bytes: int = MAX_BYTES) -> str:
    """The shortest string a string schema accepts (minLength, format, pattern); TooLong past max_bytes."""
    fmt = node.get("format")
    if isinstance(fmt, str) and fmt in _FORMATS:
        return _FORMATS[fmt]
    if isinstance(fmt, str) and fmt not in ("regex",):
        raise Unknown(f"format {fmt[:40]}")
    n = count(node.get("minLength"))
    if n + 2 > max_bytes:
        raise TooLong("the minLength string", max_bytes)
    if isinstance(node.get("pattern"), str):
        return shortest_match(node["pattern"], max_bytes=max_bytes, min_chars=n)
    return "a" * n
