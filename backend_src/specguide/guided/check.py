"""Why did my guide reject this? Compile JSON schemas and walk instances through the engine's own
grammar code (the GuidedDecoder's backend matchers), token by token, then EOS.

Input lines are MaskBench cases: `{"schema": ..., "tests": [{"data": ..., "valid": bool}, ...]}`.
Each instance is checked in two forms: `compact` (`{"a":1}`) and `spaced` (`json.dumps` spacing).
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional

import numpy as np
import torch

from ..request import GuidedDecodingParams, InvalidRequestError
from .backend import CompiledGuide
from .compiler import GrammarCompilerService

FORMS: dict[str, Callable[[Any], str]] = {
    "compact": lambda v: json.dumps(v, separators=(",", ":"), ensure_ascii=False),
    "spaced": lambda v: json.dumps(v, ensure_ascii=False),
}


@dataclass
class Walk:
    """One instance in one form: accepted = every token and then EOS accepted."""

    valid: bool
    accepted: bool
    rejected_at: Optional[int]  # token index of the first rejected token (len = EOS); None if accepted


@dataclass
class CaseResult:
    """One output line of `check`."""

    id: Any
    backend: str
    compiled: bool
    error: Optional[str]
    compile_ms: float
    mask_us_p50: Optional[float] = None
    mask_us_p99: Optional[float] = None
    tests: list[dict[str, dict]] = field(default_factory=list)  # [{form: Walk}] per instance
    extra: dict = field(default_factory=dict)  # the input line's other keys

    def to_json(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k != "extra"}
        return {**self.extra, **out}

    @property
    def passing(self) -> bool:
        """Compiled, and every instance in every form accepted exactly when valid."""
        return self.compiled and all(w["accepted"] == w["valid"] for t in self.tests for w in t.values())

    @property
    def invalid_accepted(self) -> int:
        return sum(1 for t in self.tests for w in t.values() if w["accepted"] and not w["valid"])

    @property
    def valid_rejected(self) -> int:
        return sum(1 for t in self.tests for w in t.values() if w["valid"] and not w["accepted"])


def walk(guide: CompiledGuide, tokens: list[int], stop_id: int, bitmask: torch.Tensor,
         mask_us: Optional[list[float]] = None) -> Optional[int]:
    """Feed tokens then `stop_id` to a fresh matcher; the index of the first rejected one, or None.
    With `mask_us`, each step's mask fill is timed (the work a decode step pays)."""
    m = guide.matcher()
    for i, t in enumerate(tokens + [stop_id]):
        if mask_us is not None and not m.is_terminated():
            t0 = time.perf_counter()
            m.fill(bitmask, 0)
            mask_us.append((time.perf_counter() - t0) * 1e6)
        if not m.accept(t):
            return i
    return None if m.is_terminated() else len(tokens) + 1


def check_case(service: GrammarCompilerService, encode: Callable[[str], list[int]], case: dict, case_id: Any,
               backend: str = "", timeout_s: float = 30.0, params: Optional[dict] = None) -> CaseResult:
    """Compile one case's schema on `backend` ('' = the service default) and walk its tests."""
    extra = {k: v for k, v in case.items() if k not in ("schema", "tests", "id")}
    guide = GuidedDecodingParams("json_schema", json.dumps(case["schema"]), backend=backend, **(params or {}))
    t0 = time.perf_counter()
    name = backend or service.default_backend
    try:
        name = service.backend_for(guide)
        compiled = service.submit(guide, timeout_s=timeout_s).result()
    except InvalidRequestError as e:
        return CaseResult(case_id, name, False, str(e), (time.perf_counter() - t0) * 1e3, extra=extra)
    except Exception as e:  # noqa: BLE001 - a crashing compile is reported, the run goes on
        return CaseResult(case_id, name, False, f"{type(e).__name__}: {e}", (time.perf_counter() - t0) * 1e3, extra=extra)
    compile_ms = (time.perf_counter() - t0) * 1e3
    bitmask = torch.full((1, (service.vocab_size + 31) // 32), -1, dtype=torch.int32)
    stop_id = service.stop_token_ids[0]
    mask_us: list[float] = []
    tests = []
    for test in case.get("tests", []):
        row = {}
        for form, dump in FORMS.items():
            at = walk(compiled, encode(dump(test["data"])), stop_id, bitmask, mask_us)
            row[form] = asdict(Walk(bool(test["valid"]), at is None, at))
        tests.append(row)
    p50, p99 = (float(np.percentile(mask_us, 50)), float(np.percentile(mask_us, 99))) if mask_us else (None, None)
    return CaseResult(case_id, compiled.backend, True, None, compile_ms, p50, p99, tests, extra)


def check_lines(service: GrammarCompilerService, encode: Callable[[str], list[int]], lines: Iterable[str],
                backend: str = "", timeout_s: float = 30.0) -> Iterator[CaseResult]:
    """One CaseResult per non-empty JSONL line (id: the line's `id`, else its 1-based line number)."""
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            case = json.loads(line)
            assert isinstance(case, dict) and "schema" in case, "a case is an object with a 'schema'"
        except (ValueError, AssertionError) as e:
            yield CaseResult(n, backend or service.default_backend, False, f"bad input line: {e}", 0.0)
            continue
        yield check_case(service, encode, case, case.get("id", n), backend, timeout_s)
