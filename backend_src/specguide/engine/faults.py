"""Fault injection for reliability tests: off unless the environment says SPECGUIDE_FAULT_INJECTION=1.

A request names its fault in `Request.fault` (through Triton: the request parameter
`specguide_fault`). Faults, each hitting only its own request unless said otherwise:

    nan_logits          the request's logits rows become NaN from its second token on
    matcher_error       the request's grammar matcher raises from its second token on (guided only)
    compile_delay:<s>   its grammar "compiles" for at least <s> seconds (guided only)
    prefill_delay:<s>   each of its prefill chunks takes at least <s> seconds longer
    crash_engine        the engine loop itself raises: the whole engine dies (the crash path)
    step_error          every decode step whose batch holds the request raises, from its second token
                        on, an exception that names no request (as an out-of-vocabulary bad word's
                        IndexError did): the engine must find the request by running the rows apart
    stall_engine:<s>    the engine loop blocks for <s> seconds as it takes the request (the watchdog,
                        `engine_stall_s`, restarts such an engine)

The engine calls one `Injector` (one method per hook); `Injector()` does nothing, and the engine's,
`injector()`, is switched on by the environment, read as each request arrives.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..request import InvalidRequestError

ENV = "SPECGUIDE_FAULT_INJECTION"
KINDS = ("nan_logits", "matcher_error", "compile_delay", "prefill_delay", "crash_engine", "step_error",
         "stall_engine")


def enabled() -> bool:
    """Whether the environment turns fault injection on."""
    return os.environ.get(ENV, "") in ("1", "true", "yes")


@dataclass(frozen=True)
class Fault:
    """One request's injected fault."""

    kind: str
    seconds: float = 0.0


class InjectedFault(RuntimeError):
    """Raised by an injected fault."""


class InjectedStepError(InjectedFault):
    """A `step_error` fault: the whole step raises, naming no request."""


def _parse(text: str) -> Fault:
    kind, _, arg = str(text).partition(":")
    if kind not in KINDS:
        raise InvalidRequestError(f"unknown fault {kind!r} (one of {', '.join(KINDS)})")
    try:
        return Fault(kind, float(arg) if arg else 0.0)
    except ValueError:
        raise InvalidRequestError(f"fault {text!r}: bad seconds") from None


def parse(text: Optional[str]) -> Optional[Fault]:
    """`kind` or `kind:<seconds>`; None when absent or when injection is off."""
    return _parse(text) if text and enabled() else None


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


def _kind(seq: Any, kind: str) -> Optional[Fault]:
    f = getattr(seq, "fault", None)
    return f if f is not None and f.kind == kind else None


class Injector:
    """The engine's fault hooks, one method per site. A request gets a fault only while `switch()`
    is true as it arrives (the default: never, so every hook does nothing); the other hooks act
    only on requests that have one."""

    def __init__(self, switch: Callable[[], bool] = lambda: False):
        self._switch = switch

    @property
    def active(self) -> bool:
        """Whether requests may name faults now."""
        return self._switch()

    def parse(self, text: Optional[str]) -> Optional[Fault]:
        """The request's fault (None when it names none or injection is off); a bad name raises
        InvalidRequestError."""
        return _parse(text) if text and self.active else None

    def checked(self, text: Optional[str]) -> Optional[str]:
        """The fault text to carry on a request (checked now, so a bad name is INVALID_ARG early)."""
        return text if self.parse(text) is not None else None

    def on_submit(self, seq: Any) -> None:
        """`crash_engine`: the loop raises as it takes the request; `stall_engine`: it blocks."""
        if _kind(seq, "crash_engine"):
            raise InjectedFault("injected engine crash")
        f = _kind(seq, "stall_engine")
        if f is not None:
            time.sleep(f.seconds)

    def holds_compile(self, seq: Any) -> bool:
        """`compile_delay`: True while the request's compiled grammar must not be used yet."""
        f = _kind(seq, "compile_delay")
        return f is not None and time.monotonic() < seq.stats.arrival + f.seconds

    def before_prefill(self, seq: Any) -> None:
        """`prefill_delay`: sleep before each prefill chunk."""
        f = _kind(seq, "prefill_delay")
        if f is not None:
            time.sleep(f.seconds)

    def after_append(self, seq: Any, guided: Any) -> None:
        """`matcher_error`: the request's grammar matcher raises from now on (guided requests)."""
        if _kind(seq, "matcher_error") and seq.guide.grammar is not None:
            getattr(guided, "synchronize", lambda: None)()  # no callback of the step still running
            getattr(guided, "inner", guided).matchers[seq.slot] = FaultyMatcher()

    def poison(self, logits: Any, seqs: list) -> None:
        """The step's logits hook (only steps holding a request with a fault call it): `nan_logits`
        NaNs the logits rows ([B, V] or [B, T, V]) of faulty requests past their first token;
        `step_error` makes the whole step raise past the request's first token."""
        if self.active:
            poison(logits, seqs)
            if any(_kind(s, "step_error") and s.output_ids for s in seqs):
                raise InjectedStepError("injected step fault")


def injector() -> Injector:
    """The engine's injector: on while SPECGUIDE_FAULT_INJECTION=1 (read per request)."""
    return Injector(enabled)
