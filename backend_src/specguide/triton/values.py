"""Typed access to a Triton request's tensors and parameters, and the small converters behind it:
every value a client sends is checked here, and a bad one is an InvalidRequestError naming it."""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

from ..guided.limits import check_json_text
from ..request import InvalidRequestError, ListLimits, check_token_ids
from .input_limits import InputLimits
from .responses import UnsupportedError


class Row:
    """Typed access to row b of every tensor, falling back to request parameters for scalars."""

    def __init__(self, tensors: dict[str, np.ndarray], parameters: dict[str, Any], b: int):
        self.tensors, self.parameters, self.b = tensors, parameters, b

    def values(self, name: str) -> Optional[np.ndarray]:
        arr = self.tensors.get(name)
        if arr is None:
            return None
        row = arr[self.b] if arr.ndim >= 1 and arr.shape[0] > self.b else arr
        return np.asarray(row).reshape(-1)

    def scalar(self, name: str) -> Any:
        vals = self.values(name)
        if vals is None:
            return self.parameters.get(name)
        if vals.size == 0:
            return None
        if vals.size != 1:
            raise InvalidRequestError(f"{name} must hold one value per row, got {vals.size}")
        return vals[0].item() if hasattr(vals[0], "item") else vals[0]

    def int(self, name: str) -> Optional[int]:
        return as_int(self.scalar(name), name)

    def float(self, name: str) -> Optional[float]:
        return as_float(self.scalar(name), name)

    def bool(self, name: str) -> Optional[bool]:
        return as_bool(self.scalar(name), name)

    def str(self, name: str) -> Optional[str]:
        v = self.scalar(name)
        return None if v is None else as_str(v, name)

    def strs(self, name: str) -> list[str]:
        vals = self.values(name)
        if vals is None:
            return []
        return [s for s in (as_str(v, name) for v in vals) if s]

    def word_lists(self, name: str, lists: ListLimits = ListLimits(), setting: str = "",
                   vocab_size: int = 0) -> list[list[int]]:
        """TensorRT-LLM's `[2, L]` word lists: flat token ids, then each word's end offset, increasing,
        -1 padded at the end (its preprocessing's `_to_word_list_format` pads the ids with 0 and the
        offsets with -1; TensorRT-LLM reads a word from the previous offset to its own). The count of
        words (against `lists`' cap named `setting`) and their tokens (max_word_tokens) are checked
        before any word is built, then every id against `vocab_size`: each a clear InvalidRequestError
        naming `name` and the value. One pass over the tensor."""
        arr = self.tensors.get(name)
        if arr is None:
            return []
        arr = np.asarray(arr)
        if arr.ndim == 3:
            if arr.shape[0] != 1 and arr.shape[0] <= self.b:
                raise InvalidRequestError(f"{name} has {arr.shape[0]} rows; the prompt has more")
            arr = arr[self.b if arr.shape[0] > self.b else 0]
        if arr.ndim != 2 or arr.shape[0] != 2:
            raise InvalidRequestError(f"{name} must be [2, L] per row (token ids; end offsets), got {list(arr.shape)}")
        if arr.dtype.kind not in "iu":
            raise InvalidRequestError(f"{name} must hold integers (token ids; end offsets), got {arr.dtype}")
        ids, offsets = arr[0].astype(np.int64), arr[1].astype(np.int64)
        pads = np.flatnonzero(offsets == -1)
        n = int(pads[0]) if pads.size else offsets.size  # the words: the offsets before the -1 padding
        after = offsets[n:][offsets[n:] != -1]
        if after.size:
            raise InvalidRequestError(f"{name}: offset {int(after[0])} follows a -1 (offsets are padded with -1 "
                                      f"at the end only)")
        ends = offsets[:n]
        if setting:
            lists.check(name, n, "words", setting)
        if n == 0:
            return []
        negative = ends[ends < 0]
        if negative.size:
            raise InvalidRequestError(f"{name}: offset {int(negative[0])} is negative (only -1 pads the offsets)")
        starts = np.concatenate(([0], ends[:-1]))
        unordered = np.flatnonzero(ends <= starts)
        if unordered.size:
            i = int(unordered[0])
            raise InvalidRequestError(f"{name}: offset {int(ends[i])} after {int(starts[i])} ends no word "
                                      f"(offsets increase, from 1)")
        if ends[-1] > ids.size:
            raise InvalidRequestError(f"{name}: offset {int(ends[-1])} is past the end of its {ids.size} token ids")
        used = ids[: ends[-1]]
        lists.check(name, used.size, "token ids in its words", "max_word_tokens")
        check_token_ids(used, name, vocab_size)
        flat = used.tolist()
        return [flat[s:e] for s, e in zip(starts.tolist(), ends.tolist())]


DEFAULT_JSON_DEPTH = InputLimits().max_json_depth


def parse_json_object(text: Any, what: str, max_depth: int = DEFAULT_JSON_DEPTH) -> dict[str, Any]:
    """A JSON object given as a dict or a (bytes) string, its nesting checked before parsing."""
    if isinstance(text, dict):
        return text
    if isinstance(text, bytes):
        text = as_str(text, what)
    if not isinstance(text, str):
        raise InvalidRequestError(f"{what} must be a JSON object (as a string)")
    d = check_json_text(text, what, max_depth)  # refuses deep nesting before json.loads recurses
    if not isinstance(d, dict):
        raise InvalidRequestError(f"{what} must be a JSON object")
    return d


def encode_words(words: list[str], tokenizer: Any) -> list[list[int]]:
    """Token ids of each non-empty word (stop / bad words)."""
    if not words:
        return []
    if tokenizer is None:
        raise InvalidRequestError("stop/bad words need a tokenizer")
    return [list(tokenizer.encode(w)) for w in words if w]


def check_neutral(name: str, value: Any, neutral: Any) -> None:
    """Refuse (UnsupportedError) a setting we support only at its neutral value."""
    if value is not None and value != neutral:
        raise UnsupportedError(f"{name}={value} is not supported (only {neutral})")


def json_type(v: Any) -> str:
    """The JSON name of a parsed value's type (what a client wrote), for messages."""
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(v), type(v).__name__)


def as_str(v: Any, name: str) -> str:
    """A string (bytes as UTF-8)."""
    if isinstance(v, bytes):
        try:
            return v.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidRequestError(f"{name} is not valid UTF-8") from None
    if isinstance(v, str):
        return v
    raise InvalidRequestError(f"{name} must be a string, got {json_type(v)}")


def as_int(v: Any, name: str) -> Optional[int]:
    """An integer (None stays None); numeric strings and integral floats are accepted."""
    if v is None:
        return None
    if isinstance(v, (bool, np.bool_)):
        raise InvalidRequestError(f"{name} must be an integer, got {v!r}")
    if isinstance(v, (bytes, str)):
        s = as_str(v, name).strip()
        try:
            return int(s)
        except ValueError:
            try:
                f = float(s)
            except ValueError:
                raise InvalidRequestError(f"{name} must be an integer, got {s!r}") from None
            v = f
    if isinstance(v, (float, np.floating)):
        if not math.isfinite(v) or v != int(v):
            raise InvalidRequestError(f"{name} must be an integer, got {v!r}")
        return int(v)
    try:
        return int(v)
    except (TypeError, ValueError):
        raise InvalidRequestError(f"{name} must be an integer, got {v!r}") from None


def as_float(v: Any, name: str) -> Optional[float]:
    """A number, not NaN (None stays None)."""
    if v is None:
        return None
    if isinstance(v, (bool, np.bool_)):
        raise InvalidRequestError(f"{name} must be a number, got {v!r}")
    try:
        f = float(as_str(v, name) if isinstance(v, bytes) else v)
    except (TypeError, ValueError):
        raise InvalidRequestError(f"{name} must be a number, got {v!r}") from None
    if math.isnan(f):
        raise InvalidRequestError(f"{name} must be a number, got NaN")
    return f


def as_bool(v: Any, name: str) -> Optional[bool]:
    """A boolean: true/false, 1/0, yes/no (None stays None)."""
    if v is None:
        return None
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, (bytes, str)):
        s = as_str(v, name).strip().lower()
        if s in ("true", "1", "yes"):
            return True
        if s in ("false", "0", "no", ""):
            return False
        raise InvalidRequestError(f"{name} must be a boolean, got {s!r}")
    if isinstance(v, (int, np.integer)) and v in (0, 1):
        return bool(v)
    raise InvalidRequestError(f"{name} must be a boolean, got {v!r}")


def as_list(v: Any, name: str) -> list:
    """A list (or tuple)."""
    if isinstance(v, (list, tuple)):
        return list(v)
    raise InvalidRequestError(f"{name} must be a list, got {json_type(v)}")
