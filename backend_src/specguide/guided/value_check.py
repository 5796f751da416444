"""Value-close checks for `best_effort` JSON guides: what the grammar leaves unchecked (`uniqueItems`,
non-exclusive `oneOf`, `dependencies`, ...) is checked with `jsonschema` when the JSON value closes.

The check runs on the stop token: a closed value that fails the schema gets its stop token
rejected (and masked out), like a rejected draft token, so nothing invalid ends a sequence. The
grammar then allows nothing else, and the engine ends the request with an error that names the
violation (`ValueCheckedMatcher.violation`).
"""
from __future__ import annotations

import json
from typing import Any, Callable, Optional

import torch

from .backend import Encode, Matcher

_NEWER = ("prefixItems", "dependentRequired", "dependentSchemas", "unevaluatedProperties", "unevaluatedItems", "$defs")


def make_validator(schema: Any) -> Any:
    """A jsonschema validator with format checks: the schema's `$schema` draft, else 2020-12 when it
    uses a 2019+ keyword, else draft 7 (MaskBench-style schemas use `dependencies`, tuple `items`)."""
    import jsonschema

    text = json.dumps(schema)
    if isinstance(schema, dict) and "$schema" in schema:
        cls = jsonschema.validators.validator_for(schema)
    elif any(f'"{k}"' in text for k in _NEWER):
        cls = jsonschema.Draft202012Validator
    else:
        cls = jsonschema.Draft7Validator
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def uncheckable_formats(schema: Any, validator: Any, grammar_formats: frozenset[str]) -> list[str]:
    """'format X at /pointer' for formats neither the grammar nor `validator` checks (jsonschema
    checks only some formats without extra packages): best effort refuses those too."""
    from .schema import walk

    known = set(validator.format_checker.checkers) | grammar_formats
    return [f"format {node['format']} at {p or '/'}" for p, node in walk(schema)
            if isinstance(node.get("format"), str) and node["format"] not in known]


class ValueCheckedMatcher(Matcher):
    """Wraps a backend matcher: its stop token is accepted only when the text is a value the schema
    accepts. `decode` turns the accepted tokens (stop tokens excluded) into text."""

    def __init__(self, inner: Matcher, validator: Any, decode: Callable[[list[int]], str], stop_ids: frozenset[int]):
        self.inner = inner
        self.validator = validator
        self.decode = decode
        self.stop_ids = stop_ids
        self.tokens: list[int] = []
        self._cache: tuple[int, Optional[str]] = (-1, None)  # (len(tokens), violation)

    def violation(self) -> Optional[str]:
        """Why the value so far cannot end here (None: it is valid, or not a complete JSON value)."""
        n = len(self.tokens)
        if self._cache[0] != n:
            try:
                value = json.loads(self.decode(self.tokens))
            except ValueError:
                msg = None  # not a closed value: the grammar decides
            else:
                err = next(iter(self.validator.iter_errors(value)), None)
                msg = None if err is None else f"{err.message} (at /{'/'.join(map(str, err.absolute_path))}, " \
                                               f"schema {err.validator} at /{'/'.join(map(str, err.absolute_schema_path))})"
            self._cache = (n, msg)
        return self._cache[1]

    def accept(self, token: int) -> bool:
        t = int(token)
        if t in self.stop_ids and not self.inner.is_terminated() and self.violation() is not None:
            return False
        if not self.inner.accept(t):
            return False
        self.tokens.append(t)
        return True

    def rollback(self, n: int) -> None:
        if n > 0:
            self.inner.rollback(n)
            del self.tokens[len(self.tokens) - n:]
            self._cache = (-1, None)  # the cache is keyed by length: valid only between rollbacks

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.inner.fill(bitmask, row)
        self._ban_stop(bitmask, row)

    def _ban_stop(self, bitmask: torch.Tensor, row: int) -> None:
        if self.inner.is_completed() and self.violation() is not None:
            for t in self.stop_ids:  # bit t % 32 of word t // 32
                bitmask[row, t // 32] &= ~(1 << (t % 32)) if t % 32 != 31 else 0x7FFFFFFF

    def forced_tokens(self, encode: Encode, k: int) -> list[int]:
        toks = self.inner.forced_tokens(encode, k)
        return toks[: self.validate(toks)]

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def is_completed(self) -> bool:
        return self.inner.is_completed() and self.violation() is None

    def reset(self) -> None:
        self.inner.reset()
        self.tokens.clear()
        self._cache = (-1, None)

    @classmethod
    def fill_many(cls, matchers: list["ValueCheckedMatcher"], bitmask: torch.Tensor, rows: list[int],
                  num_threads: int | str = "auto") -> None:
        groups: dict[type, tuple[list[Matcher], list[int]]] = {}
        for m, r in zip(matchers, rows):
            ms, idx = groups.setdefault(type(m.inner), ([], []))
            ms.append(m.inner)
            idx.append(r)
        for inner_cls, (ms, idx) in groups.items():
            inner_cls.fill_many(ms, bitmask, idx, num_threads)  # type: ignore[attr-defined]
        for m, r in zip(matchers, rows):
            m._ban_stop(bitmask, r)
