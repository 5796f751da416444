"""JSON Schema helpers the backends share: OpenAI `strict`, and the keywords a grammar leaves unenforced.

A grammar cannot check some keywords (`uniqueItems`, `oneOf` exclusivity, `dependencies`, some
formats). llguidance refuses those itself; xgrammar silently ignores them, so `xgrammar_unenforced`
lists them (keyword + JSON pointer) and the xgrammar backend refuses the schema unless the request
opts into best effort.
"""
from __future__ import annotations

import json
import re
from typing import Any, Iterator
from urllib.parse import quote

from ..request import InvalidRequestError, UndeclaredKeys
from . import client_regex

ANY_JSON_SCHEMA = {"type": ["object", "array"]}  # guide type `json`: an object or an array

# keywords xgrammar 0.2.8 accepts but does not (or not surely) enforce; `format: date` takes
# a February 30th, `oneOf` is `anyOf`, `not` and `if` are ignored, `allOf` drops a later part's
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


_LOOKAROUND = ("(?=", "(?!", "(?<=", "(?<!")
_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "null": (type(None),),
          "object": (dict,), "array": (list,)}


def _has_type(value: Any, types: Any) -> bool:
    names = types if isinstance(types, list) else [types]
    for t in names:
        py = _TYPES.get(t, (object,))
        if isinstance(value, bool) and t in ("integer", "number"):
            continue
        if isinstance(value, py) or (t == "integer" and isinstance(value, float) and value.is_integer()):
            return True
    return False


def xgrammar_unenforced(schema: Any) -> list[str]:
    """What xgrammar would leave unchecked in `schema` (empty: it enforces all of it). Measured on
    MaskBench: it also ignores minLength / maxLength next to a `pattern`, lookarounds in patterns,
    `multipleOf` on non-integers, and `type` beside an `enum` / `const` whose values break it."""
    out = find_keywords(schema, XGRAMMAR_IGNORES)
    for p, node in walk(schema):
        at = p or "/"
        out += [f"{kw} with pattern at {at}" for kw in ("minLength", "maxLength") if "pattern" in node and kw in node]
        regexes = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
        regexes += list(node["patternProperties"]) if isinstance(node.get("patternProperties"), dict) else []
        if any(la in r for r in regexes for la in _LOOKAROUND):
            out.append(f"pattern lookaround at {at}")
        m = node.get("multipleOf")
        if m is not None and (not isinstance(m, int) or node.get("type") != "integer"):
            out.append(f"multipleOf on numbers at {at}")
        values = node.get("enum", []) if isinstance(node.get("enum"), list) else []
        values += [node["const"]] if "const" in node else []
        if "type" in node and any(not _has_type(v, node["type"]) for v in values):
            out.append(f"type beside enum at {at}")
    return out


def check_patterns(schema: Any, what: str = "json_schema guide") -> None:
    """InvalidRequestError naming the first `pattern` / `patternProperties` key of `schema` that
    client_regex does not run (a backreference, an atomic group, invalid, ...) and where it is."""
    for ptr, node in walk(schema):
        pats = node.get("patternProperties")
        found = ([("pattern", node["pattern"])] if isinstance(node.get("pattern"), str) else []) + \
            ([("patternProperties", key) for key in pats] if isinstance(pats, dict) else [])
        for kw, pattern in found:
            try:
                client_regex.compile(pattern)
            except client_regex.ClientRegexError as e:
                raise InvalidRequestError(f"invalid {what}: {e} (at {ptr}/{kw}); patterns run in RE2, a linear-time "
                                          f"engine: no backreferences, atomic groups or possessive quantifiers") from None


def json_schema_of(params: Any) -> Any:
    """The JSON schema a `json` / `json_schema` guide (GuidedDecodingParams) compiles, OpenAI strict
    applied, undeclared keys closed unless allowed (`declared_keys_only`); None for other guide
    types. InvalidRequestError for the `false` schema, and for a `pattern` / `patternProperties`
    key no linear-time engine runs (client_regex.py: a backreference, ...), whichever backend."""
    if params.guide_type not in ("json", "json_schema"):
        return None
    schema = ANY_JSON_SCHEMA if params.guide_type == "json" else json.loads(params.guide)
    if schema is False:
        raise InvalidRequestError("invalid json_schema guide: the schema is `false`: no JSON value is valid")
    check_patterns(schema)
    if params.strict:
        return strictify(schema)
    return schema if UndeclaredKeys(params.undeclared_keys) == UndeclaredKeys.ALLOW else declared_keys_only(schema)


# keywords that apply another subschema to the same instance: an object beside them (or inside
# one of them) shares its keys with other subschemas, so closing it alone could refuse their keys
_SAME_INSTANCE = ("allOf", "anyOf", "oneOf", "$ref", "if", "then", "else", "not", "dependentSchemas",
                  "dependencies", "unevaluatedProperties")
_OBJECT_KEYWORDS = ("properties", "patternProperties", "required", "additionalProperties", "minProperties",
                    "maxProperties", "propertyNames")
_OWN_VALUE = (("properties", "map"), ("patternProperties", "map"), ("additionalProperties", "one"),
              ("items", "one|list"), ("prefixItems", "list"), ("additionalItems", "one"), ("contains", "one"))
_DEFS = ("$defs", "definitions")


def declared_keys_only(schema: Any) -> Any:
    """Generation's reading of JSON Schema: an object schema that declares `properties` and says
    nothing of `additionalProperties` / `unevaluatedProperties` / `patternProperties` gets
    `additionalProperties: false` (an object with patternProperties stays as it is: xgrammar would
    drop its pattern keys from a closed object; so does one whose `required` names a key it does not
    declare). What a schema states is kept, and so is
    an object whose keys other subschemas of the same instance may declare: one beside allOf /
    anyOf / oneOf / $ref / if / not / dependencies, a part of an allOf (or of an anyOf / oneOf
    beside object keywords), and a `$defs` entry that a `$ref` reaches in such a place. A small
    model told "any key" writes keys until max_tokens; xgrammar's strict mode, llama.cpp and OpenAI
    generate declared keys only. Returns a new schema; the input is not changed."""
    if not isinstance(schema, dict):
        return schema
    shared_refs: set[str] = set()
    while True:  # $refs reached where their instance is shared, to a fixpoint (a shared def shares its refs)
        before = len(shared_refs)
        _close(schema, False, shared_refs, "#", collect=True)
        if len(shared_refs) == before:
            break
    return _close(schema, False, shared_refs, "#")


def _close(node: Any, shared: bool, shared_refs: set[str], ptr: str, collect: bool = False) -> Any:
    """The node with its objects closed; `shared`: other subschemas apply to this instance too.
    With `collect`, only adds to `shared_refs` the $refs that such nodes hold."""
    if not isinstance(node, dict):
        return node
    if collect and isinstance(node.get("$ref"), str) and (shared or len(set(node) - {"$ref", "description", "title", "default", "examples", "$comment"})):
        shared_refs.add(node["$ref"])
    out = dict(node)
    for key, kind in _OWN_VALUE:  # subschemas of other instances (values, items): closed on their own
        v, p = node.get(key), f"{ptr}/{_esc(key)}"
        if isinstance(v, dict) and "map" in kind:
            out[key] = {n: _close(sub, False, shared_refs, f"{p}/{_esc(n)}", collect) for n, sub in v.items()}
        elif isinstance(v, dict):
            out[key] = _close(v, False, shared_refs, p, collect)
        elif isinstance(v, list) and "list" in kind:
            out[key] = [_close(sub, False, shared_refs, f"{p}/{i}", collect) for i, sub in enumerate(v)]
    for key in _DEFS:  # reached through $ref: shared where a $ref shares its instance
        if isinstance(node.get(key), dict):
            out[key] = {n: _close(sub, f"{ptr}/{key}/{_esc(n)}" in shared_refs, shared_refs,
                                  f"{ptr}/{key}/{_esc(n)}", collect) for n, sub in node[key].items()}
    beside = shared or any(k in node for k in _OBJECT_KEYWORDS)
    for key in ("allOf", "anyOf", "oneOf"):  # parts of this instance's schema
        if isinstance(node.get(key), list):
            out[key] = [_close(sub, key == "allOf" or beside, shared_refs, f"{ptr}/{key}/{i}", collect)
                        for i, sub in enumerate(node[key])]
    composed = any(k in node for k in _SAME_INSTANCE)
    props = node.get("properties")
    required = node.get("required") if isinstance(node.get("required"), list) else []
    if (isinstance(props, dict) and props and not shared and not composed and "additionalProperties" not in node
            and "patternProperties" not in node and all(k in props for k in required)):
        out["additionalProperties"] = False
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


_REGEX_META = re.compile(r"([\\.+*?()|\[\]{}^$])")


def any_key_order(schema: Any) -> tuple[Any, list[str]]:
    """The schema for a grammar that takes listed keys in any order, and the objects whose `required`
    it no longer holds ('required at /pointer': the value check holds them, and duplicate keys).
    Each object's `properties` become exact-key `patternProperties` (llguidance fixes the order of
    `properties` and of `required` keys) and its `required` goes; an object with patternProperties
    of its own keeps its order (patterns must stay disjoint). Local `$ref`s into moved properties
    follow them. The input is not changed."""
    if not isinstance(schema, dict):
        return schema, []
    flagged: list[str] = []
    moved: set[str] = set()
    out = _unorder(schema, "", flagged, moved)
    return (_follow_refs(out, moved) if moved else out), flagged


def _pattern(name: str) -> str:
    return "^" + _REGEX_META.sub(r"\\\1", name) + "$"


def _unorder(node: Any, ptr: str, flagged: list[str], moved: set[str]) -> Any:
    if isinstance(node, list):
        return [_unorder(s, f"{ptr}/{i}", flagged, moved) for i, s in enumerate(node)]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        if k in ("enum", "const", "default", "examples", "required"):
            out[k] = v
        elif k in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas") and isinstance(v, dict):
            out[k] = {n: _unorder(s, f"{ptr}/{_esc(k)}/{_esc(n)}", flagged, moved) for n, s in v.items()}
        else:
            out[k] = _unorder(v, f"{ptr}/{_esc(k)}", flagged, moved)
    props = out.get("properties")
    ordered = isinstance(props, dict) and len(props) > 1 and "patternProperties" in out  # kept as it is
    if isinstance(props, dict) and len(props) > 1 and not ordered:
        del out["properties"]
        out["patternProperties"] = {_pattern(n): s for n, s in props.items()}
        moved.add(ptr)
    if out.get("required") and not ordered:
        del out["required"]
        flagged.append(f"required at {ptr or '/'}")
    return out


def _follow_refs(node: Any, moved: set[str]) -> Any:
    """`$ref: #/a/properties/x` -> `#/a/patternProperties/^x$` where /a's properties moved."""
    if isinstance(node, list):
        return [_follow_refs(s, moved) for s in node]
    if not isinstance(node, dict):
        return node
    out = {k: _follow_refs(v, moved) if k not in ("enum", "const", "default", "examples") else v
           for k, v in node.items()}
    ref = out.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/"):
        parts, at, new = ref[2:].split("/"), "", []
        i = 0
        while i < len(parts):
            if parts[i] == "properties" and at in moved and i + 1 < len(parts):
                name = parts[i + 1].replace("~1", "/").replace("~0", "~")
                new += ["patternProperties", quote(_esc(_pattern(name)), safe="")]  # a URI fragment
                at += f"/properties/{parts[i + 1]}"
                i += 2
                continue
            new.append(parts[i])
            at += f"/{parts[i]}"
            i += 1
        out["$ref"] = "#/" + "/".join(new)
    return out
