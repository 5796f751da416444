"""JSON Schema helpers the backends share: OpenAI `strict`, and the keywords a grammar leaves unenforced.

A grammar cannot check some keywords (`uniqueItems`, `oneOf` exclusivity, `dependencies`, some
formats). llguidance refuses those itself; xgrammar silently ignores them, so `xgrammar_unenforced`
lists them (keyword + JSON pointer) and the xgrammar backend refuses the schema unless the request
opts into best effort.
"""
from __future__ import annotations

from typing import Any, Iterator

ANY_JSON_SCHEMA = {"type": ["object", "array"]}  # guide type `json`: an object or an array

# keywords xgrammar 0.2.8 accepts but does not (or not surely) enforce; `format: date` takes
# 2024-02-30, `oneOf` is `anyOf`, `not` and `if` are ignored, `allOf` drops a later part's
# `required` (measured); all formats are refused
XGRAMMAR_IGNORES = ("uniqueItems", "oneOf", "allOf", "dependencies", "dependentRequired", "dependentSchemas",
                    "if", "then", "else", "not", "contains", "minContains", "maxContains", "propertyNames",
                    "unevaluatedProperties", "unevaluatedItems", "format")
# subschema-holding keywords: (keyword, kind) kind = "one" | "list" | "map"
_SUB = (("properties", "map"), ("patternProperties", "map"), ("$defs", "map"), ("definitions", "map"),
        ("dependentSchemas", "map"), ("additionalProperties", "one"), ("items", "one|list"),
        ("prefixItems", "list"), ("anyOf", "list"), ("allOf", "list"), ("oneOf", "list"), ("not", "one"),
        ("if", "one"), ("then", "one"), ("else", "one"), ("contains", "one"), ("propertyNames", "one"),
        ("additionalItems", "one"), ("unevaluatedProperties", "one"), ("unevaluatedItems", "one"))


def _esc(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def walk(schema: Any, pointer: str = "") -> Iterator[tuple[str, dict]]:
    """(JSON pointer, subschema) for every object subschema, the root first."""
    if not isinstance(schema, dict):
        return
    yield pointer, schema
    for key, kind in _SUB:
        v = schema.get(key)
        p = f"{pointer}/{_esc(key)}"
        if isinstance(v, dict) and "map" in kind:
            for name, sub in v.items():
                yield from walk(sub, f"{p}/{_esc(name)}")
        elif isinstance(v, dict):
            yield from walk(v, p)
        elif isinstance(v, list) and "list" in kind:
            for i, sub in enumerate(v):
                yield from walk(sub, f"{p}/{i}")


def find_keywords(schema: Any, keywords: tuple[str, ...]) -> list[str]:
    """'keyword at /pointer' for each use of `keywords` that constrains something."""
    out = []
    for ptr, node in walk(schema):
        for kw in keywords:
            if kw not in node or (kw == "uniqueItems" and node[kw] is not True):
                continue
            if kw == "dependencies" and not node[kw]:
                continue
            out.append(f"{kw} at {ptr or '/'}")
    return out


def xgrammar_unenforced(schema: Any) -> list[str]:
    """What xgrammar would leave unchecked in `schema` (empty: it enforces all of it); it also
    ignores minLength / maxLength next to a `pattern` (its own warning says so)."""
    out = find_keywords(schema, XGRAMMAR_IGNORES)
    out += [f"{kw} with pattern at {p or '/'}" for p, node in walk(schema) if "pattern" in node
            for kw in ("minLength", "maxLength") if kw in node]
    return out


def strictify(schema: Any) -> Any:
    """OpenAI strict mode: every object `additionalProperties: false` (unless given) and all of
    its `properties` required. Returns a new schema; the input is not changed."""
    if isinstance(schema, list):
        return [strictify(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strictify(v) if k not in ("enum", "const", "default", "examples", "required") else v
           for k, v in schema.items()}
    for key in ("properties", "patternProperties", "$defs", "definitions"):
        if isinstance(schema.get(key), dict):
            out[key] = {n: strictify(s) for n, s in schema[key].items()}
    if isinstance(out.get("properties"), dict) or out.get("type") == "object":
        out.setdefault("additionalProperties", False)
        props = list(out.get("properties", {}))
        out["required"] = list(dict.fromkeys(list(out.get("required", [])) + props))
    return out
