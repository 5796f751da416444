"""Value-close checks: what a JSON grammar leaves unchecked (`uniqueItems`, non-exclusive `oneOf`,
`dependencies`, formats, ...) is checked with `jsonschema` when the value closes.

A scanner (value_scan.py) follows the JSON structure of the accepted bytes. When a token closes a string value,
an array or an object whose subschemas hold an unchecked keyword, the value is validated against
the subschemas that apply to its path unconditionally (`$ref`, `allOf`, `properties`,
`patternProperties`, `additionalProperties`, `items`, `prefixItems`; anyOf/oneOf/if branches are
not descended, so a nested verdict never rejects a valid document). A token that closes a failing
value is rejected and masked out, like a rejected draft token, and the sampler goes on with
another one (`[1, 1` cannot close with `]`, `, 2]` can). The whole document is checked again on
the stop token: what no nested path reached is caught there. When nothing valid is left, the
engine ends the request with an error naming the violation (`ValueCheckedMatcher.violation`).
Client regexes (`pattern`, `patternProperties`, `format: regex`) run in RE2, linear time
(client_regex.py; the validator's keywords: schema_regex.py).
"""
from __future__ import annotations

import json
from typing import Any, Optional
from urllib.parse import unquote

import numpy as np
import torch

from ..request import InvalidRequestError
from . import client_regex
from .backend import Encode, Matcher, fill_by_class
from .schema import walk
from .schema_regex import format_checker, validator_class
from .value_scan import OPEN_ARRAY, START, State, TokenTable, child_path, scan

_NEWER = ("prefixItems", "dependentRequired", "dependentSchemas", "unevaluatedProperties", "unevaluatedItems", "$defs")
# keywords whose subschemas apply conditionally: a flag under them is checked where they sit
_BRANCHES = ("anyOf", "oneOf", "not", "if", "then", "else", "dependentSchemas", "dependencies", "contains",
             "propertyNames", "unevaluatedProperties", "unevaluatedItems")
_MAPS = ("dependentSchemas", "dependencies")
def make_validator(schema: Any) -> Any:
    """A jsonschema validator with format checks: the schema's `$schema` draft, else 2020-12 when it
    uses a 2019+ keyword, else draft 7 (MaskBench-style schemas use `dependencies`, tuple `items`).
    Its regex keywords run client_regex (schema_regex.validator_class), and so does the meta-schema's
    `format: regex` on the schema's own patterns. jsonschema.SchemaError when the schema itself is
    not valid."""
    import jsonschema

    text = json.dumps(schema)
    if isinstance(schema, dict) and "$schema" in schema:
        cls = jsonschema.validators.validator_for(schema)
    elif any(f'"{k}"' in text for k in _NEWER):
        cls = jsonschema.Draft202012Validator
    else:
        cls = jsonschema.Draft7Validator
    cls.check_schema(schema, format_checker=format_checker(cls))
    cls = validator_class(cls)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def uncheckable_formats(schema: Any, validator: Any, grammar_formats: frozenset[str],
                        dropped: tuple[str, ...] = ()) -> list[str]:
    """'format X at /pointer' for formats neither the grammar nor `validator` checks (jsonschema
    checks only some formats without extra packages): refused unless the request is best effort.
    `grammar_formats` do not count under a `dropped` keyword (a grammar without `not` does not
    enforce the formats inside it)."""
    checked = set(validator.format_checker.checkers)
    out = []
    for p, node in walk(schema):
        fmt = node.get("format")
        if not isinstance(fmt, str) or fmt in checked:
            continue
        if fmt in grammar_formats and not set(p.split("/")) & set(dropped):
            continue
        out.append(f"format {fmt} at {p or '/'}")
    return out


def checked_validator(schema: Any, params: Any, grammar_formats: frozenset[str],
                      dropped: tuple[str, ...] = ()) -> tuple[Any, list[str]]:
    """The validator for value-close checks and the formats nothing checks (left unenforced).
    InvalidRequestError when the schema is not valid JSON Schema, or uses such a format and the
    request (`params`, GuidedDecodingParams) is not best effort."""
    import jsonschema

    try:
        validator = make_validator(schema)
    except jsonschema.SchemaError as e:
        at = "/".join(map(str, e.absolute_path))
        raise InvalidRequestError(f"invalid json_schema guide: {e.message} (at /{at})") from None
    blind = uncheckable_formats(schema, validator, grammar_formats, dropped)
    if blind and not params.best_effort:
        raise InvalidRequestError(f"invalid json_schema guide: neither the grammar nor the value check can enforce "
                                  f"{'; '.join(blind[:4])}; set best_effort to accept it unchecked")
    return validator, blind


class _DuplicateKey(Exception):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        raise _DuplicateKey(next(k for k, _ in pairs if k in seen or seen.add(k)))  # type: ignore[func-returns-value]
    return out


class ValueChecker:
    """Per compiled guide: the validator, the paths whose values need a check, and a memo of verdicts.
    `flagged`: 'keyword at /pointer' for the keywords the grammar leaves unchecked."""

    MEMO = 65536  # verdicts kept (cleared when full)

    def __init__(self, schema: Any, validator: Any, flagged: list[str], table: TokenTable, stop_ids: frozenset[int]):
        self.schema, self.validator, self.table, self.stop_ids = schema, validator, table, stop_ids
        ptrs = {f.rsplit(" at ", 1)[-1] for f in flagged}
        self.flagged = {id(node) for p, node in walk(schema) if (p or "/") in ptrs}
        self._nodes: dict[tuple, tuple[dict, ...]] = {}
        self._needs: dict[tuple, bool] = {}
        self._below: dict[int, bool] = {}
        self._validators: dict[int, Any] = {}  # id(subschema) -> its validator
        self._unique: Any = None  # the validator of {"uniqueItems": true}
        self._verdicts: dict[tuple, Optional[str]] = {}

    # -- which subschemas apply to a path ---------------------------------------------------------
    def _deref(self, ref: str) -> Any:
        if not ref.startswith("#"):
            return None  # remote / $id refs: not followed (the whole-document check still runs)
        node: Any = self.schema
        for part in [unquote(p).replace("~1", "/").replace("~0", "~") for p in ref[1:].split("/") if p]:
            if isinstance(node, dict):
                node = node.get(part)
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node

    def _expand(self, node: Any, seen: set[int]) -> list[dict]:
        """`node` and what its `$ref` and `allOf` add (they apply unconditionally)."""
        if not isinstance(node, dict) or id(node) in seen:
            return []
        seen.add(id(node))
        out = [node]
        if isinstance(node.get("$ref"), str):
            out += self._expand(self._deref(node["$ref"]), seen)
        for part in node.get("allOf", []) if isinstance(node.get("allOf"), list) else []:
            out += self._expand(part, seen)
        return out

    @staticmethod
    def _children(node: dict, step: Any) -> list[Any]:
        if isinstance(step, str):
            out = []
            if isinstance(node.get("properties"), dict) and step in node["properties"]:
                out.append(node["properties"][step])
            pats = node.get("patternProperties")
            for pat, sub in pats.items() if isinstance(pats, dict) else ():
                try:
                    if client_regex.search(pat, step):
                        out.append(sub)
                except client_regex.ClientRegexError:
                    pass  # not known to apply: the whole-document check still runs
            return out or [node.get("additionalProperties")]
        if not isinstance(step, int):
            return []  # a key that did not decode
        pre, items = node.get("prefixItems"), node.get("items")
        if isinstance(pre, list):
            return [pre[step]] if step < len(pre) else [items]
        if isinstance(items, list):
            return [items[step]] if step < len(items) else [node.get("additionalItems")]
        return [items]

    def nodes(self, path: tuple) -> tuple[dict, ...]:
        """The subschemas that every valid document applies to the value at `path`."""
        got = self._nodes.get(path)
        if got is None:
            if not path:
                got = tuple(self._expand(self.schema, set()))
            else:
                got = tuple(n for parent in self.nodes(path[:-1]) for c in self._children(parent, path[-1])
                            for n in self._expand(c, set()))
            self._nodes[path] = got
        return got

    def _flagged_below(self, node: dict, seen: Optional[set[int]] = None) -> bool:
        if id(node) in self._below:
            return self._below[id(node)]
        seen = set() if seen is None else seen
        seen.add(id(node))
        hit = False
        for _, sub in walk(node):
            if id(sub) in self.flagged:
                hit = True
            elif isinstance(sub.get("$ref"), str):
                target = self._deref(sub["$ref"])
                hit = isinstance(target, dict) and id(target) not in seen and self._flagged_below(target, seen)
            if hit:
                break
        if len(seen) == 1 or hit:  # a partial answer inside a $ref cycle is not memoized
            self._below[id(node)] = hit
        return hit

    def _flagged_here(self, node: dict) -> bool:
        """`node` is flagged, or holds a flagged keyword under a branch no path resolves (anyOf,
        oneOf, not, if, ...); what sits under `properties` / `items` is checked at its own path."""
        if id(node) in self.flagged:
            return True
        for kw in _BRANCHES:
            v = node.get(kw)
            subs = v if isinstance(v, list) else list(v.values()) if isinstance(v, dict) and kw in _MAPS else [v]
            if any(isinstance(s, dict) and self._flagged_below(s) for s in subs):
                return True
        return False

    def needs(self, path: tuple) -> bool:
        """Whether the value at `path` holds a keyword the grammar leaves unchecked."""
        got = self._needs.get(path)
        if got is None:
            got = self._needs[path] = any(self._flagged_here(n) for n in self.nodes(path))
        return got

    def unique(self, path: tuple) -> bool:
        """Whether the array at `path` must hold unique items (checked as each item ends)."""
        return any(n.get("uniqueItems") is True for n in self.nodes(path))

    # -- verdicts ---------------------------------------------------------------------------------
    def items_verdict(self, path: tuple, text: bytes) -> Optional[str]:
        """Why the items so far (`text` + "]") of a uniqueItems array already fail it; None if not."""
        key = (path, text, "items")
        if key in self._verdicts:
            return self._verdicts[key]
        msg = None
        try:
            value = json.loads(text + b"]")
        except ValueError:
            value = None
        if isinstance(value, list):
            if self._unique is None:
                self._unique = self.validator.evolve(schema={"uniqueItems": True})
            err = next(iter(self._unique.iter_errors(value)), None)
            if err is not None:
                msg = f"{err.message} (at /{'/'.join(map(str, path))}, schema uniqueItems)"
        return self._remember(key, msg)

    def _remember(self, key: tuple, msg: Optional[str]) -> Optional[str]:
        if len(self._verdicts) >= self.MEMO:
            self._verdicts.clear()
        self._verdicts[key] = msg
        return msg

    def verdict(self, path: tuple, text: bytes) -> Optional[str]:
        """Why the closed value `text` at `path` is invalid; None when valid (or not a JSON value)."""
        key = (path, text)
        if key in self._verdicts:
            return self._verdicts[key]
        try:
            value = json.loads(text, object_pairs_hook=_unique_keys)
        except _DuplicateKey as e:
            return self._remember(key, f"duplicate key {e.args[0]!r} (at /{'/'.join(map(str, path))})")
        except ValueError:
            return None  # not a closed value: the grammar decides
        msg = None
        for node in (self.schema,) if not path else self.nodes(path):
            v = self._validators.get(id(node))
            if v is None:
                v = self._validators[id(node)] = self.validator if node is self.schema else self.validator.evolve(schema=node)
            try:
                err = next(iter(v.iter_errors(value)), None)
            except Exception as e:  # noqa: BLE001 - a check that cannot run accepts nothing
                msg = f"the value at /{'/'.join(map(str, path))} cannot be checked ({type(e).__name__})"
                break
            if err is not None:
                where = "/".join(map(str, path + tuple(err.absolute_path)))
                msg = (f"{err.message} (at /{where}, schema {err.validator} at "
                       f"/{'/'.join(map(str, err.absolute_schema_path))})")
                break
        return self._remember(key, msg)


class ValueCheckedMatcher(Matcher):
    """Wraps a backend matcher: a token that closes a value the schema rejects is not accepted, and
    the stop token only ends a document the schema accepts."""

    def __init__(self, inner: Matcher, checker: ValueChecker):
        self.inner, self.c = inner, checker
        self.buf = bytearray()
        self.states: list[tuple[State, int]] = [(START, 0)]  # after each accepted token: (state, len(buf))
        self.last_reason: Optional[str] = None  # the latest nested rejection (for the error message)

    def _span(self, data: bytes) -> Any:
        pos = len(self.buf)
        return lambda s, e: bytes(self.buf[s:e]) if e <= pos else bytes(self.buf[s:]) + data[max(0, s - pos):e - pos]

    def _next(self, data: bytes) -> Optional[State]:
        """The scanner state after `data`, or None when it closes a value that fails its check."""
        span = self._span(data)
        state, events = scan(self.states[-1][0], data, len(self.buf), span)
        for item, path, s, e in events:
            if item:
                why = self.c.items_verdict(path, span(s, e)) if self.c.unique(path) else None
            else:
                why = self.c.verdict(path, span(s, e)) if self.c.needs(path) else None
            if why is not None:
                self.last_reason = why
                return None
        return state

    def _doc_violation(self) -> Optional[str]:
        """Why the whole text cannot end here (None: valid, or not a complete JSON value)."""
        return self.c.verdict((), bytes(self.buf)) if not self.states[-1][0][0] else None

    def violation(self) -> Optional[str]:
        """Why the value so far is invalid: the document's verdict, else the latest nested one."""
        return self._doc_violation() or self.last_reason

    def accept(self, token: int) -> bool:
        t = int(token)
        if t in self.c.stop_ids and not self.inner.is_terminated():
            if self._doc_violation() is not None or not self.inner.accept(t):
                return False
            self.states.append(self.states[-1])
            return True
        data = self.c.table.bytes[t]
        state = self._next(data)
        if state is None or not self.inner.accept(t):
            return False
        self.buf += data
        self.states.append((state, len(self.buf)))
        return True

    def rollback(self, n: int) -> None:
        if n > 0:
            self.inner.rollback(n)
            del self.states[len(self.states) - n:]
            del self.buf[self.states[-1][1]:]

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.inner.fill(bitmask, row)
        self._ban(bitmask, row)

    def _candidates(self) -> Optional[np.ndarray]:
        """The tokens that could close a checked value (or end an item of a uniqueItems array) from
        here; None when no open value needs a check."""
        stack, in_str, _, _, is_key = self.states[-1][0]
        tab, c = self.c.table, self.c
        if in_str and not is_key and (c.needs(child_path(stack)) or (stack and stack[-1][0] == OPEN_ARRAY and c.unique(stack[-1][2]))):
            return tab.closers[tab.quoted]
        closes = None  # fewest `]` / `}` before a checked value closes or an item of a unique array ends
        for j in range(len(stack) - 1, -1, -1):
            if c.unique(stack[j][2]) and stack[j][0] == OPEN_ARRAY:
                closes = len(stack) - 1 - j
            elif c.needs(stack[j][2]):
                closes = len(stack) - j
            if closes is not None:
                break
        if closes is None:
            return None
        if closes == 0 and not in_str:
            return tab.item_closers
        return tab.closers[(tab.n_close >= closes) & (tab.quoted | (not in_str))]

    def _ban(self, bitmask: torch.Tensor, row: int) -> None:
        banned: list[int] = []
        if self.inner.is_completed() and self._doc_violation() is not None:
            banned += self.c.stop_ids
        ids = self._candidates()
        words = bitmask.numpy()[row].view(np.uint32)  # bit t % 32 of word t // 32: token t allowed
        if ids is not None:  # try each allowed token that can close a checked value
            on = (words[ids >> 5] >> (ids & 31).astype(np.uint32)) & 1
            banned += [t for t in ids[on.astype(bool)].tolist() if self._next(self.c.table.bytes[t]) is None]
        for t in banned:
            words[t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)

    def forced_tokens(self, encode: Encode, k: int) -> list[int]:
        toks = self.inner.forced_tokens(encode, k)
        return toks[: self.validate(toks)]

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def is_completed(self) -> bool:
        return self.inner.is_completed() and self._doc_violation() is None

    def reset(self) -> None:
        self.inner.reset()
        self.buf.clear()
        self.states = [(START, 0)]
        self.last_reason = None

    @classmethod
    def fill_many(cls, matchers: list["ValueCheckedMatcher"], bitmask: torch.Tensor, rows: list[int],
                  num_threads: int | str = "auto") -> None:
        fill_by_class([m.inner for m in matchers], bitmask, rows, num_threads)
        for m, r in zip(matchers, rows):
            m._ban(bitmask, r)
