"""Triton's HTTP `generate` / `generate_stream` of the three served names (`http_case`): JSON bodies
with the right keys and wrong JSON types, unknown keys, raw text that is not JSON."""
from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

from specguide.triton.interfaces import INTERFACES

from .case import ENGINE, UNARY, VLLM, Case
from .primitives import cheap, json_values, lengths, nested
from .sampling import sampling_parameters
from .triton_tensors import UNKNOWN_NAMES, row_values

@st.composite
def http_case(draw) -> Case:
    """Triton's HTTP generate / generate_stream: JSON values per key (right and wrong types), raw text."""
    model = draw(st.sampled_from([ENGINE, UNARY, VLLM]))
    specs = {s.name: s for s in INTERFACES[model].inputs}
    stream = model != UNARY and draw(st.booleans())
    path = f"/v2/models/{model}/{'generate_stream' if stream else 'generate'}"
    if draw(st.integers(0, 9)) == 0:
        body = draw(st.one_of(st.sampled_from([b"", b"{", b"[]", b"null", b'{"text_input": }', b"\xff\xfe",
                                               nested(100_000).encode(), b'{"text_input": "a", "text_input": "b"}']),
                              st.binary(max_size=32)))
        return Case("http", path=path, body=body, stream=stream)
    d: dict[str, Any] = {"text_input": draw(st.one_of(st.sampled_from(["Hi", "The capital of France is", ""]),
                                                      st.text(max_size=24), json_values))}
    if model == VLLM:
        d["sampling_parameters"] = draw(sampling_parameters()).decode("utf-8", "replace")
    else:
        d["max_tokens"] = cheap(draw(st.one_of(lengths, json_values)))
    for name in draw(st.lists(st.sampled_from(sorted(specs) + list(UNKNOWN_NAMES)), max_size=4, unique=True)):
        spec = specs.get(name)
        if spec is None:
            d[name] = draw(json_values)
            continue
        right = draw(row_values(name, spec))
        right = [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in right]
        value = right[0] if spec.dims == (1,) and len(right) == 1 else right
        d[name] = draw(st.one_of(st.just(value), st.just(value), json_values))
    text = json.dumps(d, allow_nan=True)
    return Case("http", path=path, body=text.encode("utf-8", "surrogatepass"), stream=stream)
