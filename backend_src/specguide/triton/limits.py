"""Input caps, checked on the raw tensors before anything is decoded, parsed or tokenized.

Tokenizing a multi-megabyte `text_input` on Triton's request thread holds the tokenizer lock the
engine's detokenizer needs and stalls every stream for as long, only to refuse the prompt for its
token count. Bytes bound tokens, so a byte cap derived from `max_seq_len` refuses
it in microseconds; what passes tokenizes in a few milliseconds.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from ..guided.limits import GuideLimits
from ..models.gemma import MULTIMODAL
from ..request import InvalidRequestError, ListLimits, limit_exceeded

BIG_REQUEST_BYTES = 1 << 20  # requests past this trigger a malloc_trim once they are done with


@dataclass(frozen=True)
class InputLimits:
    """Byte caps per input (0 = no cap). Built from EngineConfig."""

    max_prompt_bytes: int = 32768  # text_input, per row (max_prompt_bytes)
    max_prompt_tokens: int = 2048  # input_ids, per row (max_seq_len)
    max_json_bytes: int = 327680  # sampling_parameters, request parameters, stop/bad words (max_sampling_parameters_bytes)
    max_guide_bytes: int = 262144  # guided_decoding_guide (guided_max_guide_bytes)
    max_json_depth: int = 72  # sampling_parameters nesting (guided_max_nesting_depth + 8)
    guide: GuideLimits = GuideLimits()  # guide bytes and nesting, checked on the tensor before parsing
    lists: ListLimits = ListLimits()  # stop strings, stop token ids, stop / bad words per request
    vocab_size: int = 0  # the model's (its config.json): every token id a client sends is below it; 0 = unknown

    @classmethod
    def from_config(cls, cfg: Any, vocab_size: int = 0) -> "InputLimits":
        depth = cfg.guided_max_nesting_depth + 8 if cfg.guided_max_nesting_depth else 0
        return cls(cfg.max_prompt_bytes, cfg.max_seq_len, cfg.max_sampling_parameters_bytes,
                   cfg.guided_max_guide_bytes, depth, GuideLimits.from_config(cfg), ListLimits.from_config(cfg),
                   vocab_size)


def model_vocab_size(model_dir: Any) -> int:
    """The model's vocabulary size as the engine reads it (config.json's `vocab_size`; a multimodal
    Gemma 3's text model's), which every token id a client sends must stay below. Not the
    tokenizer's length: the two may differ, and the engine's tables are the model's. 0 when it
    cannot be read (the engine's intake checks the ids all the same)."""
    if not model_dir:
        return 0
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        if cfg.get("model_type") in MULTIMODAL:
            cfg = cfg.get("text_config") or {}
        n = cfg.get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return 0
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 0


_refuse = limit_exceeded  # "<what> has <n> <unit>; the limit is <limit> (the setting <setting> ...)"


def _row_bytes(arr: np.ndarray) -> int:
    """The largest per-row total of a BYTES tensor [B, n] (all strings of a row together)."""
    a = np.asarray(arr, dtype=object)
    rows = a.reshape(a.shape[0], -1) if a.ndim >= 1 and a.shape[0] else a.reshape(1, -1)
    return max((sum(len(v) for v in row if isinstance(v, (bytes, str))) for row in rows), default=0)


def request_bytes(tensors: dict[str, np.ndarray]) -> int:
    """Bytes held by a request's tensors (strings counted by length)."""
    total = 0
    for arr in tensors.values():
        a = np.asarray(arr)
        total += sum(len(v) for v in a.reshape(-1) if isinstance(v, (bytes, str))) if a.dtype == object else a.nbytes
    return total


def check_inputs(tensors: dict[str, np.ndarray], raw_parameters: Optional[Any], limits: InputLimits) -> int:
    """Refuse oversized inputs by name (InvalidRequestError); returns the request's total BYTES size."""
    total = 0
    caps = {
        "text_input": (limits.max_prompt_bytes, "max_prompt_bytes", "bytes"),
        "guided_decoding_guide": (limits.max_guide_bytes, "guided_max_guide_bytes", "bytes"),
        "sampling_parameters": (limits.max_json_bytes, "max_sampling_parameters_bytes", "bytes"),
    }
    for name, arr in tensors.items():
        if np.asarray(arr).dtype != object:
            continue
        n = _row_bytes(arr)
        total += n
        limit, setting, unit = caps.get(name, (limits.max_json_bytes, "max_sampling_parameters_bytes", "bytes"))
        if limit and n > limit:
            raise _refuse(name, n, unit, limit, setting)
    ids = tensors.get("input_ids")
    if ids is not None and limits.max_prompt_tokens:
        arr = np.asarray(ids)
        n = int(arr.shape[-1]) if arr.ndim else 1
        if n >= limits.max_prompt_tokens:
            raise InvalidRequestError(f"input_ids has {n} tokens; max_seq_len is {limits.max_prompt_tokens} "
                                      f"(the prompt must leave room for at least one generated token)")
    if raw_parameters is not None and limits.max_json_bytes:
        n = len(raw_parameters) if isinstance(raw_parameters, (bytes, str)) else 0
        total += n
        if n > limits.max_json_bytes:
            raise _refuse("the request parameters", n, "bytes", limits.max_json_bytes, "max_sampling_parameters_bytes")
    return total
