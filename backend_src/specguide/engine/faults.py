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

A `FaultInjector` installed on a built EngineCore injects them by wrapping a few of its parts'
methods (instance attributes; `remove` puts them back): the engine's own code has no fault branch.
The engine process installs one when the environment enables injection as it starts; a test may
install one on an engine it built. A request names a fault only while the environment enables
injection as the request arrives.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from ..request import InvalidRequestError

if TYPE_CHECKING:
    from .core import EngineCore

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
    """Raised by an injected fault; its words reach the client (the engine's error detail)."""

    client_readable = True


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
    """`kind` or `kind:<seconds>`; None when absent or when injection is off. A bad name raises
    InvalidRequestError."""
    return _parse(text) if text and enabled() else None


def checked(text: Optional[str]) -> Optional[str]:
    """The fault text to carry on a request (checked now, so that a bad name is INVALID_ARG at
    intake); None when absent or when injection is off."""
    return text if parse(text) is not None else None


class FaultyMatcher:
    """Stands in for a broken xgrammar GrammarMatcher: every use raises (xgrammar's batched calls
    reject it too, as they would fail on a broken matcher)."""

    def __getattr__(self, name: str) -> Any:
        raise InjectedFault("injected matcher fault")


class FaultInjector:
    """Injects each request's fault into `core` (see the module's list): `install` wraps intake
    (which requests have one; compiles held back), the loop's `add` (crash, stall), the runner's
    prefill (delay) and step (the batch), the step's LM head (NaN rows, a raising step) and the
    output processor's append (a broken matcher). Requests are matched to their fault by id."""

    def __init__(self, core: "EngineCore", switch: Callable[[], bool] = enabled):
        self.core, self._switch = core, switch
        self.faults: dict[int, Fault] = {}  # seq_id -> its fault, while it runs
        self._batch: list = []  # the decode step's sequences, while it runs (row b = _batch[b])
        self._saved: list[tuple[Any, str, Any]] = []

    def install(self) -> "FaultInjector":
        c = self.core
        for obj, name, hook in ((c.intake, "sequence", self._sequence), (c.intake, "poll_compiles", self._poll_compiles),
                                (c, "add", self._add), (c, "finish", self._finish),
                                (c.runner, "prefill", self._prefill), (c.runner, "step", self._step),
                                (c.runner.core, "logits", self._logits), (c.outputs, "append", self._append)):
            self._saved.append((obj, name, vars(obj).get(name)))
            setattr(obj, name, _wrapped(getattr(obj, name), hook))
        return self

    def remove(self) -> None:
        """Put every wrapped method back."""
        for obj, name, own in reversed(self._saved):
            if own is None:
                delattr(obj, name)
            else:
                setattr(obj, name, own)
        self._saved.clear()

    def of(self, seq: Any, kind: str) -> Optional[Fault]:
        f = self.faults.get(seq.seq_id)
        return f if f is not None and f.kind == kind else None

    # ---- hooks: each gets the wrapped method first ------------------------------------------
    def _sequence(self, inner: Callable, request: Any, callback: Any) -> Any:
        fault = _parse(request.fault) if request.fault and self._switch() else None
        seq = inner(request, callback)
        if fault is not None:
            self.faults[seq.seq_id] = fault
        return seq

    def _poll_compiles(self, inner: Callable, waiting: Any) -> Any:
        """`compile_delay`: the request's compiled grammar is not taken before its time."""
        now = time.monotonic()
        held = lambda s: (f := self.of(s, "compile_delay")) is not None and now < s.stats.arrival + f.seconds  # noqa: E731
        return inner([s for s in waiting if not held(s)])

    def _add(self, inner: Callable, seq: Any) -> None:
        """`crash_engine`: the loop raises as it takes the request; `stall_engine`: it blocks.
        (The request is in the core's hands first: the dying loop fails it with the others.)"""
        inner(seq)
        if self.of(seq, "crash_engine"):
            raise InjectedFault("injected engine crash")
        if (f := self.of(seq, "stall_engine")) is not None:
            time.sleep(f.seconds)

    def _finish(self, inner: Callable, seq: Any, *args: Any, **kw: Any) -> None:
        inner(seq, *args, **kw)
        self.faults.pop(seq.seq_id, None)

    def _prefill(self, inner: Callable, chunk: Any, *args: Any) -> Any:
        """`prefill_delay`: sleep before each prefill chunk (its output, where its forward ran in the step's)."""
        if (f := self.of(chunk.seq, "prefill_delay")) is not None:
            time.sleep(f.seconds)
        return inner(chunk, *args)

    def _step(self, inner: Callable, seqs: list, plan: Any, *args: Any) -> Any:
        self._batch = seqs
        try:
            return inner(seqs, plan, *args)
        finally:
            self._batch = []

    def _logits(self, inner: Callable, key: Any, hidden: Any) -> Any:
        """The decode step's logits [B, T, V]: `nan_logits` NaNs its request's row past its first
        token; `step_error` makes the whole step raise past its request's first token."""
        logits = inner(key, hidden)
        for b, seq in enumerate(self._batch):
            if seq.output_ids and self.of(seq, "step_error"):
                raise InjectedStepError("injected step fault")
            if seq.output_ids and self.of(seq, "nan_logits"):
                logits[b] = float("nan")
        return logits

    def _append(self, inner: Callable, seq: Any, tokens: list[int]) -> Any:
        """`matcher_error`: once its tokens are appended, the request's grammar matcher raises."""
        end = inner(seq, tokens)
        if end is None and self.of(seq, "matcher_error") and seq.guide.grammar is not None:
            guided = self.core.guided
            guided.synchronize()  # no callback of the step still running
            guided.inner.matchers[seq.slot] = FaultyMatcher()
        return end


def _wrapped(inner: Callable, hook: Callable) -> Callable:
    return lambda *args, **kw: hook(inner, *args, **kw)
