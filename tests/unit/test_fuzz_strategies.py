"""The fuzzing suite's generators (tests/integration/fuzz_strategies.py), without a server: every
target and guide type is drawn, and every length a drawn request asks for is cheap to serve (at
most 8 tokens) or one the server must refuse."""
from __future__ import annotations

import json
from collections import Counter

import numpy as np
from hypothesis import HealthCheck, Phase, given, settings

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


def test_every_target_and_guide_type_is_drawn():
    targets = Counter(c.target for c in CASES)
    assert set(targets) == set(TARGETS), targets
    types = Counter(np.asarray(c.tensors["guided_decoding_guide_type"]).reshape(-1)[0]
                    for c in CASES if "guided_decoding_guide_type" in c.tensors
                    and c.tensors["guided_decoding_guide_type"].dtype == object
                    and c.tensors["guided_decoding_guide_type"].size)
    assert {t.encode() for t in GUIDE_TYPES} <= set(types), types


def test_every_length_asked_for_is_cheap_or_refused():
    costly = [(c.describe(200), v) for c in CASES for v in _lengths(c) if _honoured(v) and float(v) > 8]
    assert not costly, costly[:5]
