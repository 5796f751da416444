"""`json_depth`: the nesting scan that runs on raw client text (guides, sampling_parameters) before
anything parses it, on the stub's request thread with the GIL held. It must be right about strings
(brackets inside them do not count) and linear in its input: a quadratic scan of a 48 KB run of
escaped quotes froze every stream of the server for 7 s (issue 75)."""
from __future__ import annotations

import json

import pytest

from specguide.guided.limits import json_depth


@pytest.mark.parametrize("text, depth", [
    ("", 0),
    ("1", 0),
    ("[]", 1),
    ('{"a": [[1], {"b": []}]}', 4),
    ('{"a": "[[[[", "b": [[1]]}', 3),  # brackets inside strings do not count
    (r'{"a": "\"[[[\"", "b": [1]}', 2),  # nor inside strings with escaped quotes
    (r'["\\", [[]]]', 3),  # an escaped backslash ends before the quote that closes the string
    ('[[["unterminated [[[[', 3),  # an unterminated string runs to the end
    ("]]]][[", 0),  # stray closers cannot make the depth negative
    ('{"é": ["ü"]}', 2),
])
def test_depth_skips_strings(text, depth):
    assert json_depth(text) == depth


def _depth(doc) -> int:
    if isinstance(doc, dict):
        return 1 + max(map(_depth, doc.values()), default=0)
    if isinstance(doc, list):
        return 1 + max(map(_depth, doc), default=0)
    return 0


@pytest.mark.parametrize("levels", [1, 7, 64, 300])
def test_depth_of_nested_documents_matches_their_structure(levels):
    doc = "x"
    for i in range(levels):
        doc = [doc, {"k]": "v[\\"}] if i % 2 else {"a": doc, "[": "{\""}
    assert json_depth(json.dumps(doc)) == _depth(doc)
    assert json_depth(json.dumps(doc, indent=1)) == _depth(doc)


@pytest.mark.timeout(60)
def test_a_run_of_escaped_quotes_is_scanned_in_one_pass():
    # 8 MB: the quadratic scan took 0.76 s at 16 KB and 7 s at 48 KB, so hours here; one pass takes
    # milliseconds. The timeout only stops a regression from hanging the suite.
    attack = '"' + '\\"' * (4 << 20)
    assert json_depth(attack) == 0
    assert json_depth("[" + attack) == 1
    assert json_depth('{"a": [' + attack[:-1] + '"]}') == 2
