"""jsonschema validators whose regex keywords run client_regex (RE2, linear time) instead of `re`:
`pattern`, `patternProperties`, `additionalProperties` and `unevaluatedProperties` (both look
through `patternProperties`), and `format: regex` (a pattern this server runs). The rest is
jsonschema's own. A pattern that cannot be run on a text (client_regex.ClientRegexError) is a
validation error that says so: the value is not accepted, the check never hangs."""
from __future__ import annotations

import functools
from typing import Any, Iterator

from . import client_regex


def _error(message: str) -> Any:
    from jsonschema.exceptions import ValidationError

    return ValidationError(message)


def _extras_msg(extras: Any) -> tuple[str, str]:
    return ", ".join(repr(extra) for extra in extras), "was" if len(extras) == 1 else "were"


def pattern(validator: Any, patrn: str, instance: Any, schema: dict) -> Iterator[Any]:
    if not validator.is_type(instance, "string"):
        return
    try:
        ok = client_regex.search(patrn, instance)
    except client_regex.ClientRegexError as e:
        yield _error(f"{instance!r} cannot be checked against {patrn!r}: {e}")
        return
    if not ok:
        yield _error(f"{instance!r} does not match {patrn!r}")


def patternProperties(validator: Any, patterns: dict, instance: Any, schema: dict) -> Iterator[Any]:
    if not validator.is_type(instance, "object"):
        return
    for patrn, subschema in patterns.items():
        for k, v in instance.items():
            try:
                hit = client_regex.search(patrn, k)
            except client_regex.ClientRegexError as e:
                yield _error(f"property {k!r} cannot be checked against {patrn!r}: {e}")
                continue
            if hit:
                yield from validator.descend(v, subschema, path=k, schema_path=patrn)


def _matches_any(patterns: Any, key: str) -> bool:
    return any(client_regex.search(p, key) for p in patterns)


def additionalProperties(validator: Any, aP: Any, instance: Any, schema: dict) -> Iterator[Any]:
    if not validator.is_type(instance, "object"):
        return
    properties, patterns = schema.get("properties", {}), schema.get("patternProperties", {})
    try:
        extras = {k for k in instance if k not in properties and not (patterns and _matches_any(patterns, k))}
    except client_regex.ClientRegexError as e:
        yield _error(f"the properties cannot be checked against patternProperties: {e}")
        return
    if validator.is_type(aP, "object"):
        for extra in extras:
            yield from validator.descend(instance[extra], aP, path=extra)
    elif not aP and extras:
        if "patternProperties" in schema:
            verb = "does" if len(extras) == 1 else "do"
            joined = ", ".join(repr(each) for each in sorted(extras))
            pats = ", ".join(repr(each) for each in sorted(patterns))
            yield _error(f"{joined} {verb} not match any of the regexes: {pats}")
        else:
            yield _error("Additional properties are not allowed (%s %s unexpected)"
                         % _extras_msg(sorted(extras, key=str)))


def _valid(errors: Iterator[Any]) -> bool:
    return next(errors, None) is None


def _evaluated_keys(validator: Any, instance: dict, schema: Any, legacy: bool) -> list[str]:
    """jsonschema's find_evaluated_property_keys_by_schema (draft 2020-12; `legacy`: 2019-09's),
    with patternProperties matched by client_regex."""
    if validator.is_type(schema, "boolean"):
        return []
    keys: list[str] = []
    refs = [schema.get("$ref")] + ([schema.get("$dynamicRef")] if not legacy else [])
    for ref in refs:
        if ref is not None:
            resolved = validator._resolver.lookup(ref)
            keys += _evaluated_keys(validator.evolve(schema=resolved.contents, _resolver=resolved.resolver),
                                    instance, resolved.contents, legacy)
    if legacy and "$recursiveRef" in schema:
        from jsonschema._legacy_keywords import lookup_recursive_ref  # referencing's, as jsonschema uses it

        resolved = lookup_recursive_ref(validator._resolver)
        keys += _evaluated_keys(validator.evolve(schema=resolved.contents, _resolver=resolved.resolver),
                                instance, resolved.contents, legacy)
    if legacy:
        for keyword in ("properties", "additionalProperties", "unevaluatedProperties"):
            if keyword in schema:
                value = schema[keyword]
                if validator.is_type(value, "boolean") and value:
                    keys += instance.keys()
                elif validator.is_type(value, "object"):
                    keys += [p for p in value if p in instance]
    else:
        properties = schema.get("properties")
        if validator.is_type(properties, "object"):
            keys += properties.keys() & instance.keys()
        for keyword in ("additionalProperties", "unevaluatedProperties"):
            if (subschema := schema.get(keyword)) is not None:
                keys += [k for k, v in instance.items() if _valid(validator.descend(v, subschema))]
    if "patternProperties" in schema:
        for prop in instance:
            for patrn in schema["patternProperties"]:
                if client_regex.search(patrn, prop):
                    keys.append(prop)
    if "dependentSchemas" in schema:
        for prop, subschema in schema["dependentSchemas"].items():
            if prop in instance:
                keys += _evaluated_keys(validator, instance, subschema, legacy)
    for keyword in ("allOf", "oneOf", "anyOf"):
        for subschema in schema.get(keyword, []):
            if _valid(validator.descend(instance, subschema)):
                keys += _evaluated_keys(validator, instance, subschema, legacy)
    if "if" in schema:
        if validator.evolve(schema=schema["if"]).is_valid(instance):
            keys += _evaluated_keys(validator, instance, schema["if"], legacy)
            if "then" in schema:
                keys += _evaluated_keys(validator, instance, schema["then"], legacy)
        elif "else" in schema:
            keys += _evaluated_keys(validator, instance, schema["else"], legacy)
    return keys


def _unevaluated_properties(legacy: bool) -> Any:
    def unevaluatedProperties(validator: Any, uP: Any, instance: Any, schema: dict) -> Iterator[Any]:
        if not validator.is_type(instance, "object"):
            return
        try:
            evaluated = _evaluated_keys(validator, instance, schema, legacy)
        except client_regex.ClientRegexError as e:
            yield _error(f"the properties cannot be checked against patternProperties: {e}")
            return
        unevaluated = []
        for prop in instance:
            if prop not in evaluated:
                for _ in validator.descend(instance[prop], uP, path=prop, schema_path=prop):
                    unevaluated.append(prop)
        if unevaluated:
            if uP is False:
                yield _error("Unevaluated properties are not allowed (%s %s unexpected)"
                             % _extras_msg(sorted(unevaluated, key=str)))
            else:
                yield _error("Unevaluated properties are not valid under the given schema "
                             "(%s %s unevaluated and invalid)" % _extras_msg(unevaluated))
    return unevaluatedProperties


def format_checker(cls: Any) -> Any:
    """`cls`'s format checker with `regex` read as client_regex reads patterns."""
    from jsonschema import FormatChecker

    checker = FormatChecker(())
    checker.checkers = dict(cls.FORMAT_CHECKER.checkers)
    if "regex" in checker.checkers:
        checker.checks("regex")(client_regex.is_valid)
    return checker


@functools.lru_cache(maxsize=None)
def validator_class(cls: Any) -> Any:
    """`cls` (a jsonschema draft's validator class) with its regex keywords on client_regex, and
    its FORMAT_CHECKER's `regex` too."""
    import jsonschema

    replaced = {"pattern": pattern, "patternProperties": patternProperties,
                "additionalProperties": additionalProperties}
    if "unevaluatedProperties" in cls.VALIDATORS:
        legacy = cls.VALIDATORS["unevaluatedProperties"].__module__.endswith("_legacy_keywords")
        replaced["unevaluatedProperties"] = _unevaluated_properties(legacy)
    ours = {k: v for k, v in replaced.items() if k in cls.VALIDATORS}
    return jsonschema.validators.extend(cls, ours, format_checker=format_checker(cls))
