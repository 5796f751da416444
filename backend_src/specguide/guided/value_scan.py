"""Which JSON values the accepted bytes close: a byte scanner over the structure of a document
(strings, arrays, objects; numbers and literals end at the next delimiter) for the value-close
checks (value_check.py). `scan` returns, per token, the values it closes, by path; `TokenTable`
knows which tokens can close one."""
from __future__ import annotations

import json
from typing import Any

import numpy as np

_Q, _BS, _LB, _RB, _LC, _RC, _COMMA = b'"\\[]{},'
OPEN_ARRAY = _LB  # a frame's open byte for an array

# scanner state: (stack, in_string, escaped, string_start, string_is_key); a frame is
# (open byte, start offset, path, array index, current key, next string is a key)
Frame = tuple[int, int, tuple, int, Any, bool]
State = tuple[tuple[Frame, ...], bool, bool, int, bool]
START: State = ((), False, False, 0, False)
# (item, path, start, end): bytes [start, end) close the value at `path`; item: they end an item of the
# array at `path` ([start, end) + "]" is that array so far: uniqueItems is checked per item)
Event = tuple[bool, tuple, int, int]


def child_path(stack: tuple[Frame, ...]) -> tuple:
    """The path of the value that starts next (inside the innermost open container)."""
    if not stack:
        return ()
    kind, _, path, idx, key, _ = stack[-1]
    return path + ((idx,) if kind == _LB else (key,))


def scan(state: State, data: bytes, pos: int, span: Any) -> tuple[State, list[Event]]:
    """Follow `data` (starting at byte offset `pos`) from `state`; the values it closes.
    `span(start, end)` returns the bytes [start, end) of the text (to read object keys)."""
    stack, in_str, esc, s0, is_key = state
    events: list[Event] = []
    for i, c in enumerate(data):
        p = pos + i
        if in_str:
            if esc:
                esc = False
            elif c == _BS:
                esc = True
            elif c == _Q:
                in_str = False
                if is_key:
                    try:
                        key = json.loads(span(s0, p + 1))
                    except ValueError:
                        key = None
                    kind, start, path, idx, _, _ = stack[-1]
                    stack = stack[:-1] + ((kind, start, path, idx, key, False),)
                else:
                    events.append((False, child_path(stack), s0, p + 1))
                    if stack and stack[-1][0] == _LB:
                        events.append((True, stack[-1][2], stack[-1][1], p + 1))
        elif c == _Q:
            in_str, s0 = True, p
            is_key = bool(stack) and stack[-1][0] == _LC and stack[-1][5]
        elif c == _LB or c == _LC:
            stack = stack + ((c, p, child_path(stack), 0, None, c == _LC),)
        elif (c == _RB or c == _RC) and stack:
            events.append((False, stack[-1][2], stack[-1][1], p + 1))
            stack = stack[:-1]
            if stack and stack[-1][0] == _LB:
                events.append((True, stack[-1][2], stack[-1][1], p + 1))
        elif c == _COMMA and stack:
            kind, start, path, idx, key, _ = stack[-1]
            if kind == _LB:  # a number or literal item ends here
                events.append((True, path, start, p))
            stack = stack[:-1] + ((kind, start, path, idx + 1, key, kind == _LC),)
    return (stack, in_str, esc, s0, is_key), events


class TokenTable:
    """Per tokenizer: each token's bytes and the tokens that can close a string or a container."""

    def __init__(self, token_bytes: list[bytes]):
        self.bytes = token_bytes
        ids = [i for i, b in enumerate(token_bytes) if b'"' in b or b"]" in b or b"}" in b]
        self.item_closers = np.array([i for i, b in enumerate(token_bytes) if any(c in b for c in b'"]},')],
                                     dtype=np.int64)
        # numpy, not torch: masks are filled inside CUDA host callbacks too (no dispatcher there)
        self.closers = np.array(ids, dtype=np.int64)
        self.n_close = np.array([token_bytes[i].count(b"]") + token_bytes[i].count(b"}") for i in ids])
        self.quoted = np.array([b'"' in token_bytes[i] for i in ids], dtype=bool)
