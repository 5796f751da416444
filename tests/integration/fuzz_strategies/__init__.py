"""Hypothesis strategies for hostile requests (issue 75's fuzzing suite): what a client can send.

Each strategy draws a `Case`: one request to one target, cheap to serve unless the point is the size
of an input (every valid `max_tokens` is <= 8; a drawn length past that is one the server must
refuse, e.g. 8193 > max_seq_len). Targets:

- `specguide` (gRPC stream), `specguide_unary` (gRPC infer), `specguide_vllm` (gRPC stream): raw
  tensors. Names: the declared inputs of each interface (`specguide.triton.interfaces`, the one
  declaration the config.pbtxt files are generated from) and unknown ones; dtypes: the declared one
  mostly, a wrong one sometimes; shapes: [B, 1] with B in 1..3 or 64 / 65, and [1, 0], [0, 1],
  missing or extra dimensions; values: extremes (negative, huge, NaN / inf, int overflow, past the
  vocabulary), empty strings, invalid UTF-8, long strings up to and past the caps.
- `http` (Triton's HTTP `generate` / `generate_stream` of the three names): JSON bodies with the
  right keys and wrong JSON types, unknown keys, raw text that is not JSON.
- `openai_completions`, `openai_chat` (the OpenAI server): bodies with every field, odd values and
  wrong types (n, many prompts, stop lists, tools, logit_bias, response_format, guides, streams).

`sampling_parameters` JSON and guides of every type (json, json_schema, regex, ebnf_grammar,
structural_tag, choice) are drawn sane (the shipped samples: specguide/training/data/guided_samples
and jsonschemabench_dev) and hostile (deep nesting, big repetition bounds, escaped-quote runs,
invalid syntax), and go into all targets.

The package: `case.py` (Case, the targets, the stack's limits), `primitives.py` (edge values,
strings, JSON values), `guides.py`, `sampling.py` (sampling_parameters), `triton_tensors.py`,
`triton_http.py`, `openai_bodies.py` (one module per interface), `attacks.py` (the fixed cases);
`cases` draws from all of them.
"""
from __future__ import annotations

from hypothesis import strategies as st


def _pin_constants() -> None:
    """Draws that depend on the seed alone. Hypothesis mixes into its draws constants it reads from
    the project's modules loaded at the time (hypothesis.internal.conjecture.providers
    `_get_local_constants`): a run of one test file and `make test` load different modules, and every
    commit changes them, so the same seed drew different cases. Hypothesis is pinned
    (requirements-test.txt); without that function this does nothing."""
    from hypothesis.internal.conjecture import providers
    from hypothesis.internal.constants_ast import Constants

    if hasattr(providers, "_get_local_constants"):
        none = Constants()
        providers._get_local_constants = lambda: none


_pin_constants()

# the strategies, once the constants are pinned (importing any module of the package runs this first)
from .attacks import FOUND, known_attacks  # noqa: E402
from .case import (ENGINE, EOS, GUIDE_BYTES_CAP, GUIDE_TYPES, JSON_BYTES_CAP, MAX_SEQ_LEN,  # noqa: E402
                   PROMPT_BYTES_CAP, TARGETS, UNARY, VLLM, VOCAB, Case)
from .guides import SAMPLES, guides  # noqa: E402
from .openai_bodies import openai_case  # noqa: E402
from .sampling import sampling_parameters  # noqa: E402
from .triton_http import http_case  # noqa: E402
from .triton_tensors import triton_case  # noqa: E402

__all__ = ["Case", "ENGINE", "EOS", "FOUND", "GUIDE_BYTES_CAP", "GUIDE_TYPES", "JSON_BYTES_CAP", "MAX_SEQ_LEN",
           "PROMPT_BYTES_CAP", "SAMPLES", "TARGETS", "UNARY", "VLLM", "VOCAB", "cases", "guides", "http_case",
           "known_attacks", "openai_case", "sampling_parameters", "triton_case"]


def cases(targets: tuple[str, ...] = TARGETS) -> st.SearchStrategy[Case]:
    """Any hostile request to any of `targets`."""
    by = {ENGINE: triton_case(ENGINE), UNARY: triton_case(UNARY), VLLM: triton_case(VLLM), "http": http_case(),
          "openai_completions": openai_case(chat=False), "openai_chat": openai_case(chat=True)}
    return st.one_of(*[by[t] for t in targets])
