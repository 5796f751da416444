"""Fault injection for reliability tests: off unless the environment says SPECGUIDE_FAULT_INJECTION=1.

A request names its fault in `Request.fault` (through Triton: the request parameter
`specguide_fault`). Faults, each hitting only its own request unless said otherwise:

    nan_logits          the request's logits rows become NaN from its second token on
    matcher_error       the request's grammar matcher raises from its second token on (guided only)
    compile_delay:<s>   its grammar "compiles" for at least <s> seconds (guided only)
    prefill_delay:<s>   each of its prefill chunks takes at least <s> seconds longer
    crash_engine        the engine loop itself raises: the whole engine dies (the crash path)
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

from .request import InvalidRequestError

ENV = "SPECGUIDE_FAULT_INJECTION"
KINDS = ("nan_logits", "matcher_error", "compile_delay", "prefill_delay", "crash_engine")


def enabled() -> bool:
    return os.environ.get(ENV, "") in ("1", "true", "yes")


@dataclass(frozen=True)
class Fault:
    kind: str
    seconds: float = 0.0


class InjectedFault(RuntimeError):
    """Raised by an injected fault."""


def parse(text: Optional[str]) -> Optional[Fault]:
    """`kind` or `kind:<seconds>`; None when absent or when injection is off."""
    if not text or not enabled():
        return None
    kind, _, arg = str(text).partition(":")
    if kind not in KINDS:
        raise InvalidRequestError(f"unknown fault {kind!r} (one of {', '.join(KINDS)})")
    try:
        return Fault(kind, float(arg) if arg else 0.0)
    except ValueError:
        raise InvalidRequestError(f"fault {text!r}: bad seconds") from None


class FaultyMatcher:
    """Stands in for a broken xgrammar GrammarMatcher: every use raises (xgrammar's batched calls
    reject it too, as they would fail on a broken matcher)."""

    def __getattr__(self, name: str) -> Any:
        raise InjectedFault("injected matcher fault")


def poison(logits: Any, seqs: list) -> None:
    """NaN the logits rows ([B, V] or [B, T, V]) of requests with a `nan_logits` fault past their first token."""
    for b, seq in enumerate(seqs):
        f = getattr(seq, "fault", None)
        if f is not None and f.kind == "nan_logits" and seq.output_ids:
            logits[b] = float("nan")
