"""The shortest text that ends a JSON scalar half written (`finish_scalar`): a literal, a number
within the schema's bounds, a string (a half-written escape, then enum / const, format, pattern or
minLength). The budget's JSON scanner (json_scanner.py) ends the value being written with it."""
from __future__ import annotations

import json
import re
from typing import Any, Optional

from .regex_completion import TooLong, Unknown, shortest_match
from .schema_completion import FORMAT_PATTERNS, count, json_text, shortest_string

_HEX_DIGITS = b"0123456789abcdefABCDEF"
_JSON_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")


def escape_end(buf: bytes) -> str:
    """What completes a half-written escape at the end of a string's bytes ('' when none)."""
    body = buf.rstrip(b"\\")
    if (len(buf) - len(body)) % 2:
        return "\\"  # a lone backslash: make it an escaped backslash
    tail = buf[-4:]
    digits = len(tail) - len(tail.rstrip(_HEX_DIGITS))
    if digits <= 3 and buf[:len(buf) - digits].endswith(b"u"):  # `\u` and up to 3 hex digits at the end
        head = buf[:len(buf) - digits - 1]
        if (len(head) - len(head.rstrip(b"\\"))) % 2:  # an odd run of backslashes before the `u`: one pass
            return "0" * (4 - digits)
    return ""


def decoded_prefix(buf: bytes) -> str:
    """The characters of a partial JSON string (a half-written escape dropped)."""
    for cut in range(len(buf), max(-1, len(buf) - 7), -1):
        try:
            return json.loads(b'"' + buf[:cut] + b'"')
        except ValueError:
            continue
    raise Unknown("undecodable string prefix")


def finish_scalar(kind: str, buf: bytes, node: Any, max_bytes: int) -> str:
    """The shortest text that ends the scalar whose bytes so far are `buf` (`kind`: "literal",
    "number", "string") valid for `node`; TooLong past `max_bytes`, Unknown where none is known."""
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
    escape = escape_end(buf)
    if escape:
        buf += escape.encode()
    prefix = decoded_prefix(buf)
    values = [node["const"]] if "const" in node else node.get("enum") if isinstance(node.get("enum"), list) else None
    if values is not None:
        fits = [v for v in values if isinstance(v, str) and v.startswith(prefix)]
        if not fits:
            raise Unknown("no enum value with this prefix")
        return json_text(min(fits, key=len))[1:][len(json_text(prefix)[1:-1]):]
    if isinstance(node.get("format"), str):
        if not prefix:
            return json_text(shortest_string(node, max_bytes))[1:]
        if node["format"] in FORMAT_PATTERNS:  # else a format no grammar checks: the string ends as any would
            try:
                return escape + json_text(shortest_match(FORMAT_PATTERNS[node["format"]], prefix, max_bytes))[1:]
            except TooLong:
                raise
            except Unknown:  # a text this pattern does not take, which the grammar did: its own check
                pass
    if isinstance(node.get("pattern"), str):
        end = shortest_match(node["pattern"], prefix, max_bytes, count(node.get("minLength")) - len(prefix))
        return escape + json_text(end)[1:]
    missing = max(0, count(node.get("minLength")) - len(prefix))
    if missing + 2 > max_bytes:
        raise TooLong("the rest of the minLength string", max_bytes)
    return escape + "a" * missing + '"'


def _in_bounds(v: float, node: dict) -> bool:
    """Whether `v` is within the schema's minimum / maximum (exclusive ones too)."""
    def num(k: str) -> Optional[float]:
        x = node.get(k)
        return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None
    lo, hi, xlo, xhi = num("minimum"), num("maximum"), num("exclusiveMinimum"), num("exclusiveMaximum")
    return ((lo is None or v >= lo) and (hi is None or v <= hi) and (xlo is None or v > xlo)
            and (xhi is None or v < xhi))
