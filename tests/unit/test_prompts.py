"""The draft head's training prompts never touch the benchmarks' held-out schemas."""
import collections
import json

import pytest

from specguide.training import prompts as P


@pytest.fixture(scope="module")
def subschemas() -> list[str]:
    return P.load_subschemas()


def test_splits_are_disjoint_and_heldout_is_the_bench_half():
    train, held = P.schema_files("train"), P.schema_files("heldout")
    assert train and held and not set(train) & set(held)
    for f in held:
        assert f.parent.name in P.BENCH_SUBSETS
        assert sorted(f.parent.glob("*.json")).index(f) % 2 == 0
    assert not set(P.load_schemas("train")) & set(P.load_schemas("heldout"))
    assert not set(P.CHAT_TRAIN) & set(P.CHAT_BENCH)


def test_subschemas_are_new_self_contained_objects(subschemas):
    assert len(subschemas) > len(P.load_schemas("train"))  # more than doubles the JSON prompts
    assert len(set(subschemas)) == len(subschemas)
    train_objects = set().union(*map(P.object_schemas, P.schema_files("train")))
    held = set(P.load_schemas("heldout")).union(*map(P.object_schemas, P.schema_files("heldout")))
    whole = set(P.load_schemas("train"))
    for text in subschemas:
        s = json.loads(text)
        assert s["type"] == "object" and len(s["properties"]) >= 2
        assert '"$ref"' not in text and len(text) <= P.MAX_SCHEMA_CHARS
        assert text in train_objects and text not in held and text not in whole


def test_subschemas_prefix_is_varied(subschemas):
    # round-robin over files: a short prefix already mixes the sources
    source = {}
    for f in P.schema_files("train"):
        for t in P.object_schemas(f):
            source.setdefault(t, f.parent.name)
    for n in (40, 80):
        counts = collections.Counter(source[t] for t in subschemas[:n])
        assert len(counts) >= 4 and max(counts.values()) <= n // 2, counts


def test_subschemas_only_those_that_compile():
    class Refuses:
        def compile(self, params):
            raise ValueError("no")

    class AcceptsShort:
        def compile(self, params):
            if len(params.guide) > 300:
                raise ValueError("too long")
    assert P.load_subschemas(Refuses()) == []
    short = P.load_subschemas(AcceptsShort())
    assert short and all(len(t) <= 300 for t in short)
