"""The fuzzing suite's generators (tests/integration/fuzz_strategies/), without a server: every
target and guide type is drawn, and every length a drawn request asks for is cheap to serve (at
most 8 tokens) or one the server must refuse."""
from __future__ import annotations

import json
from collections import Counter

import numpy as np
from hypothesis import HealthCheck, Phase, find, given, settings

from tests.integration.fuzz_strategies import GUIDE_TYPES, MAX_SEQ_LEN, TARGETS, Case, cases

N = 400
DRAW = settings(max_examples=N, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
                suppress_health_check=list(HealthCheck))


def _draw() -> list[Case]:
    out: list[Case] = []

    @DRAW
    @given(cases())
    def collect(case: Case) -> None:
        out.append(case)

    collect()
    return out


CASES = _draw()


def _honoured(v) -> bool:
    """A length the server would honour: an integer (or its string) in [1, max_seq_len]."""
    try:
        n = float(v.strip()) if isinstance(v, str) else v
    except ValueError:
        return False
    return not isinstance(n, bool) and isinstance(n, (int, float)) and 1 <= n <= MAX_SEQ_LEN


def _lengths(case: Case) -> list:
    out = []
    for name in ("max_tokens", "request_output_len"):
        arr = case.tensors.get(name)
        if arr is not None and arr.dtype == np.int32:  # another dtype is refused by Triton
            out += [float(x) for x in np.asarray(arr).reshape(-1)]
    sp = case.tensors.get("sampling_parameters")
    for raw in [] if sp is None or sp.dtype != object else np.asarray(sp).reshape(-1):
        try:
            d = json.loads(raw)
        except (ValueError, RecursionError):
            continue
        if isinstance(d, dict):
            out += [d[k] for k in ("max_tokens", "max_completion_tokens") if k in d]
    if case.body:
        try:
            d = json.loads(case.body)
        except (ValueError, RecursionError, UnicodeDecodeError):
            d = None
        if isinstance(d, dict):
            out += [d[k] for k in ("max_tokens", "max_completion_tokens") if k in d]
            if case.target.startswith("openai") and any(d.get(k, 0) is None for k in ("max_tokens", "max_completion_tokens")):
                out.append(MAX_SEQ_LEN)  # null: as many as fit
            if isinstance(d.get("sampling_parameters"), str):
                try:
                    inner = json.loads(d["sampling_parameters"])
                except (ValueError, RecursionError):
                    inner = None
                if isinstance(inner, dict):
                    out += [inner[k] for k in ("max_tokens", "max_completion_tokens") if k in inner]
    return out


def _guide_type(case: Case) -> bytes | None:
    arr = case.tensors.get("guided_decoding_guide_type")
    if arr is None or arr.dtype != object or not arr.size:
        return None
    return np.asarray(arr).reshape(-1)[0]


def test_every_target_and_guide_type_is_drawn():
    targets = Counter(c.target for c in CASES)
    assert set(targets) == set(TARGETS), targets
    drawn = {_guide_type(c) for c in CASES}
    # A type the fixed sample missed must still come within a few thousand draws: the sample is one
    # seed's, and which cases it holds moves with every change to the strategies.
    for t in sorted({t.encode() for t in GUIDE_TYPES} - drawn):
        found = find(cases(), lambda c, t=t: _guide_type(c) == t,
                     settings=settings(max_examples=4000, deadline=None, derandomize=True, database=None,
                                       phases=[Phase.generate], suppress_health_check=list(HealthCheck)))
        assert _guide_type(found) == t


def test_every_length_asked_for_is_cheap_or_refused():
    costly = [(c.describe(200), v) for c in CASES for v in _lengths(c) if _honoured(v) and float(v) > 8]
    assert not costly, costly[:5]
