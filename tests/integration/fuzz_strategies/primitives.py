"""The building blocks of every target's strategies: integers and floats at the edges (int32,
float32, uint64), lengths (cheap or refused), token ids (in and out of the vocabulary), strings
(special, random, invalid UTF-8, near and past a cap), JSON values (odd scalars, deep nesting,
numbers Python reads as huge or inf)."""
from __future__ import annotations

import math
from typing import Any

from hypothesis import strategies as st

from .case import EOS, MAX_SEQ_LEN, VOCAB

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT_EXTREMES = [0, 1, -1, 2, 7, 8, 9, 255, 256, 1000, 2047, 2048, 2049, 4096, VOCAB - 1, VOCAB, VOCAB + 1, 65535,
                65536, 999999, 10**9, INT32_MAX, INT32_MIN, INT32_MIN + 1, -2, -100, -VOCAB]
FLOAT_EXTREMES = [0.0, -0.0, 1.0, -1.0, 0.5, 1e-5, 9.99e-6, 1e-2, 2.0, 2.0001, -2.0001, 100.0, 100.1, 0.01, 0.0099,
                  1e-38, 1e-45, 1e30, -1e30, 3.4e38, -3.4e38, math.inf, -math.inf, math.nan]

ints32 = st.one_of(st.sampled_from(INT_EXTREMES), st.integers(INT32_MIN, INT32_MAX))
floats32 = st.one_of(st.sampled_from(FLOAT_EXTREMES), st.floats(width=32))
uint64s = st.one_of(st.sampled_from([0, 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1]), st.integers(0, 2**64 - 1))
# a length a client asks for: small (cheap to serve), or one the server must refuse
lengths = st.one_of(st.integers(0, 8), st.sampled_from([-1, -2, INT32_MIN, INT32_MAX, MAX_SEQ_LEN + 1, 2 * MAX_SEQ_LEN, 10**6]))
small_counts = st.one_of(st.integers(0, 4), st.sampled_from([-1, 16, 17, 64, 65, 1000, INT32_MAX, INT32_MIN]))
# tokens the model writes often (" the", ".", ",", " a", "\n", " and", " of", " is", " The", "-", ...): a word
# list's prefix that matches what a sequence just wrote makes the engine look at the word's next id
COMMON_IDS = [260, 30, 28, 253, 198, 284, 282, 314, 378, 504, 288, 281, 1116, 29, 339, 57]
OUT_OF_VOCAB = [-1, -2, VOCAB, VOCAB + 1, 999999, INT32_MAX, INT32_MIN]
token_ids = st.one_of(st.integers(0, VOCAB - 1), st.sampled_from(COMMON_IDS), st.sampled_from(OUT_OF_VOCAB + [EOS, 0]))

SPECIAL_TEXT = [b"", b" ", b"Hi", b"The capital of France is", b"\x00", b"\x00" * 64, b"\xff\xfe\xfd", b"\xc3",
                b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82", "\u20ac\U0001f600".encode(), b"<|im_start|>",
                b"<|im_end|>", b"<|endoftext|>", b"\r\n\t", b"%s%n{0}", b"\\u0000", b"null", b"[]", b"{}",
                b"\xef\xbb\xbfBOM"]


def long_text(cap: int) -> st.SearchStrategy[bytes]:
    """A long string near and past `cap` bytes (ASCII, multibyte, invalid UTF-8)."""
    sizes = st.sampled_from([1000, 4000, cap - 1, cap, cap + 1, 2 * cap])
    fill = st.sampled_from([b"x", b"ab ", "\u00e9".encode(), b"\xff", b"word "])
    return st.builds(lambda n, f: (f * (n // len(f) + 1))[:n], sizes, fill)


def texts(cap: int = 64, long: bool = True) -> st.SearchStrategy[bytes]:
    """Bytes of a string input: special values, random text, random bytes; long ones rarely."""
    options = [st.sampled_from(SPECIAL_TEXT), st.text(max_size=24).map(lambda s: s.encode("utf-8", "surrogatepass")),
               st.binary(max_size=24)]
    if long:
        options.append(long_text(cap))
    return st.one_of(*options)


# ------------------------------------------------------------------------------ JSON values

json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.sampled_from(INT_EXTREMES),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12),
    st.sampled_from(["", "16", "-1", "1e9", "nan", "inf", "0x10", " 8 ", "true", "\u0000", "\ud800"]))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=12)


def cheap(v: Any) -> Any:
    """A drawn length made cheap to serve: one the server would honour past 8 tokens becomes 8 (a
    refused one stays as drawn)."""
    try:
        n = float(v.strip()) if isinstance(v, str) else v
        if not isinstance(n, bool) and isinstance(n, (int, float)) and 8 < n <= MAX_SEQ_LEN:
            return "8" if isinstance(v, str) else 8
    except (ValueError, OverflowError):
        pass
    return v


def nested(depth: int, kind: str = "list") -> str:
    return ("[" * depth + "]" * depth) if kind == "list" else ('{"a":' * depth + "1" + "}" * depth)


deep_json = st.builds(nested, st.sampled_from([8, 70, 73, 200, 5000, 100_000]), st.sampled_from(["list", "object"]))
# numbers Python's json reads as huge ints, inf, or nan
odd_json_numbers = st.sampled_from(["1e999", "-1e999", "NaN", "Infinity", "-Infinity", "9" * 400, "-" + "9" * 5000,
                                    "1" + "0" * 4300, "1.5e-400", "0.1e1", "-0"])


def escaped_quotes(n: int) -> str:
    """An unterminated JSON string of escaped quotes (issue 75: the depth scan went quadratic on it)."""
    return '"' + '\\"' * n
